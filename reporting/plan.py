"""The runs of a reproduction, in one place: which runs each table of the paper makes (`run_list`), the datasets
they read and how to fetch them (`fetch_lines`), and the plan `bash reproduce.sh` prints before its first run (per
table its runs and cost: download, disk, GPU-hours measured or est. from counted FLOPs; the runs skipped and why;
`budget_plan`: the tables that fit in --budget hours). reproduce.sh reads the list from `python -m reporting.plan ...
--list`; benchmarks/bench_paper.py imports it. It reads the tasks' presets and the data sets' names, not train.py.

    python -m reporting.plan                      # the paper on one GPU: the plan and its cost
    python -m reporting.plan --budget 8 --gpu A100   # the tables that fit in 8 hours of one A100
    python -m reporting.plan --quick --list       # the CPU version's runs, one a line, as reproduce.sh reads them

A run is a line `TABLE TASK INIT SEED TAG FLAGS...` (TAG `-` for none; @DATA and @RUNS stand for the --data and
--runs folders, which reproduce.sh passes as one argument whatever they hold); `WAIT` lets every run before it
finish (teachers before their students); `REPLAN` does too, then reproduce.sh reads the plan again (once): its next
runs are chosen from those results (mult-ladder's better order); `DOWNLOAD NAME...` (before the runs) names the
absent data sets `train.py download` fetches (--download). The run's folder is RUNS/TABLE/TASK-INIT-sSEED[-TAG].
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import re
import sys
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import datafetch.download  # noqa: E402
import runfiles  # noqa: E402
import tasks  # noqa: E402

# reproduce.sh --only TABLE: the tables, and the studies that run only when asked (at the small preset)
TABLES = ("boolean", "arithmetic", "vision", "lm", "persistence", "ablation", "data", "mult2", "visionprior",
          "oraclefree", "parity3", "lee", "mult-ladder")
STUDIES = ("ablation", "data", "mult2", "visionprior", "oraclefree", "parity3")
QK = ("default", "mask", "qk-svd", "qk-opt")
SHORT = "--steps 250 --log-every 10 --eval-points 500"  # addition at the paper's regime (its budget is unknown)


@dataclass(frozen=True)
class Run:
    table: str
    task: str
    init: str
    seed: int
    tag: str = ""
    flags: str = ""

    @property
    def name(self) -> str:
        return f"{self.task}-{self.init}-s{self.seed}" + (f"-{self.tag}" if self.tag else "")

    def line(self) -> str:
        return " ".join([self.table, self.task, self.init, str(self.seed), self.tag or "-", *self.flags.split()])


WAIT = "WAIT"
REPLAN = "REPLAN"  # the runs before it finish, then reproduce.sh reads the plan again (it chooses from them)


@dataclass
class Plan:
    """What a reproduction runs: `items` (Runs and WAITs, in order), `skipped` ({table: [(what, why)]}: the runs
    left out for want of their data, with where to get it; `missing`: those runs) and `absent` (the data sets missing
    from their own place in DATA, which `train.py download` or `train.py imagenet100` puts there); with --budget,
    `notes` ({table: "; " and its reduced budget}) and `left_out` ({table: its cost, which does not fit})."""
    quick: bool
    only: str | None
    seeds: tuple
    data: str | None
    items: list
    skipped: dict
    absent: list = field(default_factory=list)
    later: list = field(default_factory=list)  # [(Run, why)]: runs planned once the runs before REPLAN are in
    missing: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    left_out: dict = field(default_factory=dict)
    budget: str = ""

    @property
    def runs(self) -> list[Run]:
        return [r for r in self.items if isinstance(r, Run)]


def run_list(quick: bool = False, only: str | None = None, seeds=(0, 1, 2),
             data: str | None = "data", runs: str | None = None) -> Plan:
    """The runs of `bash reproduce.sh [--quick] [--only TABLE] --seeds ... --data DATA --runs RUNS`: every table's
    (the paper presets; --quick: the CPU version), or one table's or study's. A run whose dataset is not in DATA is
    skipped and named in `skipped` (nothing else is looked at); data None: every run, as if every dataset were
    there. RUNS: the results a later stage chooses from (mult-ladder); None: that stage waits (`later`)."""
    plan = Plan(quick or only in STUDIES, only, tuple(seeds), data, [], {})

    def want(table):
        return only is None or only == table

    def add(table, task, inits, flags="", tag="", where=None):
        have = where is None or _have(plan, table, task, where, len(inits) * len(seeds))
        if where is not None and "--data-dir" not in flags:
            flags += f" --data-dir @DATA{where}"
        # @SEED in the flags: each run's seed (a student's teacher is the run of its seed)
        (plan.items if have else plan.missing).extend(Run(table, task, init, s, tag, flags.replace("@SEED", str(s)))
                                                      for s in seeds for init in inits)

    if want("boolean"):             # not --only persistence: it only aggregates the Boolean runs already made
        for t in ("parity2", "majority3", "cyclic3"):
            add("boolean", t, QK)
    if want("arithmetic"):
        _arithmetic(plan, add)
    if only == "data":
        add("arithmetic", "addition", ("default", "mask"))  # 0.4%: the arithmetic table's own runs
        for f in ("0.0005", "0.001", "0.002", "0.008"):
            add("data", "addition", ("default", "mask"), f"--data-frac {f}", f"frac{f}")
    if not plan.quick and want("vision"):
        for t, where in (("cifar10", ""), ("cifar100", ""), ("imagenet100", "/imagenet100")):
            add("vision", t, ("default", "mimetic", "impulse", "mask", "mask-impulse"), where=where)
    if not plan.quick and want("lm"):
        add("lm", "wikitext2", QK, where="")
        add("lm", "tinystories", ("default", "mask"), where="")
    if only == "mult2":
        for f in ("0.03", "0.3"):
            d2 = f"--digits 2 --data-frac {f} --answer-order lsb --steps 1000 --log-every 50"
            add("mult2", "multiplication", QK, d2, f"d2-frac{f}")
            add("mult2", "multiplication", ("mask",), d2 + " --pattern partial", f"d2-frac{f}-partial")
    if study := {"lee": _lee, "visionprior": _vision_prior, "ablation": _ablation, "oraclefree": _oracle_free,
                 "parity3": _parity3, "mult-ladder": lambda plan, add: _mult_ladder(plan, add, runs)}.get(only):
        study(plan, add)
    return plan


def _have(plan: Plan, table: str, task: str, where: str, runs: int | None = None) -> bool:
    """Whether DATA + `where` holds `task`'s data (`tasks.Task.locate`); if not, the reason is kept in plan.skipped
    (with the number of `runs` skipped, where one table's runs of the task are meant)."""
    if plan.data is None:
        return True
    try:
        tasks.TASKS[task].locate(plan.data + where)
        return True
    except tasks.DataError as e:
        plan.skipped.setdefault(table, []).append((task if runs is None else f"{task} ({runs} runs)", str(e)))
        if where == HOME.get(task, "") and task not in plan.absent:
            plan.absent.append(task)
        return False


HOME = {"imagenet100": "/imagenet100"}  # where in DATA a set's fetched copy lies, if not in DATA itself


def fetch_lines(plan: Plan) -> list[str]:
    """The commands that put the plan's absent data sets in DATA: one `train.py download` for those published
    (datafetch.download.SOURCES), `train.py imagenet100` for ImageNet-100 (built from an ImageNet-1k copy)."""
    names = [t for t in plan.absent if t in datafetch.download.SOURCES]
    lines = [f"python train.py download {' '.join(names)} --data {plan.data}   (or bash reproduce.sh --download)"
             ] if names else []
    if "imagenet100" in plan.absent:
        lines.append(f"python train.py imagenet100 --from IMAGENET_1K_DIR --data {plan.data}   "
                     "(its licence forbids a download)")
    return lines


def _arithmetic(plan, add):
    """The paper presets: every init at the preset's budget. --quick: addition at convergence (default and mask;
    every init with --only arithmetic) and every init at 250 steps (tag 250steps), where the paper's numbers show."""
    if not plan.quick:
        add("arithmetic", "addition", QK)
        add("arithmetic", "multiplication", QK)
        return
    full = QK if plan.only == "arithmetic" else ("default", "mask")
    add("arithmetic", "addition", full)
    add("arithmetic", "addition", QK, SHORT, "250steps")
    if plan.only == "arithmetic":
        add("arithmetic", "multiplication", QK)
        add("arithmetic", "multiplication", QK, SHORT, "250steps")


def _lee(plan, add):
    """Lee et al.'s multiplication data: their NanoGPT budget on a GPU (256 windows of 256 characters / 10.25
    characters an example); --quick: the CPU ladder at 40, 150 and 500 epochs, plain and reversed."""
    lee = "--digits 2 --lee-samples 3000"
    if not plan.quick:
        add("lee", "multiplication", ("default", "mask"), f"{lee} --answer-order msb --batch-size 6400 --log-every 250",
            "msb-nanogpt")
        return
    for order in ("msb", "lsb"):
        for epochs, log in ((40, 48), (150, 180), (500, 600)):  # a log step every 1/20 of a run
            add("lee", "multiplication", ("default", "mask"),
                f"{lee} --answer-order {order} --epochs {epochs} --log-every {log}", f"{order}-ep{epochs}")


LADDER = (("default", "", ""), ("mask", "", ""), ("mask", " --pattern partial", "-partial"), ("qk-opt", "", ""))


def _mult_ladder(plan, add, runs):
    """Multiplication at the paper preset (a GPU's): answers msb and lsb, 5,000 steps, default, the mask (`carry`),
    the mask with --pattern partial and qk-opt; then the better order (the higher mean sequence accuracy of its runs
    in RUNS) at 20,000 steps, planned after a REPLAN once the first stage's results are in."""
    def stage(order, steps, tag):
        for init, pattern, suffix in LADDER:
            add("mult-ladder", "multiplication", (init,), f"--answer-order {order} --steps {steps}{pattern}",
                f"{order}{tag}{suffix}")
    for order in ("msb", "lsb"):
        stage(order, 5000, "")
    first = list(plan.runs)
    if better := _better_order(first, runs):
        stage(better, 20000, "-20k")
        return
    plan.items.append(REPLAN)
    stage("msb", 20000, "-20k")  # its cost (either order's): kept in `later`, not run
    plan.later = [(r, "the better order of the 5,000-step runs (the higher mean sequence "
                      "accuracy), once they are in") for r in plan.runs[len(first):]]
    plan.items = [i for i in plan.items if not isinstance(i, Run) or i in first]


def _better_order(first: list, runs: str | None) -> str | None:
    """msb or lsb: the order whose runs in `first` have the higher mean sequence accuracy in RUNS
    (msb on a tie); None while any of them has no result.json."""
    if runs is None:
        return None
    mean = {}
    for order in ("msb", "lsb"):
        try:
            accs = [runfiles.read_result(os.path.join(runs, r.table, r.name, "result.json"))["metrics"]["seq_acc"]
                    for r in first if f"--answer-order {order}" in r.flags]
        except (runfiles.ReadError, KeyError, TypeError):
            return None
        mean[order] = sum(accs) / len(accs)
    return "lsb" if mean["lsb"] > mean["msb"] else "msb"


def _vision_prior(plan, add):
    """The vision prior study on DATA (a CIFAR-10 layout, e.g. the make-digits set)."""
    if not _have(plan, "visionprior", "cifar10", ""):
        return
    d = "--data-dir @DATA"
    for p in ("impulse", "soft", "local", "graded"):
        add("visionprior", "cifar10", ("mask",), f"{d} --pattern {p}", p)
    add("visionprior", "cifar10", ("default", "impulse"), d)
    for m in (2, 5):                                             # the hard impulse's off level
        add("visionprior", "cifar10", ("mask",), f"{d} --pattern impulse --mask-off {m}", f"impulse-off{m}")
    for a in ("0.3", "3"):                                       # the soft bump's width
        add("visionprior", "cifar10", ("mask",), f"{d} --pattern soft --soft-alpha {a}", f"soft-alpha{a}")
    add("visionprior", "cifar10", ("qk-svd",), d)                # impulse taken apart: its QK part alone,
    add("visionprior", "cifar10", ("qk-svd",), f"{d} --qk-svd-pos-scale 18", "pos18")   # then with the positions x18
    for p in ("impulse", "soft"):                                # the mask with impulse's positions x18 and mimetic V
        add("visionprior", "cifar10", ("mask-impulse",), f"{d} --pattern {p}", p)


def _ablation(plan, add):
    """The robustness grid: each Boolean task's readout x positional std x {default, mask}; the cells at the task's
    own small preset are its Boolean-table runs (all four inits), the others go to ablation/."""
    for t in ("parity2", "majority3", "cyclic3"):
        add("boolean", t, QK)
        preset = tasks.TASKS[t].preset("small")
        own = (preset["readout"], preset["pos_init_std"])
        for readout in ("cls", "mean"):
            for pos in (0.02, 0.5):
                if (readout, pos) != own:
                    add("ablation", t, ("default", "mask"), f"--readout {readout} --pos-init-std {pos}",
                        f"{readout}-pos{pos}")


ORACLE_FREE_BITS = {"kparity": "--bits random:2 --unseen bits:2", "kmajority": "--bits random:3 --unseen bits:2"}


def _oracle_free(plan, add):
    """Priors without an oracle, a group of tasks at a time: its teachers (default runs), a WAIT, then the students
    (the hand mask, the pattern found in the data, the teacher's prior in mask and qk-svd, and default for the
    teacher's and the student's steps together); the cheap tasks first, cyclic3 (8,000 steps a run) last."""
    of, teacher = "oraclefree", "--prior-from @RUNS/oraclefree"
    twice = {t: 2 * int(tasks.TASKS[t].preset("small").get("steps") or tasks.TASKS[t].preset("small")["epochs"])
             for t in ("parity2", "kparity", "majority3", "kmajority", "addition", "wikitext2", "cyclic3", "cifar10")}
    vision = _have(plan, of, "cifar10", "")
    lm = _have(plan, of, "wikitext2", "/vimtext-a") and _have(plan, of, "wikitext2", "/vimtext-b")
    _oracle_free_group(plan, add, ("parity2", "kparity", "majority3", "kmajority", "addition"), twice, teacher)
    if vision:
        add(of, "cifar10", ("default", "impulse"), "--data-dir @DATA")
        plan.items.append(WAIT)
        add(of, "cifar10", ("mask",), "--data-dir @DATA")
        for s in plan.seeds:
            plan.items += [Run(of, "cifar10", "mask", s, "teacher", f"--data-dir @DATA {teacher}/cifar10-default-s{s}"),
                           Run(of, "cifar10", "mask", s, "teacher-impulse",
                               f"--data-dir @DATA {teacher}/cifar10-impulse-s{s}")]
        add(of, "cifar10", ("default",), f"--data-dir @DATA --epochs {twice['cifar10']}", "budget2x")
    if lm:
        add(of, "wikitext2", ("default",), "--data-dir @DATA/vimtext-a", "corpusA")
        plan.items.append(WAIT)
        add(of, "wikitext2", ("default", "mask"), "--data-dir @DATA/vimtext-b", "corpusB")
        add(of, "wikitext2", ("mask",), f"--data-dir @DATA/vimtext-b {teacher}/wikitext2-default-s@SEED-corpusA",
            "corpusB-teacher")
        add(of, "wikitext2", ("default",), f"--data-dir @DATA/vimtext-b --steps {twice['wikitext2']}",
            "corpusB-budget2x")
    _small_data_and_mixed(plan, add, teacher)
    _oracle_free_group(plan, add, ("cyclic3",), twice, teacher)


SMALL_DATA = {"kmajority": "--bits 1,4,8,10,13 --unseen 1,4", "kparity": "--bits 2,7,11 --unseen 2,7"}
MIXED = {"sum23": "--terms 0,1:2,3,4", "summaj": "--terms 0,1:m2,3,4"}  # x0 x1 + x2 x3 x4; x0 x1 + maj(x2..x4)


def _small_data_and_mixed(plan, add, teacher):
    """Round two of the priors without an oracle: the data route on small training sets (default, the hand mask and
    the found one at 100 .. 2,000 draws and every seen point), 2-digit multiplication's found digit pairs, and two
    targets that mix structures (ksum: teachers, a WAIT, then the hand mask, the found one, the teacher's)."""
    of = "oraclefree"
    for task, f in SMALL_DATA.items():
        for n in (100, 250, 500, 2000, None):
            size, tag = ("", "all") if n is None else (f" --train-size {n}", f"n{n}")
            add(of, task, ("default", "mask"), f + size, tag)
            add(of, task, ("mask",), f"{f}{size} --pattern discovered", f"{tag}-discovered")
    d2 = "--digits 2 --data-frac 0.3 --answer-order lsb --steps 1000 --log-every 50"
    add(of, "multiplication", ("default", "mask"), d2, "d2")
    add(of, "multiplication", ("mask",), f"{d2} --pattern discovered", "d2-discovered")
    for tag, f in MIXED.items():
        add(of, "ksum", ("default",), f, tag)
    plan.items.append(WAIT)
    for tag, f in MIXED.items():
        add(of, "ksum", ("mask",), f, tag)
        add(of, "ksum", ("mask",), f"{f} --pattern discovered", f"{tag}-discovered")
        add(of, "ksum", ("mask",), f"{f} {teacher}/ksum-default-s@SEED-{tag}", f"{tag}-teacher")


def _parity3(plan, add):
    """Does any layout let the mask generalise on a 3-parity (kparity on bits 2, 7, 11)? The robustness grid's axes:
    readout, positional std, depth, and the bits frozen on U (two of the three, or one); the mask on every seed,
    default on the first two (the MDI's place). 600 steps: on the preset's 1,500 the mask sits at 50% on U from 90."""
    for unseen in ("2,7", "2"):
        for readout in ("cls", "mean"):
            for pos in ("0.02", "0.5"):
                for layers in (2, 3):
                    f = (f"--bits 2,7,11 --unseen {unseen} --readout {readout} --pos-init-std "
                         f"{pos} --layers {layers} --steps 600 --log-every 30")
                    tag = f"U{unseen.replace(',', '')}-{readout}-pos{pos}-L{layers}"
                    add("parity3", "kparity", ("mask",), f, tag)
                    plan.items += [Run("parity3", "kparity", "default", s, tag, f) for s in plan.seeds[:2]]


def _oracle_free_group(plan, add, group, twice, teacher):
    """A group of tasks' teachers (default runs), a WAIT, then their students."""
    of = "oraclefree"
    for t in group:
        add(of, t, ("default",), ORACLE_FREE_BITS.get(t, ""))
    plan.items.append(WAIT)
    for t in group:
        if t == "addition":  # addition's default is at 98% by its preset's 1,500 steps: no room
            continue
        f = ORACLE_FREE_BITS.get(t, "")
        add(of, t, ("mask",), f)
        add(of, t, ("mask",), f"{f} --pattern discovered".strip(), "discovered")
        add(of, t, ("mask", "qk-svd"), f"{f} {teacher}/{t}-default-s@SEED".strip(), "teacher")
        add(of, t, ("default",), f"{f} --steps {twice[t]}".strip(), "budget2x")
    # addition's students at 250 steps, the paper's regime; the teachers are the 1,500-step defaults
    if "addition" in group:
        add(of, "addition", ("default", "mask"), SHORT, "250steps")
        add(of, "addition", ("mask",), f"{SHORT} --pattern discovered", "250steps-discovered")
        add(of, "addition", ("mask", "qk-svd"), f"{SHORT} {teacher}/addition-default-s@SEED", "250steps-teacher")
        add(of, "addition", ("default",), f"--steps {twice['addition'] // 2 + 250} --log-every 50 --eval-points 500",
            "250steps-samebudget")


# ---- the plan printed before the first run: per table its runs and cost, the runs skipped and why

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
STEP_TIMES, STEP_FLOPS = os.path.join(RESULTS, "step_times.json"), os.path.join(RESULTS, "step_flops.json")


def step_times(path: str = STEP_TIMES) -> dict:
    """{time_key: {"ms_step", "ms_eval", "ms_final", "ms_setup", "device", ...}} that benchmarks/bench_paper.py
    measured (paper presets on a GPU, --quick ones on a CPU; real data path, evaluation included); {} without it."""
    return _read_keys(path, STEP_TIME_SCHEMA, ("ms_step", "ms_eval"), "the step times", "measure them again", "")


def step_flops(path: str = STEP_FLOPS) -> dict:
    """{time_key: {"step", "eval", "final": FLOPs, "layers", "ckpt_bytes", ...}} that bench_paper.py --flops counted:
    a training step, a log step's evaluation, the final one; a checkpoint's bytes. {} without it."""
    return _read_keys(path, FLOPS_SCHEMA, tuple(FLOPS_SCHEMA), "the counts", "count them again", "--flops ")


def _read_keys(path: str, schema: dict, required: tuple, what: str, how: str, flag: str) -> dict:
    if not os.path.exists(path):
        return {}
    found, how = runfiles.read_json(path), f"{how} with python benchmarks/bench_paper.py {flag}--write, or remove it"
    if not isinstance(found, dict):
        raise runfiles.ReadError(f"{path} holds {type(found).__name__}, not {what} bench_paper.py {flag}writes; {how}")
    for key, entry in found.items():
        try:
            runfiles.check_schema(entry, schema, required, f"{path} [{key!r}]")
        except runfiles.ReadError as e:
            raise runfiles.ReadError(f"{e}; {how}") from None
    return found


_ms = (lambda v: runfiles.is_finite(v) and v >= 0, "milliseconds, a finite number >= 0")
STEP_TIME_SCHEMA = {"ms_step": _ms, "ms_eval": _ms, "ms_final": _ms, "ms_setup": _ms,  # what hours() reads
                    "device": (lambda v: isinstance(v, str) and len(v) <= 200 and v.isprintable(),
                               "the device's name, printable text of at most 200 characters")}
_count = (lambda v: runfiles.is_count(v) and v <= runfiles.MAX_VALUE, "an integer from 0 to 1e100")
FLOPS_SCHEMA = {"step": _count, "eval": _count, "final": _count, "ckpt_bytes": _count,
                "layers": (lambda v: runfiles.is_count(v) and 0 < v <= runfiles.MAX_LAYERS, "1 to 1024 layers")}

# An estimate's GPU: its bf16 dense tensor-core peak in FLOP/s (NVIDIA's datasheets of the SXM parts: A100 312
# TFLOPS; H100 and H200 1,979 "with sparsity", 989.4 dense), of which a step uses UTIL, and no step is faster
# than FLOOR_S a layer. Both from the steps measured on one H200 (results/README.md), their FLOPs counted here:
# ViT-Tiny/2 at 32 px, batch 512 (preset paper32), 5.10 TFLOP in 59.6 ms: 8.7%; the 12-layer Boolean model, batch
# 256, 0.15 TFLOP in 27.4 ms: 2.3 ms a layer (a small step waits on kernel launches, not on FLOPs).
PEAK = {"A100": 312e12, "H100": 989.4e12, "H200": 989.4e12}
UTIL, FLOOR_S = 0.087, 0.0023
LOG_BYTES = 2048            # a log step's lines in metrics.jsonl and the run's .log, about
IMAGENET_1K = 147_897_477_120 + 6_744_924_160   # ILSVRC2012_img_train.tar and _val.tar (image-net.org: 138 + 6.3 GiB)
TEST_SIZE = {"cifar10": 10_000, "cifar100": 10_000, "imagenet100": 5_000}      # test images as released


def cost(run: Run, times: dict, flops: dict, preset: str = "paper", gpu: str = "H100") -> tuple[float | None, bool]:
    """(hours, measured) of a run: step_times.json's (`hours`, on the device that measured them) where there, else the
    paper presets' estimate on `gpu` from the counted FLOPs at UTIL of its peak; None where neither is known (a --quick
    plan's minutes are measured only)."""
    h, counted = hours(run, times, preset), flops.get(time_key(run, preset))
    if h is not None or preset != "paper" or counted is None:
        return h, h is not None
    steps, evals, rate = *steps_of(run, preset), UTIL * PEAK[gpu]     # a step no faster than FLOOR_S a layer
    return (steps * max(counted["step"] / rate, counted["layers"] * FLOOR_S)
            + (counted["eval"] * (evals - 1) + counted["final"]) / rate) / 3600, False


def _bytes(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.0f} MiB" if n else "none"


def cost_text(rs: list, plan: Plan, times: dict, flops: dict, jobs: int = 1) -> str:
    """What runs `rs` cost: their time (--quick: measured minutes at `jobs` runs at a time; else GPU-hours, measured,
    or est. on each GPU of PEAK), the bytes to download (the plan's absent sets: datafetch SOURCES; ImageNet-100 is
    hard-linked from the user's ImageNet-1k copy) and the disk (their data sets, an archive unpacked at most to
    max_unpacked, an image set's decoded uint8 cache at 32 x 32; each run's ckpt.pt and logs); "not counted" where a
    time key was neither measured nor counted."""
    preset = "small" if plan.quick else "paper"
    h = {gpu: [cost(r, times, flops, preset, gpu) for r in rs] for gpu in (("H100",) if plan.quick else PEAK)}
    total = {gpu: sum(x or 0 for x, _ in v) for gpu, v in h.items()}
    if any(x is None for x, _ in h["H100"]):
        when = "minutes not measured" if plan.quick else "GPU-hours not measured or counted"
    elif plan.quick:
        when = f"about {60 * total['H100'] / jobs:.0f} min"
    else:
        when = (f"{total['H100']:.2f} device-hours (measured)" if all(m for _, m in h["H100"]) else
                f"est. {' / '.join(f'{x:.1f}' for x in total.values())} GPU-hours on {' / '.join(h)}")
    sets = [t for t in dict.fromkeys(r.task for r in rs) if t in TEST_SIZE or t in datafetch.download.SOURCES]
    files = {t: datafetch.download.SOURCES.get(t, ()) for t in sets}
    on_disk = sum(f.max_unpacked or f.size for t in sets for f in files[t]) + sum(
        (tasks.TASKS[t].TRAIN_SIZE + TEST_SIZE[t]) * 3 * 32 * 32 for t in sets if t in TEST_SIZE)
    mine = "imagenet100" in plan.absent and "imagenet100" in sets
    disk = [c["ckpt_bytes"] + steps_of(r, preset)[1] * LOG_BYTES if (c := flops.get(time_key(r, preset))) else None
            for r in rs]
    return (f"{when}, download {_bytes(sum(f.size for t in sets if t in plan.absent for f in files[t]))}"
            + f" and your ImageNet-1k copy ({_bytes(IMAGENET_1K)}, not fetched)" * mine + ", disk "
            + ("not counted" if None in disk else _bytes(sum(disk) + on_disk)))


LENGTH_FLAGS = ("--steps", "--epochs", "--log-every", "--data-dir", "--prior-from")  # not a step's cost (time_key)


def time_key(run: Run, preset: str = "paper") -> str:
    """The step time a run shares with every run of its preset, task, init and flags, but those that only set how
    long it trains or where its data is (LENGTH_FLAGS): "paper cifar10 mask", "small addition default"."""
    words = run.flags.split()
    kept = [w for i, w in enumerate(words) if w not in LENGTH_FLAGS and (i == 0 or words[i - 1] not in LENGTH_FLAGS)]
    return " ".join([preset, run.task, run.init, *kept])


def hours(run: Run, times: dict, preset: str = "paper") -> float | None:
    """A run's device-hours from the measured times of its time_key: its steps, its log steps' evaluations, the final
    one over the whole test set (`steps_of`), its start (process, data, model, init: `ms_setup`); None: unmeasured."""
    t = times.get(time_key(run, preset))
    if not isinstance(t, dict):
        return None
    steps, evals = steps_of(run, preset)
    return (t["ms_step"] * steps + t["ms_eval"] * (evals - 1) + t.get("ms_final", t["ms_eval"])
            + t.get("ms_setup", 0.0)) / 3.6e6


def steps_of(run: Run, preset: str = "paper") -> tuple[int, int]:
    """(training steps, evaluations) of a run of the paper preset, from its flags and its task's
    preset; a preset in epochs takes the dataset's size (`train_size`)."""
    p = tasks.TASKS[run.task].preset(preset)
    words = run.flags.split()
    flag = {words[i][2:].replace("-", "_"): words[i + 1] for i in range(len(words) - 1)
            if words[i].startswith("--")}
    batch = int(flag.get("batch_size", p.get("batch_size", 64)))
    if "steps" in flag or ("epochs" not in flag and "steps" in p):
        steps = int(flag.get("steps", p.get("steps", 0)))
    else:
        steps = round(float(flag.get("epochs", p.get("epochs", 0))) * math.ceil(train_size(run.task) / batch))
    log_every = int(flag.get("log_every", p.get("log_every") or max(1, steps // 10)))
    return steps, steps // log_every + 1


@functools.cache
def train_size(task: str) -> int:
    """Training examples of a task at its defaults: an image set's size as released (`TRAIN_SIZE`),
    else its own count once set up (the Boolean and arithmetic tasks make their data)."""
    return getattr(tasks.TASKS[task], "TRAIN_SIZE", None) or tasks.make_task(task).setup().n_train


def describe(plan: Plan, times: dict | None = None, jobs: int = 1, flops: dict | None = None) -> str:
    """The plan as reproduce.sh prints it first: per table, in the order of the paper's claims, its runs (those
    skipped for want of their data too) and their cost (`cost_text`), with --budget each reduced budget and the tables
    left out; the cost in all and what it rests on; then every table or task skipped and why, and the commands that
    fetch the missing data."""
    times = step_times() if times is None else times
    flops = step_flops() if flops is None else flops
    preset, every, by_table = "small" if plan.quick else "paper", plan.runs + plan.missing, {}
    for r in every:
        by_table.setdefault(r.table, []).append(r)
    lines = [f"plan: {len(plan.runs)} runs, preset {preset} ({'CPU' if plan.quick else 'one GPU'}), "
             f"seeds {' '.join(map(str, plan.seeds))}{plan.budget}"
             + (f"; {len(plan.missing)} more once their data is there (below)" if plan.missing else "")]
    for table in sorted({*by_table, *plan.left_out}, key=TABLES.index):
        rs, skipped = by_table.get(table, []), sum(r.table == table for r in plan.missing)
        lines.append(f"  {table:<12} {len(rs):>4} runs  " + (f"left out: {plan.left_out[table]}" if table in
                     plan.left_out else cost_text(rs, plan, times, flops, jobs) + f"; {skipped} skipped (no data)"
                     * bool(skipped) + plan.notes.get(table, "")))
    if plan.later:
        lines.append(f"  then {len(plan.later):>4} runs  {cost_text([r for r, _ in plan.later], plan, times, flops)}"
                     f": {plan.later[0][1]}")
    lines += [f"  {'in all':<12} {len(every):>4} runs  {cost_text(every, plan, times, flops, jobs)}"
              + f", {jobs} run(s) at a time" * plan.quick] * (len(by_table) > 1)
    lines += [f"  est.: the FLOPs of a step and of the evaluations ({os.path.relpath(STEP_FLOPS)}) at {UTIL:.1%} of "
              f"each GPU's bf16 dense peak ({', '.join(f'{g} {p / 1e12:.0f}' for g, p in PEAK.items())} TFLOPS), a "
              f"step no faster than {1000 * FLOOR_S:.1f} ms a layer, until a step is measured"] * (not plan.quick)
    lines.append("  disk: the data sets unpacked and decoded" + " (ImageNet-100: hard links to your copy)" * (
        not plan.quick) + ", each run's ckpt.pt and logs")
    lines += [f"  skipped: {table} {what}: {why}" for table, skips in plan.skipped.items() for what, why in skips]
    lines += [f"  fetch: {line}" for line in fetch_lines(plan)]
    measured = {t.get("device") for k, t in times.items() if k.startswith(preset + " ") and isinstance(t, dict)}
    how = f"python benchmarks/bench_paper.py {'--quick --device cpu' if plan.quick else '--device cuda'} --write"
    lines.append(f"  step times: {os.path.relpath(STEP_TIMES)} "
                 f"({', '.join(sorted(map(str, measured)))}; {how} measures them again)"
                 if measured else f"  step times: none measured ({how} measures them)")
    return "\n".join(lines)


def budget_plan(budget: float, gpu: str, only: str | None, seeds, data: str | None, runs: str | None) -> Plan:
    """The paper presets' tables (or `only`'s) that fit in `budget` hours of one `gpu`, in the order of the paper's
    claims: each with all its seeds, else with the first seeds that fit (its note says so), else left out with its
    cost. A table's cost is its runs' as if every data set were there (`cost`): what fits does not hang on DATA."""
    times, flops, left, seeds = step_times(), step_flops(), budget, tuple(seeds)
    plan, whole = Plan(False, only, seeds, data, [], {}), run_list(False, only, seeds, None, runs)
    every = whole.runs + [r for r, _ in whole.later]
    for table in dict.fromkeys(r.table for r in every):
        costs = [[cost(r, times, flops, "paper", gpu) for r in every if r.table == table and r.seed == s]
                 for s in seeds]
        est = "est. " * any(not m for c in costs for _, m in c)
        need = list(itertools.accumulate(sum(math.inf if h is None else h for h, _ in c) for c in costs))
        if not (k := sum(h <= left for h in need)):      # inf: a run neither measured nor counted
            plan.left_out[table] = f"{sum(map(len, costs))} runs, " + (
                f"{est}{need[-1]:.1f} GPU-hours on {gpu} (a seed {need[0]:.1f}), more than the {left:.1f} left"
                if need[-1] < math.inf else "GPU-hours not measured or counted (bench_paper.py --flops --write)")
            continue
        left -= need[k - 1]
        part = run_list(False, table, seeds[:k], data, runs)
        for name in ("items", "missing", "later", "absent"):
            getattr(plan, name).extend(getattr(part, name))
        plan.skipped.update(part.skipped)
        if k < len(seeds):
            plan.notes[table] = (f"; seed{'s' * (k > 1)} {' '.join(map(str, seeds[:k]))} only, within the budget "
                                 f"(all {len(seeds)}: {est}{need[-1]:.1f} GPU-hours on {gpu})")
    plan.budget = f"; budget {budget:g} GPU-hours on one {gpu}, {budget - left:.1f} of them planned"
    return plan


class _Once(argparse.Action):
    """A flag's value, refused when the flag is given twice (the last would win in silence)."""
    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in getattr(namespace, "_given", set()):
            parser.error(f"{option_string} is given twice; give each flag once")
        namespace._given = getattr(namespace, "_given", set()) | {option_string}
        setattr(namespace, self.dest, values)


class _Parser(argparse.ArgumentParser):
    """argparse with its refusals in one line (exit status 2), as every other refusal here."""
    def error(self, message):
        print(runfiles.one_line(f"reporting.plan: {message} (python -m reporting.plan --help lists the flags)"),
              file=sys.stderr)
        sys.exit(2)


def _refused(error: Exception):
    """Raise `error` (a parser's refusal, as an expression)."""
    raise error


def parse_seeds(text: str) -> list[int]:
    """--seeds "0 1 2": distinct seeds in 0 .. 2^32 - 1, each through the one parser of counts (tasks.parse_count)."""
    seeds = [tasks.parse_count(s, "seeds", 0, 2 ** 32 - 1) for s in text.split()]
    return seeds if seeds and len(set(seeds)) == len(seeds) else _refused(tasks.TaskError(
        f"--seeds needs distinct seeds, e.g. \"0 1 2\", got {tasks.cut(text)}"))


def parse_budget(text: str | None) -> float | None:
    """--budget HOURS: GPU-hours above 0, up to 1e6, as plain decimals (8, 2.5); None where not given."""
    if text is None or re.fullmatch(r"[0-9]*\.?[0-9]+", text) and 0 < float(text) <= 1e6:
        return text and float(text)
    raise runfiles.UsageError(f"--budget needs a number of GPU-hours above 0 (up to 1e6), e.g. 8 or 2.5, not "
                              f"{tasks.cut(text)}")


def _folder(flag: str, what: str):
    """The parser of a folder flag: the path, where it is a folder or not there yet (a folder to come: its data
    sets absent, its runs not made); a path that is something else is refused."""
    return lambda path: (path if path is None or not os.path.exists(path) or os.path.isdir(path) else
                         _refused(runfiles.UsageError(f"--{flag} {path} is a file, not a folder: give {what}")))


JOBS = (1, 1024)            # runs at a time
# every flag past argparse, in one table: flag -> its parser (text -> value; a refusal is one line)
FLAGS = {"seeds": parse_seeds, "jobs": lambda text: tasks.parse_count(text, "jobs", *JOBS),
         "data": _folder("data", "the data sets' folder"),
         "runs": _folder("runs", "the run folders a later stage reads"), "budget": parse_budget}


def main(argv=None) -> int:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.register("action", None, _Once)                # every flag below: given once
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=TABLES)
    p.add_argument("--seeds", default="0 1 2")
    p.add_argument("--data", default="data")
    p.add_argument("--runs", help="the run folders a later stage chooses from (mult-ladder)")
    p.add_argument("--jobs", default="1", help=f"runs at a time (the --quick plan's minutes), {JOBS[0]} .. {JOBS[1]}")
    p.add_argument("--budget", metavar="HOURS", help="plan the paper's tables that fit in HOURS of one --gpu, in the "
                   "order of its claims, a table with fewer seeds where only those fit")
    p.add_argument("--gpu", choices=tuple(PEAK), default="H100", help="the GPU whose hours --budget counts")
    p.add_argument("--list", action="store_true",
                   help="the plan as reproduce.sh reads it: its text, each line led by '# ', then the runs, one a line")
    a = p.parse_args(argv)
    try:
        flags = {flag: parse(getattr(a, flag)) for flag, parse in FLAGS.items()}
        if "--gpu" in getattr(a, "_given", ()) and not flags["budget"]:
            raise runfiles.UsageError("--gpu names the GPU whose hours --budget counts; give --budget HOURS with it "
                                      "(the plan lists every GPU's hours without it)")
        if flags["budget"] and (a.quick or a.only in STUDIES):
            raise runfiles.UsageError("--budget counts GPU-hours of the paper presets; --quick and the studies run on "
                                      "a CPU and their plan gives their minutes: leave out --budget")
        times, flops = step_times(), step_flops()        # read once, a bad file refused before any line
        plan = (budget_plan(flags["budget"], a.gpu, a.only, flags["seeds"], a.data, a.runs) if flags["budget"] else
                run_list(a.quick, a.only, flags["seeds"], a.data, a.runs))
    except (runfiles.UsageError, runfiles.ReadError) as e:  # one line, exit 2: reproduce.sh relays it, starts nothing
        print(runfiles.one_line(f"reporting.plan: {e}"), file=sys.stderr)
        return 2
    if a.list:
        fetch = [t for t in plan.absent if t != "imagenet100"]
        print("\n".join(["# " + line for line in describe(plan, times, flags["jobs"], flops).splitlines()]
                        + (["DOWNLOAD " + " ".join(fetch)] if fetch else [])
                        + [item if isinstance(item, str) else item.line() for item in plan.items]))
    else:
        print(describe(plan, times, flags["jobs"], flops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
