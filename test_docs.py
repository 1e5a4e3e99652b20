"""Tests for the documents and the suite's own rules: the README (CI runs its test command, its snippets and its
example task run as written, it stays a manual), GUARANTEES.md (each test it names exists), and every test that
starts a process is marked slow. Run: python -m pytest -q test_docs.py
"""
import ast
import contextlib
import glob
import importlib
import io
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import BAD_INPUT, HERE, _at_once, _extra


# ---------------------------------------------------------------------------------------- README and CI

def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(HERE, "README.md")).read()
    ci = open(os.path.join(HERE, ".ci", "run")).read().strip().splitlines()[-1]
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert (
        first_block[0] == ci
        and len(first_block) == 3
        and first_block[2] == "python train.py --task cyclic3 --init mask"
    )
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
    for path in glob.glob(os.path.join(HERE, "test_*.py")):     # (they import conftest's helpers: imported here)
        tests.update(vars(importlib.import_module(os.path.basename(path)[:-3])))
    assert len(names) >= 20 and all(callable(tests.get(n)) for n in names), [n for n in names if n not in tests]
    cases = len(BAD_INPUT) + int(torch.backends.mps.is_available())       # the mps case is left out on a Mac
    assert f"`test_bad_input_exits_2` ({cases} inputs" in section


# the README's test command runs them all (test_*.py)
TEST_FILES = tuple(sorted(os.path.basename(p) for p in glob.glob(os.path.join(HERE, "test_*.py"))))


def test_every_test_that_starts_a_process_is_marked_slow():
    """The fast loop (`pytest -m "not slow"`) leaves out every test that starts a process (a call on `subprocess`),
    itself or through a helper of the test files; the marks are checked here, not trusted."""
    functions = [n for path in (*TEST_FILES, "conftest.py")        # conftest.py: the helpers they share
                 for n in ast.parse(open(os.path.join(HERE, path)).read()).body if isinstance(n, ast.FunctionDef)]
    calls = {f.name: {c.func for c in ast.walk(f) if isinstance(c, ast.Call)} for f in functions}
    starts = {
        name
        for name, funcs in calls.items()
        if any(
            isinstance(c, ast.Attribute) and isinstance(c.value, ast.Name) and c.value.id == "subprocess" for c in funcs
        )
    }
    while grown := {name for name, funcs in calls.items() if name not in starts and any(
            isinstance(c, ast.Name) and c.id in starts and not c.id.startswith("test_") for c in funcs)}:
        starts |= grown
    marked = {f.name for f in functions if any("mark.slow" in ast.unparse(d) for d in f.decorator_list)}
    assert len(starts) > 20 and not {k for k in starts if k.startswith("test_")} - marked


PAGES = sorted(p for p in subprocess.run(["git", "ls-files", "*.md"], cwd=HERE, capture_output=True, text=True).stdout
               .split() if p) or ["README.md", "results/README.md", "API.md", "GUARANTEES.md"]


@pytest.mark.parametrize("page", PAGES)
def test_every_committed_page_renders(page):
    """Issue 75: each committed Markdown page, parsed as CommonMark (markdown-it, with tables): every fenced block
    names its language (a fence that lost its opener reads the prose after it as code, with no language), every line
    that starts with '|' renders inside a table, and every image and relative link names a file that exists."""
    md = _extra("markdown_it").MarkdownIt("commonmark").enable("table")
    text = open(os.path.join(HERE, page)).read()
    tokens = md.parse(text)
    fences = [t for t in tokens if t.type == "fence"]
    assert all(t.info for t in fences), [t.map[0] + 1 for t in fences if not t.info]
    rendered = {n for t in tokens if t.type in ("table_open", "fence") for n in range(t.map[0] + 1, t.map[1] + 1)}
    rows = [n for n, line in enumerate(text.split("\n"), 1) if line.startswith("|")]
    assert set(rows) <= rendered, sorted(set(rows) - rendered)[:5]
    targets = [c.attrs.get("src") if c.type == "image" else c.attrs.get("href")
               for t in tokens for c in t.children or [] if c.type in ("image", "link_open")]
    local = [h for h in targets if h and not re.match(r"^[a-z]+:", h) and not h.startswith("#")]
    missing = [h for h in local if not os.path.exists(os.path.join(HERE, os.path.dirname(page), h.split("#")[0]))]
    assert not missing, missing
