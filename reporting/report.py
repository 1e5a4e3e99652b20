"""The reports of a reproduction: its run folders -> results/*.md tables, learning and persistence curves, the prior
per layer, data efficiency and the oracle-free study. Loaded only by `python train.py summarize`, `report` and
`redraw`; it reads what train.py wrote (result.json, args.json, metrics.jsonl, through runfiles) and never trains or
changes a run.

Reading order: collecting runs (each once) -> the summary table -> the report's tables and figures, in the order
above -> `report`, which writes them all."""
from __future__ import annotations

import collections
import csv
import errno
import io
import json
import os
import re

import inits
import runfiles
from reporting import show
from reporting.figures import (LABEL_LINES, caption, in_groups, legend_below, line_style, panel_grid, plot_band,
                               pyplot, save_figure, token_ticks, wrapped)

# ---- Summaries: run directories -> a markdown table (mean +- std over seeds)

# The paper's numbers (%): whole-cube accuracy (Boolean), sequence accuracy (arithmetic); "~": approximate.
PAPER = {
    ("parity2", "default"): "~75", ("parity2", "qk-svd"): "~75", ("parity2", "qk-opt"): "~75",
    ("parity2", "mask"): "100",
    ("majority3", "default"): "~87", ("majority3", "qk-svd"): "~87", ("majority3", "qk-opt"): "~87",
    ("majority3", "mask"): "100",
    ("cyclic3", "mask"): "99.98",
    ("addition", "default"): "1.19", ("addition", "mask"): "77.49",
    ("multiplication", "default"): "5.01", ("multiplication", "mask"): "69.49",
    ("cifar10", "mask"): "95.66", ("cifar10", "impulse"): "95.12", ("cifar10", "default"): "94.20",
}


def collect_runs(paths) -> tuple[list, list]:
    """Read result.json under each path (a run directory or a folder of them). Returns (results, problems):
    problems name every run directory whose result.json is missing (an unfinished run) or unreadable, and every
    run counted once already (`once_each`), so nothing is skipped or counted twice silently."""
    runs, problems, dirs = [], [], []
    for path in paths:
        if os.path.exists(os.path.join(path, "args.json")) or os.path.exists(os.path.join(path, "result.json")):
            dirs.append(path)
        elif os.path.isdir(path):
            dirs += sorted(os.path.join(path, d) for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
        else:
            problems.append(f"{path}: no such run directory")
    for d in dirs:
        res = os.path.join(d, "result.json")
        if not os.path.lexists(res):
            problems.append(f"{d}: no result.json (unfinished or failed run)")
            continue
        try:
            runs.append({**runfiles.read_result(res), "run_dir": d})
        except runfiles.ReadError as e:
            problems.append(f"{d}: unreadable result.json ({e})")
    return once_each(runs, problems)


def once_each(runs: list, problems: list) -> tuple[list, list]:
    """Each run once: a folder with the run id of one already read (a copy) or with its task, init, seed, flags and
    data (the same run again) is left out and named in problems; on other data it is another run."""
    kept, ids, configs = [], {}, {}
    for r in runs:
        key = json.dumps([r["task"], r["init"], r["seed"], run_config(r), r["data"]], sort_keys=True, default=repr)
        rid = r["run_id"]
        if rid in ids:
            problems.append(f"{r['run_dir']}: a copy of {ids[rid]} (the same run, id {rid}): counted once")
        elif key in configs:
            problems.append(f"{r['run_dir']}: the same task, init, seed, flags and data as "
                            f"{configs[key]}: counted once")
        else:
            kept.append(r)
        if rid:
            ids.setdefault(rid, r["run_dir"])
        configs.setdefault(key, r["run_dir"])
    return kept, problems


def mean_std(values, digits: int = 2, count: bool = False) -> str:
    """"mean ± sample std" of the values with `digits` decimals, and their number in brackets with
    `count`; one value is "value (1 seed)" (no spread to show, not a spread of 0); "" for none."""
    if not values:
        return ""
    m = sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.{digits}f} (1 seed)"
    s = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{m:.{digits}f} ± {s:.{digits}f}" + (f" ({len(values)})" if count else "")


def init_order(runs: list):
    """The sort key of the inits of `runs`: each init's place in inits.INITS, as its runs record it."""
    return {r["init"]: r["init_order"] for r in runs}.__getitem__


def _by_init(runs: list) -> dict:
    """{init: its runs, by seed}."""
    by = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        by.setdefault(r["init"], []).append(r)
    return by


def md_table(header: list, rows) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _pct(key):
    return _num(key, 100)


def _num(key, scale=1, count=False):
    return lambda ms: mean_std([scale * m[key] for m in ms if m.get(key) is not None], count=count)


def _mass(ms):
    start, end = ([m[k] for m in ms if m.get(k) is not None] for k in ("prior_mass_start", "prior_mass_end"))
    if len(start) == len(end) == 1:                        # one run: said once
        return f"{start[0]:.2f} → {end[0]:.2f} (1 seed)"
    return f"{mean_std(start)} → {mean_std(end)}" if start or end else ""


def _mdi(ms):
    m = ms[0]
    extra = f" (sign {100 * m['mdi_sign_acc']:.1f})" if m.get("mdi_sign_acc") is not None else ""
    return "" if m.get("mdi_acc") is None else f"{100 * m['mdi_acc']:.1f}{extra}"


# Columns of the summary table by task kind: (header, function of the runs' metrics).
COLUMNS = {
    "boolean": [("acc %", _pct("acc")), ("acc on U %", _pct("acc_unseen")), ("sign acc %", _pct("sign_acc")),
                ("MSE on U", _num("mse_unseen")), ("MSE", _num("mse")), ("prior mass start → end", _mass),
                ("MDI acc %", _mdi)],
    "arithmetic": [("seq acc %", _pct("seq_acc")), ("digit acc %", _pct("digit_acc")),
                   ("train seq acc %", _pct("train_seq_acc")), ("prior mass start → end", _mass)],
    "vision": [("top-1 %", _pct("top1")), ("test loss", _num("loss")), ("prior mass start → end", _mass)],
    "lm": [("val loss", _num("val_loss")), ("val ppl", _num("val_ppl")), ("prior mass start → end", _mass)],
}


def summarize(paths, collected: tuple | None = None) -> str:
    """A markdown table per task: the kind's metrics (mean ± std over seeds), the prior's attention mass at start
    and end, and the paper's number beside ours (of the runs under `paths`, or `collected` from them already)."""
    runs, problems = collected or collect_runs(paths)
    groups, notes = config_groups(runs)
    out = [f"- {n}" for n in notes]
    for (task, label), group in groups.items():
        by = _by_init(group)
        every = [[r["metrics"] for r in rs] for rs in by.values()]
        cols = [(h, f) for h, f in COLUMNS.get(group[0].get("kind", "boolean"), COLUMNS["boolean"])
                if any(f(ms) for ms in every)]
        out.append(f"\n**{task}**" + (f" ({label})" if label else "") + "\n")
        rows = []
        for init in sorted(by, key=init_order(group)):
            ms = [r["metrics"] for r in by[init]]
            rows.append([init, ",".join(str(r["seed"]) for r in by[init]), *(f(ms) for _, f in cols),
                         PAPER.get((task, init), "")])
        out += md_table(["init", "seeds", *(h for h, _ in cols), "paper %"], rows)
    if problems:
        out.append("\nNot included:\n" + "\n".join(f"- {p}" for p in problems))
    return "\n".join(out).strip() + "\n"


# ---- Report: a reproduction's run folders -> results/*.md tables and the persistence curves

TABLES = ("boolean", "arithmetic", "vision", "lm", "mult2", "visionprior", "lee", "parity3")
REPORT_FOLDERS = (*TABLES, "ablation", "data", "oraclefree")  # what `report` reads in a runs folder
TABLE_TITLES = {"boolean": "Boolean GOTU tasks (whole-cube accuracy; MDI = min-degree interpolator)",
                "arithmetic": "Low-data arithmetic (sequence and digit accuracy on 10,000 held-out pairs)",
                "vision": "ViT image classification (top-1 on the test split)",
                "lm": "Language modelling (validation loss and perplexity)",
                "mult2": "Two-digit multiplication (sequence and digit accuracy on every pair not trained on)",
                "visionprior": "The vision priors (top-1 on the test split; one table per --pattern)",
                "lee": "Lee et al.'s multiplication data (--lee-samples: sequence accuracy on every pair not "
                       "trained on, and on the training samples)",
                "parity3": "3-parity (kparity on bits 2, 7, 11) across layouts: readout, positional std, depth and "
                           "the bits frozen on U"}
PERSISTENCE_INITS = inits.WHERE_THE_PRIOR_LIVES          # the prior in M, or in Wq Wk


def _table_folders(runs: str) -> list[str]:
    return [t for t in REPORT_FOLDERS if os.path.isdir(os.path.join(runs, t))]


# How a configuration's flag reads in a legend or a panel's title (`config_words`): flag -> its words, "{}" standing for
# the value; any other flag reads as its name and value ("steps 250"). A named pattern reads as its name.
FLAG_WORDS = {"pattern": "{} pattern", "mask_off": "M off -{}", "mask_on": "M on +{}", "soft_alpha": "α {}",
              "qk_svd_pos_scale": "positions x{}", "answer_order": "{} first", "pos_init_std": "positional std {}"}
PATTERN_WORDS = {"soft": "soft bump", "local": "local window"}


def flag_words(key: str, value: str) -> str:
    """("pattern", "soft") -> "soft bump", ("mask_off", "10.0") -> "M off -10", ("log_every", "5") -> "log every 5"."""
    value = value[:-2] if value.endswith(".0") else value
    if key == "pattern" and value in PATTERN_WORDS:
        return PATTERN_WORDS[value]
    return FLAG_WORDS[key].replace("{}", value) if key in FLAG_WORDS else f"{key.replace('_', ' ')} {value}"


def config_words(label: str, said: frozenset = frozenset()) -> str:
    """A configuration's label ("mask_off=10.0, pattern=soft") as a legend or a title reads it: its flags in words
    ("M off -10, soft bump"), leaving out a flag not given (None: the preset's) and the parts in `said` (a figure's
    caption says them once); a part that is not flag=value is kept as it is."""
    words = []
    for part in filter(None, label.split(", ")):
        key, eq, value = part.partition("=")
        if part not in said and value != "None":
            words.append(flag_words(key, value) if eq else part)
    return ", ".join(words)


def series_labels(series: list) -> tuple[dict, str]:
    """({(init, configuration label): its legend entry}, what the caption says for them) of a figure's series: the
    init, then the configuration in words less the flag=value parts (given) that more than half of the series hold
    ("mask (soft bump, α 0.3)"), and those shared parts in words ("" for none). No two entries read alike: where
    leaving the shared parts out would make them so, every part is spelled out."""
    counts = collections.Counter(p for _, c in series for p in set(filter(None, c.split(", "))))
    said = frozenset(p for p, n in counts.items() if 2 * n > len(series) and "=" in p and not p.endswith("=None"))
    for known in (said, frozenset()):
        labels = {(i, c): i + (f" ({words})" if (words := config_words(c, known)) else "") for i, c in series}
        if len(set(labels.values())) == len(labels):
            break
    return labels, config_words(", ".join(sorted(known)))


# The data a run read, by the sha256 its result.json records (`data`: `Task.data_hash`), where it is not what the task's
# name says: train.py's stand-ins (`make-digits`) are the same bytes on every machine. A task whose family makes its
# data (GENERATED) is its own data set; a task that reads files names its data here or says it is not recognised, so
# that no figure titles a stand-in with the real set's name ("cifar10" reads the digits in CIFAR-10's layout).
KNOWN_DATA = {"286666e57db38e96d7105699a9009b0e1911902e38f7bbfd2825f993cc4b7037": "digits stand-in"}
GENERATED = ("boolean", "arithmetic")
DATA_HEADER = ("task", "data")


def data_set(run: dict) -> str | None:
    """The data set a run read where a figure must name it (KNOWN_DATA, or "unrecognised data"
    and its sha256's first 8 digits), or None where the task makes its own (GENERATED)."""
    if run.get("kind", "boolean") in GENERATED:
        return None
    sha = run.get("data") or ""
    return KNOWN_DATA.get(sha) or "unrecognised data" + (f" {sha[:8]}" if re.fullmatch(r"[0-9a-f]{64}", sha) else "")


def data_rows(runs: list) -> list[tuple]:
    """data.csv's rows: (task, its runs' data set) of each task whose runs all read one named set (`data_set`)."""
    sets = {}
    for r in runs:
        sets.setdefault(r["task"], set()).add(data_set(r))
    return sorted((task, *named) for task, named in sets.items() if len(named) == 1 and None not in named)


def data_title(task: str, data: dict | None = None) -> str:
    """What a figure calls a task: the data set it read where `data` ({task: data set}, data.csv)
    names one, "digits stand-in (task cifar10)"; else the task."""
    named = (data or {}).get(task)
    return f"{named} (task {task})" if named else task


def log_records(run: dict) -> list[dict]:
    """The records of a run's metrics.jsonl (one per logged step, each checked against the model its result.json
    names: `runfiles.read_log`), or [] when it has none; read once per run dict."""
    if "_records" not in run:
        path = os.path.join(run["run_dir"], "metrics.jsonl")
        layers = (run.get("config") or {}).get("n_layers")
        try:
            run["_records"] = runfiles.read_log(path, layers) if os.path.isfile(path) else []
        except runfiles.LogError as e:  # the run has no curves; its result.json still counts in the tables
            run["_records"] = []
            run["_log_problem"] = str(e)
    return run["_records"]


def persistence_rows(boolean_dir: str) -> list[dict]:
    """Per logged step of every Boolean run of a PERSISTENCE_INITS init, from its metrics.jsonl: the attention mass on
    the pattern (mean and per layer) and the mean drift of the prior itself (M, or Wq Wk^T for the QK inits)."""
    rows = []
    for r in collect_runs([boolean_dir])[0]:
        if r["init"] not in PERSISTENCE_INITS:
            continue
        drift_key = "mask_drift" if r["init"] == "mask" else "qk_drift"
        for rec in log_records(r):
            if rec.get("prior_mass") is None:
                continue
            drift = rec.get(drift_key)
            rows.append({"task": r["task"], "init": r["init"], "seed": r["seed"], "step": rec["step"],
                         "mass": rec["prior_mass_mean"], "layers": rec["prior_mass"],
                         "drift": sum(drift) / len(drift) if drift else float("nan")})
    rows.sort(key=lambda x: (x["task"], PERSISTENCE_INITS.index(x["init"]), x["seed"], x["step"]))
    return rows


PERSISTENCE_HEADER = ("task", "init", "seed", "step", "mass_mean", "drift_mean")


def write_persistence(rows: list[dict], out_dir: str) -> list[str]:
    """persistence.csv always; persistence.png (`draw_persistence`) with matplotlib. Returns the paths written."""
    n_layers = max((len(r["layers"]) for r in rows), default=0)
    lines = [",".join([*PERSISTENCE_HEADER, *(f"mass_layer{i}" for i in range(n_layers))])]
    for r in rows:
        lines.append(f"{r['task']},{r['init']},{r['seed']},{r['step']},{r['mass']:.5f},{r['drift']:.5f},"
                     + ",".join(f"{m:.5f}" for m in r["layers"]))
    return ([emit(out_dir, "persistence.csv", "\n".join(lines) + "\n")]
            + draw_persistence(rows, os.path.join(out_dir, "persistence.png")))


def draw_persistence(rows: list[dict], path: str, data: dict | None = None) -> list[str]:
    """persistence.png from persistence rows: per task (`data_title`), the mass on the pattern and the drift of the
    prior against the step, a band per prior init (`plot_band`). Returns [path], or [] without matplotlib."""
    tasks = sorted({r["task"] for r in rows})
    if (made := panel_grid(len(tasks), rows=2, width=4.2, height=3.0)) is None:
        return []
    _, fig, at = made
    for b, task in enumerate(tasks):
        for row, key, what in ((0, "mass", "attention mass on the pattern"),
                               (1, "drift", "relative change of the prior")):
            for i, init in enumerate(PERSISTENCE_INITS):
                by_step = {}
                for r in rows:
                    if r["task"] == task and r["init"] == init and r[key] == r[key]:        # drift may be NaN
                        by_step.setdefault(r["step"], []).append(r[key])
                if by_step:
                    plot_band(at(b, row), by_step, init, line_style(i, init))
            at(b, row).set_title(f"{data_title(task, data)}: {what}", fontsize=9)
            at(b, row).set(xlabel="training step", ylabel=what)
            at(b, row).grid(alpha=0.3)
        at(b, 0).set_ylim(0, 1.02)
    legend_below(fig)
    caption(fig, "Attention mass on the prior pattern (top) and relative change of the prior itself (bottom: M for "
                 "mask, Wq Wk^T for qk-svd and qk-opt) over training; mean over seeds, band = min to max")
    return [save_figure(fig, path, dpi=120)]


def m_figures(boolean_dir: str, out_dir: str) -> list[str]:
    """m_TASK.png beside persistence.png, per Boolean task with a `mask` run: M at the start and at the end of its
    lowest seed's run whose checkpoint reads, per layer and head (`reporting.show.draw_m`). Needs matplotlib."""
    if pyplot() is None:
        return []
    written, runs = [], sorted(collect_runs([boolean_dir])[0], key=lambda r: r["seed"])
    for task in sorted({r["task"] for r in runs if r["init"] == "mask"}):
        for r in (r for r in runs if r["task"] == task and r["init"] == "mask"):
            try:
                start, end = show.m_of_checkpoint(runfiles.read_checkpoint(os.path.join(r["run_dir"], "ckpt.pt")))
            except (runfiles.ReadError, KeyError, TypeError, AttributeError, ValueError):
                continue
            if end and len(start) == len(end) and all(s is None or s.shape == e.shape for s, e in zip(start, end)):
                title = f"{task} --init mask seed {r['seed']} ({os.path.basename(r['run_dir'])})"
                written.append(show.draw_m(start, end, os.path.join(out_dir, f"m_{task}.png"), title,
                                           names=r.get("token_labels")))
                break
    return written


ABLATION_INITS = inits.EVERYWHERE                        # the inits every family offers


def ablation(folders) -> str:
    """The robustness grid: per Boolean task, a markdown table over readout x positional std x init (mean ± std over
    seeds) of the `small`-preset runs under `folders`; rows at the task's own preset are marked."""
    runs, problems = collect_runs(folders)
    groups = {}
    for r in runs:
        if r.get("preset", "small") != "small" or r.get("kind", "boolean") != "boolean":
            continue
        c = r.get("config") or {}
        groups.setdefault(r["task"], {}).setdefault((c.get("readout"), c.get("pos_init_std"), r["init"]), []).append(r)
    out = []
    for task in sorted(groups):
        mdi = _mdi([next(iter(groups[task].values()))[0]["metrics"]])
        out.append(f"\n**{task}** (MDI: {mdi} %; * = the task's `small` preset)\n")
        rows = []
        for key in sorted(groups[task], key=lambda k: (str(k[0]), k[1] or 0, ABLATION_INITS.index(k[2])
                                                       if k[2] in ABLATION_INITS else 99)):
            readout, pos, init = key
            rs = sorted(groups[task][key], key=lambda r: r["seed"])
            ms = [r["metrics"] for r in rs]
            rows.append([f"{readout}{'*' if all(r.get('at_preset') for r in rs) else ''}", pos, init,
                         ",".join(str(r["seed"]) for r in rs), _pct("acc")(ms), _pct("acc_unseen")(ms),
                         _num("mse_unseen")(ms), _num("pred_unseen")(ms), _num("prior_mass_end")(ms)])
        out += md_table(["readout", "pos std", "init", "seeds", "acc %", "acc on U %", "MSE on U",
                         "mean prediction on U", "prior mass end"], rows)
    if problems:
        out.append("\nNot included:\n" + "\n".join(f"- {p}" for p in problems))
    return "\n".join(out).strip() + "\n"


# Learning curves and steps to target: each run's headline metric at every logged step

PERCENT_METRICS = ("acc_unseen", "seq_acc", "train_seq_acc", "top1")  # fractions, drawn in percent
# Headline metrics by task kind: (metric key, label, higher is better).
CURVE_METRICS = {
    "boolean": (("acc_unseen", "accuracy on U", True), ("mse", "MSE on the cube", False)),
    "arithmetic": (("seq_acc", "sequence accuracy", True),
                   ("train_seq_acc", "sequence accuracy on the training samples", True),  # --lee-samples runs
                   ("prior_mass_mean", "attention mass on the pattern", True)),
    "vision": (("top1", "top-1", True), ("prior_mass_mean", "attention mass on the pattern", True)),
    "lm": (("val_ppl", "validation perplexity", False),),
}


def run_config(run: dict, ignore=frozenset()) -> dict:
    """The flags that define a run's configuration: result.json's tells_apart (every flag but where
    and how it ran, which run it is, its init and seed), less `ignore`."""
    return {k: v for k, v in run["tells_apart"].items() if k not in ignore}


def config_groups(runs: list, ignore=frozenset()) -> tuple[dict, list]:
    """Split runs by task, then by configuration (`run_config` less `ignore`, and the data set where a figure must
    name it: `data_set`). Returns ({(task, label): runs}, notes): label is "" when a task has one configuration, else
    the flags that tell its configurations apart ("steps=250"), and a note names each such mix in one line."""
    by_task, notes, groups = {}, [], {}
    for r in runs:
        named = {"data": data_set(r)} if data_set(r) else {}  # other data: another configuration
        by_task.setdefault(r["task"], []).append((r, {**run_config(r, ignore), **named}))
    for task in sorted(by_task):
        configs = []
        for r, c in by_task[task]:
            for known in configs:
                if known[0] == c:
                    known[1].append(r)
                    break
            else:
                configs.append((c, [r]))
        if len(configs) == 1:
            groups[(task, "")] = configs[0][1]
            continue
        keys = sorted({k for c, _ in configs for k in c})
        differ = [k for k in keys if len({json.dumps(c.get(k)) for c, _ in configs}) > 1]
        configs.sort(key=lambda cr: [json.dumps(cr[0].get(k)) for k in differ])
        for c, rs in configs:
            groups[(task, ", ".join(f"{k}={c.get(k)}" for k in differ))] = rs
        notes.append(f"{task}: {len(configs)} configurations differing in {', '.join(differ)}; "
                     "each is drawn and tabulated on its own, never averaged together")
    return groups, notes


def curve_points(run: dict) -> dict:
    """{metric: [(step, value), ...]} from a run's metrics.jsonl, for its kind's headline metrics (read from the
    record's metrics, or from the record itself where its schema has the key: the prior's mass, prior_mass_mean)."""
    keys = [k for k, _, _ in CURVE_METRICS.get(run.get("kind", "boolean"), ())]
    points = {k: [] for k in keys}
    for rec in log_records(run):
        for k in keys:
            v = rec["metrics"].get(k, rec.get(k) if k in runfiles.LOG_SCHEMA else None)
            if v is not None and v == v:
                points[k].append((rec["step"], float(v)))
    return points


CURVES_HEADER = ("task", "config", "init", "seed", "step", "metric", "value")
EFFICIENCY_HEADER = ("config", "init", "seed", "n_train", "seq_acc", "digit_acc")
METRIC_NAMES = {k: name for metrics in CURVE_METRICS.values() for k, name, _ in metrics}


def curve_rows(groups: dict) -> list[tuple]:
    """(task, configuration label, init, seed, step, metric, value) for every logged headline metric of every run of
    `groups` (`config_groups`), by init then seed: the rows of curves.csv, from which its figures are drawn."""
    return [(task, label, r["init"], r["seed"], step, k, v) for (task, label), rs in groups.items()
            for r in sorted(rs, key=lambda r: (r["init_order"], r["seed"]))
            for k, pts in curve_points(r).items() for step, v in pts]


def write_rows(path: str, header: tuple, rows: list, quoted: int | None = None) -> str:
    """A CSV of `rows` under `header`, written atomically (column `quoted` in double quotes: a
    label with commas; floats to 6 significant digits); returns path."""
    cell = lambda i, v: f'"{v}"' if i == quoted else f"{v:.6g}" if isinstance(v, float) else str(v)   # noqa: E731
    lines = [",".join(header)] + [",".join(cell(i, v) for i, v in enumerate(row)) for row in rows]
    runfiles.atomic_write(path, "\n".join(lines) + "\n")
    return path


def _by_metric(rows: list, key) -> dict:
    """{key(row): {metric: {init or legend: {step: [values over seeds]}}}} of curve rows, in the order first met."""
    out = {}
    for task, label, init, seed, step, metric, value in rows:
        by_init = out.setdefault(key(task, label, init), {}).setdefault(metric, {}).setdefault(init, {})
        by_init.setdefault(step, []).append(value)
    return out


# the metrics in an order that keeps the one CURVE_METRICS gives each family (a task's are one family's)
METRIC_ORDER = ("acc_unseen", "mse", "seq_acc", "train_seq_acc", "top1", "prior_mass_mean", "val_ppl")


def _metric_order(metrics) -> list:
    return sorted(metrics, key=lambda k: METRIC_ORDER.index(k) if k in METRIC_ORDER else len(METRIC_ORDER))


def draw_curves(rows: list, path: str, data: dict | None = None) -> list[str]:
    """curves.png from curve rows: a panel per task, configuration and headline metric, titled by the data set
    (`data_title`) and the configuration in words, a band per init. Returns [path], or [] without matplotlib or rows."""
    panels = [("\n".join(filter(None, (data_title(task, data), config_words(label)))), k, by_init)
              for (task, label), by in _by_metric(rows, lambda t, c, i: (t, c)).items()
              for k in _metric_order(by) for by_init in [by[k]]]
    if (made := panel_grid(len(panels), width=4.0, height=3.0)) is None:
        return []
    _, fig, at = made
    for b, (title, key, by_init) in enumerate(panels):
        ax = at(b)
        for i, (init, by_step) in enumerate(by_init.items()):
            plot_band(ax, by_step, init, line_style(i, init), scale=100.0 if key in PERCENT_METRICS else 1.0)
        if key in ("mse", "val_ppl"):
            ax.set_yscale("log")
        ax.set_title(wrapped(title, 3.8, 8, LABEL_LINES), fontsize=8)
        ax.set_xlabel("training step")
        ax.set_ylabel(METRIC_NAMES.get(key, key) + (" %" if key in PERCENT_METRICS else ""), fontsize=8)
        ax.grid(alpha=0.3)
    legend_below(fig)
    mass = " and the attention mass on the prior pattern" if any(k == "prior_mass_mean" for _, k, _ in panels) else ""
    caption(fig, f"Headline metric{mass} against the training step; mean over seeds, band = min to max")
    return [save_figure(fig, path)]


def draw_comparison(rows: list, path: str, title: str, data: dict | None = None) -> list[str]:
    """One figure that sets every configuration and init side by side: a panel per metric, a band per (init,
    configuration) in words, the series in columns of at most LEGEND_MOST by init, each column its legend, a metric on
    one scale in every column, a configuration in one colour where its column allows; the caption names the data
    (`data_title`) and the parts of the configuration most lines share. Returns [path], or [] without matplotlib."""
    series = _by_metric(rows, lambda t, c, i: (i, c))
    labels, said = series_labels(list(series))
    tasks = " and ".join(data_title(t, data) for t in dict.fromkeys(r[0] for r in rows))
    metrics = _metric_order({k for by in series.values() for k in by})
    columns, configs = in_groups(list(series), key=lambda s: s[0]), list(dict.fromkeys(c for _, c in series))
    if (made := panel_grid(len(columns), rows=len(metrics), width=5.0, height=3.8)) is None:
        return []
    _, fig, at = made
    for b, keys in enumerate(columns):
        styles = [configs.index(c) for _, c in keys]
        styles = styles if len(set(styles)) == len(styles) else range(len(keys))
        for row, k in enumerate(metrics):
            ax, scale = at(b, row), 100.0 if k in PERCENT_METRICS else 1.0
            for i, key in zip(styles, keys):
                for by_step in series[key].get(k, {}).values():
                    plot_band(ax, by_step, labels[key], line_style(i), scale=scale)
            if not ax.lines:
                ax.text(0.5, 0.5, "not logged by these runs", ha="center", transform=ax.transAxes)
            ax.set(xlabel="training step", ylabel=METRIC_NAMES.get(k, k) + (" %" if scale == 100.0 else ""))
            ax.grid(alpha=0.3)
        legend_below(fig, 7, [at(b, row) for row in range(len(metrics))] if len(columns) > 1 else None)
    for row in range(len(metrics)):                     # each metric on one scale
        lows, highs = zip(*(at(b, row).get_ylim() for b in range(len(columns)) if at(b, row).lines))
        for b in range(len(columns)):
            at(b, row).set_ylim(min(lows), max(highs))
    caption(fig, f"{title}; data: {tasks}; mean over seeds, band = min to max"
                 + (f"; where a line's label does not say otherwise: {said}" if said else ""))
    return [save_figure(fig, path)]


def first_step(records: list, target: list):
    """The first logged step of `records` where every (metric, threshold, higher is better) of target holds, or None."""
    for rec in records:
        m = rec.get("metrics") or {}
        if all(m.get(k) is not None and ((m[k] >= t) if higher else (m[k] <= t)) for k, t, higher in target):
            return rec["step"]
    return None


def targets_for(kind: str, runs: list) -> list:
    """[(description, [(metric key, threshold, higher is better), ...])] for a task kind: arithmetic 50% and 90%
    sequence accuracy; Boolean 99% on U together with 99% on the seen domain (an untrained model can score 100% on U
    by its constant sign); vision (LM) the default init's final top-1 (perplexity), mean over its seeds."""
    if kind == "arithmetic":
        return [("seq acc 50%", [("seq_acc", 0.5, True)]), ("seq acc 90%", [("seq_acc", 0.9, True)])]
    if kind == "boolean":
        return [("99% on U and on the seen domain", [("acc_unseen", 0.99, True), ("acc_seen", 0.99, True)])]
    key, higher = ("top1", True) if kind == "vision" else ("val_ppl", False)
    finals = [r["metrics"][key] for r in runs if r["init"] == "default" and r["metrics"].get(key) is not None]
    if not finals:
        return []
    t = sum(finals) / len(finals)
    desc = f"default's final top-1, {100 * t:.2f}%" if higher else f"default's final val ppl, {t:.2f}"
    return [(desc, [(key, t, higher)])]


def steps_to_target(groups: dict) -> str:
    """Markdown: per task (and configuration), target and init, the first logged step at which the headline metric
    reaches the target (STEPS_TO_TARGET_HEAD says what each column is); where default never reaches it and the mask
    always does, the ratio default / mask is a lower bound (default's total steps / the mask's mean)."""
    rows = []
    for (task, label), rs in groups.items():
        name = task + (f" ({label})" if label else "")
        log_every = run_config(rs[0]).get("log_every", "")
        by_init = _by_init(rs)
        for desc, target in targets_for(rs[0].get("kind", "boolean"), rs):
            found = {init: [first_step(log_records(r), target) for r in by_init[init]]
                     for init in sorted(by_init, key=init_order(rs))}
            ratio = ""
            ms, ds = found.get("mask"), found.get("default")
            if ms and ds and all(s is not None for s in ms) and sum(ms) > 0:
                m = sum(ms) / len(ms)
                if all(s is not None for s in ds):
                    ratio = f"{sum(ds) / len(ds) / m:.1f}"
                elif all(s is None for s in ds):
                    ratio = f"> {max(r.get('steps') or 0 for r in by_init['default']) / m:.1f}"
            for init, steps in found.items():
                hit = [s for s in steps if s is not None]
                cell = mean_std(hit, digits=0) if hit else "not reached"
                seeds = ",".join(str(r["seed"]) for r in by_init[init])
                rows.append([name, desc, init, seeds, f"{len(hit)}/{len(steps)}", cell, log_every,
                             ratio if init == "mask" else ""])
    return "\n".join(md_table(["task", "target", "init", "seeds", "reached", "step to target", "log every",
                               "default / mask"], rows)) + "\n"


def prior_layers(groups: dict) -> str:
    """Markdown: per task (and configuration), prior init and layer, from the runs' metrics.jsonl (mean over seeds):
    the mass on the pattern, the drift of M and of Wq Wk^T and the content margin, where logged (PRIOR_LAYERS_HEAD
    says what each column is): where and when a prior's mass goes, and whether the content outbids the bias."""
    rows = []
    avg = lambda v: sum(v) / len(v)                                           # noqa: E731
    for (task, label), rs in groups.items():
        name = task + (f" ({label})" if label else "")
        by_init = {}
        for r in sorted(rs, key=lambda r: r["seed"]):
            records = [rec for rec in log_records(r) if rec.get("prior_mass")]
            if r["init"] != "default" and records:
                by_init.setdefault(r["init"], []).append((r["seed"], records))
        for init in sorted(by_init, key=init_order(rs)):
            runs = by_init[init]
            seeds = ",".join(str(s) for s, _ in runs)
            for layer in range(min(len(recs[0]["prior_mass"]) for _, recs in runs)):
                start = [recs[0]["prior_mass"][layer] for _, recs in runs]
                end = [recs[-1]["prior_mass"][layer] for _, recs in runs]
                low = [min(rec["prior_mass"][layer] for rec in recs) for _, recs in runs]
                # the first logged step at which the mass has made half of its change from start to end
                half = [next(rec["step"] for rec in recs if (rec["prior_mass"][layer] - (a + b) / 2) * (a - b) <= 0)
                        for (_, recs), a, b in zip(runs, start, end)]
                drift = {k: [recs[-1][k][layer] for _, recs in runs if recs[-1].get(k)]
                         for k in ("mask_drift", "qk_drift")}
                margin = [(recs[0]["content_margin"][layer], recs[-1]["content_margin"][layer])
                          for _, recs in runs if recs[0].get("content_margin") and recs[-1].get("content_margin")]
                rows.append([name, init, seeds, layer, f"{avg(start):.2f}", f"{avg(low):.2f}", f"{avg(end):.2f}",
                             f"{avg(half):.0f}", *(f"{avg(drift[k]):.3g}" if drift[k] else "" for k in drift),
                             f"{avg([a for a, _ in margin]):.2f} → {avg([b for _, b in margin]):.2f}"
                             if margin else ""])
    return "\n".join(md_table(["task", "init", "seeds", "layer", "mass start", "mass min", "mass end", "half-way step",
                               "M drift", "Wq Wk^T drift", "content margin start → end"], rows)) + "\n"


def data_efficiency(folders: list, out_dir: str) -> list[str]:
    """Addition's final sequence accuracy against the number of training pairs, per init (inits run at one size only
    are left out), from the runs under folders whose configurations differ in --data-frac alone:
    data_efficiency.md (its text says what is in it), data_efficiency.csv always and .png with matplotlib."""
    runs, problems = collect_runs(folders)
    runs = [r for r in runs if r["task"] == "addition" and "n_train" in r["metrics"]]
    problems += [f"{r['run_dir']}: {what}" for r in runs for what in [efficiency_problem(r)] if what]
    runs = [r for r in runs if not efficiency_problem(r)]
    groups, notes = config_groups(runs, ignore={"data_frac"})
    rows, md, panels = [], [], []
    for (_, label), rs in groups.items():
        by = {}                                                      # {init: {n_train: [seq_acc]}}
        for r in sorted(rs, key=lambda r: (r["init_order"], r["metrics"]["n_train"], r["seed"])):
            m = r["metrics"]
            by.setdefault(r["init"], {}).setdefault(m["n_train"], []).append(m["seq_acc"])
            rows.append((label, r["init"], r["seed"], m["n_train"], float(m["seq_acc"]), float(m["digit_acc"])))
        sizes = sorted({n for d in by.values() for n in d})
        if len(sizes) < 2:
            md.append(f"\n- addition ({label or 'all runs'}): one training set size only, not a series")
            continue
        inits = sorted((i for i in by if len(by[i]) > 1), key=init_order(rs))    # a series each
        digits = run_config(rs[0]).get("digits") or 3  # the task's own universe: 10^(2d) pairs
        md += ["\n**addition**" + (f" ({label})" if label else "") + "\n", *_efficiency_table(by, inits, sizes, digits)]
        panels.append(label)
    csv_path = write_rows(os.path.join(out_dir, "data_efficiency.csv"), EFFICIENCY_HEADER, rows, quoted=0)
    text = ("# Data efficiency: addition's sequence accuracy against the training set size\n\nFinal sequence "
            "accuracy on the 10,000 test pairs, mean ± std over seeds (their number in brackets). The last column: "
            "the fewest training pairs (of the sizes run) at which the mask's mean accuracy is at least default's "
            "mean at this size. Runs: " + ", ".join(f"`{f}`" for f in folders)
            + "; the curves: `data_efficiency.csv`" + (", `data_efficiency.png`" if panels else "") + ".\n\n"
            + "".join(f"- {n}\n" for n in notes) + "\n".join(md)
            + ("\n\nNot included:\n" + "\n".join(f"- {p}" for p in problems) if problems else "") + "\n")
    return ([emit(out_dir, "data_efficiency.md", text), csv_path]
            + draw_efficiency(rows, os.path.join(out_dir, "data_efficiency.png")))


# what a run of the data-efficiency series holds: its metrics (key -> (check, what it must be)), digits (tells_apart)
EFFICIENCY_METRICS = {"n_train": (lambda v: runfiles.is_count(v) and v > 0, "a count of pairs > 0"),
                      "seq_acc": (runfiles.is_share, "a share in [0, 1]"),
                      "digit_acc": (runfiles.is_share, "a share in [0, 1]")}
EFFICIENCY_FLAGS = {"digits": (lambda v: v is None or runfiles.is_count(v) and 0 < v <= 64, "null or 1 .. 64 digits")}


def efficiency_problem(run: dict) -> str | None:
    """Why an addition run with n_train is not a point of the data-efficiency series, or None."""
    problem = (runfiles.schema_problem(run["metrics"], EFFICIENCY_METRICS, EFFICIENCY_METRICS)
               or runfiles.schema_problem(run_config(run), EFFICIENCY_FLAGS, ()))
    return problem and f"not a point of the series (its metrics or flags{problem})"


def _efficiency_table(by: dict, inits: list, sizes: list, digits: int) -> list[str]:
    """data_efficiency.md's table of one configuration: a row per training set size."""
    mean = {i: {n: sum(v) / len(v) for n, v in by[i].items()} for i in inits}
    rows = []
    for n in sizes:
        cells = [mean_std([100 * v for v in by[i][n]], count=True) if n in by[i] else "" for i in inits]
        enough = ""
        if "default" in mean and "mask" in mean and n in mean["default"]:
            hit = [k for k in sorted(mean["mask"]) if mean["mask"][k] >= mean["default"][n]]
            enough = (f"{hit[0]:,} ({n / hit[0]:.2g}x less)" if hit[0] < n else f"{hit[0]:,}") if hit else "none"
        rows.append([f"{n:,}", f"{100 * n / 10 ** (2 * digits):g}", *cells, enough])
    return md_table(["training pairs", "% of all pairs", *(f"{i} seq acc % (seeds)" for i in inits),
                     "fewest pairs with mask >= default here"], rows)


def draw_efficiency(rows: list, path: str, data: dict | None = None) -> list[str]:
    """data_efficiency.png from data_efficiency.csv's rows: a panel per configuration run at two or more sizes, the
    accuracy against the size, a band per init run at more than one. [path], or [] without matplotlib or such panels."""
    by_config = {}                                          # {label: {init: {n_train: [seq_acc]}}}
    for label, init, seed, n, seq_acc, digit_acc in rows:
        by_config.setdefault(label, {}).setdefault(init, {}).setdefault(n, []).append(seq_acc)
    panels = [(label, {i: s for i, s in by.items() if len(s) > 1}) for label, by in by_config.items()
              if len({n for s in by.values() for n in s}) > 1]
    if (made := panel_grid(len(panels), width=4.8, height=3.6)) is None:
        return []
    _, fig, at = made
    for b, (label, by) in enumerate(panels):
        ax = at(b)
        for i, (init, by_size) in enumerate(by.items()):
            plot_band(ax, by_size, init, line_style(i, init), scale=100.0)
        sizes = sorted({n for s in by.values() for n in s})
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes], fontsize=7, rotation=30)
        ax.minorticks_off()
        ax.set(xlabel="training pairs", ylabel="sequence accuracy %")
        title = "\n".join(filter(None, (data_title("addition", data), config_words(label))))
        ax.set_title(wrapped(title, 4.6, 9, LABEL_LINES), fontsize=9)
        ax.grid(alpha=0.3)
    legend_below(fig)
    caption(fig, "Final sequence accuracy against the training set size; mean over seeds, band = min to max")
    return [save_figure(fig, path)]


# The oracle-free study (reproduce.sh --only oraclefree): runs named TASK-INIT-sSEED[-TAG]; a run's column is its init
# and tag (less a corpus prefix, naming the row: the language stand-in's teacher reads corpus A, its students B).
ORACLE_FREE_COLUMNS = (("default", "default", ""), ("hand pattern, mask", "mask", ""),
                       ("found in the data, mask", "mask", "discovered"), ("from the teacher, mask", "mask", "teacher"),
                       ("from an impulse teacher, mask", "mask", "teacher-impulse"),
                       ("the teacher's pattern, qk-svd", "qk-svd", "teacher"), ("impulse", "impulse", ""),
                       ("default, the teacher's + the student's steps", "default", "budget2x"))
ORACLE_FREE_METRIC = {"boolean": ("acc_unseen", "accuracy on U %", 100), "vision": ("top1", "top-1 %", 100),
                      "arithmetic": ("seq_acc", "sequence accuracy %", 100),
                      "lm": ("val_ppl", "validation perplexity", 1)}


def oracle_free_cell(run: dict) -> tuple[str, str]:
    """(row, column tag) of an oracle-free run from its folder name: the row is the task, or the data set it read
    (`data_title`), and the corpus or the step count the tag names (corpusB-teacher, 250steps-teacher); the tag what
    follows -sSEED- and them (samebudget, the default at a teacher's steps + its student's, is budget2x)."""
    name = os.path.basename(os.path.normpath(run["run_dir"]))
    tag = name.split(f"-s{run['seed']}", 1)[1].lstrip("-") if f"-s{run['seed']}" in name else ""
    row = data_title(run["task"], {run["task"]: data_set(run)})
    if tag.startswith("corpus"):
        corpus, _, tag = tag.partition("-")
        row += f", corpus {corpus[-1]}"
    elif re.match(r"\d+steps(-|$)", tag):
        steps, _, tag = tag.partition("-")
        row += f", {steps[:-5]} steps"
    elif re.match(r"(n\d+|all|d2|sum23|summaj)(-|$)", tag):  # round two: a training-set size, 2 digits, a sum
        what, _, tag = tag.partition("-")
        row += {"all": ", every seen point", "d2": ", 2 digits", "sum23": " x0x1 + x2x3x4",
                "summaj": " x0x1 + maj(x2,x3,x4)"}.get(what, f", {what[1:]} points")
    return row, "budget2x" if tag == "samebudget" else tag


def oracle_free(folder: str, out_dir: str) -> list[str]:
    """oraclefree.md: per task (row), each variant's headline metric (mean ± std over seeds, their number), and the
    found patterns' precision and recall of pairs against the hand pattern; oraclefree_patterns.png (with
    matplotlib): for seed 0, the hand pattern beside the one found in the data and the teacher's."""
    runs, problems = collect_runs([folder])
    table, agreement, rows = {}, {}, []
    for r in runs:
        row, tag = oracle_free_cell(r)
        if row not in rows:
            rows.append(row)
        table.setdefault(row, {}).setdefault((r["init"], tag), []).append(r)
        src = r.get("prior_source") or {}
        if "precision" in src and r["init"] == "mask":  # qk-svd reads the same teacher's pattern
            agreement.setdefault(row, {}).setdefault(tag, []).append((src["precision"], src["recall"]))
    cols = [(h, i, t) for h, i, t in ORACLE_FREE_COLUMNS if any((i, t) in table[row] for row in rows)]
    results = []
    for row in rows:
        kind = next(iter(table[row].values()))[0].get("kind", "boolean")
        key, label, scale = ORACLE_FREE_METRIC.get(kind, ORACLE_FREE_METRIC["boolean"])
        results.append([row, label, *(_num(key, scale, count=True)([r["metrics"] for r in table[row].get((i, t), [])])
                                      for _, i, t in cols)])
    found = [[row, "the data" if tag == "discovered" else tag, mean_std([p for p, _ in pr]),
              mean_std([r for _, r in pr]), len(pr)] for row in rows
             for tag, pr in agreement.get(row, {}).items()]
    out = (md_table(["task", "metric", *(h for h, _, _ in cols)], results) + [""]
           + md_table(["task", "found in", "precision of its pairs", "recall", "seeds"], found))
    if problems:
        out.append("\nNot included:\n" + "\n".join(f"- {p}" for p in problems))
    return ([emit(out_dir, "oraclefree.md", "\n".join(out) + "\n")] + oracle_free_figure(table, rows, out_dir)
            + oracle_free_mass(table, rows, out_dir))


def oracle_free_mass(table: dict, rows: list, out_dir: str) -> list[str]:
    """oraclefree_mass.png: per task, the mass on each prior's own pattern by step, a band per variant with a prior."""
    curves = []
    for row in rows:
        lines = {}
        for head, init, tag in ORACLE_FREE_COLUMNS:
            by_step = {}
            for r in table[row].get((init, tag), []) if init != "default" else []:
                for rec in log_records(r):
                    if rec.get("prior_mass_mean") is not None:
                        by_step.setdefault(rec["step"], []).append(rec["prior_mass_mean"])
            if by_step:
                lines[head] = by_step
        if lines:
            curves.append((row, lines))
    if (made := panel_grid(len(curves), width=4.0, height=3.0)) is None:
        return []
    _, fig, at = made
    heads = [h for h, _, _ in ORACLE_FREE_COLUMNS]
    for b, (row, lines) in enumerate(curves):
        ax = at(b)
        for head, by_step in lines.items():
            plot_band(ax, by_step, head, line_style(heads.index(head)))
        ax.set_title(row, fontsize=9)
        ax.set(ylim=(0, 1.02), xlabel="training step")
        ax.set_ylabel("mass on its pattern", fontsize=8)
        ax.grid(alpha=0.3)
    legend_below(fig)
    caption(fig, "Attention mass on each prior's own pattern against the training step; mean "
                 "over seeds, band = min to max")
    return [save_figure(fig, os.path.join(out_dir, "oraclefree_mass.png"))]


def oracle_free_figure(table: dict, rows: list, out_dir: str) -> list[str]:
    """oraclefree_patterns.png: per task, seed 0's hand pattern (black: allowed) beside the one its
    discovered and teacher runs started from (prior.pt), all layers' first head."""
    panels = []
    for row in rows:
        for tag, title in (("", "hand"), ("discovered", "found in the data"), ("teacher", "from the teacher"),
                           ("teacher-impulse", "impulse teacher")):
            first = sorted(table[row].get(("mask", tag), []), key=lambda r: r["seed"])[:1]
            if not first:
                continue
            try:
                pattern = runfiles.read_prior(os.path.join(first[0]["run_dir"], "prior.pt")).pattern
            except runfiles.ReadError:
                continue
            panels.append((f"{row}: {title} (seed {first[0]['seed']})", pattern[0]
                           if pattern.dim() == 3 else pattern, first[0].get("token_labels")))
    if (made := panel_grid(len(panels), width=3.0, height=3.2)) is None:
        return []
    _, fig, at = made
    for b, (title, p, names) in enumerate(panels):
        ax = at(b)
        ax.imshow(p.float().numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(wrapped(title, 2.9, 7, LABEL_LINES), fontsize=7)
        token_ticks(ax, names, p.shape[-1])
    caption(fig, "Patterns the priors started from: row = query, column = key, black = allowed (first head)")
    return [save_figure(fig, os.path.join(out_dir, "oraclefree_patterns.png"))]


STEPS_TO_TARGET_HEAD = (
    "# Steps to target\n\nThe first logged step at which each run's headline metric reaches the target (mean ± std "
    "over the seeds that reach it; the resolution is the log interval; log steps of Boolean and arithmetic runs "
    "are measured on `--eval-points` points, the last on the whole test set). default / mask is the ratio of the "
    "mean steps: how many times faster the mask gets there; '> x' where default never does within its steps. The "
    "curves are `curves.csv` and `curves.png`. ")
PRIOR_LAYERS_HEAD = (
    "# The prior per layer: attention mass on the pattern and drift over training\n\nMean over seeds, from each run's "
    "metrics.jsonl (the mass is measured on the probe batch). 'half-way step': the first logged step at which the "
    "layer's mass has made half of its change from start to end. M drift: relative Frobenius change of M (`mask`); Wq "
    "Wk^T drift: of the content logits' weights. Content margin: by how many nats the content logits q.k/sqrt(d) alone "
    "favour the keys off the pattern over those on it (log-sum-exp off minus on, mean over rows, heads and the probe "
    "batch; runs made before it was logged have none); a row keeps most of its mass on the pattern while this stays "
    "below the prior's own gap (for `mask`, log sigmoid(m_on) - log sigmoid(-m_off), about m_off). ")


def report(runs_dir: str, out_dir: str) -> list[str]:
    """runs_dir/<table>/<task>-<init>-s<seed>/ -> out_dir/<table>.md (a runs_dir of run folders alone is one table,
    runs.md or its table's name), the robustness grid, the persistence curves of the Boolean runs, the data-efficiency
    table, the oracle-free study, and over every table's runs the learning curves, steps to target and the prior per
    layer (`report_curves`). Unfinished or unreadable runs are listed under their table."""
    runfiles.output_folder(out_dir, "report")
    written = []
    made_by = f"made by `python train.py report {runs_dir} {out_dir}`"
    for table in TABLES:
        folder = os.path.join(runs_dir, table)
        if os.path.isdir(folder):
            written.append(emit(out_dir, f"{table}.md", f"# {TABLE_TITLES[table]}\n\nRuns: `{folder}`; mean ± std "
                                                        f"over seeds; {made_by}.\n\n{summarize([folder])}"))
    grid, boolean = os.path.join(runs_dir, "ablation"), os.path.join(runs_dir, "boolean")
    if os.path.isdir(grid):
        written.append(emit(out_dir, "ablation.md",
                            "# Robustness grid: readout x positional-embedding std x init, Boolean tasks, `small` "
                            f"preset\n\nRuns: `{grid}` and, at each task's own preset, `{boolean}`; mean ± std "
                            "over seeds; accuracy over the whole cube (exact match for cyclic3); "
                            f"{made_by}.\n\n{ablation([grid] + ([boolean] if os.path.isdir(boolean) else []))}"))
    if os.path.isdir(boolean):
        written += write_persistence(persistence_rows(boolean), out_dir) + m_figures(boolean, out_dir)
    if os.path.isdir(os.path.join(runs_dir, "oraclefree")):
        written += oracle_free(os.path.join(runs_dir, "oraclefree"), out_dir)
    data, arithmetic = os.path.join(runs_dir, "data"), os.path.join(runs_dir, "arithmetic")
    if os.path.isdir(data):
        written += data_efficiency([data] + ([arithmetic] if os.path.isdir(arithmetic) else []), out_dir)
    folders = [os.path.join(runs_dir, t) for t in TABLES if os.path.isdir(os.path.join(runs_dir, t))]
    if not _table_folders(runs_dir):
        name = os.path.basename(os.path.normpath(runs_dir))          # a folder of single runs: one table of them
        table, folders = name if name in TABLES else "runs", [runs_dir]
        written.append(emit(out_dir, f"{table}.md", f"# {TABLE_TITLES.get(table, 'Runs')}\n\nRuns: `{runs_dir}`; "
                                                    f"mean ± std over seeds; {made_by}.\n\n{summarize(folders)}"))
    return written + (report_curves(runs_dir, folders, out_dir, made_by) if folders else [])


def emit(out_dir: str, name: str, text: str) -> str:
    path = os.path.join(out_dir, name)
    runfiles.atomic_write(path, text)
    return path


STUDY_FIGURES = {
    "visionprior": "The vision priors side by side: top-1 and the attention mass on each prior's own pattern against "
                   "the training step",
    "lee": "Lee et al.'s multiplication data: sequence accuracy on the held-out pairs and on the training samples, "
           "and the attention mass on the pattern, against the step"}


def report_curves(runs_dir: str, folders: list, out_dir: str, made_by: str) -> list[str]:
    """Over the runs of every table folder: data.csv (`data_rows`), curves.csv / .png, the studies' figures
    (STUDY_FIGURES), steps to target and the prior per layer (a damaged log is named in the notes of both tables)."""
    runs = collect_runs(folders)[0]
    groups, notes = config_groups(runs)
    data = data_rows(runs)
    written = [write_rows(os.path.join(out_dir, "data.csv"), DATA_HEADER, data, quoted=1)]
    rows = curve_rows(groups)
    written += [write_rows(os.path.join(out_dir, "curves.csv"), CURVES_HEADER, rows, quoted=1)]
    written += draw_curves(rows, os.path.join(out_dir, "curves.png"), dict(data))
    for folder, title in STUDY_FIGURES.items():         # a study's runs side by side: FOLDER.csv and .png
        where = os.path.normpath(os.path.join(runs_dir, folder))
        study = [r for r in runs if os.path.dirname(os.path.normpath(r["run_dir"])) == where]
        if study:
            rows = curve_rows(config_groups(study)[0])
            written += [write_rows(os.path.join(out_dir, f"{folder}.csv"), CURVES_HEADER, rows, quoted=1)]
            written += draw_comparison(rows, os.path.join(out_dir, f"{folder}.png"), title, dict(data))
    for r in runs:
        log_records(r)                          # read every log once: a damaged one is named below
    notes += [f"{r['run_dir']}: its log is left out of the curves and these tables ({r['_log_problem']}); its "
              "result.json counts in the results tables" for r in runs if "_log_problem" in r]
    intro = f"Runs: {', '.join(f'`{f}`' for f in folders)}; {made_by}.\n\n" + "".join(f"- {n}\n" for n in notes) + "\n"
    return written + [emit(out_dir, "steps_to_target.md", STEPS_TO_TARGET_HEAD + intro + steps_to_target(groups)),
                      emit(out_dir, "prior_layers.md", PRIOR_LAYERS_HEAD + intro + prior_layers(groups))]


# ---- Redrawing: a results folder's figures from the CSVs beside them, no runs needed (`train.py redraw RESULTS`)

LABEL_MAX = 4000  # a label's characters: more than all of train.py's flags (a figure draws LABEL_LINES lines, cut)
# a figure redrawn: at most this many panels (about 0.05 s each) and series in its legend (those `line_style` tells
# apart); one of more than REDRAW_SLOW_PANELS says so before it is drawn
REDRAW_MAX_PANELS, REDRAW_MAX_SERIES, REDRAW_SLOW_PANELS = 400, 40, 40


def _digits(text: str) -> int | None:
    """An integer cell: ASCII digits alone (no sign, '_', space or other script's digits); None for anything else."""
    return int(text) if re.fullmatch(r"[0-9]{1,20}", text) else None


def _number(text: str) -> float | None:
    """A number cell as a report writes one (ASCII, 'nan' where nothing was measured); None for anything else."""
    return float(text) if re.fullmatch(r"-?[0-9]+(\.[0-9]*)?([eE][-+]?[0-9]+)?|nan", text) else None


# a report CSV's cells: kind -> (its text's parser (None: not of the kind), the check of the value, what it must be)
CELLS = {
    "name": (str, runfiles.is_name, "a name as train.py writes one (lower-case letters, digits, - and _, at most 40)"),
    "label": (str, lambda v: len(v) <= LABEL_MAX and v.isprintable(),
              f"a configuration's flags (printable, at most {LABEL_MAX} characters)"),
    "seed": (_digits, lambda v: v < 2 ** 32, "a seed in 0 .. 2^32 - 1"),
    "step": (_digits, runfiles.is_step, "a step in 0 .. 2^53"),
    "count": (_digits, lambda v: 0 < v <= runfiles.MAX_STEP, "a count in 1 .. 2^53"),
    "value": (_number, runfiles.is_value, f"a finite number within +-{runfiles.MAX_VALUE:g}"),
    "mass": (_number, runfiles.is_mass, f"an attention mass in [0, 1] (+-{runfiles.MASS_SLACK:g})"),
    "drift": (_number, lambda v: v != v or runfiles.is_value(v) and v >= 0, "nan or a relative change >= 0"),
    "data": (str, lambda v: 0 < len(v) <= 80 and v.isprintable() and ", " not in v,
             "a data set's name (printable, at most 80 characters, no ', ')"),
}


def _cells(kinds: tuple, cells: list, rest: str | None = None) -> list:
    """A CSV row's cells, each parsed and checked as its kind (CELLS; `rest`: the kind of every
    cell after `kinds`); ValueError naming the first that is not."""
    specs = [CELLS[kinds[i] if i < len(kinds) else rest] for i in range(len(cells))]
    values = [parse(text) for (parse, _, _), text in zip(specs, cells)]
    bad = [(text, what) for (_, ok, what), text, v in zip(specs, cells, values) if v is None or not ok(v)][:1]
    if bad:
        raise ValueError(f"{runfiles.cut(bad[0][0])} is not {bad[0][1]}")
    return values


def _persistence_row(cells: list) -> dict:
    """A persistence.csv row (a drift of nan: a run that logged none), a mass a layer after it."""
    task, init, seed, step, mass, drift, *layers = _cells(("name", "name", "seed", "step", "mass", "drift"),
                                                          cells, "mass")
    return {"task": task, "init": init, "seed": seed, "step": step, "mass": mass, "drift": drift, "layers": layers}


def _row(*kinds: str):
    """The parser of a CSV row whose cells are of `kinds` (`_cells`): cells -> a tuple of their values."""
    return lambda cells: tuple(_cells(kinds, cells))


_curve_row = _row("name", "label", "name", "seed", "step", "name", "value")    # a curves.csv row (CURVES_HEADER)
_efficiency_row = _row("label", "name", "seed", "count", "value", "value")     # a data_efficiency.csv row
_data_row = _row("name", "data")                                  # a data.csv row: (task, the data set its runs read)


# name -> (the CSV's header, at least; the cells after it (a mass a layer); a row's parser; the drawer of NAME.png
# from the rows and data.csv's {task: data set}; the figure's (panels, series in its legend) from the rows)
REDRAWN = {"curves": (CURVES_HEADER, 0, _curve_row, draw_curves,
                      lambda rows: (len({(r[0], r[1], r[5]) for r in rows}), len({r[2] for r in rows}))),
           "persistence": (PERSISTENCE_HEADER, runfiles.MAX_LAYERS, _persistence_row, draw_persistence,
                           lambda rows: (2 * len({r["task"] for r in rows}),
                                         len({r["init"] for r in rows} & set(PERSISTENCE_INITS)))),
           "data_efficiency": (EFFICIENCY_HEADER, 0, _efficiency_row, draw_efficiency,
                               lambda rows: (len({r[0] for r in rows}), len({r[1] for r in rows}))),
           **{study: (CURVES_HEADER, 0, _curve_row,
                      lambda rows, path, data, title=title: draw_comparison(rows, path, title, data),
                      lambda rows: (len({r[5] for r in rows}), len({(r[2], r[1]) for r in rows})))
              for study, title in STUDY_FIGURES.items()}}


def read_rows(path: str, header: tuple, parse, extra: int = 0) -> list:
    """The rows of a CSV a report wrote, read through the one reader (at most READ_LIMITS' "table" bytes; rows of
    `header` and up to `extra` cells more) and parsed; anything else is a ReportError naming the file and the line."""
    try:
        lines = list(csv.reader(io.StringIO(runfiles.read_back(path, "table").decode("utf-8"))))
    except (runfiles.ReadError, UnicodeDecodeError, csv.Error) as e:
        raise ReportError(f"redraw: cannot read {path} ({e})") from None
    if not lines or tuple(lines[0][:len(header)]) != header or len(lines[0]) > len(header) + extra:
        raise ReportError(f"redraw: {path} is not the table a report writes: its header is not "
                          f"{','.join(header)}" + (f" and at most {extra} more" if extra else ""))
    rows = []
    for n, cells in enumerate(lines[1:], 2):
        try:
            if not len(header) <= len(cells) <= len(lines[0]):  # persistence: a task's layers, up to the most
                raise ValueError(f"{len(cells)} cells, the header has {len(lines[0])}")
            rows.append(parse(cells))
        except ValueError as e:
            raise ReportError(f"redraw: {path} line {n}: {e}; nothing was redrawn from it") from None
    return rows


def redraw(results: str) -> tuple[list[str], list[str]]:
    """Every figure of `results` that a CSV beside it holds the data of (REDRAWN), drawn again from that CSV, each
    task titled by the data set data.csv names for it (`data_title`); the CSVs and tables are left as they are. Every
    CSV is read and checked, and each figure's panels and series bounded, before any figure is drawn. Returns
    (written, the figures there drawn from the runs alone: report again to redraw them)."""
    if pyplot() is None:
        raise ReportError("redraw: drawing needs matplotlib: pip install matplotlib")
    if not os.path.isdir(results):
        raise ReportError(f"redraw: {results} is not a folder of tables and figures (train.py "
                          "report RUNS OUT writes one)")
    runfiles.output_folder(results, "redraw", (".png",))
    tables = {name: read_rows(os.path.join(results, name + ".csv"), header, parse, extra)
              for name, (header, extra, parse, _, _) in REDRAWN.items()
              if os.path.isfile(os.path.join(results, name + ".csv"))}
    if not tables:
        raise ReportError(f"redraw: {results} holds none of {', '.join(n + '.csv' for n in REDRAWN)}, so there is "
                          "nothing to redraw and nothing was written")
    named = os.path.join(results, "data.csv")
    data = dict(read_rows(named, DATA_HEADER, _data_row)) if os.path.isfile(named) else {}
    sizes = {name: REDRAWN[name][4](rows) for name, rows in tables.items()}
    big = [(name, p, s) for name, (p, s) in sizes.items() if p > REDRAW_MAX_PANELS or s > REDRAW_MAX_SERIES][:1]
    if big:
        name, p, s = big[0]
        raise ReportError(f"redraw: {os.path.join(results, name + '.csv')} would draw {p:,} panels and {s:,} "
                          f"series in one figure, more than any report draws ({REDRAW_MAX_PANELS} panels, "
                          f"{REDRAW_MAX_SERIES} series); it is not a table a report wrote: nothing was redrawn")
    written = []
    for name, (panels, _) in sizes.items():
        if panels > REDRAW_SLOW_PANELS:
            print(f"redraw: {name}.png: {panels} panels, about {panels // 20 + 1} s to draw", flush=True)
        written += REDRAWN[name][3](tables[name], os.path.join(results, name + ".png"), data)
    left = sorted(f for f in os.listdir(results) if f.endswith(".png") and os.path.join(results, f) not in written)
    return written, left


def redraw_command(results: str) -> int:
    written, left = redraw(results)
    for path in written:
        print(f"redrew {path}")
    if left:
        print("redraw: not redrawn (drawn from the runs, not from a table: train.py report RUNS "
              f"{results} draws them): {', '.join(left)}")
    return 0


# ---- The commands: `python train.py summarize PATH...` and `python train.py report RUNS OUT`

class ReportError(runfiles.UsageError):
    """A summary or report that cannot be made: one line on stderr, exit status 2 (train.py prints it)."""


def summarize_command(paths: list) -> int:
    """`summarize PATH...`; one line where a path holds no run (RUN_PATH_PROBLEMS) or none holds a finished one."""
    bad = [f"{p} {why}; give run folders, or folders of them" for p in paths if (why := no_runs_in(p))]
    collected = ([], bad) if bad else collect_runs(paths)
    if not collected[0]:
        raise ReportError("summarize: " + (bad[0] if bad else f"no finished run (result.json) in {', '.join(paths)}, "
                                           f"so there is nothing to tabulate ({'; '.join(collected[1][:3])})"))
    print(summarize(paths, collected), end="")
    return 0


def no_runs_in(path: str) -> str | None:
    return next((what for holds_none, what in RUN_PATH_PROBLEMS if holds_none(path)), None)


def _listing(path: str) -> list | None:
    try:
        return os.listdir(path)
    except OSError:
        return None


# why a path given to `summarize` holds no run, in order: (it holds none, what is wrong)
RUN_PATH_PROBLEMS = (
    (lambda p: not os.path.exists(p), "does not exist"),
    (lambda p: not os.path.isdir(p), "is a file, not a run folder or a folder of them"),
    (lambda p: _listing(p) is None, "is a folder that cannot be read"),
    (lambda p: not _listing(p), "is an empty folder"),
    (lambda p: not ({"args.json", "result.json"} & set(_listing(p))
                    or any(os.path.isdir(os.path.join(p, d)) for d in _listing(p))),
     "holds no run folder (neither a run's files nor folders)"))


def _holds_runs(folder: str) -> bool:
    """Whether `folder` holds a run folder (one with a ckpt.pt or result.json) directly."""
    held = os.listdir(folder) if os.path.isdir(folder) else []
    return any(os.path.exists(os.path.join(folder, d, f)) for d in held for f in ("ckpt.pt", "result.json"))


def report_command(runs: str, out: str) -> int:
    """`report` with its refusals: a folder with neither table folders nor run folders (a hint naming a folder in it
    that holds runs), an OUT that is a file, and a failed write are one line; what was written before is whole."""
    if not os.path.isdir(runs):
        raise ReportError(f"report: {runs} is not a folder of runs")
    if not _table_folders(runs) and not _holds_runs(runs):
        inside = [d for d in sorted(os.listdir(runs)) if _holds_runs(os.path.join(runs, d))]
        hint = (f"{inside[0]} in it holds run folders: python train.py report {os.path.join(runs, inside[0])} {out}"
                if inside else "give the folder reproduce.sh --runs wrote (e.g. runs/quick) or a folder of run folders")
        raise ReportError(f"report: {runs} holds none of the table folders ({', '.join(REPORT_FOLDERS)}) and no run "
                          f"folder, so there is nothing to report and nothing was written; {hint}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ReportError(f"report: {out} is a file; give a folder for the tables and figures")
    try:
        written = report(runs, out)
    except OSError as e:
        if e.errno not in runfiles.STORAGE_ERRORS | {errno.ENOTDIR, errno.ENOENT}:
            raise
        raise ReportError(f"report: cannot write {e.filename or out} ({e.strerror}); every file written before is "
                          "whole: give another folder, or free space, and report again") from None
    for path in written:
        print(f"wrote {path}")
    stale = sorted(name for name in os.listdir(out) if name.endswith((".md", ".csv", ".png"))
                   and os.path.join(out, name) not in written)
    if stale:
        print(f"not made by these runs, left as they were (an earlier report's, or yours): {', '.join(stale)}")
    return 0
