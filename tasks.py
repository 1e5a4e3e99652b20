"""Every dataset of the paper: data, interaction patterns, metrics and presets.

A task is a class on the small `Task` base below, registered under its command-line name with `@register("name")`;
`make_task(name, **options)` builds one and `TASKS` maps names to classes. What train.py uses of a task:

    class constants   KIND, PATTERNS, DEFAULT_PATTERN, FIXED_LAYOUT, HEADLINE, PRESETS, ...
    inits()                     -> the inits it offers (from inits.INITS: its family's, fitted or not)
    options()                   -> the constructor's keyword options (train.py flags of those names)
    arch()                      -> dict of model fields (vocab, sequence length, outputs, readout)
    pattern(variant)            -> bool (N, N) or (H, N, N) interaction pattern
    mask_logits(variant, on, off) -> float (N, N) or (H, N, N): the initial M of `--init mask`
    setup(device)               -> build or load the data (call once; the seed is the constructor's)
    train_batch(step, size)     -> the batch of a step (deterministic in step and seed)
    loss(model, batch)          -> scalar training loss
    evaluate(model, points)     -> dict of metrics on the test split
    probe_inputs(n)             -> a fixed real batch for the prior-mass probe

Layout: the base and the registry; caches; one section per family (its task classes, readers and `small` / `paper`
presets). What a run writes and reads back (run folders, checkpoints, logs, prior.pt) is `runfiles`; the image
augmentation is `augment`; small real data sets in real layouts (`make-digits`, `make-wikitext`) are `datafetch.write`.
"""
from __future__ import annotations

import collections
import contextlib
import glob
import hashlib
import inspect
import io
import itertools
import json
import math
import os
import pickle
import re
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F

import augment
import inits
import maskprior as mp
from runfiles import (Prior, ReadError, UsageError, atomic_output, atomic_write, cut, first_line, open_back, read_back,
                      read_json)


class Must(NamedTuple):
    """A task option's declared refusal: `test(value)` holds, or it is refused (`flag`: its flag if not --name)."""
    what: str
    test: Callable
    flag: str | None = None


class TaskError(UsageError):
    """Bad task options or data files."""


class DataError(TaskError):
    """A missing, truncated or malformed data file."""


# ----------------------------------------------------------------------------------------
# The base and the registry


TASKS: dict[str, type[Task]] = {}


def register(name: str):
    """Class decorator: make a Task subclass available as `--task name`."""
    def add(cls):
        if name in TASKS:
            raise ValueError(f"task {name!r} is registered twice ({TASKS[name].__name__}, {cls.__name__})")
        cls.NAME = name
        TASKS[name] = cls
        return cls
    return add


def make_task(name: str, **options) -> Task:
    """Build a registered task; `options` must be among its `options()` (plus `seed`); None: the task's default."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    cls = TASKS[name]
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(cls.options()) - {"seed"})
    if unknown:
        raise TaskError(f"task {name} takes no option {', '.join(unknown)}; it takes "
                        f"{', '.join(cls.options()) or 'none'}")
    return cls.build(**options)


class Task:
    """What every task shares. PRESETS: {"small": {"model": {flag: value}, "recipe": {flag: value}}, "paper": {...}}:
    a subclass's entries go on top of its parents' (`preset_parts`); every constructor also takes `seed`."""
    NAME: ClassVar[str] = ""                    # the --task name (set by @register)
    KIND: ClassVar[str] = ""                    # family: boolean, arithmetic, vision or lm
    PATTERNS: ClassVar[tuple] = ()              # --pattern variants
    DEFAULT_PATTERN: ClassVar[str | None] = None
    FIXED_LAYOUT: ClassVar[bool] = True         # one layout for every example (the inits fitted on positions need it)
    HEADLINE: ClassVar[tuple] = ()              # metrics of the log line; the first heads the tables
    PRESETS: ClassVar[dict] = {}

    seed: int = 0
    device: torch.device = torch.device("cpu")
    n_train: int = 0
    _perm_epoch: int | None = None

    say: ClassVar[Callable[[str], None]] = print    # where a task says what slow work it does (train.py: its log)
    MUST: ClassVar[dict] = {}       # option -> Must(what it must be, its test[, flag]), refused by `check_options`

    def check_options(self) -> None:
        """Refuse the first option failing its MUST test (class, bases): TaskError "--flag must be <what>, got <v>"."""
        for klass in type(self).__mro__:
            for name, must in vars(klass).get("MUST", {}).items():
                value = getattr(self, name)
                try:
                    good = bool(must.test(value))
                except TypeError:               # e.g. a string where a number goes
                    good = False
                if not good:
                    flag = must.flag or "--" + name.replace("_", "-")
                    raise TaskError(f"{flag} must be {must.what}, got {value!r}")

    @property
    def name(self) -> str:
        return self.NAME

    @classmethod
    def preset(cls, name: str) -> dict:
        """The named preset as flags: its model size, then its training recipe (`preset_parts`)."""
        model, recipe = cls.preset_parts(name)
        return {**model, **recipe}

    @classmethod
    def preset_parts(cls, name: str) -> tuple[dict, dict]:
        """(model size, training recipe) of the named preset: the family's entries, then the task's
        own ("model": architecture flags, "recipe": everything else; any other part is an error)."""
        model, recipe = {}, {}
        for klass in reversed(cls.__mro__):
            entry = vars(klass).get("PRESETS", {}).get(name, {})
            if set(entry) - {"model", "recipe"}:
                raise ValueError(f"{klass.__name__}.PRESETS[{name!r}] holds {sorted(entry)}; a preset has a "
                                 "'model' part (the size) and a 'recipe' part (the training), nothing else")
            model.update(entry.get("model", {}))
            recipe.update(entry.get("recipe", {}))
        return model, recipe

    @classmethod
    def inits(cls) -> tuple:
        return inits.offered(cls.KIND, cls.FIXED_LAYOUT)

    @classmethod
    def options(cls) -> tuple:
        """The keyword arguments of the constructor and of `build`, less `seed` (train.py passes the flags so named)."""
        params = [*inspect.signature(cls).parameters.values(), *inspect.signature(cls.build).parameters.values()]
        return tuple(dict.fromkeys(p.name for p in params if p.name != "seed" and p.kind != p.VAR_KEYWORD))

    @classmethod
    def build(cls, **options) -> Task:
        """The task these options make (where a variant is a class of its own, e.g. Lee et al.'s multiplication)."""
        return cls(**options)

    def final_eval_size(self) -> int | None:
        """Points the final evaluation scores where log steps score a sample (`--eval-points`); None: all; set up."""
        return None

    def normal_options(self) -> dict:
        """The options whose target has several spellings, in the one a run stores (one target: one report row)."""
        return {}

    def token_labels(self) -> list | None:
        """The names of the model's input positions (a Boolean task's bits, an arithmetic format's digits), for the
        ticks of M and attention maps; None where positions have no fixed meaning (images, text)."""
        return None

    @classmethod
    def presets(cls) -> tuple:
        return tuple(dict.fromkeys(p for klass in cls.__mro__ for p in vars(klass).get("PRESETS", {})))

    def pattern_name(self, variant: str | None) -> str:
        """The pattern variant to use (None: the default); TaskError for a name it does not have."""
        variant = variant or self.DEFAULT_PATTERN
        if variant not in self.PATTERNS:
            raise TaskError(f"task {self.name} has no pattern {variant!r}; choose from {list(self.PATTERNS)}")
        return variant

    def pattern(self, variant: str | None = None) -> torch.Tensor:
        return self.build_pattern(self.pattern_name(variant))

    def prior(self, variant: str | None, m_on: float, m_off: float) -> Prior:
        """The prior of pattern `variant` (None: the default), by hand or `discovered` in the data, M `mask_logits`."""
        name = self.pattern_name(variant)
        source = {"from": "data" if name == "discovered" else "hand", "pattern": name}
        pattern, logits = self.pattern(name), self.mask_logits(name, m_on, m_off)
        return self.found_prior(pattern, logits, {**source, **self.discovery()} if name == "discovered" else source)

    def discovery(self) -> dict:
        """What `--pattern discovered` found, and how (result.json's prior_source): tested, kept, the noise level."""
        return {}

    def found_prior(self, pattern: torch.Tensor, logits: torch.Tensor, source: dict) -> Prior:
        """A Prior; one found (in the data or a teacher) carries its pairs' precision and recall against the default
        hand pattern (`mp.pattern_agreement`); a TaskError where it names no pair beyond self-loops (`found_rows`)."""
        if source["from"] != "hand":
            off = pattern & ~torch.eye(pattern.shape[-1], dtype=torch.bool, device=pattern.device)
            rows = self.found_rows()
            if not (off if rows is None else off[..., rows, :]).any():
                where = "training data" if source["from"] == "data" else "teacher's attention"
                raise TaskError(f"the prior found in the {where} names no pair of tokens beyond each token itself, "
                                "so it would hold nothing; it is refused, not used (use a hand pattern or another "
                                "teacher)")
            oracle = self.pattern(self.DEFAULT_PATTERN)
            source = {**source, **mp.pattern_agreement(pattern, oracle, self.arch().get("causal", False))}
        return Prior(pattern, logits, source)

    def build_pattern(self, variant: str) -> torch.Tensor:
        raise NotImplementedError

    def mask_logits(self, variant: str | None, m_on: float, m_off: float) -> torch.Tensor:
        return mp.mask_logits_from_pattern(self.pattern(variant), m_on, m_off)

    def steps_per_epoch(self, batch_size: int) -> int:
        return math.ceil(self.n_train / batch_size)

    def final_cost(self, points: int) -> float:
        """What the final evaluation (the whole test set) costs in log-step evaluations of `points` items (ETA)."""
        size = self.final_eval_size()
        return size / points if size and 0 < points < size else 1.0

    @classmethod
    def locate(cls, data_dir: str | None) -> str | None:
        """Which layout of its data files `data_dir` holds (a word, e.g. "python"), from the file names alone (asked
        by reproduce.sh's plan); DataError naming what was looked for and where to get it; None: no data files."""
        return None

    def data_hash(self) -> str | None:
        """A sha256 of the set-up data (setup's `_data_hash`): checkpoints keep it to refuse a resume on other data."""
        return getattr(self, "_data_hash", None)

    def found_rows(self) -> list[int] | None:
        """The rows a found prior is found for (None: all); the others are the task's own (arithmetic's: causal)."""
        return None

    # ---- a prior from a teacher's attention (train.py --prior-from): what the teacher reads and how
    TEACHER_KINDS: ClassVar[tuple] = ("pattern", "logits")      # --prior-kind values; the first is the default
    # a teacher under this `teacher_fit` (each family's measure) did not learn its task: refused (--teacher-min-fit)
    TEACHER_MIN_FIT: ClassVar[float] = 0.9

    def teacher_fit(self, model: torch.nn.Module, n: int) -> float:
        """The teacher's accuracy on the training examples its attention is read on (`teacher_inputs(n)`)."""
        raise NotImplementedError

    def teacher_inputs(self, n: int = 512) -> torch.Tensor:
        """The batch a teacher's attention is read on: the probe batch (where tests are held out: training inputs)."""
        return self.probe_inputs(n)

    def teacher_prior(self, attn: torch.Tensor, kind: str, ratio: float, m_on: float, m_off: float, **reading
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pattern, logits) for this task's model from a teacher's mean attention `attn` (L, H, N, N): `pattern`: the
        pairs above `ratio` times the uniform share (`mp.pattern_from_attention`, given a family's `reading`: its keys
        or rows), M +m_on on them, -m_off elsewhere; `logits`: the M whose bias alone gives that attention, per head
        (`mp.logits_from_attention`), its pattern where log sigmoid(M) > -1. Families add forms (offsets, distances)."""
        causal = self.arch().get("causal", False)
        if kind == "pattern":
            pattern = mp.pattern_from_attention(attn, ratio, causal, **reading)
            return pattern, mp.mask_logits_from_pattern(pattern, m_on, m_off)
        return self._soft(mp.logits_from_attention(attn, m_on, m_off, causal))

    def prior_from_teacher(self, teacher_task: Task, model_config: dict, weights: dict, n: int, kind: str, ratio: float,
                           m_on: float, m_off: float, source: dict, min_fit: float | None = None) -> Prior:
        """The prior a teacher's attention gives: its model (`mp.model_from_config`, `weights`), its mean attention on
        its own training inputs (`teacher_task`, set up), made this task's prior (`teacher_prior`). A teacher fitting
        under `min_fit` of them (None: TEACHER_MIN_FIT), or a map naming nothing or not finite: a TaskError, unused."""
        model = mp.model_from_config(model_config)
        model.load_state_dict(weights)
        model.to(self.device).eval()
        with torch.no_grad():
            fit = teacher_task.teacher_fit(model, n)
        least = self.TEACHER_MIN_FIT if min_fit is None else min_fit
        source = {**source, "teacher_fit": round(fit, 4), "teacher_min_fit": least}
        if fit < least:
            raise TaskError(f"the teacher fits {fit:.1%} of its own training inputs, under the {least:.0%} a "
                            "teacher that learned its task reaches (--teacher-min-fit): its attention is no "
                            "prior; train it longer, or choose another teacher")
        inputs = teacher_task.teacher_inputs(n)
        try:
            pattern, logits = self.teacher_prior(mp.mean_attention(model, inputs), kind, ratio, m_on, m_off)
        except ValueError as e:
            raise TaskError(f"its attention gives no prior ({e})") from None
        return self.found_prior(pattern, logits, source)

    @staticmethod
    def _soft(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pattern a soft M favours: log sigmoid(M) > -1, as for `soft`; the logits)."""
        return F.logsigmoid(logits) > -1, logits

    def epoch_indices(self, step: int, batch_size: int) -> torch.Tensor:
        """Indices (on the device) of batch `step` of an epoch-wise shuffle of the examples, epoch e's by (seed, e)."""
        epoch, i = divmod(step, self.steps_per_epoch(batch_size))
        if self._perm_epoch != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._perm = torch.randperm(self.n_train, generator=g).to(self.device)
            self._perm_epoch = epoch
        return self._perm[i * batch_size:(i + 1) * batch_size]


# ----------------------------------------------------------------------------------------
# Caches: where decoded data lives and the signature of its sources, fingerprints of data (their files: runfiles').


CACHE_DIRNAME = "maskprior-cache"


def default_cache_dirs(data_dir: str | os.PathLike) -> list[Path]:
    """[<data_dir>/maskprior-cache, ~/.cache/maskprior/<name>-<hash of abs data_dir>]."""
    absolute = Path(data_dir).resolve()
    digest = hashlib.sha256(str(absolute).encode("utf-8")).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", absolute.name) or "root"
    return [absolute / CACHE_DIRNAME, Path.home() / ".cache" / "maskprior" / f"{name}-{digest}"]


def _writable_cache_dir(candidates: list[Path]) -> Path:
    """The first candidate folder that can be created and written to."""
    for folder in candidates:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
            return folder
        except OSError:
            continue
    raise DataError(f"cannot write a cache in any of: {', '.join(map(str, candidates))}")


@contextlib.contextmanager
def _cache_folder(candidates: list[Path]) -> Iterator[Path]:
    """The first writable cache folder; one this call created goes again when the body fails and left it empty."""
    created = [c for c in candidates if not c.exists()]
    folder = _writable_cache_dir(candidates)
    try:
        yield folder
    except BaseException:
        if folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()                   # only an empty folder goes
        raise


def _source_signature(path: Path, known: Iterable[dict] = (), name: str | None = None) -> dict:
    """What a cache records of a source file: its name, size and the sha256 of its bytes, so that a file replaced by
    other contents of the same size and mtime (as tar -x, cp -p or rsync -t leave it) is seen; and its stat (size,
    mtime, ctime, inode): while the stat of a `known` signature (one a cache recorded) still holds, its hash is
    reused without reading the file (every write moves ctime, and no tool sets it)."""
    st, name = path.stat(), name or path.name
    stat = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    for k in known:
        if isinstance(k, dict) and k.get("name") == name and k.get("stat") == stat and isinstance(k.get("sha256"), str):
            return {"name": name, "size": st.st_size, "sha256": k["sha256"], "stat": stat}
    with open_back(path) as f:
        digest = hashlib.sha256()
        while block := f.read(1 << 20):
            digest.update(block)
    return {"name": name, "size": st.st_size, "sha256": digest.hexdigest(), "stat": stat}


def _same_sources(a, b) -> bool:
    """Whether two lists of source signatures name the same files with the same contents (stat aside)."""
    def content(sigs):
        return [{k: v for k, v in s.items() if k != "stat"} if isinstance(s, dict) else s for s in sigs]
    return isinstance(a, list) and isinstance(b, list) and content(a) == content(b)


def array_hash(*arrays) -> str:
    """sha256 of arrays or tensors: their dtypes, shapes and bytes, in order."""
    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a.cpu().numpy() if isinstance(a, torch.Tensor) else a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------
# Boolean GOTU tasks (Abbe, Bengio, Lotfi, Rizk 2023): inputs in {-1, +1}^n, one token per bit, MSE regression. Two
# token layouts: readout "cls" puts a CLS token first (bit i at sequence position i + 1, N = n + 1); readout "mean"
# has no CLS token and averages the bit tokens (bit i at position i, N = n). Patterns are built for the layout in use.


READOUTS = ("cls", "mean")

# The exact MDI's least squares: 1,024 monomials (a parity of 10 bits) take seconds on a 2-core CPU, 2,048 (11 bits)
# two minutes, 4,096 more than five; a task whose MDI needs more is refused when it is made.
MDI_MAX_MONOMIALS = 1024


def cube(n: int) -> np.ndarray:
    """(2^n, n) int8 array of every point of {-1, +1}^n; row r has bit i = +1 iff bit i of r is 0."""
    r = np.arange(2 ** n, dtype=np.int64)[:, None]
    bits = (r >> np.arange(n)[None, :]) & 1
    return (1 - 2 * bits).astype(np.int8)


def monomials(n: int, max_degree: int) -> list[tuple[int, ...]]:
    """All subsets of range(n) of size <= max_degree, by degree then lexicographically."""
    return [s for d in range(max_degree + 1) for s in itertools.combinations(range(n), d)]


def chi(x: np.ndarray, subset) -> np.ndarray:
    """The monomial prod_{i in subset} x_i on rows of x (B, n) -> (B,) float64."""
    return np.prod(x[:, list(subset)].astype(np.float64), axis=1) if subset else np.ones(len(x))


def parity_fn(bits):
    return lambda x: chi(x, bits)


def majority_fn(bits):
    return lambda x: np.sign(x[:, list(bits)].astype(np.float64).sum(axis=1))


def _null_space(a: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal columns spanning {z : a z = 0}, from the eigenvectors of a^T a."""
    w, v = np.linalg.eigh(a.T @ a)
    return v[:, w <= tol * max(float(w.max(initial=0.0)), 1.0)]


def min_degree_interpolator(x_seen: np.ndarray, y_seen: np.ndarray, x_eval: np.ndarray, max_degree: int | None = None):
    """The min-degree interpolator (MDI) of the data (x_seen, y_seen), evaluated on x_eval (x_*: (B, n), in {-1, +1}):
    the smallest degree profile (W_d, W_{d-1}, ..., W_0), lexicographically, W_k its Fourier weight on degree-k
    monomials: the smallest degree d that fits the data exactly, then least squares on the coefficients degree by degree
    (highest first) over the remaining freedom. -> (predictions on x_eval, degree, {monomial: coef})."""
    n = x_seen.shape[1]
    max_degree = n if max_degree is None else max_degree
    ys = y_seen.astype(np.float64)
    for d in range(max_degree + 1):
        mons = monomials(n, d)
        phi = np.stack([chi(x_seen, s) for s in mons], axis=1)
        c, *_ = np.linalg.lstsq(phi, ys, rcond=None)
        if np.abs(phi @ c - ys).max() > 1e-6 * max(1.0, np.abs(ys).max()):
            continue
        null = _null_space(phi)                  # coefficient directions the data cannot see
        degrees = np.array([len(m) for m in mons])
        for k in range(d, -1, -1):
            if null.shape[1] == 0:
                break
            idx = degrees == k
            z, *_ = np.linalg.lstsq(null[idx], -c[idx], rcond=None)
            c = c + null @ z
            null = null @ _null_space(null[idx])
        pred = np.stack([chi(x_eval, s) for s in mons], axis=1) @ c
        return pred, d, {m: float(v) for m, v in zip(mons, c) if abs(v) > 1e-9}
    raise ValueError(f"no interpolator of degree <= {max_degree}")


def cube_metrics(pred: torch.Tensor, y: torch.Tensor, u: torch.Tensor, top: torch.Tensor, exact: bool) -> dict:
    """Metrics of predictions `pred` against targets `y` (all (P,)); `u` marks the unseen points (U), `top` is the top
    monomial at each point: accuracy and MSE over all and on U, its Fourier coefficient, the mean prediction on U."""
    sign_ok = (torch.sign(pred) == torch.sign(y)).float()
    ok = (torch.round(pred) == y).float() if exact else sign_ok
    err = (pred - y) ** 2
    out = {"acc": ok.mean(), "acc_unseen": ok[u].mean(), "acc_seen": ok[~u].mean(),
           "mse": err.mean(), "mse_unseen": err[u].mean(), "mse_seen": err[~u].mean(),
           "coef_top": (pred * top).mean(), "pred_unseen": pred[u].mean()}
    if exact:
        out["sign_acc"], out["sign_acc_unseen"] = sign_ok.mean(), sign_ok[u].mean()
    return {k: float(v) for k, v in out.items()}


def cyclic_patterns(n_bits: int, width: int = 2):
    """band: bits attend within |i - j| <= width (mod n), and with a CLS token CLS -> every bit
    (the default); band-only: the band with the CLS row attending to itself only (CLS layout)."""
    def build(cls: bool) -> dict:
        band = mp.banded_pattern(n_bits, width, circulant=True)
        if not cls:
            return {"band": band}
        band = mp.embed_pattern(band, 1, n_bits + 1)
        band_only = band.clone()
        band_only[0, 0] = True
        with_cls = band.clone()
        with_cls[0, :] = True
        return {"band": with_cls, "band-only": band_only}
    return build


# ---- `--pattern discovered`: the pattern found in the training data (never from the target function)
# (set, point) terms a second of walsh_coefficients on the 2-core CPU (4.7e8 measured idle)
WALSH_RATE = 3e8


def walsh_coefficients(x: np.ndarray, y: np.ndarray, max_degree: int = 3) -> dict[tuple, float]:
    """The Walsh-Fourier coefficients of data: for every set S of 1..max_degree bits, the mean of (y - mean y) *
    prod_{i in S} x_i over the points. x: (P, n) in {-1, +1}; y: (P,) -> {S: coefficient}. The product of +-1 bits
    is the sign of an XOR of their -1 flags, so each term is +-(y - mean y) exactly."""
    negative = np.asfortranarray(np.asarray(x) < 0)             # (P, n): a bit's flags contiguous
    yc = np.asarray(y, dtype=np.float64) - float(np.mean(y))
    out = {}
    for degree in range(1, max_degree + 1):
        for s in itertools.combinations(range(negative.shape[1]), degree):
            odd = negative[:, s[0]].copy()
            for i in s[1:]:
                odd ^= negative[:, i]
            out[s] = float(np.mean(np.where(odd, -yc, yc)))
    return out


def walsh_noise(y: np.ndarray, n_sets: int, alpha: float) -> float:
    """The level a Walsh coefficient of P points reaches by sampling noise: for targets independent of the bits each
    coefficient mean((y - mean y) chi_S) has mean 0 and standard error std(y) / sqrt(P) (chi_S^2 = 1), so all `n_sets`
    stay below z * std(y) / sqrt(P), z = Phi^-1(1 - alpha / (2 n_sets)), with probability >= 1 - alpha (Bonferroni)."""
    return statistics.NormalDist().inv_cdf(1 - alpha / (2 * n_sets)) * float(np.std(y)) / math.sqrt(len(y))


def walsh_sets(x: np.ndarray, y: np.ndarray, max_degree: int = 3, threshold: float = 0.25,
               alpha: float = 0.05) -> tuple[list[tuple], dict]:
    """(sets, report): the sets of bits whose |Walsh coefficient| is at least `threshold` times the largest one and
    above the sampling noise of this many points (`walsh_noise` at `alpha`), largest first: the interactions the
    seen data shows (it hides how the target extrapolates, not which bits interact); few points give fewer or none."""
    coefs = walsh_coefficients(x, y, max_degree)
    top = max(abs(v) for v in coefs.values())
    noise = walsh_noise(y, len(coefs), alpha)
    cut = max(threshold * top, noise, 1e-12)
    sets = sorted((s for s, v in coefs.items() if abs(v) >= cut), key=lambda s: -abs(coefs[s]))
    return sets, {"points": len(y), "sets_tested": len(coefs), "sets_kept": len(sets),
                  "noise_level": round(noise, 6), "largest": round(top, 6), "alpha": alpha}


# --discover-alpha, of the Boolean and the arithmetic families
DISCOVER_ALPHA = Must("the chance that a set (pair) of no dependence passes the cut, in "
                      "0.001 .. 0.5", lambda v: isinstance(v, (int, float)) and 0.001 <= v <= 0.5)


def pattern_from_sets(n_bits: int, sets, cls: bool) -> torch.Tensor:
    """bool (N, N): each set a clique, every bit its own self-loop, and with a CLS token in front CLS -> their bits."""
    off = int(cls)
    edges = [(a + off, b + off) for s in sets for a in s for b in s if a != b]
    if cls:
        edges += [(0, b + off) for b in sorted({b for s in sets for b in s})]
    return mp.pattern_from_pairs(n_bits + off, edges)


def set_patterns(n_bits: int, sets):
    """The hand patterns of a target on `sets` of bits (one set, or a sum's terms), as a function of the layout (a
    CLS token in front?): each set a clique (`pattern_from_sets`), the CLS token reading every bit of them ("clique",
    the default), or CLS -> the bits alone and self-loops ("cls", with a CLS token only)."""
    def build(cls: bool) -> dict:
        clique = pattern_from_sets(n_bits, sets, cls)
        if not cls:
            return {"clique": clique}
        return {"clique": clique, "cls": pattern_from_sets(n_bits, [(b,) for s in sets for b in s], True)}
    return build


@dataclass(kw_only=True)
class BooleanTask(Task):
    """A GOTU task: f on {-1,+1}^n, trained on the seen domain, tested on the whole cube. `unseen` fixes some bits
    (bit -> value); the unseen domain U is the subcube where all of them hold, the seen domain its complement.
    `train_size=None` trains on every seen point (each once per epoch); an integer draws that many seen points uniformly
    with replacement. `exact=True` marks an integer-valued target: accuracy is the rounded exact match (sign accuracy
    is reported too), else sign accuracy. `readout` picks the token layout (see above)."""
    KIND = "boolean"
    PATTERNS = ("clique", "cls", "discovered")
    DEFAULT_PATTERN = "clique"
    HEADLINE = ("acc", "acc_unseen", "mse_unseen")
    PRESETS = {
        # majority3, cyclic3, kmajority: GOTU's CLS layout, positional std 0.5 (why this layout and these budgets:
        # results/README.md, "Choices where the paper is silent")
        "small": {"model": dict(readout="cls", layers=3, heads=4, dim=64, mlp_dim=256, pos_init_std=0.5),
                  "recipe": dict(lr=1e-3, batch_size=128, schedule="cosine", warmup=100, steps=1500, log_every=75,
                                 eval_points=4096)},
        # GOTU (aryol/GOTU main.py and script.sh): 12 layers, 6 heads, dim 256, Adam + coupled L2
        "paper": {"model": dict(layers=12, heads=6, dim=256, head_dim=64, mlp_dim=256),
                  "recipe": dict(lr=1e-5, batch_size=256, weight_decay=1e-3, optimizer="adam",
                                 schedule="constant", epochs=20, log_every=500)},
    }

    n_bits: int
    target: Callable[[np.ndarray], np.ndarray]
    unseen: dict
    patterns: Callable[[bool], dict]    # has a CLS token in front? -> {variant: bool (N, N)}
    top_monomial: tuple
    train_size: int | None = None
    exact: bool = False
    support: tuple | None = None        # bits the target depends on (None: all); speeds up the MDI
    degree: int = 0                     # the target's Fourier degree, which bounds the MDI's (its cost)
    readout: str = "cls"
    discover_degree: int = 3            # --pattern discovered: Walsh sets of up to this many bits
    discover_threshold: float = 0.25    # ... kept when at least this fraction of the largest coefficient
    discover_alpha: float = 0.05        # ... and above the sampling noise at this false-positive rate
    seed: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    MUST: ClassVar[dict] = {
        "discover_degree": Must("in 1..4 (sets of up to 4 bits)", lambda v: 1 <= v <= 4),
        "discover_threshold": Must("a fraction of the largest coefficient in (0, 1]", lambda v: 0 < v <= 1),
        "discover_alpha": DISCOVER_ALPHA,
    }

    def __post_init__(self):
        if self.readout not in READOUTS:
            raise TaskError(f"--readout for {self.name} must be one of {', '.join(READOUTS)}, got {self.readout!r}")
        self.check_options()
        size = self.mdi_size()
        if size > MDI_MAX_MONOMIALS:
            raise TaskError(f"{self.name}: its exact min-degree interpolator (the MDI column) is a least-squares "
                            f"problem in {size:,} monomials of the {len(self.mdi_bits())} bits the target and the "
                            f"unseen domain read, which takes minutes to hours; at most {MDI_MAX_MONOMIALS:,} are "
                            "solved (a parity or majority of at most 10 bits, the unseen ones among them)")

    def mdi_bits(self) -> list[int]:
        """The bits the MDI is solved on: those the target and the unseen domain depend on."""
        return sorted(set(range(self.n_bits) if self.support is None else self.support) | set(self.unseen))

    def mdi_size(self) -> int:
        """Monomials of up to the target's degree on `mdi_bits`: the MDI's least squares' size."""
        return sum(math.comb(len(self.mdi_bits()), d) for d in range(self.degree + 1))

    def arch(self) -> dict:
        return {"vocab_size": 2, "seq_len": self.n_bits, "n_outputs": 1, "readout": self.readout}

    def token_labels(self) -> list:
        return ["CLS"] * (self.readout == "cls") + [f"x{i}" for i in range(self.n_bits)]

    def final_eval_size(self) -> int:
        return len(self.x_test)

    def pattern_name(self, variant: str | None) -> str:
        variant = variant or self.DEFAULT_PATTERN
        mine = self.patterns(self.readout == "cls")
        if variant not in mine and variant != "discovered":
            other = "mean" if self.readout == "cls" else "cls"
            hint = f" (pattern {variant!r} needs --readout {other})" if variant in self.patterns(other == "cls") else ""
            raise TaskError(f"task {self.name} has no pattern {variant!r} with --readout "
                            f"{self.readout}; choose from {sorted(mine) + ['discovered']}{hint}")
        return variant

    def build_pattern(self, variant: str) -> torch.Tensor:
        """bool (N, N) for the layout (N = n_bits + 1 with a CLS token); `discovered`: from the training set, not f."""
        if variant == "discovered":
            return pattern_from_sets(self.n_bits, self.discovered_sets(), self.readout == "cls")
        return self.patterns(self.readout == "cls")[variant]

    def discovered_sets(self) -> list[tuple]:
        """The sets of bits that interact in the training data (set up): `walsh_sets` of up to `discover_degree` bits,
        at `discover_threshold` and `discover_alpha`; none is a TaskError: no pattern is better than a wrong one."""
        if not hasattr(self, "x_train"):
            raise TaskError(f"--pattern discovered for {self.name} is found in the training set: set the task up first")
        if "discovery" not in self._cache:
            x = 2 * self.x_train.cpu().numpy() - 1                  # tokens 0/1 -> bits -1/+1
            sets = sum(math.comb(self.n_bits, d) for d in range(1, self.discover_degree + 1))
            if sets * len(x) > 10 * WALSH_RATE:
                self.say(f"finding the pattern in the training data: {sets:,} Walsh sets of up to "
                         f"{self.discover_degree} bits over {len(x):,} points (about "
                         f"{sets * len(x) / WALSH_RATE:.0f} s on a 2-core CPU)")
            sets, report = walsh_sets(x, self.y_train.cpu().numpy(), self.discover_degree,
                                      self.discover_threshold, self.discover_alpha)
            if not sets:
                raise TaskError(f"--pattern discovered: no Walsh set of up to {self.discover_degree} bits stands above "
                                f"the sampling noise of the {report['points']:,} training points (noise level "
                                f"{report['noise_level']:.3f} at --discover-alpha {self.discover_alpha}; the largest "
                                f"coefficient is {report['largest']:.3f}): too few points to find a pattern in; give "
                                "more (--train-size) or a hand pattern")
            self._cache["discovery"] = sets, report
        return self._cache["discovery"][0]

    def discovery(self) -> dict:
        self.discovered_sets()
        return {"walsh": self._cache["discovery"][1]}

    TEACHER_MIN_FIT = 0.95

    def _teacher_sample(self, n: int) -> torch.Tensor:
        return torch.randperm(len(self.x_train), generator=torch.Generator().manual_seed(0))[:n].to(self.device)

    def teacher_inputs(self, n: int = 512) -> torch.Tensor:
        """A fixed sample of training points (seen domain only: no unseen input reaches the teacher's reading)."""
        return self.x_train[self._teacher_sample(n)]

    def teacher_fit(self, model, n: int) -> float:
        """Sign accuracy (exact match for an integer target) on the training points of `teacher_inputs`."""
        idx = self._teacher_sample(n)
        pred, y = model(self.x_train[idx]).squeeze(-1).float(), self.y_train[idx]
        return float((pred.round() == y if self.exact else torch.sign(pred) == torch.sign(y)).float().mean())

    def teacher_prior(self, attn, kind, ratio, m_on, m_off):
        """Boolean tasks read the keys a teacher attends to (`mp.pattern_from_attention(keys=True)`), averaged over the
        readout rows (the CLS row, else every bit), made a clique the CLS row reads: the hand patterns' form."""
        return super().teacher_prior(attn, kind, ratio, m_on, m_off, keys=True,
                                     readout=[0] if self.readout == "cls" else None)

    def in_unseen(self, x: np.ndarray) -> np.ndarray:
        return np.all([x[:, b] == v for b, v in self.unseen.items()], axis=0)

    def setup(self, device="cpu"):
        """Build the train set (seeded) and the whole cube as test set, on `device`."""
        x_all = cube(self.n_bits)
        seen = x_all[~self.in_unseen(x_all)]
        x_train = (seen if self.train_size is None
                   else seen[np.random.default_rng(self.seed).integers(0, len(seen), size=self.train_size)])
        self.device = torch.device(device)
        self.x_train = torch.as_tensor((x_train > 0).astype(np.int64), device=device)
        self.y_train = torch.as_tensor(self.target(x_train), dtype=torch.float32, device=device)
        self.x_test = torch.as_tensor((x_all > 0).astype(np.int64), device=device)
        self.y_test, self.unseen_mask, self.chi_top = (t.to(device) for t in self._cube_targets())
        return self

    def _cube_targets(self) -> tuple:
        """(targets, unseen mask, top monomial) over the whole cube, as CPU tensors."""
        x_all = cube(self.n_bits)
        return (torch.as_tensor(self.target(x_all), dtype=torch.float32), torch.as_tensor(self.in_unseen(x_all)),
                torch.as_tensor(chi(x_all, self.top_monomial), dtype=torch.float32))

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    def data_hash(self) -> str:
        return array_hash(self.x_train, self.y_train, self.x_test, self.y_test)

    def train_batch(self, step: int, batch_size: int):
        idx = self.epoch_indices(step, batch_size)
        return self.x_train[idx], self.y_train[idx]

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).squeeze(-1).float(), y)

    def probe_inputs(self, n: int = 512) -> torch.Tensor:
        """A fixed batch of cube points, seen and unseen alike."""
        g = torch.Generator().manual_seed(0)
        return self.x_test[torch.randperm(len(self.x_test), generator=g)[:n].to(self.device)]

    def eval_points(self, n: int) -> torch.Tensor:
        """Indices of a fixed sample of `n` cube points (the same for every run and step), drawn without replacement
        from U and the seen domain in proportion to their sizes: plain means over it estimate the whole cube's."""
        key = ("eval_points", n)
        if key not in self._cache:
            g = torch.Generator().manual_seed(0)
            u = self.unseen_mask.cpu()
            n_u = round(n * float(u.float().mean()))
            parts = [torch.nonzero(part).squeeze(1) for part in (u, ~u)]
            idx = [p[torch.randperm(len(p), generator=g)[:k]] for p, k in zip(parts, (n_u, n - n_u))]
            self._cache[key] = torch.cat(idx).sort().values.to(self.device)
        return self._cache[key]

    @torch.no_grad()
    def predict(self, model, idx: torch.Tensor | None = None, batch_size: int = 8192) -> torch.Tensor:
        x = self.x_test if idx is None else self.x_test[idx]
        return torch.cat([model(x[i:i + batch_size]).squeeze(-1).float() for i in range(0, len(x), batch_size)])

    def evaluate(self, model, points: int | None = None) -> dict:
        """Metrics on the whole cube, or (`points` = n > 0) on the sample `eval_points(n)`; `eval_points` says which."""
        idx = self.eval_points(points) if points and points < len(self.x_test) else None
        y, u, top = (t if idx is None else t[idx] for t in (self.y_test, self.unseen_mask, self.chi_top))
        metrics = cube_metrics(self.predict(model, idx), y, u, top, self.exact)
        metrics["eval_points"] = 0 if idx is None else len(idx)
        mdi = self.mdi()
        for key in ("acc", "acc_unseen") + ("sign_acc",) * self.exact:
            metrics[f"mdi_{key}"] = mdi[key]
        return metrics

    def mdi(self) -> dict:
        """The MDI's metrics (cached): what a min-degree learner would predict; from the target alone (no setup)."""
        if "mdi" not in self._cache:
            x_all = cube(self.n_bits)
            seen = ~self.in_unseen(x_all)
            # The MDI only involves the bits the target and the unseen domain depend on (it is unique, and flipping any
            # other bit maps the problem to itself): it is solved on that sub-cube and read back on the whole cube.
            rel = self.mdi_bits()
            if self.mdi_size() > 256:
                self.say(f"computing the exact min-degree interpolator of {self.name} "
                         f"({self.mdi_size():,} monomials on {len(rel)} bits; up to a minute)")
            x_sub = np.unique(x_all[seen][:, rel], axis=0)
            full = np.zeros((len(x_sub), self.n_bits), dtype=np.int8)
            full[:, rel] = x_sub
            _, degree, coefs = min_degree_interpolator(x_sub, self.target(full), x_sub)
            pred = sum(v * chi(x_all, [rel[i] for i in m]) for m, v in coefs.items())
            coefs = {tuple(rel[i] for i in m): v for m, v in coefs.items()}
            m = cube_metrics(torch.as_tensor(pred, dtype=torch.float32), *self._cube_targets(), self.exact)
            m["degree"] = degree
            m["coefficients"] = {"x" + "x".join(map(str, k)) if k else "1": v for k, v in coefs.items()}
            self._cache["mdi"] = m
        return self._cache["mdi"]


# The QK inits fit the pattern on the positional embedding, which must not be drowned by the token embeddings:
# parity2 generalises only without a CLS token and with near-zero positions (README: the grid), and the QK inits
# then scale the positions x18 first, as the 2025 source does for a 0.02-std embedding.
_NEAR_ZERO_POSITIONS = dict(readout="mean", pos_init_std=0.02)          # model
_QK_POSITIONS = dict(qk_svd_pos_scale=18.0, qk_opt_pos_scale=18.0)     # recipe: the QK inits scale the positions


class _PaperBoolean(BooleanTask):
    """A Boolean task of the paper on 15 bits: target and domain in `FIELDS`; its options: the layout, the discovery."""
    FIELDS: ClassVar[dict] = {}

    def __init__(self, readout: str = "cls", discover_degree: int = 3, discover_threshold: float = 0.25,
                 discover_alpha: float = 0.05, seed: int = 0):
        super().__init__(n_bits=15, readout=readout, discover_degree=discover_degree,
                         discover_threshold=discover_threshold, discover_alpha=discover_alpha, seed=seed, **self.FIELDS)


@register("parity2")
class Parity2(_PaperBoolean):
    """x0 * x1 on 15 bits; unseen x0 = x1 = -1; trained on all 24,576 seen points."""
    # the demo's preset (why these: results/README.md, "Choices where the paper is silent")
    PRESETS = {"small": {"model": dict(_NEAR_ZERO_POSITIONS, layers=2),
                         "recipe": dict(_QK_POSITIONS, steps=600, log_every=30, eval_points=2048)},
               "paper": {"model": _NEAR_ZERO_POSITIONS, "recipe": dict(_QK_POSITIONS, epochs=20)}}
    FIELDS = dict(target=parity_fn((0, 1)), unseen={0: -1, 1: -1}, patterns=set_patterns(15, [(0, 1)]),
                  top_monomial=(0, 1), degree=2, support=(0, 1))


@register("majority3")
class Majority3(_PaperBoolean):
    """sign(x0 + x1 + x2) on 15 bits; unseen x0 = x1 = -1; 32,768 uniform draws of seen points."""
    PRESETS = {"paper": {"recipe": dict(epochs=30)}}
    FIELDS = dict(target=majority_fn((0, 1, 2)), unseen={0: -1, 1: -1}, patterns=set_patterns(15, [(0, 1, 2)]),
                  top_monomial=(0, 1, 2), degree=3, train_size=32768, support=(0, 1, 2))


@register("cyclic3")
class Cyclic3(_PaperBoolean):
    """sum_i x_i x_{i+1} x_{i+2} (indices mod 15); unseen x0 = x1 = x2 = -1; integer-valued."""
    PATTERNS = ("band", "band-only", "discovered")
    DEFAULT_PATTERN = "band"
    # 8,000 steps (why: results/README.md, "Choices where the paper is silent")
    PRESETS = {"small": {"recipe": dict(steps=8000, log_every=400)}, "paper": {"recipe": dict(epochs=80, lr=2e-5)}}
    FIELDS = dict(target=lambda x: sum(chi(x, [(i + j) % 15 for j in range(3)]) for i in range(15)), exact=True,
                  unseen={0: -1, 1: -1, 2: -1}, patterns=cyclic_patterns(15), top_monomial=(0, 1, 2), degree=3)


def parse_count(token, what: str, least: int, most: int) -> int:
    """The one parser of every integer a list or count on the command line holds (--bits, --unseen, --terms,
    'random:K'): ASCII digits alone (no sign, '_' or other script's digits) in least..most, else a TaskError (cut)."""
    token = str(token).strip()
    if not (token.isascii() and token.isdigit()) or len(token) > len(str(most)) or not least <= int(token) <= most:
        raise TaskError(f"--{what}: {cut(token)} is not an integer in {least}..{most} (ASCII digits)")
    return int(token)


def _parse_bits(text, what: str, n_bits: int) -> tuple:
    bits = tuple(parse_count(b, what, 0, n_bits - 1) for b in str(text).split(",") if b.strip() != "")
    if not bits or len(set(bits)) != len(bits):
        raise TaskError(f"--{what} must list distinct bits in 0..{n_bits - 1}, got {cut(text)}")
    return bits


def _count(text: str, prefix: str, what: str, most: int) -> int:
    return parse_count(str(text)[len(prefix):], what, 1, most)


def _random_bits(text: str, n_bits: int, seed: int) -> tuple:
    """'random:K': K distinct bits of 0..n_bits-1 drawn by the seed (a task nobody wrote the pattern of)."""
    k = _count(text, "random:", "bits", n_bits)
    return tuple(sorted(int(b) for b in np.random.default_rng([seed, 7]).choice(n_bits, size=k, replace=False)))


def parse_terms(text: str, n_bits: int) -> list[tuple[str, tuple]]:
    """--terms 'T1:T2:...', each term its bits split by ',' (their parity), or led by 'm' (their majority, an odd
    number of bits): '0,1:m2,3,4' -> [("parity", (0, 1)), ("majority", (2, 3, 4))]. A bit twice in a term, the same
    term twice, a bit outside 0..n_bits-1 or an even majority is a TaskError."""
    terms = []
    for part in str(text).split(":"):
        kind = "majority" if part.startswith("m") else "parity"
        bits = _parse_bits(part[1:] if kind == "majority" else part, "terms", n_bits)
        if kind == "majority" and len(bits) % 2 == 0:
            raise TaskError(f"--terms {cut(text)}: the majority term {cut(part)} needs an odd "
                            "number of bits (ties have no sign)")
        same = lambda k, b: (k if len(b) > 1 else "parity", set(b))        # noqa: E731 (one bit: itself, either kind)
        if same(kind, bits) in [same(k, b) for k, b in terms]:
            raise TaskError(f"--terms {cut(text)}: the term {cut(part)} is given twice")
        terms.append((kind, bits))
    return terms


def terms_text(terms: list) -> str:
    """--terms in its one spelling: each term's bits sorted, the terms sorted, 'm' on majorities of several bits."""
    spelt = sorted((sorted(bits), "m" if kind == "majority" and len(bits) > 1 else "") for kind, bits in terms)
    return ":".join(m + ",".join(map(str, bits)) for bits, m in spelt)


def term_fn(kind: str, bits: tuple):
    return parity_fn(bits) if kind == "parity" else majority_fn(bits)


class _CustomBoolean(BooleanTask):
    """A target on chosen bits (a k-parity, k-majority or a sum of such terms); --unseen 'bits:J': its first J bits."""

    def __init__(self, n_bits: int = 15, bits: str = "0,1,2", unseen: str = "0,1",
                 train_size: int | None = None, readout: str = "cls", discover_degree: int = 3,
                 discover_threshold: float = 0.25, discover_alpha: float = 0.05, seed: int = 0):
        self._check_size(n_bits, train_size)
        drawn = str(bits).startswith("random:")
        b = _random_bits(bits, n_bits, seed) if drawn else _parse_bits(bits, "bits", n_bits)
        if self.NAME == "kmajority" and len(b) % 2 == 0:
            raise TaskError(f"--bits for kmajority needs an odd number of bits (ties have no sign), got {len(b)}")
        self._make(n_bits, [("parity" if self.NAME == "kparity" else "majority", b)], ",".join(map(str, b)),
                   unseen, train_size, readout, discover_degree, discover_threshold, discover_alpha, seed)
        # drawn bits come sorted: 'bits:J' names the same ones
        self.normal = {"bits": str(bits) if drawn else ",".join(map(str, sorted(b))),
                       "unseen": str(unseen) if drawn and str(unseen).startswith("bits:") else self._unseen_text()}

    def _unseen_text(self) -> str:
        return ",".join(map(str, sorted(self.unseen)))

    def normal_options(self) -> dict:
        """Bits and unseen bits sorted ('bits:J' as the bits it names, unless the bits are drawn)."""
        return dict(self.normal)

    @staticmethod
    def _check_size(n_bits, train_size):
        if not 2 <= n_bits <= 20:
            raise TaskError(f"--n-bits must be in 2..20 (the whole cube is enumerated), got {n_bits}")
        if train_size is not None and train_size < 1:
            raise TaskError(f"--train-size must be a positive number of draws, got {train_size}")

    def _make(self, n_bits, terms, text, unseen, train_size, readout, discover_degree, discover_threshold,
              discover_alpha, seed):
        """BooleanTask's fields for the target `terms` ([(kind, bits)]; `text` names it)."""
        b = tuple(dict.fromkeys(bit for _, bits in terms for bit in bits))
        u = (b[:_count(unseen, "bits:", "unseen", len(b))] if str(unseen).startswith("bits:")
             else _parse_bits(unseen, "unseen", n_bits))
        fn = term_fn(*terms[0]) if len(terms) == 1 else (lambda x: sum(term_fn(*t)(x) for t in terms))
        patterns = set_patterns(n_bits, [bits for _, bits in terms])
        self.label = f"{self.NAME}[{text}|U:{','.join(map(str, u))}]"
        super().__init__(n_bits=n_bits, target=fn, unseen={i: -1 for i in u}, patterns=patterns, support=b, seed=seed,
                         top_monomial=max((bits for _, bits in terms), key=len), degree=max(len(t) for _, t in terms),
                         train_size=train_size, readout=readout, exact=len(terms) > 1, discover_alpha=discover_alpha,
                         discover_degree=discover_degree, discover_threshold=discover_threshold)

    @property
    def name(self) -> str:
        return self.label


@register("kparity")
class KParity(_CustomBoolean):
    """The parity of `--bits` on `--n-bits` bits, unseen where the `--unseen` bits are -1."""
    PRESETS = {"small": Parity2.PRESETS["small"],                         # parity2's demo preset
               "paper": {"model": _NEAR_ZERO_POSITIONS, "recipe": _QK_POSITIONS}}


@register("kmajority")
class KMajority(_CustomBoolean):
    """The majority of `--bits` (an odd number) on `--n-bits` bits, unseen where the `--unseen` bits are -1."""


@register("ksum")
class KSum(_CustomBoolean):
    """A sum of parities and majorities of chosen bits (`--terms`, e.g. 0,1:m2,3,4 = x0 x1 + maj(x2, x3, x4)),
    integer-valued (accuracy: exact match); each term a clique of the hand pattern; unseen where `--unseen` are -1."""

    def __init__(self, n_bits: int = 15, terms: str = "0,1:2,3,4", unseen: str = "0,1",
                 train_size: int | None = None, readout: str = "cls", discover_degree: int = 3,
                 discover_threshold: float = 0.25, discover_alpha: float = 0.05, seed: int = 0):
        self._check_size(n_bits, train_size)
        parsed = parse_terms(terms, n_bits)
        self._make(n_bits, parsed, terms_text(parsed), unseen, train_size, readout, discover_degree,
                   discover_threshold, discover_alpha, seed)
        self.normal = {"terms": terms_text(parsed), "unseen": self._unseen_text()}


# ----------------------------------------------------------------------------------------
# Arithmetic: addition and multiplication of d-digit operands (3 by default), generated by a causal decoder. A
# sequence is  a2 a1 a0 op b2 b1 b0 = c_{A-1} ... c_0  (zero-padded digits; the answer most significant digit first,
# or reversed with answer_order="lsb"). The model reads the sequence without its last token and predicts the next
# one; the loss and the metrics count only the A answer digits. An operation is a subclass of ArithmeticTask: its
# symbol, its answer, its answer's length and which operand digits its carry pattern holds strong.


ARITH_VOCAB = "0123456789+*="       # an operation whose symbol is not here appends it to its own vocabulary
ARITH_TEST_SIZE = 10_000            # held-out pairs, or every pair not trained on where the universe is smaller


@dataclass(kw_only=True)
class ArithmeticTask(Task):
    """An operation (a subclass, as above) on d-digit operands (`n_digits`, default 3). `data_frac` of the 10^(2d)
    ordered pairs train (drawn by seed); the disjoint test set: 10,000 pairs, or all the rest where fewer remain."""
    KIND = "arithmetic"
    PATTERNS = ("carry", "aligned", "lower", "discovered")
    DEFAULT_PATTERN = "carry"
    HEADLINE = ("seq_acc", "digit_acc")
    PRESETS = {
        "small": {"model": dict(layers=3, heads=4, dim=128, mlp_dim=512, emb_init_std=1.0, pos_init_std=1.0,
                                qkv_bias=True),
                  "recipe": dict(optimizer="adamw", lr=1e-3, weight_decay=0.01, batch_size=128, schedule="cosine",
                                 warmup=100, steps=600, log_every=100, eval_points=2000)},
        # minGPT's adder / Lee et al. 2023 (NanoGPT)
        "paper": {"model": dict(layers=6, heads=6, dim=384, mlp_dim=1536, emb_init_std=0.02, pos_init_std=0.02,
                                qkv_bias=True, dropout=0.2),
                  "recipe": dict(optimizer="adamw", lr=1e-3, weight_decay=0.1, betas="0.9,0.99", batch_size=256,
                                 schedule="cosine", warmup=100, steps=5000, log_every=500)},
    }

    SYMBOL: ClassVar[str]               # the operation's token between the operands; and three staticmethods:
    answer: ClassVar[Callable]          # (B,) operands a, b -> (B,) answers
    answer_digits: ClassVar[Callable]   # d -> digits in the answer of two d-digit operands (zero-padded to this length)
    strong: ClassVar[Callable]          # (j, k) -> the carry pattern: is a digit of significance j <= k strong for c_k?

    data_frac: float
    answer_order: str = "msb"
    n_digits: int = 3
    discover_alpha: float = 0.05        # --pattern discovered: the test level of each pair's selection
    seed: int = 0
    _cache: dict = field(default_factory=dict, repr=False)

    MUST: ClassVar[dict] = {
        "n_digits": Must("an integer in 1..4", lambda v: isinstance(v, int) and 1 <= v <= 4, "--digits"),
        "data_frac": Must("in (0, 1]", lambda v: 0 < v <= 1),
        "answer_order": Must("msb or lsb", lambda v: v in ("msb", "lsb")),
        "discover_alpha": DISCOVER_ALPHA,
    }

    def __post_init__(self):
        self.check_options()
        self.universe = 10 ** (2 * self.n_digits)                  # ordered pairs of d-digit operands
        self.n_train = int(round(self.data_frac * self.universe))
        if self.n_train < 1:
            raise TaskError(f"--data-frac {self.data_frac} gives no training pair out of "
                            f"{self.universe:,}; use at least {1 / self.universe:g}")
        self.test_size = min(ARITH_TEST_SIZE, self.universe - self.n_train)
        if self.test_size < min(ARITH_TEST_SIZE, self.universe // 10):
            most = (self.universe - min(ARITH_TEST_SIZE, self.universe // 10)) / self.universe
            raise TaskError(f"--data-frac {self.data_frac} leaves {self.test_size:,} of the {self.universe:,} "
                            f"pairs for the disjoint test set; use at most {most:g}")
        self.n_answer = self.answer_digits(self.n_digits)
        self.length = 2 * self.n_digits + 2 + self.n_answer      # tokens in a whole sequence
        self.eq_pos = 2 * self.n_digits + 1                       # index of '='

    @property
    def vocab(self) -> str:
        return ARITH_VOCAB if self.SYMBOL in ARITH_VOCAB else ARITH_VOCAB + self.SYMBOL

    # ---- encoding
    def encode(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(B,) operands -> (B, length) token ids."""
        c, (d, A) = self.answer(a, b), (self.n_digits, self.n_answer)
        cols = [(a // 10 ** (d - 1 - i)) % 10 for i in range(d)] + [np.full_like(a, self.vocab.index(self.SYMBOL))]
        cols += [(b // 10 ** (d - 1 - i)) % 10 for i in range(d)] + [np.full_like(a, self.vocab.index("="))]
        ans = [(c // 10 ** (A - 1 - i)) % 10 for i in range(A)]
        cols += ans if self.answer_order == "msb" else ans[::-1]
        return np.stack(cols, axis=1).astype(np.int64)

    def decode(self, seq) -> tuple[int, int, int]:
        """One token sequence (list or 1-D array) -> (a, b, answer)."""
        s, d = [str(int(t)) for t in seq], self.n_digits
        ans = s[2 * d + 2:] if self.answer_order == "msb" else s[2 * d + 2:][::-1]
        return int("".join(s[:d])), int("".join(s[d + 1:2 * d + 1])), int("".join(ans))

    def answer_significance(self, i: int) -> int:
        """Significance (power of ten) of answer digit number i in the sequence."""
        return self.n_answer - 1 - i if self.answer_order == "msb" else i

    # ---- model shape and pattern
    def arch(self) -> dict:
        return {"vocab_size": len(self.vocab), "seq_len": self.length - 1,
                "n_outputs": len(self.vocab), "readout": "tokens", "causal": True}

    def final_eval_size(self) -> int:
        return len(self.test_seq)

    def token_labels(self) -> list:
        """a2 a1 a0 + b2 b1 b0 = c3 ... (the answer's digits in its order), less the last: the decoder's inputs."""
        places = range(self.n_digits - 1, -1, -1)
        answer = [f"c{self.answer_significance(i)}" for i in range(self.n_answer)]
        return ([f"a{p}" for p in places] + [self.SYMBOL] + [f"b{p}" for p in places] + ["="] + answer)[:-1]

    def _levels(self, variant: str) -> torch.Tensor:
        """(N, N) int: 2 = strong, 1 = allowed, 0 = suppressed; N = length - 1 input positions. Prompt rows (before '=')
        keep the plain causal pattern; the row that predicts the answer digit of significance k (the '=' row and the
        answer rows) may see itself and the operand digits of significance <= k, strong as the operation's `strong`."""
        n, d = self.length - 1, self.n_digits
        lv = torch.zeros(n, n, dtype=torch.long)
        for q in range(self.eq_pos):
            lv[q, :q + 1] = 1
        operand = {p: d - 1 - i for i in range(d) for p in (i, d + 1 + i)}     # position -> significance
        for q in range(self.eq_pos, n):
            k = self.answer_significance(q - self.eq_pos)           # digit predicted at row q
            lv[q, q] = 1
            for pos, j in operand.items():
                if variant == "lower" and j <= k:
                    lv[q, pos] = 1
                elif variant == "aligned" and j in (k, k - 1):
                    lv[q, pos] = 2
                elif variant == "carry" and j <= k:
                    lv[q, pos] = 2 if self.strong(j, k) else 1
        return lv

    def build_pattern(self, variant: str) -> torch.Tensor:
        return self.discovered_pattern() if variant == "discovered" else self._levels(variant) > 0

    def mask_logits(self, variant: str | None, m_on: float, m_off: float) -> torch.Tensor:
        """Graded initial M: +m_on on strong pairs, 0 on the other allowed (log sigmoid 0 = -0.69), -m_off elsewhere."""
        variant = self.pattern_name(variant)
        if variant not in ("carry", "aligned", "lower"):           # found, or per head: two levels
            return super().mask_logits(variant, m_on, m_off)
        lv = self._levels(variant)
        return torch.where(lv == 2, float(m_on), torch.where(lv == 1, 0.0, -float(m_off)))

    def answer_rows(self) -> list[int]:
        """The input rows that predict answer digits: '=' and the answer tokens before the last."""
        return list(range(self.eq_pos, self.length - 1))

    def digit_selection(self) -> dict:
        """For each answer digit c_k (by significance k), the operand digit pairs (a_i, b_j) it depends on in the
        training pairs (`forward_selection` at `discover_alpha`). Pairs, not single digits: a digit of a sum is
        independent of either operand digit alone (like parity), not of the two; conditioning on the aligned pair first
        is what lets the carry from the pair below show. {k: [(i, j, cmi, noise, kept)]}, cached."""
        if "selection" not in self._cache:
            d, base = self.n_digits, 10 ** self.n_digits
            a, b = self.train_idx // base, self.train_idx % base
            c = self.answer(a, b)
            digit = lambda v, i: (v // 10 ** i) % 10                   # noqa: E731
            pairs = {(i, j): digit(a, i) * 10 + digit(b, j) for i in range(d) for j in range(d)}
            rng = np.random.default_rng([self.seed, 44])
            self._cache["selection"] = {k: forward_selection(digit(c, k), pairs, self.discover_alpha, rng)
                                        for k in range(self.n_answer)}
        return self._cache["selection"]

    def discovered_pattern(self) -> torch.Tensor:
        """`--pattern discovered`, found in the training pairs, bool (N, N): the row that predicts the answer digit of
        significance k sees itself and the operand digits of the pairs `digit_selection` kept for it; prompts causal."""
        if not hasattr(self, "train_idx"):
            raise TaskError(f"--pattern discovered for {self.name} is found in the training "
                            "pairs: set the task up first")
        chosen, d = self.digit_selection(), self.n_digits
        pattern = mp.causal_pattern(self.length - 1).clone()
        for q in self.answer_rows():
            k = self.answer_significance(q - self.eq_pos)
            pattern[q] = False
            pattern[q, q] = True
            # a_i stands at position d - 1 - i, b_j at 2d - j
            pattern[q, sorted({p for i, j, _, _, kept in chosen[k] if kept for p in (d - 1 - i, 2 * d - j)})] = True
        return pattern

    def discovery(self) -> dict:
        chosen = self.digit_selection()
        steps = {f"c{k}": [[f"a{i}b{j}", round(v, 4), round(n, 4), kept] for i, j, v, n, kept in s]
                 for k, s in chosen.items()}
        return {"pairs": {"tested": self.n_digits ** 2, "kept": sum(kept for s in chosen.values() for *_, kept in s),
                          "alpha": self.discover_alpha, "steps": steps}}

    def teacher_inputs(self, n: int = 512) -> torch.Tensor:
        """The first n training sequences, without their last token (no test pair reaches the teacher)."""
        return self.train_seq[:n, :-1]

    def teacher_fit(self, model, n: int) -> float:
        """Answer-digit accuracy, each digit predicted from the true ones before it, on `teacher_inputs`."""
        seq = self.train_seq[:n]
        return float((model(seq[:, :-1])[:, self.eq_pos:].argmax(-1) == seq[:, self.eq_pos + 1:]).float().mean())

    def found_rows(self) -> list[int]:
        return self.answer_rows()

    def teacher_prior(self, attn, kind, ratio, m_on, m_off):
        """Query-key pairs of the rows that predict answer digits (prompt rows causal, as in the hand patterns)."""
        return super().teacher_prior(attn, kind, ratio, m_on, m_off, readout=self.answer_rows())

    # ---- data
    def setup(self, device="cpu"):
        idx = np.random.default_rng(self.seed).choice(self.universe, size=self.n_train + self.test_size, replace=False)
        self.test_idx, self.train_idx = idx[:self.test_size], idx[self.test_size:]
        self.device = torch.device(device)
        base = 10 ** self.n_digits                                 # pair index = a * base + b
        self.train_seq = torch.as_tensor(self.encode(self.train_idx // base, self.train_idx % base), device=device)
        self.test_seq = torch.as_tensor(self.encode(self.test_idx // base, self.test_idx % base), device=device)
        return self

    def train_batch(self, step: int, batch_size: int) -> torch.Tensor:
        return self.train_seq[self.epoch_indices(step, batch_size)]

    def data_hash(self) -> str:
        return array_hash(self.train_seq, self.test_seq)

    def loss(self, model, batch) -> torch.Tensor:
        logits = model(batch[:, :-1])[:, self.eq_pos:]                  # the rows that predict answer digits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, self.eq_pos + 1:].reshape(-1))

    def probe_inputs(self, n: int = 512) -> torch.Tensor:
        return self.test_seq[:n, :-1]

    @torch.no_grad()
    def generate(self, model, prompts: torch.Tensor) -> torch.Tensor:
        """Greedy decoding of the answer digits. prompts: (B, eq_pos + 1) -> (B, n_answer)."""
        seq = prompts
        for _ in range(self.n_answer):
            seq = torch.cat([seq, model(seq)[:, -1, :10].argmax(-1, keepdim=True)], dim=1)     # among the digits
        return seq[:, self.eq_pos + 1:]

    def evaluate(self, model, points: int | None = None, batch_size: int = 2500) -> dict:
        """Sequence and digit accuracy of greedy decoding on the test pairs, or (`points` = n > 0) their first n."""
        test = self.test_seq[:points] if points and points < len(self.test_seq) else self.test_seq
        preds = torch.cat([self.generate(model, test[i:i + batch_size, :self.eq_pos + 1])
                           for i in range(0, len(test), batch_size)])
        ok = preds == test[:, self.eq_pos + 1:]
        return {"seq_acc": float(ok.all(1).float().mean()), "digit_acc": float(ok.float().mean()),
                "n_train": self.n_train, "eval_points": 0 if len(test) == len(self.test_seq) else len(test)}


def _entropy(codes: np.ndarray) -> float:
    counts = np.bincount(codes)
    p = counts[counts > 0] / len(codes)
    return float(-(p * np.log(p)).sum())


def _joint(*codes: np.ndarray) -> np.ndarray:
    """One code (0, 1, ...) per distinct tuple of non-negative integer codes."""
    out = np.zeros(len(codes[0]), dtype=np.int64)
    for c in codes:
        out = np.unique(out * (int(c.max()) + 1) + c, return_inverse=True)[1].reshape(-1)
    return out


def conditional_mi(y: np.ndarray, x: np.ndarray, z: np.ndarray) -> float:
    """I(Y; X | Z) in nats of integer arrays (plug-in): H(Y, Z) - H(Z) - H(Y, Z, X) + H(Z, X)."""
    zx = _joint(z, x)
    return _entropy(_joint(y, z)) - _entropy(z) - _entropy(_joint(y, zx)) + _entropy(zx)


def forward_selection(y: np.ndarray, candidates: dict, alpha: float, rng: np.random.Generator) -> list[tuple]:
    """Greedy forward selection of the candidates (key -> integer codes per example) that y depends on: at each step
    the candidate of largest I(y; candidate | the chosen ones) is kept when it exceeds every one of round(1 / alpha)
    - 1 permutations (each candidate's codes shuffled within the strata of the chosen ones, the largest over
    candidates taken: a test at level alpha that counts how many were tried); the first that does not ends the
    selection. [(*key, cmi, noise, kept)], the last entry the one that stopped it (if any)."""
    chosen, steps, z = [], [], np.zeros(len(y), dtype=np.int64)
    while len(chosen) < len(candidates):
        rest = [k for k in candidates if k not in chosen]
        values = {k: conditional_mi(y, candidates[k], z) for k in rest}
        noise = 0.0
        for _ in range(round(1 / alpha) - 1):
            order = np.lexsort((rng.random(len(z)), z))                # a permutation within each stratum of z
            perm = order[np.argsort(np.argsort(z, kind="stable"))]     # example i takes the codes of perm[i]
            noise = max(noise, max(conditional_mi(y, candidates[k][perm], z) for k in rest))
        best = max(values, key=values.get)
        kept = values[best] > noise + 1e-12
        steps.append((*best, values[best], noise, kept))
        if not kept:
            break
        chosen.append(best)
        z = _joint(z, candidates[best])
    return steps


@register("addition")
class Addition(ArithmeticTask):
    """a + b for d-digit a, b (--digits, default 3): d + 1 answer digits; trains on 0.4% of the pairs by default."""
    # why this budget, and `--steps 250` as the paper's regime: results/README.md, "Choices where the paper is silent"
    PRESETS = {"small": {"recipe": dict(steps=1500, log_every=75)}}
    SYMBOL = "+"

    answer = staticmethod(lambda a, b: a + b)
    answer_digits = staticmethod(lambda d: d + 1)
    strong = staticmethod(lambda j, k: j >= k - 1)      # the aligned digits and the pair below, the carry's source

    def __init__(self, data_frac: float = 0.004, answer_order: str = "msb", digits: int = 3,
                 discover_alpha: float = 0.05, seed: int = 0):
        super().__init__(data_frac=data_frac, answer_order=answer_order, n_digits=digits,
                         discover_alpha=discover_alpha, seed=seed)


# Lee et al.'s multiplication data ("Teaching Arithmetic to Small Transformers", ICLR 2024; lee-ny/
# teaching_arithmetic, data/bal/train_multiplication_3000.txt): 2-digit x 2-digit only (`lee_pairs`, `lee_text`),
# unpadded, one character a token; the test set is every pair not trained on. A row holds one example, padded after
# its end with '_' (never a target, and causal attention keeps every real row from seeing it).

LEE_VOCAB = "0123456789*=$\n_"
LEE_TOKENS = {ch: i for i, ch in enumerate(LEE_VOCAB)}
LEE_ROW = {"msb": 11, "lsb": 12}     # tokens in the longest row: 12*34=1234\n, $12*34=4321$
LEE_NEW = 5                          # characters generated for an answer: up to 4 digits and the end


def lee_pairs(n_samples: int, seed: int) -> np.ndarray:
    """(n_samples, 2) training pairs: 0..9 x 0..9, then n_samples - 100 drawn with replacement from 0..99 x 0..99."""
    single = np.stack(np.meshgrid(np.arange(10), np.arange(10), indexing="ij"), -1).reshape(-1, 2)
    return np.concatenate([single, np.random.default_rng(seed).integers(0, 100, size=(n_samples - 100, 2))])


def lee_text(a: int, b: int, answer_order: str) -> str:
    """One example as Lee et al. write it: `a*b=c\n` (msb, their plain format) or `$a*b=rev(c)$` (lsb, reversed)."""
    c = str(a * b)
    return f"{a}*{b}={c}\n" if answer_order == "msb" else f"${a}*{b}={c[::-1]}$"


@register("multiplication")
class Multiplication(ArithmeticTask):
    """a * b for d-digit a, b (--digits, default 3): 2d answer digits; trains on 3% of the pairs by default. With
    --lee-samples N (and --digits 2): Lee et al.'s unpadded data instead (`build`: `LeeMultiplication`)."""
    # 6,000 steps (why: results/README.md, "Choices where the paper is silent")
    PRESETS = {"small": {"recipe": dict(steps=6000, log_every=250)}}
    PATTERNS = ArithmeticTask.PATTERNS + ("partial", "columns")
    SYMBOL = "*"

    answer = staticmethod(lambda a, b: a * b)
    answer_digits = staticmethod(lambda d: 2 * d)
    strong = staticmethod(lambda j, k: True)    # every digit of significance <= k enters a partial product of c_k

    def __init__(self, data_frac: float | None = None, answer_order: str = "msb", digits: int = 3,
                 heads: int = 4, discover_alpha: float = 0.05, seed: int = 0):
        super().__init__(data_frac=0.03 if data_frac is None else data_frac, answer_order=answer_order,
                         n_digits=digits, discover_alpha=discover_alpha, seed=seed)
        self.heads = heads

    @classmethod
    def build(cls, lee_samples: int | None = None, **options) -> Task:
        """Lee et al.'s data where --lee-samples N is given (`LeeMultiplication`), else the zero-padded pairs."""
        return cls(**options) if lee_samples is None else LeeMultiplication(lee_samples=lee_samples, **options)

    def build_pattern(self, variant: str) -> torch.Tensor:
        """`partial` and `columns`: (heads, N, N) bool, operand digit pairs a head (`_heads_of_pairs`). partial: one
        partial product per head, the row that predicts c_k seeing in head i < d a_i, b_(k-i) (itself alone where
        k - i is not a digit of b), in head d the carries' trace. columns, long multiplication's: in head 0 every a_i,
        b_j of c_k's column (i + j = k), in head 1 the column below (k - 1, the carry's main source), in head 2 k - 2,
        in head 3 the answer digits already written (lsb first: the lower digits, the running sum's trace)."""
        d = self.n_digits
        if variant == "partial":
            return self._heads_of_pairs("partial", f"each of the {d} digits of a its own head",
                                        lambda k: [[(i, k - i)] for i in range(d)])
        if variant == "columns":
            return self._heads_of_pairs("columns", "columns k, k - 1, k - 2 a head each",
                                        lambda k: [[(i, k - c - i) for i in range(d)] for c in range(3)])
        return super().build_pattern(variant)

    def _heads_of_pairs(self, name: str, gives: str, groups) -> torch.Tensor:
        """(heads, N, N) bool: the answer row of significance k sees, in head h < G, itself and the digits of the
        pairs (i, j) (significances of a and b; pairs off the operands dropped) that `groups(k)[h]` names; in head G
        the answer digits already written; in any further head the `carry` pattern. Prompt rows stay causal."""
        d, n, g = self.n_digits, self.length - 1, len(groups(0))
        if self.heads < g + 1:
            raise TaskError(f"--pattern {name} gives {gives} and one head to the answer so far: "
                            f"it needs --heads >= {g + 1}, got {self.heads}")
        pos_a = {d - 1 - i: i for i in range(d)}                    # significance -> position
        pos_b = {j: d + 1 + (d - 1 - j) for j in range(d)}
        pat = self._levels("carry").gt(0).unsqueeze(0).repeat(self.heads, 1, 1)
        for q in range(self.eq_pos, n):
            k = self.answer_significance(q - self.eq_pos)
            pat[:g + 1, q] = False
            pat[:g + 1, q, q] = True
            for head, pairs in enumerate(groups(k)):
                for i, j in pairs:
                    if 0 <= j < d:
                        pat[head, q, pos_a[i]] = pat[head, q, pos_b[j]] = True
            pat[g, q, self.eq_pos + 1:q + 1] = True
        return pat


class LeeMultiplication(ArithmeticTask):
    """Lee et al.'s data, N samples: `--task multiplication --lee-samples N` (`Multiplication.build`). Unpadded, so an
    example's positions move with its operands' lengths: M lives on the roles of one layout, the longest ("frame": [$]
    a1 a0 * b1 b0 = and four answer digits, where a 2 x 2-digit example puts them), and an example with a one-digit
    operand has its characters moved to the roles of the same significance, digits aligned from the right (`lee_roles`,
    `mp.prior_roles`); a query row's role is that of the character it predicts, less one. Reversed answers are aligned
    by significance; a plain (msb) answer's length is unknown while written, so its digits take the significance of the
    longest answer the operands allow (len(a) + len(b) digits; a shorter answer shifts every digit up by one)."""
    NAME = "multiplication"
    name = "multiplication with --lee-samples"          # in messages
    PATTERNS = ("carry",)
    FIXED_LAYOUT = False
    inits_why = (" (--lee-samples: the layout moves with the operands' lengths, which a QK prior "
                 "fitted on fixed positions cannot follow)")
    HEADLINE = ("seq_acc", "train_seq_acc", "digit_acc")
    SYMBOL, answer, answer_digits, strong = (vars(Multiplication)[k]
                                             for k in ("SYMBOL", "answer", "answer_digits", "strong"))
    MUST: ClassVar[dict] = {"lee_samples": Must("an integer in 100 .. 10,000 (the 100 one-digit pairs, then draws from "
                                                "the 10^4 pairs)", lambda v: isinstance(v, int) and 100 <= v <= 10_000)}

    def __init__(self, lee_samples: int, answer_order: str = "msb", digits: int = 3, heads: int = 4,
                 discover_alpha: float = 0.05, data_frac: float | None = None, seed: int = 0):
        if digits != 2:
            raise TaskError("--lee-samples builds Lee et al.'s 2-digit x 2-digit data: give "
                            f"--digits 2 (got --digits {digits})")
        if data_frac is not None:
            raise TaskError("--lee-samples draws its own training set (N samples with replacement, every pair not "
                            "trained on as the test set); leave --data-frac out")
        self.heads, self.lee_samples = heads, lee_samples           # lee_samples: checked first (MUST, above)
        super().__init__(data_frac=0.03, answer_order=answer_order, n_digits=digits,
                         discover_alpha=discover_alpha, seed=seed)
        self.n_train, self.length = lee_samples, LEE_ROW[answer_order]

    def arch(self) -> dict:
        return {"vocab_size": len(LEE_VOCAB), "seq_len": self.length - 1,
                "n_outputs": len(LEE_VOCAB), "readout": "tokens", "causal": True}

    token_labels = Task.token_labels    # None: the operands' lengths move the digits, a position is no fixed digit
    mask_logits = Task.mask_logits      # two levels on the frame's roles (+m_on, -m_off), not the padded layout's

    def build_pattern(self, variant: str) -> torch.Tensor:
        """(R, R) bool on the frame's roles (R = the longest row less its last character). Prompt rows: causal. The
        row that predicts the answer digit of significance k sees the operand digits of significance <= k, the '=' and
        the answer written so far (itself included); the row that predicts the end of a full answer sees every digit."""
        pre = 1 if self.answer_order == "lsb" else 0
        r_len, eq = self.length - 1, pre + 5
        sig = {pre: 1, pre + 1: 0, pre + 3: 1, pre + 4: 0}              # a1 a0 * b1 b0: role -> significance
        pat = mp.causal_pattern(r_len).clone()
        for r in range(eq, r_len):
            t = r - eq                                                  # the answer character this row predicts
            k = 4 if t == LEE_NEW - 1 else (t if self.answer_order == "lsb" else 3 - t)
            pat[r] = False
            pat[r, eq:r + 1] = True
            for pos, s in sig.items():
                pat[r, pos] = s <= k
        return pat

    def lee_roles(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, cols): (B, R) long, the frame roles of each position of x (B, T >= its '=') as a query and as a
        key (`mp.prior_roles`). Positions past an example's end take the last role (only padding rows see them)."""
        pre = 1 if self.answer_order == "lsb" else 0
        r_len = self.length - 1
        star = (x == LEE_TOKENS["*"]).long().argmax(1, keepdim=True)
        eq = (x == LEE_TOKENS["="]).long().argmax(1, keepdim=True)
        la, lb = star - pre, eq - star - 1
        gap = 4 - la - lb                                               # digits missing from the prompt
        p = torch.arange(r_len + 1, device=x.device)[None]
        after = gap if self.answer_order == "lsb" else 2 * gap          # msb: the answer also shifts to the longest
        shift = torch.where(p < pre, 0, torch.where(p <= star, 2 - la, torch.where(p <= eq, gap, after)))
        cols = (p + shift).clamp(0, r_len - 1)[:, :r_len]
        rows = (p[:, :r_len] + shift[:, 1:]).clamp(0, r_len - 1)
        return rows, cols

    def lee_encode(self, pairs: np.ndarray) -> torch.Tensor:
        """(n, 2) pairs -> (n, row length) token ids, '_' after each example's end."""
        rows = [lee_text(int(a), int(b), self.answer_order).ljust(self.length, "_") for a, b in pairs]
        return torch.tensor([[LEE_TOKENS[ch] for ch in row] for row in rows], dtype=torch.long)

    def lee_decode(self, row) -> str:
        return "".join(LEE_VOCAB[int(t)] for t in row).rstrip("_")

    def setup(self, device="cpu"):
        rng = np.random.default_rng([self.seed, 34])
        pairs = lee_pairs(self.lee_samples, self.seed)
        self.train_pairs = pairs[rng.permutation(len(pairs))]           # shuffled: a prefix is a random sample
        seen = set(map(tuple, pairs.tolist()))
        test = np.array([(a, b) for a in range(100) for b in range(100) if (a, b) not in seen])
        self.test_pairs = test[rng.permutation(len(test))]
        self.n_pairs_trained, self.test_size = len(seen), len(test)
        self.device = torch.device(device)
        self.train_seq = self.lee_encode(self.train_pairs).to(device)
        self.test_seq = self.lee_encode(self.test_pairs).to(device)
        return self

    def loss(self, model, batch) -> torch.Tensor:
        """Cross-entropy on the answer characters and the end (every character after '=' but the padding)."""
        x = batch[:, :-1]
        with mp.prior_roles(model, *self.lee_roles(x)):
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), self.lee_targets(batch).flatten(), ignore_index=-100)

    def lee_targets(self, batch: torch.Tensor) -> torch.Tensor:
        """(B, L - 1): the next character where a row predicts an answer character or the end, else -100."""
        y = batch[:, 1:]
        return torch.where(((batch == LEE_TOKENS["="]).long().cumsum(1)[:, :-1] > 0) & (y != LEE_TOKENS["_"]), y, -100)

    @torch.no_grad()
    def lee_generate(self, model, prompts: torch.Tensor, temperature: float = 0.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
        """Decoding among the digits and the end character, greedy or (`temperature` > 0) sampled from
        softmax(logits / temperature). prompts: (B, P) ending in '=' (one length) -> (B, LEE_NEW)."""
        end = LEE_TOKENS["\n" if self.answer_order == "msb" else "$"]
        banned = torch.ones(len(LEE_VOCAB), dtype=torch.bool, device=prompts.device)
        banned[:10] = banned[end] = False
        seq = prompts
        with mp.prior_roles(model, *self.lee_roles(prompts)):
            for _ in range(LEE_NEW):
                logits = model(seq)[:, -1].float().masked_fill(banned, float("-inf"))
                if temperature > 0:
                    probs = (logits / temperature).softmax(-1)
                    nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(seq.device)
                else:
                    nxt = logits.argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        return seq[:, prompts.shape[1]:]

    def _score(self, model, seq: torch.Tensor, batch_size: int = 2500, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> tuple[float, float]:
        """(sequence accuracy, character accuracy) of decoding (`lee_generate`) on rows `seq`: right iff every
        answer digit and the end are; characters after the end are not read (Lee et al. cut the answer there)."""
        eq = (seq == LEE_TOKENS["="]).long().argmax(1)
        right, chars, chars_right = 0, 0, 0
        for e in eq.unique().tolist():
            rows = seq[eq == e]
            for i in range(0, len(rows), batch_size):
                part = rows[i:i + batch_size]
                target = part[:, e + 1:e + 1 + LEE_NEW]
                read = ((target == LEE_TOKENS["_"]).long().cumsum(1) == 0)      # up to and with the end
                ok = self.lee_generate(model, part[:, :e + 1], temperature, generator) == target
                right += int((ok | ~read).all(1).sum())
                chars, chars_right = chars + int(read.sum()), chars_right + int((ok & read).sum())
        return right / len(seq), chars_right / chars

    def evaluate(self, model, points: int | None = None, temperature: float = 0.0) -> dict:
        """Sequence and character accuracy on the test pairs and, as `train_*`, on the N training samples (Lee et al.'s
        train accuracy); `points` n > 0: the first n of each (random draws). Training runs decode greedily;
        `temperature` 0.8 samples as Lee et al.'s evaluation does (their top-k 200 keeps every character), by seed."""
        n = points if points else None
        test, train = self.test_seq[:n], self.train_seq[:n]
        g = torch.Generator().manual_seed(self.seed) if temperature > 0 else None
        seq_acc, digit_acc = self._score(model, test, temperature=temperature, generator=g)
        train_seq, train_digit = self._score(model, train, temperature=temperature, generator=g)
        return {"seq_acc": seq_acc, "digit_acc": digit_acc, "train_seq_acc": train_seq, "train_digit_acc": train_digit,
                "n_train": self.n_train, "n_pairs_trained": self.n_pairs_trained, "n_test": self.test_size,
                "eval_points": 0 if len(test) == len(self.test_seq) else len(test)}

    def probe_inputs(self, n: int = 512) -> torch.Tensor:
        """Test prompts of two 2-digit operands only: their roles are their positions (probes read M by position)."""
        return self.test_seq[torch.as_tensor(self.test_pairs.min(1) >= 10, device=self.device)][:n, :-1]

    def teacher_inputs(self, n: int = 512) -> torch.Tensor:
        raise TaskError("--prior-from reads a teacher's attention by position; with --lee-samples the layout moves "
                        "with the operands' lengths, so a teacher's map has no one place to live")


# ----------------------------------------------------------------------------------------
# Vision: CIFAR-10, CIFAR-100 (python pickles or binary records) and ImageNet-100 (the downsampled ImageNet pickles
# / .npz with map_clsloc.txt, or an ImageFolder tree with Pillow). Images are kept as uint8 (N, 3, H, W) tensors on
# the device and augmented in batches there.
#
# The 100 classes of ImageNet-100 (the CMC list, Tian et al. 2019), sorted: label = index.


IMAGENET100_WNIDS = tuple("""
    n01558993 n01692333 n01729322 n01735189 n01749939 n01773797 n01820546 n01855672 n01978455 n01980166
    n01983481 n02009229 n02018207 n02085620 n02086240 n02086910 n02087046 n02089867 n02089973 n02090622
    n02091831 n02093428 n02099849 n02100583 n02104029 n02105505 n02106550 n02107142 n02108089 n02109047
    n02113799 n02113978 n02114855 n02116738 n02119022 n02123045 n02138441 n02172182 n02231487 n02259212
    n02326432 n02396427 n02483362 n02488291 n02701002 n02788148 n02804414 n02859443 n02869837 n02877765
    n02974003 n03017168 n03032252 n03062245 n03085013 n03259280 n03379051 n03424325 n03492542 n03494278
    n03530642 n03584829 n03594734 n03637318 n03642806 n03764736 n03775546 n03777754 n03785016 n03787032
    n03794056 n03837869 n03891251 n03903868 n03930630 n03947888 n04026417 n04067472 n04099969 n04111531
    n04127249 n04136333 n04229816 n04238763 n04336792 n04418357 n04429376 n04435653 n04485082 n04493381
    n04517823 n04589890 n04592741 n07714571 n07715103 n07753275 n07831146 n07836838 n13037406 n13040303
""".split())

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
IMAGENET32_URL = "https://image-net.org/download-images.php (Downsampled ImageNet 32x32 / 64x64)"


def _entries(d: dict, path: str, what: str, *names) -> list:
    """The entries `names` of a batch dict, under str (Python 3) or bytes (Python 2) keys; one missing: a DataError."""
    out = []
    for name in names:
        if name not in d and name.encode() not in d:
            raise DataError(f"{path} has no {name!r} entry; is it {what}?")
        out.append(d[name] if name in d else d[name.encode()])
    return out


def _reconstruct(subtype, shape, typecode):
    """numpy's `_reconstruct` for a plain ndarray (its state, a numeric dtype and the bytes, comes after)."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"an array of class {getattr(subtype, '__name__', subtype)!r}, not numpy.ndarray")
    return np.ndarray.__new__(np.ndarray, shape, typecode)


def _numeric_dtype(spec, *args):
    """numpy.dtype for numbers and strings only: an object dtype would let a file place Python objects in an array."""
    dt = np.dtype(spec.decode("ascii") if isinstance(spec, bytes) else spec, *args)
    if dt.hasobject:
        raise pickle.UnpicklingError("an array of Python objects (the releases hold numbers)")
    return dt


def _scalar(dtype, data):
    """numpy's `scalar`: one number of a numeric dtype from its bytes."""
    dt = _numeric_dtype(dtype)
    if dt.hasobject or not isinstance(data, bytes) or len(data) != dt.itemsize:
        raise pickle.UnpicklingError(f"a numpy scalar of {len(data) if isinstance(data, bytes) else '?'} bytes for "
                                     f"dtype {dt}")
    return np.frombuffer(data, dt, count=1)[0]


def _frombuffer(buffer, dtype, shape, order):
    """numpy's `_frombuffer` (an array pickled with protocol 5): a numeric dtype only."""
    return np.frombuffer(bytes(buffer), _numeric_dtype(dtype)).reshape(shape, order=order).copy()


def _latin1(text, encoding):
    """`_codecs.encode(text, 'latin1')`: how Python 3 writes bytes in a protocol 2 pickle; no other codec."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} (only latin1 writes bytes)")
    return text.encode("latin1")


# The only globals a CIFAR or downsampled-ImageNet python batch names (Python 2 wrote numpy.core, numpy 2 writes
# numpy._core, Python 3 writes bytes through _codecs.encode), each mapped to a checked stand-in.
RELEASE_GLOBALS = {
    **{(f"numpy.{core}.multiarray", "_reconstruct"): _reconstruct for core in ("core", "_core")},
    **{(f"numpy.{core}.multiarray", "scalar"): _scalar for core in ("core", "_core")},
    **{(f"numpy.{core}.numeric", "_frombuffer"): _frombuffer for core in ("core", "_core")},
    ("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): _numeric_dtype, ("_codecs", "encode"): _latin1,
}


class ReleaseUnpickler(pickle._Unpickler):
    """An unpickler that admits only what the releases hold: dicts, lists, strings, bytes, numbers and numpy arrays
    of numbers. Any other global, the way a crafted pickle runs code (os.system, eval, ...), is refused uncalled."""

    def find_class(self, module: str, name: str):
        found = RELEASE_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which no release file holds "
                                         "(a crafted file runs code this way; nothing was run)")
        return found


def _release_bytes(path: str) -> bytes:
    """The bytes of a release file; a DataError where it cannot be read."""
    try:
        with open_back(path) as f:
            return f.read()
    except (OSError, ReadError) as e:
        raise DataError(f"{path} cannot be read ({getattr(e, 'strerror', None) or e}); it should "
                        "be a file of the release") from None


def _load_pickle(path: str) -> dict:
    """A release batch (a Python 2 or 3 pickle) read as a dict by `ReleaseUnpickler`; any failure is one DataError."""
    raw = _release_bytes(path)
    try:
        d = ReleaseUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways (MemoryError, LookupError, ...)
        raise DataError(f"{path} is truncated, damaged or not a release pickle "
                        f"({type(e).__name__}: {first_line(e)}); re-download the release") from None
    if not isinstance(d, dict):
        raise DataError(f"{path} does not hold a dict of arrays (found {type(d).__name__})")
    return d


def _pixels(data, path: str) -> np.ndarray:
    """Pixel rows as stored, refused unless ints in 0..255 (a cast turns 0-1 floats black, NaN into 0, 300 into 44)."""
    if not isinstance(data, np.ndarray):
        raise DataError(f"{path}: pixels must be a numpy array of uint8 rows (as in the release), "
                        f"found {type(data).__name__}; re-download the release")
    if data.dtype == np.uint8:
        return data
    if data.dtype.kind not in "iu":
        what = f"{data.dtype} values" if data.dtype.kind != "f" or not data.size else (
            f"{data.dtype} values with NaN" if np.isnan(data).any()
            else f"{data.dtype} values in {data.min():g}..{data.max():g}")
        raise DataError(f"{path}: pixels must be integers 0..255 (uint8, as in the release), "
                        f"found {what}; re-download the release or write the images as uint8")
    if data.size and (data.min() < 0 or data.max() > 255):
        raise DataError(f"{path}: pixels must be integers 0..255, found {data.min()}..{data.max()}; re-download "
                        "the release or write the images as uint8")
    return data


def _images_from_rows(data, path: str, size: int | None = None) -> np.ndarray:
    """(N, 3*S*S) uint8 rows, R then G then B planes -> (N, 3, S, S); S is `size` when given."""
    data = _pixels(data, path)
    if data.ndim != 2 or data.shape[1] % 3:
        raise DataError(f"{path}: expected image rows of 3*S*S bytes, got an array of shape {data.shape}")
    if len(data) == 0:
        raise DataError(f"{path} holds no images (an empty batch); re-download the release")
    side = int(round((data.shape[1] // 3) ** 0.5))
    if 3 * side * side != data.shape[1]:
        raise DataError(f"{path}: rows of {data.shape[1]} bytes are not 3 square colour planes")
    if size and side != size:
        raise DataError(f"{path}: rows of {data.shape[1]} bytes are {side}x{side} images; "
                        f"expected {size}x{size} (rows of {3 * size * size} bytes)")
    return data.astype(np.uint8, copy=False).reshape(-1, 3, side, side)


def _labels(values, path: str, n_images: int, n_classes: int | None = None) -> np.ndarray:
    """A batch's labels as int64 (N,), refused unless they are N integers (in 0..n_classes-1 when given)."""
    if isinstance(values, (list, tuple)):
        if any(isinstance(v, (list, tuple, dict)) for v in values):
            raise DataError(f"{path}: labels must be a flat list of integers, found a list of lists")
        if any(isinstance(v, int) and not -2 ** 63 <= v < 2 ** 63 for v in values):
            raise DataError(f"{path}: labels must be 64-bit integers, found one outside -2^63 .. 2^63 - 1")
    elif not isinstance(values, np.ndarray):
        raise DataError(f"{path}: labels must be a list of integers, found {type(values).__name__}")
    try:
        y = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as e:
        raise DataError(f"{path}: labels must be a flat list of integers ({type(e).__name__})") from None
    if y.ndim != 1:
        raise DataError(f"{path}: labels must be a flat list of integers, found an array of shape {y.shape}")
    if y.size and y.dtype.kind not in "iu":
        raise DataError(f"{path}: labels must be integers, found {y.dtype} values (e.g. "
                        f"{repr(y[:1].tolist()[0])[:40]})")
    if len(y) != n_images:
        raise DataError(f"{path}: {n_images} images but {len(y)} labels (truncated?)")
    y = y.astype(np.int64)
    if n_classes is not None and (y.min() < 0 or y.max() >= n_classes):
        raise DataError(f"{path}: labels must lie in 0..{n_classes - 1}, found {y.min()}..{y.max()}")
    return y


def read_cifar_pickle(path: str, label_key: str = "labels", n_classes: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR python batch (data_batch_1, test_batch, train, test) -> (images uint8, labels int64 < n_classes)."""
    data, labels = _entries(_load_pickle(path), path, "a CIFAR python batch", "data", label_key)
    x = _images_from_rows(data, path, 32)
    return x, _labels(labels, path, len(x), n_classes)


def read_cifar_binary(path: str, label_bytes: int = 1, label_index: int = 0,
                      n_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR binary file: records of `label_bytes` label bytes then 3072 pixel bytes (CIFAR-10:
    1 label byte; CIFAR-100: coarse then fine label, label_bytes=2, label_index=1 for the fine)."""
    raw = np.frombuffer(_release_bytes(path), dtype=np.uint8)
    rec = label_bytes + 3072
    if raw.size == 0 or raw.size % rec:
        raise DataError(f"{path}: {raw.size} bytes is not a whole number of {rec}-byte records (truncated?)")
    raw = raw.reshape(-1, rec)
    return raw[:, label_bytes:].reshape(-1, 3, 32, 32).copy(), _labels(raw[:, label_index], path, len(raw), n_classes)


def find_first(data_dir: str, candidates) -> str | None:
    for c in candidates:
        p = os.path.join(data_dir, c)
        if os.path.exists(p):
            return p
    return None


def cifar_files(data_dir: str, name: str) -> tuple[str, list[str]]:
    """Where CIFAR-10 or CIFAR-100 lies in `data_dir` (or a sub-folder it holds): ("python" or "binary", its files:
    the training batches, then the test batch); DataError naming what was looked for and where to get it."""
    if name == "cifar10":
        names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        py = find_first(data_dir, [os.path.join(d, "data_batch_1") for d in ("cifar-10-batches-py", ".")])
        if py:
            return "python", [os.path.join(os.path.dirname(py), f) for f in names]
        binary = find_first(data_dir, ["cifar-10-batches-bin", "."])
        if binary and os.path.exists(os.path.join(binary, "data_batch_1.bin")):
            return "binary", [os.path.join(binary, f + ".bin") for f in names]
        raise DataError("CIFAR-10 not found: looked for cifar-10-batches-py/data_batch_1 (python) and "
                        f"cifar-10-batches-bin/data_batch_1.bin (binary) in {os.path.abspath(data_dir)}; fetch it "
                        f"with `python train.py download cifar10 --data {data_dir}` (from {CIFAR_URL}, checked and "
                        "unpacked), or point --data-dir at it")
    py = find_first(data_dir, ["cifar-100-python", "."])
    if py and os.path.exists(os.path.join(py, "train")) and not os.path.isdir(os.path.join(py, "train")):
        return "python", [os.path.join(py, s) for s in ("train", "test")]
    binary = find_first(data_dir, ["cifar-100-binary", "."])
    if binary and os.path.exists(os.path.join(binary, "train.bin")):
        return "binary", [os.path.join(binary, f"{s}.bin") for s in ("train", "test")]
    raise DataError("CIFAR-100 not found: looked for cifar-100-python/train (python) and cifar-100-binary/train.bin "
                    f"(binary) in {os.path.abspath(data_dir)}; fetch it with `python train.py download cifar100 --data "
                    f"{data_dir}` (from {CIFAR_URL}, checked and unpacked), or point --data-dir at it")


def read_cifar(data_dir: str, name: str) -> dict:
    """CIFAR-10 or CIFAR-100: {'train': (x, y), 'test': (x, y), 'sources': files}, x uint8 (N, 3, 32, 32), y int64."""
    kind, files = cifar_release(data_dir, name)                     # all checked, then decoded
    decode = {("python", "cifar10"): lambda f: read_cifar_pickle(f, n_classes=10),
              ("binary", "cifar10"): lambda f: read_cifar_binary(f, n_classes=10),
              ("python", "cifar100"): lambda f: read_cifar_pickle(f, "fine_labels", 100),
              ("binary", "cifar100"): lambda f: read_cifar_binary(f, 2, 1, 100)}[kind, name]
    parts = [decode(f) for f in files]
    if name == "cifar10":
        train = np.concatenate([p[0] for p in parts[:5]]), np.concatenate([p[1] for p in parts[:5]])
        return {"train": train, "test": parts[5], "sources": files}
    return {"train": parts[0], "test": parts[1], "sources": files}


# what a release's file opens with (python: a pickle) or is made of (binary: records of the label(s), 3072 pixels)
CIFAR_FILE = {("python", "cifar10"): {"header": b"\x80"}, ("python", "cifar100"): {"header": b"\x80"},
              ("binary", "cifar10"): {"record": 3073}, ("binary", "cifar100"): {"record": 3074}}


def cifar_release(data_dir: str, name: str) -> tuple[str, list[str]]:
    """`cifar_files`, each file checked (`release_file`): a pickle (python), whole records (binary)."""
    kind, files = cifar_files(data_dir, name)
    for f in files:
        release_file(f, name, **CIFAR_FILE[kind, name])
    return kind, files


def release_file(path: str, name: str, header: bytes = b"", record: int = 0) -> str:
    """`path`, a file of a release, checked before a byte of it is decoded: there, a regular file, not empty,
    opening with `header` and (where `record`) whole records of that many bytes; else a DataError naming it."""
    if not os.path.exists(path):
        raise DataError(f"{name}: {path} is missing (the release is incomplete?); re-download it")
    if not os.path.isfile(path):
        raise DataError(f"{name}: {path} is not a file (a folder?); it should be the file of the release")
    size = os.path.getsize(path)
    if size == 0 or (record and size % record):
        what = "empty" if size == 0 else f"{size:,} bytes, not whole {record}-byte records"
        raise DataError(f"{name}: {path} is {what} (a download cut short?); re-download it")
    if header:
        with open_back(path) as f:
            if f.read(len(header)) != header:
                raise DataError(f"{name}: {path} does not open as the release's files do (not a "
                                "pickle); re-download it")
    return path


def read_wnid_map(path: str) -> dict:
    """map_clsloc.txt ('n02119789 1 kit_fox' per line) -> {1-based label: wnid}."""
    out = {}
    with io.TextIOWrapper(open_back(path), encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2 or not parts[0].startswith("n") or not parts[1].isdigit():
                raise DataError(f"{path}:{i}: expected 'wnid label name', got {line.strip()!r}")
            out[int(parts[1])] = parts[0]
    return out


def _read_downsampled(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One Imagenet32/64 batch, pickle or .npz: rows of 3*S*S bytes, 1-based labels."""
    if path.endswith(".npz"):
        try:
            with open_back(path) as f, np.load(f) as z:
                data, labels = z["data"], z["labels"]
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path} is truncated or not an Imagenet32/64 .npz ({e})") from None
    else:
        data, labels = _entries(_load_pickle(path), path, "an Imagenet32/64 batch", "data", "labels")
    x = _images_from_rows(data, path)
    return x, _labels(labels, path, len(x))


def imagenet100_layout(data_dir: str) -> str:
    """Which ImageNet-100 layout `data_dir` holds: "folder" (train/<wnid>/*.JPEG and val/<wnid>/, read with Pillow)
    or "downsampled" (the Imagenet32/64 batches with map_clsloc.txt); DataError naming both where it holds neither."""
    if os.path.isdir(os.path.join(data_dir, "train")) and not find_first(data_dir, ["val_data", "val_data.npz"]):
        return "folder"
    if find_first(data_dir, ["train_data_batch_1", "train_data_batch_1.npz"]):
        return "downsampled"
    raise DataError(f"ImageNet-100 not found in {os.path.abspath(data_dir)}: looked for train/<wnid>/*.JPEG with "
                    "val/<wnid>/ (an ImageFolder tree; needs Pillow), and for train_data_batch_1..10 and val_data "
                    f"with map_clsloc.txt (the downsampled ImageNet, {IMAGENET32_URL}); `python train.py "
                    "imagenet100 --from IMAGENET_1K_DIR --data DIR` builds the tree from an ImageNet-1k copy")


DOWNSAMPLED_BATCHES = tuple(f"train_data_batch_{i}" for i in range(1, 11)) + ("val_data",)      # then .npz or not


def _wnid_map_path(data_dir: str) -> str:
    map_path = os.path.join(data_dir, "map_clsloc.txt")
    if not os.path.exists(map_path):
        raise DataError(f"ImageNet-100: {map_path} is missing; it maps labels 1..1000 to wnids and comes with the "
                        "ImageNet devkit (ILSVRC2012 devkit, data/map_clsloc.txt)")
    return map_path


def read_imagenet100_downsampled(data_dir: str) -> dict:
    """ImageNet-100 from the downsampled ImageNet release (train_data_batch_1..10, val_data; pickles or .npz) and
    the devkit's map_clsloc.txt, all in `data_dir`. Labels 0..99 in sorted wnid order."""
    map_path = _wnid_map_path(data_dir)
    label_to_wnid = read_wnid_map(map_path)
    index = {w: i for i, w in enumerate(IMAGENET100_WNIDS)}
    missing = [w for w in IMAGENET100_WNIDS if w not in set(label_to_wnid.values())]
    if missing:
        raise DataError(f"{map_path} lacks {len(missing)} of the ImageNet-100 wnids (e.g. {missing[0]})")
    lut = np.full(max(label_to_wnid) + 1, -1, dtype=np.int64)
    for lab, w in label_to_wnid.items():
        lut[lab] = index.get(w, -1)

    sources = [map_path]

    def load(names):
        xs, ys = [], []
        for n in names:
            path = find_first(data_dir, [n, n + ".npz"])
            if path is None:
                raise DataError(f"ImageNet-100: {os.path.join(data_dir, n)} (or .npz) is missing; "
                                f"get the downsampled ImageNet from {IMAGENET32_URL}")
            sources.append(release_file(path, "ImageNet-100"))
            x, y = _read_downsampled(path)
            if y.min() < 1 or y.max() >= len(lut):
                raise DataError(f"{path}: labels must be 1..{len(lut) - 1} (1-based), found {y.min()}..{y.max()}")
            keep = lut[y] >= 0
            xs.append(x[keep])
            ys.append(lut[y[keep]])
        return np.concatenate(xs), np.concatenate(ys)

    return {"train": load(DOWNSAMPLED_BATCHES[:-1]), "test": load(DOWNSAMPLED_BATCHES[-1:]), "sources": sources}


def _pillow():
    """PIL.Image, which an ImageFolder tree needs; DataError saying how to get it."""
    try:
        from PIL import Image
    except ImportError:
        raise DataError("reading an ImageFolder tree needs Pillow: pip install pillow (or use "
                        "the downsampled ImageNet pickles, which need nothing)") from None
    return Image


def read_image_folder(root: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """An ImageFolder tree root/<wnid>/*.JPEG of the ImageNet-100 classes, resized to size x size (Pillow)."""
    Image = _pillow()
    xs, ys = [], []
    for label, wnid in enumerate(IMAGENET100_WNIDS):
        folder = os.path.join(root, wnid)
        if not os.path.isdir(folder):
            raise DataError(f"ImageNet-100: class folder {folder} is missing")
        for fname in sorted(os.listdir(folder)):
            try:
                with open_back(os.path.join(folder, fname)) as f, Image.open(f) as im:
                    im = im.convert("RGB").resize((size, size), Image.BILINEAR)
                    xs.append(np.asarray(im, dtype=np.uint8).transpose(2, 0, 1))
            except (OSError, ReadError) as e:
                raise DataError(f"{os.path.join(folder, fname)} is not a readable image ({e})") from None
            ys.append(label)
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


def _image_signature(data_dir: str, sources, known=()) -> list[dict]:
    """Every source's `_source_signature`, named by its path relative to data_dir (sorted): the image cache's key."""
    return [_source_signature(Path(path), known, os.path.relpath(path, data_dir)) for path in sorted(sources)]


def _save_image_cache(data_dir: str, key: str, data: dict, signature: list[dict]):
    """Write the decoded arrays, their hash and sources' signature to the first writable cache folder (none: skip)."""
    try:
        folder = _writable_cache_dir(default_cache_dirs(data_dir))
    except DataError:
        return
    with atomic_output(folder / f"{key}.npz") as f:
        np.savez(f, x_train=data["train"][0], y_train=data["train"][1], x_test=data["test"][0], y_test=data["test"][1],
                 sources=np.array(json.dumps(signature)), data_hash=np.array(data["data_hash"]))


def _cached_images(cache: Path, data_dir: str) -> dict | None:
    """The cached arrays, or None when the cache is broken, has no signature, or its sources changed."""
    try:
        with open_back(cache) as f, np.load(f) as z:
            saved = json.loads(str(z["sources"]))
            now = _image_signature(data_dir, [os.path.join(data_dir, e["name"]) for e in saved], known=saved)
            if not _same_sources(now, saved):
                return None
            return {"train": (z["x_train"], z["y_train"]), "test": (z["x_test"], z["y_test"]),
                    "data_hash": str(z["data_hash"])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def load_image_dataset(name: str, data_dir: str, image_size: int = 32) -> dict:
    """Decode a dataset once, cached as uint8 arrays (.npz) by the data and read back while every source keeps its
    contents (`_source_signature`): {"train": (x, y), "test": (x, y), "data_hash": sha256 of the four arrays}."""
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir} is not a folder; point it at the folder that holds the {name} files")
    key = f"{name}-{image_size}"
    for cache in (folder / f"{key}.npz" for folder in default_cache_dirs(data_dir)):
        if cache.exists():
            data = _cached_images(cache, data_dir)
            if data is not None:
                return data              # a broken or stale cache is rebuilt, written new over it
    if name in ("cifar10", "cifar100"):
        data = read_cifar(data_dir, name)
    elif imagenet100_layout(data_dir) == "folder":
        data = {"train": read_image_folder(os.path.join(data_dir, "train"), image_size),
                "test": read_image_folder(os.path.join(data_dir, "val"), image_size),
                "sources": [os.path.join(root, f) for split in ("train", "val")
                            for root, _, files in os.walk(os.path.join(data_dir, split)) for f in files]}
    else:
        data = read_imagenet100_downsampled(data_dir)
    size = data["train"][0].shape[-1]
    if size != image_size:
        raise DataError(f"{name} in {data_dir} holds {size}x{size} images but --image-size is {image_size}")
    data["data_hash"] = array_hash(*data["train"], *data["test"])
    _save_image_cache(data_dir, key, data, _image_signature(data_dir, data.pop("sources")))
    return data


@dataclass(kw_only=True)
class ImageTask(Task):
    """Image classification with a ViT; the prior lives on the grid of patches: `impulse` (the default) gives each
    head one convolution-like offset (with `--impulse random`, drawn by the seed), `soft` a 2-D bump around that
    offset (`--soft-alpha`, ConViT-like), `local` every head the `--window` x `--window` neighbourhood, `graded` the
    head's offset at +m_on and the rest of the 3 x 3 neighbourhood at 0 (log sigmoid 0 = -0.69)."""
    KIND = "vision"
    PATTERNS = ("impulse", "soft", "local", "graded")
    DEFAULT_PATTERN = "impulse"
    # The presets' prior is the soft bump (`pattern="soft"`): with impulse's positions x18 and mimetic V-proj
    # (`--init mask-impulse`) it beats `impulse` on every seed of the digits stand-in (results/README.md); the QK
    # inits read it as its centre, the impulse pattern (`build_pattern`), so they are as before.
    HEADLINE = ("top1", "loss")
    MASK_OFF: ClassVar[float] = 10.0       # every preset's -M off the pattern (m_on stays 5)
    PRESETS = {
        "small": {"model": dict(layers=4, heads=3, dim=96, mlp_dim=192, patch_size=4, pool="mean", qkv_bias=True,
                                pos_init_std=0.02, pattern="soft"),
                  "recipe": dict(mask_off=MASK_OFF, optimizer="adamw", lr=1e-3, weight_decay=0.05, batch_size=128,
                                 schedule="cosine", warmup_epochs=2, epochs=30, label_smoothing=0.1,
                                 qk_opt_steps=2000, log_every=100)},
        # the structured-initialization small-dataset recipe (osiriszjq/structured_initialization README, timm
        # 1.0.22): vit_tiny_patch16_224 with a class token, CIFAR upsampled to 224 by a random resized crop
        # (evaluation: resize to 256, centre 224), the values below with AdamW eps 1e-8, RandAugment p 0.5, cutmix
        # switch 0.5, pixel erasing; no EMA, no clipping
        "paper": {"model": dict(layers=12, heads=3, dim=192, mlp_dim=768, patch_size=16, input_size=224, pool="cls",
                                qkv_bias=True, pos_init_std=0.02, pattern="soft"),
                  "recipe": dict(mask_off=MASK_OFF, optimizer="adamw", lr=2e-3, weight_decay=0.05, betas="0.9,0.999",
                                 batch_size=512, schedule="cosine", warmup_epochs=50, epochs=300, label_smoothing=0.1,
                                 mixup=0.8, cutmix=1.0, crop="rrc", crop_pct=0.875, randaug=9.0, randaug_std=0.5,
                                 randaug_ops=2, reprob=0.25, drop_path=0.1, log_every=1000)},
        # the earlier setting: ViT-Tiny on 32x32 images, patch 2 (256 tokens), average pooling (Zheng et al. 2024)
        "paper32": {"model": dict(layers=12, heads=3, dim=192, mlp_dim=768, patch_size=2, pool="mean", qkv_bias=True,
                                  pos_init_std=0.02, pattern="soft"),
                    "recipe": dict(mask_off=MASK_OFF, optimizer="adamw", lr=1e-3, weight_decay=0.05, batch_size=512,
                                   schedule="cosine", warmup_epochs=10, epochs=200, label_smoothing=0.1,
                                   log_every=1000)},
    }
    N_CLASSES: ClassVar[int] = 0

    data_dir: str | None = None
    image_size: int = 32                # the images' side as stored
    input_size: int | None = None       # the model's input side (None: image_size); larger = upsampled
    patch_size: int = 4
    pool: str = "mean"
    heads: int = 3
    impulse: str = "fixed"              # 'fixed' (self, up, right, ...) or 'random' offsets per head
    soft_alpha: float = 1.0             # the `soft` prior: log sigmoid(M) = -alpha * squared distance to the offset
    window: int = 3                     # the `local` prior's side in patches (odd)
    pad: int = 4
    label_smoothing: float = 0.1
    mixup: float = 0.0
    cutmix: float = 0.0
    crop: str = "pad"                   # 'pad': pad 4, random crop, flip; 'rrc': random resized crop, flip
    crop_pct: float = 0.875             # evaluation at another input size: resize to input / crop_pct, centre crop
    randaug: float = 0.0                # RandAugment magnitude in [0, 10]; 0 = off
    randaug_std: float = 0.5
    randaug_ops: int = 2
    reprob: float = 0.0                 # random erasing probability
    seed: int = 0

    MUST: ClassVar[dict] = {
        "crop": Must("pad or rrc", lambda v: v in ("pad", "rrc")),
        "randaug": Must("a magnitude in [0, 10] (0 = off)", lambda v: 0 <= v <= 10),
        "reprob": Must("a probability in [0, 1]", lambda v: 0 <= v <= 1),
        "crop_pct": Must("in (0, 1]", lambda v: 0 < v <= 1),
        "randaug_ops": Must("at least 1", lambda v: v >= 1),
        "impulse": Must("fixed or random", lambda v: v in ("fixed", "random")),
        "soft_alpha": Must("a finite number > 0", lambda v: math.isfinite(v) and v > 0),
        "window": Must("the local prior's side in patches, an odd number >= 1", lambda v: v >= 1 and v % 2 == 1),
    }

    def __post_init__(self):
        self.n_classes = self.N_CLASSES
        self.input_size = self.input_size or self.image_size
        _required_dir(self.data_dir, self.name)
        if self.input_size % self.patch_size:
            raise TaskError(f"--input-size {self.input_size} (the model's image side) is not a "
                            f"multiple of --patch-size {self.patch_size}")
        self.check_options()

    def arch(self) -> dict:
        return {"image_size": self.input_size, "patch_size": self.patch_size,
                "n_classes": self.n_classes, "pool": self.pool}

    def offsets(self):
        if self.impulse == "random":
            return mp.random_impulse_offsets(self.heads, 3, torch.Generator().manual_seed(self.seed))
        return [mp.IMPULSE_OFFSETS[h % len(mp.IMPULSE_OFFSETS)] for h in range(self.heads)]

    def build_pattern(self, variant: str) -> torch.Tensor:
        """(heads, N, N) bool: what the prior favours, for the QK inits and the probe (`soft`: the keys whose initial
        log sigmoid(M) is above -1, and in a row with none (its offset leaves the grid) the row's likeliest key, itself:
        at alpha 1 the impulse pattern, so a QK init reads the same prior with either; `graded`: the 3 x 3 around)."""
        g, prefix = self.input_size // self.patch_size, 1 if self.pool == "cls" else 0
        if variant == "local" or variant == "graded":
            return mp.window_pattern(g, g, self.window if variant == "local" else 3, self.heads, prefix)
        if variant == "soft":
            bias = torch.nn.functional.logsigmoid(self.mask_logits("soft", 10.0, 10.0))
            above, patches = bias > -1, bias[..., prefix:]               # a CLS key is +m_on for every row
            likeliest = torch.zeros_like(above)
            likeliest[..., prefix:] = patches == patches.amax(-1, keepdim=True)
            return above | (~above[..., prefix:].any(-1, keepdim=True) & likeliest)
        return mp.impulse_pattern(g, g, self.offsets(), prefix)

    def mask_logits(self, variant: str | None, m_on: float, m_off: float) -> torch.Tensor:
        variant = self.pattern_name(variant)
        g, prefix = self.input_size // self.patch_size, 1 if self.pool == "cls" else 0
        if variant == "soft":
            return mp.soft_offset_logits(g, g, self.offsets(), self.soft_alpha, m_on, m_off, prefix)
        if variant == "graded":
            strong = mp.impulse_pattern(g, g, self.offsets(), prefix)
            return torch.where(strong, float(m_on), torch.where(self.pattern("graded"), 0.0, -float(m_off)))
        return super().mask_logits(variant, m_on, m_off)

    def setup(self, device="cpu"):
        data = load_image_dataset(self.name, self.data_dir, self.image_size)
        (xtr, ytr), (xte, yte) = data["train"], data["test"]
        self._data_hash = data["data_hash"]
        for split, y in (("train", ytr), ("test", yte)):
            if len(y) == 0 or y.min() < 0 or y.max() >= self.n_classes:
                raise DataError(f"{self.name} {split} labels must lie in 0..{self.n_classes - 1} and be non-empty")
        self.device = torch.device(device)
        self.x_train, self.y_train, self.x_test, self.y_test = (torch.as_tensor(a, device=device)
                                                                for a in (xtr, ytr, xte, yte))
        xf = self.x_train.float() / 255
        self.mean = xf.mean(dim=(0, 2, 3)).view(1, 3, 1, 1)
        self.std = xf.std(dim=(0, 2, 3)).view(1, 3, 1, 1).clamp_min(1e-3)
        self.n_train = len(self.y_train)
        return self

    def normalize(self, x_uint8: torch.Tensor) -> torch.Tensor:
        return (x_uint8.float() / 255 - self.mean) / self.std

    def train_batch(self, step: int, batch_size: int):
        """Augmented batch of a step, deterministic in (seed, step), on the device: (images float (B, 3, S, S), soft
        targets (B, n_classes)), S the input size; pad crops at the stored size, upsampled; RandAugment on uint8."""
        idx = self.epoch_indices(step, batch_size)
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + step)
        if self.crop == "rrc":
            x = augment.random_resized_crop(self.x_train[idx], self.input_size, g)
        else:
            x = augment.random_crop_flip(self.x_train[idx], self.pad, g)
            if self.input_size != self.image_size:
                x = augment.resize(x, self.input_size)
        if self.randaug > 0:
            x = augment.rand_augment(x, g, self.randaug, self.randaug_std, self.randaug_ops)
        x = self.normalize(x)
        if self.reprob > 0:
            x = augment.random_erasing(x, self.reprob, g)
        y = F.one_hot(self.y_train[idx], self.n_classes).float()
        y = y * (1 - self.label_smoothing) + self.label_smoothing / self.n_classes
        return augment.mix_batch(x, y, self.mixup, self.cutmix, g, np.random.default_rng([self.seed, step]))

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return torch.sum(-y * F.log_softmax(model(x).float(), dim=-1), dim=-1).mean()

    def test_view(self, x_uint8: torch.Tensor) -> torch.Tensor:
        """Test images as the model sees them: normalised, resized to input / crop_pct, centre-cropped as timm does."""
        if self.input_size != self.image_size:
            x_uint8 = augment.resize_center_crop(x_uint8, self.input_size, self.crop_pct)
        return self.normalize(x_uint8)

    def probe_inputs(self, n: int = 64) -> torch.Tensor:
        return self.test_view(self.x_test[:n])

    TEACHER_KINDS = ("offsets", "pattern", "logits")
    TEACHER_MIN_FIT = 0.5

    def teacher_inputs(self, n: int = 64) -> torch.Tensor:
        """The first n training images, as evaluation sees them (no augmentation; no test image)."""
        return self.test_view(self.x_train[:n])

    def teacher_fit(self, model, n: int) -> float:
        return float((model(self.teacher_inputs(n)).argmax(-1) == self.y_train[:n]).float().mean())

    def teacher_prior(self, attn, kind, ratio, m_on, m_off):
        """Per 2-D offset by default (`mp.offsets_from_attention`: a soft prior per head, translation-invariant)."""
        if kind == "offsets":
            g = self.input_size // self.patch_size
            return self._soft(mp.offsets_from_attention(attn, g, g, 1 if self.pool == "cls" else 0, m_on, m_off))
        return super().teacher_prior(attn, kind, ratio, m_on, m_off)

    @torch.no_grad()
    def evaluate(self, model, points: int | None = None, batch_size: int = 500) -> dict:
        correct, loss = 0, 0.0
        for i in range(0, len(self.y_test), batch_size):
            logits = model(self.test_view(self.x_test[i:i + batch_size])).float()
            y = self.y_test[i:i + batch_size]
            correct += int((logits.argmax(-1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
        n = len(self.y_test)
        return {"top1": correct / n, "loss": loss / n}


def _required_dir(data_dir: str | None, name: str) -> str:
    if data_dir is None:
        raise DataError(f"--data-dir is required for {name}: the folder that holds its files")
    return data_dir


@register("cifar10")
class Cifar10(ImageTask):
    """CIFAR-10 (python or binary release) in --data-dir: 50,000 train / 10,000 test images, 10 classes."""
    N_CLASSES = 10
    TRAIN_SIZE = 50_000             # training images as released (reproduce.sh's plan sizes epochs with it)

    @classmethod
    def locate(cls, data_dir):
        return cifar_release(_required_dir(data_dir, cls.NAME), cls.NAME)[0]


@register("cifar100")
class Cifar100(Cifar10):
    """CIFAR-100 (python or binary release) in --data-dir, fine labels: 100 classes."""
    N_CLASSES = 100


@register("imagenet100")
class ImageNet100(ImageTask):
    """ImageNet-100 (the CMC class list) from the downsampled ImageNet pickles or an ImageFolder tree."""
    N_CLASSES = 100
    TRAIN_SIZE = 126_689

    @classmethod
    def locate(cls, data_dir):
        """The layout, with what its reader needs first: every class folder and an image in each split (the tree, and
        Pillow), or every batch and the label map (downsampled)."""
        layout = imagenet100_layout(_required_dir(data_dir, cls.NAME))
        if layout == "folder":
            _pillow()
            for split in ("train", "val"):
                folders = [os.path.join(data_dir, split, wnid) for wnid in IMAGENET100_WNIDS]
                missing = [f for f in folders if not os.path.isdir(f)]
                if missing or not any(os.listdir(f) for f in folders):
                    what = (f"class folder {missing[0]} is missing" if missing
                            else f"{os.path.join(data_dir, split)} holds no image")
                    raise DataError(f"ImageNet-100: {what}; `python train.py imagenet100 --from "
                                    "IMAGENET_1K_DIR --data DIR` builds the tree")
            return layout
        _wnid_map_path(data_dir)
        for n in DOWNSAMPLED_BATCHES:
            release_file(find_first(data_dir, [n, n + ".npz"]) or os.path.join(data_dir, n), cls.NAME)
        return layout


# ----------------------------------------------------------------------------------------
# Language modelling: WikiText-2 (word level) and TinyStories (byte level), causal decoder; read from the files their
# authors publish (no `datasets` library, no network).
#
# WikiText-2 (WIKITEXT_URL, the wikitext-2-v1 / wikitext-2-raw-v1 zips; `train.py download wikitext2`), either
# release: wikitext-2/wiki.{train,valid,test}.tokens (word level, rare words already <unk>), tried first, or
# wikitext-2-raw/wiki.{train,valid,test}.raw (raw text); data_dir may hold those folders or be one. Tokenisation
# follows PyTorch's word_language_model example (`wikitext_line_words`): headings (" = Robert Boulter = ") and the
# @,@ / @.@ / @-@ tokens are ordinary words. The vocabulary comes from the train split only (`build_vocab`); words of
# valid/test missing from it map to <unk> (only in the raw release).
#
# TinyStories (TINYSTORIES_URL), V2 (TinyStoriesV2-GPT4-{train,valid}.txt) or V1 (TinyStories-{train,valid}.txt), in
# data_dir or data_dir/TinyStories: stories are separated by lines that are exactly <|endoftext|> once surrounding
# whitespace is stripped. Byte level: a story's UTF-8 bytes are ids 0..255 and one end-of-text id 256 follows every
# story (vocabulary 257). Why: there is no trained vocabulary to fit, ship or version; nothing is ever out of
# vocabulary; and a 2 GB file streams chunk by chunk with no state beyond the current line. The cost: sequences
# about 4x longer than with a BPE tokeniser; stories are stripped, empty ones skipped (`iter_tinystories_tokens`).
#
# Token cache: every split is tokenised once into a flat little-endian uint16 (vocabulary <= 65536) or uint32 binary
# file plus a JSON meta (dtype, count, vocabulary size, the sources' signatures (`_source_signature`), so a changed
# source is re-tokenised); the WikiText vocabulary is a JSON list beside them. Every file is written to a temporary name
# and moved into place, the meta last, so an interrupted build leaves no cache that would be taken as valid.


WIKITEXT_URL = "https://wikitext.smerity.com"  # the two zips as their authors released them
TINYSTORIES_URL = "https://huggingface.co/datasets/roneneldan/TinyStories"

DEFAULT_CHUNK_SIZE = 1 << 20
CACHE_FORMAT = 2        # bump when the cache layout or a tokeniser changes (2: sources by content, tokens' sha256)

UNK = "<unk>"
EOS = "<eos>"
EOT_ID = 256
BYTE_VOCAB_SIZE = 257
EOT_TEXT = "\n<|endoftext|>\n"  # how decode() renders the end-of-text id

WIKITEXT_SPLITS = ("train", "valid", "test")
# release name -> (sub-folder, file extension), in the order "auto" tries them
WIKITEXT_RELEASES = {"tokens": ("wikitext-2", ".tokens"), "raw": ("wikitext-2-raw", ".raw")}
WIKITEXT_TOKENIZER = "word-split-eos-v1"

TINYSTORIES_SPLITS = ("train", "valid")
# version -> file name prefix, in the order "auto" tries them
TINYSTORIES_VERSIONS = {"v2": "TinyStoriesV2-GPT4", "v1": "TinyStories"}
TINYSTORIES_TOKENIZER = "utf8-bytes-eot256-v1"

# a separator line in a block of complete lines (from a line start to a "\n"); other whitespace may surround it
_SEPARATOR_LINE = re.compile(rb"^[ \t\r\f\v]*<\|endoftext\|>[ \t\r\f\v]*\n", re.MULTILINE)


# ---- corpora and windows

def load_lm_corpus(name: str, data_dir: str | os.PathLike, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                   version: str = "auto", cache_dir: str | os.PathLike | None = None) -> dict:
    """A language-modelling corpus (`name` "wikitext2" or "tinystories", its files in `data_dir` as above) as token
    id arrays, tokenised on first use. `version`: "auto" (tries them in order) or a release, "tokens" / "raw" for
    WikiText-2, "v2" / "v1" for TinyStories; `chunk_size`: bytes read at a time while streaming TinyStories;
    `cache_dir`: the token cache's folder instead of the default. Returns {"train": memmap (N_train,), "valid": memmap
    (N_valid,), "vocab_size": int, "decode": callable(list[int]) -> str, "source": str, "data_hash": a sha256 of the
    tokens}; WikiText-2 also has "test" (memmap) and "vocab" (list[str]). Arrays: 1-D, read-only, uint16 or uint32."""
    if name == "wikitext2":
        return load_wikitext2(data_dir, release=version, cache_dir=cache_dir)
    if name == "tinystories":
        return load_tinystories(data_dir, version=version, chunk_size=chunk_size, cache_dir=cache_dir)
    raise DataError(f"unknown corpus {name!r}: expected 'wikitext2' or 'tinystories'")


def random_windows(tokens: np.ndarray, context: int, batch_size: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """B = batch_size training windows of T = context tokens at uniformly random offsets s_b in 0 .. N - T - 1 of
    `tokens` (1-D, N >= T + 1 ids), drawn from `generator` (CPU: the same seed, the same batch). (x, y), int64 (B, T):
    x[b] = tokens[s_b : s_b + T], y[b] = tokens[s_b + 1 : s_b + T + 1]."""
    n = len(tokens)
    _check_context(context, n, "training")
    return _gather_windows(tokens, torch.randint(0, n - context, (batch_size,), generator=generator).numpy(), context)


def eval_windows(tokens: np.ndarray, context: int, batch_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A split covered by consecutive, non-overlapping windows: window k starts at k * context, so every token of
    tokens[1:] is a target exactly once. Full windows come in batches (<= batch_size, context); the last partial
    window, when N - 1 is not a multiple of context, is INCLUDED as a final (1, r) batch, 0 < r < context: weight
    per-batch mean losses by y.numel() for the per-token mean over the split. An iterator of int64 (x, y) pairs, y =
    x shifted by one; a DataError at once (not on first iteration) when N < context + 1."""
    _check_context(context, len(tokens), "validation")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return _iter_eval_windows(tokens, context, batch_size)


def _check_context(context: int, n_tokens: int, split: str, flag: str = "--context") -> None:
    """A window of `context` tokens (its flag `flag`) fits the split: context + 1 tokens at least."""
    if context < 1:
        raise DataError(f"{flag} must be >= 1, got {context}")
    if n_tokens < context + 1:
        raise DataError(f"{flag} {context} is longer than the {split} split ({n_tokens} tokens); "
                        f"use {flag} {max(n_tokens - 1, 1)} or less")


def _gather_windows(tokens: np.ndarray, starts: np.ndarray, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of T+1 tokens at `starts` (B,) -> x, y int64 tensors (B, T)."""
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(context + 1)
    windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def _iter_eval_windows(tokens: np.ndarray, context: int, batch_size: int
                       ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    n_targets = len(tokens) - 1
    n_full = n_targets // context
    for first in range(0, n_full, batch_size):
        yield _gather_windows(tokens, np.arange(first, min(first + batch_size, n_full)) * context, context)
    rest = n_targets - n_full * context
    if rest:
        yield _gather_windows(tokens, np.array([n_full * context]), rest)


# ---- WikiText-2

def load_wikitext2(data_dir: str | os.PathLike, release: str = "auto",
                   cache_dir: str | os.PathLike | None = None) -> dict:
    release, files = find_wikitext_files(data_dir, release)
    stem = f"wikitext2-{release}"
    candidates = _cache_candidates(data_dir, cache_dir)
    known = _known_sources(candidates, stem)
    sources = [_source_signature(files[split], known) for split in WIKITEXT_SPLITS]
    splits, vocab, data_hash = _read_or_build(candidates, lambda f: _read_wikitext_cache(f, stem, sources),
                                              lambda f: _build_wikitext_cache(f, stem, files, sources))
    return {**splits, "data_hash": data_hash, "vocab": vocab, "vocab_size": len(vocab),
            "decode": lambda ids: decode_words(ids, vocab),
            "source": f"WikiText-2 {release} release in {files['train'].parent}"}


def _read_or_build(candidates: list[Path], read: Callable, build: Callable):
    """`read(folder)` of the first candidate folder whose cache it finds valid (not None); else `build(folder)` in
    the first writable one (`_cache_folder`) and `read` it back (a DataError where it cannot be)."""
    for folder in candidates:
        loaded = read(folder)
        if loaded is not None:
            return loaded
    with _cache_folder(candidates) as folder:
        build(folder)
    loaded = read(folder)
    if loaded is None:
        raise DataError(f"token cache written to {folder} could not be read back")
    return loaded


def _choices(value: str, options: dict, what: str) -> list[str]:
    if value == "auto":
        return list(options)
    if value in options:
        return [value]
    raise DataError(f"unknown {what} {value!r}: expected 'auto' or one of {', '.join(map(repr, options))}")


def find_wikitext_files(data_dir: str | os.PathLike, release: str = "auto") -> tuple[str, dict[str, Path]]:
    """Locate wiki.{train,valid,test}.{tokens|raw}; returns (release, {split: path})."""
    data_dir = Path(data_dir)
    releases = _choices(release, WIKITEXT_RELEASES, "WikiText-2 release")
    looked = []
    for name in releases:
        subdir, ext = WIKITEXT_RELEASES[name]
        for folder in (data_dir / subdir, data_dir):
            files = {split: folder / f"wiki.{split}{ext}" for split in WIKITEXT_SPLITS}
            if all(path.is_file() for path in files.values()):
                return name, files
            looked.append(str(folder / f"wiki.{{train,valid,test}}{ext}"))
    zips = " or ".join(f"{'wikitext-2-raw-v1' if r == 'raw' else 'wikitext-2-v1'}.zip" for r in releases)
    raise DataError(f"WikiText-2 not found: looked for {', '.join(looked)}; fetch both releases with `python train.py "
                    f"download wikitext2 --data {data_dir}` ({zips} from {WIKITEXT_URL}, checked and unzipped)")


def wikitext_line_words(line: str) -> list[str]:
    """Words of one line: whitespace-split, then <eos> (an empty line gives [<eos>])."""
    return line.split() + [EOS]


def iter_wikitext_words(path: Path) -> Iterator[str]:
    """Stream the words of a WikiText file, line by line (`wikitext_line_words`)."""
    try:
        with io.TextIOWrapper(open_back(path), encoding="utf-8") as f:
            for line in f:
                yield from wikitext_line_words(line)
    except UnicodeDecodeError as exc:
        raise DataError(f"WikiText-2 file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        f"re-download it from {WIKITEXT_URL}") from None


def build_vocab(words: Iterable[str]) -> list[str]:
    """[<unk>, <eos>] then the other words by descending count, ties alphabetical."""
    counts = collections.Counter(words)
    for special in (UNK, EOS):
        counts.pop(special, None)
    return [UNK, EOS] + sorted(counts, key=lambda word: (-counts[word], word))


def encode_words(words: Iterable[str], vocab: Sequence[str]) -> np.ndarray:
    """Word ids (N,) in the cache dtype; words missing from `vocab` become <unk> (0)."""
    index = {word: i for i, word in enumerate(vocab)}
    return np.fromiter((index.get(word, 0) for word in words), dtype=token_dtype(len(vocab)))


def decode_words(ids: Iterable[int], vocab: Sequence[str]) -> str:
    """Words joined by spaces, each <eos> rendered as a newline."""
    eos = vocab.index(EOS)
    out, line_start = [], True
    for i in map(int, ids):
        out.append("\n" if i == eos else vocab[i] if line_start else " " + vocab[i])
        line_start = i == eos
    return "".join(out)


def _build_wikitext_cache(folder: Path, stem: str, files: dict[str, Path], sources: list[dict]) -> None:
    """Tokenise the three splits, refuse an empty one (writing nothing), then write the vocab, each split and meta."""
    vocab = build_vocab(iter_wikitext_words(files["train"]))
    ids = {split: encode_words(iter_wikitext_words(files[split]), vocab) for split in WIKITEXT_SPLITS}
    for split, tokens in ids.items():
        if len(tokens) == 0:
            raise DataError(f"WikiText-2 file {files[split]} is empty (no tokens); re-download it from {WIKITEXT_URL}")
    raw = json.dumps(vocab, ensure_ascii=False).encode("utf-8")
    atomic_write(folder / f"{stem}.vocab.json", raw)
    vocab_sha1 = hashlib.sha1(raw).hexdigest()
    for split in WIKITEXT_SPLITS:
        meta = _expected_meta(stem, WIKITEXT_TOKENIZER, split, sources, vocab_sha1=vocab_sha1)
        _write_split(folder, stem, split, meta, [ids[split]], len(vocab), "")


def _read_wikitext_cache(folder: Path, stem: str, sources: list[dict]
                         ) -> tuple[dict[str, np.memmap], list[str], str] | None:
    """(the cached splits, the vocab, a sha256 of both) if all are present and match `sources`, else None."""
    try:
        raw = read_back(folder / f"{stem}.vocab.json", "json")
        vocab = json.loads(raw)
    except (OSError, ValueError):
        return None
    if not isinstance(vocab, list) or vocab[:2] != [UNK, EOS]:
        return None
    vocab_sha1 = hashlib.sha1(raw).hexdigest()
    splits, digests = {}, [vocab_sha1]
    for split in WIKITEXT_SPLITS:
        meta = _expected_meta(stem, WIKITEXT_TOKENIZER, split, sources, vocab_sha1=vocab_sha1)
        read = _read_split(folder, stem, split, meta, len(vocab))
        if read is None:
            return None
        splits[split] = read[0]
        digests.append(read[1])
    return splits, vocab, hashlib.sha256(" ".join(digests).encode()).hexdigest()


# ---- TinyStories

def load_tinystories(data_dir: str | os.PathLike, version: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
                     cache_dir: str | os.PathLike | None = None) -> dict:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    version, files = find_tinystories_files(data_dir, version)
    stem = f"tinystories-{version}"
    candidates = _cache_candidates(data_dir, cache_dir)
    out: dict = {}
    known, digests = _known_sources(candidates, stem), []
    for split in TINYSTORIES_SPLITS:
        path = files[split]
        meta = _expected_meta(stem, TINYSTORIES_TOKENIZER, split, [_source_signature(path, known)])
        empty = (f"TinyStories file {path} contains no stories (nothing but whitespace and "
                 f"<|endoftext|> lines); re-download it from {TINYSTORIES_URL}")
        out[split], digest = _read_or_build(
            candidates, lambda f: _read_split(f, stem, split, meta, BYTE_VOCAB_SIZE),
            lambda f: _write_split(f, stem, split, meta, iter_tinystories_tokens(path, chunk_size),
                                   BYTE_VOCAB_SIZE, empty))
        digests.append(digest)
    return {**out, "data_hash": hashlib.sha256(" ".join(digests).encode()).hexdigest(), "vocab_size": BYTE_VOCAB_SIZE,
            "decode": decode_bytes, "source": f"TinyStories {version} ({files['train'].name}, {files['valid'].name}) "
                                              f"in {files['train'].parent}"}


def find_tinystories_files(data_dir: str | os.PathLike, version: str = "auto") -> tuple[str, dict[str, Path]]:
    """Locate the train/valid text files; returns (version, {split: path})."""
    data_dir = Path(data_dir)
    versions = _choices(version, TINYSTORIES_VERSIONS, "TinyStories version")
    folders = (data_dir, data_dir / "TinyStories")
    for name in versions:
        prefix = TINYSTORIES_VERSIONS[name]
        for folder in folders:
            files = {split: folder / f"{prefix}-{split}.txt" for split in TINYSTORIES_SPLITS}
            if all(path.is_file() for path in files.values()):
                return name, files
    wanted = " or ".join(f"{TINYSTORIES_VERSIONS[v]}-{{train,valid}}.txt" for v in versions)
    raise DataError(f"TinyStories not found: looked for {wanted} in {folders[0]} and {folders[1]}; fetch the V2 "
                    f"files with `python train.py download tinystories --data {data_dir}` (from {TINYSTORIES_URL})")


def _split_separator_lines(block: bytes) -> Iterator[bytes | None]:
    """Text between separator lines of `block`, with None for each separator line."""
    start = 0
    for match in _SEPARATOR_LINE.finditer(block):
        if match.start() > start:
            yield block[start : match.start()]
        yield None
        start = match.end()
    if start < len(block):
        yield block[start:]


def iter_line_blocks(path: Path, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes]:
    """Read `path` in `chunk_size`-byte chunks; yield blocks of complete lines. A line cut by a
    chunk boundary (a separator or a multi-byte UTF-8 character included) is carried to the next
    block; a final line without "\\n" gets one. Memory: about `chunk_size` plus the longest line."""
    pending = b""
    with open_back(path) as f:
        while chunk := f.read(chunk_size):
            buffer = pending + chunk
            cut = buffer.rfind(b"\n") + 1
            pending = buffer[cut:]
            if cut:
                yield buffer[:cut]
    if pending:
        yield pending + b"\n"


def iter_tinystories_tokens(path: Path, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[np.ndarray]:
    """Stream the byte-level tokens of a TinyStories file as uint16 arrays of about one chunk each; concatenated, each
    non-empty story's stripped UTF-8 bytes then `EOT_ID`. State carried across blocks: `started`, the current story has
    non-whitespace content; `held`, its trailing whitespace, emitted only if content follows (no story is buffered)."""
    started, held = False, b""
    for block in iter_line_blocks(path, chunk_size):
        content = bytearray()
        eot_positions: list[int] = []
        for piece in _split_separator_lines(block):
            if piece is None:  # separator line: close the story, if any
                if started:
                    eot_positions.append(len(content))
                started, held = False, b""
                continue
            if not started:
                piece = piece.lstrip()
                if not piece:
                    continue
                started = True
            text = held + piece
            body = text.rstrip()
            held = text[len(body):]
            content += body
        tokens = np.insert(np.frombuffer(content, dtype=np.uint8).astype(np.uint16), eot_positions, EOT_ID)
        if tokens.size:
            yield tokens
    if started:                 # an unterminated last story still gets its end-of-text id
        yield np.array([EOT_ID], dtype=np.uint16)


def decode_bytes(ids: Iterable[int]) -> str:
    """Byte ids to text (invalid UTF-8 replaced by U+FFFD); `EOT_ID` renders as `EOT_TEXT`."""
    parts: list[str] = []
    buffer = bytearray()
    for i in map(int, ids):
        if i == EOT_ID:
            parts.append(buffer.decode("utf-8", errors="replace") + EOT_TEXT)
            buffer.clear()
        elif 0 <= i < 256:
            buffer.append(i)
        else:
            raise ValueError(f"token id {i} is outside the byte vocabulary (0..{EOT_ID})")
    parts.append(buffer.decode("utf-8", errors="replace"))
    return "".join(parts)


# ---- the token cache

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _cache_candidates(data_dir: str | os.PathLike, cache_dir: str | os.PathLike | None) -> list[Path]:
    return [Path(cache_dir)] if cache_dir is not None else default_cache_dirs(data_dir)


def _known_sources(candidates: list[Path], stem: str) -> list[dict]:
    """The source signatures that the token caches of `stem` in `candidates` recorded (to reuse their hashes)."""
    known = []
    for folder in candidates:
        for meta_path in sorted(folder.glob(f"{glob.escape(stem)}.*.json")):
            try:
                known += [s for s in read_json(meta_path)["sources"] if isinstance(s, dict)]
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return known


def _expected_meta(stem: str, tokenizer: str, split: str, sources: list[dict], **extra) -> dict:
    """The meta fields a valid cache must match exactly."""
    return {"format": CACHE_FORMAT, "corpus": stem, "tokenizer": tokenizer, "split": split, "sources": sources, **extra}


def _split_paths(folder: Path, stem: str, split: str) -> tuple[Path, Path]:
    return folder / f"{stem}.{split}.bin", folder / f"{stem}.{split}.json"


def _read_split(folder: Path, stem: str, split: str, expected: dict, vocab_size: int) -> tuple[np.memmap, str] | None:
    """(the cached split as a read-only memmap (N,), the sha256 of its tokens), or None if absent, stale or damaged."""
    bin_path, meta_path = _split_paths(folder, stem, split)
    try:
        meta = read_json(meta_path)
        if any(meta.get(key) != value for key, value in expected.items() if key != "sources"):
            return None
        if not _same_sources(meta.get("sources"), expected["sources"]) or not isinstance(meta.get("sha256"), str):
            return None
        dtype = token_dtype(vocab_size)
        if meta.get("dtype") != dtype.name or meta.get("vocab_size") != vocab_size:
            return None
        count = meta["count"]
        if not isinstance(count, int) or count < 1 or bin_path.stat().st_size != count * dtype.itemsize:
            return None
        return np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,)), meta["sha256"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_split(folder: Path, stem: str, split: str, meta: dict, arrays: Iterable[np.ndarray],
                 vocab_size: int, empty_message: str) -> None:
    """Stream `arrays` into the split's .bin (none: a DataError, `empty_message`), then its meta (+ count, sha256)."""
    bin_path, meta_path = _split_paths(folder, stem, split)
    dtype = token_dtype(vocab_size)
    count, digest = 0, hashlib.sha256()
    with atomic_output(bin_path) as f:
        for array in arrays:
            block = np.ascontiguousarray(array, dtype=dtype).tobytes()
            f.write(block)
            digest.update(block)
            count += len(array)
        if count == 0:
            raise DataError(empty_message)
    full_meta = {**meta, "dtype": dtype.name, "byteorder": "little", "count": count,
                 "vocab_size": vocab_size, "sha256": digest.hexdigest()}
    atomic_write(meta_path, json.dumps(full_meta, indent=1).encode("utf-8"))


def lm_patterns(context: int, n_heads: int) -> torch.Tensor:
    """(H, N, N) bool: the causal distance prior, hard, for the QK inits and the probe: head h keeps the keys within
    1 / slope_h tokens behind (ALiBi slopes 2^(-8h/H): 4, 16, 64, 256 for 4 heads), where log sigmoid(M) > -1."""
    i = torch.arange(context)
    d = i[:, None] - i[None, :]
    return (d[None] >= 0) & (d[None] <= (1.0 / mp.alibi_slopes(n_heads)).ceil().long()[:, None, None])


@dataclass(kw_only=True)
class LMTask(Task):
    """Next-token prediction on random context windows, evaluated on the whole validation split; prior: ALiBi-like M."""
    KIND = "lm"
    PATTERNS = ("distance",)
    DEFAULT_PATTERN = "distance"
    HEADLINE = ("val_loss", "val_ppl")
    PRESETS = {
        # the prior is a relative-distance M (a logit per head and distance; --mask-param full: the paper's N x N M):
        # not worse on the stand-in corpus (results/README.md), and it scales with the context; small: ~3 min on a core
        "small": {"model": dict(mask_param="relative", layers=4, heads=4, dim=128, mlp_dim=512, emb_init_std=0.02,
                                pos_init_std=0.02, qkv_bias=True, context=64, dropout=0.1),
                  "recipe": dict(val_tokens=10_000, optimizer="adamw", lr=1e-3, weight_decay=0.1, betas="0.9,0.95",
                                 batch_size=16, schedule="cosine", warmup=40, steps=400, grad_clip=1.0, log_every=20)},
        # nanoGPT-like: 6 layers, 6 heads, width 384, context 256, AdamW 6e-4, cosine, dropout 0.2
        "paper": {"model": dict(mask_param="relative", layers=6, heads=6, dim=384, mlp_dim=1536, emb_init_std=0.02,
                                pos_init_std=0.02, qkv_bias=True, context=256, dropout=0.2),
                  "recipe": dict(optimizer="adamw", lr=6e-4, weight_decay=0.1, betas="0.9,0.95", batch_size=64,
                                 schedule="cosine", warmup=200, steps=10000, grad_clip=1.0, log_every=500)},
    }
    MUST: ClassVar[dict] = {
        "context": Must("at least 2", lambda v: v >= 2),
        "positions": Must("learned or none", lambda v: v in ("learned", "none")),
        "eval_context": Must("0 (off) or at least 2 tokens", lambda v: v == 0 or v >= 2),
        "val_tokens": Must(">= 0 (0 = the whole split)", lambda v: v >= 0),
    }

    data_dir: str | None = None
    context: int = 128
    heads: int = 4
    val_tokens: int = 0                 # 0: the whole validation split; else its first val_tokens tokens
    positions: str = "learned"          # the positional embedding: a learned table, or none (any length)
    eval_context: int = 0               # also evaluate on windows of this many tokens (0: only the context)
    mask_window: int | None = None      # the relative M's distances (default: the context)
    seed: int = 0
    find_files: ClassVar[Callable]      # data_dir -> (its release, {split: path}) (`locate`)

    def __post_init__(self):
        _required_dir(self.data_dir, self.name)
        self.check_options()
        if self.positions == "learned" and self.eval_context > self.context:
            raise TaskError(f"--eval-context {self.eval_context} is past --context {self.context}, which a learned "
                            "positional table cannot serve: give --positions none (the order from the causal mask "
                            f"and the prior, as ALiBi), or an --eval-context up to {self.context}")
        if self.mask_window is not None and not 1 <= self.mask_window <= self.context:
            raise TaskError(f"--mask-window must be in 1 .. --context ({self.context}), got {self.mask_window}")
        self.vocab_size = None

    def setup(self, device="cpu"):
        corpus = load_lm_corpus(self.NAME, self.data_dir)
        self.train, self.valid = corpus["train"], corpus["valid"]
        if self.val_tokens:
            self.valid = self.valid[:self.val_tokens]
        self.vocab_size, self.decode, self.vocab = corpus["vocab_size"], corpus["decode"], corpus.get("vocab")
        self._data_hash = corpus["data_hash"]
        _check_context(self.context, len(self.train), "training")
        for flag, n in (("--context", self.context), ("--eval-context", self.eval_context or self.context)):
            _check_context(n, len(self.valid), "validation", flag)
        self.device = torch.device(device)
        return self

    @classmethod
    def locate(cls, data_dir):
        """The release `find_files` finds, once each of its splits is a non-empty regular file (`release_file`)."""
        release, files = cls.find_files(_required_dir(data_dir, cls.NAME))
        for path in files.values():
            release_file(str(path), cls.NAME)
        return release

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (words of the corpus vocabulary, or UTF-8 bytes)."""
        return list(text.encode("utf-8")) if self.vocab is None else encode_words(text.split(), self.vocab).tolist()

    @torch.no_grad()
    def continue_text(self, model, prompt: str, n: int, temperature: float, top_k: int, generator) -> str:
        """`prompt` and `n` tokens `model` writes after it (`mp.generate`: temperature 0 greedy; top_k 0 all)."""
        ids = self.encode(prompt)
        if not ids:
            raise TaskError(f"--sample: the prompt {prompt!r} gives no tokens")
        out = mp.generate(model, torch.tensor([ids], device=self.device), n, temperature, top_k
                          or None, generator=generator)
        sep = " " if self.vocab is not None else ""                 # words are joined by spaces, bytes are not
        return self.decode(ids) + sep + self.decode(out[0, len(ids):].tolist())

    def arch(self) -> dict:
        if self.vocab_size is None:
            raise TaskError("LMTask.arch() needs setup() first: the vocabulary comes from the data")
        return {"vocab_size": self.vocab_size, "seq_len": self.context, "n_outputs": self.vocab_size,
                "readout": "tokens", "causal": True, "tie_embeddings": True, "positions": self.positions}

    def build_pattern(self, variant: str) -> torch.Tensor:
        return lm_patterns(self.context, self.heads)

    def mask_logits(self, variant: str | None, m_on: float, m_off: float) -> torch.Tensor:
        """Initial M with log sigmoid(M) = -slope_h * distance on the past (ALiBi-like; the causal mask removes the
        future). No on / off levels: train.py keeps --mask-on / --mask-off to the other families (here: defaults)."""
        self.pattern_name(variant)
        return mp.causal_distance_logits(self.mask_window or self.context, self.heads)

    def steps_per_epoch(self, batch_size: int) -> int:
        return max(1, len(self.train) // (batch_size * self.context))

    def train_batch(self, step: int, batch_size: int):
        """Random windows of a step, deterministic in (seed, step): (x, y) int64 (B, context)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x, y = random_windows(self.train, self.context, batch_size, g)
        return x.to(self.device), y.to(self.device)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())

    def probe_inputs(self, n: int = 64) -> torch.Tensor:
        return next(eval_windows(self.valid, self.context, max(1, min(n, 16))))[0].to(self.device)     # (B, context)

    TEACHER_KINDS = ("relative", "pattern", "logits")
    TEACHER_MIN_FIT = 0.2

    def teacher_inputs(self, n: int = 64) -> torch.Tensor:
        return next(eval_windows(self.train, self.context, max(1, min(n, 16))))[0].to(self.device)     # (B, context)

    def teacher_fit(self, model, n: int) -> float:
        x, y = next(eval_windows(self.train, self.context, max(1, min(n, 16))))
        return float((model(x.to(self.device)).argmax(-1) == y.to(self.device)).float().mean())

    def teacher_prior(self, attn, kind, ratio, m_on, m_off):
        """Per head and distance by default (`mp.relative_from_attention`): the form of `--mask-param relative`'s M."""
        if kind == "relative":
            return self._soft(mp.relative_from_attention(attn, m_on, m_off, causal=True))
        return super().teacher_prior(attn, kind, ratio, m_on, m_off)

    @torch.no_grad()
    def evaluate(self, model, points: int | None = None, batch_size: int = 32) -> dict:
        """Mean next-token loss over every token of the validation split (or --val-tokens), in windows of the
        training context; with --eval-context N also in windows of N tokens (long_val_loss, long_val_ppl)."""
        out = {}
        for name, context in (("val", self.context), ("long_val", self.eval_context)):
            if not context:
                continue
            total, count = 0.0, 0
            for x, y in eval_windows(self.valid, context, max(1, batch_size * self.context // context)):
                logits = model(x.to(self.device)).float()
                total += float(F.cross_entropy(logits.flatten(0, 1), y.to(self.device).flatten(), reduction="sum"))
                count += y.numel()
            out[f"{name}_loss"] = total / count
            out[f"{name}_ppl"] = math.exp(min(total / count, 50.0))
        return out


@register("wikitext2")
class WikiText2(LMTask):
    """WikiText-2 (word level; the .tokens or the raw release) in --data-dir."""
    find_files = staticmethod(find_wikitext_files)


@register("tinystories")
class TinyStories(LMTask):
    """TinyStories (V2 or V1 text files, byte level) in --data-dir."""
    PRESETS = {"paper": {"model": dict(dropout=0.0), "recipe": dict(steps=20000, log_every=1000, val_tokens=2_000_000)}}
    find_files = staticmethod(find_tinystories_files)
