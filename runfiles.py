"""What a run writes and what resume, `--prior-from` and the reports read back, in one place: the one writer (a file
appears whole or not at all), the one reader and the schemas checked before any value is used: the run folder and its
lock, ckpt.pt's container, result.json, metrics.jsonl and prior.pt."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import pickle
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import torch

import inits
import maskprior as mp

try:
    import fcntl
except ImportError:             # not on POSIX: run folders are not locked
    fcntl = None


class UsageError(ValueError):
    """Bad input (a flag, a file, a folder): train.py prints the message as one line and exits with `status`."""
    status = 2


def one_line(text) -> str:
    """`text` on one line, as every refusal is printed: an unprintable character (a newline in a path) as its escape."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


def cut(text, most: int = 40) -> str:
    """`text` as a message quotes it: repr, cut to `most` characters (a 5,000-digit index is not echoed whole)."""
    text = str(text)
    return repr(text) if len(text) <= most else repr(text[:most]) + f"... ({len(text):,} characters)"


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:200] if str(e) else ""


class BusyError(UsageError):
    """A run folder in use by another process: exit status 75 (EX_TEMPFAIL: try again later)."""
    status = 75


# ---- the one writer: a file this program writes is made new by this process (O_CREAT | O_EXCL, never through a
# link) and renamed into place, or appended to only where it is provably this process's own (`append_own`)

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """A binary file that appears at `path` only if the `with` body completes: a temporary file made new in the same
    folder (O_CREAT | O_EXCL | O_NOFOLLOW), flushed to disk, then renamed over `path`; a name that was there (a
    file, a link to a user's file) is replaced, never written through. `dir_fd`: `path` is a name in that folder."""
    path = Path(path)
    where = (lambda name: name) if dir_fd is not None else (lambda name: path.parent / name)
    tmp, fd = None, -1
    for _ in range(100):
        tmp = f".{path.name}.{os.urandom(6).hex()}.tmp"
        try:
            fd = os.open(where(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o666 & ~umask(), dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
        except OSError as e:
            e.filename = e.filename or str(path)
            raise
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(where(tmp), where(path.name), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(where(tmp), dir_fd=dir_fd)
        if isinstance(e, OSError) and not e.filename:
            e.filename = str(path)                # a full disk names the file it could not write
        raise


def partial_writes(folder: str | os.PathLike, dir_fd: int | None = None) -> Iterator[tuple[str, str]]:
    """(temporary file, the file it was writing) for each temporary file an `atomic_output` killed mid-write left
    in `folder` (named ``.<name>.<random characters>.tmp``; names in the open folder `dir_fd` where given)."""
    for entry in os.listdir(folder if dir_fd is None else dir_fd):
        m = re.fullmatch(r"\.(.+)\.[a-z0-9_]+\.tmp", entry)
        if m:
            yield entry if dir_fd is not None else os.path.join(folder, entry), m.group(1)


def umask() -> int:
    """The process's umask (read without changing it): the mode a new file gets."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, data: bytes | str, dir_fd: int | None = None) -> None:
    with atomic_output(path, dir_fd) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def own_problem(info: os.stat_result, inode: int | None = None) -> str | None:
    """Why an opened file is not provably this process's own to append to: not a regular file, more than one link
    (a hard link to someone's file), another user's, or another inode than the one recorded; None where it is."""
    return ("is not a regular file" if not stat.S_ISREG(info.st_mode)
            else f"has {info.st_nlink} links (one may be a user's file)" if info.st_nlink != 1
            else "belongs to another user" if hasattr(os, "getuid") and info.st_uid != os.getuid()
            else "is another file than the one this run made" if inode is not None and info.st_ino != inode else None)


def append_own(path: str | os.PathLike, data: bytes, inode: int | None = None, dir_fd: int | None = None) -> int:
    """Append `data` to `path` by single write() calls where it is provably this process's own (`own_problem`, on the
    descriptor opened without following a link or blocking); else an OSError (EPERM). Returns its inode."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        problem = own_problem(info, inode)
        if problem:
            raise OSError(errno.EPERM, f"{path} {problem}: not written", str(path))
        os.set_blocking(fd, True)
        while data:
            data = data[os.write(fd, data):]
        return info.st_ino
    except OSError as e:
        e.filename = e.filename or str(path)
        raise
    finally:
        os.close(fd)


def output_folder(path: str, who: str, suffixes: tuple = (".md", ".csv", ".png")) -> str:
    """The folder a command writes into, checked before any work: made where missing (with the folders above it),
    writable (a file made there new, then removed), no output name (`suffixes`) taken by other than a regular file, a
    killed write's temporary outputs removed; else one line, the folders it made removed."""
    made, fd = missing_folders(os.path.abspath(path)), None
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        probe = f".write-check.{os.urandom(6).hex()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=fd))
        os.unlink(probe, dir_fd=fd)
        taken = sorted(e.name for e in os.scandir(fd) if e.name.endswith(suffixes)
                       and not e.is_file(follow_symlinks=False))
        if not taken:
            for tmp, name in partial_writes(path, fd):
                if name.endswith(suffixes):
                    os.remove(tmp, dir_fd=fd)
            return path
        problem = (f"{who}: {os.path.join(path, taken[0])} is not a regular file, and the output written there "
                   "would replace it: move it away, or give another folder; nothing was written")
    except OSError as e:
        problem = (f"{who}: cannot write into {path} ({e.strerror or e}): give a folder you can write; nothing was "
                   "written")
    finally:
        if fd is not None:
            os.close(fd)
    for folder in made:
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    raise UsageError(problem)


# ---- the one reader of every file a run reads back (its checkpoint, prior and log on resume, a teacher's checkpoint,
# result.json and args.json in reports), read as someone else's file: bytes of a regular file within a size limit; a
# torch file loaded with weights_only=True (nothing it names is called), JSON as JSON. Its schema is the caller's.

class ReadError(UsageError):
    """A file read back that is not what this program writes there (missing, not a regular file, too large...)."""


MiB = 1 << 20
READ_LIMITS = {"checkpoint": 8192 * MiB, "prior": 2048 * MiB, "log": 1024 * MiB, "json": 64 * MiB, "table": 64 * MiB}


def open_back(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading in binary, a regular file: opened without blocking (a FIFO or device never blocks
    the open), then checked on its descriptor (a symlink followed, its target checked), never by a look at the path
    first. Every file read goes through here (`read_back`: a whole file within a size limit; data readers stream)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ReadError(f"{path} is missing") from None
    except OSError as e:
        raise ReadError(f"cannot read {path} ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a folder" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise ReadError(f"{path} is {kind}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_back(path: str | os.PathLike, kind: str) -> bytes:
    """The bytes of `path` (`open_back`: a regular file) when it holds at most READ_LIMITS[kind] bytes."""
    limit = READ_LIMITS[kind]
    with open_back(path) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ReadError(f"cannot read {path} ({e.strerror or e})") from None
    if len(data) > limit:
        raise ReadError(f"{path} holds more than {limit // MiB} MiB, more than any {kind} this program writes")
    return data


def load_torch(data: bytes, path: str | os.PathLike):
    """torch.load of bytes read back, weights_only=True (tensors, numbers, strings and containers; a pickle that
    names anything else is refused before it is called), torch's own warnings kept out of the one line."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f"it names {named.group(1)}" if named else next(
            (line.strip()[:160] for line in str(e).splitlines()[1:] if line.strip()), "an unsupported pickle")
        raise ReadError(f"{path} holds more than tensors and plain values ({what}), which no file of this program "
                        "holds and which would run code if unpickled; it was not run") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is one line
        raise ReadError(f"{path} is not a torch file ({type(e).__name__}: {first_line(e)})") from None


JSON_MAX_DEPTH, JSON_MAX_DIGITS = 64, 40        # deeper than anything this program writes; an int past any count


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > JSON_MAX_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-')):,} digits (at most {JSON_MAX_DIGITS})")
    return int(text)


def _json_float(text: str) -> float:
    v = float(text)
    if math.isinf(v):
        raise ValueError(f"{text[:40]!r} overflows a float")
    return v


def _json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON bytes (brackets inside strings not counted)."""
    depth = deepest = 0
    for token in re.finditer(rb'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', data):
        t = token.group()
        if t in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif t in (b"]", b"}"):
            depth -= 1
    return deepest


def load_json(data: bytes, path: str | os.PathLike):
    """JSON of bytes read back (UTF-8), bounded before it is parsed: at most JSON_MAX_DEPTH levels of nesting,
    integers of at most JSON_MAX_DIGITS digits, no number that overflows a float; anything else is a ReadError."""
    try:
        if _json_depth(data) > JSON_MAX_DEPTH:
            raise ValueError(f"nested more than {JSON_MAX_DEPTH} levels deep")
        return json.loads(data.decode("utf-8"), parse_int=_json_int, parse_float=_json_float)
    except ValueError as e:                         # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ReadError(f"{path} is not JSON as this program writes it ({first_line(e)})") from None


def read_json(path: str | os.PathLike):
    return load_json(read_back(path, "json"), path)


# ---- schemas: key -> (check, what it must be), checked on what is read back before any value is used

def is_finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_share(v) -> bool:
    return is_finite(v) and 0 <= v <= 1


def is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_optional(check):
    return lambda v: v is None or check(v)


def is_of(kind):
    return lambda v: isinstance(v, kind) and (kind is bool or not isinstance(v, bool))


def is_list_of(check):
    return lambda v: isinstance(v, list) and all(map(check, v))


def is_plain_tensor(t) -> bool:
    """A tensor as this program saves one: strided (not sparse), on the CPU (not meta: it holds its values), not
    recording a gradient, and finite where floating (no non-finite state is ever saved)."""
    return (isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu" and not t.is_meta
            and not t.requires_grad and (not t.is_floating_point() or bool(torch.isfinite(t).all())))


def is_named_tensors(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and is_plain_tensor(t) for k, t in v.items())


def schema_problem(obj, schema: dict, required) -> str | None:
    """What in `obj` (a dict read back) breaks `schema` (key -> (check, what it must be)): not a dict, a `required` key
    absent, or the first value failing its check; else None. It follows the file's name (" has no step")."""
    if not isinstance(obj, dict):
        return f" holds a {type(obj).__name__}, not the dict this program writes there"
    missing = [key for key in required if key not in obj]
    bad = [key for key, (ok, _) in schema.items() if key in obj and not ok(obj[key])][:1]
    return (f" has no {missing[0]}" if missing else
            f": {bad[0]} is {_short(obj[bad[0]])}, not {schema[bad[0]][1]}" if bad else None)


def check_schema(obj, schema: dict, required, path) -> dict:
    problem = schema_problem(obj, schema, required)
    if problem:
        raise ReadError(f"{path}{problem}")
    return obj


# ---- bounds of the numbers read back: what every schema below checks a value against

MAX_STEP = 2 ** 53               # past any run's steps: every step a float holds exactly
MAX_LAYERS = 1024                # more layers than any model this program builds
MAX_VALUE = 1e100                # past any metric, loss or drift; a report's sums and squares of them stay finite
MAX_METRICS = 256                # metrics in one log step: more than any task measures


def is_value(v) -> bool:
    return is_finite(v) and abs(v) <= MAX_VALUE


def is_measure(v) -> bool:
    """A number a log step measured: a value (`is_value`), or NaN (nothing there to measure: an empty set of points)."""
    return is_value(v) or isinstance(v, float) and math.isnan(v)


def is_step(v) -> bool:
    return is_count(v) and v <= MAX_STEP


MASS_SLACK = 0.01                # a share measured in low precision (--amp) may pass 1 by as much


def is_mass(v) -> bool:
    return is_finite(v) and -MASS_SLACK <= v <= 1 + MASS_SLACK


def is_layers(check, least: int = 1):
    return lambda v: isinstance(v, list) and least <= len(v) <= MAX_LAYERS and all(map(check, v))


def is_metrics(v, check=is_optional(is_measure)) -> bool:
    return isinstance(v, dict) and len(v) <= MAX_METRICS and all(
        isinstance(k, str) and len(k) <= 64 and check(x) for k, x in v.items())


# result.json as train.py writes it: key -> (check, what it must be); the RESULT_REQUIRED keys are in every one (a
# run of an earlier version lacks some: reports list it).

def is_name(v) -> bool:
    """A task, init or preset name: lower-case letters, digits, '-' and '_' (nothing a report reads as markdown)."""
    return isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,39}", v) is not None


KINDS = ("boolean", "arithmetic", "vision", "lm")      # the task families a result belongs to

INITS = tuple(inits.INITS)      # the inits' names, in their records' order

RESULT_SCHEMA = {
    "task": (is_name, "a task name"), "init": (lambda v: v in INITS, f"one of {', '.join(INITS)}"),
    "seed": (lambda v: is_count(v) and v < 2 ** 32, "a seed in 0 .. 2^32 - 1"),
    "metrics": (lambda v: is_metrics(v, is_optional(is_value)),
                f"a dict of at most {MAX_METRICS} finite numbers within +-{MAX_VALUE:g} (or null)"),
    "kind": (lambda v: v in KINDS, f"one of {', '.join(KINDS)}"), "preset": (is_name, "a preset name"),
    "run_id": (is_optional(is_of(str)), "an id"), "data": (is_optional(is_of(str)), "a data hash"),
    "steps": (is_step, "a step count in 0 .. 2^53"),
    "seconds": (lambda v: is_finite(v) and v >= 0, "a time"),
    "prior_mass_start_layers": (is_optional(is_layers(is_value, 0)), "finite numbers per layer"),
    "prior_mass_end_layers": (is_optional(is_layers(is_value, 0)), "finite numbers per layer"),
    "init_report": (is_optional(is_of(dict)), "a dict"),
    "config": (lambda v: v is None or isinstance(v, dict) and (
        "n_layers" not in v or is_count(v["n_layers"]) and 0 < v["n_layers"] <= MAX_LAYERS),
               f"null or a model config (n_layers in 1 .. {MAX_LAYERS})"),
    "tells_apart": (is_of(dict), "the flags that tell runs apart"),
    "init_order": (is_count, "the init's place in inits.INITS"),
    # a short printable name of each token position (x0, CLS, +)
    "token_labels": (is_optional(is_list_of(lambda v: isinstance(v, str) and 0 < len(v) <= 16 and v.isprintable())),
                     "null or the names of its positions"),
    "at_preset": (is_of(bool), "true or false"),
    "prior_source": (lambda v: v is None or isinstance(v, dict) and all(
        is_share(v[k]) for k in ("precision", "recall") if k in v) and all(
        is_count(v[k]) for k in ("found_pairs", "oracle_pairs") if k in v),
        "null or a dict whose precision and recall are in [0, 1]"),
}
RESULT_REQUIRED = ("task", "init", "seed", "metrics", "tells_apart", "init_order", "run_id", "data")


def read_result(path: str | os.PathLike) -> dict:
    """A run's result.json through the one reader, checked against RESULT_SCHEMA, a bad metric named."""
    result = read_json(path)
    metrics = result.get("metrics") if isinstance(result, dict) else None
    bad = ([k for k, v in metrics.items() if not is_optional(is_value)(v)] if isinstance(metrics, dict) else [])
    if bad:
        v = metrics[bad[0]]
        raise ReadError(f"{path}: metric {bad[0]} is {_short(v)}, not a finite number"
                        + (f" within +-{MAX_VALUE:g}" if is_finite(v) else ""))
    return check_schema(result, RESULT_SCHEMA, RESULT_REQUIRED, path)


def _short(v) -> str:
    """`v` as a one-line message quotes it: its repr on one line (a tensor's spans many), cut to 80 characters."""
    text = re.sub(r"\s+", " ", repr(v))
    return text if len(text) <= 80 else text[:77] + "..."


# ---- the checkpoint: train.py's contents serialised, stored beside their sha256 (a damaged file is seen, never used)

def is_tensor(ranks: tuple):
    return lambda v: is_plain_tensor(v) and v.is_floating_point() and v.dim() in ranks


def is_record(schema: dict):
    """A record nested in a file read back: a dict with every key of `schema`, each value passing its check."""
    return lambda v: schema_problem(v, schema, schema) is None


# A layer's record of the prior at the start (mp.prior_snapshot, the probe's `snapshot`): M (null for a layer without
# one), (heads, N, N) or relative (heads, distances); Wq Wk^T per head.
SNAPSHOT_SCHEMA = {
    "mask": (is_optional(is_tensor((2, 3))), "null or M at the start, a finite float tensor of (heads, N, N) or "
                                             "(heads, distances)"),
    "qk": (is_optional(is_tensor((3,))), "null or Wq Wk^T per head, a finite float tensor of (heads, dim, dim)")}


def snapshot_fits(contents: dict) -> bool:
    """The snapshot's Ms have the shapes of the model's Ms (`attn.prior.bias`), layer by layer, where the model has
    M: `show` draws end - start. (Weights that are not this version's model are train.py's to name.)"""
    ends = [tuple(t.shape) for k, t in contents["model"].items() if k.endswith("attn.prior.bias")]
    return not ends or [tuple(r["mask"].shape) for r in contents["snapshot"] if r["mask"] is not None] == ends


def is_rng_state(v) -> bool:
    return is_plain_tensor(v) and v.dtype == torch.uint8 and v.dim() == 1


NAMED_TENSORS = "finite tensors by name (strided, on the CPU, recording no gradient)"
# the records nested in a checkpoint, as save_checkpoint writes them
IDENTITY_SCHEMA = {"run_id": (is_of(str), "a run id"), "seed": (is_count, "a seed"),
                   "config_hash": (is_of(str), "a sha256")}
MACHINE_SCHEMA = {"device": (lambda v: v in ("cpu", "cuda", "mps"), "a device type"),
                  "threads": (is_optional(is_count), "null or a thread count")}
RNG_SCHEMA = {"torch": (is_rng_state, "a generator state (uint8)"),
              "cuda": (is_optional(is_list_of(is_rng_state)), "null or a state per CUDA device")}
OPTIMIZER_SCHEMA = {"state": (is_of(dict), "the parameters' states"),
                    "param_groups": (is_list_of(is_of(dict)), "the groups' settings")}

# A checkpoint's contents: key -> (check, what it must be); every key but "ema" (--ema) is in each one.
CKPT_SCHEMA = {
    "model": (is_named_tensors, NAMED_TENSORS),
    "optimizer": (is_record(OPTIMIZER_SCHEMA), "an optimiser state (OPTIMIZER_SCHEMA)"),
    "step": (is_count, "a step"), "seconds": (lambda v: is_finite(v) and v >= 0, "a training time"),
    "config": (is_of(dict), "the run's flags"), "model_config": (is_of(dict), "a model config"),
    "init_report": (is_optional(is_of(dict)), "a report"),
    "snapshot": (is_layers(is_record(SNAPSHOT_SCHEMA)), "a record a layer of M and Wq Wk^T at the start "
                 "(SNAPSHOT_SCHEMA: each null or a finite float tensor, M of 2 or 3 dimensions, Wq Wk^T of 3)"),
    "prior_mass_start": (is_optional(is_list_of(is_finite)), "finite numbers per layer"),
    "rng": (is_record(RNG_SCHEMA), "the generators' states (RNG_SCHEMA)"),
    "identity": (is_record(IDENTITY_SCHEMA), "the run's id, seed and config hash (IDENTITY_SCHEMA)"),
    "log_step": (is_count, "a step"), "data": (is_optional(is_of(str)), "a data hash"),
    "machine": (is_record(MACHINE_SCHEMA), "the device and threads its floats were summed on (MACHINE_SCHEMA)"),
    "prior_source": (is_optional(is_of(dict)), "a prior's source"),
    "prior_sha256": (is_of(str), "a sha256"), "ema": (is_named_tensors, NAMED_TENSORS)}


CKPT_KEYS = tuple(k for k in CKPT_SCHEMA if k != "ema")


def weights_mismatch(config: dict, state: dict) -> str | None:
    """What keeps saved weights `state` from fitting the model a saved `config` describes (built on the meta device,
    sizes bounded first): a weight lacking or in excess, another shape or dtype; or None."""
    sizes = [v for v in config.values() if isinstance(v, int) and not isinstance(v, bool)]
    if any(v < 0 or v > 1 << 24 for v in sizes) or not 0 < (config.get("n_layers") or 0) <= len(state):
        return f"its model config's sizes do not fit its {len(state)} weights: {config}"[:400]
    try:
        with torch.device("meta"):
            model = {k: (tuple(t.shape), t.dtype) for k, t in mp.model_from_config(config).state_dict().items()}
    except Exception as e:  # noqa: BLE001 - a config the model refuses is an answer, not a crash
        return f"its config does not build a model ({type(e).__name__}: {first_line(e)[:160]})"
    saved = {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
    missing, extra = sorted(set(model) - set(saved)), sorted(set(saved) - set(model))
    other = [k for k in sorted(set(model) & set(saved)) if model[k] != saved[k]]
    return (f"it lacks {missing[0]}" if missing
            else f"it holds {extra[0]}, which the model has not" if extra
            else f"{other[0]} is {saved[other[0]]} in the file, {model[other[0]]} in the model" if other else None)


def checkpoint_problem(c: dict) -> str | None:
    """What the keys of a checkpoint that pass CKPT_SCHEMA break together, or None: a log step past its step, a snapshot
    not one record a layer or not of the model's M shapes, weights (or the EMA's) that do not rebuild its model."""
    unfit = [w for w in (weights_mismatch(c["model_config"], c[k]) for k in ("model", "ema") if k in c) if w][:1]
    return (f"its log step {c['log_step']} is past its step {c['step']}" if c["log_step"] > c["step"]
            else f"does not fit this version's model ({unfit[0]}); it was written by another version of maskprior or "
                 "altered: continue it with that version, or start a new run" if unfit
            else "its prior snapshot is not one record per layer" if len(c["snapshot"]) != c["model_config"]["n_layers"]
            else "its snapshot's M (the start) does not have the shape of the model's M, layer by layer"
            if not snapshot_fits(c) else None)

CKPT_FORMAT = "maskprior-checkpoint-5"       # a checkpoint of this version holds every flag of it


def checkpoint_bytes(contents: dict) -> bytes:
    """ckpt.pt's bytes: `contents` serialised (torch.save), beside their sha256 and the format."""
    buf = io.BytesIO()
    torch.save(contents, buf)
    payload, outer = buf.getvalue(), io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, outer)
    return outer.getvalue()


def read_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint's contents through the one reader (weights_only=True) once of this format, matching their sha256,
    passing CKPT_SCHEMA and agreeing with each other and their model (`checkpoint_problem`); else a ReadError."""
    outer = load_torch(read_back(path, "checkpoint"), path)
    if not isinstance(outer, dict) or outer.get("format") != CKPT_FORMAT:
        what = (f"a checkpoint of an earlier version of train.py ({outer['format']}); this version reads {CKPT_FORMAT}:"
                if isinstance(outer, dict) and "format" in outer else "not a checkpoint of this version of train.py "
                "(no format: one written before checksums, or another program's file);")
        raise ReadError(f"{path} is {what} continue the run with the version that wrote it, or start a new run")
    payload = outer.get("payload")
    if not isinstance(payload, bytes) or hashlib.sha256(payload).hexdigest() != outer.get("sha256"):
        raise ReadError(f"{path} is damaged (its contents do not match the checksum saved with them); restore the "
                        "file from a copy, or start a new run with another --out")
    contents = check_schema(load_torch(payload, path), CKPT_SCHEMA, CKPT_KEYS, path)
    broken = checkpoint_problem(contents)
    if broken:
        raise ReadError(f"{path}: {broken}")
    return contents


# ---- the run folder: locked by the process that runs in it, its files written whole, a refusal leaving it as it was

# A write that fails for want of room or permission: one line naming it, every file written before whole.
STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}

class RunFolder:
    """A run directory, locked by its process (flock on the folder, released when the process exits) from before the
    first check to the run's end: two processes never share one. It holds a run once it has ckpt.pt (the first save
    writes it last) or result.json; a new run may take over a folder without them (a start that died before its first
    checkpoint). The run holds it by a handle (`fd`): every write goes into that folder wherever it is now; a folder
    moved away while the run trains stops the run at its next write (`check_here`), never writing at the old path."""
    OURS = ("args.json", "prior.pt", "metrics.jsonl", "result.json", "ckpt.pt")

    def __init__(self, path: str):
        if not path:
            raise UsageError("--out must name a folder, got an empty path")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"--out {ascii(path)} holds bytes that are not UTF-8 text, which the run could not print "
                             "or record: give a path in UTF-8") from None
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--out {path} is a file, not a folder; give a folder for the run")
        self.path, self.created, self.new, self.fd, self.held = path, False, False, None, None
        self.parents: list[str] = []            # the folders above it this run made, deepest first
        self.written: list[str] = []            # the files this process wrote here (`write`), in order
        self.inodes: dict[str, int] = {}        # the inode of each file it appends to (`append`)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def holds_run(self) -> bool:
        return os.path.exists(self.file("ckpt.pt")) or os.path.exists(self.file("result.json"))

    def check_free(self) -> None:
        """Before a new run reads anything: refuse a folder holding a run, or where no folder can be made."""
        if self.holds_run():
            raise UsageError(f"{self.path} already holds a run; use --resume to continue it, or another --out")
        above = os.path.dirname(os.path.abspath(self.path))
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
            why = "Not a directory" if not os.path.isdir(above) else "Permission denied"
            raise UsageError(f"--out {self.path}: cannot create the run folder ({why}) at {above}")

    def here(self) -> bool:
        """Whether the folder at `path` is still the one this run held (the device and inode it locked)."""
        try:
            now = os.stat(self.path)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == self.held

    def check_here(self) -> None:
        """An OSError (ENOENT) where the run folder moved or was deleted while the run trained (`here`): train.py
        says so in one line; nothing is written at the path, which may now name another run's folder."""
        if not self.here():
            raise OSError(errno.ENOENT, "the run folder was moved or deleted", self.path)

    def write(self, name: str, data: bytes | str) -> None:
        """Write a file of the run whole (`atomic_write`) into the folder this run holds (by its handle), remembering
        that this process wrote it and dropping any inode recorded for its name (the file is a new one)."""
        self.check_here()
        atomic_write(name, data, dir_fd=self.fd)
        self.inodes.pop(name, None)
        if name not in self.written:
            self.written.append(name)

    def append(self, name: str, data: bytes) -> None:
        """`append_own` to a file this run wrote (`write`), still the inode recorded at its first append."""
        self.check_here()
        self.inodes[name] = append_own(self.file(name) if self.fd is None else name, data, self.inodes.get(name),
                                       dir_fd=self.fd)

    @contextlib.contextmanager
    def reading(self, flag: str):
        """Read another run's folder (a teacher's) under a shared lock, refused at once where a run holds the folder."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    raise UsageError(f"{flag} is in use by another process (a run is training "
                                     "there); wait for it to end, then give it again") from None
            yield
        finally:
            os.close(fd)

    def open_existing(self) -> None:
        if not os.path.exists(self.file("ckpt.pt")):
            raise UsageError(f"--resume: no checkpoint {self.file('ckpt.pt')}; start the run without --resume")
        self._lock()

    def create(self) -> None:
        """Create (or take over) the folder of a new run and lock it; nothing of another run is touched."""
        try:
            parent = os.path.dirname(os.path.abspath(self.path))
            self.parents = missing_folders(parent)
            os.makedirs(parent, exist_ok=True)
            try:
                os.mkdir(self.path)
                self.created = True
            except FileExistsError:             # there already, or made by a run starting at the same moment
                if not os.path.isdir(self.path):
                    raise
        except OSError as e:
            self._remove_parents()
            raise UsageError(f"--out {self.path}: cannot create the run folder ({e.strerror or e})") from None
        self._lock()
        if self.holds_run():
            self.release()
            raise UsageError(f"{self.path} already holds a run; use --resume to continue it, or another --out")
        self.new = True

    def _lock(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | NOFOLLOW)
            self.held = (os.fstat(self.fd).st_dev, os.fstat(self.fd).st_ino)
            probe = f".write-check.{os.urandom(6).hex()}"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600, dir_fd=self.fd))
            os.unlink(probe, dir_fd=self.fd)
        except OSError as e:
            self.release()
            raise UsageError(f"--out {self.path}: the run folder is not writable ({e.strerror or e})") from None
        if fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.release()
                raise BusyError(f"{self.path} is in use by another process (a run is training "
                                "there); wait for it to end, or use another --out") from None
        for tmp, name in partial_writes(self.path, self.fd):    # temporary files of a write that was killed
            if name in self.OURS:
                with contextlib.suppress(OSError):
                    os.remove(tmp, dir_fd=self.fd)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def abandon(self) -> None:
        """A run that failed before it was one (no ckpt.pt of its own): remove the files this process wrote, and the
        folders it made where nothing else is there; then unlock. A resumed run (`open_existing`) keeps all."""
        if self.new and self.fd is not None and "ckpt.pt" not in self.written:
            for name in self.written:
                with contextlib.suppress(OSError):
                    os.remove(name, dir_fd=self.fd)
            # the folder it made, only while it holds its lock: a run that lost the lock to another started at the
            # same moment leaves that run its folder (removing it, empty, broke the other's first write)
            if self.created and self.fd is not None and self.here():
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)
                self._remove_parents()
        self.release()

    def failure(self, e: OSError, resume: bool, step: int | None, saved_step: int | None) -> str | None:
        """The one line for a write of a run that failed (`e`): the folder moved or deleted while the run trained,
        or a disk full, over quota or read-only; what failed where, and what is kept (every file is written whole,
        so the last checkpoint resumes exactly). None for another error (a bug: its traceback is shown)."""
        if e.errno in (errno.ENOENT, errno.EPERM) and step is not None and self.here():
            return (f"a file of the run, {e.filename}, was deleted, moved or replaced while it trained ({e.strerror}); "
                    "nothing was written through it: " + (f"the checkpoint of step {saved_step} in "
                    f"{self.file('ckpt.pt')} is whole: put the file back and --resume, or start a new run"
                    if saved_step is not None else "start the run again"))
        if e.errno == errno.ENOENT and step is not None and not self.here():
            kept = (f"its files went with it, whole: the checkpoint of step {saved_step} resumes exactly with "
                    "--resume --out NEW_PLACE" if saved_step is not None else "it had no checkpoint yet")
            return f"the run folder {self.path} disappeared at step {step} (moved or deleted while training); {kept}"
        if e.errno not in STORAGE_ERRORS:
            return None
        what = (f"{e.strerror or errno.errorcode.get(e.errno, e.errno)}"
                + (f" writing {e.filename}" if e.filename else f" under {self.path}"))
        if saved_step is None:
            return (f"{what}; the run in {self.path} is unchanged: free space, then --resume --out {self.path} again"
                    if resume else f"{what}; the new run had no checkpoint yet and left nothing "
                                   "behind: free space and start it again")
        return (f"{what} at step {step}; the checkpoint of step {saved_step} in {self.file('ckpt.pt')} is whole: "
                f"free space, then continue with --resume --out {self.path}")

    def _remove_parents(self) -> None:
        """Remove the folders above the run that it made, while empty (a run starting under them at once keeps them)."""
        for folder in self.parents:
            try:
                os.rmdir(folder)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    break                       # in use: it and the folders above stay


def missing_folders(path: str) -> list[str]:
    """The folders of `path` (absolute) that do not exist yet, deepest first."""
    out = []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out


# ---- metrics.jsonl, a run's log: one JSON record per log step (train.py appends them; reports read them back)

class LogError(ValueError):
    """A metrics.jsonl that is not one run's whole log: a line damaged, lost, repeated or out of order."""


# A metrics.jsonl line as `train_loop` writes it: key -> (check, what it must be); the LOG_REQUIRED keys are in every
# one. The lists hold a value a layer (LOG_LAYER_KEYS; qk_drift is empty for a model whose attention is not ours);
# NaN is a metric or margin with nothing to measure.
LOG_SCHEMA = {
    "step": (is_step, "a step in 0 .. 2^53"),
    "prev": (is_optional(is_step), "null or the step logged before it"),
    "metrics": (is_metrics, f"a dict of at most {MAX_METRICS} metrics, each a finite number within +-{MAX_VALUE:g}, "
                            "NaN or null"),
    "prior_mass": (is_optional(is_layers(is_mass)), "null or the attention mass on the pattern a layer "
                                                    f"(1 .. {MAX_LAYERS} shares)"),
    "prior_mass_mean": (is_optional(is_mass), "null or a share in [0, 1]"),
    "content_margin": (is_optional(is_layers(is_measure)), f"null or a margin a layer (finite within +-{MAX_VALUE:g}, "
                                                           "or NaN)"),
    "mask_drift": (is_optional(is_layers(lambda v: is_value(v) and v >= 0)), "null or a relative change >= 0 a layer"),
    "qk_drift": (is_optional(is_layers(lambda v: is_value(v) and v >= 0, 0)), "null or a relative change >= 0 a layer"),
    "loss": (is_optional(is_value), f"null or a loss within +-{MAX_VALUE:g}"),
    "lr": (lambda v: is_value(v) and v >= 0, "a learning rate >= 0"),
    "seconds": (lambda v: is_value(v) and v >= 0, "a time >= 0"),
    "run_id": (lambda v: v is None or isinstance(v, str) and len(v) <= 64, "null or a run id"),
}
LOG_REQUIRED = ("step", "metrics")
LOG_LAYER_KEYS = ("prior_mass", "content_margin", "mask_drift", "qk_drift")


def log_problem(rec) -> str | None:
    """What makes a parsed metrics.jsonl line other than `train_loop` writes it (LOG_SCHEMA), or None."""
    problem = schema_problem(rec, LOG_SCHEMA, LOG_REQUIRED)
    if problem is None and (rec.get("prior_mass") is None) != (rec.get("prior_mass_mean") is None):
        return ": prior_mass and prior_mass_mean are not both given or both null"
    return problem


def read_log(path: str, layers: int | None = None) -> list[dict]:
    """The records of a metrics.jsonl, each line checked (`log_problem`) and the log whole (`check_log`, of `layers`
    layers where given): only a last line a killed write cut short (no newline) is left out; a damaged, lost, repeated
    or reordered line is a LogError naming it, so nothing is ever dropped or rewritten away."""
    try:
        lines = read_back(path, "log").split(b"\n")
    except ReadError as e:
        raise LogError(str(e)) from None
    lines.pop()                 # after the last newline: b"", or a write cut short (its step is logged again)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            rec = load_json(line, path)
        except ReadError:
            rec = None
        problem = ": not JSON" if rec is None else log_problem(rec)
        if problem:
            raise LogError(f"{path} line {number} is damaged ({problem.lstrip(': ')}; not a "
                           "whole record as train.py writes it)")
        records.append(rec)
    check_log(records, path, layers)
    return records


def check_log(records: list[dict], path: str, layers: int | None = None) -> None:
    """Steps start at 0 and increase line by line, and each line's `prev` (the step logged before it, where logs carry
    it) is the step of the line before: a lost, repeated or reordered line is a LogError. Each line is of one run:
    every list of LOG_LAYER_KEYS holds a value for each of its `layers` (else as many as the first such list holds)."""
    for number, (before, rec) in enumerate(zip([None, *records], records), 1):
        step = rec["step"]
        counts = {len(rec[k]) for k in LOG_LAYER_KEYS if rec.get(k)}
        layers = layers or min(counts, default=None)
        if counts - {layers}:
            raise LogError(f"{path} line {number} holds {max(counts - {layers})} values a layer, "
                           f"but the run has {layers} layers: the line is not this run's")
        if before is None:
            if step != 0 or rec.get("prev") is not None:
                raise LogError(f"{path} line 1 is step {step}, not the run's start (step 0): the "
                               "log lost its first lines")
            continue
        if step <= before["step"]:
            what = "repeats" if step == before["step"] else "goes back from"
            raise LogError(f"{path} line {number} (step {step}) {what} step {before['step']} of "
                           "the line before it: the log holds a repeated or misplaced line")
        if "prev" in rec and rec["prev"] != before["step"]:
            raise LogError(f"{path} line {number} (step {step}) was logged after step {rec['prev']}, but the line "
                           f"before it is step {before['step']}: a line of the log is missing")


def log_bytes(record: dict) -> bytes:
    """One metrics.jsonl line, written by a single write() so that it is never half there (`RunFolder.append`)."""
    return (json.dumps(record) + "\n").encode()


def truncate_log(folder: RunFolder, step: int) -> None:
    """Drop log lines past the checkpoint's step and a last line cut short: the log written anew, whole."""
    folder.write("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in read_log(folder.file("metrics.jsonl"))
                                          if r["step"] <= step))


# ---- prior.pt: the prior a run starts from

@dataclass
class Prior:
    """The prior a run starts from: `pattern` (bool (N, N) or (H, N, N)) the QK inits fit and the probe measures,
    `logits` (a mask init's M) and `source` (where both came from, in result.json); kept as prior.pt."""
    pattern: torch.Tensor
    logits: torch.Tensor
    source: dict

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"pattern": self.pattern.cpu(), "logits": self.logits.cpu(), "source": self.source}, buf)
        return buf.getvalue()


def prior_evidence(source: dict) -> str | None:
    """One log line: what a prior not written by hand rests on (`Prior.source`); None for a hand pattern."""
    pairs = f"{source.get('found_pairs')} pairs"
    if "walsh" in source:
        w = source["walsh"]
        return (f"found in the training data: {w['sets_kept']} of {w['sets_tested']} Walsh sets stand above the "
                f"sampling noise {w['noise_level']:.3f} ({w['points']} points, alpha {w['alpha']}): {pairs}")
    if "pairs" in source:
        p = source["pairs"]
        return (f"found in the training data: {p['kept']} (answer digit, operand digit pair) dependences pass the "
                f"permutation test ({p['tested']} pairs tried per answer digit, alpha {p['alpha']}): {pairs}")
    if "teacher_fit" in source:
        return (f"read from the teacher {source['teacher']}: it fits {100 * source['teacher_fit']:.1f}% of its "
                f"training inputs (at least {100 * source['teacher_min_fit']:.0f}% asked): {pairs}")
    return None


def read_prior(path: str | os.PathLike, n: int | None = None, data: bytes | None = None) -> Prior:
    """prior.pt through the one reader (`data`: its bytes, read already): a bool pattern (N, N) or (H, N, N) (N = `n`
    where given), finite logits, and a source; ReadError otherwise."""
    saved = load_torch(read_back(path, "prior") if data is None else data, path)
    pattern, logits, source = (saved.get(k) if isinstance(saved, dict) else None
                               for k in ("pattern", "logits", "source"))
    n = n or (pattern.shape[-1] if isinstance(pattern, torch.Tensor) and pattern.dim() else 0)
    if not (isinstance(pattern, torch.Tensor) and pattern.dtype == torch.bool and pattern.dim() in (2, 3)
            and tuple(pattern.shape[-2:]) == (n, n) and isinstance(logits, torch.Tensor) and logits.is_floating_point()
            and bool(torch.isfinite(logits).all()) and logits.dim() in (2, 3) and isinstance(source, dict)):
        raise ReadError(f"{path} does not hold a run's prior (a bool pattern of ({n}, {n}) or "
                        f"(heads, {n}, {n}), finite logits and a source)")
    return Prior(pattern, logits, source)
