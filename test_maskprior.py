"""Tests for maskprior.py, the method (and maskprior_fast.py, the speed paths its fused path takes): the module and
its span, patterns, mask helpers, MaskPrior, attention, models, generate, inits, param groups, probes, priors from
attention, and the refusals of bad arguments (generated from ARG_KINDS). Run: python -m pytest -q test_*.py

The other files test the other rooms: test_retrofit.py (maskprior_retrofit.py), test_library.py (maskprior.py's
public arguments, fuzzed), test_tasks.py (tasks.py, augment.py), test_train.py (train.py, runconfig.py,
runfiles.py), test_datafetch.py (datafetch/), test_reporting.py (reporting/), test_reproduce.py (reproduce.sh,
benchmarks/), test_docs.py (the README, GUARANTEES.md, CI); the helpers several of them share are in conftest.py. In
the source's order, a test under the part of the code it tests; a helper or fixture sits before its first user.
"""
import ast
import dataclasses
import glob
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import inits
import maskprior as mp
import maskprior_fast
import maskprior_retrofit as retrofit
import runfiles
import tasks
import runconfig
import train
from conftest import HERE, TINY, _at_once, _one_line, _past, _resolved, cuda, run_train


# ---------------------------------------------------------------------------------------- maskprior.py: module, checks

# what each file of ours may import of ours: the method at the bottom, the rooms above it, the commands on top;
# reports read run folders (runfiles), never the datasets or train
IMPORTS_ALLOWED = {
    "maskprior.py": {"maskprior_fast"}, "maskprior_fast.py": set(), "maskprior_retrofit.py": {"maskprior"},
    "inits.py": {"maskprior"},
    "runfiles.py": {"inits", "maskprior"}, "augment.py": set(),
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
    assert {n for n in names if ".dist-info/" not in n} == {
        "maskprior.py",
        "maskprior_fast.py",
        "maskprior_retrofit.py",
    }
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    version = re.search(r'^version = "([^"]+)"', open(os.path.join(HERE, "pyproject.toml")).read(), re.M).group(1)
    assert wheel.name.startswith(f"maskprior-{version}-") and mp.__version__ == version
    assert f"version: {version}" in open(os.path.join(HERE, "CITATION.cff")).read()


@pytest.mark.parametrize("module, internal", [
    (mp, {"check_size", "tracing", "watch_decay", "drop_path"}),
    (maskprior_fast, set()), (retrofit, set())])
def test_all_names_every_public_function_and_class(module, internal):
    """`__all__` of the files people copy lists each public function and class they define (a new one is listed or
    named internal here), and each name in it exists."""
    defined = {n for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or
               inspect.isclass(v)) and v.__module__ == module.__name__}
    assert defined - internal <= set(module.__all__) and all(hasattr(module, n) for n in module.__all__)
    assert not internal & set(module.__all__)


def test_api_md_lists_every_public_name():
    """API.md, the short reference, has a row for each name of the library files' `__all__` (and no name they lack),
    and options of add_mask_prior and a tested-versions table are there."""
    text = open(os.path.join(HERE, "API.md")).read()
    rows = set(re.findall(r"^\| `(\w+)", text, re.M))
    public = set(mp.__all__) | set(maskprior_fast.__all__) | set(retrofit.__all__)
    options = set(inspect.signature(retrofit.add_mask_prior).parameters) - {"model"}
    assert public <= rows and rows - public <= options, (public - rows, rows - public - options)
    assert options <= rows and "## Tested versions" in text and "| torch | " in text


def test_imports_run_one_way():
    """Each file imports of ours only what IMPORTS_ALLOWED gives it (anywhere in it, functions too), so the layers
    hold: the method imports nothing of ours, report.py no task and no train; every file of ours is listed."""
    ours = {"maskprior", "maskprior_fast", "maskprior_retrofit", "inits", "tasks", "runconfig", "train", "runfiles",
            "augment", "reporting", "datafetch"}
    found = {os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "**", "*.py"), recursive=True)}
    found -= {p for p in found if p.startswith(("benchmarks", "examples", "test_", "conftest"))
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


SPAN_END = "# Beyond the comparison"        # the banner that ends the method's span in maskprior.py
# What the span copied alone does, beside what the module does: the same lines run in both (`check` below)
SPAN_SCRIPT = r"""
import math, sys
sys.modules["maskprior_fast"] = None                  # the span alone: no speed file beside it
import torch, torch.nn as nn
import span
sys.path.append(sys.argv[1])
import maskprior
assert not {"maskprior_retrofit", "tasks", "train"} & set(sys.modules) and sys.modules["maskprior_fast"] is None


def run(lib):
    out = {}
    torch.manual_seed(0)
    attn = lib.Attention(16, 2, mask_size=6, causal=True)
    model = nn.Sequential(attn)
    pattern = lib.banded_pattern(6, 1) & lib.causal_pattern(6)
    out["init"] = lib.init_mask_(model, pattern)
    explicit = lib.Attention(16, 2, mask_size=6, causal=True, fused=False)
    explicit.load_state_dict(attn.state_dict())
    x = torch.randn(3, 6, 16)
    out["fused"], out["explicit"] = attn(x)[0], explicit(x)[0]
    torch.testing.assert_close(out["fused"], out["explicit"], atol=1e-5, rtol=1e-5)
    opt = torch.optim.AdamW(lib.param_groups(model, 0.1), lr=1e-2)
    attn(x)[0].pow(2).mean().backward()
    opt.step()
    out["trained"] = attn.prior.bias.detach().clone()
    out["half"] = (attn.half().prior.bias.dtype, attn.to(torch.bfloat16).prior.bias.dtype)
    bad = {k: v.float() for k, v in attn.state_dict().items()}
    bad["prior.bias"] = torch.full_like(bad["prior.bias"], math.nan)
    for name, call in (("nan", lambda: attn.load_state_dict(bad)), ("arg", lambda: lib.banded_pattern(-3, 1)),
                       ("decay", lambda: torch.optim.AdamW(model.parameters(), weight_decay=0.1).step())):
        try:
            call()
            out[name] = "no refusal"
        except ValueError as e:
            out[name] = str(e)
    torch.manual_seed(1)
    blocks = [(nn.LayerNorm(16), lib.Attention(16, 2)) for _ in range(2)]
    view = lib.QKView([lib.qk_site(a.qkv, a.proj, a.n_heads, ln) for ln, a in blocks], torch.randn(1, 6, 16) * 0.02)
    pattern = lib.banded_pattern(6, 1)
    out["svd"] = lib.init_qk_svd_(view, pattern, generator=torch.Generator().manual_seed(0), pos_scale=18.0)
    out["svd_q"] = blocks[1][1].qkv.weight.detach().clone()
    out["opt"] = lib.init_qk_opt_(view, pattern, steps=30, generator=torch.Generator().manual_seed(0))
    out["opt_q"] = blocks[1][1].qkv.weight.detach().clone()
    return out


span_out, module_out = run(span), run(maskprior)
assert span_out["half"] == (torch.float32, torch.float32), span_out["half"]
assert "non-finite" in span_out["nan"] and "banded_pattern: n must be" in span_out["arg"], span_out
assert "erases the prior" in span_out["decay"] and span_out["svd"]["pseudo_mass"][0] > 0.5, span_out
for key in span_out:
    a, b = span_out[key], module_out[key]
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), key
    else:
        assert a == b, (key, a, b)
print("ok")
"""


def _span() -> str:
    src = open(os.path.join(HERE, "maskprior.py")).read()
    return src[:src.index("# ====", src.index(SPAN_END) - 100)]


@pytest.mark.slow
def test_the_method_span_copied_alone_behaves_as_the_module(tmp_path):
    """maskprior.py's span (its start to the banner "Beyond the comparison"), copied alone into an empty folder
    beside no speed file, needs torch alone and behaves as the module: M stays float32 through .half() and
    .to(bfloat16), a NaN state dict and a bad argument are refused in one line, decayed M is refused at the
    optimiser's step, fused = explicit, and both QK baselines give the module's weights and reports on a model
    built from the span (a QKView of its Attention layers); it is at most 1,100 lines."""
    span = _span()
    assert span.count("\n") <= 1100, span.count("\n")
    (tmp_path / "span.py").write_text(span)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", SPAN_SCRIPT, HERE], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.parametrize("name", ["maskprior.py", "maskprior_fast.py", "maskprior_retrofit.py"])
def test_nothing_at_top_level_changes_a_name_defined_above_it(name):
    """What a reader copies is what runs: at the top level of the library's files no statement rebinds a name
    defined above it, assigns into one (an attribute, an item: `Cls.method = ...`, `LIST += ...`), or reaches
    them another way (globals(), setattr, a loop or block at the top level); each class's behaviour is in its body."""
    tree = ast.parse(open(os.path.join(HERE, name)).read())
    bound, broken = set(), []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            if node.name in bound:
                broken.append(f"{node.lineno}: {node.name} defined again")
            bound.add(node.name)
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue                                   # the module docstring
        if not isinstance(node, (ast.Assign, ast.AnnAssign)):
            broken.append(f"{node.lineno}: a top-level {type(node).__name__}")
            continue
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            if any(isinstance(t, (ast.Attribute, ast.Subscript, ast.Starred)) for t in ast.walk(target)):
                broken.append(f"{node.lineno}: assigns into {ast.unparse(target)}")
            for t in (t for t in ast.walk(target) if isinstance(t, ast.Name)):
                if t.id in bound:
                    broken.append(f"{node.lineno}: {t.id} bound again")
                bound.add(t.id)
        if any(isinstance(c, ast.Call) and getattr(c.func, "id", "") in ("globals", "setattr", "exec")
               for c in ast.walk(node)):
            broken.append(f"{node.lineno}: globals(), setattr or exec")
    assert not broken, broken


@pytest.mark.slow
def test_importing_the_library_and_train_installs_nothing():
    """`import maskprior`, `import maskprior_retrofit` and `import train` leave sys.meta_path and torch's global
    optimiser hooks as they were and import no transformers, peft or timm; the decay check goes in with the process's
    first MaskPrior, the adapter loaders' check and the retrofit's check of an optimiser that holds a layer but not its
    M with its first attached prior."""
    script = ("import sys, torch, torch.optim.optimizer as o\n"
              "before = (list(sys.meta_path), len(o._global_optimizer_pre_hooks))\n"
              "import maskprior, maskprior_retrofit, train\n"
              "assert (list(sys.meta_path), len(o._global_optimizer_pre_hooks)) == before\n"
              "assert not {'transformers', 'peft', 'timm'} & set(sys.modules)  # MaskPriorCallback: on first use\n"
              "maskprior.MaskPrior(4)\n"
              "assert len(o._global_optimizer_pre_hooks) == before[1] + 1 and list(sys.meta_path) == before[0]\n"
              "maskprior_retrofit.add_mask_prior(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(\n"
              "    8, 2, 16, batch_first=True), 1, enable_nested_tensor=False), maskprior.banded_pattern(4, 1))\n"
              "assert len(o._global_optimizer_pre_hooks) == before[1] + 2  # and the retrofit's, of M left out\n"
              "assert 'peft' in sys.modules or len(sys.meta_path) > len(before[0])\n"
              "print('ok')\n")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=HERE, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


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
    torch.testing.assert_close(maskprior_fast.mask_bias_grad(m.detach()), grad, atol=0, rtol=1e-12)


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
    assert tasks.TASKS["parity2"].inits() == report.ABLATION_INITS and len(tasks.TASKS["cifar10"].inits()) == len(
        inits.INITS
    )
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
    assert (
        torch.allclose(kept[kept > 0], torch.tensor(1 / 0.75)) and abs(float((kept > 0).float().mean()) - 0.75) < 0.05
    )


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


def test_a_grid_prior_takes_displacement_logits_exactly_and_refuses_a_slot_whose_pairs_differ():
    """Logits that depend on the displacement alone (the soft bump, its class token at +m_on) are held exactly, even
    near float32's largest; the impulse pattern, whose edge patches fall back to themselves, is refused in one line
    naming the displacement whose pairs differ (a mean of them would be no pair's logit), as a relative prior refuses
    logits that differ along a diagonal; a grid prior takes no prefix (another size is another grid)."""
    soft = mp.soft_offset_logits(4, 4, mp.IMPULSE_OFFSETS[:3], 1.0, 5.0, 10.0, n_prefix=1)
    prior = mp.MaskPrior(17, 3, logits=soft, param="grid", grid=(4, 4))
    assert torch.equal(prior.full_logits().detach(), soft)
    big = mp.MaskPrior(17, 1, logits=torch.full((17, 17), 3.3e38), param="grid", grid=(4, 4))
    assert torch.isfinite(big.bias).all() and torch.isfinite(big(17)).all()
    pat = mp.impulse_pattern(4, 4, [(0, 1)], n_prefix=1)
    with pytest.raises(ValueError, match=r"^MaskPrior: a grid MaskPrior .* at patch displacement \(0, 0\), its pairs "
                                         r"differ; use param='full'") as err:
        mp.MaskPrior(17, 1, pat, param="grid", grid=(4, 4))
    _one_line(err)
    with pytest.raises(ValueError, match=r"without prefix .* prefix=True") as err:
        mp.MaskPrior(17, 1, param="grid", grid=(4, 4), prefix=True)
    _one_line(err)


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
    model_cfg = runconfig.model_config(config, runconfig.check(config))
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


DECAY_LATER = ["the first refusal caught, then step again", "a schedule that sets decay on M's group after step 1",
               "add_param_group(M, weight_decay > 0)", "load_state_dict of a decayed state",
               "M frozen at the first step, unfrozen later"]


def _decay_later(model, way: str) -> torch.optim.Optimizer:
    """An AdamW over `model` that takes its first step without decaying M (M in a group of its own, weight decay
    0), then decays M `way` (DECAY_LATER); the first way is a plain AdamW whose first refusal was caught."""
    ms = [b.attn.prior.bias for b in model.blocks]
    if way == DECAY_LATER[0]:
        opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
        with pytest.raises(ValueError):
            opt.step()
        return opt
    rest = [p for p in model.parameters() if all(p is not m for m in ms)]
    groups = [{"params": rest, "weight_decay": 0.1}] + (
        [{"params": ms, "weight_decay": 0.0}] if "add" not in way else []
    )
    if "frozen" in way:
        groups[1]["weight_decay"] = 0.1
        for m in ms:
            m.requires_grad_(False)
    opt = torch.optim.AdamW(groups)
    opt.step()
    if "schedule" in way:
        opt.param_groups[1]["weight_decay"] = 0.1
    elif "add" in way:
        opt.add_param_group({"params": ms, "weight_decay": 0.1})
    elif "load" in way:
        state = opt.state_dict()
        state["param_groups"][1]["weight_decay"] = 0.1
        opt.load_state_dict(state)
    else:
        for m in ms:
            m.requires_grad_(True)
    return opt


@pytest.mark.parametrize("way", DECAY_LATER)
def test_m_is_refused_decay_on_every_step_it_would_happen(way):
    """Issue 73: the decay check runs before every step, not the first only: whichever way decay reaches M after the
    first step (the refusal caught and the step taken again, a schedule, add_param_group, load_state_dict, M unfrozen
    later), that step is one ValueError line and M is as it was."""
    task, model = gotu_model(learnable_mask=True)
    mp.init_mask_(model, task.pattern())
    model(task.setup().probe_inputs(4)).float().square().mean().backward()
    opt = _decay_later(model, way)
    start = [b.attn.prior.bias.detach().clone() for b in model.blocks]
    with pytest.raises(ValueError, match=r"decays M of 2 prior\(s\) .* erases the prior") as err:
        opt.step()
    assert "\n" not in str(err.value)
    assert all(torch.equal(b.attn.prior.bias, s) for b, s in zip(model.blocks, start))


def test_assign_true_and_every_cast_keep_m_float32():
    """Issue 73: load_state_dict(assign=True) of a half-precision M, .half(), .bfloat16(), .to(dtype) and .type()
    leave M float32 (its values rounded as the saved ones were); float64 passes."""
    prior = mp.MaskPrior(8, 2, mp.banded_pattern(8, 1))
    prior.load_state_dict({k: v.half() for k, v in prior.state_dict().items()}, assign=True)
    assert prior.bias.dtype == torch.float32 and prior.bias.requires_grad and float(prior.bias.max()) == 5.0
    for cast in (lambda m: m.half(), lambda m: m.bfloat16(), lambda m: m.to(torch.float16),
                 lambda m: m.type(torch.bfloat16), lambda m: m.to(dtype=torch.half)):
        assert cast(mp.MaskPrior(8, 2, mp.banded_pattern(8, 1))).bias.dtype == torch.float32
    assert mp.MaskPrior(8, 2).double().bias.dtype == torch.float64


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


# ---------------------------------------------------------------------------------------- maskprior.py: arguments

# ---- the library refuses what it would drop or guess (issue 41): a pattern with logits, a switch that is not a
# bool, prior_roles on a retrofitted model, a part's M that PEFT froze, non-finite or empty maps and m_on / m_off,
# a ratio no pair reaches, an encoder-decoder's parts given priors one call each


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


LIBRARY_CALLS = {   # each public function that reads an argument ARG_KINDS names, called well: the test changes one
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
    "qk_site": lambda **k: mp.qk_site(**{"qkv": nn.Linear(16, 48), "proj": nn.Linear(16, 16), "n_heads": 2, **k}),
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


class Want(NamedTuple):
    """What a public argument of a name must be: a kind of BAD, the least value it takes (strictly above it where
    `above`), or for kind "choice" one of `choices`."""
    kind: str
    least: float | None = None
    above: bool = False
    choices: tuple = ()


# every public argument of maskprior.py and maskprior_retrofit.py by its name: a name means one thing everywhere
ARG_KINDS = {
    **{k: Want("bool") for k in ("symmetric", "self_loops", "circulant", "prefix_all", "causal", "keys", "per_head",
                                 "prefix", "cross_attention", "flex")},
    **{k: Want("int", 1) for k in ("n", "n_keys", "grid_h", "grid_w", "kernel", "heads", "n_heads", "top_k", "steps",
                                   "norm_every")},
    **{k: Want("int", 0) for k in ("width", "offset", "n_prefix", "n_new")},
    **{k: Want("real", 0) for k in ("m_on", "m_off", "alpha", "weight_decay", "tol", "log_seconds", "noise",
                                    "temperature")},
    **{k: Want("real", 0, above=True) for k in ("ratio", "scale", "factor_norm", "lr")},
    "pos_scale": Want("real", 1 / mp.MAX_GAIN), "self_logit": Want("real"),
    "pattern": Want("pattern"), "logits": Want("logits"), "attn": Want("maps"), "readout": Want("indices"),
    "offsets": Want("offsets"), "grid": Want("grid"),
    **{k: Want("choice", choices=("full", "relative", "grid")) for k in ("param", "mask_param")},
}
# the model configs' fields: as the arguments of those names, and the config's own
FIELD_KINDS = {
    "readout": Want("choice", choices=("cls", "mean", "tokens")),
    "positions": Want("choice", choices=("learned", "none")),
    "pool": Want("choice", choices=("mean", "cls")),
    "mask_param": ARG_KINDS["mask_param"],
    **{k: Want("bool") for k in ("learnable_mask", "fused", "flex", "qkv_bias", "causal", "tie_embeddings")},
    **{
        k: Want("int", 1)
        for k in (
            "dim",
            "n_layers",
            "head_dim",
            "mlp_dim",
            "vocab_size",
            "n_outputs",
            "image_size",
            "patch_size",
            "in_chans",
            "n_classes",
            "n_heads",
            "seq_len",
            "mask_window",
        )
    },
    **{k: Want("real", 0) for k in ("dropout", "drop_path", "pos_init_std", "emb_init_std")},
}


def _bad_values(arg: Want) -> list:
    below = [] if arg.least is None else [arg.least if arg.above else arg.least - 1]
    return BAD[arg.kind] + [int(v) if arg.kind == "int" else float(v) for v in below]


def _public(module) -> dict:
    """A module's public functions and nn.Module classes (their __init__)."""
    return {n: (f.__init__ if isinstance(f, type) else f) for n, f in vars(module).items()
            if not n.startswith("_") and callable(f) and getattr(f, "__module__", "") == module.__name__
            and (not isinstance(f, type) or issubclass(f, nn.Module))}


def _checked(fn: str) -> tuple:
    """The arguments of `fn` that ARG_KINDS names: each one a bad value of its kind is refused for."""
    target = getattr(mp, fn, None) or getattr(retrofit, fn)
    params = inspect.signature(target.__init__ if isinstance(target, type) else target).parameters
    return tuple(name for name in params if name in ARG_KINDS)


LIBRARY_CASES = [(fn, name, i) for fn in LIBRARY_CALLS for name in _checked(fn)
                 for i in range(len(_bad_values(ARG_KINDS[name])))]


def test_every_public_argument_the_table_names_is_checked_and_every_checked_function_has_a_call():
    """By construction: every public function or class of maskprior.py and maskprior_retrofit.py that takes an
    argument ARG_KINDS names has a good call in LIBRARY_CALLS (but `pattern_mass`, a measurement: nan maps give a nan
    mass, which training watches), so the generated test below gives each of those arguments each bad value of its
    kind; each call as given runs."""
    public = {**_public(mp), **_public(retrofit)}
    takes = {n for n, f in public.items() if set(inspect.signature(f).parameters) & set(ARG_KINDS)}
    exempt = {"pattern_mass", "prior_probe", "prior_mass", "content_margin",     # measurements
              "Block", "Attention"}                                             # built from a checked config
    assert takes - exempt == set(LIBRARY_CALLS), (takes - exempt) ^ set(LIBRARY_CALLS)
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
    """Generated from the table (`ARG_KINDS`): each public argument of each checked function, given each bad value of
    its kind (a switch that is not a bool, a number not finite or below its least, a pattern that allows nothing or
    is not bool, logits that are bool or nan, maps that are negative or attend nowhere, readout rows that are not
    positions, offsets that are not pairs), is one ValueError line naming the function."""
    value = _bad_values(ARG_KINDS[name])[i]
    with pytest.raises(ValueError) as err:
        LIBRARY_CALLS[fn](**{name: value})
    assert str(err.value).startswith(f"{fn}: ") or fn in str(err.value), str(err.value)
    _one_line(err)


FIELD_CASES = [(cfg, name, value) for cfg in (mp.TransformerConfig, mp.ViTConfig)
               for name in FIELD_KINDS if name in {f.name for f in dataclasses.fields(cfg)}
               for value in _bad_values(FIELD_KINDS[name])]


@pytest.mark.parametrize("cfg, name, value", FIELD_CASES,
                         ids=[f"{c.__name__}-{n}-{v!r}" for c, n, v in FIELD_CASES])
def test_a_model_config_refuses_each_bad_value_of_each_declared_field(cfg, name, value):
    """Generated from the table (`FIELD_KINDS`): a model config given a bad value of a field the table
    names is one ValueError line naming the config and the field; each allowed value is taken (but a 2-D
    relative M, mask_param='grid', by a model of tokens: refused in one line naming the image model)."""
    with pytest.raises(ValueError, match=rf"^{cfg.__name__}: {name} must be ") as err:
        cfg(**{name: value})
    _one_line(err)
    for good in FIELD_KINDS[name].choices:
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
