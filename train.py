"""Train any task with any initialisation and write a run directory.

    python train.py --task parity2 --init mask
    python train.py --task cyclic3 --init qk-svd --preset paper --seed 1
    python train.py --task kparity --bits 0,4,7 --unseen 0,4 --init mask
    python train.py --task addition --init mask --seed 2
    python train.py --task cifar10 --data-dir data/ --init impulse
    python train.py summarize runs/          # a markdown table of finished runs
    python train.py report runs/quick results/quick   # results/*.md tables, learning and persistence curves
    python train.py make-digits data/digits  # a small real image set in CIFAR-10 format (needs scikit-learn)
    python train.py make-wikitext data/text FILE...   # any English text in WikiText-2's layout

A run directory (default runs/TASK-INIT-sSEED) holds args.json, metrics.jsonl (one line
per log step: loss, metrics, per-layer attention mass on the prior pattern, drift of M
and Wq Wk^T), result.json (final, written atomically) and ckpt.pt (model, optimiser,
step, RNG states): `--resume` continues it exactly. Bad input: one line, exit status 2.

Reading order: config (flags, presets) -> build (task, model, INITS, optimiser) -> loop
(start or resume, train, finish) -> checkpoint and files -> reporting -> commands.
"""
from __future__ import annotations

import time

STARTED = time.time()       # the process's start, for the wall time the final line prints

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import errno  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from dataclasses import asdict, dataclass, field, fields, replace  # noqa: E402

import torch  # noqa: E402

import maskprior as mp  # noqa: E402
import tasks as T  # noqa: E402

# ----------------------------------------------------------------------------------------
# Config: one frozen dataclass holds every setting of a run. Each field carries its flag: the
# help, a range check, whether --resume may change it, whether it is architecture, its argparse
# group (a task family's group holds that family's task options), whether it tells runs apart
# in reports, and its alternative (--steps / --epochs). argparse is generated from the fields;
# `resolve` fills a Config once: the flag given, else the task's preset
# (`T.TASKS[task].preset(name)`: the family's entries, then the task's own), else the field's
# default. Nothing changes a Config after that: what a task sizes (steps from epochs, warm-up
# from warm-up epochs, the log and checkpoint intervals) `size_schedule` fills into a new one
# before anything is built, and a resume builds its own from the run's files. args.json is
# `asdict(config)`.

GROUPS = {"run": "run", "optimisation": "optimisation", "model": "model", "prior": "prior",
          "boolean": "Boolean tasks (parity2, majority3, cyclic3, kparity, kmajority)",
          "arithmetic": "arithmetic (addition, multiplication)", "vision": "vision (cifar10, cifar100, imagenet100)",
          "lm": "language modelling (wikitext2, tinystories; --data-dir as above)",
          "sampling": "sampling from a trained language model"}
FAMILIES = ("boolean", "arithmetic", "vision", "lm")       # the groups of task options


def setting(default=None, help=None, *, group: str, type=None, switch=False, choices=None, metavar=None,
            check=None, resumable=False, arch=False, tells_apart=True, alternative=None, needs=None, excludes=()):
    """A Config field and its flag --NAME-WITH-DASHES. type: int or float (None: a string); switch: a flag
    without a value; check: "positive" (> 0), "non_negative" (>= 0) or "fraction" (in [0, 1)); resumable:
    --resume may change it; arch: it shapes the model or the data (named so when a resume disagrees);
    tells_apart: runs that differ in it are different configurations in reports; alternative: the field
    this one replaces when given (--steps drops the preset's --epochs and the other way round).
    Where the flag applies (`check_applies` refuses it given anywhere else): needs, {key: allowed}, each key a
    field (its resolved value) or "kind" (the task's family), allowed a tuple of values, GIVEN (not None) or
    ON (not zero); excludes, the fields that may not be given with it. A task option (a family's group)
    applies to the tasks whose constructor takes it."""
    return field(default=default, metadata=dict(help=help, group=group, type=type, switch=switch, choices=choices,
                                                metavar=metavar, check=check, resumable=resumable, arch=arch,
                                                tells_apart=tells_apart, alternative=alternative,
                                                needs=needs or {}, excludes=tuple(excludes)))


class Need(str):
    """A `needs` condition other than a list of values: GIVEN (the field is set) or ON (it is not zero)."""


GIVEN, ON = Need("given"), Need("on")
# The inits by what they read (the INITS table below holds them all; a test keeps the two in step).
MASK_INITS = ("mask", "mask-impulse")                  # the model owns an M (a learnable log sigmoid(M) per layer)
PRIOR_INITS = ("mask", "qk-svd", "qk-opt", "impulse", "mask-impulse")    # write a prior (a pattern or M) into the model
QK_SVD_INITS = ("qk-svd", "impulse")                   # solve Wq Wk in closed form (init_qk_svd_)
LEVELS = ("boolean", "arithmetic", "vision")           # families whose M has on / off levels (--mask-on, --mask-off)


@dataclass(frozen=True)
class Config:
    """Every setting of a training run, one field per flag (see `setting` for what a field carries)."""
    # run
    task: str = setting("parity2", "task name: {tasks} (default parity2)", group="run", arch=True)
    init: str = setting("default", "initialisation: {inits} (default default)",
                                   group="run", arch=True, tells_apart=False)
    preset: str = setting("small", "named hyper-parameters: small (2-core CPU; the default) or paper (the paper's "
                                   "setting, for a GPU)",
                                   group="run")
    seed: int = setting(0, "seed for data, init and order, 0 .. 2^32 - 1 (torch's CPU generator keeps 32 bits, so a "
                           "larger seed would repeat a smaller one; default 0)",
                           group="run", type=int, check="non_negative", tells_apart=False)
    out: str | None = setting(None, "run directory (default runs/TASK-INIT-sSEED)", group="run", tells_apart=False)
    resume: bool = setting(False, "continue the run in --out from its checkpoint",
                                  group="run", switch=True, resumable=True, tells_apart=False)
    device: str = setting("auto", "auto (cuda, mps, cpu; the default), cpu, cuda, ...",
                                  group="run", resumable=True, tells_apart=False)
    amp: str = setting("auto", "autocast: auto = bf16 on CUDA only",
                               group="run", choices=("auto", "bf16", "off"), resumable=True, tells_apart=False)
    log_every: int | None = setting(None, "steps between evaluations and log lines",
                                          group="run", type=int, check="positive", resumable=True)
    ckpt_every: int | None = setting(None, "steps between checkpoints (default: every log step)",
                                           group="run", type=int, check="positive", resumable=True, tells_apart=False)
    halt_after: int | None = setting(None, "stop at this step as if interrupted (checkpoint kept)",
                                           group="run", type=int, check="positive", resumable=True, tells_apart=False)
    compile: bool = setting(False, "torch.compile the model for training (off by default; the probes run the model "
                                   "uncompiled)",
                                   group="run", switch=True, resumable=True, tells_apart=False)
    dist_timeout: float = setting(1800.0, "under torchrun: seconds to wait for the other processes (joining, and at "
                                          "each collective; default 1800)",
                                          group="run", type=float, check="positive", resumable=True, tells_apart=False)
    # optimisation
    steps: int | None = setting(None, "training steps",
                                      group="optimisation", type=int, check="positive", resumable=True,
                                      alternative="epochs")
    epochs: float | None = setting(None, "training epochs (instead of --steps)",
                                         group="optimisation", type=float, check="positive", resumable=True,
                                         alternative="steps")
    lr: float = setting(0.0001, "peak learning rate",
                                group="optimisation", type=float, check="positive", resumable=True)
    batch_size: int = setting(64, None, group="optimisation", type=int, check="positive")
    weight_decay: float = setting(0.0, "never applied to M, biases, norms, embeddings",
                                       group="optimisation", type=float, check="non_negative")
    optimizer: str = setting("adam", "adam = coupled L2 (GOTU), adamw = decoupled",
                                     group="optimisation", choices=("adam", "adamw"))
    betas: str = setting("0.9,0.999", "Adam betas, e.g. 0.9,0.999", group="optimisation")
    schedule: str = setting("constant", None, group="optimisation", choices=("constant", "cosine"))
    warmup: int = setting(0, "linear warm-up steps",
                             group="optimisation", type=int, check="non_negative", alternative="warmup_epochs")
    warmup_epochs: float | None = setting(None, "warm-up length in epochs (instead of --warmup)",
                                                group="optimisation", type=float, check="non_negative",
                                                alternative="warmup")
    grad_clip: float = setting(0.0, "clip the gradient norm (0 = off)",
                                    group="optimisation", type=float, check="non_negative", resumable=True)
    # model
    layers: int = setting(2, None, group="model", type=int, check="positive", arch=True)
    heads: int = setting(4, None, group="model", type=int, check="positive", arch=True)
    dim: int = setting(64, None, group="model", type=int, check="positive", arch=True)
    head_dim: int | None = setting(None, "default dim // heads", group="model", type=int, check="positive", arch=True)
    mlp_dim: int = setting(256, "hidden units of each MLP", group="model", type=int, check="positive", arch=True)
    emb_init_std: float = setting(1.0, "std of the token and CLS embeddings (GOTU: 1)",
                                       group="model", type=float, check="non_negative", arch=True)
    pos_init_std: float = setting(1.0, "std of the positional embedding (GOTU: 1)",
                                       group="model", type=float, check="non_negative", arch=True)
    qkv_bias: bool | int = setting(False, "bias on the q, k, v projections",
                                          group="model", type=int, choices=(0, 1), arch=True)
    dropout: float = setting(0.0, "dropout on embeddings, attention output and MLP",
                                  group="model", type=float, check="fraction", arch=True)
    drop_path: float = setting(0.0, "stochastic depth: the last block skips its branches with this probability, "
                                    "linearly less before it (timm's schedule; 0 = off)",
                                    group="model", type=float, check="fraction")
    ema: float = setting(0.0, "also keep an exponential moving average of the weights with this decay (e.g. 0.9999) "
                              "and evaluate it beside them (ema_* metrics); 0 = off",
                              group="model", type=float, check="fraction")
    attention: str = setting("auto", "scaled_dot_product_attention (fused) or the explicit softmax; auto = fused, "
                                     "except explicit for a masked model on the CPU, where PyTorch's fused kernel "
                                     "takes no float mask",
                                     group="model", choices=("auto", "fused", "explicit"), tells_apart=False)
    # prior
    pattern: str | None = setting(None, "interaction pattern variant (task-specific; see README)",
                                        group="prior", arch=True)
    mask_on: float = setting(mp.M_ON, "initial M on allowed pairs", group="prior", type=float, check="non_negative",
                             needs={"init": MASK_INITS, "kind": LEVELS})
    mask_off: float = setting(mp.M_OFF, "initial -M elsewhere", group="prior", type=float, check="non_negative",
                              needs={"init": MASK_INITS, "kind": LEVELS})
    mask_param: str = setting("full", "M per (query, key) pair (heads x N x N; the paper's), or relative: one logit "
                                      "per head and distance i - j (heads x N), for priors that depend on the "
                                      "distance alone (language models)",
                                      group="prior", choices=("full", "relative"), arch=True,
                                      needs={"init": MASK_INITS})
    qk_svd_scale: float = setting(1000.0, "qk-svd target logit on the pattern",
                                          group="prior", type=float, check="positive", needs={"init": QK_SVD_INITS})
    qk_svd_noise: float = setting(3.0, "qk-svd off-pattern noise scale",
                                       group="prior", type=float, check="non_negative", needs={"init": QK_SVD_INITS})
    qk_svd_norm: float = setting(7.0, "qk-svd Frobenius norm of each factor",
                                      group="prior", type=float, check="positive", needs={"init": QK_SVD_INITS})
    qk_svd_pos_scale: float | None = setting(None, "qk-svd: multiply the positional embedding first (impulse and "
                                                   "mask-impulse: 18 unless given)",
                                                   group="prior", type=float, check="positive",
                                                   needs={"init": ("qk-svd", "impulse", "mask-impulse")})
    qk_opt_steps: int = setting(10000, "qk-opt Adam steps (at most)", group="prior", type=int, check="positive",
                                needs={"init": ("qk-opt",)})
    qk_opt_lr: float = setting(0.0001, None, group="prior", type=float, check="positive", needs={"init": ("qk-opt",)})
    qk_opt_tol: float = setting(1e-07, "qk-opt stops when 100 steps gain less than this",
                                       group="prior", type=float, check="non_negative", needs={"init": ("qk-opt",)})
    qk_opt_pos_scale: float | None = setting(None, "qk-opt: multiply the positional embedding first",
                                                   group="prior", type=float, check="positive",
                                                   needs={"init": ("qk-opt",)})
    prior_from: str | None = setting(None, "a finished run folder of the same task and token layout (a teacher, e.g. a "
                                           "default run): M (--init mask) or the QK inits' pattern is read from its "
                                           "attention instead of the task's hand pattern",
                                           group="prior", metavar="RUN", arch=True, needs={"init": PRIOR_INITS},
                                           excludes=("pattern",))
    prior_kind: str | None = setting(None, "what --prior-from reads: pattern (keys or query-key pairs above "
                                           "--prior-ratio "
                                           "times the uniform share), logits (M whose bias gives the teacher's mean "
                                           "attention), relative (a profile per head and distance: language models) or "
                                           "offsets (a profile per head and 2-D offset: vision); default: the task's "
                                           "first",
                                           group="prior", choices=("pattern", "logits", "relative", "offsets"),
                                           arch=True, needs={"prior_from": GIVEN})
    prior_ratio: float = setting(1.5, "--prior-kind pattern: keep what gets at least this multiple of the uniform "
                                      "attention share (default 1.5)",
                                      group="prior", type=float, check="positive", arch=True,
                                      needs={"prior_from": GIVEN, "prior_kind": ("pattern",)})
    probe_size: int = setting(512, "batch size of the prior-mass probe", group="prior", type=int, check="positive")
    eval_points: int = setting(0, "Boolean and arithmetic tasks: evaluate the log steps on a fixed sample of this "
                                  "many cube points or test pairs (0 = all); the final evaluation uses all of them",
                                  group="prior", type=int, check="non_negative", resumable=True,
                                  needs={"kind": ("boolean", "arithmetic")})
    # boolean
    readout: str | None = setting(None, "a CLS token in front, read out (GOTU), or no CLS token and mean pooling over"
                                        " the bit tokens; the pattern follows the layout",
                                        group="boolean", metavar="{" + ",".join(T.READOUTS) + "}", arch=True)
    n_bits: int = setting(15, "kparity, kmajority: input bits (default 15)", group="boolean", type=int, arch=True)
    bits: str = setting("0,1,2", "kparity, kmajority: bits the target reads (default 0,1,2; random:K draws K of them "
                                 "by the seed)",
                                 group="boolean", arch=True)
    unseen: str = setting("0,1", "kparity, kmajority: bits set to -1 in the unseen domain (default 0,1; bits:J: the "
                                   "first J of --bits)",
                                 group="boolean", arch=True)
    train_size: int | None = setting(None, "kparity, kmajority: draws from the seen domain (default: every seen "
                                           "point)",
                                           group="boolean", type=int)
    discover_degree: int = setting(3, "Boolean tasks, --pattern discovered: the Walsh sets of the training data of up "
                                      "to this many bits (default 3)",
                                      group="boolean", type=int, arch=True, needs={"pattern": ("discovered",)})
    discover_threshold: float = setting(0.25, "Boolean and arithmetic tasks, --pattern discovered: keep the sets "
                                              "(digit "
                                              "pairs) whose Walsh coefficient (mutual information) is at least this "
                                              "fraction of the largest (default 0.25)",
                                              group="boolean", type=float, arch=True,
                                              needs={"pattern": ("discovered",)})
    # arithmetic
    data_frac: float | None = setting(None, "fraction of the 10^(2 x --digits) pairs to train on (default: 0.004 for addition, "
                                            "0.03 for multiplication)",
                                            group="arithmetic", type=float, arch=True)
    answer_order: str = setting("msb", "answer digits most significant first (the paper's plain format; the default) "
                                       "or reversed",
                                       group="arithmetic", metavar="{msb,lsb}", arch=True)
    digits: int = setting(3, "digits per operand: 3 (the default; 10^6 pairs) or 2 (10^4 pairs, Lee et al.'s "
                             "multiplication), 1 or 4",
                             group="arithmetic", type=int, metavar="{1,2,3,4}", arch=True)
    lee_samples: int | None = setting(None, "multiplication, --digits 2: Lee et al.'s data instead, N samples (the 100 "
                                            "one-digit pairs, then N - 100 drawn with replacement; theirs: 3000), "
                                            "unpadded a*b=c (--answer-order lsb: $a*b=rev(c)$), tested on every pair "
                                            "not trained on; inits default and mask",
                                            group="arithmetic", type=int, arch=True, metavar="N")
    # vision
    data_dir: str | None = setting(None, "folder holding the dataset files (e.g. the one with cifar-10-batches-py/; "
                                         "for language models the corpus folder)",
                                         group="vision", resumable=True, tells_apart=False)
    image_size: int | None = setting(None, "image side in pixels as stored (CIFAR 32; ImageNet-100 32 or 64)",
                                           group="vision", type=int, check="positive", arch=True)
    input_size: int | None = setting(None, "the model's image side (default: the image size); larger upsamples, e.g. "
                                           "224 for CIFAR as the recipe of the paper preset does",
                                           group="vision", type=int, check="positive", arch=True)
    patch_size: int | None = setting(None, "ViT patch side in pixels",
                                           group="vision", type=int, check="positive", arch=True)
    pool: str | None = setting(None, "ViT readout: global average pooling or a CLS token",
                                     group="vision", choices=("mean", "cls"), arch=True)
    impulse: str = setting("fixed", "impulse offsets per head: fixed order (self, up, right, ...; the default) or "
                                    "random (drawn by the seed)",
                                    group="vision", metavar="{fixed,random}", arch=True,
                                    needs={"pattern": ("impulse", "soft", "graded")})
    soft_alpha: float = setting(1.0, "--pattern soft: log sigmoid(M) = -alpha x squared distance (in patches) to "
                                     "the head's offset (default 1.0)",
                                     group="vision", type=float, arch=True, needs={"pattern": ("soft",)})
    window: int = setting(3, "--pattern local: the side of every head's window, in patches (odd; default 3)",
                               group="vision", type=int, arch=True, needs={"pattern": ("local",)})
    label_smoothing: float | None = setting(None, None, group="vision", type=float, check="fraction")
    mixup: float = setting(0.0, "mixup Beta(alpha, alpha); 0 = off", group="vision", type=float, check="non_negative")
    cutmix: float = setting(0.0, "cutmix Beta(alpha, alpha); 0 = off", group="vision", type=float, check="non_negative")
    crop: str = setting("pad", "training crop: pad 4 and crop back, or a random resized crop to the input size (scale"
                               " 0.08-1); a flip either way",
                               group="vision", metavar="{pad,rrc}")
    crop_pct: float = setting(0.875, "evaluation at another input size: resize to input / crop-pct, keep the centre "
                                     "(default 0.875)",
                                     group="vision", type=float, needs={"input_size": GIVEN})
    randaug: float = setting(0.0, "RandAugment magnitude in [0, 10] (0 = off; the recipe: 9)",
                                  group="vision", type=float)
    randaug_std: float = setting(0.5, "RandAugment: std of the per-image magnitude noise (default 0.5)",
                                      group="vision", type=float, check="non_negative", needs={"randaug": ON})
    randaug_ops: int = setting(2, "RandAugment: ops per image (default 2)", group="vision", type=int,
                               needs={"randaug": ON})
    reprob: float = setting(0.0, "random erasing probability (0 = off; the recipe: 0.25)",
                                 group="vision", type=float)
    # lm
    context: int | None = setting(None, "context length in tokens (also the model's positions)",
                                        group="lm", type=int, arch=True)
    val_tokens: int | None = setting(None, "evaluate on the first N validation tokens (0 = all)",
                                           group="lm", type=int)
    # sampling
    sample: str | None = setting(None, "print a continuation of PROMPT from the checkpoint in --out and exit (no "
                                       "training)",
                                       group="sampling", metavar="PROMPT", resumable=True, tells_apart=False)
    sample_tokens: int = setting(100, "tokens to generate (default 100)",
                                      group="sampling", type=int, check="positive", resumable=True, tells_apart=False,
                                      needs={"sample": GIVEN})
    temperature: float = setting(0.8, "0 = greedy (default 0.8)",
                                      group="sampling", type=float, check="non_negative", resumable=True,
                                      tells_apart=False, needs={"sample": GIVEN})
    top_k: int = setting(40, "sample among the k likeliest (0 = all; default 40)",
                             group="sampling", type=int, check="non_negative", resumable=True, tells_apart=False,
                             needs={"sample": GIVEN})


FIELDS = {f.name: f for f in fields(Config)}
DEFAULTS = {name: f.default for name, f in FIELDS.items()}
RESUMABLE = {name for name, f in FIELDS.items() if f.metadata["resumable"]}
ARCH = {name for name, f in FIELDS.items() if f.metadata["arch"]}
NOT_TELLING_APART = {name for name, f in FIELDS.items() if not f.metadata["tells_apart"]}
ALTERNATIVES = {name: f.metadata["alternative"] for name, f in FIELDS.items() if f.metadata["alternative"]}
TASK_FLAGS = {name for name, f in FIELDS.items() if f.metadata["group"] in FAMILIES}
NEEDS = {name: f.metadata["needs"] for name, f in FIELDS.items() if f.metadata["needs"]}
EXCLUDES = {name: f.metadata["excludes"] for name, f in FIELDS.items() if f.metadata["excludes"]}
CHECKS = {"positive": (lambda v: v > 0, "> 0"), "non_negative": (lambda v: v >= 0, ">= 0"),
          "fraction": (lambda v: 0 <= v < 1, "in [0, 1)")}
COMMANDS = ("train", "summarize", "report", "make-digits", "make-wikitext")


def say(text: str) -> None:
    """A line of progress on standard output, from one process (under torchrun, rank 0's)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""
    status = 2


class BusyError(UsageError):
    """The run folder is in use by another process: one line, exit status 75 (EX_TEMPFAIL: try again later)."""
    status = 75


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{message} (see python train.py --help)")


class _Unset:
    """The default of every flag: tells a flag given on the command line from one left to the preset."""

    def __repr__(self):
        return "preset"


UNSET = _Unset()


class Once(argparse.Action):
    """Store a flag's value (a switch: True), refusing a flag given twice, whose last value would win in silence."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest, UNSET)
        if before is not UNSET:
            again = "" if self.nargs == 0 else f" ({before!r}, then {values!r})"
            raise UsageError(f"{option_string} is given twice{again}; give each flag once")
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """One flag per Config field, in its group; every flag parses to UNSET when not given (see `resolve`)."""
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    for name, f in FIELDS.items():
        m = f.metadata
        kw = {"help": m["help"] and m["help"].format(tasks=", ".join(T.TASKS), inits=", ".join(INITS)),
              "action": Once}
        if m["switch"]:
            kw["nargs"] = 0
        else:
            kw.update({k: v for k, v in (("type", m["type"]), ("metavar", m["metavar"])) if v is not None})
            if m["choices"]:
                kw["choices"] = list(m["choices"])
        groups[m["group"]].add_argument("--" + name.replace("_", "-"), **kw)


def build_parser() -> Parser:
    """`train.py [train] FLAGS` (the default command), `summarize`, `report`, `make-digits`, `make-wikitext`."""
    p = Parser(prog="train.py", description="Train a task with an attention prior, or tabulate runs.")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    t = sub.add_parser("train", argument_default=UNSET, help="train one run (the default command)",
                       description="Train a task with an attention prior. A flag not given takes the task's preset "
                                   "value (--preset small or paper), else the default shown. Other commands: "
                                   "summarize, report, make-digits, make-wikitext (python train.py COMMAND --help).")
    add_train_flags(t)
    s = sub.add_parser("summarize", help="a markdown table (mean ± std over seeds) of finished runs")
    s.add_argument("paths", nargs="+", help="run directories or folders of them")
    r = sub.add_parser("report", help="results/*.md tables, learning and persistence curves of a reproduction")
    r.add_argument("runs", help="a reproduce.sh runs folder (e.g. runs/quick)")
    r.add_argument("out", help="the folder to write the tables and figures to (e.g. results/quick)")
    d = sub.add_parser("make-digits", help="scikit-learn's digits written in the CIFAR-10 python layout")
    d.add_argument("folder")
    w = sub.add_parser("make-wikitext", help="plain-text files written in WikiText-2's word-level layout")
    w.add_argument("folder")
    w.add_argument("files", nargs="+", help="text files: one article each, the first line its title")
    return p


def parse_args(argv=None):
    """-> (namespace, explicit): the command's arguments, and for `train` the flags given on the
    command line (the others are UNSET until `resolve`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        argv = ["train"] + argv                       # training is the default command
    flags = build_parser().parse_args(argv)
    explicit = {k for k, v in vars(flags).items() if v is not UNSET} - {"command"}
    return flags, explicit


def resolve(flags: argparse.Namespace, explicit: set) -> Config:
    """The one resolver: each field is the flag given, else the task's preset (less the alternatives of the
    flags given), else its default."""
    given = {k: getattr(flags, k) for k in explicit}
    task, init, preset = (given.get(k, DEFAULTS[k]) for k in ("task", "init", "preset"))
    if task not in T.TASKS:
        raise UsageError(f"unknown task {task!r}; choose from {', '.join(T.TASKS)}")
    if init not in INITS:
        raise UsageError(f"unknown init {init!r}; choose from {', '.join(INITS)}")
    task_cls = T.TASKS[task]
    if preset not in task_cls.presets():
        raise UsageError(f"unknown preset {preset!r}; choose from {', '.join(task_cls.presets())}")
    for flag, other in ALTERNATIVES.items():
        if flag in explicit and other in explicit:
            raise UsageError(f"give either --{flag.replace('_', '-')} or --{other.replace('_', '-')}, not both")
    from_preset = task_cls.preset(preset)
    for flag in explicit & set(ALTERNATIVES):
        from_preset.pop(ALTERNATIVES[flag], None)
    values = {**DEFAULTS, **from_preset, **given}
    if values["out"] is None:
        values["out"] = os.path.join("runs", f"{task}-{init}-s{values['seed']}")
    return Config(**values)


SEED_MAX = 2 ** 32 - 1          # torch's CPU generator keeps the low 32 bits of a seed


def check_numbers(config: Config) -> None:
    """Every numeric field finite and in its range (its `check`), before anything is written."""
    if isinstance(config.seed, int) and not 0 <= config.seed <= SEED_MAX:
        raise UsageError(f"--seed must be an integer in 0 .. {SEED_MAX} (torch's CPU generator keeps 32 bits, so a "
                         f"larger seed would train the same weights as a smaller one), got {config.seed}")
    for name, f in FIELDS.items():
        value = getattr(config, name)
        if f.metadata["check"] is None or value is None:
            continue
        ok, what = CHECKS[f.metadata["check"]]
        if not (math.isfinite(value) and ok(value)):
            kind = "an integer" if isinstance(value, int) else "a finite number"
            raise UsageError(f"--{name.replace('_', '-')} must be {kind} {what}, got {value}")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def applied_value(config: Config, key: str):
    """What a `needs` condition reads: the task's family ("kind"), or a field's resolved value (a --pattern or
    --prior-kind not given: the task's default)."""
    task = T.TASKS[config.task]
    if key == "kind":
        return task.KIND
    if key == "pattern":
        return config.pattern or task.DEFAULT_PATTERN
    if key == "prior_kind":
        return config.prior_kind or task.TEACHER_KINDS[0]
    return getattr(config, key)


def unmet(key: str, allowed, value) -> str | None:
    """What a flag needs of `key` when `value` does not meet `allowed` (None: it does)."""
    if allowed is GIVEN:
        return None if value is not None else f"with {flag(key)}"
    if allowed is ON:
        return None if value else f"with {flag(key)} above 0 (here {value})"
    if value in allowed:
        return None
    if key == "kind":
        return f"to the {' and '.join(allowed)} tasks (this task is {value})"
    return f"with {flag(key)} {' or '.join(map(str, allowed))} (here {value})"


def check_applies(config: Config, explicit: set) -> None:
    """The one check of where a flag applies, from the Config table: each flag given must be a task option of the
    task (its constructor takes it), meet its field's `needs` and come without what it `excludes`; else one line
    naming the flag and what it needs. Runs before anything is built or read."""
    task = T.TASKS[config.task]
    options = [o for o in task.options() if o in FIELDS]
    for name in (n for n in FIELDS if n in explicit):
        if name in TASK_FLAGS and name not in options:
            what = f" (use --pool for {config.task})" if name == "readout" and task.KIND == "vision" else ""
            raise UsageError(f"{flag(name)} does not apply to task {config.task} ({task.KIND}){what}; its task "
                             f"options are: {', '.join(flag(o) for o in options if o != 'heads')}")
        for key, allowed in NEEDS.get(name, {}).items():
            need = unmet(key, allowed, applied_value(config, key))
            if need:
                raise UsageError(f"{flag(name)} applies only {need}; leave it out or give what it needs")
        for other in EXCLUDES.get(name, ()):
            if other in explicit:
                raise UsageError(f"give {flag(name)} or {flag(other)}, not both ({flag(name)} replaces "
                                 f"{flag(other)})")


def validate(config, task, explicit: set):
    if config.steps is None and config.epochs is None:
        raise UsageError("give --steps or --epochs (no preset sets them for this task)")
    if config.init not in task.INITS:
        raise UsageError(f"init {config.init!r} does not apply to task {config.task} ({task.KIND}); "
                         f"choose from {', '.join(task.INITS)}{getattr(task, 'inits_why', '')}")
    if config.head_dim is None and config.dim % config.heads:
        raise UsageError(f"--dim {config.dim} is not divisible by --heads {config.heads}; set --head-dim")
    if config.pattern == "":
        raise UsageError(f"--pattern needs a name; {config.task}'s patterns are {', '.join(task.PATTERNS)} (leave the "
                         f"flag out for the default, {task.check_pattern(None)})")
    try:
        task.check_pattern(config.pattern)
    except T.TaskError as e:
        raise UsageError(str(e)) from None
    try:
        b = tuple(float(x) for x in config.betas.split(","))
        assert len(b) == 2 and all(0 <= x < 1 for x in b)
    except (ValueError, AssertionError):
        raise UsageError(f"--betas must be two numbers in [0, 1) like 0.9,0.999, got {config.betas!r}") from None


# ----------------------------------------------------------------------------------------
# Build: the task, the model, the init, the optimiser


def make_task(config) -> T.Task:
    """The task of config.task, given its options (flags of the same names) and the seed."""
    options = {k: getattr(config, k) for k in T.TASKS[config.task].options()
               if k in FIELDS and getattr(config, k) is not None}
    try:
        return T.make_task(config.task, seed=config.seed, **options)
    except T.TaskError as e:
        raise UsageError(str(e)) from None


def mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda", "mps"):
        raise UsageError(f"--device {name!r} is not a device to train on; use auto, cpu, cuda, cuda:1 or mps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but torch sees no CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type == "mps" and not mps_available():
        raise UsageError("--device mps asked for, but torch sees no Apple GPU (MPS); use --device cpu")
    return dev


def use_fused(attention: str, init: str, device: torch.device) -> bool:
    """--attention auto: the fused kernel, except for a masked model on the CPU (measured faster there:
    PyTorch's CPU scaled_dot_product_attention falls back to its math kernel for a float mask)."""
    if attention == "auto":
        return not (init in MASK_INITS and device.type == "cpu")
    return attention == "fused"


def model_config(config, task, device=torch.device("cpu")):
    arch = task.arch()
    trunk = dict(dim=config.dim, n_layers=config.layers, n_heads=config.heads, head_dim=config.head_dim,
                 mlp_dim=config.mlp_dim, learnable_mask=config.init in MASK_INITS,
                 fused=use_fused(config.attention, config.init, device), qkv_bias=bool(config.qkv_bias),
                 dropout=config.dropout, pos_init_std=config.pos_init_std, drop_path=config.drop_path,
                 mask_param=config.mask_param)
    if arch.get("model") == "vit":
        return mp.ViTConfig(image_size=arch["image_size"], patch_size=arch["patch_size"],
                            n_classes=arch["n_classes"], pool=arch["pool"], **trunk)
    return mp.TransformerConfig(vocab_size=arch["vocab_size"], seq_len=arch["seq_len"], n_outputs=arch["n_outputs"],
                                readout=arch["readout"], causal=arch.get("causal", False),
                                emb_init_std=config.emb_init_std, tie_embeddings=arch.get("tie_embeddings", False),
                                **trunk)


def build_model(config, task, device):
    model_cfg = model_config(config, task, device)
    torch.manual_seed(config.seed)
    model = mp.ViT(model_cfg) if isinstance(model_cfg, mp.ViTConfig) else mp.Transformer(model_cfg)
    return model.to(device), model_cfg


@dataclass
class Prior:
    """The prior a run starts from: `pattern` (bool (N, N) or (H, N, N)), which the QK inits fit and the probe
    measures the mass on; `logits`, the initial M of --init mask; and `source`, where both came from (the
    task's hand pattern, its training data, or a teacher run's attention), recorded in result.json."""
    pattern: torch.Tensor
    logits: torch.Tensor
    source: dict


# The inits: name -> function(model, prior, config, generator) that writes the prior (`Prior`: its pattern or
# its logits) into the model in place and returns a small report. Add one here and it is a --init.

def init_default(model, prior, config, g) -> dict:
    return {}


def init_mask(model, prior, config, g) -> dict:
    """M from the prior's logits: +m_on on the pattern, -m_off elsewhere, the task's own graded M, or soft."""
    return mp.init_mask_(model, logits=prior.logits)


def init_qk_svd(model, prior, config, g) -> dict:
    return mp.init_qk_svd_(model, prior.pattern, config.qk_svd_scale, config.qk_svd_noise, config.qk_svd_norm,
                           config.qk_svd_pos_scale, generator=g)


def init_qk_opt(model, prior, config, g) -> dict:
    return mp.init_qk_opt_(model, prior.pattern, config.qk_opt_steps, config.qk_opt_lr, tol=config.qk_opt_tol,
                           pos_scale=config.qk_opt_pos_scale, generator=g, log=say)


def init_mimetic(model, prior, config, g) -> dict:
    return mp.init_mimetic_(model, generator=g)


def init_impulse(model, prior, config, g) -> dict:
    """The 2025 structured-initialization recipe: positional embedding x18, QK solved in closed form
    for the impulse pattern, V-proj mimetic (0.4 Z - 0.4 I)."""
    report = mp.init_qk_svd_(model, prior.pattern, config.qk_svd_scale, config.qk_svd_noise,
                             config.qk_svd_norm, config.qk_svd_pos_scale or 18.0, generator=g)
    report.update(mp.init_mimetic_(model, qk=None, vo=(0.4, 0.4), generator=g))
    return report


def init_mask_impulse(model, prior, config, g) -> dict:
    """`impulse` with its pattern moved from Wq Wk^T into the logits: the positional embedding x18 and the
    mimetic V-proj (0.4 Z - 0.4 I) as `init_impulse` gives them, M from the prior's logits (`--pattern`: the
    hard impulse or the soft bump) as `init_mask` gives it; Wq, Wk keep the model's own init."""
    scale = config.qk_svd_pos_scale or 18.0                 # impulse's scale, applied as init_qk_svd_ applies it
    with torch.no_grad():
        model.pos_emb.mul_(scale)
    report = mp.init_mask_(model, logits=prior.logits)
    report.update(mp.init_mimetic_(model, qk=None, vo=(0.4, 0.4), generator=g))
    report["pos_scale"] = scale
    return report


INITS = {"default": init_default, "mask": init_mask, "qk-svd": init_qk_svd, "qk-opt": init_qk_opt,
         "mimetic": init_mimetic, "impulse": init_impulse, "mask-impulse": init_mask_impulse}


def apply_init(model, prior: Prior, config) -> dict:
    """Write the prior into the model as config.init says; returns the init's report."""
    return INITS[config.init](model, prior, config, torch.Generator().manual_seed(config.seed + 1))


def make_prior(config, task, device, teacher: Teacher | None = None) -> Prior:
    """The run's prior: from --prior-from's teacher (`teacher_prior`; `teacher`: its files, read already by
    `read_teacher`), else the task's --pattern (the hand patterns, or `discovered` in the training data), with
    precision and recall of its pairs against the task's default hand pattern where the prior is not a hand one."""
    if config.prior_from is not None:
        pattern, logits, source = teacher_prior(config, task, device, teacher or read_teacher(config, task))
    else:
        name = task.check_pattern(config.pattern)
        pattern, logits = task.pattern(name), task.mask_logits(name, config.mask_on, config.mask_off)
        source = {"from": "data" if name == "discovered" else "hand", "pattern": name}
    if source["from"] != "hand":
        source.update(pattern_agreement(pattern, task.pattern(task.DEFAULT_PATTERN), task.arch().get("causal", False)))
    return Prior(pattern, logits, source)


LAYOUT = ("seq_len", "readout", "causal", "image_size", "patch_size", "pool")   # what a teacher's maps must share


@dataclass
class Teacher:
    """A --prior-from run's files, read and checked (`read_teacher`): its checkpoint and its flags."""
    folder: str
    ckpt: dict
    config: Config


def read_teacher(config, task) -> Teacher:
    """--prior-from RUN, read as someone else's files before anything is built or written: a folder no process is
    training in (its lock is free), holding a finished run (result.json of the checkpoint's run and step) whose
    checkpoint (`read_checkpoint`: schema checked) is of this task, token layout and, for a per-head prior, head
    count. Anything else is one line."""
    folder, flag = config.prior_from, f"--prior-from {config.prior_from}"
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} is not a folder; give the folder of a finished run (a teacher)")
    with RunFolder(folder).reading(flag):
        result = read_result(os.path.join(folder, "result.json"), flag)
        ckpt = read_checkpoint(os.path.join(folder, "ckpt.pt"), flag)
    ident = ckpt["identity"]
    if result.get("run_id") != ident.get("run_id") or result.get("steps") != ckpt["step"]:
        raise UsageError(f"{flag}: its result.json (run {result.get('run_id')}, step {result.get('steps')}) and "
                         f"ckpt.pt (run {ident.get('run_id')}, step {ckpt['step']}) are not one finished run; "
                         f"finish the run (--resume) or give another teacher")
    saved, mine = saved_config(ckpt["config"], f"{flag}: ckpt.pt"), asdict(model_config(config, task))
    if saved.task != config.task:
        raise UsageError(f"{flag} is a run of task {saved.task}, not {config.task}: a teacher is a run of the same "
                         f"task")
    theirs = ckpt["model_config"]
    other = {k: (theirs.get(k), mine.get(k)) for k in LAYOUT if theirs.get(k) != mine.get(k)}
    if other:
        what = ", ".join(f"{k} {a} (here {b})" for k, (a, b) in other.items())
        raise UsageError(f"{flag} has another token layout: {what}; a teacher's attention maps must cover this "
                         f"run's positions")
    kind = config.prior_kind or task.TEACHER_KINDS[0]
    if kind not in task.TEACHER_KINDS:
        raise UsageError(f"--prior-kind {kind} does not apply to task {config.task}; choose from "
                         f"{', '.join(task.TEACHER_KINDS)}")
    if kind != "pattern" and theirs["n_heads"] != config.heads:
        raise UsageError(f"{flag} has {theirs['n_heads']} heads, this run {config.heads}: --prior-kind {kind} "
                         f"gives each head its own M (the teacher's head); use --prior-kind pattern or as many heads")
    return Teacher(folder, ckpt, saved)


def read_result(path: str, flag: str) -> dict:
    """A finished run's result.json through the one reader (`T.read_result`: its schema checked)."""
    if not os.path.lexists(path):
        raise UsageError(f"{flag} is not a finished run (no result.json): train it to the end first")
    try:
        return T.read_result(path)
    except T.ReadError as e:
        raise UsageError(f"{flag}: {e}") from None


def teacher_prior(config, task, device, teacher: Teacher) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The prior a teacher's attention gives (`T.Task.teacher_prior`): its model rebuilt from its checked
    checkpoint and its mean attention read on its own training inputs (`T.Task.teacher_inputs`: its task made from
    its flags, so a teacher of another corpus reads its own). Returns (pattern, logits, source)."""
    flag, ckpt = f"--prior-from {teacher.folder}", teacher.ckpt
    teacher_task = make_task(teacher.config)
    setup_task(teacher_task, device)
    theirs = ckpt["model_config"]
    model = mp.ViT(mp.ViTConfig(**theirs)) if "patch_size" in theirs else mp.Transformer(mp.TransformerConfig(**theirs))
    load_weights(model, ckpt["model"], f"{flag}'s checkpoint")
    model.to(device).eval()
    attn = mp.mean_attention(model, teacher_task.teacher_inputs(config.probe_size))
    kind = config.prior_kind or task.TEACHER_KINDS[0]
    try:
        pattern, logits = task.teacher_prior(attn, kind, config.prior_ratio, config.mask_on, config.mask_off)
    except ValueError as e:                # a map that names nothing, or is not finite: refused, not used
        raise UsageError(f"{flag}: its attention gives no prior ({e})") from None
    return pattern, logits, {"from": "teacher", "teacher": os.path.abspath(teacher.folder),
                             "teacher_run_id": ckpt["identity"]["run_id"],
                             "teacher_init": teacher.config.init,
                             "teacher_steps": ckpt["step"], "kind": kind, "ratio": config.prior_ratio}


def pattern_agreement(found: torch.Tensor, oracle: torch.Tensor, causal: bool) -> dict:
    """Precision and recall of the pairs (query i, key j != i) a found pattern allows against an oracle's, over
    the rows the oracle constrains (per head where both are per head, else over the union of heads)."""
    if found.dim() != oracle.dim():
        found, oracle = (p.any(0) if p.dim() == 3 else p for p in (found, oracle))
    rows = mp.prior_rows(oracle, causal)
    n = oracle.shape[-1]
    off_diagonal = ~torch.eye(n, dtype=torch.bool)
    keep = off_diagonal & (rows[..., :, None] if rows.dim() == oracle.dim() - 1 else rows)
    f, o = found.cpu() & keep, oracle.cpu() & keep
    hit = int((f & o).sum())
    return {"precision": hit / max(1, int(f.sum())), "recall": hit / max(1, int(o.sum())),
            "found_pairs": int(f.sum()), "oracle_pairs": int(o.sum())}


def make_optimizer(model, config):
    groups = mp.param_groups(model, config.weight_decay)
    betas = tuple(float(x) for x in config.betas.split(","))
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=config.lr, betas=betas)


def lr_at(step: int, total: int, config) -> float:
    """Learning rate of a step: linear warm-up, then constant or cosine to 0."""
    if config.warmup and step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    if config.schedule == "cosine":
        t = (step - config.warmup) / max(1, total - config.warmup)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return config.lr


def autocast(device, config):
    use = config.amp == "bf16" or (config.amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)


# ----------------------------------------------------------------------------------------
# Data parallelism: `torchrun --nproc_per_node N train.py ...` (nanoGPT's wiring). Every rank
# draws the same global batch of a step and trains on its own shard of it, so --batch-size and
# --lr mean what they mean on one device; DistributedDataParallel averages the gradients (M's
# too: it is an ordinary parameter); rank 0 alone evaluates, logs and writes the run folder.


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

    def agree(self, error: str | None) -> None:
        """Every rank learns rank 0's error (None: none): rank 0 raises it, the others exit quietly."""
        error = self.share(error)
        if error is not None:
            raise UsageError(error) if self.main else QuietExit()

    def shard(self, batch):
        """This rank's part of a global batch (a tensor or a tuple of tensors, split along dim 0) and
        its loss weight, n_rank * world / n_global, so that the averaged gradients are those of the
        global mean (the last batch of an epoch may not split evenly)."""
        if self.world == 1:
            return batch, None
        first = batch[0] if isinstance(batch, (tuple, list)) else batch
        n = len(first)
        lo, hi = n * self.rank // self.world, n * (self.rank + 1) // self.world
        weight = (hi - lo) * self.world / n
        if hi == lo:                             # fewer examples than ranks: a stand-in with no weight
            lo, hi = 0, 1
        part = (lambda t: t[lo:hi])
        return (type(batch)(part(t) for t in batch) if isinstance(batch, (tuple, list)) else part(batch)), weight

    def step_state(self, loss: torch.Tensor, stop: bool) -> tuple[float, bool]:
        """From this rank's weighted shard loss: the global batch's mean loss and whether any rank was
        interrupted, the same on every rank."""
        if self.world == 1:
            return float(loss), stop
        t = torch.tensor([float(loss) / self.world, float(stop)], dtype=torch.float64,
                         device="cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
        torch.distributed.all_reduce(t)
        return float(t[0]), bool(t[1] > 0)


def init_distributed(config: Config) -> tuple[Dist, Config]:
    """One process (no torchrun): Dist(). Under torchrun: join the process group (NCCL on GPUs, gloo
    on the CPU) and pin this rank's device (the config it returns names it); bad settings are one line
    from rank 0."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(), config
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if world == 1:
        return Dist(), config
    if config.sample is not None:
        raise UsageError("--sample runs in one process; start it without torchrun")
    if config.batch_size % world:
        raise UsageError(f"--batch-size {config.batch_size} (the global batch) does not divide by the {world} "
                         f"processes; give a multiple of {world}")
    device = pick_device(config.device)
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UsageError(f"torchrun started {world} processes per node but torch sees {torch.cuda.device_count()} "
                             f"CUDA GPU(s); use --nproc_per_node {torch.cuda.device_count()} or fewer")
        torch.cuda.set_device(local)
        config = replace(config, device=f"cuda:{local}")
    elif device.type != "cpu":
        raise UsageError(f"--device {config.device}: data parallelism runs on CUDA GPUs (NCCL) or on the CPU (gloo)")
    import datetime
    try:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=config.dist_timeout))
    except Exception as e:  # noqa: BLE001 - an unreachable rendezvous is one line, not a traceback
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UsageError(f"torchrun: cannot join the process group at {where} within --dist-timeout "
                         f"{config.dist_timeout} s ({type(e).__name__}); are all {world} processes started?") from None
    return Dist(rank, world, local), config


@dataclass
class Probe:
    """What every log step measures: the task's metrics, and the prior per layer (attention mass on
    the pattern and content margin on a fixed real batch, drift of M and Wq Wk^T since the start).
    When the pattern constrains no query row there is no mass to measure: `no_mass` says why."""
    task: T.Task
    pattern: torch.Tensor
    inputs: torch.Tensor
    snapshot: list
    eval_points: int
    device: torch.device
    config: Config

    def __post_init__(self):
        causal = self.task.arch().get("causal", False)
        self.no_mass = None if mp.prior_rows(self.pattern, causal).any() else (
            f"the {self.task.check_pattern(self.config.pattern)} pattern of {self.config.task} constrains no query row "
            f"at this size (every row allows every key it can see), so there is no prior mass to measure")

    def measure(self, model, ema: torch.nn.Module | None = None, final: bool = False) -> dict:
        """The log record of `model` (and, with --ema, its moving average `ema`, evaluated beside it as ema_*
        metrics). Log steps of a Boolean or arithmetic task use --eval-points cube points or test pairs;
        the final measurement always uses the whole test set."""
        model.eval()
        with autocast(self.device, self.config):
            metrics = self.task.evaluate(model, points=None if final else self.eval_points)
            if ema is not None:
                ema.eval()
                averaged = self.task.evaluate(ema, points=None if final else self.eval_points)
                metrics.update({f"ema_{k}": v for k, v in averaged.items() if isinstance(v, float)})
            if self.no_mass is None:
                mass, margin = mp.prior_probe(model, self.inputs, self.pattern)
            else:
                mass = margin = None
        model.train()
        rec = {"metrics": metrics, "prior_mass": mass,
               "prior_mass_mean": None if mass is None else sum(mass) / len(mass),
               "content_margin": margin}
        rec.update(mp.prior_drift(model, self.snapshot))
        return rec


# ----------------------------------------------------------------------------------------
# Loop: start a run (or resume it), train, finish


@dataclass
class Run:
    """Everything a run carries from its start to its end."""
    config: Config
    task: T.Task
    model: torch.nn.Module
    model_cfg: object
    optimizer: torch.optim.Optimizer
    probe: Probe
    device: torch.device
    init_report: dict
    mass_start: list | None
    folder: RunFolder | None        # rank 0's (the others never touch the run folder)
    dist: Dist
    step: int = 0
    seconds: float = 0.0            # training time before this invocation
    run_id: str | None = None       # written at the start into ckpt.pt and the log's step-0 line (None: an old run)
    data: str | None = None         # the task's data fingerprint (T.Task.fingerprint), saved in ckpt.pt
    prior_source: dict | None = None  # where the prior came from (`Prior.source`), saved in ckpt.pt and result.json
    prior_file: bytes | None = None   # a new run's prior.pt (a prior not written by hand), written by `begin`
    prior_sha256: str | None = None   # its sha256, saved in ckpt.pt: a resume reads back the same file
    log_step: int = 0               # the step of the last line in metrics.jsonl
    saved_step: int | None = None   # the step of the checkpoint on disk (None: none yet)
    last: dict | None = None        # the latest logged record
    trained: torch.nn.Module | None = None   # what the steps run: the model, compiled and/or in DDP
    ema: torch.nn.Module | None = None       # the moving average of the weights (--ema): updated each step, saved

    def path(self, name: str) -> str:
        return os.path.join(self.config.out, name)

    def say(self, text: str) -> None:
        if self.dist.main:
            print(text, flush=True)


def run(flags: argparse.Namespace, explicit: set) -> int:
    """The `train` command: resolve the flags, then start or resume, train, finish."""
    config = resolve(flags, explicit)
    check_numbers(config)
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
        if e.errno == errno.ENOENT and state is not None and not os.path.isdir(config.out):
            raise UsageError(folder_vanished(config, state)) from None
        if e.errno not in STORAGE_ERRORS:
            raise
        raise UsageError(storage_failed(e, config, state)) from None
    finally:
        if dist.world > 1:
            if sys.exc_info()[0] is None:
                torch.distributed.barrier()     # leave together: gloo aborts a rank whose peer is gone
            torch.distributed.destroy_process_group()


# A write that fails for want of room or permission: the run stops with one line, its files whole.
STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def storage_failed(e: OSError, config: Config, state: Run | None) -> str:
    """The line for a write that failed (disk full, quota, read-only): what failed where, and what is
    kept (every file is written whole or not at all, so the last checkpoint resumes exactly)."""
    where = f" writing {e.filename}" if e.filename else f" under {config.out}"
    what = f"{e.strerror or errno.errorcode.get(e.errno, e.errno)}{where}"
    if state is None or state.saved_step is None:
        if config.resume:
            return f"{what}; the run in {config.out} is unchanged: free space, then --resume --out {config.out} again"
        return f"{what}; the new run had no checkpoint yet and left nothing behind: free space and start it again"
    return (f"{what} at step {state.step}; the checkpoint of step {state.saved_step} in {state.path('ckpt.pt')} is "
            f"whole: free space, then continue with --resume --out {config.out}")


def folder_vanished(config: Config, state: Run) -> str:
    """The line for a run folder moved or deleted while the run trained (its next write found no folder)."""
    kept = (f"its files went with it, whole: the checkpoint of step {state.saved_step} resumes exactly with "
            f"--resume --out NEW_PLACE" if state.saved_step is not None else "it had no checkpoint yet")
    return f"the run folder {config.out} disappeared at step {state.step} (moved or deleted while training); {kept}"


def start_or_resume(config, explicit: set, dist: Dist = Dist()) -> Run:
    """Check everything the run reads (its flags and where they apply, a resumed run's files, a teacher's), build
    it in memory (the data, the model, the init, every check of a resume), and only then take the run folder and
    write (`begin`): a refusal writes nothing and deletes nothing, and a new run that fails after `begin` removes
    only what it wrote itself (`RunFolder.abandon`). A resumed run's folder is locked from its first read to the
    end, a new run's from `begin`. Under torchrun rank 0 alone reads and writes the folder and shares the
    (restored) flags, or its error, with the others."""
    folder = ckpt = task = device = teacher = error = None
    try:
        if dist.main:
            folder = RunFolder(config.out)
            if config.resume:
                folder.open_existing()
                ckpt = read_checkpoint(folder.file("ckpt.pt"), "--resume")
                config = restore_config(config, explicit, folder, ckpt)
                check_numbers(config)
            else:
                folder.check_free()
            check_applies(config, explicit)
            task = make_task(config)
            task.say = say                               # the task's word on its slow work (the exact MDI)
            validate(config, task, explicit)
            teacher = read_teacher(config, task) if config.prior_from is not None and ckpt is None else None
            device = pick_device(config.device)
    except UsageError as e:
        if folder is not None:
            folder.release()
        if dist.world == 1:
            raise
        error = str(e)
    dist.agree(error)
    shared = dist.share(asdict(config) if dist.main else None)
    try:
        if not dist.main:                        # the flags rank 0 restored, then this rank's own copies
            config = Config(**shared)
            ckpt = read_checkpoint(os.path.join(config.out, "ckpt.pt"), "--resume") if config.resume else None
            task, device = make_task(config), pick_device(config.device)
        state = build_run(config, explicit, task, device, folder, ckpt, dist, teacher)
        if dist.main:
            begin(state, ckpt)
    except UsageError as e:
        if folder is not None:
            folder.abandon()
        if dist.world == 1:
            raise
        error = str(e) if dist.main else None
    except BaseException:
        if folder is not None:
            folder.abandon()
        raise
    dist.agree(error)
    return state


def size_schedule(config: Config, explicit: set, task) -> Config:
    """The config with what the task sizes filled in: --steps from --epochs (unless --steps was given, or
    kept from a resumed run while --epochs was given now), --warmup from --warmup-epochs, and the log
    (a tenth of the run) and checkpoint (each log step) intervals where not given."""
    sized = {}
    if config.warmup_epochs is not None:
        sized["warmup"] = round(config.warmup_epochs * task.steps_per_epoch(config.batch_size))
    if config.steps is None or ("epochs" in explicit and "steps" not in explicit):
        sized["steps"] = max(1, round(config.epochs * task.steps_per_epoch(config.batch_size)))
    log_every = config.log_every or max(1, sized.get("steps", config.steps) // 10)
    return replace(config, **sized, log_every=log_every, ckpt_every=config.ckpt_every or log_every)


@dataclass
class Built:
    """What a config builds (`build`): the config with its schedule sized, the task set up, the model
    and its model config, the optimiser, and the init's report and prior (None when the init was not applied)."""
    config: Config
    task: T.Task
    model: torch.nn.Module
    model_cfg: object
    optimizer: torch.optim.Optimizer
    init_report: dict | None
    prior: Prior | None = None      # what the init wrote (None when it was not applied)


def build(config: Config, device: torch.device | None = None, explicit: set = frozenset(), task: T.Task | None = None,
          init: bool = True, teacher: Teacher | None = None) -> Built:
    """Everything a run trains, from a config: the task (made from the config unless given) set up on
    the device, the schedule sized (`size_schedule`), the model built and, with `init`, initialised by
    --init (its report timed; `teacher`: --prior-from's files, read already), and the optimiser (M undecayed).
    `train_loop`, the tests and the benchmarks that train build this way; `train_step` then takes the steps."""
    device = device or pick_device(config.device)
    task = task or make_task(config)
    setup_task(task, device)
    config = size_schedule(config, explicit, task)
    model, model_cfg = build_model(config, task, device)
    report = prior = None
    if init:
        t0 = time.time()
        prior = make_prior(config, task, device, teacher)
        try:
            report = apply_init(model, prior, config)
        except ValueError as e:     # a pattern that does not fit the model: nothing is written
            raise UsageError(f"--init {config.init}: {e}") from None
        report["seconds"] = round(time.time() - t0, 3)
        model.to(device)
    return Built(config, task, model, model_cfg, make_optimizer(model, config), report, prior)


def build_run(config, explicit: set, task, device, folder: RunFolder | None, ckpt: dict | None,
              dist: Dist = Dist(), teacher: Teacher | None = None) -> Run:
    """Load the data, size the schedule, build the model; then initialise a new run (`ckpt` None: `new_run`) or
    restore the checkpoint's state (`restored_run`), everything checked and nothing written (`begin` writes)."""
    built = build(config, device, explicit, task, init=ckpt is None, teacher=teacher)
    state = new_run(built, task, device, folder, dist) if ckpt is None else \
        restored_run(built, task, device, folder, dist, ckpt)
    state.trained = torch.compile(state.model) if state.config.compile else state.model
    if dist.world > 1:
        state.trained = torch.nn.parallel.DistributedDataParallel(
            state.trained, device_ids=[dist.local_rank] if device.type == "cuda" else None)
    return state


def new_run(built: Built, task, device, folder: RunFolder | None, dist: Dist) -> Run:
    """A new run from its build, in memory: the start checked and measured (rank 0), the prior not written by
    hand serialised for prior.pt."""
    config, model, prior = built.config, built.model, built.prior
    pattern, inputs = prior.pattern.to(device), task.probe_inputs(config.probe_size)
    check_start(model, task, config, device)
    probe = Probe(task, pattern, inputs, mp.prior_snapshot(model), config.eval_points, device, config)
    state = Run(config, task, model, built.model_cfg, built.optimizer, probe, device, built.init_report, None,
                folder, dist, run_id=uuid.uuid4().hex, data=task.fingerprint(), prior_source=prior.source)
    if config.ema:
        state.ema = copy.deepcopy(model).requires_grad_(False)
    if prior.source["from"] != "hand":          # found, not written by hand: kept beside the run
        state.prior_file = prior_bytes(prior)
        state.prior_sha256 = hashlib.sha256(state.prior_file).hexdigest()
    if dist.main:
        state.last = {"step": 0, "loss": None, "run_id": state.run_id, **probe.measure(model)}
        state.mass_start = state.last["prior_mass"]
    return state


def restored_run(built: Built, task, device, folder: RunFolder | None, dist: Dist, ckpt: dict) -> Run:
    """The run a checkpoint holds, on the build of its own config, in memory: its steps, architecture, data, moving
    average and prior file checked against this run's, then the weights, optimiser, probe snapshot and RNG
    restored."""
    config, model, model_cfg = built.config, built.model, built.model_cfg
    if config.steps < ckpt["step"]:
        raise UsageError(f"--resume: the checkpoint in {config.out} is at step {ckpt['step']}, past --steps "
                         f"{config.steps}; give --steps {ckpt['step']} or more")
    same = {k: v for k, v in ckpt["model_config"].items() if k != "fused"} == \
        {k: v for k, v in asdict(model_cfg).items() if k != "fused"}
    if not same:
        raise UsageError(f"--resume: the checkpoint in {config.out} holds a different architecture "
                         f"({ckpt['model_config']} vs {asdict(model_cfg)})")
    if config.ema and "ema" not in ckpt:
        raise UsageError(f"--resume: the checkpoint in {config.out} holds no moving average (--ema)")
    check_same_data(ckpt, task, config)
    prior_source = ckpt.get("prior_source") or {"from": "hand"}
    pattern = saved_pattern(config, task, prior_source, ckpt["prior_sha256"]).to(device)
    load_weights(model, ckpt["model"], f"--resume: the checkpoint in {config.out}")
    try:
        built.optimizer.load_state_dict(ckpt["optimizer"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UsageError(f"--resume: the optimiser state in {config.out}/ckpt.pt does not fit this run's "
                         f"parameters ({type(e).__name__}: {str(e)[:120]})") from None
    probe = Probe(task, pattern, task.probe_inputs(config.probe_size), ckpt["snapshot"], config.eval_points, device,
                  config)
    state = Run(config, task, model, model_cfg, built.optimizer, probe, device, ckpt["init_report"],
                ckpt["prior_mass_start"], folder, dist, step=ckpt["step"], seconds=ckpt["seconds"],
                run_id=ckpt["identity"]["run_id"], log_step=ckpt["log_step"], saved_step=ckpt["step"],
                data=ckpt["data"], prior_source=prior_source, prior_sha256=ckpt["prior_sha256"])
    if config.ema:
        state.ema = copy.deepcopy(model).requires_grad_(False)
        load_weights(state.ema, ckpt["ema"], f"--resume: the moving average in {config.out}/ckpt.pt")
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    return state


def begin(state: Run, ckpt: dict | None) -> None:
    """Rank 0, once everything is checked and built: a new run takes its folder (`RunFolder.create`: made or taken
    over, and locked) and writes args.json, prior.pt (a prior not written by hand), the log's first line and last
    ckpt.pt, which makes the folder a run; a resumed run cuts its log back to the checkpoint's step and rewrites
    args.json. Each then says what it runs."""
    config, folder = state.config, state.folder
    if ckpt is not None:
        truncate_log(state.path("metrics.jsonl"), state.step)
        write_json(state.path("args.json"), asdict(config))
        state.say(f"resuming {config.out} at step {state.step}/{config.steps}")
        note = rounding_note(ckpt, state.device)
        if note:
            state.say(note)
        return
    folder.create()
    folder.write("args.json", json_text(asdict(config)))
    if state.prior_file is not None:
        folder.write("prior.pt", state.prior_file)
    folder.write("metrics.jsonl", json.dumps(state.last) + "\n")
    save_checkpoint(state)              # last: a folder with a checkpoint is a run
    n_params = sum(p.numel() for p in state.model.parameters())
    procs = f" x {state.dist.world} processes" if state.dist.world > 1 else ""
    print(f"{config.task} | init {config.init} {fmt_report(state.init_report)}| {n_params:,} params | "
          f"{state.device}{procs} | {config.steps} steps | out {config.out}", flush=True)
    if config.preset == "paper" and state.device.type == "cpu":
        print(f"note: --preset paper is the paper's setting, sized for a GPU; on this CPU it may take hours "
              f"(an estimate follows within {EARLY_ETA:.0f} s of training)", flush=True)
    print(f"step {0:>6}/{config.steps} | {fmt_metrics(state.last, state.task)}", flush=True)


def prior_bytes(prior: Prior) -> bytes:
    """prior.pt: the pattern and logits a run started from and their source (torch.save, weights_only loadable)."""
    buf = io.BytesIO()
    torch.save({"pattern": prior.pattern.cpu(), "logits": prior.logits.cpu(), "source": prior.source}, buf)
    return buf.getvalue()


def saved_pattern(config, task, source: dict, sha256: str | None) -> torch.Tensor:
    """A resumed run's probe pattern: the task's for a hand prior; else its prior.pt (a prior found in the data
    or a teacher), read through the one reader, the same bytes the run wrote at its start (their sha256 is in
    the checkpoint) and of the layout the task's pattern has."""
    if source.get("from", "hand") == "hand":
        return task.pattern(config.pattern)
    path = os.path.join(config.out, "prior.pt")
    try:
        data = T.read_back(path, "prior")
    except T.ReadError as e:
        raise UsageError(f"--resume: {e}: the run started from a prior found in its {source['from']}, saved there; "
                         f"restore the file") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UsageError(f"--resume: {path} has changed since the run started (its sha256 is not the one in the "
                         f"checkpoint); restore the run's own prior.pt")
    try:
        saved = T.load_torch(data, path)
    except T.ReadError as e:
        raise UsageError(f"--resume: {e}") from None
    shape = task.pattern(task.DEFAULT_PATTERN).shape[-2:]
    pattern, logits = (saved.get(k) if isinstance(saved, dict) else None for k in ("pattern", "logits"))
    if not (isinstance(pattern, torch.Tensor) and pattern.dtype == torch.bool and pattern.dim() in (2, 3)
            and pattern.shape[-2:] == shape and isinstance(logits, torch.Tensor) and logits.is_floating_point()
            and bool(torch.isfinite(logits).all())):
        raise UsageError(f"--resume: {path} does not hold the run's prior (a bool pattern of {tuple(shape)} and "
                         f"finite logits)")
    return pattern


def load_weights(model: torch.nn.Module, state: dict, what: str) -> None:
    """model.load_state_dict(state), or one line naming the first key that does not fit (a checkpoint of an
    earlier version of the model, e.g. one whose M sat on the attention layer itself, before MaskPrior)."""
    try:
        model.load_state_dict(state)
    except (RuntimeError, ValueError) as e:
        model_keys = set(model.state_dict())
        missing = sorted(model_keys - set(state))
        extra = sorted(set(state) - model_keys)
        which = (f"it lacks {missing[0]}" if missing else f"it holds {extra[0]}, which the model has not" if extra
                 else str(e).splitlines()[0][:160])
        raise UsageError(f"{what} does not fit this version's model ({which}); it was written by another version of "
                         f"maskprior: continue it with that version, or start a new run") from None


def check_same_data(ckpt: dict, task, config) -> None:
    """--resume on the data the run trained on: the task's fingerprint must be the checkpoint's (a checkpoint
    written before fingerprints is not checked)."""
    saved, now = ckpt.get("data"), task.fingerprint()
    if saved is not None and now != saved:
        was = ckpt["config"].get("data_dir")
        raise UsageError(f"--resume: the data{f' in --data-dir {config.data_dir}' if config.data_dir else ''} is not the "
                         f"data the run in {config.out} trained on (fingerprint {now[:12]}, the checkpoint's "
                         f"{saved[:12]}); point --data-dir at the run's own data"
                         + (f" (it started from {was})" if was else ""))


def rounding_note(ckpt: dict, device: torch.device) -> str | None:
    """A resume on another device type or CPU thread count is exact only to rounding (another order of the
    float sums): a note that says so, or None when it resumes bitwise."""
    saved = ckpt.get("machine")
    if not saved:
        return None
    now = machine(device)
    if saved == now:
        return None
    what = (f"{saved['threads']} CPU threads, now {now['threads']}" if saved["device"] == now["device"] == "cpu"
            else f"on {saved['device']}, now on {now['device']}")
    fix = f"; with OMP_NUM_THREADS={saved['threads']} it resumes bitwise" if saved["device"] == now["device"] else ""
    return (f"note: the run trained with {what}: its sums round in another order, so the resumed run matches an "
            f"uninterrupted one to about 1e-6, not bitwise{fix}")


def machine(device: torch.device) -> dict:
    """What decides the order of a step's float sums: the device type and, on the CPU, torch's thread count."""
    return {"device": device.type, "threads": torch.get_num_threads() if device.type == "cpu" else None}


def finite_weights(model) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def check_start(model, task, config, device) -> None:
    """A new run's initial state must be finite, in its weights and in its loss on the first batch
    (an eval-mode forward: no random state is used), or nothing is written."""
    if not finite_weights(model):
        raise UsageError(f"--init {config.init} gave non-finite weights with these flags; nothing was written")
    model.eval()
    with torch.no_grad(), autocast(device, config):
        loss = task.loss(model, task.train_batch(0, config.batch_size))
    model.train()
    if not torch.isfinite(loss):
        raise UsageError(f"the initial model gives a {float(loss)} loss with these flags (--init {config.init}); "
                         f"nothing was written")


def train_loop(state: Run) -> int | None:
    """Train from state.step to config.steps, logging and checkpointing; None when it got to the end,
    else the exit status (interrupted, halted, or a non-finite loss or weight). Every rank takes the
    same decisions: the loss and the interrupt flag are agreed on each step."""
    config, model, optimizer, task, dist = state.config, state.model, state.optimizer, state.task, state.dist
    total, t_start, steps_done, estimated = config.steps, time.time(), 0, False
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
                rec = state.probe.measure(model, state.ema, final=step == total)
                now = time.time()
                rate = steps_done / max(now - t_start, 1e-9)
                state.last = {"step": step, "prev": state.log_step, "loss": loss_value,
                              "lr": optimizer.param_groups[0]["lr"],
                              "seconds": round(state.seconds + now - t_start, 2), **rec}
                append_log(state.path("metrics.jsonl"), state.last)
                state.log_step = step
                print(f"step {step:>6}/{total} | train_loss {loss_value:.4f} | {fmt_metrics(rec, task)} | "
                      f"{rate:.1f} steps/s | ETA {fmt_time((total - step) / rate)}", flush=True)
                estimated = True
            elif dist.main and not estimated and time.time() - t_start >= EARLY_ETA:
                rate = steps_done / (time.time() - t_start)
                print(f"step {step:>6}/{total} | train_loss {loss_value:.4f} | {rate:.2f} steps/s | ETA "
                      f"{fmt_time((total - step) / rate)} (an early estimate; the first evaluation is at step "
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
                state.say(f"{why}: checkpoint at step {step} in {state.path('ckpt.pt')}; continue with --resume "
                          f"--out {config.out}")
                return stop.code if interrupted else 0
    state.seconds += time.time() - t_start
    return None


EARLY_ETA = 10.0        # seconds of training after which a run that has not logged yet prints its pace and ETA


def step_loss(trained, task, batch, config, device, weight: float | None = None) -> torch.Tensor:
    """The first half of a training step: the task's loss on `batch` through `trained` (the model, compiled
    and/or in DDP) under --amp's autocast, times `weight` (a DDP shard's share of the global batch)."""
    with autocast(device, config):
        loss = task.loss(trained, batch)
        return loss if weight is None else loss * weight


def step_update(model, optimizer, loss: torch.Tensor, config, step: int, ema: torch.nn.Module | None = None) -> None:
    """The second half, once the loss is known to be finite: step `step`'s learning rate (--schedule),
    backward, --grad-clip, the optimiser's update and the moving average (--ema)."""
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
    """One training step exactly as `train_loop` takes it (one process): `step_loss`, then `step_update`.
    Returns the loss. Benchmarks time this function, so they time the real step."""
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


def non_finite(state: Run, what: str) -> int:
    if state.dist.main:
        print(f"error: {what}; stopped. The last good checkpoint is kept in {state.path('ckpt.pt')}; try a lower "
              f"--lr or --grad-clip (both may change on --resume)", file=sys.stderr, flush=True)
    return 1


def finish(state: Run) -> int:
    """The final measurement (the whole test set) and result.json, by rank 0."""
    if not state.dist.main:
        return 0
    config, last = state.config, state.last
    if last is None or last["step"] != state.step:
        last = {"step": state.step, **state.probe.measure(state.model, state.ema, final=True)}
    metrics = dict(last["metrics"])
    if state.mass_start is None:
        metrics["prior_mass_start"] = metrics["prior_mass_end"] = None
    else:
        metrics["prior_mass_start"] = sum(state.mass_start) / len(state.mass_start)
        metrics["prior_mass_end"] = last["prior_mass_mean"]
    result = {"task": config.task, "kind": state.task.KIND, "init": config.init, "seed": config.seed, "preset": config.preset,
              "run_id": state.run_id, "data": state.data,
              "steps": state.step, "seconds": round(state.seconds, 2), "metrics": metrics,
              "prior_mass_start_layers": state.mass_start, "prior_mass_end_layers": last["prior_mass"],
              **{k: last[k] for k in ("qk_drift", "mask_drift") if k in last},
              **({"prior_mass_note": state.probe.no_mass} if state.probe.no_mass else {}),
              "init_report": state.init_report, "prior_source": state.prior_source, "config": asdict(state.model_cfg),
              "device": str(state.device),
              "torch": torch.__version__, "params": sum(p.numel() for p in state.model.parameters())}
    write_json(state.path("result.json"), result)
    print(f"done: {fmt_metrics(last, state.task)} | training {fmt_time(state.seconds)}, "
          f"{time.time() - STARTED:.1f} s wall since the command started | {state.path('result.json')}", flush=True)
    return 0


class Interrupt:
    """Turn the first Ctrl-C (SIGINT) or SIGTERM (a scheduler's or reproduce.sh's stop) into a flag
    checked between steps: the run saves a checkpoint and exits 130 (SIGINT) or 143 (SIGTERM). A
    second signal aborts at once."""
    SIGNALS = {signal.SIGINT: ("interrupt", 130), signal.SIGTERM: ("terminated", 143)}

    def __init__(self):
        self.hit = False
        self.code = 130
        self.old = {}

    def __enter__(self):
        def handler(signum, frame):
            if self.hit:
                raise KeyboardInterrupt
            self.hit = True
            what, self.code = self.SIGNALS[signum]
            print(f"\n{what}: finishing this step and saving a checkpoint (a second signal aborts)", flush=True)
        try:
            for sig in self.SIGNALS:
                self.old[sig] = signal.signal(sig, handler)
        except ValueError:      # not in the main thread
            pass
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)


def setup_task(task, device):
    """Load the task's data; a data problem is one line for the user (UsageError)."""
    try:
        task.setup(device)
    except T.TaskError as e:
        raise UsageError(str(e)) from None


def sample(config, explicit: set) -> int:
    """--sample PROMPT: load the language model in --out and print PROMPT and its continuation."""
    if "out" not in explicit:
        raise UsageError("--sample needs --out RUN_DIR, the run whose checkpoint to sample from")
    folder = RunFolder(config.out)
    if not os.path.exists(folder.file("ckpt.pt")):
        raise UsageError(f"--sample: no checkpoint {folder.file('ckpt.pt')}; train the run first (or check --out)")
    ckpt = read_checkpoint(folder.file("ckpt.pt"), "--sample")
    config = restore_config(config, explicit, folder, ckpt)
    check_numbers(config)
    check_applies(config, explicit)
    task = make_task(config)
    if task.KIND != "lm":
        raise UsageError(f"--sample needs a language-model run (wikitext2, tinystories); {config.out} is {config.task}")
    device = pick_device(config.device)
    setup_task(task, device)
    model, _ = build_model(config, task, device)
    load_weights(model, ckpt["model"], f"--sample: the checkpoint in {config.out}")
    ids = task.encode(config.sample)
    if not ids:
        raise UsageError(f"--sample: the prompt {config.sample!r} gives no tokens")
    if config.sample_tokens < 1 or config.temperature < 0 or config.top_k < 0:
        raise UsageError("--sample-tokens must be >= 1, --temperature and --top-k >= 0")
    model.eval()
    g = torch.Generator(device=device).manual_seed(config.seed)
    out = mp.generate(model, torch.tensor([ids], device=device), config.sample_tokens, config.temperature,
                      config.top_k or None, generator=g)
    sep = " " if task.vocab is not None else ""              # words are joined by spaces, bytes are not
    print(task.decode(ids) + sep + task.decode(out[0, len(ids):].tolist()))
    return 0


# ----------------------------------------------------------------------------------------
# Checkpoint and files: every file is written whole or not at all (T.atomic_write / atomic_output)


def json_text(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=False) + "\n"


def write_json(path: str, obj) -> None:
    T.atomic_write(path, json_text(obj))


CKPT_FORMAT = "maskprior-checkpoint-4"       # the contents, serialised, beside their sha256; every flag of this version


def save_checkpoint(state: Run, seconds: float | None = None) -> None:
    """ckpt.pt: model, optimiser, step, training time, the run's config and the model's, the init's report, the prior's
    snapshot and starting mass, RNG states: all `--resume` needs to continue exactly. They are
    serialised first and stored with their sha256, which `read_checkpoint` verifies."""
    ckpt = {"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(), "step": state.step,
            "seconds": state.seconds if seconds is None else seconds, "config": asdict(state.config),
            "model_config": asdict(state.model_cfg), "init_report": state.init_report, "snapshot": state.probe.snapshot,
            "prior_mass_start": state.mass_start,
            **({"ema": state.ema.state_dict()} if state.ema is not None else {}),
            "identity": identity(state.config, state.run_id), "log_step": state.log_step,
            "data": state.data, "machine": machine(state.device), "prior_source": state.prior_source,
            "prior_sha256": state.prior_sha256,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    payload = buf.getvalue()
    outer = io.BytesIO()
    torch.save({"format": CKPT_FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload}, outer)
    state.folder.write("ckpt.pt", outer.getbuffer())    # a plain write: a full disk is an OSError (ENOSPC)
    state.saved_step = state.step


def fingerprint(flags: dict) -> str:
    """A short hash of the flags a resume may not change (all but RESUMABLE): one run's configuration."""
    fixed = {k: v for k, v in flags.items() if k not in RESUMABLE and k != "out"}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def identity(config, run_id: str) -> dict:
    """Who a checkpoint belongs to: the run id written at the start, the seed and the configuration's fingerprint."""
    return {"run_id": run_id, "seed": config.seed, "fingerprint": fingerprint(asdict(config))}


CKPT_KEYS = ("model", "optimizer", "step", "seconds", "config", "model_config", "init_report", "snapshot",
             "prior_mass_start", "rng", "identity", "log_step", "data", "machine", "prior_source", "prior_sha256")


def read_checkpoint(path: str, flag: str) -> dict:
    """A checkpoint of this program, read as someone else's file: `T.read_back` (a regular file within a size
    limit), both levels loaded with weights_only=True (a file from elsewhere runs no code), the contents matched
    against their sha256, then the schema checked (`check_checkpoint`) before any value is used. A checkpoint of
    an earlier version (another format, or none: before checksums) and anything else is one clear line."""
    try:
        ckpt = T.load_torch(T.read_back(path, "checkpoint"), path)
        if isinstance(ckpt, dict) and (ckpt.get("format") not in (None, CKPT_FORMAT)
                                       or "format" not in ckpt and set(CKPT_KEYS) <= set(ckpt)):
            was = ckpt.get("format") or "no format: written before checksums"
            raise UsageError(f"{flag}: {path} is a checkpoint of an earlier version of train.py ({was}); this version "
                             f"reads {CKPT_FORMAT}: continue the run with the version that wrote it, or start a new run")
        if isinstance(ckpt, dict) and ckpt.get("format") == CKPT_FORMAT:
            payload = ckpt.get("payload")
            if not isinstance(payload, bytes) or hashlib.sha256(payload).hexdigest() != ckpt.get("sha256"):
                raise UsageError(f"{flag}: {path} is damaged (its contents do not match the checksum saved with "
                                 f"them); restore the file from a copy, or start a new run with another --out")
            ckpt = T.load_torch(payload, path)
    except T.ReadError as e:
        raise UsageError(f"{flag}: {e}; use a checkpoint train.py wrote") from None
    check_checkpoint(ckpt, f"{flag}: {path}")
    return ckpt


# A checkpoint's payload: key -> the types its value may have (CKPT_KEYS must be there; the others are optional).
CKPT_SCHEMA = {"model": dict, "optimizer": dict, "step": int, "seconds": (int, float), "config": dict,
               "model_config": dict, "init_report": (dict, type(None)), "snapshot": list,
               "prior_mass_start": (list, type(None)), "rng": dict, "identity": dict, "log_step": int,
               "data": (str, type(None)), "machine": dict, "prior_source": (dict, type(None)),
               "prior_sha256": (str, type(None)), "ema": dict}


def check_checkpoint(ckpt, where: str) -> None:
    """The schema of a checkpoint's payload, before any value is used: every key of CKPT_KEYS, each value of its
    type, the counters in range, the weights finite tensors, the flags a valid Config of this version
    (`saved_config`) matching the identity's fingerprint, and the model config one that rebuilds (on the meta
    device: nothing allocated) a model with exactly the weights' names and shapes (`check_model_fits`)."""
    def bad(what):
        raise UsageError(f"{where} is not a checkpoint of train.py ({what})")
    missing = [k for k in CKPT_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        bad(f"no {', '.join(missing)}")
    for key, kinds in CKPT_SCHEMA.items():
        if key in ckpt and (not isinstance(ckpt[key], kinds) or isinstance(ckpt[key], bool)):
            bad(f"its {key} is a {type(ckpt[key]).__name__}")
    if ckpt["step"] < 0 or not 0 <= ckpt.get("log_step", 0) <= ckpt["step"] or \
            not (math.isfinite(ckpt["seconds"]) and ckpt["seconds"] >= 0):
        bad(f"step {ckpt['step']}, log step {ckpt.get('log_step')}, seconds {ckpt['seconds']}")
    for key in ("model", "ema"):
        for name, t in ckpt.get(key, {}).items():
            if not (isinstance(name, str) and isinstance(t, torch.Tensor)):
                bad(f"its {key} holds {name!r}: {type(t).__name__}, not a named tensor")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad(f"its {key} weight {name} holds non-finite values")
    if not isinstance(ckpt["rng"].get("torch"), torch.Tensor) or ckpt["rng"]["torch"].dtype != torch.uint8:
        bad("its rng holds no torch generator state")
    config = saved_config(ckpt["config"], where)
    ident = ckpt["identity"]
    if not isinstance(ident.get("run_id"), str) or ident.get("fingerprint") != fingerprint(asdict(config)):
        raise UsageError(f"{where} records flags that do not match its own fingerprint; the checkpoint was altered")
    check_model_fits(ckpt["model_config"], ckpt["model"], where)
    if not all(isinstance(layer, dict) for layer in ckpt["snapshot"]) or \
            len(ckpt["snapshot"]) != ckpt["model_config"].get("n_layers"):
        bad("its prior snapshot is not one record per layer")


def saved_config(saved: dict, where: str) -> Config:
    """The Config of flags a run saved (a checkpoint's, args.json's): every flag of this version there (a
    checkpoint of this format holds them all), each of its field's type and among its choices, then in range
    (`check_numbers`); anything else is one line naming the flag."""
    missing = [name for name in FIELDS if name not in saved]
    unknown = sorted(set(saved) - set(FIELDS))
    if missing or unknown:
        what = f"no {missing[0]}" if missing else f"{unknown[0]}, which is no flag of this version"
        raise UsageError(f"{where} holds the flags of another version of train.py ({what}); continue the run with "
                         f"the version that wrote it, or start a new run")
    for name, value in saved.items():
        if not value_fits(name, value):
            raise UsageError(f"{where} has {name}={value!r}, which --{name.replace('_', '-')} cannot take")
    config = Config(**saved)
    try:
        check_numbers(config)
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None
    return config


def value_fits(name: str, value) -> bool:
    """Whether `value` is one a field can hold: its type (an int for int flags, a number for float ones, a bool for
    switches, else a string), None where its default is None, and among its choices; a task and init registered."""
    f = FIELDS[name]
    m, default = f.metadata, f.default
    if value is None:
        return default is None
    if isinstance(default, bool) and isinstance(value, bool):
        return True
    kind = bool if m["switch"] else m["type"] or str
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
          else isinstance(value, kind) and (kind is bool or not isinstance(value, bool)))
    choices = m["choices"] or {"task": tuple(T.TASKS), "init": tuple(INITS)}.get(name)
    return ok and (not choices or value in choices)


def check_model_fits(model_config: dict, state: dict, where: str) -> None:
    """A saved model config that rebuilds, on the meta device (no memory), a model with exactly the saved weights'
    names, shapes and dtypes; its sizes bounded first (no more layers than weights, no size beyond 2^24)."""
    cls, config_cls = (mp.ViT, mp.ViTConfig) if "patch_size" in model_config else (mp.Transformer,
                                                                                  mp.TransformerConfig)
    names = {f.name for f in fields(config_cls)}
    if set(model_config) != names or not all(isinstance(k, str) for k in model_config):
        odd = sorted(set(map(str, model_config)) ^ names)
        raise UsageError(f"{where} is not a checkpoint of train.py (its model config has other fields: {odd[:3]})")
    sizes = [v for v in model_config.values() if isinstance(v, int) and not isinstance(v, bool)]
    if any(v < 0 or v > 1 << 24 for v in sizes) or not 0 < (model_config.get("n_layers") or 0) <= len(state):
        raise UsageError(f"{where} is not a checkpoint of train.py (its model config's sizes do not fit its "
                         f"{len(state)} weights: {model_config})")
    try:
        with torch.device("meta"):
            shapes = {k: (tuple(t.shape), t.dtype) for k, t in cls(config_cls(**model_config)).state_dict().items()}
    except Exception as e:  # noqa: BLE001 - a config the model refuses is one line
        raise UsageError(f"{where}: its model config does not build a model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    saved = {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
    if shapes != saved:
        missing, extra = sorted(set(shapes) - set(saved)), sorted(set(saved) - set(shapes))
        other = [k for k in sorted(set(shapes) & set(saved)) if shapes[k] != saved[k]]
        which = (f"it lacks {missing[0]}" if missing else f"it holds {extra[0]}, which the model has not" if extra
                 else f"{other[0]} is {saved[other[0]]} in the file, {shapes[other[0]]} in the model")
        raise UsageError(f"{where} does not fit this version's model ({which}); it was written by another version of "
                         f"maskprior or altered: continue it with that version, or start a new run")


try:
    import fcntl
except ImportError:             # not on POSIX: runs are not locked
    fcntl = None


class RunFolder:
    """A run directory, locked by its process from before the first check to the run's end (flock
    on the folder itself, released when the process exits), so that two processes never share one.
    A folder holds a run once it has ckpt.pt (the first save writes it last) or result.json; a new
    run may take over a folder without them (a start that died before its first checkpoint)."""
    OURS = ("args.json", "prior.pt", "metrics.jsonl", "result.json", "ckpt.pt")

    def __init__(self, path: str):
        if not path:
            raise UsageError("--out must name a folder, got an empty path")
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--out {path} is a file, not a folder; give a folder for the run")
        self.path, self.created, self.fd = path, False, None
        self.parents: list[str] = []            # the folders above it this run made, deepest first
        self.written: list[str] = []            # the files this process wrote here (`write`), in order

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def holds_run(self) -> bool:
        return os.path.exists(self.file("ckpt.pt")) or os.path.exists(self.file("result.json"))

    def check_free(self) -> None:
        """Before a new run reads anything: refuse a folder that holds a run, or a path no folder can be made at
        (both checked again by `create`, under the lock)."""
        if self.holds_run():
            raise UsageError(f"{self.path} already holds a run; use --resume to continue it, or another --out")
        above = os.path.dirname(os.path.abspath(self.path))
        while not os.path.exists(above):
            above = os.path.dirname(above)
        if not os.path.isdir(above) or not os.access(above, os.W_OK | os.X_OK):
            why = "Not a directory" if not os.path.isdir(above) else "Permission denied"
            raise UsageError(f"--out {self.path}: cannot create the run folder ({why}) at {above}")

    def write(self, name: str, data: bytes | str) -> None:
        """Write a file of the run whole (`T.atomic_write`), remembering that this process wrote it."""
        T.atomic_write(self.file(name), data)
        if name not in self.written:
            self.written.append(name)

    @contextlib.contextmanager
    def reading(self, flag: str):
        """Read another run's folder (a teacher's) only while no process trains in it: a shared lock, refused at
        once where a run holds the folder's lock."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    raise UsageError(f"{flag} is in use by another process (a run is training there); wait for it "
                                     f"to end, then give it again") from None
            yield
        finally:
            os.close(fd)

    def open_existing(self) -> None:
        """Lock the folder of a run to resume; it must hold a checkpoint."""
        if not os.path.exists(self.file("ckpt.pt")):
            raise UsageError(f"--resume: no checkpoint {self.file('ckpt.pt')}; start the run without --resume")
        self._lock()

    def create(self) -> None:
        """Create (or take over) the folder of a new run and lock it; nothing of another run is touched."""
        try:
            parent = os.path.dirname(os.path.abspath(self.path))
            self.parents = missing_folders(parent)
            os.makedirs(parent, exist_ok=True)
            try:
                os.mkdir(self.path)
                self.created = True
            except FileExistsError:             # there already, or made by a run starting at the same moment
                if not os.path.isdir(self.path):
                    raise
        except OSError as e:
            self._remove_parents()
            raise UsageError(f"--out {self.path}: cannot create the run folder ({e.strerror or e})") from None
        self._lock()
        if self.holds_run():
            self.release()
            raise UsageError(f"{self.path} already holds a run; use --resume to continue it, or another --out")

    def _lock(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
            with tempfile.TemporaryFile(dir=self.path):
                pass
        except OSError as e:
            self.release()
            raise UsageError(f"--out {self.path}: the run folder is not writable ({e.strerror or e})") from None
        if fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.release()
                raise BusyError(f"{self.path} is in use by another process (a run is training there); wait for "
                                f"it to end, or use another --out") from None
        for tmp, name in T.partial_writes(self.path):    # temporary files of a write that was killed
            if name in self.OURS:
                with contextlib.suppress(OSError):
                    os.remove(tmp)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def abandon(self) -> None:
        """A run that failed before it was one (no ckpt.pt of its own yet): remove the files this process wrote,
        and the folder and the folders above it where this process made them and nothing else is there; then
        unlock. Nothing this process did not write is touched, and a resumed run (it wrote nothing new) keeps all."""
        if "ckpt.pt" not in self.written:
            for name in self.written:
                with contextlib.suppress(OSError):
                    os.remove(self.file(name))
            if self.created:
                with contextlib.suppress(OSError):
                    os.rmdir(self.path)
                self._remove_parents()
        self.release()

    def _remove_parents(self) -> None:
        """Remove the folders above the run that this run made, while they are empty (another run
        starting under them at the same moment keeps them)."""
        for folder in self.parents:
            try:
                os.rmdir(folder)
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    break                       # in use: it and the folders above stay


def missing_folders(path: str) -> list[str]:
    """The folders of `path` (absolute) that do not exist yet, deepest first."""
    out = []
    while not os.path.exists(path) and os.path.dirname(path) != path:
        out.append(path)
        path = os.path.dirname(path)
    return out


def restore_config(config: Config, explicit: set, folder: RunFolder, ckpt: dict) -> Config:
    """Resume: the run's config from its saved flags (once `check_resume` finds ckpt.pt, args.json and
    metrics.jsonl to be one run), except its folder (always the --out given: a run folder can be
    moved) and the RESUMABLE flags given now; any other flag given must agree."""
    saved = check_resume(folder, ckpt)
    for key in sorted(explicit - RESUMABLE - {"out"}):
        new = getattr(config, key)
        if key in saved and saved[key] != new:
            what = "architecture" if key in ARCH else "setting"
            raise UsageError(f"--resume: the run in {config.out} has {key}={saved[key]!r} but {key}={new!r} was "
                             f"given; a resumed run cannot change its {what} (start a new run with another --out)")
    values = asdict(config)
    for key, value in saved.items():
        if key != "out" and key in DEFAULTS and (key not in explicit or key not in RESUMABLE):
            values[key] = value
    if "halt_after" not in explicit:
        values["halt_after"] = None     # a halt belongs to one invocation
    return Config(**{**values, "resume": True})


_MISSING = object()


def check_resume(folder: RunFolder, ckpt: dict) -> dict:
    """The run's flags from args.json, once the three files agree that they are one run at one step:
    args.json (read through `T.read_json`) is a JSON object holding every flag of the checkpoint and no other,
    each of the checkpoint's type and equal to it where a resume may not change it; metrics.jsonl starts at step 0
    and reaches the last step the checkpoint saw logged; and the log's step-0 line names the checkpoint's run.
    Anything else is one line."""
    path, log, flags = folder.file("args.json"), folder.file("metrics.jsonl"), ckpt["config"]
    if not os.path.isfile(log):
        what = "is not a file" if os.path.exists(log) else "is missing"
        raise UsageError(f"--resume: {log} {what}, so the run's log cannot be continued; start a new run "
                         f"with another --out")
    try:
        records, logged = read_log(log), ckpt["log_step"]
    except LogError as e:
        raise UsageError(f"--resume: {e}, so the run cannot be continued whole; restore the log from a copy, or "
                         f"start a new run with another --out") from None
    ident = ckpt["identity"]
    if records and records[0]["step"] == 0 and records[0].get("run_id") != ident["run_id"]:
        raise UsageError(f"--resume: {folder.file('ckpt.pt')} is the checkpoint of another run (run "
                         f"{ident['run_id']}, seed {ident['seed']}; this folder's log is of run "
                         f"{records[0].get('run_id')}); put back this run's ckpt.pt, or start a new run")
    if not records or records[0]["step"] != 0 or records[-1]["step"] < logged:
        held = "no records" if not records else f"steps {records[0]['step']} .. {records[-1]['step']}"
        raise UsageError(f"--resume: {log} holds {held}, but the checkpoint (step {ckpt['step']}) was saved after "
                         f"logging steps 0 .. {logged}: the log lost lines, so the run cannot be continued whole; "
                         f"start a new run with another --out")
    try:
        saved = T.read_json(path)
    except T.ReadError as e:
        raise UsageError(f"--resume: {e}; the run's flags are lost") from None
    if not isinstance(saved, dict):
        raise UsageError(f"--resume: {path} holds a JSON {type(saved).__name__}, not the object of the run's flags")
    for key, value in flags.items():
        mine = saved.get(key, _MISSING)
        if mine is _MISSING:
            raise UsageError(f"--resume: {path} lacks {key} (the checkpoint has {key}={value!r}); args.json was "
                             f"edited or belongs to another run")
        if value is not None and type(mine) is not type(value):
            raise UsageError(f"--resume: {path} has {key}={mine!r}, but the checkpoint's {key} is a "
                             f"{type(value).__name__} ({value!r})")
        if key not in RESUMABLE and key != "out" and mine != value:
            raise UsageError(f"--resume: {path} has {key}={mine!r} but the checkpoint was trained with "
                             f"{key}={value!r}; args.json does not belong to this checkpoint (restore it, or start "
                             f"a new run with another --out)")
    for key in sorted(saved.keys() - flags.keys()):
        raise UsageError(f"--resume: {path} has {key}={saved[key]!r}, which the checkpoint does not record")
    return saved


class LogError(ValueError):
    """A metrics.jsonl that is not one run's whole log: a line damaged, lost, repeated or out of order."""


def read_log(path: str) -> list[dict]:
    """The records of a metrics.jsonl, checked whole (`check_log`): only a last line that a killed write cut
    short (no newline at its end) is left out; a damaged, lost, repeated or reordered line is a LogError that
    names it, so nothing is ever dropped or rewritten away."""
    try:
        lines = T.read_back(path, "log").split(b"\n")
    except T.ReadError as e:
        raise LogError(str(e)) from None
    lines.pop()            # the bytes after the last newline: b"", or a write cut short (its step is logged again)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            rec = json.loads(line.decode("utf-8"))
        except ValueError:                        # UnicodeDecodeError is a ValueError
            rec = None
        if not log_line(rec):
            raise LogError(f"{path} line {number} is damaged (not a whole record as train.py writes it)")
        records.append(rec)
    check_log(records, path)
    return records


def check_log(records: list[dict], path: str) -> None:
    """Steps start at 0 and increase line by line, and each line's `prev` (the step logged before it, written
    since logs carry it) is the step of the line before: a lost, repeated or reordered line is a LogError."""
    for number, (before, rec) in enumerate(zip([None, *records], records), 1):
        step = rec["step"]
        if before is None:
            if step != 0 or rec.get("prev") is not None:
                raise LogError(f"{path} line 1 is step {step}, not the run's start (step 0): the log lost its first "
                               f"lines")
            continue
        if step <= before["step"]:
            what = "repeats" if step == before["step"] else "goes back from"
            raise LogError(f"{path} line {number} (step {step}) {what} step {before['step']} of the line before it: "
                           f"the log holds a repeated or misplaced line")
        if "prev" in rec and rec["prev"] != before["step"]:
            raise LogError(f"{path} line {number} (step {step}) was logged after step {rec['prev']}, but the line "
                           f"before it is step {before['step']}: a line of the log is missing")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def log_line(rec) -> bool:
    """Whether a parsed metrics.jsonl line is a record as `train_loop` writes it: a step (an int >= 0), a
    dict of metrics, and the prior's mass per layer (a list of numbers, or null) with their mean."""
    if not (isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] >= 0
            and isinstance(rec.get("metrics"), dict)):
        return False
    mass, mean, prev = rec.get("prior_mass"), rec.get("prior_mass_mean"), rec.get("prev")
    return ((mass is None or isinstance(mass, list) and all(map(_number, mass))) and (mean is None or _number(mean))
            and (prev is None or isinstance(prev, int) and not isinstance(prev, bool)))


def append_log(path: str, record: dict) -> None:
    """One metrics.jsonl line, written by a single write() so that it is never half there."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError as e:
        e.filename = path                       # a full disk names the log (a cut line is dropped on resume)
        raise
    finally:
        os.close(fd)


def truncate_log(path: str, step: int) -> None:
    """Drop log lines written after the checkpoint's step (they will be written again) and a last line cut
    short (`read_log`: anything else damaged is refused before this)."""
    T.atomic_write(path, "".join(json.dumps(r) + "\n" for r in read_log(path) if r["step"] <= step))


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def fmt_report(report: dict) -> str:
    if "pseudo_mass" in report:
        pm = report["pseudo_mass"]
        return f"(pseudo-input mass {sum(pm) / len(pm):.3f}) "
    return ""


def fmt_metrics(rec: dict, task) -> str:
    m = rec["metrics"]
    parts = [f"{'test_loss' if k == 'loss' else k} {m[k]:.4f}" for k in task.HEADLINE if k in m]
    mass = rec["prior_mass_mean"]
    return " | ".join(parts + [f"mass {'n/a' if mass is None else f'{mass:.3f}'}"])


# ----------------------------------------------------------------------------------------
# Commands: train (the default), summarize, report, and the two fixture writers


def make_digits(folder: str) -> int:
    """python train.py make-digits DIR: scikit-learn's bundled handwritten digits upscaled to 32x32
    RGB and written in the CIFAR-10 python format (`T.digits_arrays`): a small, real, learnable image
    set for trying the vision path on a CPU."""
    x_train, y_train, x_test, y_test = T.digits_arrays()
    out = T.write_cifar10_python(folder, x_train, y_train, x_test, y_test)
    print(f"wrote {len(y_train)} train / {len(y_test)} test digits in CIFAR-10 python format to {out}\n"
          f"train on them with: python train.py --task cifar10 --data-dir {folder} --init mask")
    return 0


def make_wikitext(folder: str, files: list) -> int:
    """python train.py make-wikitext DIR FILE...: plain-text files (one article each; paragraphs
    separated by blank lines; the first line is the title) written in WikiText-2's word-level
    layout under DIR/wikitext-2/, so that any English text can stand in for the corpus."""
    articles = []
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"make-wikitext: cannot read {path} ({e.strerror})") from None
        paras = [" ".join(p.split()) for p in text.split("\n\n")]
        paras = [p for p in paras if p]
        if paras:
            articles.append((paras[0][:80], paras[1:]))
    out = T.write_wikitext_layout(articles, folder)
    sizes = {}
    for s in ("train", "valid", "test"):
        with open(os.path.join(out, f"wiki.{s}.tokens"), encoding="utf-8") as f:
            sizes[s] = sum(len(line.split()) + 1 for line in f)
    print(f"wrote {len(articles)} articles to {out}: " + ", ".join(f"{s} {n:,} tokens" for s, n in sizes.items()))
    return 0


def report_command(runs: str, out: str) -> int:
    from reporting.report import REPORT_FOLDERS, report     # the reports load only for their commands
    if not os.path.isdir(runs):
        raise UsageError(f"report: {runs} is not a folder of runs")
    if not any(os.path.isdir(os.path.join(runs, t)) for t in REPORT_FOLDERS):
        held = [d for d in sorted(os.listdir(runs)) if os.path.isdir(os.path.join(runs, d))]
        runs_inside = [d for d in held if RunFolder(os.path.join(runs, d)).holds_run()]
        if runs_inside or os.path.basename(os.path.normpath(runs)) in REPORT_FOLDERS:
            hint = (f"it looks like one table's folder (it holds run folders such as {runs_inside[0]}); give the "
                    f"folder above it: python train.py report {os.path.dirname(os.path.normpath(runs)) or '.'} {out}"
                    if runs_inside else "give the folder above it")
        else:
            hint = "give the folder reproduce.sh --runs wrote (e.g. runs/quick)"
        raise UsageError(f"report: {runs} holds none of the table folders ({', '.join(REPORT_FOLDERS)}), so there is "
                         f"nothing to report and nothing was written; {hint}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"report: {out} is a file; give a folder for the tables and figures")
    try:
        written = report(runs, out)
    except OSError as e:
        if e.errno not in STORAGE_ERRORS and e.errno not in (errno.ENOTDIR, errno.ENOENT):
            raise
        raise UsageError(f"report: cannot write {e.filename or out} ({e.strerror}); every file written before "
                         f"is whole: give another folder, or free space, and report again") from None
    for path in written:
        print(f"wrote {path}")
    return 0


def main(argv=None) -> int:
    try:
        flags, explicit = parse_args(argv)
        if flags.command == "summarize":
            from reporting.report import summarize
            missing = [p for p in flags.paths if not os.path.exists(p)]
            if missing:
                raise UsageError(f"summarize: {missing[0]} does not exist; give run folders, or folders of them")
            print(summarize(flags.paths), end="")
            return 0
        if flags.command == "report":
            return report_command(flags.runs, flags.out)
        if flags.command == "make-digits":
            return make_digits(flags.folder)
        if flags.command == "make-wikitext":
            return make_wikitext(flags.folder, flags.files)
        return run(flags, explicit)
    except (UsageError, T.TaskError) as e:
        if os.environ.get("RANK", "0") == "0":              # under torchrun, rank 0 speaks for all
            print(f"error: {e}", file=sys.stderr)
        return getattr(e, "status", 2)
    except QuietExit:
        return 2


if __name__ == "__main__":
    sys.modules["train"] = sys.modules["__main__"]      # `import train` (the reports) is this module, not a copy
    sys.exit(main())
