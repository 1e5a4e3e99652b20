"""The reports' promises, fuzzed: what `report`, `redraw`, `summarize`, `show` and `python -m reporting.plan` read
back (a metrics.jsonl line, a report's CSV, a checkpoint's probe snapshot, plan's flags) gives either a valid
result or exactly one line on stderr with exit status 2: never a traceback, nothing touched outside the output
folder, in bounded time. Property tests (Hypothesis) over each format, the cases of issue 64 as their @examples,
and a plain regression test for each.

    python -m pytest -q test_pending_reporting.py          # about 40 s on two cores
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import reporting.figures
import reporting.plan
import reporting.report
import runfiles
import train

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


# ---------------------------------------------------------------------------------------- result.json (found by the fuzzer)

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
        problems[os.path.basename(path)] = reporting.figures.figure_problems(fig, drawn=True)
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
    st.tuples(st.sampled_from(["--jobs", "--seeds"]), TOKENS),
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


# ---------------------------------------------------------------------------------------- the checkpoint's probe snapshot

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


# ---------------------------------------------------------------------------------------- figures: readable, titled with their data (issue 65)

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
        assert max(w / h, h / w) <= reporting.figures.MAX_ASPECT, (png, w, h)


def test_the_oracle_free_figures_wrap_into_a_grid_under_their_caption(tmp_path, drawn):
    """Issue 65, 1 and 2: the mass curves of 17 tasks are a grid within 4:1 (a row of panels was 17.3:1), and the
    caption of the patterns figure clears its first row's titles (tight_layout left it over them)."""
    table, rows = _oracle_free_table(tmp_path, 17)
    reporting.report.oracle_free_mass(table, rows, str(tmp_path))
    w, h = drawn["oraclefree_mass.png"].get_size_inches()
    assert max(w / h, h / w) <= reporting.figures.MAX_ASPECT, (w, h)
    table, rows = _oracle_free_table(tmp_path, 4)
    reporting.report.oracle_free_figure(table, rows, str(tmp_path))
    assert reporting.figures.figure_problems(drawn["oraclefree_patterns.png"]) == []


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
