"""Tests for reproduce.sh and the plan it runs (reporting/plan.py), and for the scripts in benchmarks/.
Run: python -m pytest -q test_reproduce.py
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import datafetch.write
import reporting.plan
import runfiles
import tasks
import runconfig
import train
from conftest import (HERE, _at_once, _bench, _fake_result, _fake_run, _images, _running, _torchrun_call, _wait_for,
                      _write_layout)


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
    assert (
        sum("/mult2/multiplication-mask-s0-d2-frac0.03-partial " in x and "--pattern partial" in x for x in starts) == 1
    )
    assert sum("/mult2/multiplication-qk-opt-s0-d2-frac0.3 " in x and "--data-frac 0.3 " in x for x in starts) == 1
    starts, _ = _planned("lee", quick=True)
    assert len(starts) == 12 and all("--digits 2 --lee-samples 3000" in x for x in starts)
    assert (
        sum("/lee/multiplication-mask-s0-lsb-ep500 " in x and "--epochs 500 --log-every 600" in x for x in starts) == 1
    )
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
    assert (
        sum("/wikitext2-mask-s0-corpusB-teacher " in x and "vimtext-b" in x and "s0-corpusA" in x for x in starts) == 1
    )
    order = [x.split("/oraclefree/")[1].split()[0] for x in starts]
    assert order.index("parity2-mask-s0-teacher") > order.index("parity2-default-s0") and order[-1].startswith(
        "cyclic3"
    )


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
    assert "cifar-10-batches-py" in nodata.stdout and tables.returncode == 2 and tables.stdout == ""
    assert "invalid choice: 'tables'" in tables.stderr and len(tables.stderr.splitlines()) == 1   # the plan's line
    assert all(t in tables.stderr for t in reporting.plan.TABLES)               # every table reachable from the script
    # a failing run makes the script exit 1 and names the run
    assert failed.returncode == 1 and "FAILED" in failed.stderr and "parity2-mask-s0" in failed.stderr


@pytest.mark.slow
def test_reproduce_refuses_a_flag_without_value_and_duplicate_seeds(tmp_path, capsys):
    """reproduce.sh and `python -m reporting.plan` check their flags as train.py does: a value, each flag once, a seed
    in 0 .. 2^32 - 1 once, a folder where a folder is meant; each refusal one line, exit 2, nothing started."""
    r = _reproduce("--quick", "--dry-run", "--runs", "/nonexistent/runs", "--only")
    assert r.returncode == 2 and "--only needs a value" in r.stderr
    (tmp_path / "file").write_text("x")
    for argv, words in ((["--seeds", "0 00"], 'distinct seeds, e.g. "0 1 2", got \'0 00\''),
                        (["--seeds", "0", "--seeds", "1"], "--seeds is given twice"),
                        (["--seeds", "99999999999"], "'99999999999' is not an integer in 0..4294967295"),
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
            assert (
                train.read_checkpoint(str(folder / "ckpt.pt"), "test")["step"] > 0
                and not (folder / "result.json").exists()
            )
        assert sorted(p.name for p in (runs / "boolean").iterdir() if p.is_dir()) == [
            "parity2-default-s0",
            "parity2-mask-s0",
        ]
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
    r = subprocess.run(
        [
            "bash",
            os.path.join(HERE, "reproduce.sh"),
            "--only",
            "vision",
            "--seeds",
            "0",
            "--data",
            "../my data &1",
            "--runs",
            "relruns",
            "--results",
            "relres",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHON": str(fake), "ARGS_LOG": str(tmp_path / "args")},
    )
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


def test_the_plan_states_each_table_s_cost_before_anything_runs(tmp_path):
    """Issue 75, 1: per paper table and in all, the bytes to download (ImageNet-1k: the user's own copy, not fetched),
    the disk and the GPU-hours est. on A100 / H100 / H200 from the counted FLOPs; a measured step replaces the
    estimate and drops its label; a key neither measured nor counted is said to be, not guessed."""
    plan = reporting.plan.run_list(data=str(tmp_path / "none"))
    text = reporting.plan.describe(plan, {})
    rows = {line.split()[0]: line for line in text.splitlines()}
    for table in ("boolean", "arithmetic", "vision", "lm", "in"):
        assert re.search(r" runs  est\. [0-9.]+ / [0-9.]+ / [0-9.]+ GPU-hours on A100 / H100 / H200, download .+, "
                         r"disk [0-9.]+ [MG]iB", rows[table]), rows[table]
    assert "download none, " in rows["boolean"] and "download 2.1 GiB, " in rows["lm"]
    assert "download 324 MiB and your ImageNet-1k copy (144.0 GiB, not fetched)" in rows["vision"]
    assert "in all        123 runs" in text and "download 2.4 GiB and your ImageNet-1k copy" in rows["in"]
    assert "A100 312, H100 989, H200 989 TFLOPS" in rows["est.:"] and text.startswith("plan: 60 runs")
    assert text.splitlines()[0].endswith("; 63 more once their data is there (below)")        # 60 + 63 = 123
    h100 = [float(rows[t].split(" / ")[1]) for t in ("boolean", "arithmetic", "vision", "lm", "in")]
    assert abs(sum(h100[:4]) - h100[4]) < 0.2 and h100[2] > h100[0] > 0
    times = {reporting.plan.time_key(r): {"ms_step": 30.0, "ms_eval": 90.0, "ms_final": 90.0, "ms_setup": 0.0,
                                          "device": "NVIDIA H100"} for r in plan.runs if r.table == "boolean"}
    measured = {line.split()[0]: line for line in reporting.plan.describe(plan, times).splitlines()}
    hours = sum(reporting.plan.hours(r, times) for r in plan.runs if r.table == "boolean")
    assert f"36 runs  {hours:.2f} device-hours (measured), download none" in measured["boolean"]
    assert "est." not in measured["boolean"] and measured["vision"] == rows["vision"] and "est." in measured["in"]
    assert "36 runs  GPU-hours not measured or counted, download none, disk not counted" in (
        reporting.plan.describe(plan, {}, flops={}))


@pytest.mark.slow
def test_budget_plans_the_tables_that_fit_in_claim_order_and_says_each_reduction(tmp_path):
    """--budget HOURS: the tables in the order of the paper's claims, whole while they fit; then one with the seeds
    that fit, its line saying so; the rest left out, each with its cost. reproduce.sh passes it to the plan."""
    whole, times, flops = reporting.plan.run_list(data=None), reporting.plan.step_times(), reporting.plan.step_flops()
    need = {t: sum(reporting.plan.cost(r, times, flops)[0] for r in whole.runs if r.table == t)
            for t in ("boolean", "arithmetic", "vision", "lm")}
    budget = round(need["boolean"] + need["arithmetic"] + need["vision"] / 3, 2) + 0.01   # vision: one seed of three
    plan = reporting.plan.budget_plan(budget, "H100", None, (0, 1, 2), str(tmp_path / "none"), None)
    assert [r.table for r in plan.runs] == ["boolean"] * 36 + ["arithmetic"] * 24          # vision, lm: no data
    assert {r.seed for r in plan.missing} == {0} and {r.table for r in plan.missing} == {"vision"}
    assert plan.absent == ["cifar10", "cifar100", "imagenet100"]
    r = _reproduce("--budget", str(budget), "--dry-run", "--data", str(tmp_path / "none"), "--runs",
                   str(tmp_path / "runs"))
    lines = [line for line in r.stdout.splitlines() if line.startswith("  ")]
    assert r.returncode == 0 and f"budget {budget:g} GPU-hours on one H100" in r.stdout.splitlines()[0]
    assert [line.split()[0] for line in lines[:5]] == ["boolean", "arithmetic", "vision", "lm", "in"], lines
    assert "only" not in lines[0] + lines[1] and "15 runs  est." in lines[2]
    assert f"seed 0 only, within the budget (all 3: est. {need['vision']:.1f} GPU-hours on H100)" in lines[2]
    assert lines[3].startswith(f"  lm              0 runs  left out: 18 runs, est. {need['lm']:.1f} GPU-hours on H100")
    assert sum(line.startswith("start") for line in r.stdout.splitlines()) == 60 and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_bad_budget_is_refused_in_one_line_and_nothing_runs(tmp_path, capsys):
    """--budget takes GPU-hours above 0 of the paper presets: a bad value, --quick or a study (CPU minutes, which
    their plan prints), an unknown --gpu or one without --budget is one line, exit 2, from the plan and from
    reproduce.sh, nothing run."""
    for argv, words in ((["--budget", "0"], "--budget needs a number of GPU-hours above 0"), (["--budget", "-1"], "0"),
                        (["--budget", "abc"], "not 'abc'"), (["--budget", "nan"], "nan"), (["--budget", "1e7"], "1e7"),
                        (["--budget", "١٠"], "١٠"), (["--budget", "5", "--quick"], "leave out --budget"),
                        (["--budget", "5", "--only", "ablation"], "--quick and the studies run on a CPU"),
                        (["--budget", "5", "--gpu", "V100"], "invalid choice: 'V100'"),
                        (["--gpu", "A100"], "give --budget HOURS with it")):           # alone it would change nothing
        capsys.readouterr()
        try:
            code = reporting.plan.main(argv)
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1 and out == "", (argv, err)
    calls = tmp_path / "calls"
    fake = _fake_python(tmp_path / "py", f'echo "$@" >> {calls}\nexit 0')
    for argv in (["--budget", "abc"], ["--quick", "--budget", "2"], ["--gpu", "H200"]):
        r = _reproduce(*argv, "--runs", str(tmp_path / "runs"), env={"PYTHON": str(fake)})
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert not calls.exists() and not (tmp_path / "runs").exists()


def test_the_counted_flops_cover_the_plans_and_agree_with_a_recount(tmp_path):
    """results/step_flops.json (bench_paper.py --flops --write) holds every time key of the paper and --quick plans,
    and one cheap key counted again gives the same FLOPs and checkpoint bytes: the file cannot go stale in silence."""
    flops = reporting.plan.step_flops()
    keys = {reporting.plan.time_key(r, "small" if quick else "paper")
            for quick in (False, True) for r in reporting.plan.run_list(quick, data=None).runs}
    assert keys <= set(flops), sorted(keys - set(flops))
    sys.path.insert(0, os.path.join(HERE, "benchmarks"))
    try:
        import bench_paper
    finally:
        sys.path.pop(0)
    with torch.random.fork_rng():
        assert bench_paper.count_flops(reporting.plan.Run("boolean", "parity2", "default", 0), "small") == flops[
            "small parity2 default"]
    (tmp_path / "f.json").write_text('{"paper parity2 mask": {"step": -1, "eval": 1, "final": 1, "layers": 2, '
                                     '"ckpt_bytes": 1}}')
    with pytest.raises(runfiles.ReadError, match="step is -1, not an integer from 0 to 1e100; count them again"):
        reporting.plan.step_flops(str(tmp_path / "f.json"))


@pytest.mark.slow
def test_mult_ladder_runs_both_orders_then_the_better_one_longer(tmp_path):
    """--only mult-ladder: the paper preset, msb and lsb at 5,000 steps, four inits (the partial pattern one of
    them); then, once those results are in, the order of the higher mean sequence accuracy at 20,000 steps."""
    plan = reporting.plan.run_list(only="mult-ladder", seeds=(0, 1, 2), runs=str(tmp_path))
    names = [r.name for r in plan.runs]
    assert len(names) == 24 and not plan.quick and plan.items[-1] == reporting.plan.REPLAN and len(plan.later) == 12
    assert {r.flags for r in plan.runs if r.name == "multiplication-mask-s1-lsb-partial"} == {
        "--answer-order lsb --steps 5000 --pattern partial"}
    assert sorted({r.init for r in plan.runs}) == [
        "default",
        "mask",
        "qk-opt",
    ] and "then   12 runs" in reporting.plan.describe(plan, {})
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


@pytest.mark.parametrize("text, words", [
    ("[]", "holds list, not the step times bench_paper.py writes"),
    ('{"small parity2 mask": {"ms_eval": 1}}', "has no ms_step"),
    ('{"small parity2 mask": {"ms_step": -1, "ms_eval": 1}}', "ms_step is -1, not milliseconds"),
    ('{"small parity2 mask": 3}', "holds a int, not the dict"), ("{", "is not JSON"),
    ('{"small parity2 mask": {"ms_step": 1, "ms_eval": 1, "device": {"a": 1}}}',
     "device is {'a': 1}, not the device's"),
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


# ---------------------------------------------------------------------------------------- benchmarks

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
