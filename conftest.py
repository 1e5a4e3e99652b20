"""Helpers, fixtures and constants that several test files use: each test file imports the ones it uses by name
(`from conftest import ...`); pytest finds the fixtures here by itself. A helper used by one file lives in that file."""
import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import shutil
import signal
import struct
import runpy
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import datafetch.write
import maskprior as mp
import tasks
import runconfig
import train

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (the README's): a worker a core, each on one thread, and
    os.environ["OMP_NUM_THREADS"] = "1"    # so are the processes it starts (two workers of two threads each on two
    torch.set_num_threads(1)               # cores spent 864 CPU-s where one thread each spends about 450)


@pytest.fixture(autouse=True, scope="module")
def _one_blas_thread():
    """numpy's BLAS (OpenBLAS) on one thread while these tests run: on a 2-core machine doing other work its threads
    and torch's contend, and the min-degree interpolator's least squares (cyclic3: 576 monomials, in every cyclic3
    run) took 2 to 5 times as long as on one (idle, one is as fast). torch's threads are left as they are (runs
    compared bitwise keep their thread count)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:             # scikit-learn's dependency (the test extra); without it, BLAS as it was
        yield
        return
    with threadpool_limits(1, user_api="blas"):
        yield


LM_SMALL = ["--layers", "1", "--dim", "32", "--heads", "4", "--mlp-dim", "64", "--context", "16",
            "--batch-size", "16", "--probe-size", "4"]


SMALL = ["--layers", "1", "--dim", "32", "--heads", "2", "--mlp-dim", "32", "--batch-size", "32", "--probe-size", "32"]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


TINY = ["--task", "parity2", "--layers", "1", "--dim", "16", "--heads", "2", "--mlp-dim", "16", "--batch-size", "32",
        "--probe-size", "16", "--eval-points", "256"]


def _write_text_corpus(folder, n_articles=24):
    rng = np.random.default_rng(0)
    nouns, verbs = ["cat", "dog", "bird", "fox"], ["sat", "ran", "slept"]
    arts = []
    for i in range(n_articles):          # templated sentences: learnable in a few dozen steps
        paras = [" ".join(f"the {rng.choice(nouns)} {rng.choice(verbs)} on the mat ." for _ in range(3))
                 for _ in range(20)]
        arts.append((f"Story {i % 3}", paras))
    return datafetch.write.write_wikitext_layout(arts, str(folder), min_count=1)


@pytest.fixture
def text_dir(tmp_path):
    """A small WikiText-2 word-level release in a fresh folder."""
    _write_text_corpus(tmp_path / "text")
    return str(tmp_path / "text")


def _images(n, seed=0, size=32):
    return np.random.default_rng(seed).integers(0, 256, (n, 3, size, size), dtype=np.uint8)


def run_train(tmp_path, *args, name="run"):
    out = os.path.join(tmp_path, name)
    return train.main(["--out", out, *map(str, args)]), out


class _Touch:
    """A pickle payload that, unpickled, would create `path` (with the shell, or from Python)."""

    def __init__(self, path, how="system"):
        self.path, self.how = str(path), how

    def __reduce__(self):
        if self.how == "system":
            return (os.system, (f"touch {self.path}",))
        if self.how == "eval":
            return (eval, (f"open({self.path!r}, 'w').close()",))
        return (subprocess.call, (["touch", self.path],))


def _tree(folder) -> dict | None:
    """Every path under `folder` (hidden ones and folders too; None for a folder or link) with its bytes, None where
    there is no folder: a folder 'as it was' compares equal."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))} if folder.exists() else None


@pytest.fixture
def image_dir(tmp_path):
    """A small CIFAR-10 python release (40 train, 8 test images) in a fresh folder."""
    x, y = _images(40), np.arange(40) % 10
    datafetch.write.write_cifar10_python(str(tmp_path / "cifar"), x, y, x[:8], y[:8])
    return str(tmp_path / "cifar")


@contextlib.contextmanager
def _deadline(seconds: int):
    """Fail the test (instead of hanging it) when the body takes longer than `seconds`."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory):
    """trained_once(out, *argv): the run `train.py ARGV --out OUT` makes, trained once in this module per ARGV and
    folder name, then copied to OUT (a run folder moved there, which resumes and reports as any: the tests that
    break a fresh run in each of their cases break a copy of one)."""
    cache, made = tmp_path_factory.mktemp("trained-once"), {}

    def trained(out, *argv) -> str:
        key = (os.path.basename(out), tuple(map(str, argv)))
        if key not in made:
            made[key] = str(cache / str(len(made)) / key[0])
            assert train.main([*key[1], "--out", made[key]]) == 0
        shutil.copytree(made[key], out)
        return str(out)
    return trained


def _train(out, *argv, once=None) -> str:
    """`train.py ARGV --out OUT` (or a copy of it: `once` is trained_once), which must succeed; OUT."""
    if once is not None:
        return once(out, *argv)
    assert train.main([*map(str, argv), "--out", str(out)]) == 0
    return str(out)


def _fake_result(task, init, seed, metrics, tag="", **flags) -> dict:
    """result.json as train.py writes it, for a run of `task`, `init`, `seed` with `flags` (the rest at the defaults):
    what tells it apart, the init's place in INITS, a run id, no data files, whether it sits at its preset."""
    config = {**runconfig.DEFAULTS, "task": task, "init": init, "seed": seed, **flags}
    preset = runconfig.resolve(*train.parse_args(["--task", task]))
    return {"task": task, "kind": tasks.TASKS[task].KIND, "init": init, "seed": seed, "preset": "small",
            "run_id": hashlib.sha256(f"{task}{init}{seed}{tag}{flags}".encode()).hexdigest()[:32], "data": None,
            "init_order": list(runconfig.INITS).index(init), "metrics": metrics,
            "tells_apart": {k: v for k, v in config.items() if k not in runconfig.NOT_TELLING_APART},
            "at_preset": all(config[k] == getattr(preset, k) for k in flags if k in runconfig.ARCH)}


def _fake_run(folder, task, init, seed, acc, kind="boolean", masses=(0.9, 0.8), tag="", readout="cls", pos=0.5,
              **flags):
    """A run directory as train.py writes it: result.json and metrics.jsonl (drift grows 0, 0.1, 0.2, ...)."""
    d = folder / f"{task}-{init}-s{seed}{tag}"
    d.mkdir(parents=True)
    metrics = {"acc": acc, "acc_unseen": 0.0, "mse_unseen": 1.0, "mdi_acc": 0.75,
               "prior_mass_start": masses[0], "prior_mass_end": masses[-1]}
    (d / "result.json").write_text(json.dumps({**_fake_result(task, init, seed, metrics, tag, readout=readout,
                                                              pos_init_std=pos, **flags), "kind": kind,
                                               "config": {"readout": readout, "pos_init_std": pos}}))
    drift = "mask_drift" if init == "mask" else "qk_drift"
    (d / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "step": 10 * i,
                    "metrics": {},
                    "prior_mass": [m, m],
                    "prior_mass_mean": m,
                    drift: [0.1 * i, 0.1 * i],
                    "content_margin": [i, 2 * i],
                }
            )
            + "\n"
            for i, m in enumerate(masses)
        )
    )
    return d


@contextlib.contextmanager
def _small_disk(path, size="100k", read_only=False):
    """A tmpfs of `size` mounted at `path` (read-only if asked), unmounted after; the test is skipped, with the
    reason, where this machine cannot mount one (not root, no mount)."""
    path.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""), "tmpfs",
                            str(path)], capture_output=True, text=True)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the full-disk and read-only cases need one")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the full-disk and read-only cases need one")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def _running(*calls, timeout=120):
    """Each (argv, Popen keywords) of `calls` started at once, the body run in this process meanwhile (independent
    work: on two cores the Python starts overlap it), then the list yielded filled with each call's CompletedProcess
    (text stdout and stderr), in the order given, as subprocess.run gives it."""
    procs, done = [], []
    try:
        for argv, kw in calls:
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw))
        yield done
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _at_once(*calls, timeout=120) -> list:
    """subprocess.run of each (argv, Popen keywords) of `calls`, all started at once (_running, with nothing beside)."""
    with _running(*calls, timeout=timeout) as done:
        pass
    return done


def _wait_for(condition, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        time.sleep(0.3)
    return condition()


def _extra(name: str):
    """A test-only library (timm, transformers): skipped where it is not installed, but a failure where
    MASKPRIOR_REQUIRE_EXTRAS is set (.ci/run sets it, so CI never skips these tests in silence)."""
    if os.environ.get("MASKPRIOR_REQUIRE_EXTRAS"):
        import importlib
        return importlib.import_module(name)
    return pytest.importorskip(name)


def _past(m: torch.Tensor) -> torch.Tensor:
    """Logits `m` (..., n, n) for a causal prior: -5 on the future (a causal prior refuses an M > 0 there that
    varies)."""
    return m.masked_fill(mp.future_keys(m.shape[-1]), -5.0)


class _Py2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle wrote the CIFAR batches: protocol 2, every str and bytes an 8-bit string
    (SHORT_BINSTRING / BINSTRING; Python 3 writes bytes through _codecs.encode), numpy's functions under
    numpy.core (numpy 2 names numpy._core)."""
    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        n = len(data)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) + data if n < 256 else
                   pickle.BINSTRING + struct.pack("<i", n) + data)
        self.memoize(obj)

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode("ascii"))
        self.memoize(obj)

    dispatch[bytes] = dispatch[str] = save_bytes


def _py2_dumps(d) -> bytes:
    f = io.BytesIO()
    _Py2Pickler(f, protocol=2).dump(d)
    return f.getvalue()


def _py2_pickle(path, d):
    """What a CIFAR / Imagenet32 batch file holds, as Python 2 wrote it: a dict with bytes keys (`_Py2Pickler`)."""
    Path(path).write_bytes(_py2_dumps(d))


def _imagenet_dir(tmp_path, suffix=""):
    """A downsampled-ImageNet layout: map_clsloc.txt (1000 wnids, 1-based labels) and batches
    whose labels are 1-based; two of the ImageNet-100 classes and one other class present."""
    root = tmp_path / ("in" + suffix)
    root.mkdir()
    others = [f"n9{i:07d}" for i in range(1000 - 100)]
    wnids = sorted(list(tasks.IMAGENET100_WNIDS) + others)
    (root / "map_clsloc.txt").write_text("".join(f"{w} {i} name_{i}\n" for i, w in enumerate(wnids, 1)))
    lab = {w: i for i, w in enumerate(wnids, 1)}
    want = [lab[tasks.IMAGENET100_WNIDS[0]], lab[tasks.IMAGENET100_WNIDS[99]], lab[others[0]]]

    def write(name, n):
        x, y = _images(3 * n, n).reshape(3 * n, -1), want * n
        if suffix:
            np.savez(root / f"{name}.npz", data=x, labels=np.array(y))
        else:
            _py2_pickle(root / name, {b"data": x, b"labels": y, b"mean": np.zeros(3072)})
    for i in range(1, 11):
        write(f"train_data_batch_{i}", 1)
    write("val_data", 2)
    return root


# Corpus readers: small files in the real WikiText-2 / TinyStories layouts.

# wiki.*.tokens: a leading " " line, " = Title = " headings, blank " " lines,
# @,@ / @.@ / @-@ and <unk> tokens, a trailing space before each newline.
WIKI_TRAIN = (
    " \n"
    " = Robert Boulter = \n"
    " \n"
    " Robert Boulter is an English film , television and theatre actor . He had a <unk> role in 2000 . \n"
    " \n"
    " = = Career = = \n"
    " \n"
    " In 2006 @-@ 07 , Boulter starred in 1 @,@ 000 shows ; it cost 3 @.@ 5 million . \n"
    " \n"
)


WIKI_VALID = " \n = Career = \n \n Boulter had a <unk> role . \n"


WIKI_TEST = " \n = = Career = = \n He starred in 2000 . \n"


# wiki.*.raw: same shape, but real words with punctuation and no <unk>.
RAW_TRAIN = " \n = Robert Boulter = \n \n Robert Boulter is an English actor. He starred in 2000.\n"


RAW_VALID = " \n Boulter is an unseenword actor.\n"


RAW_TEST = " Robert is an actor.\n"


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        text = text.encode("utf-8")
    path.write_bytes(text)
    return path


def make_wikitext(root: Path, release: str = "tokens", train=None, valid=None, test=None) -> Path:
    sub, ext = tasks.WIKITEXT_RELEASES[release]
    texts = (WIKI_TRAIN, WIKI_VALID, WIKI_TEST) if release == "tokens" else (RAW_TRAIN, RAW_VALID, RAW_TEST)
    for split, default, given in zip(("train", "valid", "test"), texts, (train, valid, test)):
        write(root / sub / f"wiki.{split}{ext}", default if given is None else given)
    return root / sub


STORIES = (
    "Once upon a time, a “Lily” saw a café.\n"
    "\n"
    "She said, “Hi!” He wrote <|endoftext|> on a card.\n"
    "<|endoftext|>\n"
    "Tom ran.\n"
    "<|endoftext|>\n"
    "\n"
    "  <|endoftext|>  \n"
    "Ben was very happy é.\n"
    "<|endoftext|>\n"
    "Last story with no separator after it.\n"
)


VALID_STORIES = "A small dog.\n<|endoftext|>\nThe end “now”.\n<|endoftext|>\n"


def make_tinystories(root: Path, prefix: str = "TinyStoriesV2-GPT4", train=STORIES, valid=VALID_STORIES) -> Path:
    write(root / f"{prefix}-train.txt", train)
    write(root / f"{prefix}-valid.txt", valid)
    return root


def _resolved(argv):
    return runconfig.resolve(*train.parse_args(argv))


BAD_INPUT = [
    (["--task", "nosuch"], "unknown task"),
    (["--init", "nosuch"], "unknown init"),
    (["--preset", "nosuch"], "unknown preset"),
    (["--steps", "0"], "--steps must be an integer > 0"),
    (["--steps", "-5"], "--steps must be an integer > 0"),
    (["--batch-size", "0"], "--batch-size must be an integer > 0"),
    (["--epochs", "0"], "--epochs must be a finite number > 0"),
    (["--epochs", "nan"], "--epochs must be a finite number > 0"),
    (["--epochs", "inf"], "--epochs must be a finite number > 0"),
    (["--steps", "ten"], "invalid int value"),
    (["--steps", "5", "--epochs", "1"], "either --steps or --epochs"),
    (["--init", "mimetic"], "does not apply"),
    (["--init", "mask-impulse"], "init 'mask-impulse' does not apply to task parity2 (boolean)"),
    (["--task", "multiplication", "--lee-samples", "3000"], "give --digits 2 (got --digits 3)"),
    (
        ["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--data-frac", "0.3"],
        "leave --data-frac out",
    ),
    (
        ["--task", "multiplication", "--digits", "2", "--lee-samples", "99"],
        "--lee-samples must be an integer in 100 ..",
    ),
    (
        ["--task", "multiplication", "--digits", "2", "--lee-samples", "0"],
        "--lee-samples must be an integer in 100 .. 10,000",
    ),
    (
        ["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--init", "qk-svd"],
        "which a QK prior fitted on fixed positions cannot follow",
    ),
    (
        ["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--pattern", "partial"],
        "with --lee-samples has no pattern 'partial'",
    ),
    (["--task", "addition", "--lee-samples", "3000"], "--lee-samples does not apply to task addition"),
    (["--task", "kparity", "--bits", "0,40"], "--bits: '40' is not an integer in 0..14"),
    (
        ["--task", "kparity", "--bits", "random:15", "--unseen", "bits:2"],
        "is a least-squares problem in 32,768 monomials",
    ),
    (["--task", "kmajority", "--bits", "random:11", "--n-bits", "15"], "at most 1,024 are solved"),
    (["--task", "kmajority", "--train-size", "-1"], "--train-size must be a positive number"),
    (["--task", "kmajority", "--train-size", "0"], "--train-size must be a positive number"),
    (
        [
            "--task",
            "kmajority",
            "--bits",
            "1,4,8,10,13",
            "--unseen",
            "1,4",
            "--train-size",
            "12",
            "--init",
            "mask",
            "--pattern",
            "discovered",
        ],
        "too few points to find a pattern in",
    ),
    (
        [
            "--task",
            "ksum",
            "--terms",
            "0,1:m2,3,4",
            "--readout",
            "mean",
            "--train-size",
            "60",
            "--init",
            "mask",
            "--pattern",
            "discovered",
            "--discover-degree",
            "1",
        ],
        "names no pair of tokens beyond each token itself",
    ),
    (["--task", "ksum", "--terms", "0,1:0,1"], "the term '0,1' is given twice"),
    (
        ["--init", "mask", "--prior-from", "nowhere", "--teacher-min-fit", "1.5"],
        "--teacher-min-fit must be a finite number in [0, 1]",
    ),
    (["--pattern", "nosuch"], "has no pattern"),
    (["--pattern", ""], "--pattern needs a name; parity2's patterns are clique, cls"),
    (["--readout", "mean", "--pattern", "cls"], "pattern 'cls' needs --readout cls"),
    (["--task", "cyclic3", "--readout", "mean", "--pattern", "band-only"], "needs --readout cls"),
    (["--readout", "tokens"], "--readout for parity2 must be one of cls, mean, got 'tokens'"),
    (["--task", "addition", "--readout", "mean"], "--readout does not apply to task addition"),
    (["--task", "addition", "--readout", "mean", "--init", "mask"], "--readout does not apply"),
    (["--task", "wikitext2", "--data-dir", ".", "--eval-points", "100"], "applies only to the boolean and arithmetic"),
    (["--eval-points", "-1"], "--eval-points must be an integer >= 0"),
    (["--lr", "0"], "--lr must be a finite number > 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0"),
    (["--lr", "nan"], "--lr must be a finite number > 0"),
    (["--grad-clip", "nan"], "--grad-clip must be a finite number >= 0"),
    (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
    (["--warmup", "-5"], "--warmup must be an integer >= 0"),
    (["--init", "mask", "--mask-on", "nan"], "--mask-on must be a finite number >= 0"),
    (["--init", "mask", "--mask-off", "-5"], "--mask-off must be a finite number >= 0"),
    (["--init", "qk-opt", "--qk-opt-steps", "-1"], "--qk-opt-steps must be an integer > 0"),
    (["--init", "qk-svd", "--qk-svd-scale", "inf"], "--qk-svd-scale must be a finite number > 0"),
    (["--dropout", "2"], "--dropout must be a finite number in [0, 1)"),
    (["--head-dim", "-1"], "--head-dim must be an integer > 0"),
    (["--emb-init-std", "-1"], "--emb-init-std must be a finite number >= 0"),
    (["--probe-size", "0"], "--probe-size must be an integer > 0"),
    (["--seed", "-1"], "--seed must be an integer in 0 .. 4294967295"),
    (["--halt-after", "0"], "--halt-after must be an integer > 0"),
    (["--betas", "0.9"], "--betas must be two numbers"),
    (["--device", "meta"], "is not a device to train on"),
    (["--device", "nonsense"], "is not a device to train on"),
    (["--device", "mps"], "torch sees no Apple GPU"),
    (["--task", "wikitext2", "--data-dir", ".", "--context", "0"], "--context must be at least 2"),
    (
        ["--task", "wikitext2", "--data-dir", ".", "--positions", "none", "--init", "qk-svd"],
        "--init qk-svd fits its pattern on the positional embedding, which --positions none leaves out",
    ),
    (
        [
            "--task",
            "wikitext2",
            "--data-dir",
            ".",
            "--positions",
            "none",
            "--eval-context",
            "128",
            "--init",
            "mask",
            "--mask-param",
            "full",
        ],
        "which a full M (N x N) cannot serve: give --mask-param relative",
    ),
    (
        ["--task", "wikitext2", "--data-dir", ".", "--init", "mask", "--mask-off", "3"],
        "--mask-off applies only to the boolean and arithmetic and vision tasks (this task is lm)",
    ),
    (["--task", "parity2", "--train-size", "100"], "--train-size does not apply to task parity2"),
    (["--task", "parity2", "--data-frac", "0.1"], "--data-frac does not apply"),
    (["--task", "addition", "--data-frac", "2"], "--data-frac must be in (0, 1]"),
    (["--sample", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--sample", "hi"], "--sample: no checkpoint"),
    (["--resume"], "--resume: no checkpoint"),
]


if torch.backends.mps.is_available():                   # the machine has the Apple GPU that case asks for
    BAD_INPUT.remove((["--device", "mps"], "torch sees no Apple GPU"))


def _torchrun_call(*args, n=2) -> tuple:
    """`python -m torch.distributed.run --standalone --nproc_per_node N train.py ARGS`, one thread a process, as a
    call for _at_once or _running."""
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
             os.path.join(HERE, "train.py"), *map(str, args)], {"env": {**os.environ, "OMP_NUM_THREADS": "1"}})


@pytest.fixture(scope="module")
def _interpolators():
    return {}


@pytest.fixture
def interpolator_once(monkeypatch, _interpolators):
    """tasks.min_degree_interpolator remembered, in this module, by the bytes of what it is given: the runs of one
    target (cyclic3's: 576 monomials on 15 bits, seconds a run) solve it once, and each gets a copy of that answer."""
    real = tasks.min_degree_interpolator

    def remembered(*arrays, max_degree=None):
        key = (max_degree, *((a.dtype.str, a.shape, a.tobytes()) for a in map(np.asarray, arrays)))
        if key not in _interpolators:
            _interpolators[key] = real(*arrays, max_degree=max_degree)
        return copy.deepcopy(_interpolators[key])
    monkeypatch.setattr(tasks, "min_degree_interpolator", remembered)


def _edit_json(path, change):
    data = json.load(open(path))
    change(data)
    open(path, "w").write(json.dumps(data))


def _write_layout(data: Path, layout: str) -> str:
    """One release layout a reader reads, written small under DATA (where reproduce.sh's --data points); returns
    the folder the task's --data-dir names."""
    if layout.startswith("cifar10 "):
        if layout == "cifar10 python":
            datafetch.write.write_cifar10_python(str(data), _images(10), np.arange(10), _images(4), np.arange(4))
        else:
            (data / "cifar-10-batches-bin").mkdir(parents=True)
            for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
                np.concatenate([np.array([[4], [9]], np.uint8), _images(2).reshape(2, -1)], axis=1).tofile(
                    data / "cifar-10-batches-bin" / f"{name}.bin")
        return str(data)
    if layout.startswith("cifar100 "):
        python = layout == "cifar100 python"
        folder = data / ("cifar-100-python" if python else "cifar-100-binary")
        folder.mkdir(parents=True)
        for split, n in (("train", 5), ("test", 3)):
            if python:
                _py2_pickle(folder / split, {b"fine_labels": list(range(n)), b"coarse_labels": [1] * n,
                                             b"data": _images(n).reshape(n, -1)})
            else:
                np.concatenate([np.full((n, 1), 7, np.uint8), np.arange(n, dtype=np.uint8)[:, None],
                                _images(n).reshape(n, -1)], axis=1).tofile(folder / f"{split}.bin")
        return str(data)
    if layout.startswith("imagenet100 downsampled"):
        data.mkdir(parents=True)
        os.rename(_imagenet_dir(data, ".npz" if layout.endswith("npz") else ""), data / "imagenet100")
        return str(data / "imagenet100")
    if layout == "imagenet100 folder":
        from PIL import Image
        for split in ("train", "val"):
            for label, w in enumerate(tasks.IMAGENET100_WNIDS):
                (data / "imagenet100" / split / w).mkdir(parents=True)
                if label in (0, 99):
                    Image.fromarray(_images(1, label)[0].transpose(1, 2, 0)).save(
                        data / "imagenet100" / split / w / "a.JPEG", format="JPEG")
        return str(data / "imagenet100")
    if layout.startswith("wikitext2 "):
        make_wikitext(data, layout.split()[1])
        return str(data)
    make_tinystories(data if layout.endswith("V2") else data / "TinyStories",
                     "TinyStoriesV2-GPT4" if layout.endswith("V2") else "TinyStories")
    return str(data)


def _bench(monkeypatch, capsys, script, *argv):
    """`python benchmarks/SCRIPT ARGV`, run in this process (a script's start is not what its test tests):
    (exit status, stdout); torch's threads and generator, sys.path and sys.argv are left as they were."""
    path = os.path.join(HERE, "benchmarks", script)
    monkeypatch.setattr(sys, "argv", [path, *argv])
    monkeypatch.setattr(sys, "path", [os.path.dirname(path), *sys.path])      # as `python SCRIPT` has it
    threads, code = torch.get_num_threads(), 0
    capsys.readouterr()
    with torch.random.fork_rng():
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)
    return code, capsys.readouterr().out


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg
