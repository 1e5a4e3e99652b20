"""The reports' promises, fuzzed: what `report`, `redraw`, `summarize`, `show` and `python -m reporting.plan` read
back (a metrics.jsonl line, a report's CSV, a checkpoint's probe snapshot, plan's flags) gives either a valid result
or exactly one line on stderr with exit status 2: never a traceback, nothing touched outside the output folder, in
bounded time. Property tests (Hypothesis) over each format, the cases of issue 64 as their @examples, and a plain
regression test for each; after them, the reports' plain tests (summaries, tables and curves, broken runs).

    python -m pytest -q test_pending_reporting.py          # about 40 s on two cores
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import datafetch.write
import maskprior as mp
import maskprior_retrofit as retrofit
import reporting.figures
import reporting.plan
import reporting.report
import reporting.show
import runfiles
import tasks
import train
from conftest import (TINY, _deadline, _edit_json, _extra, _fake_result, _fake_run, _images, _small_disk, _train,
                      run_train)

HERE = os.path.dirname(os.path.abspath(__file__))
# every property: no deadline (the first example imports matplotlib), no example database in the repository
FUZZ = dict(deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                   HealthCheck.data_too_large])
SECONDS = 30            # what one command of an example may take, at most
FRAC = "$\\frac{$"      # a name that matplotlib's math text cannot parse


# ---------------------------------------------------------------------------------------- helpers

def _tree(folder) -> dict | None:
    """Every path under `folder` with its bytes (None for a folder): a folder 'as it was' compares equal."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))} if folder.exists() else None


def _result(init="mask", seed=0, metrics=None, **extra) -> dict:
    """result.json of a finished 2-layer parity2 run, as train.py writes one (the keys reports read)."""
    return {"task": "parity2", "kind": "boolean", "init": init, "seed": seed, "preset": "small",
            "run_id": f"parity2-{init}-{seed}", "data": None, "init_order": list(runfiles.INITS).index(init),
            "metrics": {"acc": 1.0, "acc_unseen": 0.5} if metrics is None else metrics,
            "tells_apart": {"layers": 2, "steps": 20, "log_every": 10}, "steps": 20,
            "config": {"n_layers": 2}, **extra}


# a log line of that run as train_loop writes it (step 0: its first)
LINE0 = {"step": 0, "loss": None, "run_id": "parity2-mask-0",
         "metrics": {"acc_unseen": 0.5, "acc_seen": 0.5, "mse": 1.0}, "prior_mass": [0.9, 0.8],
         "prior_mass_mean": 0.85, "content_margin": [0.1, 0.2], "qk_drift": [0.0, 0.0], "mask_drift": [0.0, 0.0]}
LINE10 = {**LINE0, "step": 10, "prev": 0, "loss": 0.5, "lr": 1e-3, "seconds": 1.5, "run_id": None,
          "metrics": {"acc_unseen": 0.9, "acc_seen": 0.99, "mse": 0.1}, "prior_mass": [0.7, 0.6],
          "prior_mass_mean": 0.65, "mask_drift": [0.1, 0.2], "qk_drift": [0.1, 0.1]}
del LINE10["run_id"]


def _run(root: Path, lines: list, result: dict | None = None) -> Path:
    """root/runs/boolean/parity2-mask-s0 with result.json and a metrics.jsonl of `lines` (records, or bytes as
    they are); returns root/runs."""
    d = root / "runs" / "boolean" / "parity2-mask-s0"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps(_result() if result is None else result))
    (d / "metrics.jsonl").write_bytes(b"".join(x if isinstance(x, bytes) else json.dumps(x).encode() + b"\n"
                                               for x in lines))
    return root / "runs"


def _main(argv, capsys) -> tuple:
    """train.main(argv) in this process: (exit status, stdout, stderr, seconds)."""
    capsys.readouterr()
    started = time.perf_counter()
    rc = train.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err, time.perf_counter() - started


def _plan(argv, capsys) -> tuple:
    """python -m reporting.plan argv in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    try:
        rc = reporting.plan.main(argv)
    except SystemExit as e:                 # argparse's refusals (and --help)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_line(rc, out: str, err: str, prefix: str = "error: ") -> str:
    """The promise of a refusal: exit status 2, nothing on stdout, exactly one line on stderr, no traceback."""
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, (rc, out[:300], err[:600])
    assert err.startswith(prefix) and "Traceback" not in err, err[:600]
    return err.strip()


def _write_csv(path: Path, header: list, rows: list) -> None:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([header, *rows])
    path.write_text(buf.getvalue())


# ---------------------------------------------------------------------------------------- metrics.jsonl lines

# numbers as a hostile file holds them: huge, non-finite, out of range, not numbers at all
NUMBERS = st.one_of(st.floats(), st.integers(-10 ** 40, 10 ** 40), st.none(), st.booleans(), st.text(max_size=3),
                    st.sampled_from([1e308, -1e308, 1e100, 1e101, 0.5, 1.0, 1.005, 1.02, -0.0]))
STEPS = st.one_of(st.integers(-3, 2 ** 60), st.sampled_from([10 ** 39, 2 ** 53, 2 ** 53 + 1, 10, 20]), st.floats(),
                  st.none(), st.text(max_size=2))
LAYER_LISTS = st.one_of(st.none(), st.lists(NUMBERS, max_size=3),
                        st.builds(lambda n, v: [v] * n, st.sampled_from([0, 1, 2, 3, 50_000]),
                                  st.sampled_from([0.5, 1e308, -1e308, float("nan"), float("inf")])))
METRICS = st.one_of(st.dictionaries(st.one_of(st.sampled_from(["acc_unseen", "acc_seen", "mse", "seq_acc"]),
                                              st.text(max_size=70)), NUMBERS, max_size=4),
                    st.lists(NUMBERS, max_size=2), st.none())
FIELDS = {"prior_mass": LAYER_LISTS, "prior_mass_mean": NUMBERS, "mask_drift": LAYER_LISTS,
          "qk_drift": LAYER_LISTS, "content_margin": LAYER_LISTS, "prev": STEPS, "loss": NUMBERS, "lr": NUMBERS,
          "seconds": NUMBERS, "run_id": st.one_of(st.text(max_size=5), NUMBERS), "seq_acc": NUMBERS,
          "step": STEPS, "metrics": METRICS}
# a crafted line: anything of the record's shape, or a whole line with one field made hostile
RECORDS = st.one_of(
    st.fixed_dictionaries({"step": STEPS, "metrics": METRICS},
                          optional={k: v for k, v in FIELDS.items() if k not in ("step", "metrics")}),
    st.sampled_from(sorted(FIELDS)).flatmap(lambda k: FIELDS[k].map(lambda v: {**LINE10, k: v})),
    st.just(LINE10))

ISSUE_LINES = [{**LINE10, "step": 10 ** 39}, {**LINE10, "prior_mass": [0.5] * 50_000},
               {**LINE10, "prior_mass": [1e308, -1e308], "prior_mass_mean": 1e308, "mask_drift": [1e308, -1e308],
                "metrics": {"acc_unseen": 1e308, "acc_seen": -1e308, "mse": 1e308}}]


def _check_record(rec: dict) -> None:
    """What every record read_log returns is, for a 2-layer run: the bounds the reports rely on."""
    assert isinstance(rec["step"], int) and not isinstance(rec["step"], bool) and 0 <= rec["step"] <= 2 ** 53
    assert isinstance(rec["metrics"], dict)
    for v in rec["metrics"].values():
        assert v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                             and (math.isnan(v) or abs(v) <= 1e100))
    for k in ("prior_mass", "content_margin", "mask_drift", "qk_drift"):
        values = rec.get(k)
        assert values is None or len(values) in ((0, 2) if k == "qk_drift" else (2,)), (k, len(values))
        for v in values or []:
            assert isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isnan(v) or abs(v) <= 1e100)
    for v in (rec.get("prior_mass") or []) + ([rec["prior_mass_mean"]] if rec.get("prior_mass_mean") else []):
        assert -0.01 <= v <= 1.01
    assert (rec.get("prior_mass") is None) == (rec.get("prior_mass_mean") is None)


@settings(max_examples=80, **FUZZ)
@given(rec=RECORDS)
@example(rec=ISSUE_LINES[0])
@example(rec=ISSUE_LINES[1])
@example(rec=ISSUE_LINES[2])
def test_a_metrics_line_is_a_record_of_its_run_or_a_log_error_and_every_table_reads_it(rec):
    """runfiles.read_log of a log whose second line is crafted: a LogError (one line naming the line), or records
    within the bounds the reports rely on, which every table and curve of a report then takes without error."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "metrics.jsonl")
        Path(path).write_bytes(json.dumps(LINE0).encode() + b"\n" + json.dumps(rec).encode() + b"\n")
        try:
            records = runfiles.read_log(path, 2)
        except runfiles.LogError as e:
            assert "line 2" in str(e) and len(str(e).splitlines()) == 1, str(e)[:400]
            return
        for r in records:
            _check_record(r)
        run = {**_result(), "run_dir": tmp, "_records": records}
        groups = {("parity2", ""): [run]}
        reporting.report.prior_layers(groups)
        reporting.report.steps_to_target(groups)
        assert all(math.isfinite(row[6]) for row in reporting.report.curve_rows(groups))


@settings(max_examples=40, **FUZZ)
@given(rec=RECORDS)
@example(rec=ISSUE_LINES[0])
@example(rec=ISSUE_LINES[1])
@example(rec=ISSUE_LINES[2])
def test_report_goes_on_past_any_metrics_line(rec, capsys):
    """`train.py report RUNS OUT` over a run whose log holds a crafted line: exit 0, no traceback, the run's
    result.json in its table and its log either in the curves or left out with a note naming the line; nothing
    written outside OUT."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = _run(Path(tmp), [LINE0, rec])
        before = _tree(runs)
        rc, out, err, seconds = _main(["report", str(runs), os.path.join(tmp, "out")], capsys)
        assert rc == 0 and "Traceback" not in err and seconds < SECONDS, (rc, err[:600])
        assert _tree(runs) == before and sorted(os.listdir(tmp)) == ["out", "runs"]
        assert "| mask | 0 | 100.00 (1 seed) |" in Path(tmp, "out", "boolean.md").read_text()
        notes = Path(tmp, "out", "steps_to_target.md").read_text()
        curves = Path(tmp, "out", "curves.csv").read_text()
        assert ("metrics.jsonl line 2" in notes) != (",mask,0,0," in curves), notes[:2000]


def test_report_skips_each_crafted_log_with_a_line_saying_why(tmp_path, capsys):
    """Issue 64, 3: a step of 10**39, a prior_mass of 50,000 entries on a 2-layer run and values of +-1e308 were
    tracebacks; now each run's log is left out of the curves with the reason, and the report goes on."""
    why = ["step is 10000000000", "prior_mass is [0.5, 0.5", "metrics is {'acc_unseen': 1e+308"]
    for i, (rec, words) in enumerate(zip(ISSUE_LINES, why)):
        runs = _run(tmp_path / str(i), [LINE0, rec])
        rc, out, err, _ = _main(["report", str(runs), str(tmp_path / str(i) / "out")], capsys)
        notes = (tmp_path / str(i) / "out" / "steps_to_target.md").read_text()
        assert rc == 0 and err == "" and "its log is left out of the curves" in notes, err
        assert "metrics.jsonl line 2 is damaged (" + words in notes, notes
    # the same 50,000 values on every line: not one a layer of the run's 2
    runs = _run(tmp_path / "wide", [{**LINE0, "prior_mass": [0.5] * 3, "prior_mass_mean": 0.5}])
    rc, out, err, _ = _main(["report", str(runs), str(tmp_path / "wide" / "out")], capsys)
    assert rc == 0 and "line 1 holds 3 values a layer, but the run has 2 layers" in (
        tmp_path / "wide" / "out" / "steps_to_target.md").read_text()


# ---------------------------------------------------------------------------------- result.json (found by the fuzzer)

RESULT_METRICS = st.dictionaries(st.sampled_from(["acc", "acc_unseen", "mdi_acc", "mdi_sign_acc", "mse_unseen",
                                                  "prior_mass_start", "prior_mass_end", "n_train", "seq_acc"]),
                                 st.one_of(st.none(), st.sampled_from([1e308, -1e308, 1e100, 0.5, 0, 10 ** 30])),
                                 max_size=5)


@settings(max_examples=25, **FUZZ)
@given(metrics=RESULT_METRICS)
@example(metrics={"acc": 1e308, "prior_mass_start": -1e308, "prior_mass_end": 1e308})
@example(metrics={"mdi_acc": None})
def test_summarize_tabulates_any_result_metrics_or_lists_the_run(metrics, capsys):
    """`train.py summarize` of a run whose result.json holds crafted metrics (null, +-1e308): exit 0 with the run
    tabulated or listed as unreadable, never a traceback (a null mdi_acc was one)."""
    with tempfile.TemporaryDirectory() as tmp:
        runs = _run(Path(tmp), [LINE0], _result(metrics=metrics))
        rc, out, err, _ = _main(["summarize", str(runs / "boolean")], capsys)
        assert "Traceback" not in err
        if rc == 2:
            assert "no finished run" in _one_line(rc, out, err) and "unreadable result.json" in err
        else:
            assert rc == 0 and err == "" and "| mask | 0 |" in out, (rc, err[:500])


# ---------------------------------------------------------------------------------------- report CSVs and redraw

CURVES = list(reporting.report.CURVES_HEADER)
INTS = st.one_of(st.integers(0, 2 ** 70).map(str),
                 st.sampled_from(["1e20", "100000000000000000000", "-1", "1_0", "١٠", " 1", "", "0x1"]))
VALUES = st.one_of(st.floats().map(lambda v: f"{v:.6g}"),
                   st.sampled_from(["inf", "nan", "1e308", "-1e308", "1e100", "0.5", "x", "1_0", "٣"]))
NAMES = st.one_of(st.sampled_from(["parity2", "addition", "mask", "default", "seq_acc", "mse", FRAC]),
                  st.text(max_size=12))
LABELS = st.one_of(st.sampled_from(["", "steps=250", FRAC, "a=$x$, b=1"]), st.text(max_size=30),
                   st.sampled_from([200, 4000, 4001, 100_000]).map(lambda n: "a" * n))
HOSTILE_ROWS = st.tuples(NAMES, LABELS, NAMES, INTS, INTS, NAMES, VALUES).map(list)
VALID_ROWS = st.tuples(st.sampled_from(["parity2", "addition"]), st.sampled_from(["", "steps=250", FRAC]),
                       st.sampled_from(["mask", "default"]), st.integers(0, 2).map(str),
                       st.integers(0, 100).map(str), st.sampled_from(["seq_acc", "mse"]),
                       st.floats(0, 1).map(lambda v: f"{v:.6g}")).map(list)
ISSUE_TABLES = {"3,000 task names": [[f"task{i}", "", "mask", "0", str(s), "seq_acc", "0.5"]
                                     for i in range(3000) for s in (0, 10)],
                "a name that is math": [["parity2", FRAC, "mask", "0", "0", "mse", "1"],
                                        ["parity2", FRAC, "mask", "0", "10", "mse", "0.5"]],
                "a step of 1e20": [["parity2", "", "mask", "0", "100000000000000000000", "mse", "1"]],
                "a label of 100,000 characters": [["parity2", "a" * 100_000, "mask", "0", "0", "mse", "1"]]}


@settings(max_examples=30, **FUZZ)
@given(name=st.sampled_from(["curves", "visionprior"]), rows=st.lists(VALID_ROWS, min_size=1, max_size=6),
       hostile=st.lists(HOSTILE_ROWS, max_size=2))
@example(name="curves", rows=ISSUE_TABLES["3,000 task names"], hostile=[])
@example(name="curves", rows=ISSUE_TABLES["a name that is math"], hostile=[])
@example(name="visionprior", rows=ISSUE_TABLES["a name that is math"], hostile=[])
@example(name="curves", rows=ISSUE_TABLES["a step of 1e20"], hostile=[])
@example(name="curves", rows=ISSUE_TABLES["a label of 100,000 characters"], hostile=[])
def test_redraw_draws_a_report_csv_or_refuses_it_in_one_line(name, rows, hostile, capsys):
    """`train.py redraw RESULTS` of a crafted NAME.csv: the figure drawn (its texts as text) and nothing else
    changed, or one line and exit 2 with nothing written; in bounded time."""
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp, "res")
        results.mkdir()
        _write_csv(results / f"{name}.csv", CURVES, rows + hostile)
        before = _tree(tmp)
        rc, out, err, seconds = _main(["redraw", str(results)], capsys)
        assert seconds < SECONDS and "Traceback" not in err
        if rc == 2:
            assert "redraw: " in _one_line(rc, out, err) and _tree(tmp) == before
        else:
            assert rc == 0 and err == "" and f"redrew {results / name}.png" in out, (rc, err[:600])
            assert {k: v for k, v in _tree(tmp).items() if k != f"res/{name}.png"} == before


def test_redraw_of_each_crafted_table_is_drawn_or_one_line(tmp_path, capsys):
    """Issue 64, 4: 3,000 task names (150 s silent), '$\\frac{$' (a crash in math text), a step of 1e20 (a
    traceback) and a label of 100,000 characters (overlapping text, exit 0): a refusal in one line, fast, or (the
    name) the figure drawn with the name as text."""
    for case, words in (("3,000 task names", "would draw 3,000 panels"), ("a name that is math", None),
                        ("a step of 1e20", "'100000000000000000000' is not a step in 0 .. 2^53"),
                        ("a label of 100,000 characters", "(100,000 characters) is not a configuration's flags")):
        results = tmp_path / case
        results.mkdir()
        _write_csv(results / "curves.csv", CURVES, ISSUE_TABLES[case])
        rc, out, err, seconds = _main(["redraw", str(results)], capsys)
        assert seconds < 10, (case, seconds)
        if words is None:
            assert rc == 0 and err == "" and (results / "curves.png").read_bytes()[:4] == b"\x89PNG"
        else:
            assert words in _one_line(rc, out, err) and sorted(os.listdir(results)) == ["curves.csv"], case
    (tmp_path / "name").mkdir()
    _write_csv(tmp_path / "name" / "curves.csv", CURVES, [[FRAC, "", "mask", "0", "0", "mse", "1"]])
    assert "is not a name as train.py writes one" in _one_line(*_main(["redraw", str(tmp_path / "name")], capsys)[:3])


def test_a_long_label_is_drawn_cut_saying_so_and_a_figure_of_many_panels_says_it_is_slow(tmp_path, capsys,
                                                                                         monkeypatch):
    """A configuration's label of 4,000 characters (what a report may write) is drawn in a few lines that end by
    saying how much was cut, in a readable figure; a figure of more than REDRAW_SLOW_PANELS (40) panels announces
    itself before it is drawn."""
    from matplotlib.text import Text
    problems = {}
    save = reporting.report.save_figure

    def checked(fig, path, dpi=110):
        fig.canvas.draw()
        problems[os.path.basename(path)] = figure_problems(fig, drawn=True)
        texts = [t.get_text() for t in fig.findobj(Text)]
        problems[os.path.basename(path) + " cut"] = any("characters more, cut here" in t for t in texts)
        return save(fig, path, dpi)
    monkeypatch.setattr(reporting.report, "save_figure", checked)
    rows = [["parity2", label, "mask", "0", str(s), "seq_acc", "0.5"] for label in ("x=1, " * 800, "b=1")
            for s in (0, 10)]
    _write_csv(tmp_path / "visionprior.csv", CURVES, rows)
    _write_csv(tmp_path / "curves.csv", CURVES, rows)
    rc, out, err, _ = _main(["redraw", str(tmp_path)], capsys)
    assert rc == 0 and problems == {"curves.png": [], "curves.png cut": True, "visionprior.png": [],
                                    "visionprior.png cut": True}, (err, problems)
    assert reporting.report.REDRAW_SLOW_PANELS == 40
    monkeypatch.setattr(reporting.report, "REDRAW_SLOW_PANELS", 2)          # 3 panels stand in for 41
    (tmp_path / "many").mkdir()
    _write_csv(tmp_path / "many" / "curves.csv", CURVES, [[f"t{i}", "", "mask", "0", "0", "mse", "1"]
                                                          for i in range(3)])
    rc, out, err, _ = _main(["redraw", str(tmp_path / "many")], capsys)
    assert rc == 0 and out.splitlines()[0].startswith("redraw: curves.png: 3 panels, about "), out


PERSISTENCE = ["task", "init", "seed", "step", "mass_mean", "drift_mean", "mass_layer0", "mass_layer1"]


@settings(max_examples=60, **FUZZ)
@given(rows=st.lists(st.one_of(
    st.tuples(NAMES, NAMES, INTS, INTS, VALUES, VALUES, VALUES, VALUES).map(list),
    st.tuples(st.just("parity2"), st.sampled_from(["mask", "qk-svd"]), st.just("0"), st.integers(0, 50).map(str),
              st.floats(0, 1).map(lambda v: f"{v:.5f}"), st.sampled_from(["nan", "0.10000"]),
              st.floats(0, 1).map(lambda v: f"{v:.5f}"), st.floats(0, 1).map(lambda v: f"{v:.5f}")).map(list)),
    max_size=5))
def test_a_persistence_csv_reads_as_rows_within_bounds_or_as_one_report_error(rows):
    """reporting.report.read_rows of a crafted persistence.csv: rows whose every number is bounded (a mass in
    [0, 1], a step within 2^53), or a ReportError of one line naming the file and the line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "persistence.csv")
        _write_csv(path, PERSISTENCE, rows)
        try:
            got = reporting.report.read_rows(str(path), tuple(PERSISTENCE[:6]), reporting.report._persistence_row,
                                             1024)
        except reporting.report.ReportError as e:
            assert "persistence.csv" in str(e) and len(str(e).splitlines()) == 1
            return
        for r in got:
            assert 0 <= r["step"] <= 2 ** 53 and 0 <= r["seed"] < 2 ** 32
            assert all(-0.01 <= m <= 1.01 for m in [r["mass"], *r["layers"]])
            assert math.isnan(r["drift"]) or 0 <= r["drift"] <= 1e100


# ---------------------------------------------------------------------------------------- reporting.plan's flags

TOKENS = st.one_of(st.sampled_from(["0", "1", "2", "-1", "1_0", "١٠", "99999", "abc", "", " 2", "1025", "0 1 2",
                                    "0 0", "4294967296"]), st.text(max_size=6))
FLAG_ARGS = st.one_of(
    st.tuples(st.sampled_from(["--jobs", "--seeds", "--budget"]), TOKENS),
    st.tuples(st.sampled_from(["--data", "--runs"]), st.sampled_from(["@FILE", "@FOLDER", "@MISSING"])),
    st.tuples(st.just("--only"), st.one_of(st.sampled_from(reporting.plan.TABLES), TOKENS)),
    st.tuples(st.sampled_from(["--quick", "--list"])), st.tuples(TOKENS))
ISSUE_PLAN = [["--jobs", "0"], ["--jobs", "-1"], ["--jobs", "1_0"], ["--jobs", "١٠"], ["--data", "@FILE"],
              ["--runs", "@FILE"]]


@settings(max_examples=60, **FUZZ)
@given(args=st.lists(FLAG_ARGS, max_size=4).map(lambda pairs: [a for pair in pairs for a in pair]))
@example(args=ISSUE_PLAN[0])
@example(args=ISSUE_PLAN[1])
@example(args=ISSUE_PLAN[2])
@example(args=ISSUE_PLAN[3])
@example(args=ISSUE_PLAN[4] + ["--quick"])
@example(args=ISSUE_PLAN[5] + ["--only", "mult-ladder"])
def test_the_plan_prints_a_plan_or_refuses_its_flags_in_one_line(args, capsys):
    """python -m reporting.plan with crafted flags: a plan on stdout (exit 0, no minutes below 0), or one line on
    stderr and exit 2 (argparse's own refusals too); nothing written anywhere."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "file").write_text("x")
        Path(tmp, "folder").mkdir()
        where = {"@FILE": os.path.join(tmp, "file"), "@FOLDER": os.path.join(tmp, "folder"),
                 "@MISSING": os.path.join(tmp, "missing")}
        before = _tree(tmp)
        rc, out, err = _plan([where.get(a, a) for a in args], capsys)
        assert _tree(tmp) == before
        if rc == 2:
            _one_line(rc, out, err, "reporting.plan: ")
        else:
            assert rc == 0 and err == "" and out.strip() and "-" not in "".join(
                line.split("about ")[1][:1] for line in out.splitlines() if "about " in line), (rc, out, err)


@pytest.mark.slow
def test_each_plan_flag_is_refused_in_one_line(tmp_path, capsys):
    """Issue 64, 8: --jobs 0 (a ZeroDivisionError), --jobs -1 ("-158 min"), --jobs 1_0 and Arabic-Indic digits
    (int() takes both), --data FILE and --runs FILE (exit 0): each one line, exit 2; the CLI itself too."""
    (tmp_path / "file").write_text("x")
    for args, words in zip(ISSUE_PLAN, ["'0' is not an integer in 1..1024", "'-1' is not an integer in 1..1024",
                                        "'1_0' is not an integer", "'١٠' is not an integer",
                                        "--data {} is a file, not a folder", "--runs {} is a file, not a folder"]):
        args = [str(tmp_path / "file") if a == "@FILE" else a for a in args]
        err = _one_line(*_plan(args, capsys), "reporting.plan: ")
        assert words.format(tmp_path / "file") in err, err
    r = subprocess.run([sys.executable, "-m", "reporting.plan", "--jobs", "0"], cwd=HERE, capture_output=True,
                       text=True)
    assert "--jobs: '0' is not an integer in 1..1024" in _one_line(r.returncode, r.stdout, r.stderr,
                                                                  "reporting.plan: ")
    assert _plan(["--quick", "--jobs", "4"], capsys)[0] == 0


# ---------------------------------------------------------------------------------------- summarize

def test_summarize_of_paths_that_hold_no_run_is_one_line(tmp_path, capsys):
    """Issue 64, 9: a plain file, an empty folder, a folder of unfinished runs tabulated nothing with exit 0; each
    is one line saying what was wrong, exit 2. A folder with a finished run still tabulates."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unfinished" / "parity2-mask-s0").mkdir(parents=True)
    for path, words in (("file", "is a file, not a run folder"), ("empty", "is an empty folder"),
                        ("unfinished", "no finished run (result.json) in")):
        assert words in _one_line(*_main(["summarize", str(tmp_path / path)], capsys)[:3])
    runs = _run(tmp_path / "ok", [LINE0])
    rc, out, err, _ = _main(["summarize", str(runs / "boolean")], capsys)
    assert rc == 0 and "| mask | 0 |" in out
    assert "is an empty folder" in _one_line(*_main(["summarize", str(runs / "boolean"),
                                                     str(tmp_path / "empty")], capsys)[:3])


# ------------------------------------------------------------------------------------ the checkpoint's probe snapshot

def _contents(snapshot) -> dict:
    """A checkpoint's contents that pass CKPT_SCHEMA but for `snapshot`: a 1-layer model with M of (2, 5, 5)."""
    return {"model": {"blocks.0.attn.prior.bias": torch.zeros(2, 5, 5)}, "optimizer": {}, "step": 0,
            "seconds": 0.0, "config": {}, "model_config": {"n_layers": 1}, "init_report": None,
            "snapshot": snapshot, "prior_mass_start": None, "rng": {"torch": torch.zeros(4, dtype=torch.uint8)},
            "identity": {"run_id": "x"}, "log_step": 0, "data": None, "machine": {}, "prior_source": None,
            "prior_sha256": "x"}


MS = st.sampled_from(["none", "good", "nan", "inf", "rank 1", "rank 4", "wrong shape", "int", "list", "text"])
M_OF = {"none": None, "good": torch.ones(2, 5, 5), "nan": torch.full((2, 5, 5), math.nan),
        "inf": torch.full((2, 5, 5), math.inf), "rank 1": torch.ones(5), "rank 4": torch.ones(1, 2, 5, 5),
        "wrong shape": torch.ones(2, 4, 4), "int": torch.ones(2, 5, 5, dtype=torch.long), "list": [[1.0]],
        "text": "M"}


@settings(max_examples=40, **FUZZ)
@given(m=MS, qk=MS, layers=st.integers(0, 2), record=st.sampled_from(["dict", "list", "no qk"]))
@example(m="nan", qk="good", layers=1, record="dict")
def test_a_snapshot_reads_as_m_and_qk_a_layer_or_as_one_read_error(m, qk, layers, record):
    """runfiles.read_checkpoint of a crafted probe snapshot: records of finite float tensors (M of 2 or 3
    dimensions and the model's shape, Wq Wk^T of 3) or nulls, or a ReadError of one line."""
    rec = {"mask": M_OF[m], "qk": torch.ones(2, 3, 3) if qk == "good" else M_OF[qk]}
    rec = {"list": [rec["mask"]], "no qk": {"mask": rec["mask"]}}.get(record, rec)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        Path(path).write_bytes(runfiles.checkpoint_bytes(_contents([rec] * layers)))
        try:
            snapshot = runfiles.read_checkpoint(path)["snapshot"]
        except runfiles.ReadError as e:
            assert len(str(e).splitlines()) == 1 and "ckpt.pt" in str(e)
            return
        for r in snapshot:
            for t, ranks in ((r["mask"], (3,)), (r["qk"], (3,))):
                assert t is None or (t.is_floating_point() and t.dim() in ranks and bool(torch.isfinite(t).all()))
            assert r["mask"] is None or tuple(r["mask"].shape) == (2, 5, 5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A tiny parity2 --init mask run, trained for one step."""
    out = str(tmp_path_factory.mktemp("trained") / "run")
    assert train.main(["--task", "parity2", "--layers", "1", "--dim", "16", "--heads", "2", "--mlp-dim", "16",
                       "--batch-size", "16", "--probe-size", "8", "--eval-points", "64", "--init", "mask",
                       "--steps", "1", "--log-every", "1", "--out", out]) == 0
    return out


def test_show_refuses_a_snapshot_that_is_not_m_at_the_start_in_one_line(trained, tmp_path, capsys):
    """`train.py show RUN` of a checkpoint whose probe snapshot holds a NaN M (it drew blank panels, exit 0), an M
    of the wrong rank or one that is no tensor: one line naming the snapshot, exit 2, nothing drawn."""
    good = runfiles.read_checkpoint(os.path.join(trained, "ckpt.pt"))
    m = good["snapshot"][0]["mask"]
    for bad in (m * math.nan, m[0, 0], "M"):
        run = tmp_path / f"run{len(os.listdir(tmp_path))}"
        run.mkdir()
        snapshot = [{**good["snapshot"][0], "mask": bad}]
        (run / "ckpt.pt").write_bytes(runfiles.checkpoint_bytes({**good, "snapshot": snapshot}))
        err = _one_line(*_main(["show", str(run), "--out", str(tmp_path / "fig")], capsys)[:3])
        assert "snapshot is " in err and "ckpt.pt" in err, err
        assert not (tmp_path / "fig").exists()
    rc, out, err, _ = _main(["show", trained, "--out", str(tmp_path / "fig")], capsys)
    assert rc == 0 and "m.png" in out


# --------------------------------------------------------------- figures: readable, titled with their data (issue 65)

RESULTS = Path(HERE, "results")
DIGITS = next(sha for sha, name in reporting.report.KNOWN_DATA.items() if name == "digits stand-in")
SOFT = "mask_off=10.0, pattern=soft, qk_svd_pos_scale=None, soft_alpha=1.0"     # a line of results/studies


def _png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, from its header."""
    head = Path(path).read_bytes()[16:24]
    return int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")


@pytest.fixture
def drawn(monkeypatch) -> dict:
    """{file name: figure} of every figure the reports draw while the test runs, kept open and never rendered."""
    figures = {}

    def keep(fig, path, dpi=110):
        figures[os.path.basename(path)] = fig
        return path
    monkeypatch.setattr(reporting.report, "save_figure", keep)
    yield figures
    for fig in figures.values():
        reporting.figures.pyplot().close(fig)


def _oracle_free_table(tmp_path, rows: int) -> tuple[dict, list]:
    """(table, rows) as `report.oracle_free` hands them on: `rows` tasks, each with a hand, a found and a teacher's
    mask run (seed 0) that started from a prior.pt and logged its mass every 50 steps."""
    pattern = torch.eye(15, dtype=torch.bool)
    pattern[0, 1] = pattern[1, 0] = True
    table, names = {}, [f"task{i}, {100 * i} points" for i in range(rows)]
    for name in names:
        for tag in ("", "discovered", "teacher"):
            d = tmp_path / f"{len(os.listdir(tmp_path))}"
            d.mkdir()
            torch.save({"pattern": pattern, "logits": pattern.float(), "source": {}}, d / "prior.pt")
            records = [{"step": s, "prior_mass_mean": 0.9 - s / 1e4} for s in range(0, 600, 50)]
            table.setdefault(name, {})[("mask", tag)] = [{"run_dir": str(d), "seed": 0, "_records": records}]
    return table, names


def test_every_committed_figure_is_within_4_to_1():
    """Issue 65, 1: no committed figure is a strip (oraclefree*/oraclefree_mass.png were 9.9:1 and 17.3:1)."""
    for png in RESULTS.rglob("*.png"):
        w, h = _png_size(png)
        assert max(w / h, h / w) <= MAX_ASPECT, (png, w, h)


def test_the_oracle_free_figures_wrap_into_a_grid_under_their_caption(tmp_path, drawn):
    """Issue 65, 1 and 2: the mass curves of 17 tasks are a grid within 4:1 (a row of panels was 17.3:1), and the
    caption of the patterns figure clears its first row's titles (tight_layout left it over them)."""
    table, rows = _oracle_free_table(tmp_path, 17)
    reporting.report.oracle_free_mass(table, rows, str(tmp_path))
    w, h = drawn["oraclefree_mass.png"].get_size_inches()
    assert max(w / h, h / w) <= MAX_ASPECT, (w, h)
    table, rows = _oracle_free_table(tmp_path, 4)
    reporting.report.oracle_free_figure(table, rows, str(tmp_path))
    assert figure_problems(drawn["oraclefree_patterns.png"]) == []


def test_a_figure_is_titled_with_the_data_set_its_runs_read(tmp_path, drawn, capsys):
    """Issue 65, 4: the digits stand-in read by the cifar10 task is titled as the stand-in, not as CIFAR-10, in a
    report (data.csv, from the hash result.json records) and in a redraw from it; data no one recognised says so;
    a task that makes its data is its own title; runs on other data are never averaged together."""
    report = reporting.report
    assert report.data_set({"kind": "vision", "data": DIGITS}) == "digits stand-in"
    assert report.data_set({"kind": "lm", "data": "ab" * 32}) == "unrecognised data abababab"
    assert report.data_set({"kind": "boolean", "data": "ab" * 32}) is None
    runs = [{**_result(seed=s), "task": "cifar10", "kind": "vision", "data": sha, "run_dir": f"/r/cifar10-mask-s{s}"}
            for s, sha in ((0, DIGITS), (1, DIGITS), (2, "ab" * 32))]
    assert report.data_rows(runs[:2] + [_result()]) == [("cifar10", "digits stand-in")]
    assert report.data_rows(runs) == []                             # two data sets: each configuration says its own
    assert sorted(report.config_groups(runs)[0]) == [("cifar10", "data=digits stand-in"),
                                                     ("cifar10", "data=unrecognised data abababab")]
    assert report.oracle_free_cell({**runs[0], "run_dir": "/r/cifar10-mask-s0-teacher"}) == (
        "digits stand-in (task cifar10)", "teacher")
    rows = [["cifar10", SOFT, "mask", "0", str(s), metric, "0.5"] for s in (0, 10)
            for metric in ("top1", "prior_mass_mean")]
    for name in ("curves", "visionprior"):
        _write_csv(tmp_path / f"{name}.csv", CURVES, rows)
    assert _main(["redraw", str(tmp_path)], capsys)[0] == 0
    assert {ax.get_title().split("\n")[0] for ax in drawn["curves.png"].axes} == {"cifar10"}
    _write_csv(tmp_path / "data.csv", list(report.DATA_HEADER), report.data_rows(runs[:2]))
    assert _main(["redraw", str(tmp_path)], capsys)[0] == 0
    assert {ax.get_title().split("\n")[0] for ax in drawn["curves.png"].axes} == {"digits stand-in (task cifar10)"}
    assert "data: digits stand-in (task cifar10)" in " ".join(drawn["visionprior.png"]._suptitle.get_text().split())


def test_every_committed_figure_of_a_task_that_reads_files_names_its_data():
    """Issue 65, 4: each results folder whose figures draw a task that reads its data from files (vision, language)
    says in data.csv which data set that was, so that its figures (redrawn) are titled with it."""
    import tasks
    report, checked = reporting.report, []
    for table in sorted(RESULTS.glob("*/*.csv")):
        if report.REDRAWN.get(table.stem, (None,))[0] != report.CURVES_HEADER:
            continue
        checked.append(table.name)
        read = {r[0] for r in report.read_rows(str(table), report.CURVES_HEADER, report._curve_row)
                if tasks.TASKS[r[0]].KIND not in report.GENERATED}
        named = table.parent / "data.csv"
        data = dict(report.read_rows(str(named), report.DATA_HEADER, report._data_row)) if named.exists() else {}
        assert read <= set(data), (table, read, data)
    assert {"curves.csv", "visionprior.csv", "lee.csv"} <= set(checked), checked          # the loop reads them


def test_legends_and_titles_read_as_words_not_flags(tmp_path, drawn, capsys):
    """Issue 65, 3: a legend entry is the init and its configuration in words ("mask (soft bump, α 0.3)"), the
    parts most lines share said once in the caption; no legend or title of a committed table prints a flag ("--")."""
    report = reporting.report
    series = [("mask", SOFT), ("mask", SOFT.replace("alpha=1.0", "alpha=0.3")),
              ("qk-svd", SOFT.replace("pattern=soft", "pattern=None").replace("scale=None", "scale=18.0")),
              ("default", SOFT.replace("pattern=soft", "pattern=None"))]
    labels, said = report.series_labels(series)
    assert list(labels.values()) == ["mask (soft bump)", "mask (soft bump, α 0.3)", "qk-svd (positions x18)",
                                     "default"] and said == "M off -10, α 1"
    assert report.config_words("answer_order=lsb, epochs=40.0, log_every=48") == "lsb first, epochs 40, log every 48"
    for table in sorted(RESULTS.glob("*/*.csv")):
        if table.stem in report.STUDY_FIGURES or table.stem == "curves":
            rows = report.read_rows(str(table), report.CURVES_HEADER, report._curve_row)
            labels, said = report.series_labels(list(dict.fromkeys((r[2], r[1]) for r in rows)))
            words = [*labels.values(), said, *(report.config_words(r[1]) for r in rows)]
            assert not [w for w in words if "--" in w] and len(set(labels.values())) == len(labels), table
    _write_csv(tmp_path / "visionprior.csv", CURVES, [["cifar10", config, init, "0", "0", "top1", "0.5"]
                                                      for init, config in series])
    assert _main(["redraw", str(tmp_path)], capsys)[0] == 0
    legend = [t.get_text() for t in drawn["visionprior.png"].legends[0].get_texts()]
    assert legend == ["mask (soft bump)", "mask (soft bump, α 0.3)", "qk-svd (positions x18)", "default"], legend


@pytest.mark.slow
def test_the_digits_stand_in_is_known_by_the_hash_its_runs_record(tmp_path):
    """KNOWN_DATA names the digits stand-in by the sha256 a run on `train.py make-digits`'s files records."""
    pytest.importorskip("sklearn")
    import datafetch.write
    import tasks
    datafetch.write.make_digits(str(tmp_path / "digits"))
    sha = tasks.load_image_dataset("cifar10", str(tmp_path / "digits"))["data_hash"]
    assert reporting.report.data_set({"kind": "vision", "data": sha}) == "digits stand-in"


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


MAX_ASPECT = 4.0          # no figure wider than 4:1 or taller than 1:4


def figure_problems(fig, drawn: bool = False) -> list[str]:
    """What makes a drawn figure hard to read, as lines (none: readable): wider than 4:1 or taller than 1:4, a panel
    with nothing drawn in it or without a label on each axis, a legend of more than LEGEND_MOST (8) entries, two
    panels (colour bars too) over each other, or two pieces of text (titles, labels, tick labels, legend entries)
    whose boxes overlap (the renderer's extents, one pixel of slack). `drawn`: the figure was just drawn at its
    current dpi (a save), so its layout is the one checked and it is not drawn again. Every report and show test
    checks each figure it saves with it (`readable_figures`)."""
    from matplotlib.text import Text
    w, h = fig.get_size_inches()
    strip = max(w / h, h / w) > MAX_ASPECT
    problems = [f"{w:.1f} x {h:.1f} inches: a strip (more than {MAX_ASPECT:g}:1)"] if strip else []
    if not drawn:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = set()
    for ax in fig.axes:
        if ax.get_visible() and not (ax.lines or ax.images or ax.collections or ax.patches or ax.texts):
            problems.append(f"panel {ax.get_title()!r}: nothing drawn")
        if ax.get_visible() and ax.get_label() != "<colorbar>" and not (ax.get_xlabel() and ax.get_ylabel()):
            problems.append(f"panel {ax.get_title()!r}: an axis without a label")
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 * (hi - lo) <= tick.get_loc() <= hi + 1e-9 * (hi - lo):  # located, not drawn
                    hidden.update((id(tick.label1), id(tick.label2)))
    most = reporting.figures.LEGEND_MOST
    problems += [f"a legend of {n} entries (at most {most})" for legend in fig.legends + [ax.get_legend() for ax in
                 fig.axes] if legend and (n := len(legend.get_texts())) > most]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    for i, a in enumerate(panels):
        for b in panels[i + 1:]:
            one, two = a.get_window_extent(renderer), b.get_window_extent(renderer)
            if min(one.x1, two.x1) - max(one.x0, two.x0) > 1 and min(one.y1, two.y1) - max(one.y0, two.y0) > 1:
                problems.append(f"panels {a.get_title() or a.get_label()!r} and "
                                f"{b.get_title() or b.get_label()!r} overlap")
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden
             and all(a.get_visible() for a in [t.axes] if a is not None)]
    boxes = np.array([t.get_window_extent(renderer).extents for t in texts]).reshape(-1, 4)
    x = np.minimum(boxes[:, None, 2], boxes[None, :, 2]) - np.maximum(boxes[:, None, 0], boxes[None, :, 0])
    y = np.minimum(boxes[:, None, 3], boxes[None, :, 3]) - np.maximum(boxes[:, None, 1], boxes[None, :, 1])
    for i, j in zip(*np.nonzero(np.triu((x > 1) & (y > 1), 1))):
        problems.append(f"text {texts[i].get_text()!r} overlaps {texts[j].get_text()!r}")
    return problems


@pytest.fixture
def readable_figures(monkeypatch):
    """Every figure saved while the test runs (by report, show or anything else) is checked by
    `figure_problems` as it is saved: {its caption: its problems}; the test fails at the end if
    any has one."""
    matplotlib = _extra("matplotlib")
    import matplotlib.figure
    seen, save = {}, matplotlib.figure.Figure.savefig

    def checked(fig, *args, **kw):                  # the figure as saved: drawn once, at the save's dpi
        out, dpi = save(fig, *args, **kw), fig.dpi
        fig.set_dpi(kw.get("dpi", dpi))
        seen[fig._suptitle.get_text() if fig._suptitle else repr(args[0])] = figure_problems(
            fig, drawn=True
        )
        fig.set_dpi(dpi)
        return out
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked)
    yield seen
    assert seen and not {k: v for k, v in seen.items() if v}, seen


@pytest.mark.slow
def test_figure_problems_finds_a_strip_overlapping_text_and_a_blank_panel(tmp_path, readable_figures):
    """The check itself: each fault it names, made on purpose, is found (issue 75, 7: an axis without its label, a
    legend of more than 8 entries); a plain figure has none."""
    plt = reporting.figures.pyplot()
    fig, axes = plt.subplots(1, 5, figsize=(20, 3))
    for ax in axes[:4]:
        ax.plot([0, 1], [0, 1])
        ax.set(xlabel="x", ylabel="y" if ax is not axes[2] else "")
    axes[1].legend([axes[1].lines[0]] * 9, [f"line {i}" for i in range(9)], fontsize=3, ncols=9)
    axes[0].set_title("one title")
    axes[0].text(0.5, 1.0, "one title too", transform=axes[0].transAxes, ha="center", va="bottom")
    problems = figure_problems(fig)
    fig.canvas.print_figure(io.BytesIO(), format="png")            # as the fixture checks: drawn by a save
    assert figure_problems(fig, drawn=True) == problems
    assert any("a strip" in p for p in problems) and any("nothing drawn" in p for p in problems)
    assert [p for p in problems if "without a label" in p or "legend" in p] == [
        "panel '': an axis without a label", "panel '': an axis without a label", "a legend of 9 entries (at most 8)"]
    assert any("'one title' overlaps 'one title too'" in p or "'one title too' overlaps 'one title'" in p
               for p in problems), problems
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3))
    image = ax.imshow([[0.0, 1.0]])
    fig.colorbar(image, ax=ax, label="one")
    fig.add_axes([0.8, 0.1, 0.15, 0.8]).plot([0, 1])            # over the colour bar
    assert any("overlap" in p and "panels" in p for p in figure_problems(fig))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 3), layout="constrained")
    ax.plot([0, 1], [0, 1], label="a")
    ax.set(title="fine", xlabel="x", ylabel="y")
    assert figure_problems(fig) == []
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
        for init, tag, flags in (("default", "", {}), ("mask", "", {}),
                                 ("mask", "-discovered", {"pattern": "discovered"}),
                                 ("mask", "-teacher", {"prior_from": "T"}),
                                 ("qk-svd", "-teacher", {"prior_from": "T"})):
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
    curves = reporting.report.read_rows(
        str(tmp_path / "res" / "curves.csv"), reporting.report.CURVES_HEADER, reporting.report._curve_row
    )
    assert ("addition", "steps=250", "mask", 0, 30, "seq_acc", 0.3) in curves
    assert (
        len({reporting.figures.line_style(i) for i in range(40)}) == 40
        and reporting.figures.line_style(3, "mask") == reporting.figures.INIT_STYLES["mask"]
    )


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
    _curve_run(
        runs / "boolean",
        "parity2",
        "mask",
        0,
        [{"acc_unseen": 0.5, "mse": 1.0}, {"acc_unseen": 1.0, "mse": 0.1}],
        kind="boolean",
    )
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
    """train.py show RUN: m.png (M at the start and the end, a grid of layers x heads, no strip wider than 4:1),
    attention.png and the run's curves.png for a mask run; no m.png for an init without M; a relative M as profiles;
    a folder without a checkpoint or an --out that is a file is one line, exit 2, nothing written."""
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
        assert files == (["attention.png", "curves.png", "m.png"] if init == "mask"
                         else ["attention.png", "curves.png"]), printed
        assert init == "mask" or "has no M (--init default)" in printed[0]
        for f in files:
            w, h = Image.open(tmp_path / f"fig-{init}" / f).size
            assert max(w, h) <= 4 * min(w, h) and min(w, h) > 200
    start = [torch.linspace(-5, 5, 9).expand(3, 9)] * 2             # a relative M: 2 layers, 3 heads, 9 distances
    deep = [torch.randn(3, 5, 5)] * 12                               # ViT-Tiny's 12 layers x 3 heads: blocks wrap
    for path in (reporting.show.draw_m(start, [s + 1 for s in start], str(tmp_path / "rel.png"), "relative",
                                       causal=True),
                 reporting.show.draw_m(deep, deep, str(tmp_path / "deep.png"), "deep"),
                 reporting.show.draw_attention(torch.rand(12, 3, 5, 5), str(tmp_path / "deep-attention.png"), "deep"),
                 reporting.show.draw_attention(torch.rand(2, 3, 5, 5), str(tmp_path / "vit.png"), "vit", grid=(2, 1))):
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
    assert (
        reporting.report.mean_std([]) == ""
        and reporting.report.mean_std([0.5]) == "0.50 (1 seed)"
        and reporting.report.mean_std([3.0], digits=0) == "3 (1 seed)"
    )
    assert (
        reporting.report.mean_std([1.0, 1.0]) == "1.00 ± 0.00"
        and reporting.report.mean_std([1.0, 3.0], count=True) == "2.00 ± 1.41 (2)"
    )
    assert reporting.report.mean_std([7.0], count=True) == "7.00 (1 seed)"
    one = [{"prior_mass_start": 0.9, "prior_mass_end": 0.8}]
    assert (
        reporting.report._mass(one) == "0.90 → 0.80 (1 seed)"
        and reporting.report._mass(one * 2) == "0.90 ± 0.00 → 0.80 ± 0.00"
    )
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
    flags = {
        "": {},
        "discovered": {"pattern": "discovered"},
        "teacher": {"prior_from": "T"},
        "budget2x": {"steps": 1200},
    }
    for (init, tag), a in acc.items():
        for seed in (0, 1):
            d = _fake_run(folder, "parity2", init, seed, 0.75, tag=f"-{tag}" if tag else "", readout="mean",
                          **flags[tag])
            res = json.load(open(d / "result.json"))
            res["metrics"]["acc_unseen"] = a + 0.01 * seed
            if tag:
                res["prior_source"] = {
                    "from": "data" if tag == "discovered" else "teacher",
                    "precision": 0.5 + 0.5 * seed,
                    "recall": 1.0,
                }
            torch.save({"pattern": found, "logits": found.float(), "source": res.get("prior_source") or {}},
                       d / "prior.pt")
            (d / "result.json").write_text(json.dumps(res))
    written = reporting.report.report(str(tmp_path / "runs"), str(tmp_path / "res"))
    table = (tmp_path / "res" / "oraclefree.md").read_text().splitlines()
    assert table[0] == (
        "| task | metric | default | hand pattern, mask | found in the data, mask | from the teacher, mask "
        "| the teacher's pattern, qk-svd | default, the teacher's + the student's steps |"
    )
    assert table[2] == ("| parity2 | accuracy on U % | 0.50 ± 0.71 (2) | 100.50 ± 0.71 (2) | 100.50 ± 0.71 (2) | "
                        "50.50 ± 0.71 (2) | 10.50 ± 0.71 (2) | 2.50 ± 0.71 (2) |")
    assert "| parity2 | the data | 0.75 ± 0.35 | 1.00 ± 0.00 | 2 |" in table
    assert "| parity2 | teacher | 0.75 ± 0.35 | 1.00 ± 0.00 | 2 |" in table
    if reporting.figures.pyplot() is not None:
        assert {"oraclefree_patterns.png", "oraclefree_mass.png"} <= {os.path.basename(p) for p in written}


def test_oracle_free_rows_and_columns_come_from_the_folder_names():
    """The row is the task plus the corpus or the step count a tag names; the default at a teacher's steps plus
    its student's (samebudget) is the budget2x column; a seed's digits inside a tag do not split it."""
    cell = lambda name, task, seed: reporting.report.oracle_free_cell(
        {
            "run_dir": f"/r/oraclefree/{name}",
            "task": task,  # noqa: E731
            "seed": seed,
        }
    )
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
    assert {"curves.csv", "steps_to_target.md", "prior_layers.md", "persistence.csv"} <= set(
        os.listdir(tmp_path / "res")
    )
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


@pytest.mark.slow
@pytest.mark.parametrize("command", ["report", "redraw", "show"])
def test_an_output_folder_that_cannot_take_the_outputs_is_one_line_before_any_work(tmp_path, capsys, command):
    """Issue 73: report, redraw and show check their OUT before any work (`runfiles.output_folder`): one that is
    read-only, or holds a folder where a table or figure goes, is one line and exit 2, and OUT is as it was (a
    folder made on the way to it removed again; before, a traceback after the work)."""
    runs, run = _report_case(tmp_path, "")
    results = tmp_path / "results"
    assert train.main(["report", str(runs), str(results)]) == 0
    argv = {"report": ["report", str(runs)], "redraw": ["redraw"], "show": ["show", str(run), "--out"]}[command]
    target = {"report": "boolean.md", "redraw": "curves.png", "show": "m.png"}[command]
    out = results if command == "redraw" else tmp_path / "out"
    if command != "redraw":
        out.mkdir()
    (out / target).unlink(missing_ok=True)
    (out / target).mkdir()
    before = _tree(out)
    capsys.readouterr()
    assert train.main([*argv, str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{target} is not a regular file" in err and len(err.splitlines()) == 1, err
    assert _tree(out) == before
    if command != "redraw":
        with _small_disk(tmp_path / "ro", read_only=True) as ro:
            assert train.main([*argv, str(ro / "deeper")]) == 2
            err = capsys.readouterr().err.strip()
            assert "Read-only file system" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("where", ["a folder above a folder of runs", "an empty folder", "a folder of other things"])
def test_report_on_a_folder_without_table_folders_is_one_line_and_writes_nothing(tmp_path, capsys, where):
    """Neither table folders nor run folders: one line, nothing written; where a folder in it holds runs, the line
    gives the command that reports them, and that command works."""
    runs = tmp_path / "runs"
    if where == "a folder above a folder of runs":
        _fake_run(runs / "mine", "parity2", "mask", 0, 1.0)
    elif where == "an empty folder":
        runs.mkdir()
    else:
        (runs / "notes").mkdir(parents=True)
    assert train.main(["report", str(runs), str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds none of the table folders" in err and "nothing was written" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "res").exists()
    if where == "a folder above a folder of runs":
        suggested = err.split("python train.py ")[1].split()
        assert suggested == ["report", str(runs / "mine"), str(tmp_path / "res")]
        assert train.main(suggested) == 0 and (tmp_path / "res" / "runs.md").exists()


@pytest.mark.parametrize("name,table", [("mine", "runs"), ("boolean", "boolean")])
def test_report_takes_a_folder_of_single_runs_as_one_table(tmp_path, capsys, name, table):
    """The README's single runs (runs/parity2-mask-s0, ...) report as they are: one table, named for the folder where
    it is a table's (a table's folder given alone), runs.md otherwise, with the curves and the per-run tables."""
    for init, acc in (("mask", 1.0), ("default", 0.75)):
        _fake_run(tmp_path / name, "parity2", init, 0, acc)
    assert train.main(["report", str(tmp_path / name), str(tmp_path / "res")]) == 0
    text = (tmp_path / "res" / f"{table}.md").read_text()
    assert "**parity2**" in text and "| mask | 0 | 100.00" in text and "| default | 0 | 75.00" in text
    assert {"curves.csv", "steps_to_target.md", "prior_layers.md"} <= set(os.listdir(tmp_path / "res"))


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
