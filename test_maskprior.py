"""Tests for maskprior.py, tasks.py and train.py (the retrofit's: test_retrofit.py; datafetch/: test_datafetch.py).
Run: python -m pytest -q test_*.py

In the source's order, a test under the part of the code it tests: helpers shared by several parts; maskprior.py
(patterns, mask helpers, MaskPrior, attention, models, generate, inits, param groups, probes, priors from attention,
the retrofit into torch, timm, Hugging Face and PEFT models); tasks.py (base, files, Boolean, arithmetic, vision,
language, fixtures); train.py (config, build, data parallelism, loop, durability); reports; reproduce.sh;
benchmarks; README and CI. A fixture sits before its first user.
"""
import argparse
import ast
import collections
import contextlib
import copy
import dataclasses
import errno
import glob
import fcntl
import hashlib
import importlib
import inspect
import io
import itertools
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import struct
import runpy
import subprocess
import sys
import time
import types
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given as fuzz, settings, strategies as st
import torch
import torch.nn as nn
import torch.nn.functional as F

import augment
import datafetch.download
import datafetch.imagenet100
import datafetch.write
import inits
import maskprior as mp
import maskprior_retrofit as retrofit
import reporting.figures
import reporting.plan
import reporting.report
import reporting.show
import runfiles
import tasks
import runconfig
import train

HERE = os.path.dirname(os.path.abspath(__file__))
# the README's test command runs them all (test_*.py)
TEST_FILES = tuple(sorted(os.path.basename(p) for p in glob.glob(os.path.join(HERE, "test_*.py"))))


# ---------------------------------------------------------------------------------------- shared helpers

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


RUN24 = ["--task", "parity2", "--layers", "1", "--dim", "16", "--heads", "2", "--mlp-dim", "32", "--steps", "40",
         "--log-every", "5", "--batch-size", "32", "--probe-size", "32"]


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


def _halted(tmp_path, name="run", seed=0, once=None) -> str:
    return _train(tmp_path / name, *RUN24, "--seed", seed, "--halt-after", 20, once=once)


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
    (d / "metrics.jsonl").write_text("".join(
        json.dumps({"step": 10 * i, "metrics": {}, "prior_mass": [m, m], "prior_mass_mean": m, drift: [0.1 * i, 0.1 * i],
                    "content_margin": [i, 2 * i]}) + "\n"
        for i, m in enumerate(masses)))
    return d


def _files_whole(folder) -> None:
    """Every file of a run folder is whole: JSON files parse, every metrics.jsonl line is a record, the
    checkpoint loads. Hidden temporary files of a killed write may be there (the next start removes them)."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.endswith(".json"):
            json.load(open(path))
        elif name == "metrics.jsonl":
            text = open(path).read()
            assert text.endswith("\n") and all(json.loads(line)["step"] >= 0 for line in text.splitlines())
        elif name == "ckpt.pt":
            assert set(runfiles.CKPT_KEYS) <= set(train.read_checkpoint(str(path), "test"))
        elif name == "prior.pt":
            runfiles.read_prior(path)
        else:
            assert name.startswith(".") and name.endswith(".tmp"), name


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
def _torch_threads(n: int):
    """torch on `n` CPU threads in this process for the body (as a subprocess with OMP_NUM_THREADS=n), then as before:
    a run here rounds as that subprocess's does."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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


# ---------------------------------------------------------------------------------------- maskprior.py: module, checks

# what each file of ours may import of ours: the method at the bottom, the rooms above it, the commands on top;
# reports read run folders (runfiles), never the datasets or train
IMPORTS_ALLOWED = {
    "maskprior.py": set(), "maskprior_retrofit.py": {"maskprior"}, "inits.py": {"maskprior"},
    "runfiles.py": {"inits"}, "augment.py": set(),
    "tasks.py": {"maskprior", "inits", "runfiles", "augment"},
    "reporting/figures.py": {"runfiles"}, "reporting/show.py": {"maskprior", "reporting"},
    "reporting/report.py": {"inits", "runfiles", "reporting"}, "reporting/plan.py": {"tasks", "runfiles", "datafetch"},
    "datafetch/write.py": {"tasks", "runfiles"}, "datafetch/download.py": {"tasks", "runfiles", "datafetch"},
    "datafetch/imagenet100.py": {"tasks", "datafetch"},
    "runconfig.py": {"maskprior", "inits", "runfiles", "tasks"},
    "train.py": {"maskprior", "maskprior_retrofit", "runconfig", "runfiles", "tasks", "reporting", "datafetch"},
}


@pytest.mark.slow
def test_the_wheel_installs_the_library_alone_under_names_of_its_own(tmp_path):
    """`pip install` puts the method and the retrofit into site-packages and nothing else (no top-level `train` or
    `tasks` to shadow a user's own), with the LICENSE; the version is the one pyproject.toml declares."""
    pytest.importorskip("setuptools", minversion="61")
    src = tmp_path / "src"                  # built from a copy of the checkout: setuptools writes build/ beside it
    shutil.copytree(HERE, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "runs", "data", "results"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("maskprior-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n for n in names if ".dist-info/" not in n} == {"maskprior.py", "maskprior_retrofit.py"}
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    version = re.search(r'^version = "([^"]+)"', open(os.path.join(HERE, "pyproject.toml")).read(), re.M).group(1)
    assert wheel.name.startswith(f"maskprior-{version}-") and mp.__version__ == version
    assert f"version: {version}" in open(os.path.join(HERE, "CITATION.cff")).read()


@pytest.mark.parametrize("module, internal", [
    (mp, {"Arg", "Call", "Kind", "check_arg", "check_call", "check_one_source", "check_pattern", "checked", "tracing",
          "watch_decay", "drop_path"}),
    (retrofit, set())])
def test_all_names_every_public_function_and_class(module, internal):
    """`__all__` of the files people copy lists each public function and class they define (a new one is listed or
    named internal here), and each name in it exists."""
    defined = {n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or
               inspect.isclass(v)) and v.__module__ == module.__name__}
    assert defined - internal <= set(module.__all__) and all(hasattr(module, n) for n in module.__all__)
    assert not internal & set(module.__all__)


def test_api_md_lists_every_public_name():
    """API.md, the short reference, has a row for each name of both files' `__all__` (and no name they lack), and
    options of add_mask_prior and a tested-versions table are there."""
    text = open(os.path.join(HERE, "API.md")).read()
    rows = set(re.findall(r"^\| `(\w+)", text, re.M))
    public = set(mp.__all__) | set(retrofit.__all__)
    options = set(inspect.signature(retrofit.add_mask_prior).parameters) - {"model"}
    assert public <= rows and rows - public <= options, (public - rows, rows - public - options)
    assert options <= rows and "## Tested versions" in text and "| torch | " in text


def test_imports_run_one_way():
    """Each file imports of ours only what IMPORTS_ALLOWED gives it (anywhere in it, functions too), so the layers
    hold: the method imports nothing of ours, report.py no task and no train; every file of ours is listed."""
    ours = {"maskprior", "maskprior_retrofit", "inits", "tasks", "runconfig", "train", "runfiles", "augment",
            "reporting", "datafetch"}
    found = {os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "**", "*.py"), recursive=True)}
    found -= {p for p in found if p.startswith(("benchmarks", "examples", "test_"))
              or p in ("reporting/__init__.py", "datafetch/__init__.py")}       # (empty package markers)
    assert found == set(IMPORTS_ALLOWED), found ^ set(IMPORTS_ALLOWED)
    for path, allowed in IMPORTS_ALLOWED.items():
        got = set()
        for node in ast.walk(ast.parse(open(os.path.join(HERE, path)).read())):
            if isinstance(node, ast.Import):
                got |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                got.add(node.module.split(".")[0])
        assert got & ours <= allowed, (path, got & ours - allowed)


def test_no_function_of_ours_is_over_60_lines():
    """Every function and method in every non-test file of ours (the one list test_imports_run_one_way keeps),
    docstring included, is at most 60 lines: a long one is split where it grows, not found by a reader."""
    long = []
    for path in IMPORTS_ALLOWED:
        for node in ast.walk(ast.parse(open(os.path.join(HERE, path)).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{path}:{node.name} {node.end_lineno - node.lineno + 1}")
    assert not long, long


def test_the_core_lifts_whole_and_runs_alone():
    """maskprior.py's core, up to its argument tables, taken alone as a module: it needs nothing below it, and an
    Attention with a prior set by init_mask_ trains through param_groups (M undecayed), its fused and explicit paths
    agreeing; the code in it, docstrings and comments aside, stays under 380 lines (the file's opening says about 360)."""
    src = open(os.path.join(HERE, "maskprior.py")).read()
    core = src[:src.index("# ----------------------------------------------------------------------------------------\n"
                          "# The public arguments")]
    lifted = types.ModuleType("lifted")
    exec(compile(core, "lifted", "exec"), lifted.__dict__)
    torch.manual_seed(0)
    attn = lifted.Attention(16, 2, mask_size=6, causal=True)
    explicit = copy.deepcopy(attn)
    explicit.fused = False
    model = nn.Sequential(attn)
    lifted.init_mask_(model, lifted.banded_pattern(6, 1) & lifted.causal_pattern(6))
    lifted.init_mask_(nn.Sequential(explicit), lifted.banded_pattern(6, 1) & lifted.causal_pattern(6))
    x = torch.randn(3, 6, 16)
    torch.testing.assert_close(attn(x)[0], explicit(x)[0], atol=1e-5, rtol=1e-5)
    groups = lifted.param_groups(model, 0.1)
    assert any(attn.prior.bias is p for g in groups if g["weight_decay"] == 0 for p in g["params"])
    opt = torch.optim.AdamW(groups, lr=1e-2)
    attn(x)[0].pow(2).mean().backward()
    opt.step()
    assert attn.prior.bias.grad.abs().max() > 0
    docs = {n for node in ast.walk(ast.parse(core)) if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module))
            and ast.get_docstring(node) for n in range(node.body[0].lineno, node.body[0].end_lineno + 1)}
    code = [line for n, line in enumerate(core.splitlines(), 1)
            if n not in docs and line.strip() and not line.lstrip().startswith(("#", "import ", "from "))]
    assert len(code) < 380, len(code)


@pytest.mark.slow
def test_maskprior_copied_alone_runs(tmp_path):
    """maskprior.py alone, in an empty folder, trains our models (and imports no library but torch); beside it,
    maskprior_retrofit.py retrofits anyone's (an nn.TransformerEncoder here), and neither imports a module of ours
    beyond the other. The two run at once, each in a folder of its own."""
    alone, beside = tmp_path / "alone", tmp_path / "beside"
    alone.mkdir()
    shutil.copy(os.path.join(HERE, "maskprior.py"), alone)
    ours = ("import maskprior as mp, torch, sys\n"
            "assert not {'transformers', 'timm', 'safetensors', 'maskprior_retrofit'} & set(sys.modules)\n"
            "cfg = mp.TransformerConfig(vocab_size=2, seq_len=7, n_layers=2, n_heads=2, dim=16, mlp_dim=16,\n"
            "                           learnable_mask=True)\n"
            "m = mp.Transformer(cfg)\n"
            "mp.init_mask_(m, mp.banded_pattern(8, 1))\n"
            "y = m(torch.randint(0, 2, (4, 7)))\n"
            "y.sum().backward()\n"
            "assert m.blocks[0].attn.prior.bias.grad is not None\n"
            "v = mp.ViT(mp.ViTConfig(image_size=8, patch_size=4, n_layers=1))\n"
            "v(torch.randn(2, 3, 8, 8)).sum().backward()\n"
            "rel = mp.MaskPrior(6, 2, causal=True, logits=mp.causal_distance_logits(6, 2), param=\"relative\")\n"
            "assert rel.bias.shape == (2, 6) and rel(4).shape == (2, 4, 4)\n"
            "print('ok')\n")
    theirs = ("import maskprior as mp, maskprior_retrofit as retrofit, torch, sys\n"
              "enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,\n"
              "                                  enable_nested_tensor=False)\n"
              "priors = retrofit.add_mask_prior(enc, mp.banded_pattern(5, 1))\n"
              "enc(torch.randn(3, 5, 8)).sum().backward()\n"
              "assert all(p.bias.grad is not None for p in priors.values())\n"
              "assert not {'transformers', 'timm', 'tasks', 'train', 'runfiles'} & set(sys.modules)\n"
              "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    beside.mkdir()
    for name in ("maskprior.py", "maskprior_retrofit.py"):
        shutil.copy(os.path.join(HERE, name), beside)
    for r in _at_once(([sys.executable, "-c", ours], {"cwd": alone, "env": env}),
                      ([sys.executable, "-c", theirs], {"cwd": beside, "env": env})):
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    for name in ("maskprior.py", "maskprior_retrofit.py"):
        src = open(os.path.join(HERE, name)).read()
        assert not re.search(r"^\s*(import|from) (tasks|train|runfiles|reporting|augment|datafetch)\b", src, re.M)
    assert "maskprior_retrofit" not in re.findall(r"^\s*import (\w+)", open(os.path.join(HERE, "maskprior.py")).read(),
                                                  re.M)


def test_the_library_refuses_what_would_fail_later_or_in_silence():
    """A NaN strength, a negative pair index, a missing pattern, non-finite logits and inputs of the wrong
    size are one ValueError each, naming what was wrong, instead of a NaN model or a generic torch error."""
    model = mp.Transformer(mp.TransformerConfig(vocab_size=2, seq_len=7, n_layers=1, learnable_mask=True))
    before = [p.detach().clone() for p in model.parameters()]
    for call, message in (
            (lambda: mp.init_mask_(model, mp.banded_pattern(8, 1), m_on=float("nan")), "m_on must be a finite number"),
            (lambda: mp.init_mask_(model, mp.banded_pattern(8, 1), m_off=float("inf")),
             "m_off must be a finite number"),
            (lambda: mp.init_mask_(model), "no pattern: give a bool"),
            (lambda: mp.init_mask_(model, logits=torch.full((8, 8), float("nan"))),
             r"logits must be a finite float tensor \(\.\.\., N, N\), got .* holding nan or inf"),
            (lambda: mp.pattern_from_pairs(4, [(0, -1)]), r"pair \(0, -1\) is outside positions 0 .. 3"),
            (lambda: mp.pattern_from_pairs(4, [(4, 0)]), r"pair \(4, 0\) is outside"),
            (lambda: model(torch.randint(0, 2, (2, 9))), "an input of 9 tokens is longer than the model's seq_len 7"),
            (lambda: mp.ViT(mp.ViTConfig(image_size=8, patch_size=4, n_layers=1))(torch.randn(2, 3, 16, 16)),
             r"images of shape \(2, 3, 16, 16\) do not fit the model: it takes \(B, C, 8, 8\)")):
        with pytest.raises(ValueError, match=message):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))       # nothing was changed
    assert model(torch.randint(0, 2, (2, 7))).shape[0] == 2


# ---------------------------------------------------------------------------------------- maskprior.py: patterns

def test_pattern_builders():
    p = mp.pattern_from_pairs(4, [(0, 2)], symmetric=True, self_loops=False)
    assert p.tolist() == [[False, False, True, False], [False] * 4, [True, False, False, False], [False] * 4]
    assert mp.pattern_from_pairs(3, []).equal(torch.eye(3, dtype=torch.bool))
    b = mp.banded_pattern(6, 1, circulant=True)
    assert b[0].tolist() == [True, True, False, False, False, True]
    assert mp.banded_pattern(6, 1)[0].tolist() == [True, True, False, False, False, False]
    e = mp.embed_pattern(torch.ones(2, 2, dtype=torch.bool), 1, 4)
    assert e.sum() == 4 and e[1:3, 1:3].all()
    c = mp.causal_pattern(3)
    assert c.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_impulse_pattern_on_known_grid():
    # 3x3 grid, heads: self, up, right; patch 4 is the centre (row 1, col 1)
    p = mp.impulse_pattern(3, 3, mp.IMPULSE_OFFSETS[:3])
    assert p.shape == (3, 9, 9) and (p.sum(-1) == 1).all()
    assert p[0].equal(torch.eye(9, dtype=torch.bool))
    assert p[1, 4, 1] and p[2, 4, 5]
    assert p[1, 0, 0] and p[2, 2, 2]          # neighbours off the grid fall back to self
    q = mp.impulse_pattern(2, 2, [(0, 1)], n_prefix=1)
    assert q.shape == (1, 5, 5) and q[0, 0].all() and q[0, :, 0].all()
    offs = mp.random_impulse_offsets(5, 3, torch.Generator().manual_seed(0))
    assert len(offs) == 5 and all(-1 <= a <= 1 and -1 <= b <= 1 for a, b in offs)


def test_soft_and_window_priors_on_a_known_grid():
    """soft: log sigmoid(M) = -alpha * squared distance to the head's offset, within [-m_off, m_on]; window:
    every head sees its k x k neighbourhood; a prefix token sees and is seen by all."""
    m = mp.soft_offset_logits(5, 5, [(0, 0), (-1, 0)], 0.5, 5.0, 10.0)
    bias = F.logsigmoid(m)
    centre = 12                                                # row 2, column 2
    for h, (dr, dc) in enumerate([(0, 0), (-1, 0)]):
        for key in range(25):
            r, c = divmod(key, 5)
            d2 = (r - 2 - dr) ** 2 + (c - 2 - dc) ** 2
            want = min(max(-0.5 * d2, float(F.logsigmoid(torch.tensor(-10.0)))), float(F.logsigmoid(torch.tensor(5.0))))
            assert float(bias[h, centre, key]) == pytest.approx(want, abs=1e-4), (h, key)
    assert float(m.max()) == 5.0 and float(m.min()) == -10.0
    assert int(bias[1, centre].argmax()) == 7                  # the key one row up
    w = mp.window_pattern(4, 4, 3, 2, n_prefix=1)
    assert w.shape == (2, 17, 17) and w[:, 0].all() and w[:, :, 0].all() and w[0].equal(w[1])
    assert w[0, 1 + 5].sum() == 1 + 9 and w[0, 1 + 0].sum() == 1 + 4      # an inner patch and a corner


def test_causal_distance_logits_are_alibi():
    m = mp.causal_distance_logits(6, 4)
    bias = mp.mask_bias(m)
    slopes = mp.alibi_slopes(4)
    assert slopes.tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    for h in range(4):
        for i in range(6):
            for j in range(i):
                assert abs(float(bias[h, i, j]) + float(slopes[h]) * (i - j)) < 1e-5
    assert (bias[:, range(6), range(6)] > -1e-4).all()


# ---------------------------------------------------------------------------------------- maskprior.py: mask helpers

def test_mask_bias_grad_is_the_derivative_autograd_takes_of_mask_bias():
    """The fused CPU path's backward multiplies by mask_bias_grad: it must be d mask_bias / dM, as autograd takes it
    (float64, logits across the range M takes, saturated ones included)."""
    m = torch.cat([torch.linspace(-40, 40, 81), torch.randn(50) * 5]).double().requires_grad_()
    grad, = torch.autograd.grad(mp.mask_bias(m).sum(), m)
    torch.testing.assert_close(mp.mask_bias_grad(m.detach()), grad, atol=0, rtol=1e-12)


def test_mask_bias_never_positive():
    m = torch.linspace(-50, 50, 1001)
    assert (mp.mask_bias(m) <= 0).all()
    pat = mp.banded_pattern(6, 1)
    logits = mp.mask_logits_from_pattern(pat, 5.0, 7.0)
    assert (logits[pat] == 5).all() and (logits[~pat] == -7).all()
    assert abs(float(mp.mask_bias(torch.tensor(5.0))) + 0.0067) < 1e-4


def tiny_cfg(**kw):
    base = dict(vocab_size=5, seq_len=11, n_layers=2, n_heads=3, dim=24, mlp_dim=32, n_outputs=4)
    base.update(kw)
    return mp.TransformerConfig(**base)


def test_mask_gradient_bound_holds():
    """|dL/dM_ij| <= sigma(-M_ij) * sum_b p_bij (max_k g_bik - min_k g_bik) (Theorem 1), and the
    bound is reasonably tight (not vacuous)."""
    torch.manual_seed(1)
    model = mp.Transformer(tiny_cfg(learnable_mask=True, fused=False, n_outputs=1, readout="cls"))
    mp.init_mask_(model, mp.banded_pattern(12, 1), 5.0, 5.0)
    idx = torch.randint(0, 5, (8, 11))
    out, maps = model(idx, return_attn=True)
    for a in maps:
        a.retain_grad()
    F.mse_loss(out.squeeze(-1), torch.randn(8)).backward()
    for block, a in zip(model.blocks, maps):
        m = block.attn.prior.bias
        bound = mp.mask_grad_bound(a.detach(), a.grad, m.detach())
        assert (m.grad.abs() <= bound + 1e-7).all()
        assert (m.grad.abs().sum() / bound.sum()) > 0.05
        # the bound is at most the attention mass times the gradient spread: sigma(-M) <= 1
        spread = a.grad.amax(-1, keepdim=True) - a.grad.amin(-1, keepdim=True)
        assert (bound <= (a.detach() * spread).sum(0) + 1e-9).all()


def test_theorem_1_bound_holds_on_the_relative_table():
    """dL/dM_d sums dL/dM_ij over the pairs at distance d, so its size is bounded by the sum of their bounds."""
    n = 8
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=n, n_layers=1, n_heads=2, dim=16, mlp_dim=16, readout="tokens",
                               causal=True, n_outputs=5, learnable_mask=True, fused=False, mask_param="relative")
    torch.manual_seed(2)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, logits=mp.causal_distance_logits(n, 2))
    x = torch.randint(0, 5, (6, n))
    out, (attn,) = model(x, return_attn=True)
    attn.retain_grad()
    (out * torch.randn(out.shape)).sum().backward()
    prior = model.blocks[0].attn.prior
    bound = mp.mask_grad_bound(attn.detach(), attn.grad, prior.full_logits().detach())        # (H, n, n)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    per_distance = torch.stack([bound[:, d == k].sum(-1) for k in range(n)], -1)               # (H, n)
    g = prior.bias.grad
    assert g.abs().max() > 0 and bool((g.abs() <= per_distance + 1e-6).all())


# ---------------------------------------------------------------------------------------- maskprior.py: MaskPrior

def test_mask_prior_bias_shapes_for_each_target():
    pattern = mp.banded_pattern(6, 1)
    prior = mp.MaskPrior(6, heads=3, pattern=pattern, m_on=5.0, m_off=4.0)
    b = prior()
    assert b.shape == (3, 6, 6) and torch.allclose(b[0][pattern], F.logsigmoid(torch.tensor(5.0)))
    assert torch.allclose(b[1][~pattern], F.logsigmoid(torch.tensor(-4.0)))
    causal = mp.MaskPrior(6, 2, causal=True)
    assert causal(4).shape == (2, 4, 4) and torch.isinf(causal(4)[0, 0, 1]) and causal(4)[0, 1, 0] == F.logsigmoid(
        torch.tensor(0.0))
    assert mp.param_groups(nn.Sequential(nn.Linear(6, 6), prior), 0.1)[1]["params"][-1] is prior.bias


def _lm_cfg(param, fused=True, n=12):
    return mp.TransformerConfig(vocab_size=11, seq_len=n, n_layers=2, n_heads=4, dim=32, mlp_dim=64, readout="tokens",
                                causal=True, n_outputs=11, learnable_mask=True, fused=fused, mask_param=param,
                                tie_embeddings=True)


def test_relative_prior_starts_where_the_full_one_does_and_is_small():
    torch.manual_seed(0)
    full, rel = mp.Transformer(_lm_cfg("full")), mp.Transformer(_lm_cfg("relative"))
    rel.load_state_dict({k: v for k, v in full.state_dict().items() if not k.endswith("prior.bias")}, strict=False)
    logits = mp.causal_distance_logits(12, 4)
    mp.init_mask_(full, logits=logits)
    mp.init_mask_(rel, logits=logits)
    a, b = full.blocks[0].attn, rel.blocks[0].attn
    assert b.prior.bias.shape == (4, 12) and a.prior.bias.shape == (4, 12, 12)
    assert torch.equal(a.attn_bias(12, torch.float32), b.attn_bias(12, torch.float32))
    assert torch.equal(a.attn_bias(7, torch.float32), b.attn_bias(7, torch.float32))       # a prompt
    x = torch.randint(0, 11, (3, 12))
    torch.testing.assert_close(full(x), rel(x))
    with pytest.raises(ValueError, match="differ along a diagonal"):
        mp.init_mask_(rel, logits=_past(torch.randn(4, 12, 12)))
    far = b.prior(30)                                         # past the table: distances >= 11 read its last logit
    assert torch.equal(far[:, :12, :12], b.prior(12)) and torch.equal(far[:, 29, :19], far[:, 29, :1].expand(4, 19))
    with pytest.raises(ValueError, match="sequence length 13 does not fit the mask size 12"):
        a.prior(13)                                           # a full M serves its n positions at most


def test_a_float64_mask_prior_passes_gradcheck():
    """M in float64 stays float64 through the bias (no float32 cast), so torch.autograd.gradcheck passes for
    a full and a relative prior, non-causal and causal (through a softmax, where the future is -inf)."""
    q = torch.randn(2, 5, 5, dtype=torch.float64)
    priors = [mp.MaskPrior(5, 2, mp.banded_pattern(5, 1), param="full"),
              mp.MaskPrior(5, 2, logits=mp.causal_distance_logits(5, 2), causal=True, param="full"),
              mp.MaskPrior(5, 2, logits=mp.causal_distance_logits(5, 2), causal=True, param="relative")]
    for prior in priors:
        prior = prior.double()
        assert prior.bias.dtype == torch.float64 and prior(5).dtype == torch.float64

        def attention(m, prior=prior):
            return (q + torch.func.functional_call(prior, {"bias": m}, ())).softmax(-1)
        assert torch.autograd.gradcheck(attention, (prior.bias.detach().clone().requires_grad_(),))


@pytest.mark.parametrize("kw", [dict(n=0), dict(heads=0), dict(heads=-2), dict(n=4, n_keys=0), dict(heads=2.0)])
def test_a_mask_prior_of_no_size_is_refused(kw):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        mp.MaskPrior(**{"n": 4, **kw})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_saved_m_that_is_not_finite_is_refused_on_load(bad):
    """load_state_dict of a model (ours, or a retrofitted torch encoder) whose saved M holds nan or +-inf: a
    ValueError naming the parameter; the model keeps its own M."""
    cfg = mp.TransformerConfig(vocab_size=2, seq_len=6, readout="mean", n_layers=1, n_heads=2, dim=16, mlp_dim=16,
                               learnable_mask=True)
    model = mp.Transformer(cfg)
    state = model.state_dict()
    key = next(k for k in state if k.endswith("prior.bias"))
    state[key] = state[key].clone()
    state[key][0, 1, 2] = bad
    before = model.state_dict()[key].clone()
    with pytest.raises(ValueError, match=f"{re.escape(key)} .*the saved M holds non-finite values"):
        mp.Transformer(cfg).load_state_dict(state)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 16, batch_first=True), 1, enable_nested_tensor=False)
    retrofit.add_mask_prior(enc, mp.banded_pattern(6, 1))
    s = {k: v.clone() for k, v in enc.state_dict().items()}
    s["layers.0.self_attn.mask_prior.bias"][0, 0, 0] = bad
    with pytest.raises(ValueError, match="layers.0.self_attn.mask_prior.bias .*non-finite"):
        enc.load_state_dict(s)
    assert torch.equal(model.state_dict()[key], before)


def test_prior_roles_gathers_m_per_example_on_both_attention_paths():
    """mp.prior_roles: query i, key j of example b read M[rows[b, i], cols[b, j]]; fused = explicit; bad roles
    are refused naming the shapes."""
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=6, readout="tokens", causal=True, n_layers=2, n_heads=2, dim=16,
                               mlp_dim=16, learnable_mask=True, fused=True)
    fused = mp.Transformer(cfg)
    mp.init_mask_(fused, logits=_past(torch.randn(2, 6, 6) * 4))
    explicit = mp.Transformer(dataclasses.replace(cfg, fused=False))
    explicit.load_state_dict(fused.state_dict())
    rows = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 4, 5, 5, 5]])
    cols = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 2, 3, 4, 5, 5]])
    x = torch.randint(0, 5, (2, 6))
    with mp.prior_roles(fused, rows, cols), mp.prior_roles(explicit, rows, cols):
        bias = fused.blocks[1].attn.attn_bias(5, torch.float32)
        assert torch.allclose(fused(x), explicit(x), atol=1e-5)
    m = F.logsigmoid(fused.blocks[1].attn.prior.bias)
    assert bias[1, 1, 3, 2] == m[1, 5, 3] and bias[1, 0, 2, 1] == m[0, 4, 2] and bias[1, 0, 1, 2] == float("-inf")
    assert torch.equal(bias[0], fused.blocks[1].attn.attn_bias(5, torch.float32))    # identity roles
    with pytest.raises(ValueError, match=r"prior_roles needs rows and cols of one \(B, L\) shape, long, in 0..5"):
        with mp.prior_roles(fused, rows, cols + 1):
            pass
    with mp.prior_roles(nn.Linear(2, 2), rows, cols):                     # a model without a prior: left alone
        pass


# ---------------------------------------------------------------------------------------- maskprior.py: attention

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_and_explicit_agree(causal, with_mask):
    torch.manual_seed(0)
    attn = mp.Attention(24, 3, mask_size=10 if with_mask else None, causal=causal, qkv_bias=True)
    if with_mask:
        with torch.no_grad():
            attn.prior.bias.copy_(torch.randn(3, 10, 10) * 4)
    # a causal layer may read a prefix of M (T=9 < 10); a non-causal one needs T = N exactly
    x = torch.randn(2, 9 if causal else 10, 24, requires_grad=True)
    grads = []
    for fused in (True, False):
        attn.fused = fused
        attn.zero_grad()
        x.grad = None
        out, maps = attn(x)
        assert (maps is None) == fused
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        params = [x.grad.clone(), attn.qkv.weight.grad.clone(), attn.proj.weight.grad.clone()]
        if with_mask:
            params.append(attn.prior.bias.grad.clone())
        grads.append((out.detach(), params))
    (o1, g1), (o2, g2) = grads
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_model_fused_and_explicit_agree():
    torch.manual_seed(0)
    model = mp.Transformer(tiny_cfg(learnable_mask=True))
    mp.init_mask_(model, mp.banded_pattern(12, 2), 5.0, 5.0)
    idx = torch.randint(0, 5, (3, 11))
    out_fused = model(idx)
    out_explicit, maps = model(idx, return_attn=True)
    torch.testing.assert_close(out_fused, out_explicit, atol=1e-5, rtol=1e-5)
    assert len(maps) == 2 and maps[0].shape == (3, 3, 12, 12)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(3, 3, 12))


def test_causal_bias_hides_the_future():
    attn = mp.Attention(8, 2, mask_size=6, causal=True)
    bias = attn.attn_bias(6, torch.float32)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert torch.isinf(bias[:, future]).all() and torch.isfinite(bias[:, ~future]).all()


def test_mask_size_must_match_the_sequence_unless_causal():
    attn = mp.Attention(16, 2, mask_size=6)
    with pytest.raises(ValueError, match="does not fit the mask size 6"):
        attn(torch.randn(1, 5, 16))                  # a non-causal layer never reads part of M
    with pytest.raises(ValueError, match="does not fit the mask size 6"):
        attn(torch.randn(1, 7, 16))
    causal = mp.Attention(16, 2, mask_size=6, causal=True)
    assert causal(torch.randn(1, 5, 16))[0].shape == (1, 5, 16)   # a prefix, e.g. a prompt
    with pytest.raises(ValueError, match="does not fit the mask size 6"):
        causal(torch.randn(1, 7, 16))


@pytest.mark.parametrize("causal", [True, False])
def test_relative_prior_fused_equals_explicit_with_the_table_gradient(causal):
    n = 10
    cfg = mp.TransformerConfig(vocab_size=7, seq_len=n, n_layers=1, n_heads=2, dim=16, mlp_dim=16, readout="tokens",
                               causal=causal, n_outputs=7, learnable_mask=True, mask_param="relative")
    torch.manual_seed(0)
    fused = mp.Transformer(cfg)
    with torch.no_grad():
        fused.blocks[0].attn.prior.bias.normal_()
    explicit = mp.Transformer(mp.TransformerConfig(**{**cfg.__dict__, "fused": False}))
    explicit.load_state_dict(fused.state_dict())
    x = torch.randint(0, 7, (4, n))
    r = torch.randn(4, n, 7)
    outs = []
    for m in (fused, explicit):
        out = m(x)
        (out * r).sum().backward()
        outs.append((out.detach(), m.blocks[0].attn.prior.bias.grad))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    assert outs[0][1].abs().max() > 1e-3
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-4)
    if causal:                                                # later tokens never reach earlier outputs
        y = x.clone()
        y[:, 6:] = (y[:, 6:] + 1) % 7
        torch.testing.assert_close(fused(x)[:, :6], fused(y)[:, :6])


PRIOR_LAYOUTS = {   # (MaskPrior kwargs, queries T, keys S): every layout the fused path serves
    "full": (dict(n=20, param="full"), 20, 20),
    "full causal": (dict(n=20, param="full", causal=True), 20, 20),
    "full causal, a prefix": (dict(n=20, param="full", causal=True), 13, 13),
    "full causal, a KV cache": (dict(n=20, param="full", causal=True), 5, 17),
    "cross-attention": (dict(n=20, n_keys=9), 20, 9),
    "relative": (dict(n=20, param="relative"), 20, 20),
    "relative, past its n": (dict(n=6, param="relative"), 90, 90),
    "relative causal": (dict(n=20, param="relative", causal=True), 20, 20),
    "relative causal, past its n": (dict(n=6, param="relative", causal=True), 150, 150),
    "relative causal, a KV cache past its n": (dict(n=6, param="relative", causal=True), 7, 150),
    "relative causal, a table of one": (dict(n=1, param="relative", causal=True), 70, 70),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(PRIOR_LAYOUTS))
def test_the_fused_prior_equals_the_explicit_softmax_in_outputs_and_every_gradient(layout, dtype):
    """mp.prior_attention (on the CPU: the fused kernel forward, M's gradient beside q's, k's and v's from its saved
    log-sum-exp) gives the explicit softmax's output and the gradients of q, k, v and M, for every layout: to 1e-5 in
    float32 (measured: <= 1e-6 of the largest entry), to bf16's rounding in bf16 (measured: <= 7e-3)."""
    kw, t, s = PRIOR_LAYOUTS[layout]
    gen = torch.Generator().manual_seed(0)
    prior = mp.MaskPrior(heads=3, **kw)
    with torch.no_grad():
        prior.bias.normal_(0, 3, generator=gen)
    q = torch.randn(2, 3, t, 8, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 3, s, 8, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    r = torch.randn(2, 3, t, 8, generator=gen)
    got = mp.prior_attention(q, k, v, prior)
    grads = torch.autograd.grad((got.float() * r).sum(), (q, k, v, prior.bias))
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    m = prior.bias.detach().clone().requires_grad_()
    bias = torch.func.functional_call(prior, {"bias": m}, (t,), {"k_len": s})
    want = ((qf @ kf.transpose(-2, -1)) * 8 ** -0.5 + bias).softmax(-1) @ vf
    wants = torch.autograd.grad((want * r).sum(), (qf, kf, vf, m))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip((got, *grads), (want, *wants)):                 # relative to the largest entry of each
        assert (a.float() - b).abs().max() <= tol * max(b.abs().max(), 1.0), layout
    assert grads[3].abs().max() > 1e-4 or kw["n"] == 1, layout   # M learns (a table of one: a constant, no gradient)


def test_a_relative_prior_serves_any_length_and_generation_past_it_equals_with_and_without_the_cache():
    """A relative M of n = 8 distances in a model without positional embedding (positions='none') serves 40 tokens:
    distances past the table read its last logit; greedy generation to 3 x n tokens gives the same tokens with the
    KV cache as without it (and each step's logits: measured <= 4e-7); a full M refuses past its n in one line."""
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(vocab_size=20, seq_len=8, n_outputs=20, readout="tokens", causal=True, n_layers=2,
                               n_heads=2, dim=16, mlp_dim=32, learnable_mask=True, mask_param="relative",
                               positions="none")
    model = mp.Transformer(cfg).eval()
    mp.init_mask_(model, logits=mp.causal_distance_logits(8, 2))
    assert model.any_length() and model.pos_emb is None
    prompt = torch.randint(0, 20, (3, 4))
    with_cache = mp.generate(model, prompt, 20, temperature=0, cache=True)
    assert with_cache.shape == (3, 24) and torch.equal(with_cache, mp.generate(model, prompt, 20, temperature=0,
                                                                                 cache=False))
    kv = [{} for _ in model.blocks]
    steps = torch.cat([model(with_cache[:, :4], cache=kv)] + [model(with_cache[:, i:i + 1], cache=kv)
                                                               for i in range(4, 24)], 1)
    torch.testing.assert_close(steps, model(with_cache), atol=1e-5, rtol=1e-5)
    bias = model.blocks[0].attn.prior(40)
    assert torch.equal(bias[:, 39, :32], bias[:, 39, :1].expand(2, 32))          # distances >= 7: the far logit
    full = mp.Transformer(dataclasses.replace(cfg, mask_param="full"))
    with pytest.raises(ValueError, match="sequence length 9 does not fit the mask size 8"):
        full(torch.randint(0, 20, (1, 9)))
    learned = mp.Transformer(dataclasses.replace(cfg, positions="learned")).eval()
    assert not learned.any_length() and torch.equal(mp.generate(learned, prompt, 12, temperature=0, cache=True),
                                                    mp.generate(learned, prompt, 12, temperature=0, cache=False))
    with pytest.raises(ValueError, match="QK inits fit the pattern on the positional embedding"):
        mp.init_qk_svd_(model, mp.causal_pattern(8))










@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_bf16_fused_matches_explicit_with_mask(causal):
    torch.manual_seed(0)
    # sequence length not a multiple of 8 on purpose; a causal layer reads a prefix of its M, others all of it
    n, t = (70, 67) if causal else (67, 67)
    attn = mp.Attention(128, 2, mask_size=n, causal=causal).cuda()
    with torch.no_grad():
        attn.prior.bias.copy_(torch.randn(2, n, n, device="cuda") * 4)
    x = torch.randn(4, t, 128, device="cuda", requires_grad=True)
    res = []
    for fused in (True, False):
        attn.fused = fused
        attn.zero_grad()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = attn(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        res.append((out.float().detach(), x.grad.clone(), attn.prior.bias.grad.clone()))
    (o1, gx1, gm1), (o2, gx2, gm2) = res
    assert torch.isfinite(gm1).all() and gm1.abs().sum() > 0
    torch.testing.assert_close(o1, o2, atol=3e-2, rtol=3e-2)
    assert float((gx1 - gx2).norm() / gx2.norm()) < 3e-2
    assert float((gm1 - gm2).norm() / gm2.norm()) < 3e-2


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False])
def test_compiled_model_matches_eager(fused):
    """torch.compile traces both attention paths with the learnable mask (aot_eager here, no compiler needed;
    `--compile` uses inductor, checked on a GPU by test_cuda_compile_matches_eager)."""
    cfg = mp.TransformerConfig(vocab_size=3, seq_len=6, n_layers=1, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True,
                               fused=fused, readout="tokens", causal=True, n_outputs=3)
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, logits=mp.causal_distance_logits(6, 2))
    x = torch.randint(0, 3, (4, 6))
    grads = []
    for m in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad()
        out = m(x)
        out.square().sum().backward()
        grads.append((out.detach(), model.blocks[0].attn.prior.bias.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize("causal,param", [(False, "full"), (True, "full"), (True, "relative"), (False, "relative")])
def test_flex_attention_gives_the_explicit_path_s_outputs_for_every_prior_layout(causal, param):
    """--attention flex (M read inside torch's flex_attention: a score_mod on the (heads, N, N) bias or on the
    relative table by distance, a block mask for the causal part) gives what the explicit softmax gives, for a full
    or relative M, causal (a prefix too) or not; forward only here (its backward runs on CUDA)."""
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=12, n_layers=2, n_heads=3, dim=24, learnable_mask=True,
                               causal=causal, mask_param=param, readout="tokens", n_outputs=5)
    ref = mp.Transformer(dataclasses.replace(cfg, fused=False))
    with torch.no_grad():
        for p in mp.mask_priors(ref):
            p.bias.normal_(0, 3)
    flex = mp.Transformer(dataclasses.replace(cfg, flex=True))
    flex.load_state_dict(ref.state_dict())
    plain = mp.Transformer(dataclasses.replace(cfg, fused=False, learnable_mask=False))
    plain.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.endswith("prior.bias")})
    for t in ((12, 7) if causal else (12,)):
        x = torch.randint(0, 5, (4, t))
        with torch.no_grad():
            got, want = flex(x), ref(x)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert (got - plain(x)).abs().max() > 1e-2                  # M moved the output: the prior is in the kernel


def test_flex_attention_refuses_a_backward_on_the_cpu_and_train_py_says_where_it_runs(tmp_path, capsys):
    cfg = mp.TransformerConfig(vocab_size=2, seq_len=7, n_layers=1, learnable_mask=True, flex=True)
    model = mp.Transformer(cfg)
    with pytest.raises(ValueError, match="flex_attention has no backward on the CPU"):
        model(torch.randint(0, 2, (2, 7))).sum().backward()
    for init in ("mask", "default"):
        rc, out = run_train(tmp_path, *TINY, "--init", init, "--attention", "flex", "--steps", "2")
        err = capsys.readouterr().err
        assert rc == 2 and "--attention flex runs M through torch's flex_attention" in err and not os.path.exists(out)


@cuda
@pytest.mark.parametrize("causal,param", [(False, "full"), (True, "full"), (True, "relative")])
def test_flex_attention_trains_m_as_the_explicit_path_does_on_cuda(causal, param):
    """On CUDA flex_attention is compiled: its outputs and the gradients of x, the weights and M are the explicit
    path's (float32)."""
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=64, n_layers=2, n_heads=4, dim=64, learnable_mask=True,
                               causal=causal, mask_param=param, readout="tokens", n_outputs=5)
    ref = mp.Transformer(dataclasses.replace(cfg, fused=False)).cuda()
    with torch.no_grad():
        for p in mp.mask_priors(ref):
            p.bias.normal_(0, 3)
    flex = mp.Transformer(dataclasses.replace(cfg, flex=True)).cuda()
    flex.load_state_dict(ref.state_dict())
    x = torch.randint(0, 5, (8, 64), device="cuda")
    a, b = ref(x), flex(x)
    torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    a.square().sum().backward()
    b.square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), flex.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-3, rtol=2e-3, msg=name)




# ---------------------------------------------------------------------------------------- maskprior.py: models

def test_transformer_and_vit_share_one_trunk():
    assert issubclass(mp.Transformer, mp.Trunk) and issubclass(mp.ViT, mp.Trunk)
    assert mp.Transformer.forward is mp.ViT.forward is mp.Trunk.forward
    cfg = mp.TransformerConfig(n_layers=1, dim=16, n_heads=2, mlp_dim=24, dropout=0.1)
    block = mp.Block(cfg, mask_size=16, causal=False)
    assert block.mlp[0].out_features == 24 and block.attn.prior.bias.shape == (2, 16, 16)



def test_every_list_of_inits_is_derived_from_the_one_record(monkeypatch):
    """An init is one record (inits.INITS): train's table and its flag groups, what a result.json may name
    (runfiles.INITS), each task's offer and the report's tables are read off the records, so a record added is
    offered, checked and reported everywhere, and one whose flags say otherwise is not."""
    import reporting.report as report
    assert runconfig.INITS is inits.INITS and runfiles.INITS == tuple(inits.INITS)
    # the paper's inits lead each list; a record added joins the lists its flags name (the recipe: one record, one test)
    assert runconfig.MASK_INITS[:2] == ("mask", "mask-impulse") and runconfig.QK_SVD_INITS[:2] == ("qk-svd", "impulse")
    assert runconfig.PRIOR_INITS == tuple(n for n, i in inits.INITS.items() if i.reads_prior)
    assert report.ABLATION_INITS[:4] == ("default", "mask", "qk-svd", "qk-opt")
    assert report.PERSISTENCE_INITS[:3] == ("mask", "qk-svd", "qk-opt")
    assert tasks.TASKS["parity2"].inits() == report.ABLATION_INITS and len(tasks.TASKS["cifar10"].inits()) == len(inits.INITS)
    assert tasks.LeeMultiplication.inits() == tuple(n for n, i in inits.INITS.items()   # its layout moves: no QK init
                                                    if "arithmetic" in i.families and not i.fixed_layout)
    assert tasks.LeeMultiplication.inits()[:2] == ("default", "mask")
    new = inits.Init("qk-twice", inits.init_qk_svd, ("boolean",), reads_prior=True, closed_form=True,
                     fixed_layout=True)
    monkeypatch.setitem(inits.INITS, "qk-twice", new)
    assert tasks.TASKS["parity2"].inits()[-1] == "qk-twice" and "qk-twice" not in tasks.TASKS["cifar10"].inits()
    assert inits.named(closed_form=True)[-1] == "qk-twice"
    assert "qk-twice" not in tasks.LeeMultiplication.inits()


def test_one_model_registry_builds_each_family_and_reads_its_saved_config():
    """MODELS maps each config class to its model: `build_model` builds from a config, `model_from_config` from its
    saved dict (the one family whose config takes every key; a dict that fits none, or a config class that is not
    registered, is refused), so a new family is one entry."""
    small = dict(n_layers=1, dim=16, n_heads=2, mlp_dim=16)
    for cfg in (mp.TransformerConfig(**small), mp.ViTConfig(**small, image_size=8, patch_size=4)):
        assert type(mp.build_model(cfg)) is mp.MODELS[type(cfg)]
        assert type(mp.model_from_config(dataclasses.asdict(cfg))) is mp.MODELS[type(cfg)]
    with pytest.raises(ValueError, match="fits 0 model families"):
        mp.model_from_config({"vocab_size": 2, "patch_size": 4})
    with pytest.raises(TypeError, match="no model family takes a TrunkConfig"):
        mp.build_model(mp.TrunkConfig())

@pytest.mark.parametrize("init", ["default", "mask"])
def test_causal_lm_never_sees_the_future(init):
    """Changing tokens after position t leaves the outputs at positions <= t unchanged."""
    cfg = mp.TransformerConfig(vocab_size=11, seq_len=12, n_layers=2, n_heads=4, dim=32, mlp_dim=64,
                               readout="tokens", causal=True, n_outputs=11, learnable_mask=init == "mask",
                               tie_embeddings=True)
    torch.manual_seed(0)
    model = mp.Transformer(cfg).eval()
    if init == "mask":
        mp.init_mask_(model, logits=mp.causal_distance_logits(12, 4))
    x = torch.randint(0, 11, (3, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 11
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    assert cfg.fused                                        # `model` runs the fused path; compare the explicit one
    explicit = mp.Transformer(mp.TransformerConfig(**{**cfg.__dict__, "fused": False})).eval()
    explicit.load_state_dict(model.state_dict())
    torch.testing.assert_close(explicit(x), a, atol=1e-5, rtol=1e-5)


def test_vit_shapes_and_few_steps_lower_the_loss():
    torch.manual_seed(0)
    cfg = mp.ViTConfig(image_size=8, patch_size=4, n_classes=2, dim=32, n_layers=2, n_heads=2, pool="cls",
                       learnable_mask=True)
    vit = mp.ViT(cfg)
    mp.init_mask_(vit, mp.impulse_pattern(2, 2, mp.IMPULSE_OFFSETS[:2], n_prefix=1))
    x = torch.randn(16, 3, 8, 8)
    y = (x[:, 0, :4, :4].mean((1, 2)) > 0).long()                # learnable from the top-left patch
    logits, maps = vit(x, return_attn=True)
    assert logits.shape == (16, 2) and len(maps) == 2 and maps[0].shape == (16, 2, 5, 5)
    opt = torch.optim.AdamW(mp.param_groups(vit, 0.05), lr=3e-3)
    with torch.no_grad():
        first = float(F.cross_entropy(vit(x), y))
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(vit(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert float(F.cross_entropy(vit(x), y)) < 0.5 * first


def test_drop_path_schedule_and_identity_in_eval():
    cfg = mp.ViTConfig(image_size=8, patch_size=4, n_layers=3, dim=16, n_heads=2, mlp_dim=16, drop_path=0.1)
    model = mp.ViT(cfg)
    assert [b.drop_path for b in model.blocks] == [0.0, 0.05, 0.1]
    x = torch.randn(4, 3, 8, 8)
    model.eval()
    assert torch.equal(model(x), model(x))
    h = torch.ones(1000, 4, 8)
    kept = mp.drop_path(h, 0.25, True)[:, 0, 0]
    assert torch.allclose(kept[kept > 0], torch.tensor(1 / 0.75)) and abs(float((kept > 0).float().mean()) - 0.75) < 0.05


# ---------------------------------------------------------------------------------------- maskprior.py: generate

def test_generate_is_seeded_and_crops_the_context():
    cfg = mp.TransformerConfig(vocab_size=7, seq_len=5, n_layers=1, n_heads=2, dim=16, mlp_dim=16,
                               readout="tokens", causal=True, n_outputs=7)
    model = mp.Transformer(cfg).eval()
    start = torch.tensor([[1, 2, 3]])
    a = mp.generate(model, start, 9, 1.0, 3, torch.Generator().manual_seed(0))
    b = mp.generate(model, start, 9, 1.0, 3, torch.Generator().manual_seed(0))
    assert a.shape == (1, 12) and a.equal(b) and a[:, :3].equal(start)
    g = mp.generate(model, start, 4, 0.0)
    assert g[0, 3] == model(start)[0, -1].argmax()


# ---------------------------------------------------------------------------------------- maskprior.py: inits

def gotu_model(**kw):
    task = tasks.make_task("parity2")
    cfg = mp.TransformerConfig(**{**task.arch(), "n_layers": 2, "n_heads": 4, "dim": 64, **kw})
    torch.manual_seed(0)
    return task, mp.Transformer(cfg)


def test_init_mask_sets_every_layer():
    task, model = gotu_model(learnable_mask=True)
    pat = task.pattern()
    rep = mp.init_mask_(model, pat, 5.0, 8.0)
    assert rep["m_off"] == 8.0
    for blk in model.blocks:
        m = blk.attn.prior.bias
        assert m.shape == (4, 16, 16) and (m[:, pat] == 5).all() and (m[:, ~pat] == -8).all()


def test_init_mask_never_creates_or_resizes_m():
    task, model = gotu_model()                       # no learnable mask
    with pytest.raises(ValueError, match="learnable_mask=True"):
        mp.init_mask_(model, task.pattern())
    _, model = gotu_model(learnable_mask=True, readout="mean")     # 15 positions, no CLS
    before = [b.attn.prior.bias for b in model.blocks]
    with pytest.raises(ValueError, match=r"\(16, 16\).*15 positions"):
        mp.init_mask_(model, task.pattern())         # parity2's CLS layout: 16 x 16
    with pytest.raises(ValueError, match="4 heads and 15 positions"):
        mp.init_mask_(model, torch.ones(3, 15, 15, dtype=torch.bool))
    assert [b.attn.prior.bias for b in model.blocks] == before and all((m == 0).all() for m in before)


def test_a_grid_prior_holds_a_logit_per_displacement_and_the_class_tokens_row_and_column():
    """`grid_index`: two patch pairs share a slot exactly when their displacements agree; the class token's row
    and column are slots of their own; every slot is read. ViT-Tiny at 224 px (14 x 14 patches and a class
    token): a grid M adds <= 1% to the model's parameters, where a full M adds 25%."""
    idx = mp.grid_index(3, 4, n_prefix=1)
    rc = torch.tensor([(r, c) for r in range(3) for c in range(4)])
    disp = (rc[None] - rc[:, None]).view(12 * 12, 2)
    same_slot = idx[1:, 1:].reshape(-1)[:, None] == idx[1:, 1:].reshape(-1)[None]
    assert torch.equal(same_slot, (disp[:, None] == disp[None]).all(-1))
    prefix = torch.cat([idx[0], idx[1:, 0]])
    assert prefix.unique().numel() == 13 + 12 and not bool(torch.isin(prefix, idx[1:, 1:]).any())
    assert torch.equal(idx.unique(), torch.arange(mp.grid_slots(3, 4, 1)))
    counts = {}
    for param in ("full", "grid"):
        vit = mp.ViT(mp.ViTConfig(image_size=224, patch_size=16, pool="cls", learnable_mask=True, mask_param=param))
        m = sum(p.bias.numel() for p in mp.mask_priors(vit))
        counts[param] = (m, sum(p.numel() for p in vit.parameters()) - m)
    assert counts["full"][0] == 12 * 3 * 197 * 197 and counts["grid"][0] == 12 * 3 * mp.grid_slots(14, 14, 1)
    assert counts["grid"][0] / counts["grid"][1] <= 0.01 < 0.25 <= counts["full"][0] / counts["full"][1]


def test_a_grid_prior_takes_displacement_logits_exactly_and_the_mean_of_each_slot_otherwise():
    """Logits that depend on the displacement alone (the soft bump, its class token at +m_on) are held exactly;
    (to rounding: the slot's mean); the impulse pattern, whose edge patches fall back to themselves, becomes each
    slot's mean: a head's own
    offset stays +m_on, self-attention (the fall-back of a few patches) its mean."""
    soft = mp.soft_offset_logits(4, 4, mp.IMPULSE_OFFSETS[:3], 1.0, 5.0, 10.0, n_prefix=1)
    prior = mp.MaskPrior(17, 3, logits=soft, param="grid", grid=(4, 4))
    torch.testing.assert_close(prior.full_logits().detach(), soft, atol=1e-5, rtol=0)
    pat = mp.impulse_pattern(4, 4, [(0, 1)], n_prefix=1)
    held = mp.MaskPrior(17, 1, pat, param="grid", grid=(4, 4)).full_logits().detach()[0]
    assert held[1, 2] == 5.0 and held[0].eq(5.0).all() and held[1:, 0].eq(5.0).all()
    assert float(held[1, 1]) == pytest.approx((4 * 5.0 - 12 * 5.0) / 16)          # 4 of 16 patches at the right edge


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_a_vit_with_a_grid_prior_gives_the_same_outputs_and_gradients_fused_and_explicit(pool):
    """The fused path (on the CPU, the kernel with M's gradient by `_backward`, gathered into its slots) and the
    explicit softmax agree on a ViT with a 2-D relative M, in its outputs and every gradient, M's included."""
    cfg = mp.ViTConfig(image_size=16, patch_size=4, dim=24, n_layers=2, n_heads=3, mlp_dim=32, pool=pool,
                       learnable_mask=True, mask_param="grid")
    torch.manual_seed(0)
    vit = mp.ViT(cfg)
    mp.init_mask_(vit, logits=mp.soft_offset_logits(4, 4, mp.IMPULSE_OFFSETS[:3], 0.5, 5.0, 5.0, cfg.n_prefix))
    x = torch.randn(2, 3, 16, 16)
    grads = []
    for fused in (True, False):
        for block in vit.blocks:
            block.attn.fused = fused
        vit.zero_grad()
        out = vit(x)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in vit.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mask_param_grid_is_refused_in_one_line_where_there_is_no_patch_grid(image_dir):
    """--mask-param grid on a task of tokens (train.py's rule) and mask_param='grid' in a TransformerConfig are
    each one line; on an image task the run's model holds the grid M."""
    with pytest.raises(runfiles.UsageError, match=r"^--mask-param grid is a 2-D relative M .* parity2 is a boolean"):
        runconfig.check(_resolved(["--task", "parity2", "--init", "mask", "--mask-param", "grid"]))
    with pytest.raises(ValueError, match=r"^TransformerConfig: mask_param='grid'"):
        mp.TransformerConfig(learnable_mask=True, mask_param="grid")
    config = _resolved(["--task", "cifar10", "--data-dir", image_dir, "--init", "mask-impulse", "--mask-param", "grid",
                        "--preset", "small"])
    model_cfg = train.model_config(config, runconfig.check(config))
    assert model_cfg.mask_grid == (8, 8) and mp.build_model(model_cfg).blocks[0].attn.prior.param == "grid"


def test_qk_svd_puts_pseudo_input_mass_on_pattern():
    task, model = gotu_model()
    pat = task.pattern()
    rep = mp.init_qk_svd_(model, pat, generator=torch.Generator().manual_seed(0))
    assert len(rep["pseudo_mass"]) == 2 and min(rep["pseudo_mass"]) > 0.9
    p = mp.pseudo_input(model, mp.qk_view(model).sites[1])
    a = mp.pseudo_attention(model.blocks[1].attn, p)
    assert float(mp.pattern_mass(a.unsqueeze(0), pat)) == pytest.approx(rep["pseudo_mass"][1], abs=1e-5)
    # uniform attention would put only the pattern's density there
    assert float(pat.float().sum(-1).mean() / 16) < 0.2


def test_qk_opt_fits_pattern_better_than_random():
    task, model = gotu_model()
    pat = task.pattern()
    before = mp.pattern_mass(mp.pseudo_attention(model.blocks[0].attn, mp.pseudo_input(model)).unsqueeze(0), pat)
    rep = mp.init_qk_opt_(model, pat, steps=300, lr=1e-2, generator=torch.Generator().manual_seed(0))
    assert rep["steps"] == 300 and rep["pseudo_mass"][0] > float(before) + 0.1
    # layer 0 is copied to every layer
    inner = 2 * 64
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight[:inner], model.blocks[1].attn.qkv.weight[:inner])


def test_mimetic_products_close_to_targets():
    cfg = mp.ViTConfig(image_size=8, patch_size=4, dim=48, n_layers=1, n_heads=1, head_dim=48)
    vit = mp.ViT(cfg)
    g = torch.Generator().manual_seed(0)
    rep = mp.init_mimetic_(vit, generator=g)
    assert rep["vo_truncation_error"][0] < 1e-5
    wq, wk = mp.qk_weights(vit.blocks[0].attn)
    qk = (wq[0] @ wk[0].T).detach()
    # a Z + b I with Z of variance 1/D: the diagonal ~ b, the rest ~ N(0, a^2 / D)
    assert float(qk.diagonal().mean()) == pytest.approx(0.7, abs=0.1)
    off = qk - torch.diag(qk.diagonal())
    assert float(off.std()) == pytest.approx(0.7 / 48 ** 0.5, rel=0.2)
    attn = vit.blocks[0].attn
    vo = (attn.qkv.weight[96:].T @ attn.proj.weight.T).detach()
    assert float(vo.diagonal().mean()) == pytest.approx(-0.4, abs=0.1)


# ---------------------------------------------------------------------------------------- maskprior.py: param groups

def test_param_groups_keep_mask_out_of_weight_decay():
    _, model = gotu_model(learnable_mask=True)
    groups = mp.param_groups(model, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    masks = [b.attn.prior.bias for b in model.blocks]
    assert all(id(m) not in decay for m in masks)
    assert id(model.blocks[0].attn.qkv.weight) in decay and id(model.pos_emb) not in decay
    assert id(model.blocks[0].ln1.weight) not in decay and id(model.tok_emb.weight) not in decay
    n_all = sum(1 for _ in model.parameters())
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == n_all


@pytest.mark.parametrize("make", [lambda ps, wd: torch.optim.AdamW(ps, lr=1e-2, weight_decay=wd),
                                  lambda ps, wd: torch.optim.Adam(ps, lr=1e-2, weight_decay=wd),
                                  lambda ps, wd: torch.optim.SGD(ps, lr=1e-2, weight_decay=wd)],
                         ids=["AdamW", "Adam", "SGD"])
def test_an_optimiser_that_would_decay_m_is_refused_on_its_first_step(make):
    """M in a decayed group (a plain optimiser over model.parameters()) is one ValueError line on the first step,
    M untouched, naming param_groups; M frozen, decay 0, or param_groups' groups step as usual."""
    task, model = gotu_model(learnable_mask=True)
    mp.init_mask_(model, task.pattern())
    start = model.blocks[0].attn.prior.bias.detach().clone()
    x = task.setup().probe_inputs(4)

    def step(opt):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    with pytest.raises(ValueError, match=r"param group 0 decays M of 2 prior\(s\) .* weight_decay=0.1, .* "
                                         r"maskprior.param_groups\(model, weight_decay\) does$"):
        step(make(model.parameters(), 0.1))
    assert torch.equal(model.blocks[0].attn.prior.bias, start)
    for opt in (make(mp.param_groups(model, 0.1), 0.1), make(model.parameters(), 0.0)):
        step(opt)
        step(opt)
    for block in model.blocks:
        block.attn.prior.bias.requires_grad_(False)
    step(make([p for p in model.parameters() if p.requires_grad], 0.1))


# ---------------------------------------------------------------------------------------- maskprior.py: probes

def test_prior_probes():
    task, model = gotu_model(learnable_mask=True)
    pat = task.pattern()
    mp.init_mask_(model, pat, 5.0, 5.0)
    task.setup()
    mass = mp.prior_mass(model, task.probe_inputs(64), pat)
    assert len(mass) == 2 and all(0.5 < m <= 1.0 for m in mass)
    snap = mp.prior_snapshot(model)
    assert mp.prior_drift(model, snap)["mask_drift"] == [0.0, 0.0]
    with torch.no_grad():
        model.blocks[0].attn.prior.bias.mul_(2)
    assert mp.prior_drift(model, snap)["mask_drift"][0] == pytest.approx(1.0)


@pytest.mark.parametrize("causal", [False, True])
def test_content_margin_takes_the_prior_out_and_matches_the_mass(causal):
    """One layer: the content margin is the same with M set or zeroed (the bias is taken out); without M it
    is, row by row, log(mass off / mass on); with a constant on/off bias the mass follows margin - gap."""
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=9, n_layers=1, n_heads=2, dim=32, mlp_dim=64, readout="tokens",
                               n_outputs=5, causal=causal, learnable_mask=True)
    model = mp.Transformer(cfg).eval()
    x = torch.randint(0, 5, (6, 9))
    pattern = mp.banded_pattern(9, 1) & (mp.causal_pattern(9) if causal else True)
    zero = mp.content_margin(model, x, pattern)                      # M = 0: a constant bias, no prior
    with torch.no_grad():
        _, (a,) = model(x, return_attn=True)
    on = (a * pattern).sum(-1)
    rows = mp.prior_rows(pattern, causal)
    ratio = ((1 - on) / on).log()[..., rows]
    # the mean of log-ratios: LSE over off keys minus LSE over on keys of log a, row by row
    assert zero[0] == pytest.approx(float(ratio.mean()), abs=1e-4)
    mp.init_mask_(model, pattern, m_on=5.0, m_off=10.0)
    assert mp.content_margin(model, x, pattern)[0] == pytest.approx(zero[0], abs=1e-3)
    with torch.no_grad():
        _, (a,) = model(x, return_attn=True)
    gap = float(F.logsigmoid(torch.tensor(5.0)) - F.logsigmoid(torch.tensor(-10.0)))
    on = (a * pattern).sum(-1)
    assert float(((1 - on) / on).log()[..., rows].mean()) == pytest.approx(zero[0] - gap, abs=1e-3)


def test_no_constrained_row_gives_null_mass_with_a_reason(tmp_path, text_dir):
    """A causal-distance window wider than the context constrains no row: the mass is null with a reason, not NaN."""
    out = str(tmp_path / "lm")
    assert train.main(["--task", "wikitext2", "--data-dir", text_dir, "--context", "5", "--heads", "4", "--init",
                       "mask", "--steps", "2", "--layers", "1", "--dim", "16", "--mlp-dim", "16", "--val-tokens", "50",
                       "--out", out]) == 0
    text = open(os.path.join(out, "result.json")).read()
    assert "NaN" not in text
    res = json.loads(text)
    m = res["metrics"]
    assert m["prior_mass_start"] is None and m["prior_mass_end"] is None
    assert "constrains no query row" in res["prior_mass_note"]
    with pytest.raises(ValueError, match="constrains no query row"):
        mp.prior_probe(mp.Transformer(mp.TransformerConfig(seq_len=4, readout="tokens", causal=True, n_outputs=2)),
                       torch.zeros(1, 4, dtype=torch.long), mp.causal_pattern(4))


# ---------------------------------------------------------------------------------------- maskprior.py: from attention

def test_a_prior_from_attention_reads_known_maps():
    """The attention-to-prior functions on maps of known structure: pairs above the ratio (causal rows over their
    visible keys, free rows outside `readout`), keys made a clique, soft logits whose bias alone gives the
    attention back, a distance profile a relative MaskPrior takes, and offsets on an image grid."""
    n = 6
    a = torch.full((n, n), 1.0 / n)
    a[:, 1] += 0.5
    a[:, 3] += 0.5
    a = a / a.sum(-1, keepdim=True)                              # keys 1 and 3 favoured by every row
    attn = a.expand(2, 3, n, n)                                  # (L, H, N, N)
    keys = mp.pattern_from_attention(attn, 1.5, keys=True)
    assert keys.sum() == n + 2 and keys[1, 3] and keys[3, 1] and not keys[0, 1]
    cls = mp.pattern_from_attention(attn, 1.5, keys=True, readout=[0])
    assert cls[0, 1] and cls[0, 3] and cls.sum() == n + 4
    pairs = mp.pattern_from_attention(attn, 1.5)
    assert pairs[:, [1, 3]].all() and pairs.sum() == 2 * n + (n - 2)
    only = mp.pattern_from_attention(attn, 1.5, readout=[2])
    assert only[[0, 1, 3, 4, 5]].all() and only[2].tolist() == [False, True, True, True, False, False]
    c = mp.causal_pattern(n).float()
    c[:, 0] += 3.0 * c.sum(-1)                                   # every row looks back at key 0
    causal = mp.pattern_from_attention((c / c.sum(-1, keepdim=True)).tril(), 1.5, causal=True)
    assert torch.equal(causal, torch.eye(n, dtype=torch.bool) | (torch.arange(n)[None] == 0))   # no future key
    assert mp.pattern_from_attention(attn, 1.5, per_head=True).shape == (3, n, n)
    m = mp.logits_from_attention(attn, 30.0, 30.0)
    assert m.shape == (3, n, n) and torch.allclose(F.logsigmoid(m).softmax(-1), a.expand(3, n, n), atol=1e-5)
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    kernel = torch.where((d >= 0) & (d <= 2), torch.exp(-d.float()), torch.zeros(()))
    kernel = kernel / kernel.sum(-1, keepdim=True)
    rel = mp.relative_from_attention(kernel.expand(1, 2, n, n), causal=True)
    prior = mp.MaskPrior(n, 2, logits=rel, causal=True, param="relative")        # one logit per distance
    table = prior.bias
    assert table[:, 0].eq(5.0).all() and (table[:, 1] < 5.0).all() and (table[:, 1] > table[:, 2]).all()
    assert table[:, 3:].eq(-5.0).all()
    grid = mp.impulse_pattern(4, 4, mp.IMPULSE_OFFSETS[:3])
    shares = mp.offsets_from_attention((grid.float() / grid.sum(-1, keepdim=True))[None], 4, 4)
    assert (shares > 0).sum() >= 0.8 * grid.sum() and not ((shares > 0) & ~grid).any()
    with_cls = mp.offsets_from_attention(torch.rand(1, 3, 17, 17).softmax(-1), 4, 4, n_prefix=1)
    assert with_cls.shape == (3, 17, 17) and with_cls[:, 0].eq(5.0).all() and with_cls[:, :, 0].eq(5.0).all()
    for bad, needle in ((lambda: mp.pattern_from_attention(attn, 0.0), "ratio must be a finite number > 0"),
                        (lambda: mp.pattern_from_attention(torch.rand(3, 4, 5), 1.5), "attention maps are"),
                        (lambda: mp.offsets_from_attention(torch.rand(1, 3, 16, 16), 4, 4, 1), "a 4 x 4 grid")):
        with pytest.raises(ValueError, match=needle):
            bad()


# ---------------------------------------------------------------------------------------- maskprior.py: retrofit

















def _past(m: torch.Tensor) -> torch.Tensor:
    """Logits `m` (..., n, n) for a causal prior: -5 on the future (a causal prior refuses an M > 0 there that varies)."""
    return m.masked_fill(mp.future_keys(m.shape[-1]), -5.0)


























































# ---- the library refuses what it would drop or guess (issue 41): a pattern with logits, a switch that is not a
# bool, prior_roles on a retrofitted model, a part's M that PEFT froze, non-finite or empty maps and m_on / m_off,
# a ratio no pair reaches, an encoder-decoder's parts given priors one call each





def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


# ---- 10: pattern and logits



def test_mask_prior_and_init_mask_refuse_a_pattern_given_with_logits():
    with pytest.raises(ValueError, match="MaskPrior: got both a pattern and logits"):
        mp.MaskPrior(8, 4, mp.banded_pattern(8, 1), logits=torch.zeros(4, 8, 8))
    model = mp.Transformer(mp.TransformerConfig(vocab_size=2, seq_len=8, readout="mean", learnable_mask=True,
                                                n_layers=1, n_heads=2, dim=16, mlp_dim=16))
    before = model.blocks[0].attn.prior.bias.detach().clone()
    with pytest.raises(ValueError, match="init_mask_: got both a pattern and logits"):
        mp.init_mask_(model, mp.banded_pattern(8, 1), logits=torch.zeros(2, 8, 8))
    assert torch.equal(model.blocks[0].attn.prior.bias, before)


# ---- 11: switches are bools

_PAT, _MAP = mp.banded_pattern(8, 1), torch.rand(2, 8, 8).softmax(-1)


# ---- 12: prior_roles







# ---- 13: PEFT on a part



# ---- 16: maps and numbers

FROM_MAPS = {
    "pattern_from_attention": lambda a: mp.pattern_from_attention(a, 1.5),
    "logits_from_attention": lambda a: mp.logits_from_attention(a),
    "relative_from_attention": lambda a: mp.relative_from_attention(a),
    "offsets_from_attention": lambda a: mp.offsets_from_attention(a, 2, 2),
}


def _maps(kind: str) -> torch.Tensor:
    a = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    if kind == "empty":
        return torch.zeros(0, 3, 4, 4)
    a[1, 2, 3, 1] = float("nan") if kind == "one nan" else float("inf")
    return a


@pytest.mark.parametrize("kind", ["one nan", "one inf", "empty"])
@pytest.mark.parametrize("who", list(FROM_MAPS))
def test_priors_from_attention_refuse_non_finite_or_empty_maps(who, kind):
    want = "are empty" if kind == "empty" else "hold 1 non-finite values"
    with pytest.raises(ValueError, match=rf"^{who}: the attention maps .*{want}") as err:
        FROM_MAPS[who](_maps(kind))
    _one_line(err)


def test_pattern_from_attention_refuses_an_empty_square_map():
    with pytest.raises(ValueError, match="are empty"):
        mp.pattern_from_attention(torch.zeros(0, 0), 1.5)




def _lm() -> mp.Transformer:
    return mp.Transformer(mp.TransformerConfig(vocab_size=5, seq_len=8, readout="tokens", causal=True, n_outputs=5,
                                               learnable_mask=True, n_layers=1, n_heads=2, dim=16, mlp_dim=16))


_MODEL8 = lambda: mp.Transformer(mp.TransformerConfig(  # noqa: E731
    vocab_size=2, seq_len=8, readout="mean", learnable_mask=True, n_layers=1, n_heads=2, dim=16, mlp_dim=16))
def _source(kwargs: dict) -> dict:
    """The arguments given, with the pattern _PAT where they name neither a pattern nor logits."""
    return kwargs if {"pattern", "logits"} & set(kwargs) else {"pattern": _PAT, **kwargs}


LIBRARY_CALLS = {   # each public function `mp.checked` checks, called well: the generated test changes one argument
    "pattern_from_pairs": lambda **k: mp.pattern_from_pairs(**{"n": 4, "pairs": [(0, 1)], **k}),
    "banded_pattern": lambda **k: mp.banded_pattern(**{"n": 8, "width": 1, **k}),
    "embed_pattern": lambda **k: mp.embed_pattern(**{"pattern": _PAT, "offset": 1, "n": 9, **k}),
    "impulse_pattern": lambda **k: mp.impulse_pattern(**{"grid_h": 2, "grid_w": 2, "offsets": [(0, 1)], "n_prefix": 1,
                                                         **k}),
    "grid_index": lambda **k: mp.grid_index(**{"grid_h": 2, "grid_w": 3, "n_prefix": 1, **k}),
    "grid_slots": lambda **k: mp.grid_slots(**{"grid_h": 2, "grid_w": 3, "n_prefix": 1, **k}),
    "window_pattern": lambda **k: mp.window_pattern(**{"grid_h": 3, "grid_w": 3, "kernel": 3, "n_heads": 2, **k}),
    "soft_offset_logits": lambda **k: mp.soft_offset_logits(**{"grid_h": 2, "grid_w": 2, "offsets": [(0, 1)],
                                                               "alpha": 1.0, "m_on": 5.0, "m_off": 5.0, **k}),
    "random_impulse_offsets": lambda **k: mp.random_impulse_offsets(**{"n_heads": 3, **k}),
    "causal_pattern": lambda **k: mp.causal_pattern(**{"n": 4, **k}),
    "alibi_slopes": lambda **k: mp.alibi_slopes(**{"n_heads": 4, **k}),
    "causal_distance_logits": lambda **k: mp.causal_distance_logits(**{"n": 8, "n_heads": 2, **k}),
    "mask_logits_from_pattern": lambda **k: mp.mask_logits_from_pattern(**{"pattern": _PAT, **k}),
    "MaskPrior": lambda **k: mp.MaskPrior(**_source({"n": 8, "heads": 2, **k})),
    "init_mask_": lambda **k: mp.init_mask_(_MODEL8(), **_source(k)),
    "param_groups": lambda **k: mp.param_groups(_MODEL8(), **{"weight_decay": 0.1, **k}),
    "prior_rows": lambda **k: mp.prior_rows(**{"pattern": _PAT, **k}),
    "layer_margin": lambda **k: mp.layer_margin(**{"a": _MAP[None], "pattern": _PAT, "rows": torch.ones(8, dtype=bool),
                                                   **k}),
    "visible_keys": lambda **k: mp.visible_keys(**{"n": 8, **k}),
    "attention_ratio": lambda **k: mp.attention_ratio(**{"attn": _MAP, **k}),
    "pattern_from_attention": lambda **k: mp.pattern_from_attention(**{"attn": _MAP, "ratio": 1.01, **k}),
    "logits_from_attention": lambda **k: mp.logits_from_attention(**{"attn": _MAP, **k}),
    "relative_from_attention": lambda **k: mp.relative_from_attention(**{"attn": _MAP, **k}),
    "offsets_from_attention": lambda **k: mp.offsets_from_attention(**{"attn": torch.rand(2, 5, 5).softmax(-1),
                                                                       "grid_h": 2, "grid_w": 2, "n_prefix": 1, **k}),
    "add_mask_prior": lambda **k: retrofit.add_mask_prior(nn.TransformerEncoder(nn.TransformerEncoderLayer(
        16, 2, 16, batch_first=True), 1, enable_nested_tensor=False), **_source(k)),
    "init_qk_svd_": lambda **k: mp.init_qk_svd_(_MODEL8(), **{"pattern": _PAT, **k}),
    "init_qk_opt_": lambda **k: mp.init_qk_opt_(_MODEL8(), **{"pattern": _PAT, "steps": 2, **k}),
    "depends_on_distance": lambda **k: mp.depends_on_distance(_PAT, **k),
    "pattern_agreement": lambda **k: mp.pattern_agreement(_PAT, _PAT, **{"causal": False, **k}),
    "mask_grad_bound": lambda **k: mp.mask_grad_bound(**{"attn": _MAP, "attn_grad": _MAP, "mask_logits": _MAP, **k}),
    "generate": lambda **k: mp.generate(_lm(), **{"idx": torch.zeros(1, 2, dtype=torch.long), "n_new": 2, **k}),
}
BAD = {   # an argument's kind -> values it must refuse (ints and reals also just below their least)
    "bool": ["no", 1, 0.0],
    "int": [2.5, True, "3", float("nan")],
    "real": [float("nan"), float("inf"), -float("inf"), "5", True],
    "pattern": [torch.zeros(8, 8, dtype=torch.bool), torch.ones(8, 8), torch.ones(8, dtype=torch.bool), "all"],
    "logits": [torch.ones(8, 8, dtype=torch.bool), torch.full((8, 8), float("nan")), torch.ones(8, 8, dtype=torch.long),
               torch.zeros(8)],
    "maps": [-_MAP, torch.zeros(2, 8, 8), torch.full((2, 8, 8), float("nan")), torch.ones(2, 8, 8, dtype=torch.long),
             torch.empty(0, 8, 8)],
    "indices": [[0.5], 0, [], [-1], torch.tensor([True, False]), [True]],
    "offsets": [[], [(0,)], [(0.5, 0)], "ab", [(0, True)]],
    "grid": [(0, 4), (4,), (2.0, 2), "ab", (True, 2), (4, 2 ** 21)],
    "choice": ["ful", "", 1, ("full",)],
}


def _bad_values(arg: mp.Arg) -> list:
    below = [] if arg.least is None else [arg.least if arg.above else arg.least - 1]
    return BAD[arg.kind] + [int(v) if arg.kind == "int" else float(v) for v in below]


def _checked(fn: str) -> tuple:
    target = getattr(mp, fn, None) or getattr(retrofit, fn)
    return (target.__init__ if isinstance(target, type) else target).checked


LIBRARY_CASES = [(fn, name, i) for fn in LIBRARY_CALLS for name in _checked(fn)
                 for i in range(len(_bad_values(mp.ARGS[name])))]


def test_every_public_argument_the_table_names_is_checked_and_every_checked_function_has_a_call():
    """By construction: every public function or class of maskprior.py and maskprior_retrofit.py that takes an
    argument ARGS names is `mp.checked` (but `pattern_mass`, a measurement: nan maps give a nan mass, which training
    watches), and every checked one has a good call above, so the generated test reaches each new one; each call as
    given runs."""
    public = {n: (f.__init__ if isinstance(f, type) else f) for module in (mp, retrofit) for n, f in vars(module).items()
              if not n.startswith("_") and callable(f) and getattr(f, "__module__", "") == module.__name__
              and (not isinstance(f, type) or issubclass(f, nn.Module))}
    takes = {n for n, f in public.items() if set(inspect.signature(f).parameters) & set(mp.ARGS)}
    exempt = {"pattern_mass", "prior_probe", "prior_mass", "content_margin",     # measurements
              "check_pattern", "check_one_source", "Block", "Attention"}         # the checks; built from a checked config
    assert {n for n in takes if not hasattr(public[n], "checked")} <= exempt
    assert {n for n, f in public.items() if hasattr(f, "checked")} == set(LIBRARY_CALLS)
    for fn, call in LIBRARY_CALLS.items():
        call()


def test_an_m_that_to_empty_left_without_values_is_refused_until_set_or_loaded_and_torchscript_is_one_line():
    """A model built on the meta device and moved with `to_empty` has memory but no values in M: its forward is one
    line until init_mask_ or load_state_dict sets M (then it runs as the model it was loaded from); a TorchScript model
    cannot take a prior (no hooks, no new parameters): one line saying to add it to the module, then trace it."""
    cfg = mp.TransformerConfig(vocab_size=2, seq_len=7, n_layers=1, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True)
    x, saved = torch.zeros(1, 7, dtype=torch.long), mp.Transformer(cfg).eval()
    for fused in (True, False):
        for load in (True, False):
            with torch.device("meta"):
                model = mp.Transformer(dataclasses.replace(cfg, fused=fused))
            model = model.to_empty(device="cpu").eval()
            with pytest.raises(ValueError, match="M was built on the meta device and holds no values yet"):
                model(x)
            if load:
                model.load_state_dict(saved.state_dict())
                torch.testing.assert_close(model(x), saved(x))
            else:               # M set; the other weights are still to_empty's memory (initialise them as you would)
                mp.init_mask_(model, mp.banded_pattern(8, 1))
                assert model(x).shape == (1, 1)
    scripted = torch.jit.script(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 16, batch_first=True), 1,
                                                      enable_nested_tensor=False))
    with pytest.raises(ValueError, match="is a TorchScript model.*add the prior to the nn.Module, then trace") as err:
        retrofit.add_mask_prior(scripted, _PAT)
    _one_line(err)


@pytest.mark.parametrize("fn, name, i", LIBRARY_CASES, ids=[f"{f}-{n}-{i}" for f, n, i in LIBRARY_CASES])
def test_the_library_refuses_each_bad_value_of_each_public_argument(fn, name, i):
    """Generated from the table (`mp.ARGS`): each public argument of each checked function, given each bad value of
    its kind (a switch that is not a bool, a number not finite or below its least, a pattern that allows nothing or
    is not bool, logits that are bool or nan, maps that are negative or attend nowhere, readout rows that are not
    positions, offsets that are not pairs), is one ValueError line naming the function."""
    value = _bad_values(mp.ARGS[name])[i]
    with pytest.raises(ValueError) as err:
        LIBRARY_CALLS[fn](**{name: value})
    assert str(err.value).startswith(f"{fn}: ") or fn in str(err.value), str(err.value)
    _one_line(err)


FIELD_CASES = [(cfg, name, value) for cfg in (mp.TransformerConfig, mp.ViTConfig)
               for name in mp.FIELDS if name in {f.name for f in dataclasses.fields(cfg)}
               for value in _bad_values(mp.FIELDS[name])]


@pytest.mark.parametrize("cfg, name, value", FIELD_CASES,
                         ids=[f"{c.__name__}-{n}-{v!r}" for c, n, v in FIELD_CASES])
def test_a_model_config_refuses_each_bad_value_of_each_declared_field(cfg, name, value):
    """Generated from the table (`mp.FIELDS`): a model config given a bad value of a field the table
    names is one ValueError line naming the config and the field; each allowed value is taken (but a 2-D
    relative M, mask_param='grid', by a model of tokens: refused in one line naming the image model)."""
    with pytest.raises(ValueError, match=rf"^{cfg.__name__}: {name} must be ") as err:
        cfg(**{name: value})
    _one_line(err)
    for good in mp.FIELDS[name].choices:
        if (name, good, cfg) == ("mask_param", "grid", mp.TransformerConfig):
            with pytest.raises(ValueError, match=r"^TransformerConfig: mask_param='grid' .* \(ViTConfig\)$"):
                cfg(**{name: good})
            continue
        assert getattr(cfg(**{name: good}), name) == good


@pytest.mark.parametrize("keys", [False, True], ids=["pairs", "keys"])
def test_pattern_from_attention_refuses_a_ratio_no_pair_reaches_naming_the_largest(keys):
    """N = 15: no key's share exceeds 15 times uniform, so ratio 1e9 finds only self-loops: refused, naming the
    largest ratio present (at most 15); a reachable ratio still finds pairs."""
    attn = torch.rand(2, 4, 15, 15, generator=torch.Generator().manual_seed(0)).softmax(-1)
    want = r"^pattern_from_attention: no query-key pair beyond the self-loops reaches ratio 1e\+09 \(the largest share"
    with pytest.raises(ValueError, match=want) as err:
        mp.pattern_from_attention(attn, 1e9, keys=keys)
    msg = _one_line(err)
    largest = float(msg.split("largest share present is ")[1].split(" ")[0])
    reach = float(msg.split("give a ratio of at most ")[1].split(",")[0])
    assert 1.0 < reach <= largest <= 15.0 and (reach == largest) != keys
    found = mp.pattern_from_attention(attn, reach * 0.999, keys=keys)             # the ratio it names finds pairs
    assert (found & ~torch.eye(15, dtype=torch.bool)).any()
    with pytest.raises(ValueError, match="no query-key pair beyond the self-loops"):
        mp.pattern_from_attention(attn, reach * 1.001, keys=keys)


# ---- 18: encoder and decoder





# ---- the peers' behaviours, generated: each family of the README's models table x each behaviour it has

















































# ---------------------------------------------------------------------------------------- tasks.py: base and registry

def test_registry_and_task_constants():
    assert set(tasks.TASKS) == {"parity2", "majority3", "cyclic3", "kparity", "kmajority", "ksum", "addition", "multiplication",
                            "cifar10", "cifar100", "imagenet100", "wikitext2", "tinystories"}
    for name, cls in tasks.TASKS.items():
        assert cls.NAME == name and cls.KIND in ("boolean", "arithmetic", "vision", "lm")
        assert cls.DEFAULT_PATTERN in cls.PATTERNS and cls.HEADLINE and set(cls.inits()) <= set(runconfig.INITS)
        assert {"small", "paper"} <= set(cls.presets()) <= {"small", "paper", "paper32"}
    with pytest.raises(tasks.TaskError, match="unknown task"):
        tasks.make_task("nosuch")
    with pytest.raises(tasks.TaskError, match="takes no option data_frac"):
        tasks.make_task("parity2", data_frac=0.1)
    with pytest.raises(ValueError, match="registered twice"):
        tasks.register("parity2")(type("Again", (tasks.Task,), {}))


# ---------------------------------------------------------------------------------------- tasks.py: files

@pytest.mark.parametrize("how", ["plain", "checksummed", "sample"])
def test_a_checkpoint_that_would_run_code_runs_nothing(tmp_path, capsys, trained_once, how):
    """ckpt.pt replaced by a pickle that runs a command when loaded (the whole file, or inside the checksummed
    format with a matching sha256), read by --resume or --sample: one line, exit 2, the command never runs,
    the folder unchanged. A real checkpoint loads at both levels with weights_only=True."""
    out = _halted(tmp_path, once=trained_once)
    outer = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert set(torch.load(io.BytesIO(outer["payload"]), weights_only=True)) >= set(runfiles.CKPT_KEYS)
    marker = tmp_path / "ran"
    if how == "plain":
        torch.save({"model": _Touch(marker), "step": 1}, os.path.join(out, "ckpt.pt"))
    else:
        buf = io.BytesIO()
        torch.save({**{k: 0 for k in runfiles.CKPT_KEYS}, "model": _Touch(marker, "eval")}, buf)
        payload = buf.getvalue()
        torch.save({"format": runfiles.CKPT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload},
                   os.path.join(out, "ckpt.pt"))
    before = _tree(out)
    capsys.readouterr()
    argv = ["--out", out, "--sample", "hi"] if how == "sample" else ["--out", out, "--resume"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert not marker.exists() and len(err.splitlines()) == 1 and "would run code" in err and "it was not run" in err
    assert "it names posix.system" in err or "it names eval" in err, err
    assert _tree(out) == before


def test_torch_s_own_warnings_never_reach_the_one_line(monkeypatch):
    """`runfiles.load_torch` keeps whatever torch.load warns (older torch warns on several load paths; 2.14 on none of
    this suite's) out of the user's terminal: a torch.load that warns, then loads, leaves no warning behind."""
    real = torch.load

    def noisy(*args, **kwargs):
        warnings.warn("torch says something", UserWarning)
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "load", noisy)
    buf = io.BytesIO()
    torch.save({"a": torch.ones(2)}, buf)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert torch.equal(runfiles.load_torch(buf.getvalue(), "x.pt")["a"], torch.ones(2))
    assert not [w for w in seen if "torch says" in str(w.message)]


@pytest.mark.slow
def test_a_damaged_checkpoint_is_refused(tmp_path, capsys):
    """ckpt.pt holds its contents beside their sha256: a bit flipped in the contents, or anywhere in the file,
    is one line and exit 2 (never a resume from damaged weights); the intact file resumes."""
    out = _halted(tmp_path)
    path = os.path.join(out, "ckpt.pt")
    good = open(path, "rb").read()
    outer = torch.load(path, weights_only=False)
    assert outer["format"] == runfiles.CKPT_FORMAT and len(outer["sha256"]) == 64
    payload = bytearray(outer["payload"])
    payload[len(payload) // 2] ^= 0x10
    torch.save({**outer, "payload": bytes(payload)}, path)
    capsys.readouterr()
    assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "is damaged (its contents do not match the checksum" in err and len(err.splitlines()) == 1
    for offset in (len(good) // 5, len(good) // 2, 4 * len(good) // 5):
        bad = bytearray(good)
        bad[offset] ^= 0x01
        open(path, "wb").write(bytes(bad))
        assert train.main(["--resume", "--out", out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and ("is damaged" in err or "cannot read" in err), (offset, err)
    open(path, "wb").write(good)
    assert train.main(["--resume", "--out", out]) == 0


def test_an_out_path_that_cannot_be_made_leaves_no_folder(tmp_path, capsys):
    """A 4 KB --out (each folder name fits, the whole path does not): one line, and none of the folders the
    attempt made is left; an --out under a file likewise."""
    deep = tmp_path / "/".join(["d" * 200] * 21) / "run"
    assert len(str(deep)) > 4096
    assert train.main([*TINY, "--steps", "1", "--out", str(deep)]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot create the run folder (File name too long)" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("x")
    assert train.main([*TINY, "--steps", "1", "--out", str(tmp_path / "file" / "a" / "run")]) == 2
    assert "cannot create the run folder (Not a directory)" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.parametrize("where", ["file", "under-file", "empty", "unwritable"])
def test_an_out_that_cannot_hold_a_run_is_one_line(tmp_path, capsys, where):
    (tmp_path / "f").write_text("not a folder")
    out = {"file": str(tmp_path / "f"), "under-file": str(tmp_path / "f" / "run"), "empty": "",
           "unwritable": "/proc/maskprior-run"}[where]
    if where == "unwritable" and not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc, a folder nobody can write in")
    assert train.main([*TINY, "--steps", "2", "--out", out]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and ("--out" in err or "not a folder" in err), err
    assert open(tmp_path / "f").read() == "not a folder"


@pytest.mark.slow
def test_out_dir_holding_another_run_is_refused(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "2", *SMALL)
    assert rc == 0
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    rc, _ = run_train(tmp_path, "--steps", "2", "--init", "mask", *SMALL)
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before


def test_a_start_that_died_before_its_first_checkpoint_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "args.json").write_text("{}")                          # killed after args.json, before ckpt.pt
    (out / ".ckpt.pt.abc.tmp").write_text("half")
    assert train.main([*TINY, "--resume", "--out", str(out)]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert train.main([*TINY, "--steps", "4", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["args.json", "ckpt.pt", "metrics.jsonl", "prior.pt", "result.json"]
    assert train.main([*TINY, "--steps", "4", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("case, needle", [
    ("middle line deleted", "line 3 (step 15) was logged after step 10, but the line before it is step 5: a line of "
                            "the log is missing"),
    ("middle line cut short", "line 3 is damaged"),
    ("middle line not UTF-8", "line 3 is damaged"),
    ("middle line without metrics", "line 3 is damaged"),
    ("line repeated", "line 4 (step 10) repeats step 10"),
    ("two lines swapped", "line 3 (step 15) was logged after step 10, but the line before it is step 5"),
    ("a line from another log", "line 4 (step 7) goes back from step 10"),
    ("first line deleted", "line 1 is step 5, not the run's start (step 0)"),
])
def test_every_log_line_is_checked_on_resume_and_in_reports(tmp_path, capsys, trained_once, case, needle):
    """A log line lost, damaged, repeated or out of order: --resume refuses in one line naming the line and
    rewrites nothing; the report keeps the run's result in its table, leaves its log out of the curves and
    says why. (Only a last line that a killed write cut short is dropped: the next test.)"""
    runs = tmp_path / "runs"
    out = _train(runs / "boolean" / "parity2-mask-s0", *RUN24, "--init", "mask", "--halt-after", "20",
                 once=trained_once)
    log = os.path.join(out, "metrics.jsonl")
    lines = open(log, "rb").read().splitlines(keepends=True)            # steps 0, 5, 10, 15, 20
    if case == "middle line deleted":
        del lines[2]
    elif case == "middle line cut short":
        lines[2] = lines[2][:40] + b"\n"
    elif case == "middle line not UTF-8":
        lines[2] = lines[2].replace(b'"loss"', b'"lo\xff\xfess"')
    elif case == "middle line without metrics":
        lines[2] = json.dumps({"step": 10, "prev": 5}).encode() + b"\n"
    elif case == "line repeated":
        lines.insert(3, lines[2])
    elif case == "two lines swapped":
        lines[2], lines[3] = lines[3], lines[2]
    elif case == "a line from another log":
        lines.insert(3, json.dumps({"step": 7, "metrics": {}, "prior_mass": None}).encode() + b"\n")
    elif case == "first line deleted":
        del lines[0]
    open(log, "wb").write(b"".join(lines))
    before = _tree(out)
    capsys.readouterr()
    assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "metrics.jsonl" in err and len(err.splitlines()) == 1, err
    assert _tree(out) == before
    (Path(out) / "result.json").write_text(json.dumps({**_fake_result("parity2", "mask", 0, {"acc": 1.0}), "steps": 20}))
    assert train.main(["report", str(runs), str(tmp_path / "res")]) == 0
    assert "| mask | 0 | 100.00 (1 seed) |" in (tmp_path / "res" / "boolean.md").read_text()
    notes = (tmp_path / "res" / "steps_to_target.md").read_text()
    assert f"{out}: its log is left out of the curves" in notes and needle in notes
    assert ",mask,0," not in (tmp_path / "res" / "curves.csv").read_text()


@pytest.mark.slow
def test_a_partial_last_log_line_is_dropped_on_resume_and_by_report(tmp_path):
    runs = tmp_path / "runs" / "boolean"
    out = str(runs / "parity2-mask-s0")
    assert train.main([*TINY, "--init", "mask", "--steps", "20", "--log-every", "5", "--halt-after", "10",
                       "--out", out]) == 0
    with open(os.path.join(out, "metrics.jsonl"), "ab") as f:
        f.write(b'{"step": 15, "prev": 10, "loss": 0.1, "metr')                   # a write cut short
    assert train.main(["--resume", "--out", out]) == 0
    _files_whole(out)
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [0, 5, 10, 15, 20]
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 25, "lo')
    written = reporting.report.report(str(tmp_path / "runs"), str(tmp_path / "results"))
    assert any(p.endswith("persistence.csv") for p in written)
    assert "its log is left out" not in (tmp_path / "results" / "steps_to_target.md").read_text()
    assert ",mask,0,20," in (tmp_path / "results" / "curves.csv").read_text()


# ---------------------------------------------------------------------------------------- tasks.py: boolean

@pytest.mark.parametrize("name,size,frac_unseen", [("parity2", 24576, 0.25), ("majority3", 32768, 0.25),
                                                    ("cyclic3", 28672, 0.125)])
def test_gotu_splits(name, size, frac_unseen):
    task = tasks.make_task(name).setup()
    assert task.n_train == size and len(task.x_test) == 2 ** 15
    assert float(task.unseen_mask.float().mean()) == frac_unseen
    x = task.x_train * 2 - 1
    assert not task.in_unseen(x.numpy()).any()
    if name != "majority3":     # every seen point exactly once
        assert len(torch.unique(task.x_train, dim=0)) == size
    xb, yb = task.train_batch(0, 256)
    assert xb.shape == (256, 15) and yb.shape == (256,)


def test_gotu_targets():
    task = tasks.make_task("cyclic3").setup()
    x = task.x_test * 2 - 1
    y = sum(x[:, i] * x[:, (i + 1) % 15] * x[:, (i + 2) % 15] for i in range(15)).float()
    assert torch.equal(task.y_test, y)
    maj = tasks.make_task("majority3").setup()
    assert set(maj.y_test.unique().tolist()) == {-1.0, 1.0}


def test_epoch_batches_cover_train_set_once():
    task = tasks.make_task("parity2", seed=3).setup()
    spe = task.steps_per_epoch(1000)
    seen = torch.cat([task.train_batch(s, 1000)[0] for s in range(spe)])
    assert len(seen) == task.n_train and len(torch.unique(seen, dim=0)) == task.n_train
    assert not torch.equal(task.train_batch(0, 64)[0], task.train_batch(spe, 64)[0])   # reshuffled


@pytest.mark.slow
@pytest.mark.parametrize("name,acc,extra", [("parity2", 0.75, {}), ("majority3", 0.875, {}),
                                            ("cyclic3", 0.875, {"sign_acc": 0.928253173828125})])
def test_mdi_accuracies(interpolator_once, name, acc, extra):
    mdi = tasks.make_task(name).mdi()
    assert mdi["acc"] == acc and mdi["acc_seen"] == 1.0 and mdi["mse_seen"] == pytest.approx(0, abs=1e-9)
    for k, v in extra.items():
        assert mdi[k] == pytest.approx(v)
    if name == "parity2":
        assert mdi["coefficients"] == pytest.approx({"1": -1.0, "x0": 1.0, "x1": 1.0})


def test_mdi_prefers_low_degree():
    # on data that a degree-1 function fits, the MDI is that function, not the degree-2 truth
    x = tasks.cube(3)
    seen = ~((x[:, 0] == -1) & (x[:, 1] == -1))
    pred, degree, coefs = tasks.min_degree_interpolator(x[seen], (x[seen, 0] * x[seen, 1]).astype(float), x)
    assert degree == 1 and coefs == pytest.approx({(): -1.0, (0,): 1.0, (1,): 1.0})


def test_mdi_needs_no_setup():
    task = tasks.make_task("parity2")
    assert task.mdi()["acc"] == pytest.approx(0.75)
    assert not hasattr(task, "x_train")               # computing the MDI did not set the task up


def test_custom_boolean_tasks():
    task = tasks.make_task("kparity", bits="2,5,9", unseen="2,5").setup()
    assert task.n_train == 3 * 2 ** 13 and task.mdi()["acc"] == 0.75
    p = task.pattern()
    assert p[0, 3] and p[3, 6] and p[6, 10] and not p[1, 2]
    maj = tasks.make_task("kmajority", bits="0,1,2,3,4", unseen="0,1", train_size=1000).setup()
    assert maj.n_train == 1000
    with pytest.raises(tasks.TaskError):
        tasks.make_task("kmajority", bits="0,1")
    with pytest.raises(tasks.TaskError):
        tasks.make_task("kparity", bits="0,99")


def test_patterns_of_the_gotu_tasks():
    p = tasks.make_task("parity2").pattern()
    assert p.shape == (16, 16) and p[0, 1] and p[0, 2] and p[1, 2] and p[2, 1] and not p[0, 3]
    assert p.diagonal().all() and not p[1, 3]
    c = tasks.make_task("cyclic3").pattern()
    assert c[0].all() and c[1, 15] and c[1, 14] and c[1, 3] and not c[1, 4]   # bit 0 ~ bits 13, 14, 1, 2


@pytest.mark.parametrize("task, options", [("parity2", {}), ("majority3", {}), ("cyclic3", {}),
                                           ("parity2", {"readout": "mean"}), ("majority3", {"readout": "mean"}),
                                           ("kparity", {"bits": "random:3", "unseen": "bits:2", "seed": 4}),
                                           ("kmajority", {"bits": "random:3", "unseen": "bits:2", "seed": 9})])
def test_walsh_sets_of_the_training_data_find_the_hand_pattern(task, options):
    """--pattern discovered from the training set alone (its Walsh coefficients up to degree 3, the sets above a
    quarter of the largest, each a clique, CLS -> their bits) is exactly the hand pattern, in either layout and
    for bits drawn by the seed; the target function is never read (it is replaced by a stand-in here)."""
    t = tasks.make_task(task, **options).setup()
    oracle = t.pattern()
    t.target = lambda x: pytest.fail("the discovery read the target function")
    assert torch.equal(t.pattern("discovered"), oracle)
    assert t.pattern_name("discovered") == "discovered"
    if task == "parity2" and not options:
        assert t.discovered_sets()[0] == (0, 1)
        coefs = tasks.walsh_coefficients(2 * t.x_train.numpy() - 1, t.y_train.numpy())
        assert coefs[(0, 1)] == pytest.approx(0.889, abs=1e-3) and max(abs(v) for s, v in coefs.items()
                                                                        if not set(s) <= {0, 1}) < 1e-9
    if task == "kparity":
        assert t.name == "kparity[11,13,14|U:11,13]"


def test_the_walsh_cut_stands_above_sampling_noise_so_a_small_training_set_gives_fewer_sets_or_none():
    """--pattern discovered keeps a Walsh set only above the noise level of the training set's size (z std(y) /
    sqrt(P), Bonferroni over the sets tested): on targets independent of the bits at most about alpha of the draws
    let any set through; kmajority on 5 bits keeps only sets of its own bits at every size (precision 1), more of
    them as the size grows (sizes 100, 250, 500: 4, 7, 9 sets), the hand pattern with every seen point; too few
    points for any set is one line."""
    rng = np.random.default_rng(0)
    passed = sum(bool(tasks.walsh_sets(rng.choice([-1, 1], (150, 15)), rng.choice([-1.0, 1.0], 150), 3, 1e-9, 0.05)[0])
                 for _ in range(60))
    assert passed <= 8                                            # 60 draws at alpha 0.05: 3 expected
    kept, noise = [], []
    for size in (100, 250, 500, 2000, None):
        t = tasks.make_task("kmajority", bits="1,4,8,10,13", unseen="1,4", train_size=size).setup()
        sets, report = t.discovered_sets(), t.discovery()["walsh"]
        assert all(set(s) <= {1, 4, 8, 10, 13} for s in sets) and report["sets_kept"] == len(sets)
        kept.append(len(sets))
        noise.append(report["noise_level"])
    assert kept[:3] == sorted(kept[:3]) and kept[0] < kept[-1] and noise == sorted(noise, reverse=True)
    assert torch.equal(t.pattern("discovered"), t.pattern())
    with pytest.raises(tasks.TaskError, match="no Walsh set of up to 3 bits stands above the sampling noise of the 12 "):
        tasks.make_task("kmajority", bits="1,4,8,10,13", unseen="1,4", train_size=12).setup().pattern("discovered")


@pytest.mark.slow
def test_the_forward_selection_keeps_no_pair_of_digits_that_tells_nothing():
    """Digit pairs independent of the answer digit pass the permutation test at most about alpha of the time."""
    rng = np.random.default_rng(1)
    kept = 0
    for trial in range(30):
        pairs = {(i, j): rng.integers(0, 100, 400) for i in range(3) for j in range(3)}
        kept += tasks.forward_selection(rng.integers(0, 10, 400), pairs, 0.05, rng)[0][-1]
    assert kept <= 5                                              # 30 draws at alpha 0.05: 1.5 expected


def test_ksum_states_a_target_that_mixes_structures_on_the_command_line():
    """--task ksum --terms 0,1:m2,3,4 is x0 x1 + maj(x2, x3, x4): integer-valued, each term a clique of the hand
    pattern (CLS reading every bit of them), its exact MDI solved; the data route finds the same pattern."""
    t = tasks.make_task("ksum", terms="0,1:m2,3,4").setup()
    x = 2 * t.x_test[:64].numpy() - 1
    assert np.array_equal(t.y_test[:64].numpy(), x[:, 0] * x[:, 1] + np.sign(x[:, 2] + x[:, 3] + x[:, 4]))
    assert t.exact and t.degree == 3 and t.name == "ksum[0,1:m2,3,4|U:0,1]"
    p = t.pattern()
    assert p[1, 2] and p[3, 5] and not p[1, 3] and p[0, 1:6].all() and not p[0, 6:].any()
    assert torch.equal(t.pattern("discovered"), p)
    mdi = t.mdi()
    assert mdi["acc_unseen"] == 0.0 and mdi["acc"] == 0.75            # the MDI misses all of U
    assert tasks.parse_terms("3:m0,1,2", 15) == [("parity", (3,)), ("majority", (0, 1, 2))]


def _bit_pattern(name: str) -> torch.Tensor:
    """What each task's default pattern allows among the 15 bit tokens (bit i -> bit j)."""
    if name == "cyclic3":
        d = (torch.arange(15)[:, None] - torch.arange(15)[None, :]).abs()
        return torch.minimum(d, 15 - d) <= 2
    bits = {"parity2": [0, 1], "majority3": [0, 1, 2]}[name]
    p = torch.eye(15, dtype=torch.bool)
    for i in bits:
        for j in bits:
            p[i, j] = True
    return p


@pytest.mark.parametrize("readout", ["cls", "mean"])
@pytest.mark.parametrize("name", ["parity2", "majority3", "cyclic3"])
def test_mask_follows_the_token_layout(name, readout):
    """The pattern is built for the model's own layout (a CLS token first or none), and M after
    init_mask_ equals it at the bit positions: x0 <-> x1 for parity2 and nothing else among the bits."""
    task = tasks.make_task(name, readout=readout)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=2, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True)
    model = mp.Transformer(cfg)
    pat = task.pattern()
    off = 1 if readout == "cls" else 0
    assert pat.shape == (15 + off, 15 + off) == (cfg.n_positions, cfg.n_positions)
    mp.init_mask_(model, pat)
    for block in model.blocks:
        for h in range(2):
            assert torch.equal(block.attn.prior.bias[h, off:, off:] > 0, _bit_pattern(name))
    if off:   # the CLS row reads the target's bits (cyclic3: every bit); every bit row ignores the CLS
        m = model.blocks[0].attn.prior.bias[0]
        assert (m[0, 1:] > 0).sum() == {"parity2": 2, "majority3": 3, "cyclic3": 15}[name] and (m[1:, 0] < 0).all()
    task.setup()      # the probe sees the same pattern the model was given
    assert len(mp.prior_mass(model, task.probe_inputs(8), pat)) == 2


@pytest.mark.parametrize("readout", ["mean", "cls"])
def test_parity2_mask_ties_the_unseen_corner_to_seen_points(readout):
    """The mechanism behind parity2 (README): with no CLS token, position-blind tokens (positional
    embedding 0) and the x0 <-> x1 mask made hard, x0 and x1 at (-1, -1) carry exactly the state of any
    other bit at -1 (each sees only copies of itself), so for ANY weights the output at x0 = x1 depends
    only on how many bits are -1: the unseen corner is tied to seen points with x0 = x1 = +1. A CLS
    token reads x0, x1 through a state nothing ties down, and the outputs differ."""
    task = tasks.make_task("parity2", readout=readout)
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=2, n_heads=2, dim=16, mlp_dim=32, learnable_mask=True,
                               pos_init_std=0.0)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, task.pattern(), m_on=30.0, m_off=30.0)
    g = torch.Generator().manual_seed(1)
    rest = torch.randint(0, 2, (64, 13), generator=g)
    rest[:, :2] = 1                                         # two more +1 bits to turn into -1
    unseen = torch.cat([torch.zeros(64, 2, dtype=torch.long), rest], 1)     # token 0 = -1, token 1 = +1
    seen = torch.cat([torch.ones(64, 2, dtype=torch.long), rest.clone()], 1)
    seen[:, 2:4] = 0                                        # the same number of -1 bits, x0 = x1 = +1
    with torch.no_grad():
        gap = (model(unseen) - model(seen)).abs().max()
    if readout == "mean":
        assert gap < 1e-5
    else:
        assert gap > 1e-2


def test_mean_readout_run_trains_the_right_pattern(tmp_path):
    """The regression of --readout mean: the saved M is parity2's pattern over the 15 bit tokens."""
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--readout", "mean", "--steps", "2", *SMALL)
    assert rc == 0
    m = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")["model"]["blocks.0.attn.prior.bias"]
    assert m.shape == (2, 15, 15) and torch.equal(m[0] > 0, _bit_pattern("parity2"))
    assert json.load(open(os.path.join(out, "result.json")))["config"]["readout"] == "mean"


def test_cli_pattern_that_does_not_fit_the_model_exits_2(tmp_path, capsys, monkeypatch):
    """A task whose pattern is built for another layout than the model's: one line, exit 2, nothing written."""
    monkeypatch.setattr(tasks.BooleanTask, "pattern", lambda self, variant=None: torch.eye(16, dtype=torch.bool))
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--readout", "mean", *SMALL)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "(16, 16)" in err and "15 positions" in err
    assert not os.path.exists(out)


def test_pattern_of_the_other_layout_is_refused():
    with pytest.raises(tasks.TaskError, match="needs --readout cls"):
        tasks.make_task("parity2", readout="mean").pattern("cls")
    with pytest.raises(tasks.TaskError, match="needs --readout cls"):
        tasks.make_task("cyclic3", readout="mean").pattern("band-only")
    with pytest.raises(tasks.TaskError, match="--readout for majority3 must be one of cls, mean"):
        tasks.make_task("majority3", readout="tokens")


def test_eval_points_sample_the_cube_in_proportion():
    task = tasks.make_task("parity2").setup()
    idx = task.eval_points(4096)
    assert len(idx) == len(set(idx.tolist())) == 4096 and torch.equal(idx, task.eval_points(4096))
    assert int(task.unseen_mask[idx].sum()) == 1024                      # U is a quarter of the cube
    torch.manual_seed(0)
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16))
    full, part = task.evaluate(model), task.evaluate(model, points=4096)
    assert full["eval_points"] == 0 and part["eval_points"] == 4096
    pred = task.predict(model)
    assert part["mse_unseen"] == pytest.approx(float(((pred - task.y_test)[idx][task.unseen_mask[idx]] ** 2).mean()))
    assert full["mse"] == pytest.approx(float(((pred - task.y_test) ** 2).mean()))


# ---------------------------------------------------------------------------------------- tasks.py: arithmetic

@pytest.mark.parametrize("name,order", [("addition", "msb"), ("addition", "lsb"), ("multiplication", "msb"),
                                        ("multiplication", "lsb")])
def test_arithmetic_tokenisation_round_trip(name, order):
    task = tasks.make_task(name, data_frac=0.001, answer_order=order)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 1000, 500), rng.integers(0, 1000, 500)
    a[:3], b[:3] = [0, 999, 7], [0, 999, 40]
    seq = task.encode(a, b)
    assert seq.shape == (500, task.length) and seq.max() < len(tasks.ARITH_VOCAB)
    for s, x, y in zip(seq, a, b):
        assert task.decode(s) == (x, y, x * y if name == "multiplication" else x + y)
    text = "".join(tasks.ARITH_VOCAB[i] for i in seq[1])
    msb = "999+999=1998" if name == "addition" else "999*999=998001"
    lsb = "999+999=8991" if name == "addition" else "999*999=100899"      # the answer digits reversed
    assert text == (msb if order == "msb" else lsb)


@pytest.mark.parametrize("name,frac,n", [("addition", None, 4000), ("multiplication", None, 30000),
                                         ("addition", 0.0123, 12300)])
def test_arithmetic_split_sizes_and_disjoint(name, frac, n):
    task = tasks.make_task(name, data_frac=frac, seed=3).setup()
    assert len(task.train_seq) == n and len(task.test_seq) == 10_000
    pairs = lambda s: {(int(r[:3].dot([100, 10, 1])), int(r[4:7].dot([100, 10, 1]))) for r in s.numpy()}  # noqa
    train_pairs, test_pairs = pairs(task.train_seq), pairs(task.test_seq)
    assert len(train_pairs) == n and len(test_pairs) == 10_000 and not train_pairs & test_pairs
    assert task.train_batch(0, 64).shape == (64, task.length)


@pytest.mark.parametrize("frac,n_train,n_test", [(0.03, 300, 9_700), (0.3, 3_000, 7_000), (0.9, 9_000, 1_000)])
def test_two_digit_multiplication_tests_on_every_pair_it_does_not_train_on(frac, n_train, n_test):
    """--digits 2: 10^4 pairs; the test set is every pair not trained on (the universe allows no 10,000)."""
    task = tasks.make_task("multiplication", digits=2, data_frac=frac, answer_order="lsb", seed=1).setup()
    assert task.length == 10 and task.n_answer == 4 and task.universe == 10_000
    rows = lambda s: {tuple(r) for r in s.numpy().tolist()}                                    # noqa: E731
    train, test = rows(task.train_seq), rows(task.test_seq)
    assert len(train) == n_train and len(test) == n_test and not train & test
    assert len({task.decode(r)[:2] for r in train | test}) == n_train + n_test
    assert all(x * y == c for x, y, c in map(task.decode, task.test_seq[:200]))
    assert "".join(tasks.ARITH_VOCAB[i] for i in task.encode(np.array([99]), np.array([7]))[0]) == "99*07=3960"  # 693 reversed
    p = task.pattern()
    assert p.shape == (9, 9) and torch.nonzero(p[8]).flatten().tolist() == [0, 1, 3, 4, 8]   # c3 (lsb: last): all
    assert torch.nonzero(p[5]).flatten().tolist() == [1, 4, 5]                               # '=' predicts c0: a0, b0
    with pytest.raises(tasks.TaskError, match="leaves 500 of the 10,000 pairs for the disjoint test set; use at most 0.9"):
        tasks.make_task("multiplication", digits=2, data_frac=0.95)
    with pytest.raises(tasks.TaskError, match="--digits must be an integer in 1..4"):
        tasks.make_task("multiplication", digits=5)
    assert len(tasks.make_task("addition", digits=3).setup().test_seq) == 10_000                # 3 digits: as before


@pytest.mark.slow
def test_digit_selection_sees_the_aligned_pair_then_the_carry_from_the_pair_below():
    """Addition's answer digit c_k depends on a_k and b_k together (either alone says nothing, so digit pairs are
    the candidates) and, once they are known, on the pair below (the carry): the forward selection by conditional
    mutual information keeps both for c1, c2 and the carry-out c3, and stops at the pair two columns down (a
    carry through a middle column that sums to 9, one case in ten, is within the noise of 4,000 pairs). The rows
    see what was kept; the prompt rows stay causal; result.json's report lists each step."""
    t = tasks.make_task("addition").setup()
    kept = {k: [(i, j) for i, j, _, _, ok in steps if ok] for k, steps in t.digit_selection().items()}
    assert kept == {0: [(0, 0)], 1: [(1, 1), (0, 0)], 2: [(2, 2), (1, 1)], 3: [(2, 2), (1, 1)]}
    p, rows = t.pattern("discovered"), t.answer_rows()             # msb first: rows of c3, c2, c1, c0
    assert [p[q].nonzero().flatten().tolist() for q in rows] == [[0, 1, 4, 5, 7], [0, 1, 4, 5, 8], [1, 2, 5, 6, 9],
                                                                 [2, 6, 10]]
    assert torch.equal(p[:t.eq_pos], mp.causal_pattern(t.length - 1)[:t.eq_pos])
    report = t.discovery()["pairs"]
    assert report["tested"] == 9 and report["kept"] == 7 and report["steps"]["c2"][-1][0] == "a0b0"
    assert runfiles.prior_evidence(t.prior("discovered", 5.0, 5.0).source) == "found in the training data: 7 (answer " \
        "digit, operand digit pair) dependences pass the permutation test (9 pairs tried per answer digit, alpha " \
        "0.05): 14 pairs"
    assert runfiles.prior_evidence(t.prior(None, 5.0, 5.0).source) is None                # a hand pattern rests on no data
    x, y = np.arange(1000) % 10, np.arange(1000) % 7
    assert tasks.conditional_mi(y, x, np.zeros(1000, dtype=np.int64)) < 0.05 < tasks.conditional_mi(x, x, 0 * x)
    assert tasks.conditional_mi(x, x, x) == pytest.approx(0.0, abs=1e-12)          # nothing left once x is known


def test_partial_product_pattern_gives_each_head_one_product():
    """--pattern partial (multiplication): head i sees a_i and b_(k-i) for the answer digit of significance k,
    head d the answer written so far, the rest the carry pattern; 2 digits, answers reversed: a1 a0 * b1 b0 = c0.."""
    task = tasks.make_task("multiplication", digits=2, data_frac=0.3, answer_order="lsb", heads=4)
    p = task.pattern("partial")
    rows = lambda h, q: torch.nonzero(p[h, q]).flatten().tolist()                          # noqa: E731
    assert p.shape == (4, 9, 9) and all(p[h, :5].equal(mp.causal_pattern(9)[:5]) for h in range(4))
    assert rows(0, 5) == [1, 4, 5] and rows(1, 5) == [5]               # '=' predicts c0 = a0 b0: head 0 only
    assert rows(0, 6) == [1, 3, 6] and rows(1, 6) == [0, 4, 6]         # c1: a0 b1 in head 0, a1 b0 in head 1
    assert rows(0, 7) == [7] and rows(1, 7) == [0, 3, 7]               # c2: a1 b1 in head 1
    assert rows(2, 8) == [6, 7, 8] and rows(2, 5) == [5]               # head 2: the answer digits so far
    assert p[3].equal(task.pattern("carry"))                           # a fourth head: the carry pattern
    logits = task.mask_logits("partial", 5.0, 10.0)
    assert logits.shape == (4, 9, 9) and logits[1, 6, 0] == 5 and logits[1, 6, 1] == -10
    msb = tasks.make_task("multiplication", digits=2, data_frac=0.3, heads=4).pattern("partial")
    assert torch.nonzero(msb[1, 5]).flatten().tolist() == [5]         # msb: '=' predicts c3, a carry alone
    assert torch.nonzero(msb[1, 6]).flatten().tolist() == [0, 3, 6]   # c2: a1 b1 in head 1
    with pytest.raises(tasks.TaskError, match="needs --heads >= 4, got 3"):
        tasks.make_task("multiplication", digits=3, heads=3).pattern("partial")
    with pytest.raises(tasks.TaskError, match="has no pattern 'partial'"):
        tasks.make_task("addition").pattern("partial")


def test_columns_pattern_gives_each_head_one_column():
    """--pattern columns (multiplication): for answer digit c_k, head 0 sees the pairs of column k (i + j = k), head
    1 column k - 1, head 2 column k - 2, head 3 the answer so far, further heads the carry pattern; 2 digits,
    answers reversed: a1 a0 * b1 b0 = c0.. (positions 0 1 * 3 4 = 5, answers 6..)."""
    task = tasks.make_task("multiplication", digits=2, data_frac=0.3, answer_order="lsb", heads=5)
    p = task.pattern("columns")
    rows = lambda h, q: torch.nonzero(p[h, q]).flatten().tolist()                          # noqa: E731
    assert p.shape == (5, 9, 9) and all(p[h, :5].equal(mp.causal_pattern(9)[:5]) for h in range(5))
    assert rows(0, 5) == [1, 4, 5] and rows(1, 5) == [5] and rows(2, 5) == [5]     # c0 = a0 b0: column 0 only
    assert rows(0, 6) == [0, 1, 3, 4, 6] and rows(1, 6) == [1, 4, 6]               # c1: column 1, column 0 below
    assert rows(0, 7) == [0, 3, 7] and rows(2, 7) == [1, 4, 7]                     # c2: a1 b1; column 0 two below
    assert rows(3, 8) == [6, 7, 8] and rows(3, 5) == [5]                           # head 3: the answer so far
    assert p[4].equal(task.pattern("carry"))
    assert task.mask_logits("columns", 5.0, 10.0).shape == (5, 9, 9)
    with pytest.raises(tasks.TaskError, match="needs --heads >= 4, got 3"):
        tasks.make_task("multiplication", heads=3).pattern("columns")


def test_arithmetic_pattern_for_known_positions():
    add = tasks.make_task("addition")
    p = add.pattern()
    assert p.shape == (11, 11)
    # row 8 holds c3 and predicts c2 (significance 2): a2 a1 a0 b2 b1 b0 allowed, '+' and '=' not
    assert p[8].tolist() == [True, True, True, False, True, True, True, False, True, False, False]
    # row 10 predicts c0: only a0 (2), b0 (6) and itself
    assert torch.nonzero(p[10]).flatten().tolist() == [2, 6, 10]
    assert p[:7].equal(mp.causal_pattern(11)[:7])          # prompt rows keep the plain causal pattern
    logits = add.mask_logits(None, 5.0, 5.0)
    assert logits[8, 0] == 5 and logits[8, 1] == 5 and logits[8, 2] == 0 and logits[8, 3] == -5
    aligned = add.pattern("aligned")
    assert torch.nonzero(aligned[10]).flatten().tolist() == [2, 6, 10]
    mul = tasks.make_task("multiplication")
    m = mul.pattern()
    assert m.shape == (13, 13) and torch.nonzero(m[12]).flatten().tolist() == [2, 6, 12]   # c0: a0, b0
    assert m[9, :7].tolist() == [True, True, True, False, True, True, True]                # c3: all digits
    assert not (m & ~mp.causal_pattern(13)).any()           # the prior never reaches into the future
    lsb = tasks.make_task("addition", answer_order="lsb").pattern()
    assert torch.nonzero(lsb[7]).flatten().tolist() == [2, 6, 7]      # '=' predicts c0 first


def test_an_arithmetic_operation_is_one_subclass(monkeypatch):
    """Adding an operation touches one place: a subclass with its symbol, its answer, the answer's length and which
    operand digits its carry pattern holds strong; a symbol new to the vocabulary goes at the end of its own, so the
    registered operations keep their token ids (and their checkpoints)."""
    class Maximum(tasks.ArithmeticTask):
        SYMBOL = "^"
        answer, answer_digits = staticmethod(np.maximum), staticmethod(lambda d: d)
        strong = staticmethod(lambda j, k: j == k)

    monkeypatch.setitem(tasks.TASKS, "maximum", Maximum)
    task = Maximum(data_frac=0.01).setup()
    assert task.vocab == "0123456789+*=^" and task.arch()["vocab_size"] == 14
    assert task.encode(np.array([123]), np.array([405])).tolist() == [[1, 2, 3, 13, 4, 0, 5, 12, 4, 0, 5]]
    assert task.decode(task.encode(np.array([7]), np.array([30]))[0]) == (7, 30, 30)
    logits = task.mask_logits("carry", 5.0, 5.0)            # row 8 predicts c1: a1, b1 strong; a0, b0 allowed
    assert logits[8, [1, 5]].tolist() == [5.0, 5.0] and logits[8, [2, 6]].tolist() == [0.0, 0.0]
    assert [tasks.make_task(n).vocab for n in ("addition", "multiplication")] == ["0123456789+*="] * 2
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, dim=16, n_heads=2, mlp_dim=16))
    assert model(task.train_seq[:4, :-1]).shape == (4, 10, 14)

@pytest.mark.slow
def test_arithmetic_short_run_improves_digit_accuracy(tmp_path):
    rc, out = run_train(tmp_path, "--task", "addition", "--init", "mask", "--steps", "250", "--log-every", "250",
                        "--layers", "2", "--dim", "64", "--heads", "4", "--mlp-dim", "128", "--probe-size", "64")
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    first, last = lines[0]["metrics"], lines[-1]["metrics"]
    assert last["digit_acc"] > first["digit_acc"] + 0.15 and 0 <= last["seq_acc"] <= 1
    res = json.load(open(os.path.join(out, "result.json")))
    assert {"seq_acc", "digit_acc", "prior_mass_start", "prior_mass_end"} <= set(res["metrics"])
    assert first["eval_points"] == 2000 and last["eval_points"] == res["metrics"]["eval_points"] == 0


def test_arithmetic_eval_points_are_the_first_test_pairs():
    task = tasks.make_task("addition").setup()
    torch.manual_seed(0)
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16))
    part, full = task.evaluate(model, points=100), task.evaluate(model)
    assert part["eval_points"] == 100 and full["eval_points"] == 0
    preds = task.generate(model, task.test_seq[:100, :task.eq_pos + 1])
    assert part["digit_acc"] == pytest.approx(float((preds == task.test_seq[:100, task.eq_pos + 1:]).float().mean()))


@pytest.mark.parametrize("frac,needle", [("0", "must be in (0, 1]"), ("1.5", "must be in (0, 1]"),
                                         ("-0.1", "must be in (0, 1]"), ("1e-7", "gives no training pair"),
                                         ("1", "disjoint test set")])
def test_arithmetic_bad_data_frac(tmp_path, capsys, frac, needle):
    rc, out = run_train(tmp_path, "--task", "addition", "--data-frac", frac)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out)


def _lee_pair(text: str) -> tuple:
    a, b = re.match(r"\$?(\d+)\*(\d+)=", text).groups()
    return int(a), int(b)


@pytest.mark.slow
def test_lee_samples_are_lee_et_al_s_construction():
    """--lee-samples N (--digits 2): the 100 one-digit pairs, then N - 100 drawn with replacement from
    0..99 x 0..99 by the seed; unpadded a*b=c (lsb: $a*b=rev(c)$); tested on every pair not trained on."""
    every = set(itertools.product(range(100), repeat=2))
    made = {}
    for order in ("msb", "lsb"):
        task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order, seed=5).setup()
        train_text = [task.lee_decode(r) for r in task.train_seq]
        test_text = [task.lee_decode(r) for r in task.test_seq]
        tr, te = [_lee_pair(x) for x in train_text], [_lee_pair(x) for x in test_text]
        assert len(tr) == task.n_train == 3000 and set(itertools.product(range(10), repeat=2)) <= set(tr)
        assert collections.Counter(tr) == collections.Counter(map(tuple, tasks.lee_pairs(3000, 5).tolist()))
        assert tasks.lee_pairs(3000, 5)[:100].tolist() == [[a, b] for a in range(10) for b in range(10)]
        assert len(set(tr)) == task.n_pairs_trained < 3000 and len(te) == len(set(te)) == task.test_size
        assert not set(tr) & set(te) and set(tr) | set(te) == every              # every pair not trained on
        assert all(x == tasks.lee_text(a, b, order) for x, (a, b) in zip(train_text + test_text, tr + te))
        assert task.train_seq.shape == (3000, tasks.LEE_ROW[order]) and task.arch()["seq_len"] == tasks.LEE_ROW[order] - 1
        made[order] = tr
    assert made["msb"] == made["lsb"]                                      # one draw for both formats
    assert tasks.lee_text(7, 12, "msb") == "7*12=84\n" and tasks.lee_text(7, 12, "lsb") == "$7*12=48$"
    assert tasks.lee_text(0, 0, "msb") == "0*0=0\n" and tasks.lee_text(99, 99, "lsb") == "$99*99=1089$"
    again, other, twin = (tasks.make_task("multiplication", digits=2, lee_samples=3000, seed=s).setup() for s in (5, 6, 5))
    assert torch.equal(again.train_seq, twin.train_seq) and not torch.equal(again.train_seq, other.train_seq)
    small = tasks.make_task("multiplication", digits=2, lee_samples=100).setup()      # the one-digit pairs alone
    assert small.n_pairs_trained == 100 and small.test_size == 9_900
    row = again.lee_encode(np.array([[7, 3]]))[0]
    assert again.lee_decode(row) == "7*3=21\n" and "".join(tasks.LEE_VOCAB[i] for i in row) == "7*3=21\n____"


def _lee_expected(text: str, order: str) -> torch.Tensor:
    """The pattern of one example, written from its text: prompt rows see every earlier character; the row
    that predicts answer character t sees '=', the answer so far and the operand digits of significance <=
    k (lsb: k = t; msb: k = len(a) + len(b) - 1 - t); past the last digit of the longest answer, every digit."""
    a, b = text.lstrip("$").split("=")[0].split("*")
    pre, n = int(text[0] == "$"), len(text) - 1
    eq = text.index("=")
    sig = {pre + i: len(a) - 1 - i for i in range(len(a))}
    sig.update({pre + len(a) + 1 + j: len(b) - 1 - j for j in range(len(b))})
    full = 4 if order == "lsb" else len(a) + len(b)
    pat = mp.causal_pattern(n).clone()
    for r in range(eq, n):
        t = r - eq
        k = 9 if t >= full else (t if order == "lsb" else len(a) + len(b) - 1 - t)
        pat[r] = False
        pat[r, eq:r + 1] = True
        for pos, s in sig.items():
            pat[r, pos] = s <= k
    return pat


@pytest.mark.parametrize("order", ["msb", "lsb"])
def test_lee_pattern_aligns_digits_by_significance_for_every_operand_length(order):
    """One M on the roles of the longest layout; each example's positions map to the roles of the same
    significance (1x1, 1x2, 2x1, 2x2 operands, full and short answers), the model's bias follows."""
    task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order, heads=2)
    pairs = [(7, 3), (3, 3), (7, 15), (15, 7), (12, 34), (99, 99)]        # 1x1 (and short), 1x2, 2x1, 2x2
    rows = task.lee_encode(np.array(pairs))
    x = rows[:, :-1]
    r_role, c_role = task.lee_roles(x)
    seen = task.pattern()[r_role[:, :, None], c_role[:, None, :]] & mp.causal_pattern(x.shape[1])
    for i, (a, b) in enumerate(pairs):
        text = tasks.lee_text(a, b, order)
        n = len(text) - 1                                                 # the rows that predict a character
        assert torch.equal(seen[i, :n, :n], _lee_expected(text, order)), text
    eq = 4 if order == "msb" else 5                                       # 7*15=105: '=' at position 4 (msb)
    keys = lambda i, q: torch.nonzero(seen[i, q, :q + 1]).flatten().tolist()        # noqa: E731
    if order == "msb":
        assert keys(2, eq) == [0, 2, 3, 4]            # '=' predicts 1 (c2): a0=7, b1=1, b0=5 and '='
        assert keys(2, eq + 2) == [0, 3, 4, 5, 6]     # '0' predicts 5 (c0): a0, b0, '=', the answer so far
        assert keys(3, eq + 2) == [1, 3, 4, 5, 6]     # 15*7=105: a0=5 (position 1), b0=7 (3)
        assert torch.equal(r_role[4], torch.arange(10)) and torch.equal(c_role[4], torch.arange(10))  # 2x2: positions
    else:
        assert keys(2, eq) == [1, 4, 5]               # '=' predicts c0 = 5: a0=7 (1), b0=5 (4), '='
        assert keys(0, 4) == [1, 3, 4]                # 7*3: '=' at 4 predicts c0: a0 (1), b0 (3)
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, logits=task.mask_logits(None, 5.0, 5.0))
    with mp.prior_roles(model, r_role, c_role):
        bias = model.blocks[0].attn.attn_bias(x.shape[1], torch.float32)
    assert bias.shape == (6, 2) + seen.shape[1:] and torch.equal(bias[:, 0] > -1, seen)
    assert model.blocks[0].attn.prior.roles is None                       # the block's end clears the roles
    assert torch.equal(bias[4], model.blocks[0].attn.attn_bias(x.shape[1], torch.float32))


class _LeeOracle(nn.Module):
    """Writes the right next character of every row (or, `early`, the end one character early)."""

    def __init__(self, task, early=False):
        super().__init__()
        self.task, self.early = task, early

    def forward(self, x, return_attn=False):
        out = torch.zeros(*x.shape, len(tasks.LEE_VOCAB))
        for i, row in enumerate(x.tolist()):
            text = "".join(tasks.LEE_VOCAB[c] for c in row)
            answer = tasks.lee_text(*_lee_pair(text), self.task.answer_order)
            answer = answer[answer.index("=") + 1:]
            if self.early:
                answer = answer[:-2] + answer[-1]
            for t in range(text.index("="), len(row)):
                written = t - text.index("=")
                out[i, t, tasks.LEE_TOKENS[answer[written] if written < len(answer) else "_"]] = 1
        return out


@pytest.mark.parametrize("order", ["msb", "lsb"])
def test_lee_scoring_reads_each_answer_to_its_end_and_the_loss_only_the_answer(order):
    task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order).setup()
    right = task.evaluate(_LeeOracle(task), points=150)
    assert right["seq_acc"] == right["train_seq_acc"] == right["digit_acc"] == right["train_digit_acc"] == 1.0
    assert right["eval_points"] == 150 and right["n_train"] == 3000 and right["n_test"] == task.test_size
    early = task.evaluate(_LeeOracle(task, early=True), points=150)
    assert early["seq_acc"] == early["train_seq_acc"] == 0.0 and 0.4 < early["digit_acc"] < 1.0
    class Unsure(_LeeOracle):                        # the right character, by a margin sampling at 0.8 misses
        def forward(self, x, return_attn=False):
            return 2 * super().forward(x)
    sure, sampled = task.evaluate(Unsure(task), points=150), task.evaluate(Unsure(task), points=150, temperature=0.8)
    assert sure["seq_acc"] == 1.0 and 0 < sampled["seq_acc"] < 0.9 and sampled["train_seq_acc"] < 0.9
    assert sampled == task.evaluate(Unsure(task), points=150, temperature=0.8)         # seeded
    rows = task.lee_encode(np.array([[7, 15], [3, 3]]))
    targets = task.lee_targets(rows)
    want = ["105\n", "9\n"] if order == "msb" else ["501$", "9$"]
    assert ["".join(tasks.LEE_VOCAB[t] for t in r if t >= 0) for r in targets.tolist()] == want
    assert float(task.loss(_LeeOracle(task), rows)) < float(task.loss(_LeeOracle(task, early=True), rows))


@pytest.mark.slow
def test_lee_run_logs_train_and_test_accuracy(tmp_path):
    rc, out = run_train(tmp_path, "--task", "multiplication", "--digits", "2", "--lee-samples", "200", "--init", "mask",
                        "--answer-order", "lsb", "--steps", "2", "--log-every", "1", "--layers", "1", "--dim", "16",
                        "--heads", "2", "--mlp-dim", "16", "--batch-size", "8", "--probe-size", "8",
                        "--eval-points", "20")
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert all({"seq_acc", "train_seq_acc"} <= set(r["metrics"]) for r in lines)
    assert lines[1]["metrics"]["eval_points"] == 20
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["metrics"]["eval_points"] == 0 and res["metrics"]["n_pairs_trained"] < 200 + 1
    assert res["metrics"]["prior_mass_start"] > 0.9


# ---------------------------------------------------------------------------------------- tasks.py: vision readers

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


def test_cifar10_python_pickles_with_bytes_keys(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    xs, ys = [], []
    for i in range(1, 6):
        x, y = _images(4, i), [(i + j) % 10 for j in range(4)]
        _py2_pickle(root / f"data_batch_{i}", {b"batch_label": b"training batch", b"labels": y,
                                               b"data": x.reshape(4, -1), b"filenames": [b"a.png"] * 4})
        xs.append(x)
        ys += y
    _py2_pickle(root / "test_batch", {b"labels": [3, 1], b"data": _images(2, 9).reshape(2, -1)})
    d = tasks.read_cifar(str(tmp_path), "cifar10")
    assert d["train"][0].shape == (20, 3, 32, 32) and d["train"][0].dtype == np.uint8
    assert np.array_equal(d["train"][0], np.concatenate(xs)) and d["train"][1].tolist() == ys
    assert d["test"][1].tolist() == [3, 1] and np.array_equal(d["test"][0], _images(2, 9))
    # the python-3 style (str keys) reads the same
    (root / "test_batch").write_bytes(pickle.dumps({"labels": [3, 1], "data": _images(2, 9).reshape(2, -1)}, protocol=4))
    assert tasks.read_cifar(str(tmp_path), "cifar10")["test"][1].tolist() == [3, 1]


def test_cifar100_python_and_binary_releases(tmp_path):
    py = tmp_path / "py" / "cifar-100-python"
    py.mkdir(parents=True)
    for split, n in (("train", 5), ("test", 3)):
        _py2_pickle(py / split, {b"fine_labels": list(range(90, 90 + n)), b"coarse_labels": [1] * n,
                                 b"data": _images(n, n).reshape(n, -1)})
    d = tasks.read_cifar(str(tmp_path / "py"), "cifar100")
    assert d["train"][1].tolist() == [90, 91, 92, 93, 94] and np.array_equal(d["test"][0], _images(3, 3))
    # binary: <coarse label byte><fine label byte><3072 pixel bytes> per record
    b = tmp_path / "bin" / "cifar-100-binary"
    b.mkdir(parents=True)
    for split, n in (("train", 4), ("test", 2)):
        x = _images(n, n + 10)
        rec = np.concatenate([np.full((n, 1), 7, np.uint8), np.arange(n, dtype=np.uint8)[:, None] + 50,
                              x.reshape(n, -1)], axis=1)
        rec.tofile(b / f"{split}.bin")
    d = tasks.read_cifar(str(tmp_path / "bin"), "cifar100")
    assert d["train"][1].tolist() == [50, 51, 52, 53] and np.array_equal(d["test"][0], _images(2, 12))


def test_cifar10_binary_release(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = _images(2, len(name))
        np.concatenate([np.array([[4], [9]], np.uint8), x.reshape(2, -1)], axis=1).tofile(b / f"{name}.bin")
    d = tasks.read_cifar(str(tmp_path), "cifar10")
    assert d["train"][0].shape == (10, 3, 32, 32) and d["train"][1].tolist() == [4, 9] * 5
    assert np.array_equal(d["test"][0], _images(2, len("test_batch")))


def test_malformed_and_missing_image_files(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    (b / "data_batch_1.bin").write_bytes(b"\0" * 3000)           # not a whole 3073-byte record
    with pytest.raises(tasks.DataError, match="not a whole number of 3073-byte records"):
        tasks.read_cifar_binary(str(b / "data_batch_1.bin"))
    py = tmp_path / "p" / "cifar-10-batches-py"
    py.mkdir(parents=True)
    good = pickle.dumps({b"labels": [1, 2], b"data": _images(2).reshape(2, -1)}, protocol=2)
    (py / "data_batch_1").write_bytes(good[: len(good) // 2])     # truncated download
    with pytest.raises(tasks.DataError, match="truncated, damaged or not a release pickle"):
        tasks.read_cifar_pickle(str(py / "data_batch_1"))
    with pytest.raises(tasks.DataError, match="data_batch_2 is missing"):  # the release's files checked before decoding
        tasks.read_cifar(str(tmp_path / "p"), "cifar10")
    _py2_pickle(py / "data_batch_1", {b"labels": [1, 2, 3], b"data": _images(2).reshape(2, -1)})
    with pytest.raises(tasks.DataError, match="2 images but 3 labels"):
        tasks.read_cifar_pickle(str(py / "data_batch_1"))
    _py2_pickle(py / "data_batch_1", {b"labels": [1, 2], b"data": _images(2).reshape(2, -1)})
    with pytest.raises(tasks.DataError, match="data_batch_2 is missing"):
        tasks.read_cifar(str(tmp_path / "p"), "cifar10")
    with pytest.raises(tasks.DataError, match="CIFAR-100 not found.*cifar.html"):
        tasks.read_cifar(str(tmp_path / "empty"), "cifar100")


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


@pytest.mark.parametrize("suffix", ["", ".npz"])
def test_imagenet100_downsampled_keeps_the_100_classes_in_wnid_order(tmp_path, suffix):
    assert len(tasks.IMAGENET100_WNIDS) == 100 and list(tasks.IMAGENET100_WNIDS) == sorted(set(tasks.IMAGENET100_WNIDS))
    root = _imagenet_dir(tmp_path, suffix)
    d = tasks.read_imagenet100_downsampled(str(root))
    assert d["train"][0].shape == (20, 3, 32, 32) and d["train"][1].tolist() == [0, 99] * 10
    assert d["test"][1].tolist() == [0, 99, 0, 99]
    assert np.array_equal(d["test"][0][:2], _images(6, 2)[:2])
    os.remove(root / "map_clsloc.txt")
    with pytest.raises(tasks.DataError, match="map_clsloc.txt is missing"):
        tasks.read_imagenet100_downsampled(str(root))


def test_imagenet_labels_must_be_one_based(tmp_path):
    root = _imagenet_dir(tmp_path)
    _py2_pickle(root / "val_data", {b"data": _images(1).reshape(1, -1), b"labels": [0]})
    with pytest.raises(tasks.DataError, match="1-based"):
        tasks.read_imagenet100_downsampled(str(root))


def test_image_folder_reader(tmp_path):
    try:
        from PIL import Image
    except ImportError:
        with pytest.raises(tasks.DataError, match="needs Pillow: pip install pillow"):
            tasks.read_image_folder(str(tmp_path), 32)
        return
    for label in (0, 99):
        folder = tmp_path / tasks.IMAGENET100_WNIDS[label]
        folder.mkdir()
        Image.fromarray(_images(1, label)[0].transpose(1, 2, 0)).save(folder / "a.png")
    for w in tasks.IMAGENET100_WNIDS[1:99]:
        (tmp_path / w).mkdir()
    x, y = tasks.read_image_folder(str(tmp_path), 16)
    assert x.shape == (2, 3, 16, 16) and y.tolist() == [0, 99]
    (tmp_path / tasks.IMAGENET100_WNIDS[0] / "b.png").write_bytes(b"not an image")
    with pytest.raises(tasks.DataError, match="not a readable image"):
        tasks.read_image_folder(str(tmp_path), 16)


_U8 = np.zeros((4, 3072), np.uint8)


@pytest.mark.parametrize("data,labels,needle", [
    (np.full((4, 3072), 0.5), [1, 2, 3, 4], "pixels must be integers 0..255 (uint8, as in the release), "
                                            "found float64 values in 0.5..0.5"),           # 0-1 floats
    (np.full((4, 3072), 200.0), [1, 2, 3, 4], "found float64 values in 200..200"),        # 0-255 floats
    (np.full((4, 3072), np.nan), [1, 2, 3, 4], "found float64 values with NaN"),
    (np.full((4, 3072), 300), [1, 2, 3, 4], "pixels must be integers 0..255, found 300..300"),
    (np.full((4, 3072), -1), [1, 2, 3, 4], "found -1..-1"),
    (_U8, ["a", "b", "c", "d"], "labels must be integers, found |S1 values (e.g. b'a')"),     # Python 2's str
    (_U8, [[1], [2], [3], [4]], "labels must be a flat list of integers, found a list of lists"),
    (_U8, np.ones((4, 1), np.int64), "labels must be a flat list of integers, found an array of shape (4, 1)"),
    (_U8, [1, 2, 3, 10], "labels must lie in 0..9, found 1..10"),
    (_U8, [1, 2, 3, -1], "labels must lie in 0..9, found -1..3"),
    (np.zeros((4, 768), np.uint8), [1, 2, 3, 4], "rows of 768 bytes are 16x16 images; expected 32x32 (rows of 3072"),
    (np.zeros((0, 3072), np.uint8), [], "data_batch_2 holds no images (an empty batch)"),
])
def test_broken_cifar_data_is_refused_before_anything_is_cached(tmp_path, capsys, data, labels, needle):
    x, y = _images(4), [1, 2, 3, 4]
    datafetch.write.write_cifar10_python(str(tmp_path), np.concatenate([x] * 5), np.array(y * 5), x, np.array(y))
    _py2_pickle(tmp_path / "cifar-10-batches-py" / "data_batch_2", {b"data": data, b"labels": labels})
    rc, out = run_train(tmp_path, "--task", "cifar10", "--data-dir", tmp_path, "--steps", "1", "--layers", "1",
                        "--dim", "24", "--heads", "3", "--mlp-dim", "48", "--patch-size", "8", "--batch-size", "4")
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "data_batch_2" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-batches-py"]        # no cache, no run folder


def test_broken_binary_labels_and_imagenet_batches_are_refused(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    np.concatenate([np.array([[4], [12]], np.uint8), _images(2).reshape(2, -1)], axis=1).tofile(b / "x.bin")
    with pytest.raises(tasks.DataError, match=r"x.bin: labels must lie in 0..9, found 4..12"):
        tasks.read_cifar_binary(str(b / "x.bin"), n_classes=10)
    root = _imagenet_dir(tmp_path)
    _py2_pickle(root / "val_data", {b"data": np.full((1, 3072), 0.5), b"labels": [1]})
    with pytest.raises(tasks.DataError, match="val_data: pixels must be integers 0..255"):
        tasks.read_imagenet100_downsampled(str(root))
    _py2_pickle(root / "val_data", {b"data": _images(1).reshape(1, -1), b"labels": ["n01558993"]})
    with pytest.raises(tasks.DataError, match="val_data: labels must be integers"):
        tasks.read_imagenet100_downsampled(str(root))


def test_a_cifar_batch_that_is_a_folder_is_one_line(tmp_path):
    x, y = _images(10), np.arange(10) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    os.mkdir(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(tasks.DataError, match="data_batch_3 is not a file"):
        tasks.read_cifar(str(tmp_path), "cifar10")
    with pytest.raises(tasks.DataError, match="cannot be read"):
        tasks.read_cifar_pickle(str(tmp_path / "cifar-10-batches-py" / "data_batch_3"))


_PAYLOADS = ["system", "eval", "subprocess"]


@pytest.mark.parametrize("how", _PAYLOADS)
@pytest.mark.parametrize("where", ["cifar10 data_batch_1", "cifar10 test_batch", "cifar100 train",
                                   "imagenet val_data", "imagenet .npz"])
def test_a_dataset_file_that_would_run_code_runs_nothing(tmp_path, capsys, where, how):
    """A dataset file crafted to run a command when unpickled (os.system, eval, subprocess; as the only
    value, inside the dict, in a Python 2 or a Python 3 pickle) is one line and exit 2, and the command
    never runs: the batches are read by `tasks.ReleaseUnpickler`, which admits only numbers and arrays."""
    marker = tmp_path / "ran"
    evil = {b"data": _Touch(marker, how), b"labels": [1]}
    if where.startswith("cifar10 "):
        data = tmp_path / "data"
        datafetch.write.write_cifar10_python(str(data), _images(10), np.arange(10), _images(2), np.arange(2))
        target = data / "cifar-10-batches-py" / where.split()[1]
        target.write_bytes(pickle.dumps(evil if "test" in where else _Touch(marker, how), protocol=2))
        argv = ["--task", "cifar10", "--data-dir", data]
    elif where == "cifar100 train":
        data = tmp_path / "data" / "cifar-100-python"
        data.mkdir(parents=True)
        (data / "train").write_bytes(pickle.dumps(evil, protocol=4))
        _py2_pickle(data / "test", {b"fine_labels": [1], b"data": _images(1).reshape(1, -1)})
        argv = ["--task", "cifar100", "--data-dir", data.parent]
    else:
        data = _imagenet_dir(tmp_path)
        if where.endswith(".npz"):
            os.remove(data / "val_data")
            np.savez(data / "val_data.npz", data=np.array([_Touch(marker, how)], dtype=object), labels=np.array([1]))
        else:
            (data / "val_data").write_bytes(pickle.dumps(evil, protocol=2))
        argv = ["--task", "imagenet100", "--data-dir", data]
    before = sorted(os.listdir(tmp_path))
    rc, _ = run_train(tmp_path, *argv, "--steps", "1", "--layers", "1", "--dim", "24", "--heads", "3", "--mlp-dim",
                      "24", "--patch-size", "8", "--batch-size", "2")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and not marker.exists(), err
    assert ("no release file holds" in err and "nothing was run" in err) or "not an Imagenet32/64 .npz" in err, err
    assert sorted(os.listdir(tmp_path)) == before                       # no run folder


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_python_3_pickles_of_a_batch_read_the_same(tmp_path, protocol):
    """A batch re-saved by Python 3 (bytes through _codecs.encode at protocol 2, numpy._core names, protocol 5's
    _frombuffer), with str or bytes keys, reads as the Python 2 original."""
    x, y = _images(3, 7).reshape(3, -1), [4, 5, 6]
    for keys in (bytes, str):
        k = (lambda s: s.encode()) if keys is bytes else (lambda s: s)
        (tmp_path / "b").write_bytes(pickle.dumps({k("data"): x, k("labels"): y, k("batch_label"): k("b")},
                                                  protocol=protocol))
        got = tasks.read_cifar_pickle(str(tmp_path / "b"), n_classes=10)
        assert np.array_equal(got[0].reshape(3, -1), x) and got[1].tolist() == y


def test_damaged_copies_of_a_release_batch_are_one_data_error_each(tmp_path):
    """600 damaged copies of a Python 2 data_batch (bits flipped, bytes changed, cut, inserted or deleted, most
    in its structure): each reads or is one DataError, never another exception; and a damaged memo index that
    makes C's unpickler allocate gigabytes costs the pure-Python one nothing (ReleaseUnpickler)."""
    import random
    import tracemalloc
    x = _images(6, 3).reshape(6, -1)
    good = _py2_dumps({b"batch_label": b"training batch 1 of 5", b"labels": [1, 2, 3, 4, 5, 6], b"data": x,
                       b"filenames": [b"img_%d.png" % i for i in range(6)]})
    body = good.index(x.tobytes()[:64])
    rng, path, read, refused = random.Random(0), tmp_path / "data_batch_1", 0, 0
    for _ in range(600):
        b = bytearray(good)
        p = rng.choice([rng.randrange(body), rng.randrange(body + x.nbytes, len(b)), rng.randrange(len(b))])
        kind = rng.randrange(5)
        if kind == 0:
            b[p] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b[p] = rng.randrange(256)
        elif kind == 2:
            b = b[:p]
        elif kind == 3:
            b[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        else:
            del b[p:p + rng.randint(1, 6)]
        path.write_bytes(bytes(b))
        try:
            tasks.read_cifar_pickle(str(path), n_classes=10)
            read += 1
        except tasks.DataError:
            refused += 1
    assert read + refused == 600 and refused > 300
    reduce_at = good.index(b"R", good.index(b"numpy\nndarray"))        # REDUCE -> LONG_BINPUT with a huge index
    path.write_bytes(good[:reduce_at] + b"r" + good[reduce_at + 1:])
    tracemalloc.start()
    with pytest.raises(tasks.DataError):
        tasks.read_cifar_pickle(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50e6, peak
    for labels, needle in (([10 ** 5000], "64-bit integers"), ([[1], [2]] * 3, "a flat list of integers"),
                           (b"\x01" * 6, "labels must be a list of integers, found bytes")):
        _py2_pickle(path, {b"data": x, b"labels": labels})
        with pytest.raises(tasks.DataError, match=needle):
            tasks.read_cifar_pickle(str(path))
    _py2_pickle(path, {b"data": x.tolist(), b"labels": [1] * 6})
    with pytest.raises(tasks.DataError, match="pixels must be a numpy array of uint8 rows"):
        tasks.read_cifar_pickle(str(path))


def test_image_cache_is_written_reused_and_rebuilt_when_a_source_changes(tmp_path, monkeypatch):
    x, y = _images(10), np.arange(10) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
    first = tasks.load_image_dataset("cifar10", str(tmp_path))
    cache = tmp_path / "maskprior-cache" / "cifar10-32.npz"
    assert cache.exists()
    with monkeypatch.context() as m:                               # the second run reads only the cache
        m.setattr(tasks, "read_cifar", lambda *a: pytest.fail("the cache was not used"))
        again = tasks.load_image_dataset("cifar10", str(tmp_path))
    assert np.array_equal(first["train"][0], again["train"][0]) and np.array_equal(again["test"][1], y[:4])
    # the batches replaced in place (other images, other labels): the cache is rebuilt, not trusted
    x2 = 255 - x
    datafetch.write.write_cifar10_python(str(tmp_path / "new"), x2, y, x2[:4], (y[:4] + 1) % 10)
    for f in os.listdir(tmp_path / "new" / "cifar-10-batches-py"):
        shutil.copyfile(tmp_path / "new" / "cifar-10-batches-py" / f, tmp_path / "cifar-10-batches-py" / f)
    os.utime(tmp_path / "cifar-10-batches-py" / "test_batch", ns=(1, 1))      # even with an older mtime
    fresh = tasks.load_image_dataset("cifar10", str(tmp_path))
    assert np.array_equal(fresh["train"][0], x2) and fresh["test"][1].tolist() == ((y[:4] + 1) % 10).tolist()
    shutil.rmtree(tmp_path / "cifar-10-batches-py")               # sources gone: the cache is not trusted either
    with pytest.raises(tasks.DataError, match="CIFAR-10 not found"):
        tasks.load_image_dataset("cifar10", str(tmp_path))


# ---------------------------------------------------------------------------------------- tasks.py: augmentation

def test_augmentation_shapes_and_determinism():
    x = torch.as_tensor(_images(8))
    a = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(1))
    b = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(1))
    c = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and a.dtype == torch.uint8 and a.equal(b) and not a.equal(c)
    assert augment.random_crop_flip(x, 0, torch.Generator(), flip=False).equal(x)
    # a crop is a shifted window of the zero-padded image
    one = torch.arange(16, dtype=torch.uint8).view(1, 1, 4, 4)
    out = augment.random_crop_flip(one, 1, torch.Generator().manual_seed(0), flip=False)
    padded = F.pad(one, (1, 1, 1, 1))
    assert any(out.equal(padded[..., i:i + 4, j:j + 4]) for i in range(3) for j in range(3))


def _aug_images(n=6, h=9, w=11, seed=0):
    x = np.random.default_rng(seed).integers(0, 256, (n, 3, h, w), dtype=np.uint8)
    x[1] = x[1] // 4 + 100                                   # a low-contrast image
    x[2] = x[2] // 8 + 3                                     # a dark one
    return torch.as_tensor(x)


@pytest.mark.parametrize("name", list(augment.RANDAUG_OPS))
def test_randaugment_op_shapes_range_determinism_and_identity(name):
    fn, arg = augment.RANDAUG_OPS[name]
    x = _aug_images()
    m = torch.full((6,), 7.0)
    sign = torch.tensor([1.0, -1, 1, -1, 1, -1])
    out = fn(x, None if arg is None else arg(m, sign))
    assert out.shape == x.shape and out.dtype == torch.uint8
    again = fn(x, None if arg is None else arg(m, sign))
    assert torch.equal(out, again)
    if arg is not None:                                      # magnitude 0 leaves every image as it is
        assert torch.equal(fn(x, arg(torch.zeros(6), sign)), x), name
        assert name == "identity" or not torch.equal(out, x), name


PIL_EQUIVALENT = {  # op: (argument, Pillow's function of a PIL image and that argument)
    "brightness": (1.7, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Brightness(im).enhance(a)),
    "color": (0.3, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Color(im).enhance(a)),
    "contrast": (1.6, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Contrast(im).enhance(a)),
    "sharpness": (0.2, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Sharpness(im).enhance(a)),
    "posterize": (3, lambda im, a: __import__("PIL.ImageOps").ImageOps.posterize(im, a)),
    "solarize": (100, lambda im, a: __import__("PIL.ImageOps").ImageOps.solarize(im, a)),
    "autocontrast": (None, lambda im, a: __import__("PIL.ImageOps").ImageOps.autocontrast(im)),
    "equalize": (None, lambda im, a: __import__("PIL.ImageOps").ImageOps.equalize(im)),
}


@pytest.mark.parametrize("name", list(PIL_EQUIVALENT))
def test_randaugment_photometric_ops_equal_pillows(name):
    """Each photometric op equals Pillow's on every pixel (Pillow 13 measured; a hand value without Pillow)."""
    fn = augment.RANDAUG_OPS[name][0]
    a, ref = PIL_EQUIVALENT[name]
    x = _aug_images()
    ours = fn(x, a).numpy()
    try:
        from PIL import Image
    except ImportError:
        hand = {"brightness": lambda v: min(255, int(v * 1.7)), "posterize": lambda v: v & 0b11100000,
                "solarize": lambda v: 255 - v if v >= 100 else v}
        if name in hand:
            assert all(ours.flat[i] == hand[name](int(x.numpy().flat[i])) for i in range(0, ours.size, 7))
        return
    want = np.stack([np.asarray(ref(Image.fromarray(img.transpose(1, 2, 0)), a)).transpose(2, 0, 1)
                     for img in x.numpy()])
    assert np.array_equal(ours, want), (ours != want).sum()


def test_geometric_ops_by_hand():
    x = _aug_images(4, 9, 9)
    assert torch.equal(augment.aug_rotate(x, 90.0), torch.rot90(x, 1, (2, 3)))           # counter-clockwise
    assert torch.equal(augment.aug_rotate(x, -90.0), torch.rot90(x, -1, (2, 3)))
    t = augment.aug_translate_x(x, 2 / 9)                                                # two pixels to the left
    assert torch.equal(t[..., :7], x[..., 2:]) and t[0, :, 0, 8].tolist() == list(augment.AUG_FILL)
    t = augment.aug_translate_y(x, -3 / 9)                                               # three pixels down
    assert torch.equal(t[..., 3:, :], x[..., :6, :])
    s = augment.aug_shear_x(x, 1.0)                                                      # row i reads columns j + i
    assert torch.equal(s[:, :, 2, :7], x[:, :, 2, 2:]) and torch.equal(s[:, :, 0], x[:, :, 0])
    s = augment.aug_shear_y(x, 1.0)
    assert torch.equal(s[:, :, :7, 2], x[:, :, 2:, 2])


def test_rand_augment_is_seeded_and_mixes_ops():
    x = _aug_images(64, 16, 16)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a, b = augment.rand_augment(x, g(), 9.0, 0.5), augment.rand_augment(x, g(), 9.0, 0.5)
    assert torch.equal(a, b) and a.dtype == torch.uint8 and a.shape == x.shape
    changed = (a != x).flatten(1).any(1).float().mean()
    assert 0.5 < changed < 1.0                              # each of 2 ops applied with p 0.5: ~75% change
    zero = augment.rand_augment(x, g(), 0.0, 0.0, prob=1.0)           # magnitude 0: only autocontrast / equalize act
    unchanged = (zero == x).flatten(1).all(1).float().mean()
    assert 0.5 < unchanged < 1.0


def test_random_resized_crop_erasing_and_eval_view():
    x = _aug_images(8, 32, 32)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    out = augment.random_resized_crop(x, 224, g())
    assert out.shape == (8, 3, 224, 224) and out.dtype == torch.uint8 and torch.equal(out, augment.random_resized_crop(x, 224, g()))
    whole = augment.random_resized_crop(x, 64, g(), scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    up = tasks.F.interpolate(x.float(), size=64, mode="bilinear", align_corners=False)
    assert (whole.float() - up).abs().max() <= 1                                    # the whole image, upsampled
    view = augment.resize_center_crop(x, 224, 0.875)
    assert view.shape == (8, 3, 224, 224)
    xf = torch.randn(64, 3, 16, 16)
    e = augment.random_erasing(xf, 0.5, g())
    erased = (e != xf).flatten(1).any(1)
    assert 0.25 < erased.float().mean() < 0.75 and torch.equal(e, augment.random_erasing(xf, 0.5, g()))
    frac = (e != xf)[erased].float().mean()                                      # a box of 2% to 33% of the image
    assert 0.02 <= frac <= 0.34
    assert torch.equal(augment.random_erasing(xf, 0.0, g()), xf)


def test_mixup_and_cutmix_mix_images_and_targets_by_what_each_keeps():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.eye(4)
    perm = torch.tensor([1, 0, 3, 2])
    mx, my = augment.mixup(x, y, perm, 0.7)
    assert torch.allclose(mx, 0.7 * x + 0.3 * x[perm]) and torch.allclose(my[0], torch.tensor([0.7, 0.3, 0, 0]))
    cx, cy = augment.cutmix(x, y, perm, 0.75, g)
    pasted = (cx != x).any(1)                                  # (B, S, S): where the partner's pixels went
    assert torch.equal(cx[:, :, pasted[0]], x[perm][:, :, pasted[0]]) and torch.equal(cx[~pasted.unsqueeze(1).expand_as(x)],
                                                                                   x[~pasted.unsqueeze(1).expand_as(x)])
    kept = 1 - pasted[0].float().mean()
    assert 0 < kept < 1 and torch.allclose(cy[0], torch.tensor([kept, 1 - kept, 0, 0]))
    assert torch.equal(augment.cutmix(x, y, perm, 1.0, g)[0], x)     # lam 1: nothing pasted
    rng = np.random.default_rng(0)
    assert augment.mix_batch(x, y, 0.0, 0.0, g, rng) == (x, y)
    for mix, cut in ((0.8, 0.0), (0.0, 1.0), (0.8, 1.0)):
        bx, by = augment.mix_batch(x, y, mix, cut, torch.Generator().manual_seed(1), np.random.default_rng(1))
        assert bx.shape == x.shape and torch.allclose(by.sum(-1), torch.ones(4)) and not torch.equal(bx, x)


# ---------------------------------------------------------------------------------------- tasks.py: ImageTask

def test_image_task_batches_mixup_and_cutmix(tmp_path):
    x, y = _images(40), np.arange(40) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:8], y[:8])
    for mix in ({}, {"mixup": 0.8}, {"cutmix": 1.0}):
        task = tasks.make_task("cifar10", data_dir=str(tmp_path), **mix).setup()
        xb, yb = task.train_batch(3, 16)
        assert xb.shape == (16, 3, 32, 32) and yb.shape == (16, 10)
        torch.testing.assert_close(yb.sum(-1), torch.ones(16))
        x2, y2 = task.train_batch(3, 16)
        assert xb.equal(x2) and yb.equal(y2)
    assert task.pattern().shape == (3, 64, 64)


def test_vision_patterns_and_their_probe_patterns(image_dir):
    task = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, heads=3, soft_alpha=1.0)      # 4 x 4 grid
    imp, soft = task.pattern("impulse"), task.pattern("soft")
    # alpha 1: only the offset itself is above -1 (e^-1 at distance 1), and where it leaves the grid the row's
    # likeliest key, itself: the impulse pattern, so a QK init reads the same prior from either (CLS or not)
    assert soft.equal(imp) and (soft.sum(-1) == 1).all()
    cls = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, pool="cls")
    assert cls.pattern("soft").equal(cls.pattern("impulse"))
    assert tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, soft_alpha=3.0).pattern("soft").equal(imp)
    assert tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, soft_alpha=0.5).pattern("soft").sum() > imp.sum()
    graded = task.mask_logits("graded", 5.0, 10.0)
    assert (graded[imp] == 5).all() and (graded[task.pattern("graded") & ~imp] == 0).all()
    assert (graded[~task.pattern("graded")] == -10).all()
    local = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, window=5).pattern("local")
    assert local[0, 0].sum() == 9 and local[0, 5].sum() == 16           # a corner sees 3 x 3, an inner patch all
    for bad, needle in (({"window": 4}, "--window must be the local prior's side"), ({"soft_alpha": 0.0}, "--soft-alpha")):
        with pytest.raises(tasks.TaskError, match=needle):
            tasks.make_task("cifar10", data_dir=image_dir, **bad)


MUST_TRIES = (-1, 0, 1, 2, 3, 4, 0.5, 1.5, 11, float("nan"), float("inf"), "msb", "x", True)   # None: the default


def test_every_declared_task_option_refuses_exactly_what_its_test_fails(tmp_path):
    """Each option a task declares (Task.MUST, of every registered task and its bases) is refused in
    one line, "--flag must be <what>, got <value>", for each tried value its test fails (a TypeError
    counts as failing), and never for a value its test passes."""
    tried, seen = 0, set()
    for name, cls in tasks.TASKS.items():
        base = {"data_dir": str(tmp_path)} if "data_dir" in cls.options() else {}
        for klass in cls.__mro__:
            for option, must in vars(klass).get("MUST", {}).items():
                if (klass, option) in seen:                       # each declaration tried on one task
                    continue
                seen.add((klass, option))
                flag = must.flag or "--" + option.replace("_", "-")
                given = flag[2:].replace("-", "_")                 # the option as make_task takes it
                assert given in cls.options(), (name, option)
                for value in MUST_TRIES:
                    try:
                        good = bool(must.test(value))
                    except TypeError:
                        good = False
                    try:
                        tasks.make_task(name, **base, **{given: value})
                        said = ""
                    except tasks.TaskError as e:
                        said = str(e)
                    assert (f"{flag} must be {must.what}, got {value!r}" == said) != good, (name, option, value, said)
                    tried += 1
    assert tried > 200


def test_impulse_pattern_is_fixed_at_construction(tmp_path, image_dir):
    """--impulse random once drew its offsets with seed 0 before setup and with the run's seed after it."""
    task = tasks.make_task("cifar10", data_dir=image_dir, impulse="random", heads=3, seed=5)
    before = task.pattern()
    task.setup()
    assert torch.equal(before, task.pattern())
    other = tasks.make_task("cifar10", data_dir=image_dir, impulse="random", heads=3, seed=6).pattern()
    assert not torch.equal(before, other)


@pytest.mark.parametrize("argv,needle", [
    (["--task", "cifar10"], "--data-dir is required"),
    (["--task", "cifar10", "--data-dir", "/nonexistent/x"], "is not a folder"),
    (["--task", "cifar100", "--data-dir", "EMPTY"], "CIFAR-100 not found"),
    (["--task", "imagenet100", "--data-dir", "EMPTY"], "ImageNet-100 not found in"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--image-size", "32", "--patch-size", "5"], "not a multiple"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--patch-size", "0"], "--patch-size must be an integer > 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--image-size", "0"], "--image-size must be an integer > 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--label-smoothing", "1"], "--label-smoothing must be a finite"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--mixup", "-1"], "--mixup must be a finite number >= 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--warmup-epochs", "nan"], "--warmup-epochs must be a finite"),
])
def test_vision_bad_input_exits_2(tmp_path, capsys, argv, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out = run_train(tmp_path, *[str(empty) if a == "EMPTY" else a for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert os.listdir(empty) == [] and not os.path.exists(out)       # nothing written


# ---------------------------------------------------------------------------------------- tasks.py: language readers

def test_line_words_follow_word_language_model():
    assert tasks.wikitext_line_words(" = Robert Boulter = \n") == ["=", "Robert", "Boulter", "=", "<eos>"]
    assert tasks.wikitext_line_words(" \n") == ["<eos>"]
    assert tasks.wikitext_line_words("\n") == ["<eos>"]
    assert tasks.wikitext_line_words(" 1 @,@ 000 <unk> \n") == ["1", "@,@", "000", "<unk>", "<eos>"]


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


def test_vocab_order_specials_then_frequency_then_alphabetical(tmp_path):
    train = "b a b\n\nc a b d c\n"  # b:3, a:2, c:2, d:1, <eos>:3
    make_wikitext(tmp_path, train=train, valid="a d\n", test="c\n")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert corpus["vocab"] == ["<unk>", "<eos>", "b", "a", "c", "d"]
    assert corpus["vocab_size"] == 6
    assert corpus["train"].tolist() == [2, 3, 2, 1, 1, 4, 3, 2, 5, 4, 1]
    assert corpus["valid"].tolist() == [3, 5, 1]
    assert corpus["test"].tolist() == [4, 1]
    assert tasks.build_vocab(["<eos>", "<unk>", "z", "y", "z"]) == ["<unk>", "<eos>", "z", "y"]


def reference_words(text: str) -> list[str]:
    return [w for line in text.splitlines() for w in line.split() + ["<eos>"]]


def test_wikitext_tokens_release_ids_and_round_trip(tmp_path):
    make_wikitext(tmp_path)
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    vocab = corpus["vocab"]
    assert vocab[:2] == ["<unk>", "<eos>"]
    assert vocab.count("<unk>") == 1  # the train <unk> is the special, not a second entry
    for split, text in (("train", WIKI_TRAIN), ("valid", WIKI_VALID), ("test", WIKI_TEST)):
        tokens = corpus[split]
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and not tokens.flags.writeable
        words = reference_words(text)
        assert [vocab[i] for i in tokens] == words  # every word of .tokens is in the train vocab
        expected = "".join(" ".join(line.split()) + "\n" for line in text.splitlines())
        assert corpus["decode"](tokens.tolist()) == expected
    # Every line, blank ones included, ends in exactly one <eos>.
    assert int((np.asarray(corpus["train"]) == 1).sum()) == WIKI_TRAIN.count("\n")
    for special in ("@,@", "@.@", "@-@", "="):
        assert special in vocab
    assert corpus["decode"]([vocab.index("="), vocab.index("Career"), vocab.index("="), 1]) == "= Career =\n"


def test_wikitext_raw_release_maps_oov_to_unk(tmp_path):
    make_wikitext(tmp_path, release="raw")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "raw release" in corpus["source"]
    vocab = corpus["vocab"]
    assert "unseenword" not in vocab and "actor." in vocab
    valid_words = [vocab[i] for i in corpus["valid"]]
    assert valid_words == ["<eos>", "Boulter", "is", "an", "<unk>", "actor.", "<eos>"]
    assert corpus["test"].tolist() == [vocab.index(w) for w in ("Robert", "is", "an", "actor.", "<eos>")]


def test_wikitext_data_dir_may_be_the_subfolder_and_tokens_is_preferred(tmp_path):
    sub = make_wikitext(tmp_path, release="tokens")
    make_wikitext(tmp_path, release="raw")
    from_parent = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "tokens release" in from_parent["source"]
    from_sub = tasks.load_lm_corpus("wikitext2", sub)
    assert from_sub["train"].tolist() == from_parent["train"].tolist()
    raw = tasks.load_lm_corpus("wikitext2", tmp_path, version="raw")
    assert "raw release" in raw["source"]
    assert raw["vocab"] != from_parent["vocab"]


def test_wikitext_large_vocab_uses_uint32(tmp_path):
    words = " ".join(f"w{i}" for i in range(70_000))
    make_wikitext(tmp_path, train=words + "\n", valid="w1 w69999\n", test="w2\n")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert corpus["vocab_size"] == 70_002
    assert corpus["train"].dtype == np.uint32
    assert [corpus["vocab"][i] for i in corpus["valid"]] == ["w1", "w69999", "<eos>"]


def test_wikitext_missing_files_error(tmp_path):
    with pytest.raises(tasks.DataError) as info:
        tasks.load_lm_corpus("wikitext2", tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for needle in ("wiki.{train,valid,test}.tokens", ".raw", str(tmp_path / "wikitext-2"),
                   "wikitext-2-v1.zip", "wikitext.smerity.com", "python train.py download wikitext2 --data"):
        assert needle in message
    # An incomplete release is not used.
    write(tmp_path / "wikitext-2" / "wiki.train.tokens", WIKI_TRAIN)
    with pytest.raises(tasks.DataError, match="not found"):
        tasks.load_lm_corpus("wikitext2", tmp_path)


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_wikitext_empty_split_error(tmp_path, split):
    make_wikitext(tmp_path, **{split: ""})
    with pytest.raises(tasks.DataError, match=rf"wiki\.{split}\.tokens is empty.*wikitext\.smerity\.com"):
        tasks.load_lm_corpus("wikitext2", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()               # no vocab, no split, no folder left


def reference_bytes(data: bytes) -> list[int]:
    """Non-streaming reference for the TinyStories byte tokenisation."""
    out, story = [], []

    def flush():
        body = b"\n".join(story).strip()
        if body:
            out.extend(body)
            out.append(256)
        story.clear()

    for line in data.split(b"\n"):
        if line.strip() == b"<|endoftext|>":
            flush()
        else:
            story.append(line)
    flush()
    return out


def test_tinystories_exact_bytes():
    data = "Hi\n<|endoftext|>\né\n <|endoftext|>\n"
    assert reference_bytes(data.encode()) == [72, 105, 256, 0xC3, 0xA9, 256]


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


def stream(path: Path, chunk_size: int) -> list[int]:
    arrays = list(tasks.iter_tinystories_tokens(path, chunk_size))
    return np.concatenate(arrays).tolist() if arrays else []


def test_tinystories_stream_matches_reference_for_every_chunk_size(tmp_path):
    data = STORIES.encode("utf-8")
    path = write(tmp_path / "TinyStoriesV2-GPT4-train.txt", data)
    # The fixture really exercises chunk boundaries at chunk_size=7: a separator
    # line and a 3-byte “ are both cut by a multiple of 7.
    sep = data.index(b"\n<|endoftext|>\n") + 1
    assert sep // 7 != (sep + len(b"<|endoftext|>")) // 7
    quote = data.index("“".encode())
    assert quote // 7 != (quote + 2) // 7
    e_acute = data.rindex("é".encode())
    assert e_acute // 7 != (e_acute + 1) // 7
    expected = reference_bytes(data)
    assert expected.count(256) == 4  # the empty story between two separators is skipped
    assert bytes(t for t in expected if t != 256).count("<|endoftext|>".encode()) == 1  # mid-line text kept
    for chunk_size in list(range(1, 40)) + [7, 1 << 20]:
        assert stream(path, chunk_size) == expected, chunk_size


def test_tinystories_crlf_and_whitespace_only_lines(tmp_path):
    data = b"\r\n  \r\nOne\r\n\r\n<|endoftext|>\r\n\t<|endoftext|>\t\r\nTwo\xc3\xa9 \r\n"
    path = write(tmp_path / "x.txt", data)
    expected = list(b"One") + [256] + list("Twoé".encode()) + [256]
    assert reference_bytes(data) == expected
    for chunk_size in (1, 2, 3, 7, 64):
        assert stream(path, chunk_size) == expected


VALID_STORIES = "A small dog.\n<|endoftext|>\nThe end “now”.\n<|endoftext|>\n"


def make_tinystories(root: Path, prefix: str = "TinyStoriesV2-GPT4", train=STORIES, valid=VALID_STORIES) -> Path:
    write(root / f"{prefix}-train.txt", train)
    write(root / f"{prefix}-valid.txt", valid)
    return root


def test_tinystories_load_decode_round_trip(tmp_path):
    make_tinystories(tmp_path)
    corpus = tasks.load_lm_corpus("tinystories", tmp_path, chunk_size=7)
    assert corpus["vocab_size"] == 257
    train, valid = corpus["train"], corpus["valid"]
    assert isinstance(train, np.memmap) and train.dtype == np.uint16 and not train.flags.writeable
    assert train.tolist() == reference_bytes(STORIES.encode())
    stories = [
        "Once upon a time, a “Lily” saw a café.\n\nShe said, “Hi!” He wrote <|endoftext|> on a card.",
        "Tom ran.",
        "Ben was very happy é.",
        "Last story with no separator after it.",
    ]
    assert corpus["decode"](train.tolist()) == "".join(s + "\n<|endoftext|>\n" for s in stories)
    assert corpus["decode"](valid.tolist()) == "A small dog.\n<|endoftext|>\nThe end “now”.\n<|endoftext|>\n"
    with pytest.raises(ValueError):
        corpus["decode"]([257])


def test_tinystories_version_choice(tmp_path):
    make_tinystories(tmp_path, "TinyStories", train="v one\n<|endoftext|>\n", valid="v1 valid\n")
    assert tasks.load_lm_corpus("tinystories", tmp_path)["decode"]([118, 32, 111]) == "v o"
    v1 = tasks.load_lm_corpus("tinystories", tmp_path)
    assert "TinyStories-train.txt" in v1["source"]
    assert bytes(v1["train"][:-1].tolist()) == b"v one"
    make_tinystories(tmp_path, "TinyStoriesV2-GPT4", train="v two\n", valid="v2 valid\n")
    auto = tasks.load_lm_corpus("tinystories", tmp_path)
    assert bytes(auto["train"][:-1].tolist()) == b"v two"
    chosen = tasks.load_lm_corpus("tinystories", tmp_path, version="v1")
    assert bytes(chosen["train"][:-1].tolist()) == b"v one"
    with pytest.raises(tasks.DataError, match="unknown TinyStories version"):
        tasks.load_lm_corpus("tinystories", tmp_path, version="v3")
    with pytest.raises(tasks.DataError, match="unknown corpus"):
        tasks.load_lm_corpus("ptb", tmp_path)


def test_tinystories_subfolder(tmp_path):
    make_tinystories(tmp_path / "TinyStories")
    assert tasks.load_lm_corpus("tinystories", tmp_path)["train"].tolist() == reference_bytes(STORIES.encode())


def test_tinystories_missing_files_error(tmp_path):
    write(tmp_path / "TinyStoriesV2-GPT4-train.txt", STORIES)  # valid missing
    with pytest.raises(tasks.DataError) as info:
        tasks.load_lm_corpus("tinystories", tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for needle in ("TinyStoriesV2-GPT4-{train,valid}.txt", "TinyStories-{train,valid}.txt",
                   str(tmp_path), "huggingface.co/datasets/roneneldan/TinyStories"):
        assert needle in message


def test_tinystories_empty_corpus_error(tmp_path):
    make_tinystories(tmp_path, train="\n<|endoftext|>\n  \n<|endoftext|>\n\n")
    with pytest.raises(tasks.DataError, match=r"TinyStoriesV2-GPT4-train\.txt contains no stories.*roneneldan"):
        tasks.load_lm_corpus("tinystories", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()  # no half cache, no temp file, no folder


def test_random_windows_shapes_shift_and_determinism():
    tokens = np.arange(1000, 1100, dtype=np.uint16)
    x, y = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        start = int(row_x[0]) - 1000
        assert 0 <= start <= 100 - 9
        assert row_x.tolist() == tokens[start : start + 8].tolist()
        assert row_y.tolist() == tokens[start + 1 : start + 9].tolist()
    x2, y2 = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(1))
    assert not torch.equal(x, x3)


def test_random_windows_reach_both_ends():
    tokens = np.arange(10, dtype=np.uint32)
    x, y = tasks.random_windows(tokens, 9, 64, torch.Generator().manual_seed(0))  # only one possible window
    assert (x == torch.arange(9)).all() and (y == torch.arange(1, 10)).all()
    x, _ = tasks.random_windows(tokens, 3, 2000, torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == set(range(7))
    with pytest.raises(tasks.DataError, match=r"--context 10 is longer than the training split \(10 tokens\)"):
        tasks.random_windows(tokens, 10, 2, torch.Generator())


@pytest.mark.parametrize("n, context, batch_size", [(11, 5, 1), (12, 5, 1), (23, 5, 3), (6, 5, 4), (100, 7, 4)])
def test_eval_windows_cover_the_split(n, context, batch_size):
    tokens = np.arange(n, dtype=np.uint16) * 3
    batches = list(tasks.eval_windows(tokens, context, batch_size))
    xs = torch.cat([x.reshape(-1) for x, _ in batches])
    ys = torch.cat([y.reshape(-1) for _, y in batches])
    assert xs.tolist() == tokens[:-1].tolist()  # consecutive, non-overlapping, nothing dropped
    assert ys.tolist() == tokens[1:].tolist()
    for x, y in batches:
        assert x.dtype == torch.int64 and x.shape == y.shape and x.shape[0] <= batch_size
        assert x.shape[1] == context or (x.shape[0] == 1 and x is batches[-1][0])
    assert sum(y.numel() for _, y in batches) == n - 1


def test_eval_windows_context_longer_than_validation_split(tmp_path):
    make_wikitext(tmp_path)
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    n = len(corpus["valid"])
    with pytest.raises(tasks.DataError) as info:
        tasks.eval_windows(corpus["valid"], n)  # raised eagerly, before iterating
    assert str(info.value).startswith(f"--context {n} is longer than the validation split ({n} tokens)")
    assert len(list(tasks.eval_windows(corpus["valid"], n - 1))) == 1
    # --eval-context past the split names itself, not --context
    task = tasks.make_task("wikitext2", data_dir=str(tmp_path), context=4, positions="none", eval_context=n)
    with pytest.raises(tasks.DataError, match=f"^--eval-context {n} is longer than the validation split"):
        task.setup()


# ---------------------------------------------------------------------------------------- tasks.py: token cache

def cache_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def test_wikitext_cache_round_trip_and_rebuild(tmp_path, monkeypatch):
    sub = make_wikitext(tmp_path)
    first = tasks.load_lm_corpus("wikitext2", tmp_path)
    cache = tmp_path / "maskprior-cache"
    before = cache_files(cache)
    assert set(before) == {
        "wikitext2-tokens.vocab.json",
        *(f"wikitext2-tokens.{s}.{ext}" for s in ("train", "valid", "test") for ext in ("bin", "json")),
    }
    assert json.loads((cache / "wikitext2-tokens.vocab.json").read_text("utf-8")) == first["vocab"]
    meta = json.loads((cache / "wikitext2-tokens.train.json").read_text("utf-8"))
    assert meta["dtype"] == "uint16" and meta["count"] == len(first["train"])
    assert meta["vocab_size"] == len(first["vocab"])
    assert meta["sources"][0]["size"] == len(WIKI_TRAIN.encode())

    # Second load: no tokenisation at all, cache files untouched.
    def no_tokenising(*args, **kwargs):
        raise AssertionError("re-tokenised although the cache is valid")

    monkeypatch.setattr(tasks, "iter_wikitext_words", no_tokenising)
    second = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert cache_files(cache) == before
    assert second["vocab"] == first["vocab"]
    assert second["train"].tolist() == first["train"].tolist()
    monkeypatch.undo()

    # A changed train file rebuilds vocab and all splits.
    write(sub / "wiki.train.tokens", WIKI_TRAIN + " zebra" * 9 + " \n")
    third = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert third["vocab"][2] == "zebra"
    assert third["valid"].tolist() != first["valid"].tolist()

    # Same size, new mtime: rebuilt too.
    path = sub / "wiki.test.tokens"
    write(path, WIKI_TEST.replace("2000", "film"))  # same size
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    fourth = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "He starred in film ." in fourth["decode"](fourth["test"].tolist())


def test_tinystories_cache_round_trip_and_rebuild(tmp_path, monkeypatch):
    make_tinystories(tmp_path)
    first = tasks.load_lm_corpus("tinystories", tmp_path, chunk_size=5)
    cache = tmp_path / "maskprior-cache"
    before = cache_files(cache)
    assert set(before) == {f"tinystories-v2.{s}.{e}" for s in ("train", "valid") for e in ("bin", "json")}
    assert (cache / "tinystories-v2.train.bin").stat().st_size == 2 * len(first["train"])

    monkeypatch.setattr(tasks, "iter_tinystories_tokens", lambda *a, **k: pytest.fail("re-tokenised"))
    second = tasks.load_lm_corpus("tinystories", tmp_path)
    assert cache_files(cache) == before
    assert second["train"].tolist() == first["train"].tolist()
    monkeypatch.undo()

    write(tmp_path / "TinyStoriesV2-GPT4-valid.txt", "Changed.\n<|endoftext|>\n")
    third = tasks.load_lm_corpus("tinystories", tmp_path)
    assert third["valid"].tolist() == list(b"Changed.") + [256]
    after = cache_files(cache)
    assert after["tinystories-v2.train.bin"] == before["tinystories-v2.train.bin"]  # train not rebuilt
    assert after["tinystories-v2.valid.bin"] != before["tinystories-v2.valid.bin"]


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    make_tinystories(tmp_path)

    def interrupted(path, chunk_size):
        yield np.array([1, 2, 3], dtype=np.uint16)
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks, "iter_tinystories_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tasks.load_lm_corpus("tinystories", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()               # no half file, no temp file, no folder
    monkeypatch.undo()
    assert tasks.load_lm_corpus("tinystories", tmp_path)["train"].tolist() == reference_bytes(STORIES.encode())


def test_fallback_cache_dir_when_data_dir_not_writable(tmp_path, monkeypatch):
    data = make_tinystories(tmp_path / "data")
    write(data / "maskprior-cache", "a file, so the cache folder cannot be created here")
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    corpus = tasks.load_lm_corpus("tinystories", data)
    folders = list((home / ".cache" / "maskprior").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("data-") and len(folders[0].name) == 5 + 16
    assert folders[0] == tasks.default_cache_dirs(data)[1]
    assert (folders[0] / "tinystories-v2.train.bin").is_file()
    assert corpus["train"].tolist() == reference_bytes(STORIES.encode())
    # Another data_dir with the same folder name gets its own cache folder.
    other = make_tinystories(tmp_path / "elsewhere" / "data", train="Other.\n")
    write(other / "maskprior-cache", "blocked")
    assert tasks.load_lm_corpus("tinystories", other)["train"].tolist() == list(b"Other.") + [256]
    assert len(list((home / ".cache" / "maskprior").iterdir())) == 2


def test_explicit_cache_dir(tmp_path):
    make_wikitext(tmp_path / "data")
    tasks.load_lm_corpus("wikitext2", tmp_path / "data", cache_dir=tmp_path / "c")
    assert (tmp_path / "c" / "wikitext2-tokens.train.bin").is_file()
    assert not (tmp_path / "data" / "maskprior-cache").exists()


@pytest.mark.parametrize("corpus", ["cifar10", "wikitext2", "tinystories"])
def test_a_cache_sees_a_source_replaced_with_the_same_size_and_mtime(tmp_path, corpus):
    """A source file replaced by other contents of the same size, its mtime set back (what tar -x, cp -p or
    rsync -t leave): the cache is rebuilt from the new contents, not served stale. A touch alone (same bytes)
    keeps the cache."""
    if corpus == "cifar10":
        x, y = _images(10), np.arange(10) % 10
        datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
        source = tmp_path / "cifar-10-batches-py" / "test_batch"
        load = lambda: tasks.load_image_dataset("cifar10", str(tmp_path))["test"][0]   # noqa: E731
    elif corpus == "wikitext2":
        _write_text_corpus(tmp_path)
        source = tmp_path / "wikitext-2" / "wiki.valid.tokens"
        load = lambda: np.array(tasks.load_lm_corpus("wikitext2", tmp_path)["valid"])   # noqa: E731
    else:
        make_tinystories(tmp_path)
        source = next(tmp_path.rglob("*-valid.txt"))
        load = lambda: np.array(tasks.load_lm_corpus("tinystories", tmp_path)["valid"])   # noqa: E731
    first = load()
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10 ** 9))    # a touch: same bytes
    assert np.array_equal(load(), first)
    st = source.stat()                                # what the cache has seen last
    data = bytearray(source.read_bytes())
    i = len(data) // 2 if corpus == "cifar10" else next(j for j, c in enumerate(data) if chr(c).islower())
    data[i] = (data[i] + 1) % 256 if corpus == "cifar10" else ord("q") if data[i] != ord("q") else ord("z")
    source.write_bytes(bytes(data))                                       # in place, as cp -p does
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source.stat().st_size == st.st_size and source.stat().st_mtime_ns == st.st_mtime_ns
    again = load()
    assert not np.array_equal(again, first)


# ---------------------------------------------------------------------------------------- tasks.py: LMTask

def test_lm_patterns_follow_the_alibi_slopes():
    p = tasks.lm_patterns(300, 4)
    assert p.shape == (4, 300, 300) and not (p & ~mp.causal_pattern(300)).any()
    assert [int(p[h, 299].sum()) for h in range(4)] == [5, 17, 65, 257]      # windows 4, 16, 64, 256
    m = mp.causal_distance_logits(300, 4)
    bias = F.logsigmoid(m)
    assert (bias[p & ~torch.eye(300, dtype=torch.bool)] > -1.0001).all()


@pytest.mark.slow
def test_lm_short_run_lowers_validation_loss_and_samples(tmp_path, capsys):
    _write_text_corpus(tmp_path / "data")
    rc, out = run_train(tmp_path, "--task", "wikitext2", "--data-dir", tmp_path / "data", "--init", "mask",
                        "--steps", "60", "--log-every", "60", "--lr", "3e-3", *LM_SMALL)
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert lines[-1]["metrics"]["val_loss"] < lines[0]["metrics"]["val_loss"] - 0.5
    capsys.readouterr()
    assert train.main(["--out", out, "--sample", "the cat", "--sample-tokens", "5", "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("the cat") and len(text.split()) == 7


@pytest.mark.parametrize("setup,argv,needle", [
    ("none", [], "WikiText-2 not found"),
    ("empty", [], "no tokens"),
    ("small", ["--context", "2000"], "longer than the validation split"),
    ("small", ["--context", "100000"], "longer than the training split"),
    ("small", ["--context", "1"], "--context must be at least 2"),
])
def test_lm_bad_input_exits_2(tmp_path, capsys, setup, argv, needle):
    data = tmp_path / "data"
    data.mkdir()
    if setup == "small":
        _write_text_corpus(data)
    elif setup == "empty":
        (data / "wikitext-2").mkdir()
        for split in ("train", "valid", "test"):
            (data / "wikitext-2" / f"wiki.{split}.tokens").write_text("")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    rc, out = run_train(tmp_path, "--task", "wikitext2", "--data-dir", data, "--steps", "2", *argv,
                        name="new/parents/run")
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "new")                      # no run folder, no parent folder left
    after = sorted(p.relative_to(data) for p in data.rglob("*") if setup != "small" or "maskprior-cache" not in str(p))
    assert after == before                  # no cache of a refused corpus (a good corpus's cache may stay)


# ---------------------------------------------------------------------------------------- tasks.py: fixtures

@pytest.mark.parametrize("held", ["cifar-10-batches-py", "cifar-10-batches-bin", "top-level batches", "wikitext-2",
                                  "wikitext-2-raw", "an empty cifar-10-batches-py"])
def test_make_digits_and_make_wikitext_never_touch_an_existing_dataset(tmp_path, capsys, held, monkeypatch):
    """Over a folder that already holds a data set in any layout the readers read, make-digits and
    make-wikitext refuse in one line and change no file; a write interrupted after three files leaves the
    folder as it was (the new set is written whole in a hidden folder, then moved in)."""
    d = tmp_path / "data"
    d.mkdir()
    if held == "cifar-10-batches-py":
        datafetch.write.write_cifar10_python(str(d), _images(10), np.arange(10), _images(2), np.arange(2))
    elif held == "cifar-10-batches-bin":
        (d / "cifar-10-batches-bin").mkdir()
        (d / "cifar-10-batches-bin" / "data_batch_1.bin").write_bytes(bytes(3073))
    elif held == "top-level batches":
        _py2_pickle(d / "data_batch_1", {b"data": _images(1).reshape(1, -1), b"labels": [1]})
    elif held == "an empty cifar-10-batches-py":
        (d / "cifar-10-batches-py").mkdir()
    else:
        (d / held).mkdir()
        for split in ("train", "valid", "test"):
            (d / held / f"wiki.{split}.{'raw' if held.endswith('raw') else 'tokens'}").write_text(" = A = \n")
    texts = []
    for i in range(12):
        texts.append(tmp_path / f"a{i}.txt")
        texts[-1].write_text(f"Title {i}\n\nSome words of article {i} here, and more words.\n")
    before = _tree(d)
    cifar = "cifar" in held or "batches" in held
    command = ["make-digits", str(d)] if cifar else ["make-wikitext", str(d), *map(str, texts)]
    if cifar:
        monkeypatch.setattr(datafetch.write, "digits_arrays", lambda: (_images(10), np.arange(10), _images(2), np.arange(2)))
    assert train.main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a data set" in err and "never overwritten" in err and len(err.splitlines()) == 1, err
    assert _tree(d) == before and sorted(os.listdir(d)) == sorted({p.split("/")[0] for p in before} | (
        {"cifar-10-batches-py"} if held.startswith("an empty") else set()))
    # an interrupted write into a fresh folder leaves nothing of the new set
    fresh, calls = tmp_path / "fresh", []
    real = runfiles.atomic_write

    def interrupted(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(path, data)
    monkeypatch.setattr(datafetch.write, "atomic_write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train.main(["make-digits", str(fresh)] if cifar else ["make-wikitext", str(fresh), *map(str, texts)])
    assert len(calls) == 3 and os.listdir(fresh) == []


@pytest.mark.slow
def test_make_digits_writes_a_set_the_cifar_reader_reads(tmp_path, capsys):
    """make-digits (scikit-learn's digits) writes a whole CIFAR-10 python release that the reader reads: 1,500
    train and 297 test images, labels 0..9; then a second call over it is refused."""
    _extra("sklearn")
    assert train.main(["make-digits", str(tmp_path / "digits")]) == 0
    assert "wrote 1500 train / 297 test digits" in capsys.readouterr().out
    d = tasks.read_cifar(str(tmp_path / "digits"), "cifar10")
    assert d["train"][0].shape == (1500, 3, 32, 32) and len(d["test"][1]) == 297
    assert set(d["train"][1].tolist()) == set(range(10)) and d["train"][0].max() == 255
    assert sorted(os.listdir(tmp_path / "digits")) == ["cifar-10-batches-py"]
    assert train.main(["make-digits", str(tmp_path / "digits")]) == 2


def test_wikitext_tokenize_and_layout(tmp_path):
    assert datafetch.write.wikitext_tokenize("A well-known 1,000-page book, 3.5 cm.") == \
        ["A", "well", "@-@", "known", "1", "@,@", "000", "@-@", "page", "book", ",", "3", "@.@", "5", "cm", "."]
    arts = [(f"Title {i}", ["the cat sat on the mat .", "the dog sat ."]) for i in range(12)]
    out = datafetch.write.write_wikitext_layout(arts, str(tmp_path))
    text = open(os.path.join(out, "wiki.train.tokens")).read()
    assert text.startswith(" \n = Title <unk> = \n \n the cat sat on the mat . \n \n")
    assert " = Title <unk> = " in open(os.path.join(out, "wiki.valid.tokens")).read()


def test_make_wikitext_needs_a_file_per_split_and_has_help(tmp_path, capsys):
    files = []
    for i in range(5):
        files.append(str(tmp_path / f"a{i}.txt"))
        open(files[-1], "w").write(f"Title {i}\n\nSome words here and there.\n")
    assert train.main(["make-wikitext", str(tmp_path / "out"), *files]) == 2
    assert "at least 12" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "wikitext-2" / "wiki.test.tokens")
    with pytest.raises(SystemExit) as e:
        train.main(["make-wikitext", "--help"])
    assert e.value.code == 0 and "text files" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- datafetch: download

import http.server  # noqa: E402
import tarfile  # noqa: E402
import threading  # noqa: E402



class LoopServer:
    """An HTTP server on 127.0.0.1 for the download tests, serving `files` under a mode: /good/NAME (with Range),
    /cut/NAME (half the bytes, then the connection closes), /stall/NAME (a few bytes, then silence), /e404/, /e500/.
    `ranges` keeps the Range header of each request (None where there was none)."""

    def __init__(self, files):
        self.files, self.ranges = files, []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                _, mode, name = self.path.split("/", 2)
                owner.ranges.append(self.headers.get("Range"))
                if mode in ("e404", "e500") or name not in owner.files:
                    self.send_error(500 if mode == "e500" else 404)
                    return
                data, start = owner.files[name], 0
                if self.headers.get("Range") and mode == "good":
                    start = int(self.headers["Range"].split("=")[1].rstrip("-"))
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if mode == "cut":
                    self.wfile.write(data[:len(data) // 2])
                elif mode == "stall":
                    self.wfile.write(data[:10])
                    self.wfile.flush()
                    time.sleep(3)
                else:
                    self.wfile.write(data[start:])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *a: None          # a client that hung up: no traceback
        self.base = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def loop_server():
    servers = []

    def start(files):
        servers.append(LoopServer(files))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


def _tar_gz(folder: Path, top: str, extra=()) -> bytes:
    """folder/top as a .tar.gz (the CIFAR releases' format), plus `extra` TarInfo members (name, type, data)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        t.add(folder / top, arcname=top)
        for name, kind, data in extra:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), "/etc/passwd" if kind in (tarfile.SYMTYPE,
                                                                                             tarfile.LNKTYPE) else ""
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _zip(folder: Path, top: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(top + "/", "")
        for p in sorted((folder / top).rglob("*")):
            z.write(p, p.relative_to(folder).as_posix())
    return buf.getvalue()


def _entry(name: str, data: bytes, target: str, unpacked: int = 0) -> datafetch.download.File:
    """A File of the test's own checksum table (the pinned ones describe the real releases)."""
    return datafetch.download.File(f"https://example.invalid/{name}", len(data), hashlib.sha256(data).hexdigest(), target,
                   md5=hashlib.md5(data).hexdigest(), max_unpacked=unpacked)


@pytest.fixture
def fixture_sets(tmp_path):
    """({set: (File,)}, {file name: bytes}): CIFAR-10 as its python .tar.gz, WikiText-2's tokens as its .zip and
    TinyStories' two text files, each in its release's exact layout, made small."""
    src = tmp_path / "src"
    _write_layout(src, "cifar10 python")
    make_wikitext(src)
    stories = make_tinystories(src / "ts")
    blobs = {"cifar-10-python.tar.gz": _tar_gz(src, "cifar-10-batches-py"), "wikitext-2-v1.zip": _zip(src, "wikitext-2"),
             "TinyStoriesV2-GPT4-train.txt": (stories / "TinyStoriesV2-GPT4-train.txt").read_bytes(),
             "TinyStoriesV2-GPT4-valid.txt": (stories / "TinyStoriesV2-GPT4-valid.txt").read_bytes()}
    table = {"cifar10": (_entry("cifar-10-python.tar.gz", blobs["cifar-10-python.tar.gz"], "cifar-10-batches-py",
                                1 << 20),),
             "wikitext2": (_entry("wikitext-2-v1.zip", blobs["wikitext-2-v1.zip"], "wikitext-2", 1 << 20),),
             "tinystories": tuple(_entry(n, blobs[n], n) for n in ("TinyStoriesV2-GPT4-train.txt",
                                                                  "TinyStoriesV2-GPT4-valid.txt"))}
    return table, blobs


@pytest.mark.parametrize("name", ["cifar10", "wikitext2", "tinystories"])
def test_download_fetches_checks_and_unpacks_a_set_whole(name, tmp_path, loop_server, fixture_sets, capsys):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    assert datafetch.download.download([name], str(data), server.base + "/good", table) == 0
    assert tasks.TASKS[name].locate(str(data))                     # its reader finds it, where reproduce.sh looks
    assert sorted(os.listdir(data)) == sorted(f.target for f in table[name])    # no .part, no staging folder left
    out = capsys.readouterr().out
    assert "100%" in out and out.count("%  ") <= 10 * len(table[name]) and "is in place" in out
    assert datafetch.download.download([name], str(data), server.base + "/e404", table) == 0          # there: no request made
    assert "already there; left as it is" in capsys.readouterr().out and len(server.ranges) == len(table[name])


def test_download_refuses_a_corrupt_file_naming_both_sums_and_keeps_nothing(tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    bad = bytearray(blobs["cifar-10-python.tar.gz"])
    bad[len(bad) // 2] ^= 0xFF
    server, data = loop_server({"cifar-10-python.tar.gz": bytes(bad)}), tmp_path / "data"
    (data / "notes").mkdir(parents=True)
    before = _tree(data)
    with pytest.raises(tasks.DataError) as e:
        datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    text = str(e.value)
    assert hashlib.sha256(bytes(bad)).hexdigest() in text and table["cifar10"][0].sha256 in text and "\n" not in text
    assert _tree(data) == before


def test_download_cut_short_resumes_from_its_part_with_a_range_request(tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    size = len(blobs["cifar-10-python.tar.gz"])
    with pytest.raises(tasks.DataError, match="run the same command again to resume"):
        datafetch.download.download(["cifar10"], str(data), server.base + "/cut", table)
    assert os.listdir(data) == ["cifar-10-python.tar.gz.part"]
    assert (data / "cifar-10-python.tar.gz.part").stat().st_size == size // 2
    datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    assert server.ranges == [None, f"bytes={size // 2}-"] and os.listdir(data) == ["cifar-10-batches-py"]
    assert tasks.read_cifar(str(data), "cifar10")["train"][0].shape[0] == 10


@pytest.mark.parametrize("kind", ["link to a user's file", "link to nowhere", "folder"])
def test_download_never_writes_through_a_part_that_is_not_its_own(kind, tmp_path, loop_server, fixture_sets):
    """Issue 64's data loss: a .part that is a link (to a user's file, or dangling) or a folder is not a download
    of ours: refused in one line before any byte is fetched, the user's file and the link as they were (it
    used to be appended to, and the message said the part was deleted)."""
    table, blobs = fixture_sets
    server, data, user = loop_server(blobs), tmp_path / "data", tmp_path / "user.txt"
    data.mkdir()
    user.write_bytes(b"the user's own words\n")
    part = data / "wikitext-2-v1.zip.part"
    if kind == "folder":
        part.mkdir()
    else:
        part.symlink_to(user if kind.endswith("user's file") else tmp_path / "absent")
    before, words = _tree(data), user.read_bytes()
    with pytest.raises(tasks.DataError, match=r"wikitext-2-v1.zip.part is a link or not a regular file, so not a "
                                              r"download of ours; nothing was written or removed") as err:
        datafetch.download.download(["wikitext2"], str(data), server.base + "/cut", table)
    assert "\n" not in str(err.value) and server.ranges == []                # refused before a request
    assert _tree(data) == before and user.read_bytes() == words and not (tmp_path / "absent").exists()
    assert os.path.islink(part) == (kind != "folder")


@pytest.mark.parametrize("member", [("cifar-10-batches-py/../../evil", tarfile.REGTYPE, b"x"),
                                    ("/tmp/evil", tarfile.REGTYPE, b"x"),
                                    ("cifar-10-batches-py/link", tarfile.SYMTYPE, b""),
                                    ("cifar-10-batches-py/hard", tarfile.LNKTYPE, b""),
                                    ("cifar-10-batches-py/dev", tarfile.CHRTYPE, b""),
                                    ("elsewhere/file", tarfile.REGTYPE, b"x"),
                                    ("cifar-10-batches-py/big", tarfile.REGTYPE, b"\0" * (1 << 20))])
def test_download_refuses_an_unsafe_archive_and_leaves_the_folder_as_it_was(member, tmp_path, loop_server):
    src, data = tmp_path / "src", tmp_path / "data"
    _write_layout(src, "cifar10 python")
    blob = _tar_gz(src, "cifar-10-batches-py", [member])
    table = {"cifar10": (_entry("cifar-10-python.tar.gz", blob, "cifar-10-batches-py", 1 << 20),)}
    server = loop_server({"cifar-10-python.tar.gz": blob})
    data.mkdir()
    with pytest.raises(tasks.DataError, match="refused, nothing unpacked"):
        datafetch.download.download(["cifar10"], str(data), server.base + "/good", table)
    assert os.listdir(data) == [] and not (tmp_path / "evil").exists()


@pytest.mark.parametrize("mode, words", [("e404", "HTTP 404"), ("e500", "HTTP 500"), ("stall", "stopped at 10 of")])
def test_download_server_errors_and_stalls_are_one_line(mode, words, tmp_path, loop_server, fixture_sets):
    table, blobs = fixture_sets
    server, data = loop_server(blobs), tmp_path / "data"
    t0 = time.monotonic()
    with pytest.raises(tasks.DataError, match=words) as e:
        datafetch.download.download(["cifar10"], str(data), f"{server.base}/{mode}", table, timeout=0.5)
    assert "\n" not in str(e.value) and time.monotonic() - t0 < 2.5
    assert (os.listdir(data) == ["cifar-10-python.tar.gz.part"]) if mode == "stall" else not data.exists()


def test_download_command_wiring_refusals_and_the_lock(tmp_path, loop_server, capsys):
    data = tmp_path / "data"
    server = loop_server({})
    assert train.main(["download", "cifar10", "--data", str(data), "--from", server.base + "/e404"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "HTTP 404" in err and f"{server.base}/e404/cifar-10-python.tar.gz" in err
    assert train.main(["download", "imagenet100", "--data", str(data)]) == 2
    assert "python train.py imagenet100 --from" in capsys.readouterr().err and not data.exists()
    data.mkdir()
    fd = os.open(data, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert train.main(["download", "wikitext2", "--data", str(data), "--from", server.base + "/good"]) == 75
        assert "another download" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert os.listdir(data) == []


def test_progress_draws_a_bar_on_a_terminal_and_lines_in_a_log():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        p = datafetch.download.Progress(1000, 0, stream)
        for got in range(50, 1001, 50):
            p.update(got)
        p.done()
    assert "\r  [" in tty.getvalue() and "MiB/s" in tty.getvalue() and "ETA" in tty.getvalue()
    assert log.getvalue().count("\n") == 10 and "\r" not in log.getvalue() and " 100%" in log.getvalue()


def test_pinned_sources_name_their_sums_and_the_readers_folders():
    for name, files in datafetch.download.SOURCES.items():
        for f in files:
            assert len(f.sha256) == 64 and f.size > 0 and f.url.endswith("/" + f.name)
            assert (f.md5 is not None) == name.startswith("cifar") or name == "wikitext2"
    assert [f.target for f in datafetch.download.SOURCES["wikitext2"]] == [tasks.WIKITEXT_RELEASES[r][0] for r in ("tokens", "raw")]


# ---- imagenet100: the 100 classes from an ImageNet-1k folder

def _imagenet1k(root: Path, skip=()) -> Path:
    for split in ("train", "val"):
        for w in tasks.IMAGENET100_WNIDS + ("n99999999",):             # one class not of the 100
            if (split, w) not in skip:
                write(root / split / w / f"{w}_{split}.JPEG", f"{split} {w}")
    return root


def test_imagenet100_builds_the_tree_with_hard_links(tmp_path):
    src, data = _imagenet1k(tmp_path / "in1k"), tmp_path / "data"
    line = datafetch.imagenet100.build(str(src), str(data))
    assert "200 images, hard links" in line and os.listdir(data) == ["imagenet100"]
    assert tasks.imagenet100_layout(str(data / "imagenet100")) == "folder"
    assert sorted(os.listdir(data / "imagenet100" / "val")) == sorted(tasks.IMAGENET100_WNIDS)
    w = tasks.IMAGENET100_WNIDS[5]
    assert os.path.samefile(data / "imagenet100" / "train" / w / f"{w}_train.JPEG", src / "train" / w / f"{w}_train.JPEG")
    assert "already there; left as it is" in datafetch.imagenet100.build(str(src), str(data))


def test_imagenet100_copies_where_links_are_refused(tmp_path, monkeypatch):
    src, data = _imagenet1k(tmp_path / "in1k"), tmp_path / "data"

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device link")
    monkeypatch.setattr(datafetch.imagenet100.os, "link", refuse)
    assert "0 hard links, 200 copies" in datafetch.imagenet100.build(str(src), str(data))
    w = tasks.IMAGENET100_WNIDS[0]
    assert (data / "imagenet100" / "val" / w / f"{w}_val.JPEG").read_text() == f"val {w}"


@pytest.mark.parametrize("case", ["missing class", "empty class", "a symlink"])
def test_imagenet100_refuses_an_incomplete_source_and_builds_nothing(case, tmp_path):
    w = tasks.IMAGENET100_WNIDS[7]
    src = _imagenet1k(tmp_path / "in1k", skip={("val", w)} if case == "missing class" else ())
    if case == "empty class":
        (src / "val" / w / f"{w}_val.JPEG").unlink()
    if case == "a symlink":
        os.symlink("/etc/hostname", src / "train" / w / "x.JPEG")
    data = tmp_path / "data"
    data.mkdir()
    with pytest.raises(tasks.DataError, match="nothing built"):
        datafetch.imagenet100.build(str(src), str(data))
    assert os.listdir(data) == []
    assert train.main(["imagenet100", "--from", str(src), "--data", str(data)]) == 2


# ---------------------------------------------------------------------------------------- train.py: config

def test_every_flag_has_one_default_and_every_preset_key_is_a_flag():
    """Two layers over DEFAULTS: a preset entry must name a flag (a typo would be silently ignored), and every
    flag must parse to UNSET when not given, so that the preset, not a parser default, fills it."""
    args, explicit = train.parse_args([])
    dests = set(vars(args)) - {"command"}
    assert explicit == set() and dests == set(runconfig.DEFAULTS)
    assert all(getattr(args, d) is train.UNSET for d in dests)
    for name, cls in tasks.TASKS.items():
        for preset in cls.presets():
            assert set(cls.preset(preset)) <= set(runconfig.DEFAULTS) - {"task", "init", "preset"}, (name, preset)
        assert {o for o in cls.options() if o in runconfig.FIELDS} <= runconfig.TASK_FLAGS | {"heads"}, name


@pytest.mark.parametrize("argv, needle", [
    (["--init", "mask", "--init", "default"], "--init is given twice ('mask', then 'default')"),
    (["--steps", "5", "--steps", "5"], "--steps is given twice (5, then 5)"),
    (["--resume", "--resume"], "--resume is given twice"),
    (["--ini", "mask", "--init", "default"], "--init is given twice ('mask', then 'default')"),
    (["--lr=1e-3", "--lr", "1e-2"], "--lr is given twice (0.001, then 0.01)"),
])
def test_a_flag_given_twice_is_refused(tmp_path, capsys, argv, needle):
    assert train.main([*argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and not (tmp_path / "run").exists(), err


def test_epochs_flag_sets_steps(tmp_path):
    rc, out = run_train(tmp_path, "--task", "kparity", "--bits", "0,1", "--unseen", "0,1", "--n-bits", "6",
                        "--epochs", "2", "--batch-size", "16", *SMALL[:-4])
    assert rc == 0
    assert json.load(open(os.path.join(out, "result.json")))["steps"] == 2 * 3     # 48 seen points / 16


# Where each flag applies, generated from the Config table (runconfig.NEEDS, runconfig.EXCLUDES, the task options): every
# (flag, condition) pair gets a context that meets the flag's other conditions and breaks this one, so a flag added
# to the table is tested here without a new test.
APPLY_TASKS = ("parity2", "kparity", "addition", "multiplication", "cifar10", "wikitext2")


def _flag_value(name: str) -> list:
    """A value the flag parses (its default, else its first choice, else 1), as argv."""
    m, default = runconfig.FIELDS[name].metadata, runconfig.FIELDS[name].default
    if m["switch"]:
        return []
    value = default if default not in (None, False, True) else (m["choices"] or [1])[0]
    return [str(value)]


def _applicability_cases() -> list:
    cases = [(name, key) for name, needs in runconfig.NEEDS.items() for key in needs]
    cases += [(name, f"excludes {other}") for name, excluded in runconfig.EXCLUDES.items() for other in excluded]
    return cases + [(name, "task option") for name in sorted(runconfig.TASK_FLAGS)]


def _resolved(argv):
    return runconfig.resolve(*train.parse_args(argv))


def _context(name: str, broken: str | None, data: str) -> list:
    """argv giving --NAME where all it needs holds (and, transitively, all that the flags added for it need) except
    `broken` (None: everything holds)."""
    needs = runconfig.NEEDS.get(name, {})
    def fits(task):
        cls = tasks.TASKS[task]
        takes = name not in runconfig.TASK_FLAGS or name in cls.options()
        kind_ok = "kind" not in needs or cls.KIND in needs["kind"]
        if broken == "task option":
            return not takes
        return takes and (not kind_ok if broken == "kind" else kind_ok)
    task = next(t for t in APPLY_TASKS if fits(t))
    cls = tasks.TASKS[task]
    argv = ["--task", task] + (["--data-dir", data] if cls.KIND in ("vision", "lm") else [])
    def give(key, value):
        argv.extend(["--" + key.replace("_", "-"), *([str(value)] if value is not None else _flag_value(key))])
    def meet(flag, skip=None):
        for key, allowed in runconfig.NEEDS.get(flag, {}).items():
            if key in (skip, "kind") or not runconfig.unmet(key, allowed, runconfig.applied_value(_resolved(argv), key)):
                continue
            choices = cls.inits() if key == "init" else cls.PATTERNS if key == "pattern" else allowed
            give(key, "9" if allowed == runconfig.ON else None if allowed == runconfig.GIVEN else
                 next(v for v in allowed if v in choices))
            meet(key)
    if broken != "task option":
        if broken in needs and isinstance(needs[broken], tuple) and broken != "kind":
            choices = cls.inits() if broken == "init" else cls.PATTERNS if broken == "pattern" else \
                runconfig.FIELDS[broken].metadata["choices"]
            give(broken, next(v for v in choices if v not in needs[broken]))
            meet(broken)
        meet(name, skip=broken)
        if broken and broken.startswith("excludes "):
            give(broken.split()[1], None)
            meet(broken.split()[1])
    give(name, None)
    return argv


@pytest.mark.parametrize("name,broken", _applicability_cases())
def test_every_flag_given_where_it_does_not_apply_is_refused(tmp_path, capsys, name, broken):
    """Each flag given where one of its conditions fails (another family's task, an init, pattern or teacher kind it
    does not go with, a flag it needs left out, a flag it excludes given) is one line naming it, exit 2, nothing
    written; in the same context with that condition met the one check passes it."""
    bad = _context(name, broken, str(tmp_path))
    rc, out = run_train(tmp_path, *bad)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"--{name.replace('_', '-')} " in err, (bad, err)
    assert not os.path.exists(out)
    if not broken.startswith(("excludes ", "task option")):
        good = _context(name, None, str(tmp_path))
        runconfig.check(_resolved(good), train.parse_args(good)[1], rules=False)


def test_the_flag_table_names_real_inits_and_fields():
    """The table's init lists are inits of the INITS table, and every `needs` key is a field or the task's kind."""
    for group in (runconfig.MASK_INITS, runconfig.PRIOR_INITS, runconfig.QK_SVD_INITS):
        assert set(group) <= set(runconfig.INITS)
    assert set(runconfig.PRIOR_INITS) == {n for n, i in runconfig.INITS.items() if i.reads_prior}
    for name, needs in runconfig.NEEDS.items():
        assert set(needs) <= set(runconfig.FIELDS) | {"kind"}, name
        assert all(isinstance(a, tuple) or a in (runconfig.GIVEN, runconfig.ON) for a in needs.values()), name


def test_task_flags_of_another_family_are_refused(tmp_path, capsys):
    for argv, needle in [(["--task", "parity2", "--train-size", "100"], "--train-size does not apply to task parity2"),
                         (["--task", "addition", "--readout", "mean"], "--readout does not apply to task addition"),
                         (["--task", "parity2", "--data-frac", "0.1"], "--data-frac does not apply"),
                         (["--task", "wikitext2", "--data-dir", ".", "--init", "mask", "--mask-on", "3"],
                          "--mask-on applies only to the boolean and arithmetic and vision tasks")]:
        rc, out = run_train(tmp_path, *argv)
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert not os.path.exists(out)


def test_presets_say_model_size_and_recipe_apart(monkeypatch):
    """Every preset is a model part (architecture flags only) and a recipe part (no architecture flag); the
    flat preset is their union, and a preset with anything else in it is an error, not ignored."""
    for name, cls in tasks.TASKS.items():
        for preset in cls.presets():
            model, recipe = cls.preset_parts(preset)
            assert set(model) <= runconfig.ARCH and not set(recipe) & runconfig.ARCH, (name, preset, model, recipe)
            assert cls.preset(preset) == {**model, **recipe}
    assert tasks.TASKS["cifar10"].preset_parts("paper")[0]["input_size"] == 224
    monkeypatch.setitem(tasks.Addition.PRESETS, "small", dict(steps=10))          # the flat form of before
    with pytest.raises(ValueError, match=r"Addition.PRESETS\['small'\] holds \['steps'\]; a preset has a 'model'"):
        tasks.Addition.preset("small")


def test_an_explicit_flag_beats_the_preset_and_its_alternative(monkeypatch):
    resolve = lambda *argv: runconfig.resolve(*train.parse_args(list(argv)))  # noqa: E731
    monkeypatch.setitem(tasks.Multiplication.PRESETS, "small", {"model": dict(answer_order="lsb", impulse="random"),
                                                             "recipe": dict(steps=6000)})
    args = resolve("--task", "multiplication")
    assert (args.answer_order, args.impulse, args.steps, args.lr) == ("lsb", "random", 6000, 1e-3)
    assert resolve("--task", "multiplication", "--answer-order", "msb").answer_order == "msb"
    assert (resolve("--task", "addition").answer_order, resolve("--task", "addition").impulse) == ("msb", "fixed")
    # steps / epochs and warmup / warmup_epochs: the explicit one wins, the preset's other one is dropped
    vision = resolve("--task", "cifar10", "--warmup", "7")
    assert (vision.warmup, vision.warmup_epochs, vision.epochs) == (7, None, 30)
    assert resolve("--task", "cifar10").warmup_epochs == 2
    assert (resolve("--task", "cifar10", "--steps", "5").epochs, resolve("--task", "cyclic3", "--epochs", "2").steps) \
        == (None, None)
    with pytest.raises(train.UsageError, match="either --warmup or --warmup-epochs"):
        resolve("--task", "cifar10", "--warmup", "7", "--warmup-epochs", "1")


def test_explicit_warmup_on_an_image_task_is_the_warmup_used(tmp_path, image_dir):
    """An explicit --warmup on cifar10 once gave way to the preset's warm-up epochs (the run wrote 32)."""
    out = str(tmp_path / "run")
    assert train.main(["--task", "cifar10", "--data-dir", image_dir, "--steps", "2", "--warmup", "7", "--layers",
                       "1", "--dim", "24", "--mlp-dim", "48", "--out", out]) == 0
    args = json.load(open(os.path.join(out, "args.json")))
    assert (args["warmup"], args["warmup_epochs"]) == (7, None)


def test_the_paper_vision_preset_is_the_recipe_and_the_old_one_is_paper32(tmp_path, image_dir):
    args = runconfig.resolve(*train.parse_args(["--task", "cifar10", "--data-dir", image_dir, "--preset", "paper"]))
    want = dict(patch_size=16, input_size=224, pool="cls", epochs=300, batch_size=512, lr=2e-3, weight_decay=0.05,
                warmup_epochs=50, randaug=9.0, randaug_std=0.5, mixup=0.8, cutmix=1.0, reprob=0.25,
                label_smoothing=0.1, drop_path=0.1, crop="rrc", ema=0.0, grad_clip=0.0)
    assert {k: getattr(args, k) for k in want} == want
    task = runconfig.task_for(args)
    assert task.pattern().shape == (3, 197, 197)                # 14 x 14 patches and the class token
    old = runconfig.resolve(*train.parse_args(["--task", "cifar10", "--data-dir", image_dir, "--preset", "paper32"]))
    assert (old.patch_size, old.input_size, old.epochs) == (2, None, 200)


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
    (["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--data-frac", "0.3"],
     "leave --data-frac out"),
    (["--task", "multiplication", "--digits", "2", "--lee-samples", "99"],
     "--lee-samples must be an integer in 100 .."),
    (["--task", "multiplication", "--digits", "2", "--lee-samples", "0"], "--lee-samples must be an integer in 100 .. 10,000"),
    (["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--init", "qk-svd"],
     "which a QK prior fitted on fixed positions cannot follow"),
    (["--task", "multiplication", "--digits", "2", "--lee-samples", "3000", "--pattern", "partial"],
     "with --lee-samples has no pattern 'partial'"),
    (["--task", "addition", "--lee-samples", "3000"], "--lee-samples does not apply to task addition"),
    (["--task", "kparity", "--bits", "0,40"], "--bits: '40' is not an integer in 0..14"),
    (["--task", "kparity", "--bits", "random:15", "--unseen", "bits:2"], "is a least-squares problem in 32,768 monomials"),
    (["--task", "kmajority", "--bits", "random:11", "--n-bits", "15"], "at most 1,024 are solved"),
    (["--task", "kmajority", "--train-size", "-1"], "--train-size must be a positive number"),
    (["--task", "kmajority", "--train-size", "0"], "--train-size must be a positive number"),
    (["--task", "kmajority", "--bits", "1,4,8,10,13", "--unseen", "1,4", "--train-size", "12", "--init", "mask",
      "--pattern", "discovered"], "too few points to find a pattern in"),
    (["--task", "ksum", "--terms", "0,1:m2,3,4", "--readout", "mean", "--train-size", "60", "--init", "mask",
      "--pattern", "discovered", "--discover-degree", "1"], "names no pair of tokens beyond each token itself"),
    (["--task", "ksum", "--terms", "0,1:0,1"], "the term '0,1' is given twice"),
    (["--init", "mask", "--prior-from", "nowhere", "--teacher-min-fit", "1.5"],
     "--teacher-min-fit must be a finite number in [0, 1]"),
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
    (["--task", "wikitext2", "--data-dir", ".", "--positions", "none", "--init", "qk-svd"],
     "--init qk-svd fits its pattern on the positional embedding, which --positions none leaves out"),
    (["--task", "wikitext2", "--data-dir", ".", "--positions", "none", "--eval-context", "128", "--init", "mask",
      "--mask-param", "full"], "which a full M (N x N) cannot serve: give --mask-param relative"),
    (["--task", "wikitext2", "--data-dir", ".", "--init", "mask", "--mask-off", "3"],
     "--mask-off applies only to the boolean and arithmetic and vision tasks (this task is lm)"),
    (["--task", "parity2", "--train-size", "100"], "--train-size does not apply to task parity2"),
    (["--task", "parity2", "--data-frac", "0.1"], "--data-frac does not apply"),
    (["--task", "addition", "--data-frac", "2"], "--data-frac must be in (0, 1]"),
    (["--sample", "hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--sample", "hi"], "--sample: no checkpoint"),
    (["--resume"], "--resume: no checkpoint"),
]


if torch.backends.mps.is_available():                   # the machine has the Apple GPU that case asks for
    BAD_INPUT.remove((["--device", "mps"], "torch sees no Apple GPU"))


def _users_folder(path) -> Path:
    """A folder holding a user's files and no run: an args.json, a metrics.jsonl and a note (`abandon` once deleted
    the first two on a refusal)."""
    path.mkdir(parents=True)
    (path / "args.json").write_text("{}")
    (path / "metrics.jsonl").write_text("log\n")
    (path / "notes.txt").write_text("x")
    return path


@pytest.mark.parametrize("argv,needle", BAD_INPUT)
@pytest.mark.parametrize("held", [False, True], ids=["new out", "out holding a user's files"])
def test_bad_input_exits_2(tmp_path, capsys, argv, needle, held):
    """Each bad input is one line and exit 2, and a refusal writes nothing and deletes nothing: a new --out is not
    made, and an --out that holds a user's files (but no run) keeps them byte for byte."""
    before = _tree(_users_folder(tmp_path / "run")) if held else None
    with _deadline(60):                          # a refusal comes at once (an exact MDI too large is refused, not run)
        rc, out = run_train(tmp_path, *argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert _tree(out) == before if held else not os.path.exists(out)       # nothing written, nothing deleted


# Every task option the task checks, given out of range (nan and inf where it is a float): one line naming the
# flag, exit 2, nothing written. The task's constructor is the one check (train.py's Config declares no range or
# choices for these), so each case here fails if that check goes.
TASK_CHECKED = [("kparity", "--discover-degree", ("0", "5")), ("kparity", "--discover-threshold", ("nan", "inf", "0", "1.5")),
                ("kparity", "--discover-alpha", ("nan", "0", "0.0001", "0.9")),
                ("ksum", "--terms", ("0,1:m2,3", "0,0", "0,1:1,0", "0,99", "", "m")),
                ("kparity", "--n-bits", ("1", "21")), ("kparity", "--train-size", ("0",)), ("parity2", "--readout", ("tokens",)),
                ("addition", "--digits", ("0", "5")), ("addition", "--data-frac", ("nan", "inf", "0", "1.5")),
                ("addition", "--answer-order", ("mid",)), ("addition", "--discover-alpha", ("nan", "-1", "1")),
                ("multiplication --digits 2", "--lee-samples", ("0", "99", "10001")),
                ("cifar10", "--soft-alpha", ("nan", "inf", "0")), ("cifar10", "--window", ("0", "2")),
                ("cifar10", "--crop-pct", ("nan", "0", "1.5")), ("cifar10", "--randaug", ("nan", "inf", "-1", "11")),
                ("cifar10", "--randaug-ops", ("0",)), ("cifar10", "--reprob", ("nan", "-0.1", "1.5")),
                ("cifar10", "--impulse", ("diagonal",)), ("cifar10", "--crop", ("centre",)),
                ("wikitext2", "--val-tokens", ("-1",)), ("wikitext2", "--context", ("1",)),
                ("wikitext2", "--positions", ("sinusoid",)), ("wikitext2", "--eval-context", ("-1", "1", "65")),
                ("wikitext2 --init mask", "--mask-window", ("0", "65"))]
CONFIG_CHECKED_TASK_OPTIONS = {"image_size", "input_size", "patch_size", "pool", "label_smoothing", "mixup", "cutmix",
                               "randaug_std"}       # options no task checks: Config's range is their one check


@pytest.mark.parametrize("task,flag,bad", [(t, f, b) for t, f, bads in TASK_CHECKED for b in bads])
def test_a_task_option_out_of_range_is_one_line_from_its_one_check(tmp_path, capsys, task, flag, bad):
    data = tmp_path / "data"
    data.mkdir()
    where = ["--data-dir", str(data)] if task.split()[0] in ("cifar10", "wikitext2") else []
    rc, out = run_train(tmp_path, "--task", *task.split(), *where, flag, bad)
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(out) and os.listdir(data) == []


def test_task_options_are_declared_once():
    """A task option's range lives in its task (checked above) or, where no task checks it, in its Config field,
    never both; its Config default is its task's default (a preset may then set it)."""
    both = {n for n in runconfig.TASK_FLAGS if runconfig.FIELDS[n].metadata["check"] or runconfig.FIELDS[n].metadata["choices"]}
    assert both == CONFIG_CHECKED_TASK_OPTIONS
    checked = {f[2:].replace("-", "_") for _, f, _ in TASK_CHECKED}
    unchecked = runconfig.TASK_FLAGS - checked - both - {"bits", "unseen", "data_dir"}
    assert unchecked == set(), f"task options with no range test: {sorted(unchecked)}"
    for name, cls in tasks.TASKS.items():
        params = {**inspect.signature(cls.build).parameters, **inspect.signature(cls).parameters}
        for option in set(cls.options()) & runconfig.TASK_FLAGS:
            if runconfig.DEFAULTS[option] is not None:
                assert runconfig.DEFAULTS[option] == params[option].default, (name, option)


def _checked_fields():
    """(flag, argv, message) for every range-checked Config field: a non-finite value and an out-of-range one."""
    cases = []
    for name, f in runconfig.FIELDS.items():
        check, kind = f.metadata["check"], f.metadata["type"]
        if check is None:
            continue
        flag = "--" + name.replace("_", "-")
        if kind is None:                                    # a string the check parses (--betas)
            cases += [(flag, [flag, bad], f"{flag} must be") for bad in ("0.9", "1,0.5", "nan,0.9", "a,b", "")]
            continue
        out_of_range = {"positive": ["0"], "non_negative": ["-1"], "fraction": ["1", "-3"], "unit": ["1.5", "-3"],
                        "seed": ["-1", str(2 ** 32)], "gain": ["0", "2e6"], "gain0": ["-1", "2e6"]}[check]
        for bad in ["nan", "inf", *out_of_range]:
            if kind is int and bad in ("nan", "inf"):
                cases.append((flag, [flag, bad], f"argument {flag}: invalid int value: '{bad}'"))
            else:
                what = "an integer" if kind is int else "a finite number"
                cases.append((flag, [flag, bad], f"{flag} must be {what}"))
    return cases


@pytest.mark.parametrize("flag, argv, message", _checked_fields(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_checked_field_refuses_non_finite_and_out_of_range_values(tmp_path, capsys, flag, argv, message):
    """Each field with a range check, given nan, inf and a value below (or, for a fraction, at or above) its
    range: one line naming the flag, exit 2, nothing written."""
    out = tmp_path / "parent" / "run"
    assert train.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "parent").exists()


def test_the_checked_fields_are_the_config_s():
    """The list above covers every range-checked field (52 and counting), each with a nan, an inf and an
    out-of-range case."""
    checked = {n for n, f in runconfig.FIELDS.items() if f.metadata["check"]}
    assert {flag[2:].replace("-", "_") for flag, _, _ in _checked_fields()} == checked and len(checked) >= 40


# text a fuzzer gives a flag: numbers in and out of range, other scripts' digits, '_' in numbers, huge, empty
FLAG_TEXT = st.one_of(st.sampled_from(["0", "-1", "1", "3", "0.5", "1e308", "-1e308", "nan", "inf", "1_0", "\u0661\u0660",
                                       "\uff13", "", " ", "x", "mask", "auto", "cls", "0,4", "9" * 400, "1e-400"]),
                      st.text(max_size=8))


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@fuzz(task=st.sampled_from(("parity2", "kparity", "addition", "cyclic3")),
       pairs=st.lists(st.tuples(st.sampled_from(sorted(runconfig.FIELDS)), FLAG_TEXT), max_size=4))
@example(task="parity2", pairs=[("batch_size", "9" * 400)])         # found by it: an int past float's range
def test_fuzz_train_flags_make_a_checked_config_or_one_line(task, pairs):
    """Any flags of the table with any text: parsed (one ASCII parser, each flag once), resolved and checked
    (`runconfig.check`, the task built) to a Config, or one line (UsageError); never another exception."""
    argv = ["--task", task] + [w for name, text in pairs for w in ("--" + name.replace("_", "-"), text)]
    try:
        flags, explicit = train.parse_args([w for w in argv if w != "--resume"])
        runconfig.check(runconfig.resolve(flags, explicit), explicit)
    except runfiles.UsageError as e:
        assert str(e) and "\n" not in str(e).strip(), argv


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@fuzz(command=st.sampled_from(sorted(train.SUBCOMMANDS)), words=st.lists(st.one_of(
    FLAG_TEXT, st.sampled_from(["--data", "--from", "--timeout", "--out", "--help-me", "-x"])), max_size=5))
@example(command="download", words=["x", "--timeout", "1_0"])
@example(command="download", words=["x", "--data", "a", "--data", "b"])
def test_fuzz_every_command_s_flags_parse_or_say_one_line(command, words):
    """Every command's arguments (SUBCOMMANDS) with any words: a namespace, or one line (UsageError) where a flag
    is unknown, given twice, or a number is not ASCII digits; never another exception."""
    try:
        flags, _ = train.parse_args([command, *words])
    except runfiles.UsageError as e:
        assert str(e) and "\n" not in str(e).strip(), words
        return
    for option in ("--timeout", "--data", "--from"):
        assert words.count(option) <= 1 or command not in ("download", "imagenet100")


@pytest.mark.parametrize("command", ["train", *train.SUBCOMMANDS])
def test_each_command_refuses_a_flag_twice_and_numbers_in_other_scripts(command, capsys):
    """By construction (the parser gives every option the one `Once` action and every number the one ASCII
    parser): for each command, each option given twice is one line, and a number option refuses '1_0' and '\u0661'."""
    parser = train.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    options = [a for a in sub._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    for action in options:
        flag, number = action.option_strings[0], action.type is not None and action.type.__name__ in ("int", "float")
        assert isinstance(action, train.Once), (command, action.dest)
        value = [] if action.nargs == 0 else [str((action.choices or ["1" if number else "a"])[0])]
        with pytest.raises(runfiles.UsageError, match=f"{flag} is given twice"):
            train.parse_args([command, flag, *value, flag, *value])
        for bad in ("1_0", "\u0661") if number else ():
            with pytest.raises(runfiles.UsageError, match="invalid"):
                train.parse_args([command, flag, bad])
    assert train.parse_args(["train", "--task", "cyclic3"]) == train.parse_args(["--task", "cyclic3"])


def _but(argv, *changes):
    """argv with the flags of `changes` (flag, value, flag, value, ...) set to these values: replaced where argv
    has them, added where not (train.py refuses a flag given twice)."""
    argv = list(map(str, argv))
    for flag, value in zip(changes[::2], changes[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = str(value)
        else:
            argv += [flag, str(value)]
    return argv


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2 ** 32, 2 ** 40, 2 ** 64, -1])
def test_seeds_torch_cannot_take_are_refused(tmp_path, capsys, trained_once, seed):
    assert train.main([*RUN24, "--seed", str(seed), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "--seed must be an integer in 0 .. 4294967295" in err and str(seed) in err
    assert not os.path.exists(tmp_path / "run")
    _train(tmp_path / "top", *_but(RUN24, "--steps", 2), "--seed", 2 ** 32 - 1, once=trained_once)     # the top seed


@pytest.mark.parametrize("flag,value,needle", [
    ("--randaug", "11", "--randaug must be a magnitude in [0, 10]"),
    ("--reprob", "2", "--reprob must be a probability in [0, 1]"),
    ("--ema", "1", "--ema must be a finite number in [0, 1)"),
    ("--ema", "-0.5", "--ema must be a finite number"),
    ("--drop-path", "1", "--drop-path must be a finite number in [0, 1)"),
    ("--input-size", "50", "--input-size 50 (the model's image side) is not a multiple of --patch-size 4"),
    ("--crop-pct", "1.5 --input-size 48", "--crop-pct must be in (0, 1]"),
    ("--randaug-ops", "0 --randaug 9", "--randaug-ops must be at least 1"),
])
def test_recipe_bad_input_is_one_line(tmp_path, capsys, image_dir, flag, value, needle):
    out = tmp_path / "run"
    assert train.main(["--task", "cifar10", "--data-dir", image_dir, flag, *value.split(), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1 and not out.exists(), err


# ---------------------------------------------------------------------------------------- train.py: build

def test_vit_mlp_width_is_the_flag_given():
    """--dim 88 --mlp-dim 120 once built 119 hidden units (a ratio round-trip)."""
    args = runconfig.resolve(*train.parse_args(["--task", "cifar10", "--data-dir", ".", "--dim", "88", "--mlp-dim", "120",
                                            "--heads", "4"]))
    task = tasks.make_task("cifar10", data_dir=".", heads=4)
    model = mp.ViT(train.model_config(args, task))
    assert model.cfg.mlp_dim == 120 and model.blocks[0].mlp[0].out_features == 120


@pytest.mark.parametrize("pattern", ["impulse", "soft"])
def test_mask_impulse_is_impulse_with_the_pattern_moved_into_the_logits(image_dir, pattern):
    """--init mask-impulse: impulse's positions x18 and its mimetic V-proj (the calls init_impulse makes), M as
    --init mask sets it, Wq Wk as drawn (impulse solves them): only where the pattern lives differs."""
    argv = ["--task", "cifar10", "--data-dir", image_dir, "--layers", "2", "--dim", "24", "--heads", "3",
            "--mlp-dim", "48", "--patch-size", "8", "--steps", "1", "--pattern", pattern]
    built = {i: train.build(runconfig.resolve(*train.parse_args([*argv, "--init", i])), torch.device("cpu"))
             for i in ("default", "mask", "impulse", "mask-impulse")}
    state = {i: b.model.state_dict() for i, b in built.items()}
    ours, base = state["mask-impulse"], state["default"]
    assert torch.equal(ours["pos_emb"], 18 * base["pos_emb"])
    assert torch.equal(ours["pos_emb"], state["impulse"]["pos_emb"])
    twin = copy.deepcopy(built["default"].model)                    # the mimetic V-proj, drawn as init_impulse draws it
    mp.init_mimetic_(twin, qk=None, vo=(0.4, 0.4), generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        qkv, proj = f"blocks.{layer}.attn.qkv.weight", f"blocks.{layer}.attn.proj.weight"
        mimetic = twin.state_dict()
        assert torch.equal(ours[qkv][48:], mimetic[qkv][48:]) and torch.equal(ours[proj], mimetic[proj])
        assert torch.equal(ours[qkv][:48], base[qkv][:48])                # Wq, Wk: the model's own init
        assert not torch.equal(state["impulse"][qkv][:48], base[qkv][:48])  # impulse writes the pattern there
        m = f"blocks.{layer}.attn.prior.bias"
        assert torch.equal(ours[m], state["mask"][m]) and m not in state["impulse"]
    assert built["mask-impulse"].init_report["pos_scale"] == 18.0


def test_the_vision_presets_take_the_soft_bump_and_leave_the_qk_inits_as_they_were(image_dir):
    """Every vision preset's prior is the soft bump; `impulse` and `qk-svd` under it write the weights they write
    with the impulse pattern (they read the bump's centre)."""
    for preset in tasks.TASKS["cifar10"].presets():
        assert tasks.TASKS["cifar10"].preset(preset)["pattern"] == "soft"
    argv = ["--task", "cifar10", "--data-dir", image_dir, "--layers", "1", "--dim", "24", "--heads", "3",
            "--mlp-dim", "48", "--patch-size", "8", "--steps", "1"]
    for init in ("impulse", "qk-svd"):
        preset, hard = (train.build(runconfig.resolve(*train.parse_args([*argv, "--init", init, *more])), torch.device("cpu"))
                        for more in ([], ["--pattern", "impulse"]))
        assert preset.config.pattern == "soft" and hard.config.pattern == "impulse"
        assert all(torch.equal(v, hard.model.state_dict()[k]) for k, v in preset.model.state_dict().items())
    mask = train.build(runconfig.resolve(*train.parse_args([*argv, "--init", "mask"])), torch.device("cpu"))
    assert torch.equal(mask.model.blocks[0].attn.prior.bias, mask.task.mask_logits("soft", 5.0, 10.0))


def test_a_discovered_pattern_runs_and_is_recorded(tmp_path, capsys):
    """result.json records the evidence (the Walsh sets tested and kept, the noise level), the log says it in one
    line, and the pattern is the preset layout's."""
    out = str(tmp_path / "run")
    capsys.readouterr()
    assert train.main([*TINY, "--init", "mask", "--pattern", "discovered", "--steps", "3", "--out", out]) == 0
    assert "prior found in the training data: 3 of 575 Walsh sets stand above the sampling noise 0.024 (24576 " \
           "points, alpha 0.05): 2 pairs\n" in capsys.readouterr().out
    src = json.load(open(os.path.join(out, "result.json")))["prior_source"]
    assert src == {"from": "data", "pattern": "discovered", "precision": 1.0, "recall": 1.0, "found_pairs": 2,
                   "oracle_pairs": 2, "walsh": {"points": 24576, "sets_tested": 575, "sets_kept": 3, "alpha": 0.05,
                                                "noise_level": pytest.approx(0.0236, abs=1e-4),
                                                "largest": pytest.approx(0.8889, abs=1e-4)}}
    assert torch.equal(torch.load(os.path.join(out, "prior.pt"), weights_only=True)["pattern"],
                       tasks.make_task("parity2", readout="mean").pattern())       # the preset layout


@pytest.mark.slow
def test_slow_work_says_its_size_and_an_estimate_before_it_starts(tmp_path, capsys, monkeypatch):
    """The Walsh search of --pattern discovered and a final evaluation that scores 10x a log step's sample each
    print their size and an estimate first when it passes 10 s (made slow here: a slower rate, a slower sample);
    at their real pace on this small task neither says a word."""
    argv = [*TINY[:-2], "--eval-points", "64", "--init", "mask", "--pattern", "discovered", "--steps", "2"]
    assert train.main([*argv, "--out", str(tmp_path / "quiet")]) == 0
    assert "finding the pattern" not in (said := capsys.readouterr().out) and "the final evaluation" not in said
    monkeypatch.setattr(tasks, "WALSH_RATE", 1e3)
    evaluate = tasks.BooleanTask.evaluate

    def slow(self, model, points=None):
        time.sleep(0.05 if points else 0)
        return evaluate(self, model, points)
    monkeypatch.setattr(tasks.BooleanTask, "evaluate", slow)
    assert train.main([*argv, "--out", str(tmp_path / "slow")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("finding the pattern in the training data: 575 Walsh sets of up to 3 bits over 24,576 "
                               "points (about ")
    final = [line for line in lines if line.startswith("the final evaluation: the whole test set, 32,768 points")]
    assert len(final) == 1 and lines.index(final[0]) < len(lines) - 2        # before the last step's line


def _mask_start(folder):
    return train.read_checkpoint(str(os.path.join(folder, "ckpt.pt")), "test")["snapshot"][0]["mask"]


def _teacher(tmp_path, *changes, name="teacher", once=None):
    """A finished default run of parity2 (mean readout), TINY and 6 steps, with `changes` (`_but`)."""
    return _train(tmp_path / name, *_but([*TINY, "--readout", "mean", "--steps", 6, "--log-every", 3], *changes),
                  once=once)


@pytest.mark.slow
def test_a_prior_from_a_teacher_run_is_read_saved_and_recorded(tmp_path, capsys):
    """--prior-from RUN: the student's M is the one the teacher's attention gives (`tasks.Task.teacher_prior` of
    `mp.mean_attention` on the teacher's training inputs), prior.pt holds it (readable with weights_only=True),
    result.json records the teacher's folder and run id and the found pattern's precision and recall against
    the hand pattern, args.json the folder; the QK inits fit the found pattern; the run resumes exactly."""
    teacher = _teacher(tmp_path)
    tck = train.read_checkpoint(os.path.join(teacher, "ckpt.pt"), "test")
    common = [*TINY, "--readout", "mean", "--steps", "6", "--log-every", "3", "--prior-from", teacher,
              "--teacher-min-fit", "0"]       # the mechanics, on a 6-step teacher that has not learned (fit 0.31)
    ratio = ["--prior-ratio", "1.01"]          # a 6-step teacher's attention is near uniform: its largest share 1.04
    out = str(tmp_path / "student")
    capsys.readouterr()
    assert train.main([*common, *ratio, "--init", "mask", "--halt-after", "3", "--out", out]) == 0
    assert f"prior read from the teacher {os.path.abspath(teacher)}: it fits 31.2% of its training inputs (at " \
           f"least 0% asked): " in capsys.readouterr().out
    saved = torch.load(os.path.join(out, "prior.pt"), weights_only=True)
    model = mp.Transformer(mp.TransformerConfig(**tck["model_config"]))
    model.load_state_dict(tck["model"])
    task = tasks.make_task("parity2", readout="mean").setup()
    want, logits = task.teacher_prior(mp.mean_attention(model.eval(), task.teacher_inputs(16)), "pattern", 1.01, 5.0,
                                      5.0)
    assert torch.equal(saved["pattern"], want) and torch.equal(saved["logits"], logits)
    assert torch.equal(_mask_start(out), logits.expand(2, -1, -1))
    assert train.main(["--resume", "--out", out]) == 0
    res = json.load(open(os.path.join(out, "result.json")))
    src = res["prior_source"]
    assert (src["from"], src["teacher"], src["teacher_run_id"], src["kind"]) == \
        ("teacher", os.path.abspath(teacher), tck["identity"]["run_id"], "pattern")
    assert 0 <= src["precision"] <= 1 and 0 <= src["recall"] <= 1 and src["oracle_pairs"] == 2
    assert src["teacher_fit"] == pytest.approx(0.3125) and src["teacher_min_fit"] == 0.0
    assert json.load(open(os.path.join(out, "args.json")))["prior_from"] == teacher
    assert train.main([*common, *ratio, "--init", "qk-svd", "--out", str(tmp_path / "qk")]) == 0
    qk = json.load(open(tmp_path / "qk" / "result.json"))
    assert qk["prior_source"]["teacher_run_id"] == src["teacher_run_id"] and (tmp_path / "qk" / "prior.pt").exists()
    assert train.main([*common, "--init", "mask", "--prior-kind", "logits", "--out", str(tmp_path / "soft")]) == 0
    soft = torch.load(tmp_path / "soft" / "prior.pt", weights_only=True)
    assert soft["logits"].shape == (2, 15, 15) and not torch.equal(soft["logits"], logits.expand(2, -1, -1))


@pytest.mark.parametrize("family", ["boolean", "arithmetic", "vision", "lm"])
def test_a_teacher_s_fit_is_its_accuracy_on_the_training_inputs_its_attention_is_read_on(tmp_path, image_dir, family):
    """`teacher_fit`, what --teacher-min-fit compares with, in each family: sign accuracy on the Boolean training
    points read, answer-digit accuracy (teacher-forced) on the first training sums, top-1 on the first training
    images, next-token accuracy on the first training windows; a number in [0, 1] that a model predicting the
    labels themselves would bring to 1."""
    make_wikitext(tmp_path / "text")
    argv = {"boolean": TINY, "arithmetic": ["--task", "addition", "--layers", "1", "--dim", "16", "--heads", "2"],
            "vision": ["--task", "cifar10", "--data-dir", image_dir, "--layers", "1", "--dim", "24", "--heads", "3"],
            "lm": ["--task", "wikitext2", "--data-dir", str(tmp_path / "text"), "--context", "8", "--layers", "1",
                   "--dim", "16", "--heads", "2"]}[family]
    config = runconfig.resolve(*train.parse_args(argv))
    task = runconfig.task_for(config).setup("cpu")
    model = mp.model_from_config(dataclasses.asdict(train.model_config(config, task))).eval()
    with torch.no_grad():
        fit = task.teacher_fit(model, 16)
        if family == "boolean":
            x = task.teacher_inputs(16)
            idx = [next(i for i in range(len(task.x_train)) if torch.equal(task.x_train[i], row)) for row in x]
            want = (torch.sign(model(x).squeeze(-1)) == torch.sign(task.y_train[idx])).float().mean()
        elif family == "arithmetic":
            seq = task.train_seq[:16]
            want = (model(seq[:, :-1])[:, task.eq_pos:].argmax(-1) == seq[:, task.eq_pos + 1:]).float().mean()
        elif family == "vision":
            want = (model(task.teacher_inputs(16)).argmax(-1) == task.y_train[:16]).float().mean()
        else:
            x, y = next(tasks.eval_windows(task.train, task.context, 16))
            want = (model(x).argmax(-1) == y).float().mean()
    assert 0 <= fit <= 1 and fit == pytest.approx(float(want))
    assert type(task).TEACHER_MIN_FIT == {"boolean": 0.95, "arithmetic": 0.9, "vision": 0.5, "lm": 0.2}[family]


def _save_checkpoint(path, contents: dict) -> None:
    """Write `contents` as train.py writes ckpt.pt: serialised, beside their sha256, in CKPT_FORMAT."""
    buf = io.BytesIO()
    torch.save(contents, buf)
    payload = buf.getvalue()
    torch.save({"format": runfiles.CKPT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, path)


@pytest.mark.slow
@pytest.mark.parametrize("case, needle", [
    ("not a folder", "is not a folder; give the folder of a finished run"),
    ("unfinished", "is not a finished run (no result.json)"),
    ("another task", "is a run of task majority3, not parity2"),
    ("another layout", "has another token layout: readout cls (here mean)"),
    ("another head count", "has 4 heads, this run 2: --prior-kind logits gives each head its own M"),
    ("a kind of another family", "--prior-kind offsets does not apply to task parity2"),
    ("damaged checkpoint", "is damaged"),
    ("a checkpoint that runs code", "would run code if unpickled"),
    ("discovered on vision", "has no pattern 'discovered'"),
    ("model config a list", "model_config is ["),
    ("config without init", "holds the flags of another version of train.py (no init)"),
    ("dim -5", "--dim must be an integer > 0, got -5"),
    ("model an int", "model is 3, not finite tensors by name"),
    ("dim 10^6", "does not fit this version's model (blocks.0.attn.proj.bias is ((16,), torch.float32) in the file, "
                 "((1000000,)"),
    ("a weight times NaN", "not finite tensors by name"),
    ("a teacher in training", "is in use by another process (a run is training there)"),
    ("a FIFO for ckpt.pt", "is a FIFO (named pipe), not a regular file"),
    ("a ratio no key reaches", "its attention gives no prior"),
    ("a teacher that did not learn", "the teacher fits 31.2% of its own training inputs, under the 95%"),
])
def test_a_prior_from_that_cannot_serve_is_one_line_and_writes_nothing(tmp_path, capsys, trained_once, case, needle,
                                                                         image_dir):
    """Every teacher that cannot serve is one line and exit 2, before anything is written: the student's --out is
    not made, and an --out that holds a user's files (no run) keeps them byte for byte. A teacher's checkpoint is
    someone else's file: its schema is checked (here rebuilt with a recomputed sha256), a FIFO is refused without
    blocking, a folder locked by a training run is not read."""
    teacher = {"not a folder": str(tmp_path / "nothing"), "unfinished": None}.get(case, None)
    extra, argv = [], [*TINY, "--readout", "mean", "--steps", "2", "--init", "mask"]
    if case == "unfinished":
        teacher = _teacher(tmp_path, "--halt-after", "3", once=trained_once)
    elif case == "another task":
        teacher = _teacher(tmp_path, "--task", "majority3", once=trained_once)
    elif case == "another layout":
        teacher = _teacher(tmp_path, "--readout", "cls", once=trained_once)
    elif case == "another head count":
        teacher = _teacher(tmp_path, "--heads", "4", once=trained_once)
        extra = ["--prior-kind", "logits"]
    elif case == "a kind of another family":
        teacher, extra = _teacher(tmp_path, once=trained_once), ["--prior-kind", "offsets"]
    elif case in ("damaged checkpoint", "a checkpoint that runs code"):
        teacher = _teacher(tmp_path, once=trained_once)
        path = os.path.join(teacher, "ckpt.pt")
        if case == "damaged checkpoint":
            outer = torch.load(path, weights_only=True)
            torch.save({**outer, "payload": outer["payload"][:-9] + b"123456789"}, path)
        else:
            torch.save({"model": _Touch(tmp_path / "ran")}, path)
    elif case in ("model config a list", "config without init", "dim -5", "model an int", "dim 10^6",
                  "a weight times NaN"):
        teacher = _teacher(tmp_path, once=trained_once)
        path = os.path.join(teacher, "ckpt.pt")
        ckpt = train.read_checkpoint(path, "test")
        if case == "model config a list":
            ckpt["model_config"] = list(ckpt["model_config"].values())
        elif case == "config without init":
            del ckpt["config"]["init"]
        elif case == "dim -5":
            ckpt["config"]["dim"] = -5
        elif case == "model an int":
            ckpt["model"] = 3
        elif case == "dim 10^6":
            ckpt["model_config"]["dim"] = 10 ** 6
        else:
            ckpt["model"]["blocks.0.mlp.0.weight"] *= float("nan")
        _save_checkpoint(path, ckpt)
    elif case == "a teacher in training":
        teacher = _teacher(tmp_path, once=trained_once)
        lock = os.open(teacher, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX)                 # as RunFolder holds it while a run trains (--resume)
    elif case == "a FIFO for ckpt.pt":
        teacher = _teacher(tmp_path, once=trained_once)
        os.remove(os.path.join(teacher, "ckpt.pt"))
        os.mkfifo(os.path.join(teacher, "ckpt.pt"))
    elif case == "a ratio no key reaches":
        teacher, extra = _teacher(tmp_path, once=trained_once), ["--prior-ratio", "1e9", "--teacher-min-fit", "0"]
    elif case == "a teacher that did not learn":
        teacher, extra = _teacher(tmp_path, once=trained_once), []        # 6 steps: it fits 31% of its training points
    if case == "discovered on vision":
        argv = ["--task", "cifar10", "--data-dir", image_dir, "--layers", "1", "--dim", "24", "--heads", "3",
                "--mlp-dim", "24", "--steps", "1", "--init", "mask", "--pattern", "discovered"]
    else:
        argv = [*argv, "--prior-from", teacher, *extra]
    held = _users_folder(tmp_path / "held")
    before = _tree(held)
    for out in (tmp_path / "student", held):
        capsys.readouterr()
        with _deadline(60):                              # a read that blocks (a FIFO) fails here, never hangs
            assert train.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "student").exists() and not (tmp_path / "ran").exists() and _tree(held) == before


# ---------------------------------------------------------------------------------------- train.py: data parallelism

DDP_TINY = [*TINY, "--init", "mask", "--steps", "20", "--log-every", "5"]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun_call(*args, n=2) -> tuple:
    """`python -m torch.distributed.run --standalone --nproc_per_node N train.py ARGS`, one thread a process, as a
    call for _at_once or _running."""
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
             os.path.join(HERE, "train.py"), *map(str, args)], {"env": {**os.environ, "OMP_NUM_THREADS": "1"}})


def test_a_rank_other_than_0_that_stops_on_bad_input_ends_after_rank_0(tmp_path, capsys, monkeypatch):
    """torchrun stops every process when the first one ends, so a rank other than 0 that refuses the input (as rank
    0 does, which says the line) says nothing and waits before it ends; rank 0 ends at once (under load rank 1
    ended first and rank 0's line was lost)."""
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    for rank, said, waited in (("1", "", [10.0]), ("0", "does not divide by the 2 processes", [])):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        waits.clear()
        assert train.main([*_but(DDP_TINY, "--batch-size", 33), "--out", str(tmp_path / "odd")]) == 2
        err = capsys.readouterr().err
        assert (said in err if said else err == "") and waits == waited and not (tmp_path / "odd").exists()


@pytest.mark.slow
def test_distributed_bad_input_is_one_line_and_writes_nothing(tmp_path):
    """A batch the processes cannot share is one line (from one process), and a rendezvous nobody else joins (rank 0
    of 2 alone) is one line after --dist-timeout; neither writes a run folder. The two run at once."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    odd, alone = _at_once(_torchrun_call(*_but(DDP_TINY, "--batch-size", 33), "--out", tmp_path / "odd"),
                          ([sys.executable, os.path.join(HERE, "train.py"), *DDP_TINY, "--dist-timeout", "2", "--out",
                            str(tmp_path / "alone")], {"env": env}), timeout=120)
    assert odd.returncode != 0 and odd.stderr.count("does not divide by the 2 processes") == 1
    assert not (tmp_path / "odd").exists()
    assert alone.returncode == 2 and "cannot join the process group" in alone.stderr
    assert len(alone.stderr.splitlines()) == 1 and not (tmp_path / "alone").exists()


def _losses(folder):
    return [json.loads(line)["loss"] for line in open(os.path.join(folder, "metrics.jsonl"))][1:]


def _params(folder):
    return train.read_checkpoint(str(os.path.join(folder, "ckpt.pt")), "test")["model"]


@pytest.mark.slow
def test_torchrun_two_processes_match_one_and_resume_with_either_world_size(tmp_path):
    """Same global batch: the 2-process gloo run logs the 1-process loss curve (to 1e-5) and ends at its
    parameters (to 1e-6), M included, in one run folder; a halted 2-process run resumes under torchrun, or
    in one process (another world size, the same global batch)."""
    one, two, other = tmp_path / "one", tmp_path / "two", tmp_path / "other"
    env = os.environ.get("OMP_NUM_THREADS")
    with _running(_torchrun_call(*DDP_TINY, "--halt-after", "10", "--out", two)) as done:     # one process meanwhile
        assert train.main([*DDP_TINY, "--out", str(one)]) == 0
    assert done[0].returncode == 0, done[0].stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["one", "two"] and not os.path.exists(two / "result.json")
    shutil.copytree(two, other)
    with _running(_torchrun_call("--resume", "--out", two)) as done:
        assert train.main(["--resume", "--out", str(other)]) == 0
    assert done[0].returncode == 0, done[0].stderr[-2000:]
    for folder in (two, other):
        np.testing.assert_allclose(_losses(folder), _losses(one), rtol=1e-5)
        a, b = _params(one), _params(folder)
        assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), folder
        assert not torch.equal(b["blocks.0.attn.prior.bias"], _mask_start(folder))      # M trained
    assert env == os.environ.get("OMP_NUM_THREADS")


@pytest.mark.slow
def test_torchrun_on_an_image_task_matches_one_process(tmp_path, image_dir):
    common = ["--task", "cifar10", "--data-dir", image_dir, "--init", "mask", "--layers", "1", "--dim", "24",
              "--mlp-dim", "48", "--batch-size", "8", "--steps", "6", "--log-every", "3", "--probe-size", "4"]
    assert train.main([*common, "--out", str(tmp_path / "one")]) == 0
    r = _at_once(_torchrun_call(*common, "--out", tmp_path / "two"))[0]
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)
    a, b = (json.load(open(tmp_path / n / "result.json"))["metrics"] for n in ("one", "two"))
    assert a["top1"] == b["top1"] and a["loss"] == pytest.approx(b["loss"], rel=1e-4)


DDP_GRAD_SCRIPT = """
import torch, torch.distributed as dist, maskprior as mp
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
cfg = mp.TransformerConfig(vocab_size=2, seq_len=6, n_layers=1, n_heads=2, dim=16, mlp_dim=16, readout="mean",
                           learnable_mask=True, fused=False)
torch.manual_seed(0)
model = mp.Transformer(cfg)
mp.init_mask_(model, mp.banded_pattern(6, 1))
x, y = torch.randint(0, 2, (8, 6), generator=torch.Generator().manual_seed(1)), torch.randn(8)
full = mp.Transformer(cfg)
full.load_state_dict(model.state_dict())
torch.nn.functional.mse_loss(full(x).squeeze(-1), y).backward()              # one process, the whole batch
ddp = torch.nn.parallel.DistributedDataParallel(model)
part = slice(4 * rank, 4 * rank + 4)
torch.nn.functional.mse_loss(ddp(x[part]).squeeze(-1), y[part]).backward()  # this rank's half
g, ref = model.blocks[0].attn.prior.bias.grad, full.blocks[0].attn.prior.bias.grad
assert g.abs().sum() > 0 and torch.allclose(g, ref, atol=1e-6), (g - ref).abs().max()
open(f"ok{rank}", "w").write("ok")
del ddp                                              # DDP's reducer must go before its process group
dist.barrier()                                       # leave together: gloo aborts a rank whose peer is gone
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_averages_the_mask_gradient_like_any_other(tmp_path):
    (tmp_path / "grad.py").write_text(DDP_GRAD_SCRIPT)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(tmp_path / "grad.py")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)
    # each rank writes ok{rank} once its gradient equals the one-process gradient; the exit status is not the
    # test: on a loaded CPU gloo now and then aborts one rank as the other closes the group after the last
    # barrier (SIGABRT at teardown: twice in 14 runs here, both with the CPU oversubscribed), after both files exist
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists(), r.stderr[-4000:]


# ---------------------------------------------------------------------------------------- train.py: loop

@pytest.mark.slow
def test_run_directory_and_result(tmp_path):
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--steps", "20", "--log-every", "10", *SMALL)
    assert rc == 0
    assert sorted(os.listdir(out)) == ["args.json", "ckpt.pt", "metrics.jsonl", "prior.pt", "result.json"]
    res = json.load(open(os.path.join(out, "result.json")))
    for key in ("task", "init", "seed", "steps", "seconds"):
        assert key in res
    for key in ("acc", "acc_unseen", "mse", "mse_unseen", "mdi_acc", "prior_mass_start", "prior_mass_end"):
        assert isinstance(res["metrics"][key], float)
    assert res["metrics"]["mdi_acc"] == 0.75 and res["steps"] == 20
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in lines] == [0, 10, 20] and "mask_drift" in lines[-1]


@pytest.mark.slow
def test_log_steps_use_eval_points_and_the_end_the_whole_cube(tmp_path):
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "default", "--steps", "20", "--log-every", "10",
                        "--eval-points", "512", *SMALL)
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["metrics"]["eval_points"] for x in lines] == [512, 512, 0]
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["metrics"]["eval_points"] == 0 and res["metrics"]["acc"] == lines[-1]["metrics"]["acc"]


def _qk_opt(init: str, steps: int) -> list:
    """--qk-opt-steps STEPS where the init is qk-opt (the flag applies to it alone)."""
    return ["--qk-opt-steps", str(steps)] if init == "qk-opt" else []


@pytest.mark.slow
@pytest.mark.parametrize("init", ["qk-svd", "qk-opt"])
def test_qk_inits_run(tmp_path, init):
    rc, out = run_train(tmp_path, "--task", "majority3", "--init", init, "--steps", "4", *_qk_opt(init, 200),
                        *SMALL)
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert len(res["init_report"]["pseudo_mass"]) == 1 and "qk_drift" in res


@pytest.mark.slow
@pytest.mark.parametrize("init", ["default", "mask", "qk-svd", "qk-opt", "mimetic", "impulse", "mask-impulse"])
def test_vision_run_every_init(tmp_path, init):
    x, y = _images(64), np.arange(64) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:16], y[:16])
    rc, out = run_train(tmp_path, "--task", "cifar10", "--data-dir", tmp_path, "--init", init, "--steps", "2",
                        "--layers", "1", "--dim", "24", "--heads", "3", "--mlp-dim", "48", "--patch-size", "8",
                        "--batch-size", "16", *_qk_opt(init, 20), "--probe-size", "8")
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["kind"] == "vision" and {"top1", "loss", "prior_mass_start", "prior_mass_end"} <= set(res["metrics"])
    if init in ("mask", "impulse", "qk-svd", "mask-impulse"):
        assert res["metrics"]["prior_mass_start"] > 0.3            # uniform attention would give 1/16


@pytest.mark.slow
@pytest.mark.parametrize("init", ["default", "mask", "qk-svd", "qk-opt"])
def test_lm_run_every_init(tmp_path, init):
    _write_text_corpus(tmp_path / "data")
    rc, out = run_train(tmp_path, "--task", "wikitext2", "--data-dir", tmp_path / "data", "--init", init,
                        "--steps", "3", *LM_SMALL, *_qk_opt(init, 20))
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["kind"] == "lm" and {"val_loss", "val_ppl", "prior_mass_start", "prior_mass_end"} <= set(res["metrics"])
    assert res["metrics"]["val_ppl"] == pytest.approx(np.exp(res["metrics"]["val_loss"]), rel=1e-6)


SMOKE_FLAGS = {"boolean": ["--eval-points", "64"], "arithmetic": ["--eval-points", "16"],
               "vision": ["--patch-size", "8"], "lm": ["--context", "8", "--val-tokens", "64"]}


def _smoke_data(root: Path, task: str) -> list:
    """The --data-dir flags of a task that reads files: a tiny release in the task's real layout."""
    if task == "cifar10":
        datafetch.write.write_cifar10_python(str(root), _images(20), np.arange(20) % 10, _images(4, 1), np.arange(4))
    elif task == "cifar100":
        py = root / "cifar-100-python"
        py.mkdir(parents=True)
        for split, n in (("train", 20), ("test", 4)):
            _py2_pickle(py / split, {b"fine_labels": list(range(n)), b"coarse_labels": [0] * n,
                                     b"data": _images(n, n).reshape(n, -1)})
    elif task == "imagenet100":
        root.mkdir(parents=True)
        root = _imagenet_dir(root)
    elif task == "wikitext2":
        _write_text_corpus(root)
    elif task == "tinystories":
        make_tinystories(root)
    else:
        return []
    return ["--data-dir", str(root)]


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


@pytest.mark.slow
@pytest.mark.parametrize("task, init", [(t, i) for t, cls in tasks.TASKS.items() for i in cls.inits()])
def test_every_task_trains_with_every_init(tmp_path, interpolator_once, task, init):
    """Two steps of a one-layer model for each registered task and each init it offers: the run ends with a
    result and, for an init that writes a prior, a prior mass at the start."""
    out = str(tmp_path / "run")
    argv = ["--task", task, "--init", init, "--steps", "2", "--log-every", "1", "--layers", "1", "--dim", "16",
            "--heads", "2", "--mlp-dim", "16", "--batch-size", "4", "--probe-size", "4", *_qk_opt(init, 5),
            *SMOKE_FLAGS[tasks.TASKS[task].KIND], *_smoke_data(tmp_path / "data", task), "--out", out]
    assert train.main(argv) == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["task"] == task and res["init"] == init and res["steps"] == 2 and res["metrics"]
    if init != "default":        # a prior's mass at the start, or the reason there is none (no row constrained)
        assert res["metrics"]["prior_mass_start"] is not None or "constrains no query row" in res["prior_mass_note"]


@pytest.mark.slow
def test_augmented_and_ema_run_on_an_image_task(tmp_path, image_dir):
    out = str(tmp_path / "run")
    common = ["--task", "cifar10", "--data-dir", image_dir, "--layers", "2", "--dim", "24", "--mlp-dim", "48",
              "--batch-size", "8", "--steps", "6", "--log-every", "3", "--probe-size", "4", "--init", "mask"]
    aug = ["--input-size", "48", "--patch-size", "8", "--crop", "rrc", "--randaug", "9", "--reprob", "0.25",
           "--mixup", "0.8", "--cutmix", "1.0", "--drop-path", "0.1", "--ema", "0.9"]
    assert train.main([*common, *aug, "--halt-after", "3", "--out", out]) == 0
    assert train.main(["--resume", "--out", out]) == 0
    assert train.main([*common, *aug, "--out", str(tmp_path / "straight")]) == 0
    a, b = (json.load(open(os.path.join(d, "result.json")))["metrics"] for d in (out, str(tmp_path / "straight")))
    assert a == b and {"top1", "ema_top1", "ema_loss"} <= set(a)              # the resumed run is exact
    xb, yb = runconfig.task_for(runconfig.resolve(*train.parse_args([*common, *aug, "--out", out]))).setup().train_batch(0, 8)
    assert xb.shape == (8, 3, 48, 48) and torch.allclose(yb.sum(-1), torch.ones(8))


@cuda
def test_cuda_training_run(tmp_path):
    rc, out = run_train(tmp_path, "--task", "majority3", "--init", "mask", "--steps", "20", "--device", "cuda",
                        *SMALL)
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["device"].startswith("cuda") and res["metrics"]["mse"] < 10


@cuda
@pytest.mark.parametrize("init", ["mask", "impulse"])
def test_cuda_vision_run_bf16(tmp_path, init):
    """The vision path on a GPU: data resident on the device, bf16 autocast, masked attention backward."""
    x, y = _images(64), np.arange(64) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:16], y[:16])
    rc, out = run_train(tmp_path, "--task", "cifar10", "--data-dir", tmp_path, "--init", init, "--steps", "3",
                        "--device", "cuda", "--layers", "2", "--dim", "48", "--heads", "3", "--mlp-dim", "96",
                        "--batch-size", "16", "--probe-size", "8")
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["device"].startswith("cuda") and np.isfinite(res["metrics"]["loss"])
    if init == "mask":
        assert max(res["mask_drift"]) > 0                        # M received gradients through bf16 SDPA


def test_init_that_gives_non_finite_weights_writes_nothing(tmp_path, capsys, monkeypatch):
    """A QK gain past the library's bound is refused by its flag; an init that writes non-finite weights, or weights
    whose first loss is not finite, is one line and nothing is written."""
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--init", "qk-svd", "--qk-svd-norm", "1e30", "--steps", "2", "--out", out]) == 2
    assert "--qk-svd-norm must be a finite number > 0 and <= 1,000,000" in capsys.readouterr().err
    for value, words in ((float("nan"), "non-finite weights"), (1e30, "loss with these flags")):
        def filled(model, prior, config, g, value=value):
            with torch.no_grad():
                model.head.weight.fill_(value)
            return {}
        monkeypatch.setitem(inits.INITS, "qk-svd", dataclasses.replace(inits.INITS["qk-svd"], apply=filled))
        assert train.main([*TINY, "--init", "qk-svd", "--steps", "2", "--out", out]) == 2
        assert words in capsys.readouterr().err and not os.path.exists(out)


@pytest.mark.slow
def test_mask_beats_default_on_unseen_majority3(tmp_path):
    """The paper's claim in miniature: on majority3 the mask generalises to the unseen quarter,
    default stays at the min-degree interpolator (50% on U, 87.5% on the cube). 400 steps (6 s a run):
    seed 0 gives default 87.53% / 50.1% on U, mask 100% / 100%, end mass 0.15 vs 0.94."""
    common = ["--task", "majority3", "--layers", "3", "--dim", "32", "--heads", "2", "--mlp-dim", "64",
              "--steps", "400", "--log-every", "400", "--warmup", "50", "--seed", "0", "--probe-size", "64"]
    rc1, d = run_train(tmp_path, *common, "--init", "default", name="d")
    rc2, m = run_train(tmp_path, *common, "--init", "mask", name="m")
    assert rc1 == rc2 == 0
    rd = json.load(open(os.path.join(d, "result.json")))["metrics"]
    rm = json.load(open(os.path.join(m, "result.json")))["metrics"]
    assert rd["acc"] == pytest.approx(rd["mdi_acc"], abs=0.01) and rd["acc_unseen"] < 0.55
    assert rm["acc_unseen"] > rd["acc_unseen"] + 0.2
    assert rm["mse_unseen"] < 0.5 * rd["mse_unseen"]
    assert rm["prior_mass_end"] > 0.8 > 0.3 > rd["prior_mass_end"]


@pytest.mark.slow
def test_train_step_is_the_step_the_loop_takes(tmp_path):
    """train.build + train.train_step (what the benchmarks time), replayed, give bitwise the weights the loop
    trained (learning-rate schedule, clipping and the update included)."""
    argv = [*_but(RUN24, "--steps", 6, "--log-every", 3), "--init", "mask", "--grad-clip", "0.5", "--schedule",
            "cosine", "--warmup", "2", "--out", str(tmp_path / "run")]
    assert train.main(argv) == 0
    device = torch.device("cpu")
    b = train.build(runconfig.resolve(*train.parse_args(argv)), device)
    model, opt, task, args = b.model, b.optimizer, b.task, b.config
    for step in range(6):
        train.train_step(model, model, opt, task, task.train_batch(step, args.batch_size), args, device, step)
    trained = train.read_checkpoint(str(tmp_path / "run" / "ckpt.pt"), "test")["model"]
    assert all(torch.equal(trained[k], v) for k, v in model.state_dict().items())
    assert opt.param_groups[0]["lr"] == json.loads(open(tmp_path / "run" / "metrics.jsonl").readlines()[-1])["lr"]


@pytest.mark.slow
def test_the_compile_flag_trains_through_torch_compile_on_the_cpu(tmp_path, monkeypatch):
    """--compile on the CPU: the steps run through torch.compile's graph (dynamo traces it; the aot_eager
    backend stands in for inductor, which needs a C++ compiler and minutes here) and train the weights an
    uncompiled run trains, M included."""
    import torch._dynamo
    calls, real = [], torch.compile

    def compile_cpu(model, **kw):
        calls.append(model)
        return real(model, backend="aot_eager", **kw)
    argv = [*TINY, "--init", "mask", "--steps", "4", "--log-every", "2"]
    assert train.main([*argv, "--out", str(tmp_path / "eager")]) == 0
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    monkeypatch.setattr(train.torch, "compile", compile_cpu)
    assert train.main([*argv, "--compile", "--out", str(tmp_path / "compiled")]) == 0
    monkeypatch.undo()
    assert len(calls) == 1 and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    a, b = _params(tmp_path / "eager"), _params(tmp_path / "compiled")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not torch.equal(b["blocks.0.attn.prior.bias"], _mask_start(tmp_path / "compiled"))


@cuda
def test_cuda_compile_matches_eager(tmp_path):
    """--compile (inductor) on a GPU: both attention paths with the mask give eager's outputs and M gradient."""
    for fused in (True, False):
        cfg = mp.TransformerConfig(vocab_size=3, seq_len=10, n_layers=2, n_heads=2, dim=32, mlp_dim=32,
                                   learnable_mask=True, fused=fused, readout="tokens", causal=True, n_outputs=3)
        torch.manual_seed(0)
        model = mp.Transformer(cfg).cuda()
        mp.init_mask_(model, logits=mp.causal_distance_logits(10, 2))
        x = torch.randint(0, 3, (4, 10), device="cuda")
        outs = []
        for m in (model, torch.compile(model)):
            model.zero_grad()
            out = m(x)
            out.square().sum().backward()
            outs.append((out.detach(), model.blocks[0].attn.prior.bias.grad.clone()))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-4)
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--init", "mask", "--steps", "20", "--compile", "--device", "cuda", "--out", out]) == 0


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    """A run halted and resumed ends bitwise where an uninterrupted one does: weights, the optimiser and, with
    dropout drawing random numbers every step, the RNG state (restored from the checkpoint)."""
    args = ["--task", "parity2", "--init", "mask", "--steps", "30", "--log-every", "10", "--dropout", "0.1", *SMALL]
    rc, full = run_train(tmp_path, *args, name="full")
    assert rc == 0
    rc, part = run_train(tmp_path, *args, "--halt-after", "10", name="part")
    assert rc == 0 and not os.path.exists(os.path.join(part, "result.json"))
    assert train.read_checkpoint(str(os.path.join(part, "ckpt.pt")), "test")["step"] == 10
    rc = train.main(["--out", part, "--resume"])
    assert rc == 0
    a = train.read_checkpoint(str(os.path.join(full, "ckpt.pt")), "test")
    b = train.read_checkpoint(str(os.path.join(part, "ckpt.pt")), "test")
    assert a["step"] == b["step"] == 30
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    la = [json.loads(x)["loss"] for x in open(os.path.join(full, "metrics.jsonl"))]
    lb = [json.loads(x)["loss"] for x in open(os.path.join(part, "metrics.jsonl"))]
    assert la == lb


def test_relative_prior_runs_and_resumes_exactly(tmp_path, text_dir):
    common = ["--task", "wikitext2", "--data-dir", text_dir, "--init", "mask", "--mask-param", "relative",
              "--layers", "1", "--dim", "16", "--mlp-dim", "16", "--context", "16", "--val-tokens", "200",
              "--steps", "8", "--log-every", "4", "--batch-size", "4"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert train.main([*common, "--out", a]) == 0
    assert train.main([*common, "--halt-after", "4", "--out", b]) == 0
    assert train.main(["--resume", "--out", b]) == 0
    pa, pb = _params(a), _params(b)
    assert pa["blocks.0.attn.prior.bias"].shape == (4, 16)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert train.main(["--resume", "--out", b, "--mask-param", "full"]) == 2


def test_a_language_model_without_positions_evaluates_at_twice_its_context(tmp_path, text_dir):
    """--positions none (no positional table: the order from the causal mask and the prior) lets a language model serve
    any length: --eval-context 32 evaluates a context-16 model on windows of 32 tokens too (long_val_loss and
    long_val_ppl in result.json), for the default init and the relative M; --mask-window 4 gives M 4 distances."""
    common = ["--task", "wikitext2", "--data-dir", text_dir, "--layers", "1", "--dim", "16", "--mlp-dim", "16",
              "--context", "16", "--val-tokens", "200", "--steps", "4", "--log-every", "2", "--batch-size", "4",
              "--positions", "none", "--eval-context", "32"]
    for init, extra in (("default", []), ("mask", []), ("mask", ["--mask-window", "4"])):
        out = str(tmp_path / f"{init}{len(extra)}")
        assert train.main([*common, "--init", init, *extra, "--out", out]) == 0
        metrics = json.load(open(os.path.join(out, "result.json")))["metrics"]
        assert math.isfinite(metrics["long_val_ppl"]) and metrics["long_val_ppl"] > 1 and "val_ppl" in metrics
        params = _params(out)
        assert not any("pos_emb" in k for k in params)
        if init == "mask":
            assert params["blocks.0.attn.prior.bias"].shape == (4, 4 if extra else 16)


@pytest.mark.slow
def test_a_resume_with_the_three_files_of_one_run_goes_on(tmp_path, capsys):
    """What a resume must still take: a run halted between log steps, resumed with another --log-every and
    halted again before its next log line; and the three files moved together to another folder."""
    out = str(tmp_path / "run")
    assert train.main([*RUN24, "--halt-after", "23", "--out", out]) == 0          # ckpt at 23, log at 20
    assert train.main(["--resume", "--out", out, "--log-every", "7", "--halt-after", "26"]) == 0
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [0, 5, 10, 15, 20]
    moved = str(tmp_path / "moved")
    shutil.copytree(out, moved)
    assert train.main(["--resume", "--out", moved]) == 0
    steps = [json.loads(line)["step"] for line in open(os.path.join(moved, "metrics.jsonl"))]
    assert steps == [0, 5, 10, 15, 20, 28, 35, 40]


def test_a_resume_with_another_thread_count_says_it_is_not_bitwise(tmp_path, capsys):
    """A CPU run resumed with another torch thread count (its float sums round in another order) prints a note
    that says so and how to resume bitwise; with the same count it says nothing."""
    out = str(tmp_path / "run")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert train.main([*TINY, "--steps", "6", "--log-every", "2", "--halt-after", "2", "--out", out]) == 0
        assert train.main(["--resume", "--out", out, "--halt-after", "4"]) == 0
        assert "note:" not in capsys.readouterr().out
        torch.set_num_threads(2)
        assert train.main(["--resume", "--out", out]) == 0
    finally:
        torch.set_num_threads(threads)
    said = capsys.readouterr().out
    assert "note: the run trained with 1 CPU threads, now 2" in said and "OMP_NUM_THREADS=1" in said
    out = str(tmp_path / "amp")                # --amp (a NUMERICS flag) changed on resume: named in the same note
    assert train.main([*TINY, "--steps", "6", "--log-every", "2", "--halt-after", "2", "--out", out]) == 0
    capsys.readouterr()
    assert train.main(["--resume", "--out", out, "--amp", "bf16"]) == 0
    said = capsys.readouterr().out
    assert "note: the run trained with --amp" in said and "now bf16" in said and "not bitwise" in said


@pytest.mark.slow
def test_a_run_that_has_not_logged_yet_prints_an_early_eta(tmp_path, capsys, monkeypatch):
    """Before its first log step a run prints its pace and ETA once (after train.EARLY_ETA seconds), and
    --preset paper on the CPU says at the start that it is sized for a GPU."""
    monkeypatch.setattr(train, "EARLY_ETA", 0.0)
    assert train.main([*TINY, "--steps", "6", "--log-every", "5", "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out.splitlines()
    early = [line for line in said if "an early estimate" in line]
    assert len(early) == 1 and "the first evaluation is at step 5" in early[0] and "ETA" in early[0]
    assert train.main(["--task", "parity2", "--preset", "paper", "--layers", "1", "--dim", "16", "--heads", "2",
                       "--head-dim", "8", "--mlp-dim", "16", "--steps", "1", "--eval-points", "64", "--probe-size",
                       "8", "--out", str(tmp_path / "b"), "--device", "cpu"]) == 0
    assert "note: --preset paper is the paper's setting, sized for a GPU" in capsys.readouterr().out


def test_the_eta_counts_every_evaluation_left_and_the_final_one_over_the_whole_test_set():
    """A run's ETA is its steps at the training rate, plus each log step's evaluation as long as the last one took,
    plus the final evaluation over the whole test set (a Boolean task at --eval-points 2048 on a 32,768-point cube:
    16 log evaluations' worth), nothing once that is done; before a resumed run has timed one, the steps alone."""
    task = tasks.make_task("parity2").setup()
    config = runconfig.resolve(*train.parse_args(["--task", "parity2", "--steps", "600", "--log-every", "30",
                                              "--eval-points", "2048"]))
    state = types.SimpleNamespace(config=config, task=task, eval_seconds=0.5)
    # at step 30, 10 steps/s: 57 s of steps, 18 log evaluations before the last, the last over 16x the points
    assert train.eta(state, 30, 10.0) == pytest.approx(57 + 0.5 * (18 + 16))
    assert train.eta(state, 599, 10.0) == pytest.approx(0.1 + 0.5 * 16)
    assert train.eta(state, 600, 10.0) == 0.0                     # the last log step was the final evaluation
    assert train.eta(types.SimpleNamespace(config=config, task=task, eval_seconds=None), 30, 10.0) == pytest.approx(57)
    assert tasks.make_task("addition").setup().final_cost(500) == 20.0 and task.final_cost(0) == 1.0


@pytest.mark.slow
def test_the_paper_vision_recipe_trains_a_step_of_vit_tiny_at_224_on_the_cpu(tmp_path, image_dir):
    """The paper vision preset, as a GPU runs it, for one step here: ViT-Tiny/16 (12 layers) at 224 x 224 on CIFAR
    upsampled by the random resized crop, RandAugment m9, random erasing, mixup and cutmix (soft labels), label
    smoothing and drop path, the soft prior with impulse's positions and V (mask-impulse); evaluation resizes to 256
    and crops 224. It ends with a result and a finite loss."""
    out = str(tmp_path / "run")
    assert train.main(["--task", "cifar10", "--data-dir", image_dir, "--preset", "paper", "--init", "mask-impulse",
                       "--steps", "1", "--batch-size", "4", "--probe-size", "2", "--out", out]) == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["config"]["n_layers"] == 12 and res["config"]["image_size"] == 224 and res["config"]["patch_size"] == 16
    assert math.isfinite(res["metrics"]["loss"]) and res["init_report"]["pos_scale"] == 18.0
    args = json.load(open(os.path.join(out, "args.json")))
    assert (args["crop"], args["randaug"], args["reprob"], args["mixup"], args["cutmix"]) == ("rrc", 9.0, 0.25, 0.8, 1.0)


# ---------------------------------------------------------------------------------------- train.py: durability

def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "200", "--lr", "1e30", "--log-every", "1", *SMALL)
    err = capsys.readouterr().err
    assert rc == 1 and "loss became" in err
    ckpt = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(os.path.join(out, "result.json"))


@pytest.mark.slow
def test_a_non_finite_stop_keeps_a_finite_checkpoint_and_resumes_with_a_lower_lr(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--steps", "20", "--log-every", "5", "--lr", "1e8", "--out", out]) == 1
    assert "the loss became nan" in capsys.readouterr().err
    ckpt = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert train.main(["--resume", "--out", out, "--lr", "1e-3", "--grad-clip", "1"]) == 0
    saved = json.load(open(os.path.join(out, "args.json")))
    assert (saved["lr"], saved["grad_clip"]) == (1e-3, 1.0)
    assert json.load(open(os.path.join(out, "result.json")))["steps"] == 20


@pytest.mark.slow
def test_the_weights_are_checked_finite_before_every_save(tmp_path, capsys, monkeypatch):
    """An update that leaves a weight infinite while the loss it came from was finite (an overflow, injected
    here into the first update): the run stops before saving, naming the parameters; the checkpoint kept is
    the finite one before, and it resumes."""
    real = train.step_update

    def overflowing(model, optimizer, loss, args, step, ema=None):
        real(model, optimizer, loss, args, step, ema)
        if step == 0:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("inf")
    monkeypatch.setattr(train, "step_update", overflowing)
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--steps", "10", "--log-every", "5", "--ckpt-every", "1", "--out", out]) == 1
    err = capsys.readouterr().err
    assert "the parameters became non-finite at step 1" in err, err
    ckpt = train.read_checkpoint(os.path.join(out, "ckpt.pt"), "test")
    assert ckpt["step"] == 0 and all(torch.isfinite(v).all() for v in ckpt["model"].values())
    monkeypatch.undo()
    assert train.main(["--resume", "--out", out]) == 0


def test_resume_with_other_architecture_is_refused(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "4", "--halt-after", "2", *SMALL)
    assert rc == 0
    rc = train.main(["--out", out, "--resume", "--layers", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "architecture" in err and "layers" in err
    assert train.main(["--out", os.path.join(tmp_path, "nothing"), "--resume"]) == 2


@pytest.mark.slow
def test_resume_refuses_fewer_steps_than_done_a_lost_log_and_a_foreign_checkpoint(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--steps", "20", "--log-every", "10", "--halt-after", "20", "--out", out]) == 0
    os.remove(os.path.join(out, "result.json"))
    assert train.main(["--resume", "--out", out, "--steps", "10"]) == 2
    assert "at step 20, past --steps 10" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "result.json"))
    os.rename(os.path.join(out, "metrics.jsonl"), os.path.join(tmp_path, "log"))
    assert train.main(["--resume", "--out", out]) == 2
    assert "metrics.jsonl is missing" in capsys.readouterr().err
    os.rename(os.path.join(tmp_path, "log"), os.path.join(out, "metrics.jsonl"))
    torch.save({"model": {}}, os.path.join(out, "ckpt.pt"))
    assert train.main(["--resume", "--out", out]) == 2
    assert "is not a checkpoint of this version of train.py (no format" in capsys.readouterr().err


def _edit_json(path, change):
    data = json.load(open(path))
    change(data)
    open(path, "w").write(json.dumps(data))


@pytest.mark.slow
@pytest.mark.parametrize("case, message", [
    ("foreign checkpoint, other seed", "is the checkpoint of another run"),
    ("foreign checkpoint, same seed", "is the checkpoint of another run"),
    ("args.json of another task", "has task='majority3' but the checkpoint was trained with task='parity2'"),
    ("args.json without lr", "holds the flags of another version of train.py (no lr)"),
    ("args.json a list", "holds a list, not the object of a run's flags"),
    ("args.json steps a string", "has steps='40', which --steps cannot take"),
    ("args.json lr null", "has lr=None, which --lr cannot take"),
    ("args.json from another run", "has seed=1 but the checkpoint was trained with seed=0"),
    ("log emptied", "holds no records, but the checkpoint (step 20) was saved after logging steps 0 .. 20"),
    ("log cut short", "holds steps 0 .. 10, but the checkpoint (step 20) was saved after logging steps 0 .. 20"),
    ("log without its start", "line 1 is step 5, not the run's start (step 0)"),
    ("log of another run", "is the checkpoint of another run"),
    ("log replaced by a folder", "metrics.jsonl is not a file, so the run's log cannot be continued"),
])
def test_resume_refuses_what_is_not_this_run(tmp_path, capsys, trained_once, case, message):
    """ckpt.pt, args.json and metrics.jsonl are checked against each other before a resume: each broken or
    swapped file is one line and exit 2, and nothing in the folder changes."""
    out = _halted(tmp_path, once=trained_once)
    other = _halted(tmp_path, "other", seed=1 if "other seed" in case or "another run" in case else 0,
                    once=trained_once)
    ckpt, args_json, log = (os.path.join(out, f) for f in ("ckpt.pt", "args.json", "metrics.jsonl"))
    if case.startswith("foreign checkpoint"):
        shutil.copy(os.path.join(other, "ckpt.pt"), ckpt)
    elif case == "args.json of another task":
        _edit_json(args_json, lambda d: d.update(task="majority3"))
    elif case == "args.json without lr":
        _edit_json(args_json, lambda d: d.pop("lr"))
    elif case == "args.json a list":
        open(args_json, "w").write("[]")
    elif case == "args.json steps a string":
        _edit_json(args_json, lambda d: d.update(steps="40"))
    elif case == "args.json lr null":
        _edit_json(args_json, lambda d: d.update(lr=None))
    elif case == "args.json from another run":
        shutil.copy(os.path.join(other, "args.json"), args_json)
    elif case == "log emptied":
        open(log, "w").close()
    elif case == "log cut short":
        lines = open(log).readlines()
        open(log, "w").writelines(lines[:3])
    elif case == "log without its start":
        lines = open(log).readlines()
        open(log, "w").writelines(lines[1:])
    elif case == "log of another run":
        shutil.copy(os.path.join(other, "metrics.jsonl"), log)
    elif case == "log replaced by a folder":
        os.remove(log)
        os.mkdir(log)
    files = lambda: {f: open(os.path.join(out, f), "rb").read() if os.path.isfile(os.path.join(out, f)) else "dir"  # noqa
                     for f in os.listdir(out)}
    before = files()
    capsys.readouterr()
    assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert files() == before


@pytest.mark.slow
def test_language_models_default_to_the_relative_prior_and_a_checkpoint_without_a_flag_is_one_line(tmp_path, text_dir,
                                                                                                   capsys):
    """Language models take the relative prior by default. A checkpoint holds every flag of its version: one
    whose config lacks one (a run of another version, or an edited file, its sha256 recomputed) is one line."""
    args = runconfig.resolve(*train.parse_args(["--task", "wikitext2", "--data-dir", text_dir]))
    assert args.mask_param == "relative" and tasks.TASKS["tinystories"].preset("paper")["mask_param"] == "relative"
    out = str(tmp_path / "old")
    common = ["--task", "wikitext2", "--data-dir", text_dir, "--init", "mask", "--layers", "1", "--dim", "16",
              "--mlp-dim", "16", "--context", "16", "--val-tokens", "200", "--steps", "6", "--log-every", "3",
              "--batch-size", "4"]
    assert train.main([*common, "--mask-param", "full", "--halt-after", "3", "--out", out]) == 0
    ckpt = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")
    del ckpt["config"]["mask_param"]
    _save_checkpoint(os.path.join(out, "ckpt.pt"), ckpt)
    before = _tree(out)
    capsys.readouterr()
    assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds the flags of another version of train.py (no mask_param)" in err and len(err.splitlines()) == 1
    assert _tree(out) == before


def test_checkpoints_of_an_earlier_version_are_refused_in_one_line(tmp_path, capsys):
    """A run of an earlier version: M on the attention layer itself (before MaskPrior), or a checkpoint without
    the checksummed format: --resume refuses in one line naming the version, and nothing changes."""
    out = str(tmp_path / "run")
    assert train.main([*RUN24, "--init", "mask", "--halt-after", "20", "--out", out]) == 0
    path = os.path.join(out, "ckpt.pt")
    good = train.read_checkpoint(path, "test")
    old = {**good, "model": {k.replace("attn.prior.bias", "attn.mask_logits"): v
                             for k, v in good["model"].items()}}
    _save_checkpoint(path, old)
    before = _tree(out)
    capsys.readouterr()
    assert "blocks.0.attn.mask_logits" in old["model"] and train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not fit this version's model (it lacks blocks.0.attn.prior.bias)" in err
    assert "another version of maskprior" in err and len(err.splitlines()) == 1 and _tree(out) == before
    torch.save(good, path)                                        # the contents alone, as before checksums
    assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a checkpoint of this version of train.py (no format: one written before checksums" in err
    torch.save({"format": "maskprior-checkpoint-1", "payload": b"x"}, path)
    assert train.main(["--resume", "--out", out]) == 2
    assert "earlier version of train.py (maskprior-checkpoint-1)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("change", ["a 3 x 3 pattern", "the pattern inverted", "a symlink to /etc/passwd",
                                    "cut to 500 bytes", "a FIFO", "removed"])
def test_a_prior_file_changed_before_resume_is_one_line_and_nothing_changes(tmp_path, capsys, change):
    """The run's own prior.pt is read back through the one reader on --resume: the bytes the run wrote at its
    start (their sha256 is in the checkpoint), a regular file; any change is one line, exit 2, the folder as it was."""
    out = str(tmp_path / "run")
    assert train.main([*TINY, "--init", "mask", "--pattern", "discovered", "--steps", "4", "--log-every", "2",
                       "--halt-after", "2", "--out", out]) == 0
    path = os.path.join(out, "prior.pt")
    saved = torch.load(path, weights_only=True)
    if change == "a 3 x 3 pattern":
        torch.save({**saved, "pattern": torch.ones(3, 3, dtype=torch.bool)}, path)
    elif change == "the pattern inverted":
        torch.save({**saved, "pattern": ~saved["pattern"]}, path)
    elif change == "a symlink to /etc/passwd":
        os.remove(path)
        os.symlink("/etc/passwd", path)
    elif change == "cut to 500 bytes":
        Path(path).write_bytes(Path(path).read_bytes()[:500])
    elif change == "a FIFO":
        os.remove(path)
        os.mkfifo(path)
    else:
        os.remove(path)
    before = {p: os.lstat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    capsys.readouterr()
    with _deadline(60):
        assert train.main(["--resume", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "prior.pt" in err, err
    assert ("has changed since the run started" in err if change in ("a 3 x 3 pattern", "the pattern inverted",
                                                                      "a symlink to /etc/passwd", "cut to 500 bytes")
            else "restore the file" in err), err
    assert {p: os.lstat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)} == before


@pytest.mark.slow
def test_resume_on_other_data_is_refused_and_on_the_same_data_moved_goes_on(tmp_path, capsys, image_dir):
    """The checkpoint records a hash of the data: --resume --data-dir on another CIFAR set (other
    pixels, same sizes and names) is one line and exit 2; the same set copied elsewhere resumes."""
    common = ["--task", "cifar10", "--init", "mask", "--layers", "1", "--dim", "24", "--mlp-dim", "24", "--batch-size",
              "8", "--steps", "4", "--log-every", "2", "--halt-after", "2", "--probe-size", "4"]
    out = str(tmp_path / "run")
    assert train.main([*common, "--data-dir", image_dir, "--out", out]) == 0
    other = tmp_path / "other"
    x = 255 - _images(40)
    datafetch.write.write_cifar10_python(str(other), x, np.arange(40) % 10, x[:8], np.arange(8) % 10)
    before = _tree(out)
    capsys.readouterr()
    assert train.main(["--resume", "--out", out, "--data-dir", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not the data the run in" in err and f"it started from {image_dir}" in err and len(err.splitlines()) == 1
    assert _tree(out) == before
    moved = tmp_path / "moved"
    shutil.copytree(os.path.join(image_dir, "cifar-10-batches-py"), moved / "cifar-10-batches-py")
    assert train.main(["--resume", "--out", out, "--data-dir", str(moved)]) == 0
    assert json.load(open(os.path.join(out, "result.json")))["steps"] == 4


def test_a_locked_run_folder_is_refused(tmp_path, capsys):
    import fcntl
    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)                        # another process's run holds it
    try:
        assert train.main([*TINY, "--steps", "2", "--out", str(out)]) == 75        # EX_TEMPFAIL: try again later
        assert "in use by another process" in capsys.readouterr().err and os.listdir(out) == []
    finally:
        os.close(fd)
    assert train.main([*TINY, "--steps", "2", "--out", str(out)]) == 0


def test_a_run_that_loses_the_lock_leaves_the_folder_it_made_to_the_winner(tmp_path):
    """Two new runs at one moment: the one that made the folder can lose the lock to the other; its abandon then
    leaves the folder (and what the winner writes there) alone. Before, it removed the still-empty folder from
    under the winner, whose first write failed (test_two_processes_on_one_run_folder, 1 run in 5)."""
    path = str(tmp_path / "a" / "run")
    maker, winner = runfiles.RunFolder(path), runfiles.RunFolder(path)
    maker.create()                              # made the folder (and its parent) ...
    maker.release()                             # ... and is about to lock it when the other takes the lock
    winner.create()
    with pytest.raises(runfiles.BusyError):
        maker._lock()
    maker.abandon()
    assert os.path.isdir(path)
    winner.write("args.json", "{}")             # the winner's first write
    assert os.listdir(path) == ["args.json"]
    winner.abandon()                            # the winner holds the lock: its abandon removes what it wrote
    assert os.listdir(tmp_path / "a") == ["run"]


@pytest.mark.slow
def test_two_processes_on_one_run_folder(tmp_path):
    """Two runs started at once into one folder: one trains, the other is refused; the log is one run's."""
    out = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *TINY, "--steps", "60", "--log-every", "10", "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    results = [(p.wait(timeout=60), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) in ([0, 2], [0, 75]), results
    assert any("in use by another process" in err or "already holds a run" in err for _, err in results)
    steps = [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))]
    assert steps == list(range(0, 61, 10))


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_leaves_a_checkpoint_that_resumes(tmp_path, sig, code):
    out = os.path.join(tmp_path, "int")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--out", out, "--steps", "100000", "--log-every", "5",
           "--ckpt-every", "100000", *SMALL]                 # no checkpoint but the first and the one the signal makes
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).readlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(sig)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == code and "finishing this step and saving a checkpoint" in text, text
    step = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")["step"]
    assert step >= 5 and f"checkpoint at step {step} in" in text
    rc = train.main(["--out", out, "--resume", "--steps", str(step + 5)])
    assert rc == 0 and json.load(open(os.path.join(out, "result.json")))["steps"] == step + 5


@pytest.mark.slow
def test_a_write_that_fails_midway_keeps_the_last_checkpoint_whole_and_it_resumes_exactly(tmp_path, monkeypatch, capsys):
    """A disk that fails in the middle of writing a checkpoint (half the bytes written, then ENOSPC; no root
    needed: the file object's write is made to fail): the run stops in one line, ckpt.pt is still the previous
    checkpoint, whole, and resuming from it ends at the parameters of an uninterrupted run."""
    args = [*TINY, "--init", "mask", "--steps", "12", "--log-every", "4", "--dropout", "0.1"]
    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    assert train.main([*args, "--out", ref]) == 0
    failed = []

    class HalfThenFull:
        """A file whose writes put half the bytes on disk, then fail as a full disk does."""
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            data = bytes(data)
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            failed.append(len(data))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_fdopen, real_open = os.fdopen, open

    def failing(opener):
        def wrapped(file, mode="r", *a, **kw):
            f = opener(file, mode, *a, **kw)
            name = file if isinstance(file, str) else ""
            is_ckpt = "ckpt.pt" in name or (isinstance(file, int) and "ckpt.pt" in os.readlink(f"/proc/self/fd/{file}"))
            return HalfThenFull(f) if "w" in mode and is_ckpt and saves["n"] == 2 else f
        return wrapped

    saves = {"n": 0}
    real_save = train.save_checkpoint

    def counted(state, *a):
        saves["n"] += 1
        return real_save(state, *a)
    monkeypatch.setattr(train, "save_checkpoint", counted)
    monkeypatch.setattr(os, "fdopen", failing(real_fdopen))
    monkeypatch.setattr("builtins.open", failing(real_open))
    assert train.main([*args, "--out", out]) == 2                       # saves: step 0, then step 4 fails
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert failed and "No space left on device" in err and len(err.splitlines()) == 1, err
    assert train.read_checkpoint(os.path.join(out, "ckpt.pt"), "test")["step"] == 0
    assert train.main(["--resume", "--out", out]) == 0
    a, b = _params(ref), _params(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_full_disk_stops_a_run_in_one_line_and_the_checkpoint_resumes_exactly(tmp_path, capsys):
    """--out on a 100 KB tmpfs: the second checkpoint does not fit. One line naming the file and the step of
    the whole checkpoint, exit 2, no temporary file; the folder moved to a disk with room resumes and ends
    where an uninterrupted run ends, bit for bit. A disk too small for the first checkpoint leaves nothing."""
    args = [*TINY, "--init", "mask", "--steps", "30", "--log-every", "5", "--ckpt-every", "10"]
    assert train.main([*args, "--out", str(tmp_path / "ref")]) == 0
    with _small_disk(tmp_path / "disk") as disk:
        out = disk / "run"
        capsys.readouterr()
        assert train.main([*args, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "No space left on device writing" in err, err
        saved = train.read_checkpoint(str(out / "ckpt.pt"), "test")["step"]
        assert f"the checkpoint of step {saved} in {out / 'ckpt.pt'} is whole" in err and f"--resume --out {out}" in err
        _files_whole(str(out))
        assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
        shutil.copytree(out, tmp_path / "moved")
    assert train.main(["--resume", "--out", str(tmp_path / "moved")]) == 0
    a, b = _params(tmp_path / "ref"), _params(tmp_path / "moved")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with _small_disk(tmp_path / "tiny", size="20k") as tiny:
        assert train.main([*args, "--out", str(tiny / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert "the new run had no checkpoint yet and left nothing behind" in err and len(err.splitlines()) == 1
        assert os.listdir(tiny) == []


@pytest.mark.slow
def test_resume_writes_to_the_out_given_so_a_run_folder_can_move(tmp_path):
    x, y = str(tmp_path / "X"), str(tmp_path / "Y")
    assert train.main([*TINY, "--init", "mask", "--steps", "20", "--log-every", "10", "--halt-after", "10",
                       "--seed", "1", "--out", x]) == 0
    os.rename(x, y)
    assert train.main([*TINY, "--steps", "20", "--log-every", "10", "--halt-after", "10", "--out", x]) == 0    # run B
    before = {n: open(os.path.join(x, n), "rb").read() for n in os.listdir(x)}
    assert train.main(["--resume", "--out", y]) == 0
    assert {n: open(os.path.join(x, n), "rb").read() for n in os.listdir(x)} == before      # B untouched
    res = json.load(open(os.path.join(y, "result.json")))
    saved = json.load(open(os.path.join(y, "args.json")))
    assert (res["init"], res["seed"], res["steps"], saved["out"]) == ("mask", 1, 20, y)
    # the same through a relative path from another directory
    os.chdir(tmp_path)
    os.rename(y, "Z")
    assert train.main(["--resume", "--out", "Z", "--steps", "30"]) == 0
    assert json.load(open(tmp_path / "Z" / "result.json"))["steps"] == 30


@pytest.mark.slow
def test_a_run_folder_moved_while_it_trains_is_one_line_and_resumes_bitwise(tmp_path):
    """The run folder moved away while the run trains: its next write finds no folder, the run stops with one
    line naming what happened and what to do (exit 2), and from the new place it resumes to the parameters an
    uninterrupted run reaches."""
    args = [*TINY, "--init", "mask", "--steps", "300", "--log-every", "10"]
    ref, part, moved = (str(tmp_path / n) for n in ("ref", "part", "moved"))
    assert train.main([*args, "--out", ref]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "train.py"), *args, "--out", part], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = os.path.join(part, "metrics.jsonl")
    while p.poll() is None and not (os.path.exists(log) and len(open(log).readlines()) >= 2):
        time.sleep(0.01)
    os.rename(part, moved)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the run folder {part} disappeared at step" in err and "--resume --out NEW_PLACE" in err
    assert train.main(["--resume", "--out", moved]) == 0
    a, b = _params(ref), _params(moved)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bitwise_exact(tmp_path):
    """Fault injection: a run killed with SIGKILL at random moments after it has made progress (its log has
    grown since this start; checkpoints are written every step, so some kills land inside a checkpoint write),
    and resumed each time, ends with the same parameters and the same log as an uninterrupted run; every kill
    is followed by a real resume, and no file in its folder is ever half-written."""
    # 200 steps: room for four kills after progress even where a step is fast (at 120 a resumed run could end inside
    # the kill window: 3 kills, CI at 9ecc1eb and 41a6cfa)
    # The uninterrupted run and the last resume (after the fourth kill) run in this process on one thread, as the
    # killed ones do (OMP_NUM_THREADS=1): the same rounding, two Python starts fewer.
    args = [*TINY, "--init", "mask", "--steps", "200", "--log-every", "10", "--ckpt-every", "1", "--dropout", "0.1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(HERE, "train.py"), *args]
    ref, part = str(tmp_path / "ref"), str(tmp_path / "part")
    with _torch_threads(1):
        assert train.main([*args, "--out", ref]) == 0
    log = os.path.join(part, "metrics.jsonl")
    lines = lambda: len(open(log).readlines()) if os.path.exists(log) else 0      # noqa: E731
    saved = lambda: train.read_checkpoint(os.path.join(part, "ckpt.pt"), "test")["step"]      # noqa: E731
    rng = np.random.default_rng(0)
    kills, resumed_from = 0, []
    while kills < 4:
        resume = ["--resume"] if os.path.exists(os.path.join(part, "ckpt.pt")) else []
        if resume:
            resumed_from.append(saved())
        seen = lines()
        p = subprocess.Popen([*cmd, "--out", part, *resume], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
        _wait_for(lambda: lines() > seen or p.poll() is not None, timeout=60)     # progress since this start
        time.sleep(float(rng.uniform(0.0, 0.15)))
        if p.poll() is None:
            p.kill()
            kills += 1
        p.wait(timeout=120)
        if os.path.isdir(part):
            _files_whole(part)
        assert p.returncode == -signal.SIGKILL, (kills, p.returncode, p.stderr.read())   # not ended before its kill
    resumed_from.append(saved())
    with _torch_threads(1):
        assert train.main(["--resume", "--out", part]) == 0
    assert len(resumed_from) == 4 and resumed_from == sorted(resumed_from) and resumed_from[0] > 0
    assert os.path.exists(os.path.join(part, "result.json"))
    assert not [n for n in os.listdir(part) if n.endswith(".tmp")]          # the last start cleaned up
    a = train.read_checkpoint(str(os.path.join(ref, "ckpt.pt")), "test")
    b = train.read_checkpoint(str(os.path.join(part, "ckpt.pt")), "test")
    assert a["step"] == b["step"] == 200 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    strip = lambda path: [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "run_id")}  # noqa
                          for line in open(path)]
    assert strip(os.path.join(ref, "metrics.jsonl")) == strip(os.path.join(part, "metrics.jsonl"))


def test_a_checkpoint_holding_a_cuda_rng_state_resumes_on_the_cpu_and_says_what_differs(tmp_path, capsys):
    """A run halted on a GPU (its checkpoint holds CUDA generator states and names the device) resumes where there is
    no CUDA: the CPU generator is restored, the CUDA states are not needed, and one line says the resumed run matches
    an uninterrupted one to rounding, not bitwise."""
    out = _halted(tmp_path)
    ckpt = train.read_checkpoint(os.path.join(out, "ckpt.pt"), "test")
    ckpt["rng"]["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    ckpt["machine"] = {"device": "cuda", "threads": None}
    _save_checkpoint(os.path.join(out, "ckpt.pt"), ckpt)
    capsys.readouterr()
    assert train.main(["--resume", "--out", out]) == 0
    said = capsys.readouterr().out
    assert "note: the run trained with on cuda, now on cpu" in said and "not bitwise" in said


# ---------------------------------------------------------------------------------------- report.py: summaries

def test_summarize_and_report_from_hand_written_runs(tmp_path):
    runs = tmp_path / "runs"
    boolean = runs / "boolean"
    _fake_run(boolean, "parity2", "mask", 0, 1.0)
    _fake_run(boolean, "parity2", "mask", 1, 0.5)
    _fake_run(boolean, "parity2", "default", 0, 0.75)
    _fake_run(boolean, "parity2", "qk-opt", 0, 0.75, masses=(0.7, 0.5, 0.3))
    (boolean / "parity2-qk-svd-s0").mkdir()                                  # unfinished: no result.json
    bad = _fake_run(boolean, "parity2", "qk-svd", 1, 0.75)
    (bad / "result.json").write_text("{not json")                           # corrupt
    table = reporting.report.summarize([str(boolean)])
    row = next(line for line in table.splitlines() if line.startswith("| mask |"))
    assert "| 0,1 | 75.00 ± 35.36 |" in row and row.endswith("| 75.0 | 100 |")      # mean ± std, MDI, paper
    assert table.index("| default |") < table.index("| mask |") < table.index("| qk-opt |")
    assert "parity2-qk-svd-s0: no result.json" in table and "parity2-qk-svd-s1: unreadable result.json" in table
    written = reporting.report.report(str(runs), str(tmp_path / "results"))
    names = sorted(os.path.basename(p) for p in written)
    assert {"boolean.md", "persistence.csv", "curves.csv", "steps_to_target.md"} <= set(names)
    csv = (tmp_path / "results" / "persistence.csv").read_text().splitlines()
    assert csv[0] == "task,init,seed,step,mass_mean,drift_mean,mass_layer0,mass_layer1"
    assert "parity2,qk-opt,0,20,0.30000,0.20000,0.30000,0.30000" in csv     # qk-opt: the drift of Wq Wk^T
    assert "parity2,mask,1,10,0.80000,0.10000,0.80000,0.80000" in csv       # mask: the drift of M
    assert not any(",default," in line for line in csv)                     # only the prior inits
    assert "unreadable result.json" in (tmp_path / "results" / "boolean.md").read_text()
    assert train.main(["report", str(tmp_path / "nowhere"), str(tmp_path / "r")]) == 2


@pytest.mark.slow
def test_copies_of_a_run_and_the_same_run_again_are_counted_once(tmp_path, capsys):
    """A backup copy of a run folder (the same run id), eight copies, or the same task, init, seed and flags
    run again in another folder: `summarize` and `report` count seed 0 once and name each other folder."""
    runs = tmp_path / "runs" / "boolean"
    a = runs / "parity2-mask-s0"
    assert train.main([*TINY, "--init", "mask", "--steps", "4", "--out", str(a)]) == 0
    for i in range(8):
        shutil.copytree(a, runs / f"parity2-mask-s0.backup{i}")
    assert train.main([*TINY, "--init", "mask", "--steps", "4", "--out", str(runs / "rerun")]) == 0
    assert train.main([*TINY, "--init", "mask", "--steps", "4", "--seed", "1", "--out", str(runs / "seed1")]) == 0
    table = reporting.report.summarize([str(runs)])
    assert "| mask | 0,1 |" in table
    for i in range(8):
        assert f"parity2-mask-s0.backup{i}: a copy of {a} (the same run, id " in table
    assert f"{runs / 'rerun'}: the same task, init, seed, flags and data as {a}: counted once" in table
    assert train.main(["report", str(tmp_path / "runs"), str(tmp_path / "res")]) == 0
    assert "| mask | 0,1 |" in (tmp_path / "res" / "boolean.md").read_text()
    assert sum(",mask,0," in line for line in (tmp_path / "res" / "curves.csv").read_text().splitlines()) == \
        sum(",mask,1," in line for line in (tmp_path / "res" / "curves.csv").read_text().splitlines())


def test_the_same_flags_on_other_data_are_another_run_and_on_the_same_data_moved_the_same(tmp_path):
    """Two corpora or image sets under the same flags (--data-dir tells no configuration apart) are two runs;
    the same set at another path is the same run again (result.json's data hash); a result.json without it (an
    earlier version's) is listed, not guessed from --data-dir."""
    x, y = _images(16), np.arange(16) % 10
    datafetch.write.write_cifar10_python(str(tmp_path / "one"), x, y, x[:4], y[:4])
    datafetch.write.write_cifar10_python(str(tmp_path / "two"), x[::-1].copy(), y, x[:4], y[:4])
    shutil.copytree(tmp_path / "one", tmp_path / "one-again")
    runs = tmp_path / "runs" / "vision"
    common = ["--task", "cifar10", "--init", "mask", "--layers", "1", "--dim", "24", "--mlp-dim", "48",
              "--batch-size", "8", "--steps", "2", "--log-every", "2", "--probe-size", "4"]
    for name, data in (("a", "one"), ("b", "two"), ("c", "one-again")):
        assert train.main([*common, "--data-dir", str(tmp_path / data), "--out", str(runs / name)]) == 0
    kept, problems = reporting.report.collect_runs([str(runs)])
    assert [os.path.basename(r["run_dir"]) for r in kept] == ["a", "b"]
    assert problems == [f"{runs / 'c'}: the same task, init, seed, flags and data as {runs / 'a'}: counted once"]
    res = json.load(open(runs / "c" / "result.json"))
    del res["data"]
    (runs / "c" / "result.json").write_text(json.dumps(res))
    kept, problems = reporting.report.collect_runs([str(runs)])
    assert len(kept) == 2 and problems == [f"{runs / 'c'}: unreadable result.json ({runs / 'c' / 'result.json'} has "
                                           f"no data)"]


def _curve_run(folder, task, init, seed, curve, kind="arithmetic", steps=50, log_every=10, tag="", **args):
    """A run directory with args.json (plus `args`) and a metrics.jsonl whose metrics at step 10 * i are curve[i]."""
    d = folder / f"{task}-{init}-s{seed}{tag}"
    d.mkdir(parents=True)
    (d / "args.json").write_text(json.dumps({"task": task, "init": init, "seed": seed, "out": str(d), "preset": "small",
                                             "steps": steps, "log_every": log_every, "lr": 1e-3, **args}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": 10 * i, "metrics": m, "prior_mass": [0.9],
                                                         "prior_mass_mean": 0.9}) + "\n"
                                             for i, m in enumerate(curve)))
    (d / "result.json").write_text(json.dumps({**_fake_result(task, init, seed, curve[-1], tag, steps=steps,
                                                              log_every=log_every, lr=1e-3, **args),
                                               "kind": kind, "steps": steps}))
    return d


def test_mixed_configurations_are_never_averaged(tmp_path):
    folder = tmp_path / "runs" / "arithmetic"
    _curve_run(folder, "addition", "mask", 0, [{"seq_acc": 0.0}, {"seq_acc": 0.9}])
    _curve_run(folder, "addition", "mask", 1, [{"seq_acc": 0.0}, {"seq_acc": 0.3}], steps=250, tag="-short")
    _curve_run(folder, "addition", "mask", 2, [{"seq_acc": 0.0}, {"seq_acc": 0.5}], log_every=20, tag="-log20")
    runs, _ = reporting.report.collect_runs([str(folder)])
    groups, notes = reporting.report.config_groups(runs)
    assert sorted(label for _, label in groups) == ["log_every=10, steps=250", "log_every=10, steps=50",
                                                    "log_every=20, steps=50"]
    assert notes == ["addition: 3 configurations differing in log_every, steps; each is drawn and tabulated on "
                     "its own, never averaged together"]
    table = reporting.report.summarize([str(folder)])
    assert "**addition** (log_every=10, steps=250)" in table and table.count("| mask | ") == 3
    assert "| mask | 1 | 30.00 (1 seed) |" in table                       # seed 1 alone, not the mean of three


def test_summarize_of_a_path_that_does_not_exist_is_one_line_on_stderr(tmp_path, capsys):
    _fake_run(tmp_path / "runs", "parity2", "mask", 0, 1.0)
    assert train.main(["summarize", str(tmp_path / "runs"), str(tmp_path / "no" / "such")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "summarize: " in err and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert train.main(["summarize", str(tmp_path / "runs")]) == 0 and "| mask |" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------- report.py: tables and curves

def test_report_writes_the_tables_of_the_two_studies(tmp_path):
    runs = tmp_path / "runs"
    for p, acc in (("soft", 0.8), ("local", 0.5)):
        _curve_run(runs / "visionprior", "cifar10", "mask", 0, [{"top1": acc}], kind="vision", tag=f"-{p}", pattern=p)
    _curve_run(runs / "mult2", "multiplication", "mask", 0, [{"seq_acc": 0.1, "digit_acc": 0.5}], digits=2,
               data_frac=0.3)
    written = {os.path.basename(p) for p in reporting.report.report(str(runs), str(tmp_path / "res"))}
    assert {"visionprior.md", "mult2.md"} <= written
    vision = (tmp_path / "res" / "visionprior.md").read_text()
    assert "(pattern=soft)" in vision and "| mask | 0 | 80.00 (1 seed) |" in vision and "(pattern=local)" in vision
    assert "| mask | 0 | 10.00 (1 seed) | 50.00 (1 seed) |" in (tmp_path / "res" / "mult2.md").read_text()
    # the prior's mass is drawn beside the headline metric: the mass curve of each prior
    curves = (tmp_path / "res" / "curves.csv").read_text().splitlines()
    assert 'cifar10,"pattern=soft",mask,0,0,prior_mass_mean,0.9' in curves
    assert 'cifar10,"pattern=soft",mask,0,0,top1,0.8' in curves
    if reporting.figures.pyplot() is not None:          # and every prior in one figure, top-1 and mass side by side
        assert "visionprior.png" in written and (tmp_path / "res" / "visionprior.png").read_bytes()[:4] == b"\x89PNG"


def test_ablation_table_groups_by_readout_and_positional_std(tmp_path):
    grid, boolean = tmp_path / "runs" / "ablation", tmp_path / "runs" / "boolean"
    for seed, acc in ((0, 1.0), (1, 0.5)):      # the preset's own layout: the Boolean table's runs
        _fake_run(boolean, "parity2", "mask", seed, acc, readout="mean", pos=0.02)
        _fake_run(grid, "parity2", "mask", seed, 0.75, tag="-cls-pos0.5", readout="cls", pos=0.5)
    _fake_run(boolean, "parity2", "qk-svd", 0, 0.75, readout="mean", pos=0.02)
    table = reporting.report.ablation([str(grid), str(boolean)])
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[:3] for r in rows] == [["| cls", "0.5", "mask"], ["| mean*", "0.02", "mask"],
                                                  ["| mean*", "0.02", "qk-svd"]]
    assert "| 0,1 | 75.00 ± 35.36 |" in rows[1] and "MDI: 75.0 %" in table
    written = reporting.report.report(str(tmp_path / "runs"), str(tmp_path / "results"))
    assert any(p.endswith("ablation.md") for p in written)


@pytest.fixture
def readable_figures(monkeypatch):
    """Every figure saved while the test runs (by report, show or anything else) is checked by
    `reporting.figures.figure_problems` as it is saved: {its caption: its problems}; the test fails at the end if any has one."""
    matplotlib = _extra("matplotlib")
    import matplotlib.figure
    seen, save = {}, matplotlib.figure.Figure.savefig

    def checked(fig, *args, **kw):                  # the figure as saved: drawn once, at the save's dpi
        out, dpi = save(fig, *args, **kw), fig.dpi
        fig.set_dpi(kw.get("dpi", dpi))
        seen[fig._suptitle.get_text() if fig._suptitle else repr(args[0])] = reporting.figures.figure_problems(fig, drawn=True)
        fig.set_dpi(dpi)
        return out
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked)
    yield seen
    assert seen and not {k: v for k, v in seen.items() if v}, seen


@pytest.mark.slow
def test_figure_problems_finds_a_strip_overlapping_text_and_a_blank_panel(tmp_path, readable_figures):
    """The check itself: each fault it names, made on purpose, is found; a plain figure has none."""
    plt = reporting.figures.pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(20, 3))
    for ax in axes[:4]:
        ax.plot([0, 1], [0, 1])
    axes[0].set_title("one title")
    axes[0].text(0.5, 1.0, "one title too", transform=axes[0].transAxes, ha="center", va="bottom")
    problems = reporting.figures.figure_problems(fig)
    fig.canvas.print_figure(io.BytesIO(), format="png")            # as the fixture checks: drawn by a save
    assert reporting.figures.figure_problems(fig, drawn=True) == problems
    assert any("a strip" in p for p in problems) and any("nothing drawn" in p for p in problems)
    assert any("'one title' overlaps 'one title too'" in p or "'one title too' overlaps 'one title'" in p
               for p in problems), problems
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3))
    image = ax.imshow([[0.0, 1.0]])
    fig.colorbar(image, ax=ax, label="one")
    fig.add_axes([0.8, 0.1, 0.15, 0.8]).plot([0, 1])            # over the colour bar
    assert any("overlap" in p and "panels" in p for p in reporting.figures.figure_problems(fig))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
    ax.plot([0, 1], [0, 1], label="a")
    ax.set_title("fine")
    assert reporting.figures.figure_problems(fig) == []
    reporting.figures.save_figure(fig, str(tmp_path / "fine.png"))


@pytest.mark.slow
def test_every_figure_a_report_draws_is_readable(tmp_path, readable_figures):
    """A report over small runs of every kind (three Boolean tasks x four inits, two arithmetic budgets, a data
    series, twelve vision priors side by side, an oracle-free study of two rows, a mask run with its checkpoint):
    each figure it draws is no strip, has no blank panel and no two overlapping pieces of text (readable_figures);
    M is drawn per task beside the persistence curves, and a configuration's label reads as its flags."""
    runs = tmp_path / "runs"
    for task in ("parity2", "majority3", "cyclic3"):
        for init in ("default", "mask", "qk-svd", "qk-opt"):
            for seed in (0, 1):
                _fake_run(runs / "boolean", task, init, seed, 0.75, masses=(0.9, 0.7, 0.6, 0.6 - 0.1 * seed))
    rc, _ = run_train(tmp_path, *TINY, "--init", "mask", "--steps", "4", "--log-every", "2", "--seed", "7",
                      name="runs/boolean/parity2-mask-s7")
    assert rc == 0
    for init in ("default", "mask"):
        for steps in (50, 250):
            _curve_run(runs / "arithmetic", "addition", init, 0, [{"seq_acc": 0.1 * i, "digit_acc": 0.2 * i}
                                                                 for i in range(5)], steps=steps, tag=f"-{steps}")
        for n in (500, 8000):
            _curve_run(runs / "data", "addition", init, 0, [{"seq_acc": n / 1e4, "digit_acc": 0.5, "n_train": n}],
                       tag=f"-frac{n}", data_frac=n / 1e6)
    for i in range(12):
        _curve_run(runs / "visionprior", "cifar10", "mask", 0, [{"top1": 0.05 * i + 0.01 * s} for s in range(4)],
                   kind="vision", tag=f"-p{i}", pattern=f"p{i}", qk_svd_pos_scale=None)
    pattern = tasks.make_task("parity2", readout="mean").pattern()
    for task in ("parity2", "majority3"):
        for init, tag, flags in (("default", "", {}), ("mask", "", {}), ("mask", "-discovered", {"pattern": "discovered"}),
                                 ("mask", "-teacher", {"prior_from": "T"}), ("qk-svd", "-teacher", {"prior_from": "T"})):
            d = _fake_run(runs / "oraclefree", task, init, 0, 0.75, tag=tag, readout="mean", masses=(0.9, 0.5, 0.4),
                          **flags)
            torch.save({"pattern": pattern, "logits": pattern.float(), "source": {}}, d / "prior.pt")
    written = {os.path.basename(p) for p in reporting.report.report(str(runs), str(tmp_path / "res"))}
    assert {"persistence.png", "curves.png", "data_efficiency.png", "visionprior.png", "oraclefree_mass.png",
            "oraclefree_patterns.png", "m_parity2.png"} <= written
    assert any("M at the start" not in k and "parity2 --init mask seed 7" in k for k in readable_figures)
    # redraw: the same figures again from the CSVs beside them alone (the runs deleted), from the same rows
    shutil.rmtree(runs)
    before = {f: (tmp_path / "res" / f).read_bytes() for f in os.listdir(tmp_path / "res") if not f.endswith(".png")}
    redrawn, left = reporting.report.redraw(str(tmp_path / "res"))
    assert {os.path.basename(p) for p in redrawn} == {"curves.png", "persistence.png", "data_efficiency.png",
                                                      "visionprior.png"}
    assert left == ["m_parity2.png", "oraclefree_mass.png", "oraclefree_patterns.png"]
    assert before == {f: (tmp_path / "res" / f).read_bytes() for f in before}          # tables and CSVs untouched
    curves = reporting.report.read_rows(str(tmp_path / "res" / "curves.csv"), reporting.report.CURVES_HEADER, reporting.report._curve_row)
    assert ("addition", "steps=250", "mask", 0, 30, "seq_acc", 0.3) in curves
    assert reporting.report.flag_label("qk_svd_pos_scale=None, steps=250") == "--qk-svd-pos-scale (unset), --steps 250"
    assert len({reporting.figures.line_style(i) for i in range(40)}) == 40 and reporting.figures.line_style(3, "mask") == reporting.figures.INIT_STYLES["mask"]


@pytest.mark.slow
@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_text("task,init\n"), "is not the table a report writes"),
    (lambda p: p.write_text(p.read_text() + 'parity2,"",mask,0,10,mse,inf\n'), "'inf' is not a finite number"),
    (lambda p: p.write_text(p.read_text() + 'parity2,"",mask,zero,10,mse,1\n'), "line "),
    (lambda p: p.write_text(p.read_text() + "parity2,mask\n"), "2 cells, the header has 7"),
    (lambda p: p.write_bytes(b"\xff\xfe"), "cannot read"),
])
def test_redraw_refuses_a_damaged_table_in_one_line_and_draws_nothing(tmp_path, capsys, damage, words):
    """`train.py redraw RESULTS`: a CSV that is not one a report wrote (its header, a cell, a short row, bytes that
    are not text) is one line naming it, exit 2, and no figure is drawn, not even from the other, whole CSVs."""
    _extra("matplotlib")
    runs = tmp_path / "runs"
    _curve_run(runs / "boolean", "parity2", "mask", 0, [{"acc_unseen": 0.5, "mse": 1.0}, {"acc_unseen": 1.0, "mse": 0.1}],
               kind="boolean")
    _fake_run(runs / "boolean", "parity2", "qk-svd", 0, 0.75)
    assert train.main(["report", str(runs), str(tmp_path / "res")]) == 0
    damage(tmp_path / "res" / "curves.csv")
    before = _tree(tmp_path / "res")
    capsys.readouterr()
    assert train.main(["redraw", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err
    assert words in err and "curves.csv" in err and len(err.strip().splitlines()) == 1, err
    assert _tree(tmp_path / "res") == before
    (tmp_path / "empty").mkdir()
    assert train.main(["redraw", str(tmp_path / "empty")]) == 2 and "nothing to redraw" in capsys.readouterr().err


@pytest.mark.slow
def test_show_draws_m_at_start_and_end_and_the_attention(tmp_path, capsys, monkeypatch, readable_figures):
    """train.py show RUN: m.png (M at the start and the end, a grid of layers x heads, no strip wider than 4:1) and
    attention.png for a mask run; attention.png alone for an init without M; a relative M as profiles; a folder
    without a checkpoint or an --out that is a file is one line, exit 2, nothing written."""
    _extra("matplotlib")
    from PIL import Image
    for init in ("mask", "default"):      # the preset's 2 layers x 4 heads (the figures' grid), narrower: quicker
        rc, out = run_train(tmp_path, "--task", "parity2", "--init", init, "--steps", "4", "--log-every", "2",
                            "--eval-points", "64", "--dim", "16", "--mlp-dim", "16", "--batch-size", "32",
                            "--probe-size", "16", name=init)
        assert rc == 0
        capsys.readouterr()
        assert train.main(["show", out, "--out", str(tmp_path / f"fig-{init}")]) == 0
        printed = capsys.readouterr().out.splitlines()
        files = sorted(os.listdir(tmp_path / f"fig-{init}"))
        assert files == (["attention.png", "m.png"] if init == "mask" else ["attention.png"]), printed
        assert init == "mask" or "has no M (--init default)" in printed[0]
        for f in files:
            w, h = Image.open(tmp_path / f"fig-{init}" / f).size
            assert max(w, h) <= 4 * min(w, h) and min(w, h) > 200
    start = [torch.linspace(-5, 5, 9).expand(3, 9)] * 2             # a relative M: 2 layers, 3 heads, 9 distances
    deep = [torch.randn(3, 5, 5)] * 12                               # ViT-Tiny's 12 layers x 3 heads: blocks wrap
    for path in (reporting.show.draw_m(start, [s + 1 for s in start], str(tmp_path / "rel.png"), "relative", causal=True),
                 reporting.show.draw_m(deep, deep, str(tmp_path / "deep.png"), "deep"),
                 reporting.show.draw_attention(torch.rand(12, 3, 5, 5), str(tmp_path / "deep-attention.png"), "deep")):
        w, h = Image.open(path).size
        assert max(w, h) <= 4 * min(w, h), path
    # an image's M as offsets: M[i, j] a function of the patch offset (key - query) comes back as that function
    g, prefix = 3, 1
    r, c = torch.arange(g * g) // g, torch.arange(g * g) % g
    m = torch.zeros(2, 1 + g * g, 1 + g * g)
    m[:, 1:, 1:] = 10 * (r[None, :] - r[:, None]) + (c[None, :] - c[:, None])
    dy, dx = torch.meshgrid(torch.arange(-g + 1, g), torch.arange(-g + 1, g), indexing="ij")
    assert torch.allclose(reporting.show.offset_map(m, g, prefix), (10 * dy + dx).float().expand(2, -1, -1))
    before = _tree(tmp_path)
    (tmp_path / "file").write_text("x")
    for argv, words in ((["show", str(tmp_path / "fig-mask")], "no checkpoint"),
                        (["show", str(tmp_path / "mask"), "--out", str(tmp_path / "file")], "is a file")):
        assert train.main(argv) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1
    (tmp_path / "file").unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)            # no matplotlib: one line, nothing written
    assert train.main(["show", str(tmp_path / "mask"), "--out", str(tmp_path / "none")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err and _tree(tmp_path) == before


@pytest.mark.slow
def test_show_draws_a_retrofitted_model_s_m_and_a_saved_one(tmp_path, capsys, readable_figures):
    """A retrofit's call: reporting.show.draw_model(model, path, title, mp.prior_snapshot(model) before training);
    `train.py show DIR` of its save_pretrained folder draws M at the end (its start was not saved)."""
    tf = _extra("transformers")
    from PIL import Image
    cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50, bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match="has no mask prior"):
        reporting.show.draw_model(model, str(tmp_path / "none.png"), "plain")
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(32, 4))
    snap = mp.prior_snapshot(model)
    with pytest.raises(ValueError, match="start holds 1 snapshots, the model 2 priors"):
        reporting.show.draw_model(model, str(tmp_path / "bad.png"), "gpt2", snap[:1])
    assert not (tmp_path / "bad.png").exists()
    w, h = Image.open(reporting.show.draw_model(model, str(tmp_path / "m.png"), "gpt2", snap)).size
    assert max(w, h) <= 4 * min(w, h)
    model.save_pretrained(tmp_path / "saved")
    capsys.readouterr()
    assert train.main(["show", str(tmp_path / "saved"), "--out", str(tmp_path / "fig")]) == 0
    assert os.listdir(tmp_path / "fig") == ["m.png"] and "holds no inputs to probe" in capsys.readouterr().out


@pytest.mark.slow
def test_show_of_a_crafted_saved_folder_is_one_line(tmp_path, capsys):
    """`train.py show DIR` reads a saved folder as someone else's: a pickle alone, a config.json nested 100,000
    deep, a size of 10**400 or 10**9, an M of another shape in the safetensors: each one line, exit 2, no figure
    (transformers' own errors and its pickle loader never reach the user)."""
    tf = _extra("transformers")
    from safetensors.torch import load_file, save_file
    cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50, bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(cfg)
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(32, 4))
    model.save_pretrained(tmp_path / "good")

    def crafted(name, config=None, weights=None):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "good", folder)
        if config is not None:
            (folder / "config.json").write_text(config((folder / "config.json").read_text()))
        if weights is not None:
            weights(folder)
        return folder

    def pickle_only(folder):
        torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()

    def other_m(folder):
        state = load_file(folder / "model.safetensors")
        key = next(k for k in state if "prior" in k)
        state[key] = torch.zeros(3, 5)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cases = {"pickle": crafted("pickle", weights=pickle_only),
             "deep": crafted("deep", config=lambda t: "[" * 100_000 + "]" * 100_000),
             "huge": crafted("huge", config=lambda t: t.replace('"n_embd": 32', '"n_embd": 1' + "0" * 400)),
             "big": crafted("big", config=lambda t: t.replace('"n_embd": 32', '"n_embd": 1000000000')),
             "m": crafted("m", weights=other_m)}
    for name, folder in cases.items():
        capsys.readouterr()
        assert train.main(["show", str(folder), "--out", str(tmp_path / f"fig-{name}")]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1, (name, err)
        assert not (tmp_path / f"fig-{name}").exists()


def test_one_seed_says_so_instead_of_a_spread_of_zero():
    """A table's spread: "mean ± std" over two or more runs (a real 0 shown as 0), "value (1 seed)" for one, in
    every form a report writes (a metric, the mass start → end, a cell with its count)."""
    assert reporting.report.mean_std([]) == "" and reporting.report.mean_std([0.5]) == "0.50 (1 seed)" and reporting.report.mean_std([3.0], digits=0) == "3 (1 seed)"
    assert reporting.report.mean_std([1.0, 1.0]) == "1.00 ± 0.00" and reporting.report.mean_std([1.0, 3.0], count=True) == "2.00 ± 1.41 (2)"
    assert reporting.report.mean_std([7.0], count=True) == "7.00 (1 seed)"
    one = [{"prior_mass_start": 0.9, "prior_mass_end": 0.8}]
    assert reporting.report._mass(one) == "0.90 → 0.80 (1 seed)" and reporting.report._mass(one * 2) == "0.90 ± 0.00 → 0.80 ± 0.00"
    assert reporting.report._mass([{}]) == ""


def test_learning_curves_and_steps_to_target(tmp_path):
    runs = tmp_path / "runs"
    seq = lambda *v: [{"seq_acc": x} for x in v]                           # noqa: E731
    for seed in (0, 1):
        _curve_run(runs / "arithmetic", "addition", "default", seed, seq(0, 0.1, 0.2, 0.3, 0.6, 0.8))
        _curve_run(runs / "arithmetic", "addition", "mask", seed, seq(0, 0.6, 0.95, 0.97, 0.98, 0.99))
    # a Boolean run whose untrained sign is right on U but not on the seen domain: not "reached" at step 0
    boolean = [{"acc_unseen": 1.0, "acc_seen": 0.5, "mse": 1.0}, {"acc_unseen": 0.0, "acc_seen": 1.0, "mse": 0.5},
               {"acc_unseen": 1.0, "acc_seen": 0.995, "mse": 0.01}]
    _curve_run(runs / "boolean", "parity2", "mask", 0, boolean, kind="boolean", steps=20)
    written = reporting.report.report(str(runs), str(tmp_path / "res"))
    assert {"curves.csv", "steps_to_target.md"} <= {os.path.basename(p) for p in written}
    csv = (tmp_path / "res" / "curves.csv").read_text().splitlines()
    assert csv[0] == "task,config,init,seed,step,metric,value"
    assert 'addition,"",mask,1,20,seq_acc,0.95' in csv and 'parity2,"",mask,0,10,mse,0.5' in csv
    rows = [line for line in (tmp_path / "res" / "steps_to_target.md").read_text().splitlines()
            if line.startswith("| addition") or line.startswith("| parity2")]
    assert "| addition | seq acc 50% | default | 0,1 | 2/2 | 40 ± 0 | 10 |  |" in rows
    assert "| addition | seq acc 50% | mask | 0,1 | 2/2 | 10 ± 0 | 10 | 4.0 |" in rows       # 4x fewer steps
    assert "| addition | seq acc 90% | default | 0,1 | 0/2 | not reached | 10 |  |" in rows
    assert "| addition | seq acc 90% | mask | 0,1 | 2/2 | 20 ± 0 | 10 | > 2.5 |" in rows    # default: > 50 steps
    assert any("| parity2 |" in r and "| 1/1 | 20 (1 seed) |" in r for r in rows)


def test_prior_layers_table_says_when_the_mass_moves(tmp_path):
    runs = tmp_path / "runs"
    for seed, masses in ((0, (1.0, 0.9, 0.6, 0.5)), (1, (1.0, 0.7, 0.6, 0.6))):
        _fake_run(runs / "boolean", "parity2", "mask", seed, 1.0, masses=masses)
    _fake_run(runs / "boolean", "parity2", "default", 0, 0.75, masses=(0.5, 0.4))
    reporting.report.report(str(runs), str(tmp_path / "res"))
    rows = [line for line in (tmp_path / "res" / "prior_layers.md").read_text().splitlines()
            if line.startswith("| parity2")]
    # start 1.0, lowest 0.55, end 0.55; half-way: seed 0 at step 20 (0.6 <= 0.75), seed 1 at step 10 (0.7 <= 0.8)
    assert rows == [f"| parity2 | mask | 0,1 | {layer} | 1.00 | 0.55 | 0.55 | 15 | 0.3 |  | 0.00 → {end} |"
                    for layer, end in ((0, "3.00"), (1, "6.00"))]


def test_data_efficiency_table(tmp_path):
    runs = tmp_path / "runs"
    acc = {("default", 500): (0.1, 0.2), ("default", 4000): (0.7, 0.9), ("mask", 500): (0.8, 0.9),
           ("mask", 4000): (0.95, 0.97), ("default", 8000): (0.95, 0.99), ("mask", 8000): (0.99, 0.99)}
    for (init, n), accs in acc.items():
        for seed, a in enumerate(accs):
            m = {"seq_acc": a, "digit_acc": a, "n_train": n}
            if n == 4000:      # the arithmetic table's runs: --data-frac left at the task's default
                _curve_run(runs / "arithmetic", "addition", init, seed, [m], data_frac=None)
            else:
                _curve_run(runs / "data", "addition", init, seed, [m], tag=f"-frac{n / 1e6}", data_frac=n / 1e6)
    # another budget in the arithmetic folder: a configuration of its own, never mixed into the series
    _curve_run(runs / "arithmetic", "addition", "mask", 0, [{"seq_acc": 0.0, "digit_acc": 0.0, "n_train": 4000}],
               steps=250, tag="-250steps", data_frac=None)
    # an init run at one size only (the arithmetic table's qk-opt) is no series: not a column
    _curve_run(runs / "arithmetic", "addition", "qk-opt", 0, [{"seq_acc": 0.9, "digit_acc": 0.9, "n_train": 4000}],
               data_frac=None)
    written = reporting.report.report(str(runs), str(tmp_path / "res"))
    assert {"data_efficiency.md", "data_efficiency.csv"} <= {os.path.basename(p) for p in written}
    assert "qk-opt seq acc" not in (tmp_path / "res" / "data_efficiency.md").read_text()
    text = (tmp_path / "res" / "data_efficiency.md").read_text()
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line[2:3].isdigit()}
    assert rows["| 4,000"] == "| 4,000 | 0.4 | 80.00 ± 14.14 (2) | 96.00 ± 1.41 (2) | 500 (8x less) |"
    assert rows["| 8,000"].endswith("| 97.00 ± 2.83 (2) | 99.00 ± 0.00 (2) | 8,000 |")     # mask 99 >= 97: 8,000
    assert rows["| 500"].endswith("| 500 |") and "steps=250" in text and "one training set size only" in text
    csv = (tmp_path / "res" / "data_efficiency.csv").read_text().splitlines()
    assert csv[0] == "config,init,seed,n_train,seq_acc,digit_acc" and len(csv) == 1 + 12 + 1 + 1


def test_report_writes_the_oracle_free_table_and_the_found_patterns(tmp_path):
    """reproduce.sh --only oraclefree's runs (TASK-INIT-sSEED-TAG): a row per task (and corpus), a column per
    variant (headline metric, mean ± std, seeds), the precision and recall of the found patterns, and with
    matplotlib the patterns beside the hand one and the mass curves."""
    folder = tmp_path / "runs" / "oraclefree"
    acc = {("default", ""): 0.0, ("mask", ""): 1.0, ("mask", "discovered"): 1.0, ("mask", "teacher"): 0.5,
           ("qk-svd", "teacher"): 0.1, ("default", "budget2x"): 0.02}
    found = tasks.make_task("parity2", readout="mean").pattern()
    flags = {"": {}, "discovered": {"pattern": "discovered"}, "teacher": {"prior_from": "T"}, "budget2x": {"steps": 1200}}
    for (init, tag), a in acc.items():
        for seed in (0, 1):
            d = _fake_run(folder, "parity2", init, seed, 0.75, tag=f"-{tag}" if tag else "", readout="mean",
                          **flags[tag])
            res = json.load(open(d / "result.json"))
            res["metrics"]["acc_unseen"] = a + 0.01 * seed
            if tag:
                res["prior_source"] = {"from": "data" if tag == "discovered" else "teacher", "precision": 0.5 + 0.5 * seed,
                                       "recall": 1.0}
            torch.save({"pattern": found, "logits": found.float(), "source": res.get("prior_source") or {}},
                       d / "prior.pt")
            (d / "result.json").write_text(json.dumps(res))
    written = reporting.report.report(str(tmp_path / "runs"), str(tmp_path / "res"))
    table = (tmp_path / "res" / "oraclefree.md").read_text().splitlines()
    assert table[0] == ("| task | metric | default | hand pattern, mask | found in the data, mask | from the teacher, mask "
                        "| the teacher's pattern, qk-svd | default, the teacher's + the student's steps |")
    assert table[2] == ("| parity2 | accuracy on U % | 0.50 ± 0.71 (2) | 100.50 ± 0.71 (2) | 100.50 ± 0.71 (2) | "
                        "50.50 ± 0.71 (2) | 10.50 ± 0.71 (2) | 2.50 ± 0.71 (2) |")
    assert "| parity2 | the data | 0.75 ± 0.35 | 1.00 ± 0.00 | 2 |" in table
    assert "| parity2 | teacher | 0.75 ± 0.35 | 1.00 ± 0.00 | 2 |" in table
    if reporting.figures.pyplot() is not None:
        assert {"oraclefree_patterns.png", "oraclefree_mass.png"} <= {os.path.basename(p) for p in written}


def test_oracle_free_rows_and_columns_come_from_the_folder_names():
    """The row is the task plus the corpus or the step count a tag names; the default at a teacher's steps plus
    its student's (samebudget) is the budget2x column; a seed's digits inside a tag do not split it."""
    cell = lambda name, task, seed: reporting.report.oracle_free_cell({"run_dir": f"/r/oraclefree/{name}", "task": task,   # noqa: E731
                                                        "seed": seed})
    assert cell("parity2-mask-s0", "parity2", 0) == ("parity2", "")
    assert cell("parity2-mask-s1-teacher", "parity2", 1) == ("parity2", "teacher")
    assert cell("parity2-default-s1-budget2x", "parity2", 1) == ("parity2", "budget2x")
    assert cell("wikitext2-mask-s0-corpusB-teacher", "wikitext2", 0) == ("wikitext2, corpus B", "teacher")
    assert cell("wikitext2-default-s2-corpusA", "wikitext2", 2) == ("wikitext2, corpus A", "")
    assert cell("addition-mask-s0-250steps", "addition", 0) == ("addition, 250 steps", "")
    assert cell("addition-qk-svd-s3-250steps-teacher", "addition", 3) == ("addition, 250 steps", "teacher")
    assert cell("addition-mask-s1-250steps-discovered", "addition", 1) == ("addition, 250 steps", "discovered")
    assert cell("addition-default-s0-250steps-samebudget", "addition", 0) == ("addition, 250 steps", "budget2x")
    assert cell("addition-default-s0", "addition", 0) == ("addition", "")
    assert cell("cifar10-mask-s4-teacher-impulse", "cifar10", 4) == ("cifar10", "teacher-impulse")


# ---------------------------------------------------------------------------------------- report.py: broken runs

@pytest.mark.slow
def test_report_lists_a_non_numeric_metric_instead_of_crashing(tmp_path):
    out = tmp_path / "runs" / "boolean" / "parity2-mask-s0"
    assert train.main([*TINY, "--init", "mask", "--steps", "5", "--out", str(out)]) == 0
    res = json.load(open(out / "result.json"))
    res["metrics"]["acc"] = "high"
    (out / "result.json").write_text(json.dumps(res))
    table = open(reporting.report.report(str(tmp_path / "runs"), str(tmp_path / "results"))[0]).read()
    assert "metric acc is 'high', not a finite number" in table


def _report_case(tmp_path, case, once=None):
    """A finished real run in runs/boolean, then broken as `case` says; returns (runs, its folder)."""
    runs = tmp_path / "runs"
    out = runs / "boolean" / "parity2-mask-s0"
    _train(out, *TINY, "--init", "mask", "--steps", "10", "--log-every", "5", once=once)
    _fake_run(runs / "boolean", "parity2", "default", 0, 0.75)        # a healthy neighbour: its row must stay
    res, log = out / "result.json", out / "metrics.jsonl"
    if case == "result.json without seed":
        _edit_json(res, lambda d: d.pop("seed"))
    elif case == "seed a string":
        _edit_json(res, lambda d: d.update(seed="0"))
    elif case == "seed 10^30":
        _edit_json(res, lambda d: d.update(seed=10 ** 30))
    elif case == "a task name of markdown":
        _edit_json(res, lambda d: d.update(task="parity2 |\n## injected"))
    elif case == "an unknown kind":
        _edit_json(res, lambda d: d.update(kind="other"))
    elif case == "an unknown init":
        _edit_json(res, lambda d: d.update(init="qk-svd2"))
    elif case == "result.json a list":
        res.write_text("[]")
    elif case == "NaN metric":
        _edit_json(res, lambda d: d["metrics"].update(acc=float("nan")))
    elif case == "precision NaN":                          # a hostile study's result: as an oracle-free run records it
        _edit_json(res, lambda d: d.update(prior_source={"from": "data", "precision": "NaN", "recall": 1.0}))
    elif case == "recall a string":
        _edit_json(res, lambda d: d.update(prior_source={"from": "teacher", "precision": 1.0, "recall": "x"}))
    elif case == "result.json a FIFO":
        os.remove(res)
        os.mkfifo(res)
    elif case == "non-UTF-8 log line":
        with open(log, "ab") as f:
            f.write(b'{"step": 7, "metrics": {"acc": 1.0}, "note": "\xff\xfe"}\n')
    elif case == "log line without metrics":
        with open(log, "a") as f:
            f.write('{"step": 7, "x": 1}\n{"step": 8, "metrics": {}, "prior_mass": ["a"]}\n')
    elif case == "log a folder":
        os.remove(log)
        os.mkdir(log)
    elif case == "result.json nested 200,000 deep":
        res.write_text('{"metrics": ' + "[" * 200_000 + "]" * 200_000 + "}")
    elif case == "a 400-digit metric":
        res.write_text(res.read_text().replace('"metrics": {', '"metrics": {"big": ' + "9" * 400 + ", ", 1))
    elif case == "a log mass of 1e400":
        with open(log, "a") as f:
            f.write('{"step": 11, "metrics": {}, "prior_mass": [1e400], "prior_mass_mean": 1e400}\n')
    return runs, out


@pytest.mark.slow
@pytest.mark.parametrize("case,listed", [
    ("result.json without seed", "parity2-mask-s0: unreadable result.json ("),
    ("seed a string", "result.json: seed is '0', not a seed in 0 .. 2^32 - 1)"),
    ("seed 10^30", "not a seed in 0 .. 2^32 - 1)"), ("a task name of markdown", "not a task name)"),
    ("an unknown kind", "not one of boolean, arithmetic, vision, lm)"),
    ("an unknown init", "init is 'qk-svd2', not one of default, mask, qk-svd, qk-opt, mimetic, impulse, mask-impulse)"),
    ("result.json a list", "result.json holds a list, not the dict this program writes there)"),
    ("NaN metric", "result.json: metric acc is nan, not a finite number)"),
    ("precision NaN", "result.json: prior_source is {"),
    ("recall a string", "not null or a dict whose precision and recall are in [0, 1])"),
    ("result.json a FIFO", "result.json is a FIFO (named pipe), not a regular file"),
    ("non-UTF-8 log line", None), ("log line without metrics", None), ("log a folder", None),
    ("result.json nested 200,000 deep", "nested more than 64 levels deep)"),
    ("a 400-digit metric", "an integer of 400 digits (at most 40))"), ("a log mass of 1e400", None),
])
def test_no_broken_run_breaks_a_report(tmp_path, capsys, trained_once, case, listed):
    """The report of a folder with one broken run: exit 0, every table written, the healthy run's row
    there, and the broken run either listed by name with what is wrong, or in its table (a bad log line is
    dropped like a cut one; a log that cannot be read leaves the run without curves)."""
    runs, out = _report_case(tmp_path, case, once=trained_once)
    (tmp_path / "res").mkdir()
    (tmp_path / "res" / "mult2.md").write_text("an earlier report's table\n")
    with _deadline(120):
        assert train.main(["report", str(runs), str(tmp_path / "res")]) == 0
    said = capsys.readouterr()
    assert said.err == "" and said.out.endswith("not made by these runs, left as they were (an earlier report's, or "
                                                "yours): mult2.md\n")
    assert (tmp_path / "res" / "mult2.md").read_text() == "an earlier report's table\n"
    table = (tmp_path / "res" / "boolean.md").read_text()
    assert "| default | 0 | 75.00 (1 seed) |" in table
    assert {"curves.csv", "steps_to_target.md", "prior_layers.md", "persistence.csv"} <= set(os.listdir(tmp_path / "res"))
    if listed:
        assert listed in table and "| mask |" not in table and "nan" not in table.replace(listed, "")
    else:
        assert "| mask | 0 |" in table


@pytest.mark.slow
def test_report_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    runs, _ = _report_case(tmp_path, "")
    (tmp_path / "file").write_text("x")
    for out, needle in ((tmp_path / "file", "is a file; give a folder"),
                        (tmp_path / "file" / "sub", "cannot write")):
        assert train.main(["report", str(runs), str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    with _small_disk(tmp_path / "ro", read_only=True) as ro:
        assert train.main(["report", str(runs), str(ro)]) == 2
        err = capsys.readouterr().err.strip()
        assert "Read-only file system" in err and len(err.splitlines()) == 1, err
    with _small_disk(tmp_path / "full", size="20k") as full:       # the tables fit, the figure does not
        rc = train.main(["report", str(runs), str(full)])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "No space left on device" in err and len(err.splitlines()) == 1, err
        assert not [n for n in os.listdir(full) if n.endswith(".tmp")]


@pytest.mark.parametrize("where", ["a table's folder", "an empty folder", "a folder of other things"])
def test_report_on_a_folder_without_table_folders_is_one_line_and_writes_nothing(tmp_path, capsys, where):
    runs = tmp_path / "runs"
    if where == "a table's folder":
        _fake_run(runs / "boolean", "parity2", "mask", 0, 1.0)
        given = runs / "boolean"
    elif where == "an empty folder":
        runs.mkdir()
        given = runs
    else:
        (runs / "notes").mkdir(parents=True)
        given = runs
    assert train.main(["report", str(given), str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds none of the table folders" in err and "nothing was written" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "res").exists()
    if where == "a table's folder":
        assert f"give the folder above it: python train.py report {runs}" in err


@pytest.mark.slow
def test_a_report_killed_mid_write_leaves_no_temporary_file_for_good(tmp_path):
    runs, _ = _report_case(tmp_path, "")
    res = tmp_path / "res"
    res.mkdir()
    stale = [res / ".curves.png.k3j_x9ab.tmp", res / ".boolean.md.q1w2e3r4.tmp"]   # what SIGKILL leaves
    for p in stale:
        p.write_bytes(b"half")
    (res / ".notes.txt.abcdefgh.tmp").write_text("not ours")
    reporting.report.report(str(runs), str(res))
    assert not any(p.exists() for p in stale) and (res / ".notes.txt.abcdefgh.tmp").exists()


# ---------------------------------------------------------------------------------------- reproduce.sh

def _fake_python(path: Path, body: str) -> Path:
    """A stand-in interpreter for reproduce.sh's runs (a shell script of `body`) that hands `-m reporting.plan` (the run
    list) to this Python."""
    path.write_text(f'#!/bin/sh\n[ "$1" = -m ] && exec {sys.executable} "$@"\n{body}\n')
    path.chmod(0o755)
    return path


def _reproduce_call(*args, env=None) -> tuple:
    """`bash reproduce.sh ARGS` (with `env` added to this environment) as a call for _at_once or _running: calls on
    folders of their own run at once, each reading the plan in a Python of its own."""
    return ["bash", os.path.join(HERE, "reproduce.sh"), *args], {"env": {**os.environ, **(env or {})}}


def _reproduce(*args, env=None):
    return _at_once(_reproduce_call(*args, env=env), timeout=60)[0]


def _planned(only=None, quick=False, data=None, runs="RUNS"):
    """reporting.plan's run list (the one reproduce.sh reads) as lines like reproduce.sh's dry run: the run's folder
    under RUNS, its preset and flags (@RUNS filled in)."""
    plan = reporting.plan.run_list(quick, only, (0,), data)
    preset = "small" if plan.quick else "paper"
    lines = [f"{runs}/{r.table}/{r.name} --preset {preset} {r.flags.replace('@RUNS', runs)} " for r in plan.runs]
    return lines, reporting.plan.describe(plan, {})


def test_the_plan_lists_each_table_s_runs():
    """Which runs each table and study makes: one list (reporting/plan.py), read by reproduce.sh and bench_paper."""
    starts, text = _planned("arithmetic", quick=True)
    assert len(starts) == 16 and sum("multiplication-" in line and "-250steps " in line for line in starts) == 4
    assert sum("addition-qk-svd-s0 " in line for line in starts) == 1          # every init at convergence too
    # data efficiency: default and mask at four fractions in data/, the 0.4% runs are the arithmetic table's
    starts, text = _planned("data")
    assert len(starts) == 10 and "small (CPU)" in text
    assert sum("/data/addition-mask-s0-frac0.0005 " in line and "--data-frac 0.0005" in line for line in starts) == 1
    assert sum("/arithmetic/addition-" in line and "--data-frac" not in line for line in starts) == 2
    # the robustness grid: the off-preset cells in ablation/, the preset's own cells are the Boolean runs
    lines, text = _planned("ablation")
    grid = [line for line in lines if "/ablation/" in line]
    assert len(lines) == 30 and len(grid) == 18 and "small (CPU)" in text
    assert not any("parity2-mask-s0-mean-pos0.02" in line for line in grid)
    assert any("parity2-mask-s0-cls-pos0.5 " in line and "--readout cls" in line for line in grid)
    # the two studies of the missing claims: two-digit multiplication and the vision priors
    starts, _ = _planned("mult2")
    assert len(starts) == 10 and all("--digits 2" in x and "--answer-order lsb" in x for x in starts)
    assert sum("/mult2/multiplication-mask-s0-d2-frac0.03-partial " in x and "--pattern partial" in x for x in starts) == 1
    assert sum("/mult2/multiplication-qk-opt-s0-d2-frac0.3 " in x and "--data-frac 0.3 " in x for x in starts) == 1
    starts, _ = _planned("lee", quick=True)
    assert len(starts) == 12 and all("--digits 2 --lee-samples 3000" in x for x in starts)
    assert sum("/lee/multiplication-mask-s0-lsb-ep500 " in x and "--epochs 500 --log-every 600" in x for x in starts) == 1
    starts, _ = _planned("lee")                                   # Lee et al.'s, on a GPU
    assert len(starts) == 2 and all("--preset paper" in x and "--batch-size 6400" in x and "--answer-order msb" in x
                                    for x in starts)
    starts, _ = _planned("visionprior")
    assert len(starts) == 14
    assert sum("cifar10-qk-svd-s0-pos18 " in x and "--qk-svd-pos-scale 18" in x for x in starts) == 1
    assert sum("cifar10-mask-impulse-s0-soft " in x and "--pattern soft" in x for x in starts) == 1
    assert sum("cifar10-mask-s0-soft " in x and "--pattern soft" in x for x in starts) == 1
    assert sum("cifar10-mask-s0-impulse-off2 " in x and "--mask-off 2" in x for x in starts) == 1
    assert sum("cifar10-mask-s0-soft-alpha3 " in x and "--soft-alpha 3" in x for x in starts) == 1
    # priors without an oracle: teachers, then students that read them; the digits (--data) and the two corpora
    starts, text = _planned("oraclefree")
    assert len(starts) == 89 and "89 runs" in text
    # round two: the data route on small training sets, 2-digit multiplication, two targets that mix structures
    assert sum("/kmajority-mask-s0-n100-discovered " in x and "--train-size 100 --pattern discovered" in x
               for x in starts) == 1
    assert sum("/kparity-default-s0-all " in x and "--bits 2,7,11 --unseen 2,7 " in x for x in starts) == 1
    assert sum(x.rstrip().endswith("--prior-from RUNS/oraclefree/ksum-default-s0-summaj") for x in starts) == 1
    assert [x.split("/oraclefree/")[1].split()[0] for x in starts].index("ksum-mask-s0-sum23-teacher") > \
        [x.split("/oraclefree/")[1].split()[0] for x in starts].index("ksum-default-s0-sum23")
    grid, _ = _planned("parity3")
    assert len(grid) == 32 and sum("kparity-mask-s0-U2-mean-pos0.5-L3 " in x and "--unseen 2 --readout mean "
                                   "--pos-init-std 0.5 --layers 3" in x for x in grid) == 1
    teacher = "--prior-from RUNS/oraclefree/majority3-default-s0"
    assert sum("/majority3-mask-s0-teacher " in x and x.rstrip().endswith(teacher) for x in starts) == 1
    assert sum("/majority3-qk-svd-s0-teacher " in x and teacher in x for x in starts) == 1
    assert sum("/kparity-mask-s0-discovered " in x and "--bits random:2 --unseen bits:2 --pattern discovered" in x
               for x in starts) == 1
    assert sum("/cyclic3-default-s0-budget2x " in x and "--steps 16000" in x for x in starts) == 1
    # addition's students at 250 steps (its default is at 98% by 1,500), its 1,500-step defaults their teachers
    add = [x for x in starts if "/oraclefree/addition-" in x]
    assert sum("/addition-default-s0 " in x and "--steps" not in x for x in add) == 1
    assert all("--steps 250 " in x for x in add if "-250steps" in x and "samebudget" not in x)
    assert sum(x.rstrip().endswith("--prior-from RUNS/oraclefree/addition-default-s0") for x in add) == 2
    assert sum("-250steps-samebudget " in x and "--steps 1750 " in x for x in add) == 1 and len(add) == 7
    assert sum("/wikitext2-mask-s0-corpusB-teacher " in x and "vimtext-b" in x and "s0-corpusA" in x for x in starts) == 1
    order = [x.split("/oraclefree/")[1].split()[0] for x in starts]
    assert order.index("parity2-mask-s0-teacher") > order.index("parity2-default-s0") and order[-1].startswith("cyclic3")


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


DAMAGED = {   # a layout -> (a file or folder of it, what to do to it, what the skip says)
    "cifar10 python": ("cifar-10-batches-py/data_batch_3", "empty", "is empty"),
    "cifar10 binary": ("cifar-10-batches-bin/test_batch.bin", "cut", "not whole 3073-byte records"),
    "cifar100 python": ("cifar-100-python/test", "text", "does not open as the release's files do"),
    "cifar100 binary": ("cifar-100-binary/train.bin", "empty", "is empty"),
    "imagenet100 downsampled": ("imagenet100/val_data", "empty", "is empty"),
    "imagenet100 folder": ("imagenet100/val", "no images", "holds no image"),
    "wikitext2 tokens": ("wikitext-2/wiki.test.tokens", "empty", "is empty"),
    "tinystories V2": ("TinyStoriesV2-GPT4-valid.txt", "empty", "is empty"),
}


@pytest.mark.parametrize("layout", list(DAMAGED))
def test_the_plan_counts_a_release_present_only_if_its_files_pass_the_header_check(tmp_path, layout):
    """A release whose file is empty, cut short of whole records or not a pickle, or an ImageNet tree with a class
    folder empty, is not counted as present: the plan skips its runs naming the file (`tasks.release_file`, the check
    the readers make before decoding a byte), where the names alone would have counted it."""
    task, table = layout.split()[0], tasks.TASKS[layout.split()[0]].KIND
    folder = _write_layout(tmp_path / "data", layout)
    path, damage, words = DAMAGED[layout]
    path = tmp_path / "data" / path
    if damage == "no images":
        for f in path.glob("*/*"):
            f.unlink()
    else:
        path.write_bytes({"empty": b"", "text": b"not a pickle", "cut": path.read_bytes()[:-7]}[damage])
    skipped = dict(reporting.plan.run_list(only=table, seeds=(0,), data=str(tmp_path / "data")).skipped[table])
    why = next(reason for what, reason in skipped.items() if what.split()[0] == task)
    assert words in why and str(path) in why, why
    with pytest.raises(tasks.DataError, match=re.escape(words)):
        tasks.TASKS[task].locate(folder)


@pytest.mark.parametrize("layout", ["cifar10 python", "cifar10 binary", "cifar100 python", "cifar100 binary",
                                    "imagenet100 downsampled", "imagenet100 downsampled npz", "imagenet100 folder",
                                    "wikitext2 tokens", "wikitext2 raw", "tinystories V2", "tinystories V1"])
def test_the_plan_finds_every_layout_the_readers_read(tmp_path, monkeypatch, layout):
    """reproduce.sh's plan counts a dataset's runs in every release layout its reader reads (found by the task's own
    `locate`, then read by the reader train.py uses), and skips them, saying where to get it, in a folder without."""
    task = layout.split()[0]
    table = tasks.TASKS[task].KIND
    data = tmp_path / "data"
    folder = _write_layout(data, layout)
    if table == "vision":
        got = tasks.load_image_dataset(task, folder, 32)
        assert len(got["train"][0]) > 0 and len(got["test"][0]) > 0
    else:
        assert len(tasks.load_lm_corpus(task, folder)["train"]) > 0
    plan = reporting.plan.run_list(only=table, seeds=(0,), data=str(data))
    assert sum(r.task == task for r in plan.runs) == (5 if table == "vision" else 4 if task == "wikitext2" else 2)
    assert not any(what.split()[0] == task for skips in plan.skipped.values() for what, _ in skips)
    empty = reporting.plan.run_list(only=table, seeds=(0,), data=str(tmp_path / "empty"))
    assert not any(r.task == task for r in empty.runs)
    why = {what.split()[0]: reason for what, reason in empty.skipped[table]}[task]
    assert "not found" in why and ("http" in why or "download" in why)
    if layout == "imagenet100 folder":                      # what else the layout needs is looked for too
        monkeypatch.setitem(sys.modules, "PIL", None)
        skipped = dict(reporting.plan.run_list(only=table, seeds=(0,), data=str(data)).skipped[table])
        assert "needs Pillow: pip install pillow" in skipped["imagenet100 (5 runs)"]


@pytest.mark.slow
def test_reproduce_help_and_dry_run(tmp_path):
    """What the script itself does with the plan's list: the dry run's lines, the folders and data filled in, a
    finished run skipped and an interrupted one resumed, missing data named, a failed run named."""
    # the folders each call reads, made first; then every call at once (each on folders of its own)
    runs = tmp_path / "runs"
    _fake_run(runs / "boolean", "parity2", "mask", 0, 1.0)                  # finished
    (runs / "boolean" / "parity2-default-s0").mkdir()                       # interrupted
    (runs / "boolean" / "parity2-default-s0" / "ckpt.pt").write_bytes(b"")
    datafetch.write.write_cifar10_python(str(tmp_path / "digits"), _images(10), np.arange(10), _images(4), np.arange(4))
    for corpus in ("vimtext-a", "vimtext-b"):
        (tmp_path / "digits" / corpus / "wikitext-2").mkdir(parents=True)
        for split in ("train", "valid", "test"):                  # the whole layout the reader reads
            (tmp_path / "digits" / corpus / "wikitext-2" / f"wiki.{split}.tokens").write_text(" = A = \n a b \n")
    fake = _fake_python(tmp_path / "false", "exit 1")
    fresh = tmp_path / "fresh"
    helped, quick, boolean, oraclefree, nodata, tables, failed = _at_once(
        _reproduce_call("--help"),
        _reproduce_call("--quick", "--dry-run", "--runs", str(fresh)),
        _reproduce_call("--quick", "--dry-run", "--only", "boolean", "--seeds", "0", "--runs", str(runs)),
        _reproduce_call("--only", "oraclefree", "--dry-run", "--seeds", "0", "--runs", str(runs), "--data",
                        str(tmp_path / "digits")),
        _reproduce_call("--dry-run", "--only", "vision", "--data", str(tmp_path / "nodata")),
        _reproduce_call("--only", "tables"),
        _reproduce_call("--quick", "--only", "boolean", "--seeds", "0", "--runs", str(tmp_path / "fail"),
                        "--results", str(tmp_path / "res"), env={"PYTHON": str(fake)}), timeout=60)
    assert helped.returncode == 0 and "--quick" in helped.stdout and "--only TABLE" in helped.stdout
    starts = [line for line in quick.stdout.splitlines() if line.startswith("start")]
    assert quick.returncode == 0 and len(starts) == 54 and quick.stdout.startswith("plan: 54 runs")
    assert not fresh.exists()                                       # a dry run makes no folder
    assert all("--preset small" in line for line in starts)
    short = [line for line in starts if "-250steps " in line]      # addition at the paper's regime, 4 inits x 3
    assert len(short) == 12 and all("--steps 250 --log-every 10 --eval-points 500" in line for line in short)
    assert not any("multiplication" in line for line in starts)
    # a finished run is skipped, an interrupted one resumed
    lines = boolean.stdout.splitlines()
    assert any(line.startswith("skip") and "parity2-mask-s0" in line for line in lines)
    assert any(line.startswith("resume") and "parity2-default-s0" in line for line in lines)
    assert sum(line.startswith(("start", "resume", "skip")) for line in lines) == 12
    # @DATA and @RUNS filled in: the digits (--data) and the two corpora, teachers read from --runs
    starts = [line for line in oraclefree.stdout.splitlines() if line.startswith("start")]
    assert oraclefree.returncode == 0 and len(starts) == 89 and "89 runs" in oraclefree.stdout
    planned = [x.replace("@DATA", str(tmp_path / "digits")).split(" --preset small ") for x in
               _planned("oraclefree", runs=str(runs))[0]]
    assert [shlex.split(x.split(" --out ")[1]) for x in starts] == [[o, *f.split()] for o, f in planned]
    assert sum(f"--data-dir {tmp_path / 'digits'}/vimtext-b" in x for x in starts) == 4      # its teacher, 3 students
    # missing datasets are named, not fatal
    assert nodata.returncode == 0 and "skipped: vision cifar10 (15 runs)" in nodata.stdout
    assert "cifar-10-batches-py" in nodata.stdout and tables.returncode == 2
    # a failing run makes the script exit 1 and names the run
    assert failed.returncode == 1 and "FAILED" in failed.stderr and "parity2-mask-s0" in failed.stderr


@pytest.mark.slow
def test_reproduce_refuses_a_flag_without_value_and_duplicate_seeds(tmp_path, capsys):
    """reproduce.sh and `python -m reporting.plan` check their flags as train.py does: a value, each flag once, a seed
    in 0 .. 2^32 - 1 once, a folder where a folder is meant; each refusal one line, exit 2, nothing started."""
    r = _reproduce("--quick", "--dry-run", "--runs", "/nonexistent/runs", "--only")
    assert r.returncode == 2 and "--only needs a value" in r.stderr
    (tmp_path / "file").write_text("x")
    for argv, words in ((["--seeds", "0 0"], "seed 0 twice"), (["--seeds", "0", "--seeds", "1"], "--seeds is given twice"),
                        (["--seeds", "99999999999"], "99999999999 is not a seed in 0 .. 4294967295"),
                        (["--runs", str(tmp_path / "file")], "is a file; --runs and --results take a folder")):
        r = _reproduce("--quick", "--dry-run", *argv)
        assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)
    for argv, words in ((["--seeds", "-1"], "'-1' is not an integer in 0..4294967295"),
                        (["--seeds", "0", "--seeds", "1"], "--seeds is given twice"), (["--seeds", "1 1"], "distinct")):
        capsys.readouterr()
        try:            # `python -m reporting.plan ARGV` is sys.exit(main(ARGV)); its start is not what this tests
            code = reporting.plan.main(argv)
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and out == "", (argv, err)


@pytest.mark.slow
def test_reproduce_reports_an_interrupted_run_as_interrupted(tmp_path):
    fake = _fake_python(tmp_path / "py", "exit 130")
    r = _reproduce("--quick", "--only", "boolean", "--seeds", "0", "--jobs", "1", "--runs", str(tmp_path / "runs"),
                   "--results", str(tmp_path / "res"), env={"PYTHON": str(fake)})
    assert r.returncode == 130 and "interrupted" in r.stderr and "FAILED" not in r.stderr + r.stdout
    assert not (tmp_path / "runs" / "failed.txt").exists()


def _processes_naming(text: str) -> list[str]:
    """The command lines of the live processes that mention `text` (from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line:
            found.append(line)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="looks for left-over runs in /proc (Linux)")
def test_reproduce_passes_sigterm_and_sigint_on_to_its_runs_and_resumes(tmp_path):
    """SIGTERM to reproduce.sh: both running runs save a checkpoint and exit, no new run starts, the script
    waits for them and exits 143 with no process of the runs left; the same command again resumes both
    (no folder in use), and SIGINT then stops it with 130."""
    runs = tmp_path / "runs"
    cmd = ["bash", os.path.join(HERE, "reproduce.sh"), "--quick", "--only", "boolean", "--seeds", "0", "--jobs", "2",
           "--runs", str(runs), "--results", str(tmp_path / "res")]
    logs = [runs / "boolean" / f"parity2-{i}-s0.log" for i in ("default", "mask")]
    for sig, code, said in ((signal.SIGTERM, 143, "step "), (signal.SIGINT, 130, "resuming ")):
        # as started from a terminal: a shell that inherits an ignored SIGINT (a `cmd &` in a script) cannot trap it
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        started = _wait_for(lambda: all(log.exists() and said in log.read_text().split("saving a checkpoint")[-1]
                                        for log in logs))
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
        assert started and p.returncode == code, (out, err)
        launched = [line for line in out.splitlines() if line.split()[1:2] in (["start"], ["resume"])]
        assert err.count("interrupted /") == 2 and "FAILED" not in err and len(launched) == 2   # no new run
        assert _processes_naming(str(runs)) == []                      # no run left behind
        for i in ("default", "mask"):
            folder = runs / "boolean" / f"parity2-{i}-s0"
            assert train.read_checkpoint(str(folder / "ckpt.pt"), "test")["step"] > 0 and not (folder / "result.json").exists()
        assert sorted(p.name for p in (runs / "boolean").iterdir() if p.is_dir()) == ["parity2-default-s0", "parity2-mask-s0"]
    text = logs[1].read_text()
    assert "in use" not in text and text.count("resuming ") == 1 and "saving a checkpoint" in text


@pytest.mark.slow
def test_reproduce_takes_folders_from_where_it_is_started_and_data_paths_with_spaces(tmp_path):
    """--runs and --results given as relative paths are read from the folder the script is started in, and a
    --data folder with a space reaches train.py as one argument (a stand-in python records its arguments)."""
    fake = _fake_python(tmp_path / "py", 'for a in "$@"; do echo "$a"; done >> "$ARGS_LOG"; echo ok')
    data = tmp_path / "my data &1"
    datafetch.write.write_cifar10_python(str(data), _images(10), np.arange(10), _images(4), np.arange(4))
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = subprocess.run(["bash", os.path.join(HERE, "reproduce.sh"), "--only", "vision", "--seeds", "0", "--data",
                        "../my data &1", "--runs", "relruns", "--results", "relres"], cwd=work, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHON": str(fake), "ARGS_LOG": str(tmp_path / "args")})
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "args").read_text().splitlines()
    dirs = [args[i + 1] for i, a in enumerate(args) if a == "--data-dir"]
    assert len(dirs) == 5 and set(dirs) == {f"{work}/../my data &1"}      # cifar10's five inits, the path whole
    assert (work / "relruns" / "vision").is_dir() and not os.path.exists(os.path.join(HERE, "relruns"))
    assert f"{work}/relruns/vision/cifar10-mask-s0" in args
    assert f"{work}/relres" in args                                   # the report goes there too


@pytest.mark.slow
def test_reproduce_gpus_lines_and_refusals(tmp_path):
    r = _reproduce("--quick", "--only", "boolean", "--seeds", "0", "--gpus", "2", "--jobs", "1", "--dry-run",
                   "--runs", str(tmp_path / "runs"))
    lines = [x for x in r.stdout.splitlines() if x.startswith("start")]
    assert r.returncode == 0 and len(lines) == 12
    assert all("-m torch.distributed.run --standalone --nproc_per_node 2 train.py" in x for x in lines)
    # the line as printed runs: its launcher is the one test_torchrun_two_processes_... starts (two processes, gloo
    # on this CPU), and its train.py flags train the run (4 steps, on 256 points of the cube, in this process) with a
    # global batch the two processes share
    words = shlex.split(lines[1].split(maxsplit=1)[1])
    launcher, flags = words[:words.index("train.py")], words[words.index("train.py") + 1:]
    torchrun = _torchrun_call()[0]
    assert [os.path.basename(launcher[0]), *launcher[1:]] == ["python", *torchrun[1:-1]] and "--init mask" in lines[1]
    assert runconfig.resolve(*train.parse_args(flags)).batch_size % 2 == 0
    # where torch sees no GPU, the script run for real refuses before anything starts (checked beside the run)
    no_gpu = [] if torch.cuda.is_available() else [_reproduce_call("--quick", "--only", "boolean", "--gpus", "2",
                                                                    "--jobs", "1", "--runs", str(tmp_path / "r2"))]
    with _running(*no_gpu) as refused:
        assert train.main([*flags, "--steps", "4", "--log-every", "2", "--eval-points", "256", "--device", "cpu"]) == 0
    out = tmp_path / "runs" / "boolean" / "parity2-mask-s0"
    assert json.load(open(out / "result.json"))["metrics"]["acc"] >= 0
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [0, 2, 4]
    for r in refused:
        assert r.returncode == 2 and "sees 0 CUDA GPU" in r.stderr and not (tmp_path / "r2").exists()
    r = _reproduce("--quick", "--gpus", "2", "--jobs", "2", "--dry-run", "--runs", str(tmp_path / "runs"))
    assert r.returncode == 2 and "--gpus" in r.stderr
    for flag, count in (("--gpus", "9" * 20), ("--jobs", "9" * 20), ("--gpus", "\u0662")):   # never wrapped in silence
        r = _reproduce("--quick", flag, count, "--dry-run", "--runs", str(tmp_path / "runs"))
        assert r.returncode == 2 and f"{flag} needs" in r.stderr and not r.stdout.strip(), (flag, r.stdout)


_FAKE_TRAIN = """#!{python}
import fcntl, os, sys, time
argv = sys.argv[1:]
if argv[:1] == ["-m"]:                        # the run list: reporting.plan, in the real Python
    os.execv(sys.executable, [sys.executable, *argv])
if "report" in argv:
    sys.exit(0)
out = argv[argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
fd = os.open(out, os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print(f"error: {{out}} is in use by another process", file=sys.stderr)
    sys.exit(75)
open(os.path.join(os.path.dirname(out), "started.log"), "a").write(out + "\\n")
time.sleep(float(os.environ.get("FAKE_SECONDS", "0.3")))
if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in out:
    sys.exit(1)
open(os.path.join(out, "result.json"), "w").write("{{}}")
"""


@pytest.mark.slow
def test_two_reproduce_sh_on_one_runs_folder_report_only_their_own_runs(tmp_path):
    """Two reproduce.sh started at once on the same --runs (a stand-in train.py that locks its run folder as
    train.py does): every run is trained once, by one of them, the other leaves it ("busy"); neither names a
    run as failed and both exit 0. A run that fails in one is failed in that one only."""
    fake = tmp_path / "py"
    fake.write_text(_FAKE_TRAIN.format(python=sys.executable))
    fake.chmod(0o755)
    runs, apart = tmp_path / "runs", tmp_path / "apart"

    def cmd(folder):
        return ["bash", os.path.join(HERE, "reproduce.sh"), "--quick", "--only", "boolean", "--seeds", "0", "--jobs",
                "1", "--runs", str(folder), "--results", str(tmp_path / "res")]
    env = {**os.environ, "PYTHON": str(fake)}
    both = [subprocess.Popen(cmd(runs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    # meanwhile, on a folder apart: one run fails in the first script only; the second, started a moment later,
    # names none of it
    env_fail = {**env, "FAKE_FAIL": "parity2-default", "FAKE_SECONDS": "0.5"}
    first = subprocess.Popen(cmd(apart), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_fail)
    assert _wait_for(lambda: (apart / "boolean" / "started.log").exists())     # its first run (parity2-default) began
    second = subprocess.run(cmd(apart), capture_output=True, text=True, env=env, timeout=120)
    outs = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    assert all("FAILED" not in out + err for out, err in outs)
    started = (runs / "boolean" / "started.log").read_text().splitlines()
    assert len(started) == len(set(started)) == 12                     # 3 tasks x 4 inits, each trained once
    assert sum((out + err).count("busy    ") for out, err in outs) >= 1
    out1, err1 = first.communicate(timeout=120)
    assert first.returncode == 1 and "FAILED" in err1 and "parity2-default-s0" in err1
    assert "FAILED" not in second.stdout + second.stderr


@pytest.mark.slow
def test_the_plan_names_what_fetches_its_missing_data_and_reproduce_sh_download_fetches_it(tmp_path):
    """A plan without its data names the commands that fetch it (train.py download for the published sets, train.py
    imagenet100 for ImageNet-100); reproduce.sh --download runs the first, then plans with the sets in; --dry-run only
    says so; a failed download starts no run."""
    empty = reporting.plan.run_list(seeds=(0,), data=str(tmp_path / "none"))
    assert empty.absent == ["cifar10", "cifar100", "imagenet100", "wikitext2", "tinystories"]
    fetch = reporting.plan.fetch_lines(empty)
    assert fetch[0].startswith(f"python train.py download cifar10 cifar100 wikitext2 tinystories --data {tmp_path}")
    assert fetch[1].startswith("python train.py imagenet100 --from IMAGENET_1K_DIR") and len(fetch) == 2
    data = tmp_path / "data"
    _write_layout(data, "cifar10 python")
    plan = reporting.plan.run_list(only="vision", seeds=(0,), data=str(data))
    assert plan.absent == ["cifar100", "imagenet100"] and len(plan.runs) == 5
    assert "fetch: python train.py download cifar100 --data" in reporting.plan.describe(plan, {})
    # the dry run; the download (a stand-in that records its command and puts CIFAR-100 in), then the plan with the
    # set in; a download that fails: three calls on folders of their own, at once
    calls = tmp_path / "calls"
    fake = _fake_python(tmp_path / "py", f'echo "$@" >> {calls}\n[ "$2" = download ] && cp -r '
                        f'{tmp_path}/src/cifar-100-python {data}/\nexit 0')
    _write_layout(tmp_path / "src", "cifar100 python")
    fail = _fake_python(tmp_path / "py2", '[ "$2" = download ] && { echo "refused: bad sum" >&2; exit 2; }\nexit 0')
    runs = tmp_path / "runs"
    dry, r, failed = _at_once(
        _reproduce_call("--dry-run", "--download", "--only", "lm", "--data", str(tmp_path / "none")),
        _reproduce_call("--download", "--only", "vision", "--seeds", "0", "--data", str(data), "--runs", str(runs),
                        "--results", str(tmp_path / "res"), env={"PYTHON": str(fake)}),
        _reproduce_call("--download", "--only", "vision", "--seeds", "0", "--data", str(tmp_path / "none2"), "--runs",
                        str(tmp_path / "runs2"), env={"PYTHON": str(fail)}), timeout=60)
    assert dry.returncode == 0 and not (tmp_path / "none").exists()
    assert "--download would fetch wikitext2 tinystories into" in dry.stdout and "skipped: lm wikitext2" in dry.stdout
    lines = calls.read_text().splitlines()
    assert r.returncode == 0 and lines[0] == f"train.py download cifar100 --data {data}", r.stdout + r.stderr
    assert "plan: 10 runs" in r.stdout and sum("--task cifar100" in x for x in lines) == 5
    assert failed.returncode == 2 and "refused: bad sum" in failed.stderr and not (tmp_path / "runs2").exists()


@pytest.mark.slow
def test_mult_ladder_runs_both_orders_then_the_better_one_longer(tmp_path):
    """--only mult-ladder: the paper preset, msb and lsb at 5,000 steps, four inits (the partial pattern one of
    them); then, once those results are in, the order of the higher mean sequence accuracy at 20,000 steps."""
    plan = reporting.plan.run_list(only="mult-ladder", seeds=(0, 1, 2), runs=str(tmp_path))
    names = [r.name for r in plan.runs]
    assert len(names) == 24 and not plan.quick and plan.items[-1] == reporting.plan.REPLAN and len(plan.later) == 12
    assert {r.flags for r in plan.runs if r.name == "multiplication-mask-s1-lsb-partial"} == {
        "--answer-order lsb --steps 5000 --pattern partial"}
    assert sorted({r.init for r in plan.runs}) == ["default", "mask", "qk-opt"] and "then   12 runs" in reporting.plan.describe(plan, {})
    for r in plan.runs:                          # lsb learns better: its runs average the higher sequence accuracy
        d = tmp_path / r.table / r.name
        d.mkdir(parents=True)
        (d / "result.json").write_text(json.dumps(_fake_result(r.task, r.init, r.seed, {
            "seq_acc": 0.3 if "lsb" in r.tag else 0.2}, r.tag)))
    chosen = reporting.plan.run_list(only="mult-ladder", seeds=(0, 1, 2), runs=str(tmp_path))
    later = chosen.runs[24:]
    assert reporting.plan.REPLAN not in chosen.items and len(later) == 12 and not chosen.later
    assert all(r.tag.startswith("lsb-20k") and "--answer-order lsb --steps 20000" in r.flags for r in later)
    # reproduce.sh: the dry run says a stage follows; a stand-in run writes its result, so the plan is read again
    fake = _fake_python(tmp_path / "py", 'while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done\n'
                        '[ -n "${out:-}" ] && mkdir -p "$out" && cp ' + str(tmp_path / "mult-ladder" /
                        "multiplication-default-s0-lsb" / "result.json") + ' "$out/"\nexit 0')
    dry, quick, r = _at_once(
        _reproduce_call("--only", "mult-ladder", "--dry-run", "--runs", str(tmp_path / "fresh")),
        _reproduce_call("--only", "mult-ladder", "--quick", "--dry-run"),
        _reproduce_call("--only", "mult-ladder", "--seeds", "0", "--runs", str(tmp_path / "run2"), "--results",
                        str(tmp_path / "res"), env={"PYTHON": str(fake)}), timeout=60)
    assert dry.returncode == 0 and dry.stdout.count("\nstart") == 24
    assert "\nthen    the runs the plan chooses" in dry.stdout and quick.returncode == 2
    assert r.returncode == 0 and (tmp_path / "run2" / "mult-ladder" / "multiplication-qk-opt-s0-msb-20k").is_dir()


def test_reproduce_sh_takes_every_table_of_the_plan():
    """reproduce.sh's --only list is the plan's TABLES (a table added there is reachable from the script)."""
    text = open(os.path.join(HERE, "reproduce.sh")).read()
    case = re.search(r'case "\$ONLY" in\n\s*""\|([a-z0-9|-]+)\)', text).group(1).split("|")
    assert sorted(case) == sorted(reporting.plan.TABLES)


# ---------------------------------------------------------------------------------------- benchmarks

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


@pytest.mark.slow
def test_bench_paper_plans_reproduce_sh_s_runs_and_times_a_table(monkeypatch, capsys):
    """bench_paper reads reproduce.sh's one run list (reporting/plan.py): the 123 runs of the paper presets."""
    code, out = _bench(monkeypatch, capsys, "bench_paper.py", "--plan")
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert code == 0 and len(rows) == 10 and sum(int(row[3]) for row in rows) == 123
    assert len(reporting.plan.run_list(data=None).runs) == 123
    assert {row[1]: row[4] for row in rows}["cifar10"] == "29,400"            # 300 epochs of 98 steps
    code, out = _bench(monkeypatch, capsys, "bench_paper.py", "--quick", "--only", "boolean", "--task", "parity2",
                       "--batch-size", "4", "--steps", "1", "--warmup", "1", "--eval-points", "64", "--starts", "1")
    assert code == 0 and out.count("\nboolean") == 4 and "mask / default step time" in out




@pytest.mark.slow
def test_bench_attention_and_bench_vit_time_train_py_s_step(monkeypatch, capsys):
    """Both benchmarks run train.train_step (the loop's own step) and print a ratio column led by 1.000."""
    for script, argv in (("bench_attention.py", ["--steps", "1", "--rounds", "1"]),
                         ("bench_vit.py", ["--steps", "1", "--rounds", "1", "--inits", "default,mask",
                                           "--batch-size", "4"])):
        code, out = _bench(monkeypatch, capsys, script, *argv)
        rows = [line.split() for line in out.splitlines() if line.startswith(("default", "mask"))]
        assert code == 0 and rows[0][-1] == "1.000" and len(rows) >= 2, out




def test_bench_context_worker_measures_each_variant():
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    try:
        import bench_context
    finally:
        sys.path.pop(0)
    threads = torch.get_num_threads()
    try:
        rows = bench_context.time_all(32, list(bench_context.VARIANTS), "cpu", 1, "off")
        peak = bench_context.peak(32, "relative", "cpu", "off")
    finally:
        torch.set_num_threads(threads)                         # the worker pins one thread
    per_layer = 4 * 32 * 32                                   # full M: heads x N x N, in each of 2 layers
    assert rows["full"]["params"] - rows["default"]["params"] == 2 * per_layer
    assert rows["relative"]["params"] - rows["default"]["params"] == 2 * 4 * 32
    assert rows["relative128"]["params"] == rows["relative"]["params"]       # the window is the context here
    assert rows["floor"]["params"] == rows["default"]["params"]              # a constant mask, no M
    assert all(r["ms"] > 0 for r in rows.values()) and peak > 0


@pytest.mark.slow
def test_gpu_check_refuses_a_machine_without_cuda_and_its_train_lines_parse(tmp_path):
    """benchmarks/gpu_check.sh, the device script: without CUDA one line, exit 2, nothing written; the train.py
    runs it makes are flags train.py takes (so the GPU's minutes are not lost to a typo)."""
    script = os.path.join(HERE, "benchmarks", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read()
    lines = [line for line in text.replace("\\\n", " ").splitlines() if " train.py " in line and "#" not in line]
    assert len(lines) == 1
    for init in ("default", "mask"):
        words = shlex.split(lines[0].split(" train.py ", 1)[1].replace("$init", init).replace("$out", str(tmp_path)))
        config = runconfig.resolve(*train.parse_args(words))
        runconfig.check(config, train.parse_args(words)[1], rules=False)
        assert config.layers == 12 and config.steps == 300 and config.device == "cuda"
    if not torch.cuda.is_available():
        r = subprocess.run(["bash", script, str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "no CUDA device" in r.stderr and len(r.stderr.splitlines()) == 1
        assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------- README and CI

def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(HERE, "README.md")).read()
    ci = open(os.path.join(HERE, ".ci", "run")).read().strip().splitlines()[-1]
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert first_block[0] == ci and len(first_block) == 3 and first_block[2] == "python train.py --task cyclic3 --init mask"
    assert first_block[1].startswith("python train.py --task")


@pytest.mark.slow
def test_the_example_task_runs_as_written(tmp_path):
    """examples/my_task.py, the README's new task: one class registered as a task trains through train.main with
    the prior, and a flag of another family is refused."""
    env = {**os.environ, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}
    script = os.path.join(HERE, "examples", "my_task.py")
    r, refused = _at_once(([sys.executable, script, "--task", "xor-neighbours", "--init", "mask", "--steps", "40",
                            "--log-every", "20", "--out", "run-mask"], {"cwd": tmp_path, "env": env}),
                          ([sys.executable, script, "--task", "xor-neighbours", "--data-frac", "0.1"],
                           {"cwd": tmp_path, "env": env}))
    assert r.returncode == 0, r.stderr
    res = json.load(open(tmp_path / "run-mask" / "result.json"))
    assert res["task"] == "xor-neighbours" and res["kind"] == "boolean" and 0 <= res["metrics"]["acc"] <= 1
    assert res["metrics"]["prior_mass_start"] > 0.9          # the mask's start: M = +5 on the band, -5 off it
    assert refused.returncode == 2 and "does not apply to task xor-neighbours" in refused.stderr


def _readme_snippets() -> list[str]:
    """Every python block of the README, as written."""
    readme = open(os.path.join(HERE, "README.md")).read()
    return [b.split("\n", 1)[1] for b in readme.split("```")[1::2] if b.startswith("python\n")]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(7))
def test_every_readme_snippet_runs_alone_and_prints_what_it_says(tmp_path, monkeypatch, i):
    """Each python block of the README, alone in a fresh namespace in an empty folder, prints exactly the lines its
    `# prints:` comments say, in order (there are seven blocks, each with at least one)."""
    _extra("timm"), _extra("peft"), _extra("transformers").logging.set_verbosity_error()
    blocks = _readme_snippets()
    assert len(blocks) == 7
    said = [line.split("# prints: ", 1)[1] for line in blocks[i].splitlines() if line.startswith("# prints: ")]
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(blocks[i], f"README.md block {i}", "exec"), {"__name__": "__readme__"})
    assert said and out.getvalue().splitlines() == said, (out.getvalue(), said)








def test_readme_is_a_manual():
    """A newcomer's manual: at most 25,600 bytes (issue 50 cut it from 37,000: what each result shows lives in
    results/README.md, the guarantees' tests in GUARANTEES.md), the terms explained before the first table uses
    them, and the short list of guarantees pointing to GUARANTEES.md."""
    readme = open(os.path.join(HERE, "README.md")).read()
    assert len(readme.encode()) <= 25_600
    terms = readme.split("## Terms", 1)[1].split("\n## ", 1)[0]
    assert all(f"**{t}**" in terms for t in ("GOTU", "U", "MDI", "Pattern", "M", "Mass", "Drift", "impulse"))
    assert readme.index("## Terms") < readme.index("## Results") and "(GUARANTEES.md)" in readme


def test_every_guarantee_names_a_test_that_exists():
    """Each test GUARANTEES.md names is a test of one of the test files the README's command runs (test_*.py)."""
    section = open(os.path.join(HERE, "GUARANTEES.md")).read()
    names = re.findall(r"`(test_[a-z0-9_]+)`", section)
    tests = dict(globals())
    for path in glob.glob(os.path.join(HERE, "test_*.py")):     # (they import this file's helpers: imported here)
        tests.update(vars(importlib.import_module(os.path.basename(path)[:-3])))
    assert len(names) >= 20 and all(callable(tests.get(n)) for n in names), [n for n in names if n not in tests]
    cases = len(BAD_INPUT) + int(torch.backends.mps.is_available())       # the mps case is left out on a Mac
    assert f"`test_bad_input_exits_2` ({cases} inputs" in section


@pytest.mark.parametrize("text, words", [
    ("0,1_0", "'1_0' is not an integer in 0..14"), ("\u0660,\u0661", "is not an integer in 0..14"),
    ("\uff10,\uff11", "is not an integer in 0..14"), ("-1,2", "'-1' is not"), ("0,15", "'15' is not"),
    ("9" * 5000, "... (5,000 characters) is not"), ("0,0", "distinct bits"), ("", "distinct bits"),
])
def test_every_index_list_goes_through_one_parser(text, words):
    """--bits, --unseen and --terms take ASCII digits in range alone, through `tasks.parse_count`; the token that is
    not is named, cut to 40 characters; a term repeated as another kind (x1 as a parity and a majority) is caught."""
    for parse in (lambda s: tasks._parse_bits(s, "bits", 15), lambda s: tasks.parse_terms(s, 15)):
        with pytest.raises(tasks.TaskError, match=re.escape(words)) as err:
            parse(text)
        assert len(str(err.value)) < 200
    assert tasks._parse_bits(" 0, 1 ", "bits", 15) == (0, 1) and tasks._count("random:3", "random:", "bits", 15) == 3
    with pytest.raises(tasks.TaskError, match="given twice"):
        tasks.parse_terms("1:m1", 15)


@pytest.mark.parametrize("task, options, stored", [
    ("ksum", [{"terms": t} for t in ("0,1:2,3,4", " 0,1:2,3,4", "0,1:2,3,4,", "2,3,4:0,1", "4,3,2:1,0")],
     {"terms": "0,1:2,3,4", "unseen": "0,1"}),
    ("ksum", [{"terms": "m4,2,3:1,0"}, {"terms": "0,1:m2,3,4", "unseen": "1,0"}], {"terms": "0,1:m2,3,4", "unseen": "0,1"}),
    ("ksum", [{"terms": "1:m2"}, {"terms": "m2:1"}], {"terms": "1:2", "unseen": "0,1"}),
    ("ksum", [{"terms": "2,3:0,1", "unseen": "bits:2"}, {"terms": "0,1:2,3", "unseen": "3,2"}],
     {"terms": "0,1:2,3", "unseen": "2,3"}),
    ("kparity", [{"bits": "7,4,0", "unseen": "bits:2"}, {"bits": "0,4,7", "unseen": "7,4"}], {"bits": "0,4,7", "unseen": "4,7"}),
    ("kparity", [{"bits": "random:3", "unseen": "bits:2"}], {"bits": "random:3", "unseen": "bits:2"}),
])
def test_one_target_is_one_spelling(task, options, stored):
    """Every spelling of a target (terms in any order, bits in any order, spaces, a trailing comma, 'bits:J' for the
    bits it names) is stored in one (`Task.normal_options`), so one target is one configuration and one report
    row; drawn bits keep 'random:K' and 'bits:J' (the seed names them)."""
    for given in options:
        assert tasks.make_task(task, **given).normal_options() == stored, given


def test_a_run_stores_the_one_spelling_and_says_so(tmp_path, capsys):
    """train.py stores the task's one spelling in args.json (the resolved flags) and says so in one line."""
    out = str(tmp_path / "r")
    argv = ["--task", "ksum", "--terms", "3,2:1,0,", "--layers", "1", "--dim", "16", "--heads", "2", "--mlp-dim", "16",
            "--steps", "1", "--log-every", "1", "--out", out]
    assert train.main(argv) == 0
    assert "stored as --terms 0,1:2,3 (the one spelling of this target)" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "args.json")))["terms"] == "0,1:2,3"


@pytest.mark.parametrize("text, words", [
    ("[]", "holds list, not the step times bench_paper.py writes"), ('{"small parity2 mask": {"ms_eval": 1}}', "has no ms_step"),
    ('{"small parity2 mask": {"ms_step": -1, "ms_eval": 1}}', "ms_step is -1, not milliseconds"),
    ('{"small parity2 mask": 3}', "holds a int, not the dict"), ("{", "is not JSON"),
    ('{"small parity2 mask": {"ms_step": 1, "ms_eval": 1, "device": {"a": 1}}}', "device is {'a': 1}, not the device's"),
])
def test_a_step_times_file_that_is_not_one_is_one_line(tmp_path, text, words):
    """results/step_times.json read by the plan: a list, an entry without a time or with a negative one, or bytes
    that are not JSON is a ReadError naming the file and the mend, never a traceback; no file is no times."""
    from reporting import plan
    path = tmp_path / "step_times.json"
    path.write_text(text)
    with pytest.raises(runfiles.ReadError, match=re.escape(words)) as err:
        plan.step_times(str(path))
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    assert plan.step_times(str(tmp_path / "none.json")) == {} and plan.step_times()      # the committed file reads


def test_every_test_that_starts_a_process_is_marked_slow():
    """The fast loop (`pytest -m "not slow"`) leaves out every test that starts a process (a call on `subprocess`),
    itself or through a helper of the test files; the marks are checked here, not trusted."""
    functions = [n for path in TEST_FILES for n in ast.parse(open(os.path.join(HERE, path)).read()).body
                 if isinstance(n, ast.FunctionDef)]
    calls = {f.name: {c.func for c in ast.walk(f) if isinstance(c, ast.Call)} for f in functions}
    starts = {name for name, funcs in calls.items() if any(isinstance(c, ast.Attribute) and isinstance(c.value, ast.Name)
                                                        and c.value.id == "subprocess" for c in funcs)}
    while grown := {name for name, funcs in calls.items() if name not in starts and any(
            isinstance(c, ast.Name) and c.id in starts and not c.id.startswith("test_") for c in funcs)}:
        starts |= grown
    marked = {f.name for f in functions if any("mark.slow" in ast.unparse(d) for d in f.decorator_list)}
    assert len(starts) > 20 and not {k for k in starts if k.startswith("test_")} - marked
