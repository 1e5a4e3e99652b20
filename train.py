"""Train any task with any initialisation and write a run directory.

    python train.py --task cyclic3 --init mask
    python train.py --task kparity --bits 0,4,7 --unseen 0,4 --init qk-svd --preset paper --seed 1
    python train.py --task cifar10 --data-dir data/ --init impulse
    python train.py --config runs/cyclic3-mask-s0/args.json --seed 1 --out runs/again   # a run's flags, rerun
    python train.py summarize runs/          # a markdown table of finished runs
    python train.py report runs/quick results/quick   # results/*.md tables, learning and persistence curves
    python train.py download cifar10 wikitext2 --data data/      # the public data sets, fetched and checked
    python train.py imagenet100 --from /datasets/imagenet --data data/   # ImageNet-100 from an ImageNet-1k copy
    python train.py show runs/parity2-mask-s0   # m.png (M at the start and end), attention.png
    python train.py make-digits data/digits  # a small real image set in CIFAR-10 format (needs scikit-learn)

A run directory (default runs/TASK-INIT-sSEED) holds args.json, prior.pt, metrics.jsonl (one line per log step),
result.json and ckpt.pt: `--resume` continues it exactly. Bad input: one line, exit status 2.

Reading order: the parser (every run flag a field of runconfig.Config) -> build (task, model, prior and init,
optimiser) -> data parallelism -> loop (start or resume, train, finish) -> durability (what is written, checked) ->
commands."""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import datetime
import hashlib
import io
import json
import math
import os
import signal
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

import torch

import datafetch.download
import datafetch.imagenet100
import datafetch.write
import maskprior as mp
import maskprior_retrofit as retrofit
import reporting.report
import reporting.show
import runfiles
import runconfig
import tasks

STARTED = time.time()           # the command's start (after its imports), for the wall time the final line prints
UsageError, BusyError = runfiles.UsageError, runfiles.BusyError


# ----------------------------------------------------------------------------------------
# Parser: every flag of `train` from the Config table (runconfig.py), each command's from SUBCOMMANDS; every
# option of every command given once, and every number through one ASCII parser (`number`)


class Parser(argparse.ArgumentParser):
    def error(self, message):                       # argparse echoes the words given: one line whatever they hold
        raise UsageError(f"{runfiles.one_line(message)} (see python train.py --help)")


class _Unset:
    """The default of every flag: tells a flag given on the command line from one left to the preset."""
    __repr__ = lambda self: "preset"  # noqa: E731


UNSET = _Unset()


class Once(argparse.Action):
    """Store a flag's value (a switch: True), refusing a flag given twice, whose last value would win in silence."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, self.default)
        if before is not self.default:
            again = "" if self.nargs == 0 else f" ({before!r}, then {values!r})"
            raise UsageError(f"{option_string} is given twice{again}; give each flag once")
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def number(kind):
    """argparse's `type` for a flag: an int or float of ASCII text alone (Python's own read '1_0' and '١٠' too), an
    int of at most 20 digits (past 2^64, which no count or seed needs); any other kind as it is."""
    if kind not in (int, float):
        return kind

    def parse(text: str):
        if not text.isascii() or "_" in text or (kind is int and len(text.strip().lstrip("+-")) > 20):
            raise ValueError(text)
        return kind(text)
    parse.__name__ = kind.__name__              # argparse's line: "invalid int value: '1_0'"
    return parse


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Config field (runconfig.py), in its group, parsed to UNSET when not given (see `resolve`)."""
    groups = {key: p.add_argument_group(title) for key, title in runconfig.GROUPS.items()}
    for name, f in runconfig.FIELDS.items():
        m = f.metadata
        kw = {k: v for k, v in (("type", number(m["type"])), ("metavar", m["metavar"]),
                                ("choices", m["choices"] and list(m["choices"])), ("nargs", 0 if m["switch"] else None))
              if v is not None}
        help_ = m["help"] and m["help"].format(tasks=", ".join(tasks.TASKS), inits=", ".join(runconfig.INITS))
        groups[m["group"]].add_argument(runconfig.flag(name), action=Once, help=help_, **kw)


# the commands beside train: name -> (help, description or None, its arguments: (names, keywords))
SUBCOMMANDS = {
    "summarize": ("a markdown table (mean ± std over seeds) of finished runs", None, [
        (("paths",), dict(nargs="+", help="run directories or folders of them"))]),
    "report": ("results/*.md tables, learning and persistence curves of a reproduction", None, [
        (("runs",), dict(help="a reproduce.sh runs folder (e.g. runs/quick)")),
        (("out",), dict(help="the folder to write the tables and figures to (e.g. results/quick)"))]),
    "redraw": ("a results folder's figures drawn again from the CSVs beside them, no runs", None, [
        (("results",), dict(help="a folder train.py report wrote (e.g. results/quick)"))]),
    "download": ("fetch the public data sets into a folder, checked against pinned sums",
                 "Fetch cifar10, cifar100, wikitext2 (tokens and raw) and tinystories (V2 train and valid) into "
                 "--data: resumable (run again after a cut), checked against their pinned sha256 and md5, unpacked "
                 "safely, moved in whole; a set already there is left as it is. See datafetch/download.py.", [
                     (("names",), dict(nargs="+", metavar="NAME", help="cifar10, cifar100, wikitext2, tinystories")),
                     (("--data",), dict(required=True, metavar="DIR", help="the data folder (reproduce.sh's --data)")),
                     (("--from",), dict(dest="mirror", metavar="URL",
                                        help="a mirror: a base URL holding the same file names, or a folder on "
                                             "this machine holding them (still checked against the pinned sums)")),
                     (("--timeout",), dict(type=float, default=30.0,
                                           help="seconds without a byte before a transfer stops"))]),
    "imagenet100": ("build ImageNet-100 from an ImageNet-1k folder (it needs a licence)",
                    "DIR/imagenet100/{train,val}/<wnid>/ from IMAGENET_1K_DIR/{train,val}/<wnid>/, the 100 classes "
                    "of tasks.IMAGENET100_WNIDS, hard links where possible, else copies; whole or not at all. See "
                    "datafetch/imagenet100.py.", [
                        (("--from",), dict(dest="source", required=True, metavar="IMAGENET_1K_DIR")),
                        (("--data",), dict(required=True, metavar="DIR"))]),
    "show": ("draw a run's M at its start and end (m.png), its attention (attention.png) and curves (curves.png)",
             "Draw M at the start and at the end of a run, per layer and head, on one colour scale (m.png; none "
             "for an init without M), the mean attention on the task's probe inputs at the end (attention.png) "
             "and, for a finished run, its learning curves (curves.png). Needs matplotlib. See reporting/show.py.", [
                 (("run",), dict(metavar="RUN", help="a run folder (with its ckpt.pt)")),
                 (("--out",), dict(metavar="DIR", help="where to write the figures (default: RUN itself)"))]),
    "make-digits": ("scikit-learn's digits written in the CIFAR-10 python layout", None, [(("folder",), {})]),
    "make-wikitext": ("plain-text files written in WikiText-2's word-level layout", None, [
        (("folder",), {}),
        (("files",), dict(nargs="+", help="text files: one article each, the first line its title"))]),
}


def build_parser() -> Parser:
    """`train.py [train] FLAGS` (the default command) and each command of SUBCOMMANDS."""
    p = Parser(prog="train.py", description="Train a task with an attention prior, or tabulate runs.")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    t = sub.add_parser("train", argument_default=UNSET, help="train one run (the default command)",
                       description="Train a task with an attention prior. A flag not given takes "
                                   "the task's preset value (--preset small or paper), else the "
                                   "default shown. Other commands: " + ", ".join(SUBCOMMANDS) +
                                   " (python train.py COMMAND --help).")
    add_train_flags(t)
    t.add_argument("--config", default=None, action=Once, metavar="RUN/args.json",
                   help="rerun a run from its args.json: the flags given beside it override (each said in a line)")
    for name, (help_, description, arguments) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_, description=description)
        for names, keywords in arguments:
            once = {"action": Once} if names[0].startswith("--") else {}
            command.add_argument(*names, **{**keywords, **once, "type": number(keywords.get("type"))})
    return p


def parse_args(argv=None):
    """-> (namespace, explicit): the command's arguments, and for `train` the flags given (the others are UNSET)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("train", *SUBCOMMANDS):
        argv = ["train"] + argv                       # training is the default command
    flags = build_parser().parse_args(argv)
    explicit = {k for k, v in vars(flags).items() if v is not UNSET} - {"command", "config"}
    return flags, explicit


# ----------------------------------------------------------------------------------------
# Build: the task, the model, the prior and the init, the optimiser

# the model config of a run, sized for this machine (one line where it is not): runconfig's, named here too
model_config, use_fused = runconfig.model_config, runconfig.use_fused


def build_model(config, task, device):
    model_cfg = model_config(config, task, device)
    torch.manual_seed(config.seed)
    return mp.build_model(model_cfg).to(device), model_cfg


def apply_init(model, prior: runfiles.Prior, config) -> dict:
    """Write the prior into the model as config.init says; returns the init's report."""
    return runconfig.INITS[config.init].apply(model, prior, config, torch.Generator().manual_seed(config.seed + 1))


# what a teacher's maps must share
LAYOUT = ("seq_len", "readout", "causal", "image_size", "patch_size", "pool")
Teacher = collections.namedtuple("Teacher", "folder ckpt config")       # a --prior-from run, read and checked


def read_teacher(config, task) -> Teacher:
    """--prior-from RUN, read as someone else's files before anything is built or written: a finished run (result.json
    matching ckpt.pt) no process trains in, of this task, token layout and (for a per-head prior) head count."""
    folder, flag = config.prior_from, f"--prior-from {config.prior_from}"
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} is not a folder; give the folder of a finished run (a teacher)")
    if not os.path.lexists(os.path.join(folder, "result.json")):
        raise UsageError(f"{flag} is not a finished run (no result.json): train it to the end first")
    with runfiles.RunFolder(folder).reading(flag):
        try:
            result = runfiles.read_result(os.path.join(folder, "result.json"))
        except runfiles.ReadError as e:
            raise UsageError(f"{flag}: {e}") from None
        ckpt = read_checkpoint(os.path.join(folder, "ckpt.pt"), flag)
    ident = ckpt["identity"]
    if result.get("run_id") != ident.get("run_id") or result.get("steps") != ckpt["step"]:
        raise UsageError(f"{flag}: its result.json (run {result.get('run_id')}, step {result.get('steps')}) and "
                         f"ckpt.pt (run {ident.get('run_id')}, step {ckpt['step']}) are not one finished run; "
                         "finish the run (--resume) or give another teacher")
    saved, mine = runconfig.saved_config(ckpt["config"], f"{flag}: ckpt.pt"), asdict(model_config(config, task))
    if saved.task != config.task:
        raise UsageError(f"{flag} is a run of task {saved.task}, not {config.task}: a teacher runs the same task")
    theirs = ckpt["model_config"]
    other = {k: (theirs.get(k), mine.get(k)) for k in LAYOUT if theirs.get(k) != mine.get(k)}
    if other:
        what = ", ".join(f"{k} {a} (here {b})" for k, (a, b) in other.items())
        raise UsageError(f"{flag} has another token layout: {what}; a teacher's attention maps "
                         "must cover this run's positions")
    kind = config.prior_kind or task.TEACHER_KINDS[0]
    if kind != "pattern" and theirs["n_heads"] != config.heads:
        raise UsageError(f"{flag} has {theirs['n_heads']} heads, this run {config.heads}: --prior-kind {kind} gives "
                         "each head its own M (the teacher's head); use --prior-kind pattern or as many heads")
    return Teacher(folder, ckpt, saved)


def teacher_prior(config, task, device, teacher: Teacher) -> runfiles.Prior:
    """The prior a teacher's attention gives (`tasks.Task.prior_from_teacher`), its task made from its own flags."""
    ckpt, kind = teacher.ckpt, config.prior_kind or task.TEACHER_KINDS[0]
    teacher_task = runconfig.task_for(teacher.config).setup(device)
    source = {"from": "teacher", "teacher": os.path.abspath(teacher.folder),
              "teacher_run_id": ckpt["identity"]["run_id"], "teacher_init": teacher.config.init,
              "teacher_steps": ckpt["step"], "kind": kind, "ratio": config.prior_ratio}
    try:
        return task.prior_from_teacher(teacher_task, ckpt["model_config"], ckpt["model"],
                                       config.probe_size, kind, config.prior_ratio, config.mask_on,
                                       config.mask_off, source, config.teacher_min_fit)
    except tasks.TaskError as e:
        raise UsageError(f"--prior-from {teacher.folder}: {e}") from None


@dataclass
class Probe:
    """What each log step measures: the task's metrics and, per layer, the prior's attention mass and content margin on
    a fixed real batch `inputs` and the drift of M and Wq Wk^T since `snapshot` (the start). `no_mass`: why there is no
    mass (the pattern constrains no query row). `autocast`: the context the model runs in (--amp)."""
    task: tasks.Task
    pattern: torch.Tensor
    inputs: torch.Tensor
    snapshot: list
    eval_points: int
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    sample_seconds: list = field(default_factory=list)      # each log step's sampled evaluation's time, in order

    def __post_init__(self):
        causal = self.task.arch().get("causal", False)
        self.no_mass = None if mp.prior_rows(self.pattern, causal).any() else (
            f"the prior's pattern of {self.task.name} constrains no query row at this size (every "
            "row allows every key it can see), so there is no prior mass to measure")

    def line(self, rec: dict) -> str:
        """A log record as the progress line shows it: the task's headline metrics and the prior's mean mass."""
        m, mass = rec["metrics"], rec["prior_mass_mean"]
        parts = [f"{'test_loss' if k == 'loss' else k} {m[k]:.4f}" for k in self.task.HEADLINE if k in m]
        return " | ".join(parts + [f"mass {'n/a' if mass is None else f'{mass:.3f}'}"])

    def say_final_size(self, model) -> None:
        """Where the final evaluation scores 10x a log step's sample points (a cube of 2^20), say its size and an
        estimate past 10 s (the last sample's time, scaled; timed here if only the first, slow one ran)."""
        size = self.task.final_eval_size()
        if not size or not self.eval_points or size < 10 * self.eval_points:
            return
        if len(self.sample_seconds) < 2:
            started = time.perf_counter()
            self.task.evaluate(model, points=self.eval_points)
            self.sample_seconds.append(time.perf_counter() - started)
        seconds = size / self.eval_points * self.sample_seconds[-1]
        if seconds > 10:
            self.task.say(f"the final evaluation: the whole test set, {size:,} points (about {seconds:.0f} s)")

    def measure(self, model, ema: torch.nn.Module | None = None, final: bool = False) -> dict:
        """The log record of `model` (and of its moving average `ema`, as ema_* metrics): a Boolean or arithmetic task's
        log steps on `eval_points` cube points or test pairs, the final measurement on the whole test set."""
        points = None if final else self.eval_points
        model.eval()
        with self.autocast():
            if final:
                self.say_final_size(model)
            started = time.perf_counter()
            metrics = self.task.evaluate(model, points=points)
            if not final:
                self.sample_seconds.append(time.perf_counter() - started)
            if ema is not None:
                averaged = self.task.evaluate(ema.eval(), points=points)
                metrics.update({f"ema_{k}": v for k, v in averaged.items() if isinstance(v, float)})
            mass, margin = mp.prior_probe(model, self.inputs, self.pattern) if self.no_mass is None else (None, None)
        model.train()
        return {"metrics": metrics, "prior_mass": mass, "prior_mass_mean": None if mass is None
                else sum(mass) / len(mass), "content_margin": margin,
                **mp.prior_drift(model, self.snapshot)}


def make_optimizer(model, config):
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(mp.param_groups(model, config.weight_decay), lr=config.lr,           # M is never decayed
               betas=tuple(map(float, config.betas.split(","))))


def lr_at(step: int, total: int, config) -> float:
    """Learning rate of a step: linear warm-up, then constant or cosine to 0."""
    if config.warmup and step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    if config.schedule == "cosine":
        t = (step - config.warmup) / max(1, total - config.warmup)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return config.lr


def amp_on(amp: str, device_type: str) -> bool:
    """Whether --amp runs the step under bf16 autocast on this device type."""
    return amp == "bf16" or (amp == "auto" and device_type == "cuda")


def autocast(device, config):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp_on(config.amp, device.type))


# ----------------------------------------------------------------------------------------
# Data parallelism: `torchrun --nproc_per_node N train.py ...` (nanoGPT's wiring). Every rank draws a step's global
# batch and trains on its own shard, so --batch-size and --lr mean what they mean on one device; DistributedDataParallel
# averages the gradients (M's too); rank 0 alone evaluates, logs and writes the run folder.


class QuietExit(Exception):
    """A rank other than 0 stops because rank 0 reported an error (rank 0 prints it)."""


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, obj):
        """rank 0's `obj`, on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def failed(self, e: BaseException, folder: runfiles.RunFolder | None) -> str | None:
        """A start that raised `e`: the run folder left as it was (`RunFolder.abandon`), then `e` raised again where it
        is no refusal or the run is one process; else the line to share with the other ranks (`agree`: rank 0's)."""
        if folder is not None:
            folder.abandon()
        if self.world == 1 or not isinstance(e, UsageError):
            raise e
        return str(e) if self.main else None

    def agree(self, error: str | None) -> None:
        """Every rank learns rank 0's error (None: none): rank 0 raises it, the others exit quietly."""
        error = self.share(error)
        if error is not None:
            raise UsageError(error) if self.main else QuietExit()

    def shard(self, batch):
        """This rank's part of a global batch (a tensor or tuple of tensors, split along dim 0) and its loss weight
        n_rank * world / n_global: the averaged gradients are the global mean's (a last batch may not split evenly)."""
        if self.world == 1:
            return batch, None
        n = len(batch[0] if isinstance(batch, (tuple, list)) else batch)
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        weight = (hi - lo) * self.world / n
        if hi == lo:                    # fewer examples than ranks: a stand-in with no weight
            lo, hi = 0, 1
        return (type(batch)(t[lo:hi] for t in batch) if isinstance(batch, (tuple, list)) else batch[lo:hi]), weight

    def step_state(self, loss: torch.Tensor, stop: bool) -> tuple[float, bool]:
        """The global batch's mean loss (from this rank's weighted shard's) and whether any rank was interrupted."""
        if self.world == 1:
            return float(loss), stop
        t = torch.tensor([float(loss) / self.world, float(stop)], dtype=torch.float64,
                         device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(t)
        return float(t[0]), bool(t[1] > 0)


def init_distributed(config: runconfig.Config) -> tuple[Dist, runconfig.Config]:
    """One process (no torchrun): Dist(). Under torchrun: join the process group (NCCL on GPUs, gloo on the CPU) and
    pin this rank's device (the config it returns names it); bad settings are one line from rank 0."""
    world = int(os.environ.get("WORLD_SIZE", 1)) if "RANK" in os.environ else 1
    if world == 1:
        return Dist(), config
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if config.sample is not None:
        raise UsageError("--sample runs in one process; start it without torchrun")
    if config.batch_size % world:
        raise UsageError(f"--batch-size {config.batch_size} (the global batch) does not divide by "
                         f"the {world} processes; give a multiple of {world}")
    device = runconfig.pick_device(config.device)
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UsageError(f"torchrun started {world} processes per node but torch sees {torch.cuda.device_count()} "
                             f"CUDA GPU(s); use --nproc_per_node {torch.cuda.device_count()} or fewer")
        torch.cuda.set_device(local)
        config = replace(config, device=f"cuda:{local}")
    elif device.type != "cpu":
        raise UsageError(f"--device {config.device}: data parallelism runs on CUDA GPUs (NCCL) or on the CPU (gloo)")
    try:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=config.dist_timeout))
    except Exception as e:  # noqa: BLE001 - an unreachable rendezvous is one line, not a traceback
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UsageError(f"torchrun: cannot join the process group at {where} within --dist-timeout "
                         f"{config.dist_timeout} s ({type(e).__name__}); are all {world} processes started?") from None
    return Dist(rank, world, local), config


# ----------------------------------------------------------------------------------------
# Loop: start a run (or resume it), train, finish


@dataclass
class Run:
    """Everything a run carries from its start to its end."""
    config: runconfig.Config
    task: tasks.Task
    model: torch.nn.Module
    model_cfg: object
    optimizer: torch.optim.Optimizer
    probe: Probe
    device: torch.device
    init_report: dict
    mass_start: list | None
    folder: runfiles.RunFolder | None        # rank 0's (the others never touch the run folder)
    dist: Dist
    step: int = 0
    seconds: float = 0.0                # training time before this invocation
    run_id: str | None = None           # written into ckpt.pt and the log's step-0 line (None: an old run)
    data: str | None = None             # the task's data hash (tasks.Task.data_hash), saved in ckpt.pt
    prior_source: dict | None = None    # where the prior came from (`Prior.source`): ckpt.pt, result.json
    prior_file: bytes | None = None     # a new run's prior.pt (`runfiles.Prior.to_bytes`), written by `begin`
    prior_sha256: str | None = None     # its sha256, saved in ckpt.pt: a resume reads back the same file
    log_step: int = 0                   # the step of the last line in metrics.jsonl
    saved_step: int | None = None       # the step of the checkpoint on disk (None: none yet)
    last: dict | None = None            # the latest logged record
    eval_seconds: float | None = None   # how long the last log step's evaluation took (the ETA counts them)
    trained: torch.nn.Module | None = None      # what the steps run: the model, compiled and/or in DDP
    ema: torch.nn.Module | None = None          # the moving average of the weights (--ema): updated each step, saved

    def path(self, name: str) -> str:
        return os.path.join(self.config.out, name)


def run(flags: argparse.Namespace, explicit: set) -> int:
    """The `train` command: resolve the flags, then start or resume, train, finish."""
    config = runconfig.resolve(flags, explicit)
    runconfig.check(config, rules=False)        # its numbers, before the processes start (a resume restores the rest)
    dist, config = init_distributed(config)
    state = None
    try:
        if config.sample is not None:
            return sample(config, explicit)
        state = start_or_resume(config, explicit, dist)
        try:
            code = train_loop(state)
            return finish(state) if code is None else code
        finally:
            if state.folder is not None:
                state.folder.release()
            state.trained = None                # DDP's reducer must go before its process group
    except OSError as e:
        folder = state.folder if state is not None and state.folder is not None else runfiles.RunFolder(config.out)
        line = folder.failure(e, config.resume, state and state.step, state and state.saved_step)
        if line is None:
            raise
        raise UsageError(line) from None
    finally:
        if dist.world > 1:
            if sys.exc_info()[0] is None:
                torch.distributed.barrier()         # leave together: gloo aborts a rank whose peer is gone
            torch.distributed.destroy_process_group()


def start_or_resume(config, explicit: set, dist: Dist = Dist()) -> Run:
    """Check all the run reads (`prepare_run`), build it in memory, only then take the run folder and write (`begin`): a
    refusal writes and deletes nothing; a new run failing after `begin` removes only what it wrote (`abandon`)."""
    config, folder, ckpt, task, device, teacher = prepare_run(config, explicit, dist)
    error = None
    try:
        if not dist.main:               # the flags rank 0 restored, then this rank's own copies
            ckpt = read_checkpoint(os.path.join(config.out, "ckpt.pt"), "--resume") if config.resume else None
            task, device = runconfig.task_for(config), runconfig.pick_device(config.device)
        task.setup(device)              # its data read (and checked): nothing is written yet
        built = build(config, device, explicit, task, init=ckpt is None, teacher=teacher)
        state = (new_run(built, task, device, folder, dist) if ckpt is None
                 else restored_run(built, task, device, folder, dist, ckpt))
        state.trained = torch.compile(state.model) if state.config.compile else state.model
        if dist.world > 1:
            state.trained = torch.nn.parallel.DistributedDataParallel(
                state.trained, device_ids=[dist.local_rank] if device.type == "cuda" else None)
        if dist.main:
            begin(state, ckpt)
    except BaseException as e:
        error = dist.failed(e, folder)
    dist.agree(error)
    return state


def prepare_run(config, explicit: set, dist: Dist = Dist()) -> tuple:
    """Everything a run reads, checked before anything is written: its flags and where they apply, a resumed run's
    folder and checkpoint, a teacher's files. Under torchrun rank 0 alone reads them and shares the (restored) flags, or
    its error. Returns (config, folder, ckpt, task, device, teacher), the last five None on the other ranks."""
    folder = ckpt = task = device = teacher = error = None
    try:
        if dist.main:
            folder = runfiles.RunFolder(config.out)
            if config.resume:
                folder.open_existing()
                ckpt = read_checkpoint(folder.file("ckpt.pt"), "--resume")
                config = restore_config(config, explicit, folder, ckpt)
            else:
                folder.check_free()
            task = runconfig.check(config, explicit)
            respelt = {k: v for k, v in task.normal_options().items() if getattr(config, k) != v}
            if respelt and ckpt is None:            # one target, one spelling: what the run stores
                runconfig.say("stored as " + ", ".join(f"{runconfig.flag(k)} {v}" for k, v in respelt.items())
                              + " (the one spelling of this target)")
                config, task = replace(config, **respelt), runconfig.task_for(replace(config, **respelt))
            teacher = read_teacher(config, task) if config.prior_from is not None and ckpt is None else None
            device = runconfig.pick_device(config.device)
    except BaseException as e:
        error = dist.failed(e, folder)
    dist.agree(error)
    shared = dist.share(asdict(config) if dist.main else None)
    return (config if dist.main else runconfig.Config(**shared)), folder, ckpt, task, device, teacher


def size_schedule(config: runconfig.Config, explicit: set, task) -> runconfig.Config:
    """The config with what the task sizes: --steps from --epochs (unless --steps was given, or kept on resume while
    --epochs is given now), --warmup from --warmup-epochs, unset log and checkpoint intervals (a tenth of the run)."""
    sized = {}
    if config.warmup_epochs is not None:
        sized["warmup"] = round(config.warmup_epochs * task.steps_per_epoch(config.batch_size))
    if config.steps is None or ("epochs" in explicit and "steps" not in explicit):
        sized["steps"] = max(1, round(config.epochs * task.steps_per_epoch(config.batch_size)))
    log_every = config.log_every or max(1, sized.get("steps", config.steps) // 10)
    return replace(config, **sized, log_every=log_every, ckpt_every=config.ckpt_every or log_every)


# What `build` returns; the init's report and prior are None where the init was not applied (a resume).
Built = collections.namedtuple("Built", "config task model model_cfg optimizer init_report prior")


def build(config: runconfig.Config, device: torch.device | None = None, explicit: set = frozenset(),
          task: tasks.Task | None = None, init: bool = True, teacher: Teacher | None = None) -> Built:
    """Everything a run trains: the task (`task`: set up already, else made here), the schedule sized, the model built
    and with `init` initialised (`teacher`: --prior-from's files, read), the optimiser; for runs, tests, benchmarks."""
    device = device or runconfig.pick_device(config.device)
    if task is None:
        task = runconfig.task_for(config)
        task.setup(device)
    config = size_schedule(config, explicit, task)
    model, model_cfg = build_model(config, task, device)
    report = prior = None
    if init:
        t0 = time.time()
        # the prior of the task's --pattern, or --prior-from's (`teacher`: read by `read_teacher`)
        prior = (task.prior(config.pattern, config.mask_on, config.mask_off) if config.prior_from is None
                 else teacher_prior(config, task, device, teacher or read_teacher(config, task)))
        try:
            report = apply_init(model, prior, config)
        except ValueError as e:     # a pattern that does not fit the model: nothing is written
            raise UsageError(f"--init {config.init}: {e}") from None
        report["seconds"] = round(time.time() - t0, 3)
        model.to(device)
    return Built(config, task, model, model_cfg, make_optimizer(model, config), report, prior)


def new_run(built: Built, task, device, folder: runfiles.RunFolder | None, dist: Dist) -> Run:
    """A new run from its build, in memory: the start checked and measured (rank 0), the prior serialised."""
    config, model, prior = built.config, built.model, built.prior
    pattern, inputs = prior.pattern.to(device), task.probe_inputs(config.probe_size)
    check_start(model, task, config, device)
    probe = Probe(task, pattern, inputs, mp.prior_snapshot(model), config.eval_points, lambda: autocast(device, config))
    prior_file = prior.to_bytes()          # kept beside the run, read back on resume and by reports
    state = Run(config, task, model, built.model_cfg, built.optimizer, probe, device, built.init_report, None, folder,
                dist, run_id=uuid.uuid4().hex, data=task.data_hash(), prior_source=prior.source, prior_file=prior_file,
                prior_sha256=hashlib.sha256(prior_file).hexdigest(),
                ema=copy.deepcopy(model).requires_grad_(False) if config.ema else None)
    if dist.main:
        began = time.time()
        state.last = {"step": 0, "loss": None, "run_id": state.run_id, **probe.measure(model)}
        state.mass_start, state.eval_seconds = state.last["prior_mass"], time.time() - began
    return state


def restored_run(built: Built, task, device, folder: runfiles.RunFolder | None, dist: Dist, ckpt: dict) -> Run:
    """The run a checkpoint holds, on the build of its own config, in memory: its steps, architecture, data, moving
    average and prior file checked, then the weights, optimiser, probe snapshot and RNG restored."""
    config, model, model_cfg = built.config, built.model, built.model_cfg
    if config.steps < ckpt["step"]:
        raise UsageError(f"--resume: the checkpoint in {config.out} is at step {ckpt['step']}, "
                         f"past --steps {config.steps}; give --steps {ckpt['step']} or more")
    check_architecture(ckpt, model_cfg, "--resume", config.out)
    if config.ema and "ema" not in ckpt:
        raise UsageError(f"--resume: the checkpoint in {config.out} holds no moving average (--ema)")
    check_same_data(ckpt, task, config)
    prior = saved_prior(config, task, ckpt["prior_sha256"])
    pattern, prior_source = prior.pattern.to(device), prior.source
    model.load_state_dict(ckpt["model"])     # read_checkpoint checked that it fits
    try:
        built.optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UsageError(f"--resume: the optimiser state in {config.out}/ckpt.pt does not fit "
                         f"this run's parameters ({type(e).__name__}: {str(e)[:120]})") from None
    probe = Probe(task, pattern, task.probe_inputs(config.probe_size), ckpt["snapshot"], config.eval_points,
                  lambda: autocast(device, config))
    state = Run(config, task, model, model_cfg, built.optimizer, probe, device, ckpt["init_report"],
                ckpt["prior_mass_start"], folder, dist, step=ckpt["step"], seconds=ckpt["seconds"],
                run_id=ckpt["identity"]["run_id"], log_step=ckpt["log_step"], saved_step=ckpt["step"],
                data=ckpt["data"], prior_source=prior_source, prior_sha256=ckpt["prior_sha256"])
    if config.ema:
        state.ema = copy.deepcopy(model).requires_grad_(False)
        state.ema.load_state_dict(ckpt["ema"])     # read_checkpoint checked that it fits
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return state


def check_start(model, task, config, device) -> None:
    """A new run's weights and first-batch loss (`first_loss`) must be finite, or nothing is written."""
    if not finite_weights(model):
        raise UsageError(f"--init {config.init} gave non-finite weights with these flags; nothing was written")
    loss = first_loss(model, task, config, device)
    if not torch.isfinite(loss):
        raise UsageError(f"the initial model gives a {float(loss)} loss with these flags (--init "
                         f"{config.init}); nothing was written")


def first_loss(model, task, config, device) -> torch.Tensor:
    """The model's loss on the first training batch in an eval-mode forward (no random state is used)."""
    model.eval()
    with torch.no_grad(), autocast(device, config):
        loss = task.loss(model, task.train_batch(0, config.batch_size))
    model.train()
    return loss


def train_loop(state: Run) -> int | None:
    """Train from state.step to config.steps, logging and checkpointing: None at the end, else the exit status. Every
    rank decides alike (the loss and the interrupt flag are agreed each step)."""
    config, model, optimizer, task, dist = state.config, state.model, state.optimizer, state.task, state.dist
    total, t_start, steps_done, estimated, t_eval = config.steps, time.time(), 0, False, 0.0
    with Interrupt() as stop:
        while state.step < total:
            batch, weight = dist.shard(task.train_batch(state.step, config.batch_size))
            loss = step_loss(state.trained, task, batch, config, state.device, weight)
            loss_value, interrupted = dist.step_state(loss.detach(), stop.hit)
            if not math.isfinite(loss_value):
                return non_finite(state, f"the loss became {loss_value} at step {state.step}")
            step_update(model, optimizer, loss, config, state.step, state.ema)
            state.step += 1
            steps_done += 1
            step = state.step
            if dist.main and (step % config.log_every == 0 or step == total):
                began = time.time()
                rec = state.probe.measure(model, state.ema, final=step == total)
                now = time.time()
                state.eval_seconds, t_eval = now - began, t_eval + now - began
                rate = steps_done / max(now - t_start - t_eval, 1e-9)
                state.last = {"step": step, "prev": state.log_step, "loss": loss_value,
                              "lr": optimizer.param_groups[0]["lr"],
                              "seconds": round(state.seconds + now - t_start, 2), **rec}
                state.folder.append("metrics.jsonl", runfiles.log_bytes(state.last))
                state.log_step = step
                print(f"step {step:>6}/{total} | train_loss {loss_value:.4f} | {state.probe.line(rec)} | "
                      f"{rate:.1f} steps/s | ETA {fmt_time(eta(state, step, rate))}", flush=True)
                estimated = True
            elif dist.main and not estimated and time.time() - t_start >= EARLY_ETA:
                rate = steps_done / (time.time() - t_start - t_eval)
                print(f"step {step:>6}/{total} | train_loss {loss_value:.4f} | {rate:.2f} steps/s | ETA "
                      f"{fmt_time(eta(state, step, rate))} (an early estimate; the first evaluation is at step "
                      f"{min(total, (step // config.log_every + 1) * config.log_every)})", flush=True)
                estimated = True
            halt = interrupted or (config.halt_after is not None and step >= config.halt_after and step < total)
            if step % config.ckpt_every == 0 or step == total or halt:
                if not finite_weights(model):
                    return non_finite(state, f"the parameters became non-finite at step {step}")
                if dist.main:
                    save_checkpoint(state, state.seconds + time.time() - t_start)
            if halt:
                why = "interrupted" if interrupted else f"halted at --halt-after {config.halt_after}"
                runconfig.say(f"{why}: checkpoint at step {step} in {state.path('ckpt.pt')}; continue with "
                              f"--resume --out {config.out}")
                return stop.code if interrupted else 0
    state.seconds += time.time() - t_start
    return None


EARLY_ETA = 10.0        # seconds of training after which a run that has not logged yet prints its pace and ETA


def eta(state: Run, step: int, rate: float) -> float:
    """Seconds left: the steps at `rate` (training alone), each log step's evaluation as long as the last one timed
    (`eval_seconds`; a resumed run's is timed at its first log step) and the final one over the whole test set."""
    config, each = state.config, state.eval_seconds or 0.0
    if step >= config.steps:
        return 0.0                      # the final evaluation is the last log step's: done
    logs = max(0, (config.steps - 1) // config.log_every - step // config.log_every)
    return (config.steps - step) / rate + each * (logs + state.task.final_cost(config.eval_points))


def step_loss(trained, task, batch, config, device, weight: float | None = None) -> torch.Tensor:
    """A step's first half: the task's loss through `trained` (compiled, DDP) under --amp, times `weight`."""
    with autocast(device, config):
        loss = task.loss(trained, batch)
        return loss if weight is None else loss * weight


def step_update(model, optimizer, loss: torch.Tensor, config, step: int,
                ema: torch.nn.Module | None = None) -> None:
    """The second half, once the loss is finite: the step's learning rate, backward, --grad-clip, update, --ema."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, config.steps, config)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    if ema is not None:
        update_ema(ema, model, config.ema)


def train_step(model, trained, optimizer, task, batch, config, device, step: int,
               ema: torch.nn.Module | None = None) -> torch.Tensor:
    """One training step as `train_loop` takes it (one process; what benchmarks time): returns the loss."""
    loss = step_loss(trained, task, batch, config, device)
    step_update(model, optimizer, loss, config, step, ema)
    return loss


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * model, parameter by parameter; buffers copied."""
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p.detach(), 1.0 - decay)
    for e, b in zip(ema.buffers(), model.buffers()):
        e.copy_(b)


def finish(state: Run) -> int:
    """The final measurement (the whole test set) and result.json, by rank 0."""
    if not state.dist.main:
        return 0
    config, last = state.config, state.last
    if last is None or last["step"] != state.step:
        last = {"step": state.step, **state.probe.measure(state.model, state.ema, final=True)}
    start = state.mass_start            # None: the pattern constrains no row (no mass to measure)
    metrics = {**last["metrics"], "prior_mass_start": start and sum(start) / len(start),
               "prior_mass_end": start and last["prior_mass_mean"]}
    preset = runconfig.resolve(*parse_args(["--task", config.task, "--preset", config.preset]))
    result = {"task": config.task, "kind": state.task.KIND, "init": config.init, "seed": config.seed,
              "preset": config.preset, "run_id": state.run_id, "data": state.data,
              "init_order": list(runconfig.INITS).index(config.init), "token_labels": state.task.token_labels(),
              "tells_apart": {k: v for k, v in asdict(config).items() if k not in runconfig.NOT_TELLING_APART},
              # model and data as the preset's (reports mark it)
              "at_preset": all(getattr(config, k) == getattr(preset, k) for k in runconfig.ARCH - {"init"}),
              "steps": state.step, "seconds": round(state.seconds, 2), "metrics": metrics,
              "prior_mass_start_layers": state.mass_start, "prior_mass_end_layers": last["prior_mass"],
              **{k: last[k] for k in ("qk_drift", "mask_drift") if k in last},
              **({"prior_mass_note": state.probe.no_mass} if state.probe.no_mass else {}),
              "init_report": state.init_report, "prior_source": state.prior_source, "config": asdict(state.model_cfg),
              "device": str(state.device), "torch": torch.__version__,
              "params": sum(p.numel() for p in state.model.parameters())}
    state.folder.write("result.json", json_text(result))
    print(f"done: {state.probe.line(last)} | training {fmt_time(state.seconds)}, {time.time() - STARTED:.1f} s "
          f"wall since the command started | {state.path('result.json')}", flush=True)
    return 0


def sample(config, explicit: set) -> int:
    """--sample PROMPT: load the language model in --out and print PROMPT and its continuation."""
    if "out" not in explicit:
        raise UsageError("--sample needs --out RUN_DIR, the run whose checkpoint to sample from")
    folder = runfiles.RunFolder(config.out)
    if not os.path.exists(folder.file("ckpt.pt")):
        raise UsageError(f"--sample: no checkpoint {folder.file('ckpt.pt')}; train the run first (or check --out)")
    ckpt = read_checkpoint(folder.file("ckpt.pt"), "--sample")
    config = restore_config(config, explicit, folder, ckpt)
    task = runconfig.check(config, explicit)
    if task.KIND != "lm":
        raise UsageError(f"--sample needs a language-model run (wikitext2, tinystories); {config.out} is {config.task}")
    device = runconfig.pick_device(config.device)
    task.setup(device)
    model, model_cfg = build_model(config, task, device)
    check_architecture(ckpt, model_cfg, "--sample", config.out)
    model.load_state_dict(ckpt["model"])     # read_checkpoint checked that it fits
    print(task.continue_text(model.eval(), config.sample, config.sample_tokens, config.temperature, config.top_k,
                             torch.Generator(device=device).manual_seed(config.seed)))
    return 0


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# ----------------------------------------------------------------------------------------
# Durability: a run's files are written whole (runfiles.RunFolder), all it reads back is checked before use (a schema),
# and a run that stops, however it stops, resumes exactly: what a run writes when it begins, what a checkpoint holds,
# what a resume checks, how a run stops (a signal, a non-finite step).


def begin(state: Run, ckpt: dict | None) -> None:
    """Rank 0, once everything is checked and built: a new run takes its folder (`RunFolder.create`) and writes
    args.json, prior.pt, the log's first line and last ckpt.pt (which makes the folder a run); a resumed run cuts
    its log back to the checkpoint's step and rewrites args.json. Each then says what it runs."""
    config, folder = state.config, state.folder
    if ckpt is not None:
        runfiles.truncate_log(folder, state.step)
        folder.write("args.json", json_text(asdict(config)))
        note = rounding_note(ckpt, state.device, config) or ""
        return runconfig.say(f"resuming {config.out} at step {state.step}/{config.steps}" + (note and f"\n{note}"))
    folder.create()
    folder.write("args.json", json_text(asdict(config)))
    folder.write("prior.pt", state.prior_file)
    folder.write("metrics.jsonl", json.dumps(state.last) + "\n")
    save_checkpoint(state)              # last: a folder with a checkpoint is a run
    pm, procs = state.init_report.get("pseudo_mass"), f" x {state.dist.world} processes" if state.dist.world > 1 else ""
    init = f"{config.init} (pseudo-input mass {sum(pm) / len(pm):.3f}) " if pm else f"{config.init} "
    print(f"{config.task} | init {init}| {sum(p.numel() for p in state.model.parameters()):,} "
          f"params | {state.device}{procs} | {config.steps} steps | out {config.out}", flush=True)
    if evidence := runfiles.prior_evidence(state.prior_source):
        print(f"prior {evidence}", flush=True)
    if config.preset == "paper" and state.device.type == "cpu":
        print("note: --preset paper is the paper's setting, sized for a GPU; on this CPU it may "
              f"take hours (an estimate follows within {EARLY_ETA:.0f} s of training)", flush=True)
    print(f"step {0:>6}/{config.steps} | {state.probe.line(state.last)}", flush=True)


def json_text(obj) -> str:
    return json.dumps(obj, indent=2) + "\n"


def save_checkpoint(state: Run, seconds: float | None = None) -> None:
    """ckpt.pt: all `--resume` needs to continue exactly (the RNG states too), serialised and stored with their sha256
    (`runfiles.checkpoint_bytes`), which `read_checkpoint` verifies."""
    ckpt = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(), "step": state.step,
            "seconds": state.seconds if seconds is None else seconds, "config": asdict(state.config),
            "model_config": asdict(state.model_cfg), "init_report": state.init_report, "snapshot": state.probe.snapshot,
            "prior_mass_start": state.mass_start, **({"ema": state.ema.state_dict()} if state.ema is not None else {}),
            "identity": {"run_id": state.run_id, "seed": state.config.seed,
                         "config_hash": config_hash(asdict(state.config))},
            "log_step": state.log_step, "data": state.data, "machine": float_order(state.device),
            "prior_source": state.prior_source, "prior_sha256": state.prior_sha256,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    state.folder.write("ckpt.pt", runfiles.checkpoint_bytes(ckpt))      # a full disk: an OSError (ENOSPC)
    state.saved_step = state.step


def config_hash(flags: dict) -> str:
    """A short hash of the flags a resume may not change (all but runconfig.RESUMABLE): one run's configuration."""
    fixed = {k: v for k, v in flags.items() if k not in runconfig.RESUMABLE and k != "out"}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def show(run_dir: str, out: str) -> int:
    """`train.py show RUN`: M at the start and end -> m.png, the mean attention on the task's probe inputs at the
    end -> attention.png, a finished run's learning curves -> curves.png, each path printed (the model rebuilt on
    the CPU and checked as --resume checks it first). Without M: its attention alone; without the task's data: M
    alone, and says so."""
    if reporting.show.pyplot() is None:
        raise UsageError("show: drawing needs matplotlib: pip install matplotlib")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"show: --out {out} is a file, not a folder")
    path = os.path.join(run_dir, "ckpt.pt")
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(run_dir, "config.json")):
            return show_saved(run_dir, out)
        raise UsageError(f"show: no checkpoint {path}; give a run folder (train.py --out) that has trained, or a "
                         "model saved with save_pretrained after retrofit.add_mask_prior")
    ckpt = read_checkpoint(path, "show")
    config = replace(runconfig.saved_config(ckpt["config"], f"show: {path}"), device="cpu")
    task, model, absent = runconfig.task_for(config), None, None
    data = reporting.report.data_set({"kind": task.KIND, "data": ckpt["data"]})
    named = {config.task: data} if data else None               # the data set a figure must name
    title = (f"{reporting.report.data_title(config.task, named)}: init {config.init}, seed {config.seed}, "
             f"step {ckpt['step']}")
    try:
        task.setup(torch.device("cpu"))
    except tasks.DataError as e:
        absent = e
    if absent is None:
        model, model_cfg = build_model(config, task, torch.device("cpu"))
        check_architecture(ckpt, model_cfg, "show", run_dir)
        model.load_state_dict(ckpt["model"])
    runfiles.output_folder(out, "show", (".png",))
    start, end = reporting.show.m_of_checkpoint(ckpt)
    mc = ckpt["model_config"]
    grid = (mc["image_size"] // mc["patch_size"], int(mc["pool"] == "cls")) if "image_size" in mc else None
    if end:
        print(reporting.show.draw_m(start, end, os.path.join(out, "m.png"), title,
                       mc.get("causal", False), grid, task.token_labels()))
    else:
        print(f"show: {run_dir} has no M (--init {config.init}); its attention alone")
    finished = reporting.report.collect_runs([run_dir])[0]
    if finished:                                    # a finished run: its learning curves beside M
        rows = reporting.report.curve_rows(reporting.report.config_groups(finished)[0])
        print(*reporting.report.draw_curves(rows, os.path.join(out, "curves.png"), named), sep="\n")
    if model is None:
        print(f"show: attention.png not drawn: the run's data is not there ({absent})")
        return 0
    inputs = task.probe_inputs(config.probe_size)
    print(reporting.show.draw_attention(mp.mean_attention(model.eval(), inputs),
                           os.path.join(out, "attention.png"), title, task.token_labels(), grid))
    return 0


def json_numbers(obj):
    """Every number (not a bool) in JSON read back (its depth bounded by the reader)."""
    if isinstance(obj, dict | list):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from json_numbers(v)
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield obj


# the largest number a saved model's config.json may hold for `show` (a size, a count): larger builds no model here
SAVED_CONFIG_MOST = 1 << 24


def show_saved(folder: str, out: str) -> int:
    """`train.py show DIR` of a Hugging Face model saved with save_pretrained after `retrofit.add_mask_prior`: its M at
    the end (the start is not saved) -> m.png. Read as someone else's folder: config.json through the one reader
    (bounded depth and digits), no number in it past SAVED_CONFIG_MOST, weights from safetensors alone (never a pickle),
    any error of transformers' loader one line."""
    config = runfiles.read_json(os.path.join(folder, "config.json"))
    numbers = list(json_numbers(config))
    if not isinstance(config, dict) or any(not math.isfinite(v) or abs(v) > SAVED_CONFIG_MOST for v in numbers):
        raise UsageError(f"show: {folder}/config.json is not a saved model's config (an object whose sizes are "
                         f"at most {SAVED_CONFIG_MOST:,})")
    if not any(name.endswith(".safetensors") for name in os.listdir(folder)):
        raise UsageError(f"show: {folder} holds no .safetensors weights; show reads only those (a pickle is not "
                         "read): save the model with save_pretrained(..., safe_serialization=True)")
    try:
        import transformers
    except ImportError:
        raise UsageError(f"show: {folder} is a saved Hugging Face model; reading it needs "
                         "transformers: pip install transformers") from None
    log, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()              # its progress bars and load reports: not ours to print
    transformers.logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model = retrofit.from_pretrained(transformers.AutoModel, folder, use_safetensors=True)
    except Exception as e:              # the loader's own errors, whatever they are, at its boundary: one line
        raise UsageError(f"show: {folder} does not load as a saved model ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else 'no message'})") from None
    finally:
        transformers.logging.set_verbosity(log)
        if bars:
            transformers.logging.enable_progress_bar()
    runfiles.output_folder(out, "show", (".png",))
    print(reporting.show.draw_model(model, os.path.join(out, "m.png"),
                       f"{os.path.basename(os.path.abspath(folder))} ({type(model).__name__}, saved)"))
    print("show: attention.png not drawn: a saved model holds no inputs to probe")
    return 0


def read_checkpoint(path: str, flag: str) -> dict:
    """A checkpoint read as someone else's file (`runfiles.read_checkpoint`: its schema, itself, its model), its flags
    (`saved_config`) matching their hash, before any value is used; else one line."""
    try:
        ckpt = runfiles.read_checkpoint(path)
    except runfiles.ReadError as e:
        raise UsageError(f"{flag}: {e}") from None
    config = runconfig.saved_config(ckpt["config"], f"{flag}: {path}")
    if ckpt["identity"].get("config_hash") != config_hash(asdict(config)):
        raise UsageError(f"{flag}: {path} records flags that do not match its own config hash; the checkpoint was "
                         "altered")
    return ckpt


def restore_config(config: runconfig.Config, explicit: set, folder: runfiles.RunFolder, ckpt: dict) -> runconfig.Config:
    """Resume: the run's config from its saved flags (`resumed_flags`) but its folder (the --out given: a run folder
    can move) and the resumable flags given now; any other flag given must agree."""
    saved = resumed_flags(folder, ckpt)
    for key in sorted(explicit - runconfig.RESUMABLE - {"out"}):
        new = getattr(config, key)
        if key in saved and saved[key] != new:
            what = "architecture" if key in runconfig.ARCH else "setting"
            raise UsageError(f"--resume: the run in {config.out} has {key}={saved[key]!r} but {key}={new!r} was "
                             f"given; a resumed run cannot change its {what} (start a new run with another --out)")
    kept = {k: v for k, v in saved.items() if k != "out" and (k not in explicit or k not in runconfig.RESUMABLE)}
    return runconfig.Config(**{**asdict(config), **kept, "resume": True,         # --halt-after: this invocation's alone
                               "halt_after": config.halt_after if "halt_after" in explicit else None})


def resumed_flags(folder: runfiles.RunFolder, ckpt: dict) -> dict:
    """The run's flags from args.json once the three files are one run at one step: metrics.jsonl starts at step 0,
    reaches the checkpoint's last log step and names its run; args.json holds valid flags (`saved_config`) equal to
    the checkpoint's where a resume may not change them. Anything else is one line."""
    path, log, flags = folder.file("args.json"), folder.file("metrics.jsonl"), ckpt["config"]
    if not os.path.isfile(log):
        what = "is not a file" if os.path.exists(log) else "is missing"
        raise UsageError(f"--resume: {log} {what}, so the run's log cannot be continued; start a "
                         "new run with another --out")
    try:
        records, logged = runfiles.read_log(log), ckpt["log_step"]
    except runfiles.LogError as e:
        raise UsageError(f"--resume: {e}, so the run cannot be continued whole; restore the log "
                         "from a copy, or start a new run with another --out") from None
    ident = ckpt["identity"]
    if records and records[0]["step"] == 0 and records[0].get("run_id") != ident["run_id"]:
        raise UsageError(f"--resume: {folder.file('ckpt.pt')} is the checkpoint of another run (run "
                         f"{ident['run_id']}, seed {ident['seed']}; this folder's log is of run "
                         f"{records[0].get('run_id')}); put back this run's ckpt.pt, or start a new run")
    if not records or records[0]["step"] != 0 or records[-1]["step"] < logged:
        held = "no records" if not records else f"steps {records[0]['step']} .. {records[-1]['step']}"
        raise UsageError(f"--resume: {log} holds {held}, but the checkpoint (step {ckpt['step']}) "
                         f"was saved after logging steps 0 .. {logged}: the log lost lines, so "
                         "the run cannot be continued whole; start a new run with another --out")
    try:
        saved = asdict(runconfig.saved_config(runfiles.read_json(path), f"--resume: {path}"))
    except runfiles.ReadError as e:
        raise UsageError(f"--resume: {e}; the run's flags are lost") from None
    for key in (k for k in runconfig.FIELDS if k not in runconfig.RESUMABLE and k != "out" and saved[k] != flags[k]):
        raise UsageError(f"--resume: {path} has {key}={saved[key]!r} but the checkpoint was "
                         f"trained with {key}={flags[key]!r}; args.json does not belong to this "
                         "checkpoint (restore it, or start a new run with another --out)")
    return saved


def check_architecture(ckpt: dict, model_cfg, flag: str, out: str) -> None:
    """The model a checkpoint holds is the model this config builds (but for its attention path, which may change)."""
    if ({k: v for k, v in ckpt["model_config"].items() if k != "fused"}
            != {k: v for k, v in asdict(model_cfg).items() if k != "fused"}):
        raise UsageError(f"{flag}: the checkpoint in {out} holds a different architecture "
                         f"({ckpt['model_config']} vs {asdict(model_cfg)})")


def check_same_data(ckpt: dict, task, config) -> None:
    """--resume on the data the run trained on: the task's data hash is the checkpoint's (None: no data files)."""
    saved, now, was = ckpt["data"], task.data_hash(), ckpt["config"].get("data_dir")
    if saved is not None and now != saved:
        raise UsageError(f"--resume: the data{f' in --data-dir {config.data_dir}' if config.data_dir else ''} is "
                         f"not the data the run in {config.out} trained on (data hash {now[:12]}, the checkpoint's "
                         f"{saved[:12]}); point --data-dir at the run's own data"
                         + (f" (it started from {was})" if was else ""))


def saved_prior(config, task, sha256: str) -> runfiles.Prior:
    """A resumed run's prior: its prior.pt through the one reader (`runfiles.read_prior`), the bytes ckpt.pt names."""
    path = os.path.join(config.out, "prior.pt")
    try:
        data = runfiles.read_back(path, "prior")
        if hashlib.sha256(data).hexdigest() != sha256:
            raise UsageError(f"--resume: {path} has changed since the run started (its sha256 is "
                             "not the one in the checkpoint); restore the run's own prior.pt")
        return runfiles.read_prior(path, task.pattern(task.DEFAULT_PATTERN).shape[-1], data)
    except runfiles.ReadError as e:
        raise UsageError(f"--resume: {e}: the run keeps the prior it started from there; restore the file") from None


# resumable flags that change how a step's floats round, not what the run is: what each value does on a device type
NUMERICS = {"amp": amp_on, "compile": lambda value, device_type: value}


def rounding_note(ckpt: dict, device: torch.device, config) -> str | None:
    """A note that a resume on another device, thread count, --amp or --compile (NUMERICS) is exact to rounding."""
    saved, now, was = ckpt["machine"], float_order(device), ckpt["config"]
    changed = [f"--{k} {was.get(k)}, now {getattr(config, k)}" for k, acts in NUMERICS.items()
               if acts(was.get(k), saved["device"]) != acts(getattr(config, k), device.type)]
    if saved == now and not changed:
        return None
    same = saved["device"] == now["device"]
    what = [] if saved == now else [f"{saved['threads']} CPU threads, now {now['threads']}" if same
                                    else f"on {saved['device']}, now on {now['device']}"]
    return (f"note: the run trained with {'; '.join(what + changed)}: its sums round in another order, so the resumed "
            "run matches an uninterrupted one to about 1e-6, not bitwise"
            + (f"; with OMP_NUM_THREADS={saved['threads']} it resumes bitwise" if what and same and not changed
               else ""))


def float_order(device: torch.device) -> dict:
    """What decides the order of a step's float sums: the device type and, on the CPU, torch's thread count."""
    return {"device": device.type, "threads": torch.get_num_threads() if device.type == "cpu" else None}


def finite_weights(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def non_finite(state: Run, what: str) -> int:
    if state.dist.main:
        print(f"error: {what}; stopped. The last good checkpoint is kept in {state.path('ckpt.pt')}; try a lower "
              "--lr or --grad-clip (both may change on --resume)", file=sys.stderr, flush=True)
    return 1


class Interrupt:
    """Turn the first Ctrl-C (SIGINT) or SIGTERM (a scheduler's or reproduce.sh's stop) into a flag checked between
    steps (`hit`): the run saves a checkpoint and exits 130 (SIGINT) or 143 (SIGTERM). A second signal aborts."""
    SIGNALS = {signal.SIGINT: ("interrupt", 130), signal.SIGTERM: ("terminated", 143)}

    def __enter__(self):
        self.hit, self.code, self.old = False, 130, {}

        def handler(signum, frame):
            if self.hit:
                raise KeyboardInterrupt
            what, self.code = self.SIGNALS[signum]
            self.hit = True
            print(f"\n{what}: finishing this step and saving a checkpoint (a second signal aborts)", flush=True)
        with contextlib.suppress(ValueError):           # not in the main thread: no handler
            for sig in self.SIGNALS:
                self.old[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)


# ----------------------------------------------------------------------------------------
# Commands: train (the default); summarize and report (reporting/report.py); download and
# imagenet100, make-digits and make-wikitext (datafetch/: the data writers)


# each command's work, in its room (the flags parse_args gave it -> an exit status)
COMMANDS = {
    "summarize": lambda f, _: reporting.report.summarize_command(f.paths),
    "report": lambda f, _: reporting.report.report_command(f.runs, f.out),
    "redraw": lambda f, _: reporting.report.redraw_command(f.results),
    "download": lambda f, _: datafetch.download.download(f.names, f.data, f.mirror, timeout=f.timeout),
    "imagenet100": lambda f, _: print(datafetch.imagenet100.build(f.source, f.data)) or 0,
    "show": lambda f, _: show(f.run, f.out or f.run),
    "make-digits": lambda f, _: print(datafetch.write.make_digits(f.folder)) or 0,
    "make-wikitext": lambda f, _: print(datafetch.write.make_wikitext(f.folder, f.files)) or 0,
}


def main(argv=None) -> int:
    try:
        flags, explicit = parse_args(argv)
        return COMMANDS.get(flags.command, run)(flags, explicit)
    except UsageError as e:
        if os.environ.get("RANK", "0") == "0":              # under torchrun, rank 0 speaks for all
            print(f"error: {runfiles.one_line(e)}", file=sys.stderr)
        return _after_rank_0(getattr(e, "status", 2))
    except QuietExit:
        return _after_rank_0(2)


def _after_rank_0(status: int, wait: float = 10.0) -> int:
    """`status`, returned by a rank other than 0 only after `wait` seconds: torchrun stops every process when the first
    one ends, so rank 0, which says the one line, must end first."""
    if os.environ.get("RANK", "0") != "0":
        time.sleep(wait)
    return status


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:      # a torchrun rank whose work is saved and group destroyed:
        sys.stdout.flush()                              # skip the C++ teardown, where gloo's threads now and then
        sys.stderr.flush()                              # abort a rank after its peer left ("terminate called
        os._exit(code or 0)                             # without an active exception", after result.json)
    sys.exit(code)
