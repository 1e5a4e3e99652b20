"""A run's configuration: every flag of `train.py` as a field of one frozen dataclass (`Config`), each field saying
what its flag is (`setting`); `resolve` fills a Config once (the flag given, else the task's preset, else the
default), and `check` is the one pass over it (each number in its range, each flag given where it applies, the rules
between flags) before anything is built or written. A saved Config (a checkpoint's, args.json's) is read back
through `saved_config`. train.py generates its argparse from this table; nothing changes a Config after `resolve`
(what a task sizes, train.size_schedule fills into a new one); args.json is `asdict(config)`."""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial

import torch

import inits
import maskprior as mp
import runfiles
import tasks

UsageError = runfiles.UsageError

# the argparse groups of the flags (a field's `group`); a family's (runfiles.KINDS) holds its task options
GROUPS = {"run": "run", "optimisation": "optimisation", "model": "model", "prior": "prior",
          "boolean": "Boolean tasks (parity2, majority3, cyclic3, kparity, kmajority, ksum)",
          "arithmetic": "arithmetic (addition, multiplication)", "vision": "vision (cifar10, cifar100, imagenet100)",
          "lm": "language modelling (wikitext2, tinystories; --data-dir as above)",
          "sampling": "sampling from a trained language model"}


def setting(default=None, help=None, *, group: str, type=None, switch=False, choices=None, metavar=None, check=None,
            resumable=False, arch=False, tells_apart=True, alternative=None, needs=None, excludes=()):
    """A Config field and its flag --NAME-WITH-DASHES. type: int or float (None: a string); switch: a flag without a
    value; check: a key of CHECKS; resumable: --resume may change it; arch: it shapes the model or the data (named so
    when a resume disagrees); tells_apart: runs that differ in it are different configurations in reports; alternative:
    the field this one replaces when given (--steps drops the preset's --epochs and the other way round). Where the flag
    applies (`check` refuses it given anywhere else): needs, {key: allowed}, each key a field (its resolved value) or
    "kind" (the task's family), allowed a tuple of values, GIVEN (not None) or ON (not zero); excludes, the fields that
    may not be given with it. A task option (a family's group) applies to the tasks whose constructor takes it."""
    return field(default=default, metadata=dict(help=help, group=group, type=type, switch=switch, choices=choices,
                                                metavar=metavar, check=check, resumable=resumable, arch=arch,
                                                tells_apart=tells_apart, alternative=alternative, needs=needs or {},
                                                excludes=tuple(excludes)))


GIVEN, ON = "given", "on"       # a `needs` condition other than a tuple of values: the field is set, or not zero


# The inits by what their records say (inits.INITS): the model owns an M; the init writes the task's prior (a
# pattern or M) into the model; it solves Wq Wk in closed form (init_qk_svd_)
INITS, MASK_INITS, PRIOR_INITS = inits.INITS, inits.named(owns_m=True), inits.named(reads_prior=True)
QK_SVD_INITS = inits.named(closed_form=True)
LEVELS = ("boolean", "arithmetic", "vision")        # families whose M has on / off levels (--mask-on, --mask-off)

# `setting` for the fields of each argparse group, in GROUPS' order
run_, opt_, model_, prior_, bool_, arith_, vision_, lm_, sample_ = (partial(setting, group=g) for g in GROUPS)


QK_OPT, DISCOVERED = {"init": ("qk-opt",)}, {"pattern": ("discovered",)}
WHERE = dict(resumable=True, tells_apart=False)     # where and how a run runs: a resume may change it


@dataclass(frozen=True)
class Config:
    """Every setting of a training run, one field per flag (see `setting` for what a field carries)."""
    task: str = run_("parity2", "task name: {tasks} (default parity2)", arch=True)
    init: str = run_("default", "initialisation: {inits} (default default)", arch=True, tells_apart=False)
    preset: str = run_("small", "named hyper-parameters: small (2-core CPU; the default) or "
                                "paper (the paper's setting, for a GPU)")
    seed: int = run_(0, "seed for data, init and order, 0 .. 2^32 - 1 (torch's CPU generator keeps 32 bits; default 0)",
                     type=int, check="seed", tells_apart=False)
    out: str | None = run_(None, "run directory (default runs/TASK-INIT-sSEED)", tells_apart=False)
    resume: bool = run_(False, "continue the run in --out from its checkpoint", switch=True, **WHERE)
    device: str = run_("auto", "auto (cuda, mps, cpu; the default), cpu, cuda, ...", **WHERE)
    amp: str = run_("auto", "autocast: auto = bf16 on CUDA only", choices=("auto", "bf16", "off"), **WHERE)
    log_every: int | None = run_(None, "steps between evaluations and log lines", type=int,
                                 check="positive", resumable=True)
    ckpt_every: int | None = run_(None, "steps between checkpoints (default: every log step)",
                                  type=int, check="positive", **WHERE)
    halt_after: int | None = run_(None, "stop at this step as if interrupted (checkpoint kept)",
                                  type=int, check="positive", **WHERE)
    compile: bool = run_(False, "torch.compile the model for training (the probes run it uncompiled)", switch=True,
                         **WHERE)
    dist_timeout: float = run_(1800.0, "under torchrun: seconds to wait for the other processes (joining, and at each "
                                       "collective; default 1800)", type=float, check="positive", **WHERE)
    steps: int | None = opt_(None, "training steps", type=int, check="positive", resumable=True, alternative="epochs")
    epochs: float | None = opt_(None, "training epochs (instead of --steps)", type=float,
                                check="positive", resumable=True, alternative="steps")
    lr: float = opt_(0.0001, "peak learning rate", type=float, check="positive", resumable=True)
    batch_size: int = opt_(64, None, type=int, check="positive")
    weight_decay: float = opt_(0.0, "never applied to M, biases, norms, embeddings", type=float, check="non_negative")
    optimizer: str = opt_("adam", "adam = coupled L2 (GOTU), adamw = decoupled", choices=("adam", "adamw"))
    betas: str = opt_("0.9,0.999", "Adam betas, e.g. 0.9,0.999", check="betas")
    schedule: str = opt_("constant", None, choices=("constant", "cosine"))
    warmup: int = opt_(0, "linear warm-up steps", type=int, check="non_negative", alternative="warmup_epochs")
    warmup_epochs: float | None = opt_(None, "warm-up length in epochs (instead of --warmup)",
                                       type=float, check="non_negative", alternative="warmup")
    grad_clip: float = opt_(0.0, "clip the gradient norm (0 = off)", type=float, check="non_negative", resumable=True)
    layers: int = model_(2, None, type=int, check="positive", arch=True)
    heads: int = model_(4, None, type=int, check="positive", arch=True)
    dim: int = model_(64, None, type=int, check="positive", arch=True)
    head_dim: int | None = model_(None, "default dim // heads", type=int, check="positive", arch=True)
    mlp_dim: int = model_(256, "hidden units of each MLP", type=int, check="positive", arch=True)
    emb_init_std: float = model_(1.0, "std of the token and CLS embeddings (GOTU: 1)", type=float,
                                 check="gain0", arch=True)
    pos_init_std: float = model_(1.0, "std of the positional embedding (GOTU: 1)", type=float, check="gain0", arch=True)
    qkv_bias: bool | int = model_(False, "bias on the q, k, v projections", type=int, choices=(0, 1), arch=True)
    dropout: float = model_(0.0, "dropout on embeddings, attention output and MLP", type=float,
                            check="fraction", arch=True)
    drop_path: float = model_(0.0, "stochastic depth: the last block skips its branches with this probability, "
                                   "linearly less before it (timm's schedule; 0 = off)", type=float, check="fraction")
    ema: float = model_(0.0, "also keep a moving average of the weights with this decay (e.g. 0.9999), evaluated "
                             "beside them (ema_* metrics); 0 = off", type=float, check="fraction")
    attention: str = model_("auto", "scaled_dot_product_attention (fused), the explicit softmax, "
                                    "or for M torch's flex_attention (CUDA); auto = fused, but "
                                    "explicit for a masked model of <= 128 positions on the CPU",
                            choices=("auto", "fused", "explicit", "flex"), tells_apart=False)
    pattern: str | None = prior_(None, "interaction pattern variant (task-specific; see README)", arch=True)
    mask_on: float = prior_(mp.M_ON, "initial M on allowed pairs", type=float,
                            check="non_negative", needs={"init": MASK_INITS, "kind": LEVELS})
    mask_off: float = prior_(mp.M_OFF, "initial -M elsewhere", type=float, check="non_negative",
                             needs={"init": MASK_INITS, "kind": LEVELS})
    mask_param: str = prior_("full", "M per (query, key) pair (heads x N x N; the paper's), relative: one logit per "
                                     "head and distance i - j (heads x N; language models), or grid: per head and "
                                     "patch displacement plus the class token's row and column (vision)",
                             choices=("full", "relative", "grid"), arch=True, needs={"init": MASK_INITS})
    qk_svd_scale: float = prior_(1000.0, "qk-svd target logit on the pattern", type=float,
                                 check="gain", needs={"init": QK_SVD_INITS})
    qk_svd_noise: float = prior_(3.0, "qk-svd off-pattern noise scale", type=float,
                                 check="gain0", needs={"init": QK_SVD_INITS})
    qk_svd_norm: float = prior_(7.0, "qk-svd Frobenius norm of each factor", type=float,
                                check="gain", needs={"init": QK_SVD_INITS})
    qk_svd_pos_scale: float | None = prior_(None, "qk-svd: multiply the positional embedding first (impulse and "
                                                  "mask-impulse: 18 unless given)", type=float, check="gain",
                                            needs={"init": ("qk-svd", "impulse", "mask-impulse")})
    qk_opt_steps: int = prior_(10000, "qk-opt Adam steps (at most)", type=int, check="positive", needs=QK_OPT)
    qk_opt_lr: float = prior_(0.0001, None, type=float, check="gain", needs=QK_OPT)
    qk_opt_tol: float = prior_(1e-07, "qk-opt stops when 100 steps gain less than this",
                               type=float, check="non_negative", needs=QK_OPT)
    qk_opt_pos_scale: float | None = prior_(None, "qk-opt: multiply the positional embedding first", type=float,
                                            check="positive", needs=QK_OPT)
    prior_from: str | None = prior_(None, "a finished run of the same task and token layout (a teacher): the prior is "
                                          "read from its attention instead of the task's hand pattern", metavar="RUN",
                                    arch=True, needs={"init": PRIOR_INITS}, excludes=("pattern",))
    prior_kind: str | None = prior_(None, "what --prior-from reads: pattern (keys or query-key pairs above "
                                          "--prior-ratio x the uniform share), logits (M whose bias gives the "
                                          "teacher's mean attention), relative (per head and distance) or offsets "
                                          "(per head and 2-D offset); default: the task's first",
                                    choices=("pattern", "logits", "relative", "offsets"), arch=True,
                                    needs={"prior_from": GIVEN})
    prior_ratio: float = prior_(1.5, "--prior-kind pattern: keep what gets at least this multiple of the uniform "
                                     "attention share (default 1.5)", type=float, check="positive", arch=True,
                                needs={"prior_from": GIVEN, "prior_kind": ("pattern",)})
    teacher_min_fit: float | None = prior_(None, "refuse a teacher fitting less of its training inputs (default: "
                                                 "Boolean 0.95, arithmetic 0.9, vision 0.5, language 0.2)", type=float,
                                           check="unit", arch=True, needs={"prior_from": GIVEN})
    probe_size: int = prior_(512, "batch size of the prior-mass probe", type=int, check="positive")
    eval_points: int = prior_(0, "evaluate the log steps on a fixed sample of this many cube points or test pairs "
                                 "(0 = all); the final evaluation uses all of them", type=int, check="non_negative",
                              resumable=True, needs={"kind": ("boolean", "arithmetic")})
    readout: str | None = bool_(None, "a CLS token in front, read out (GOTU), or no CLS token and mean pooling over "
                                      "the bit tokens; the pattern follows the layout",
                                metavar="{" + ",".join(tasks.READOUTS) + "}", arch=True)
    n_bits: int = bool_(15, "kparity/kmajority/ksum: input bits (default 15)", type=int, arch=True)
    bits: str = bool_("0,1,2", "kparity/kmajority: bits the target reads (default 0,1,2; random:K: K drawn by the "
                               "seed)", arch=True)
    terms: str = bool_("0,1:2,3,4", "ksum: a sum of terms split by ':', each its bits' parity, or majority led by m "
                                    "(default 0,1:2,3,4 = x0 x1 + x2 x3 x4)", arch=True)
    unseen: str = bool_("0,1", "kparity/kmajority/ksum: bits at -1 in the unseen domain (default "
                               "0,1; bits:J: the first J of --bits)", arch=True)
    train_size: int | None = bool_(None, "kparity/kmajority/ksum: draws from the seen domain (default: all)", type=int)
    discover_degree: int = bool_(3, "--pattern discovered: the Walsh sets of the training data of up to this many bits "
                                    "(default 3)", type=int, arch=True, needs=DISCOVERED)
    discover_threshold: float = bool_(0.25, "--pattern discovered: keep the sets whose Walsh coefficient is at least "
                                            "this fraction of the largest (default 0.25)", type=float, arch=True,
                                      needs=DISCOVERED)
    discover_alpha: float = bool_(0.05, "--pattern discovered: the chance a set (digit pair) of no dependence passes "
                                        "the noise cut (default 0.05)", type=float, arch=True, needs=DISCOVERED)
    data_frac: float | None = arith_(None, "fraction of the 10^(2 x --digits) pairs to train on (default: 0.004 "
                                           "for addition, 0.03 for multiplication)", type=float, arch=True)
    answer_order: str = arith_("msb", "answer digits most significant first (the paper's plain format; the default) or "
                                      "reversed", metavar="{msb,lsb}", arch=True)
    digits: int = arith_(3, "digits per operand: 3 (the default; 10^6 pairs), 2 (10^4 pairs, Lee et al.'s "
                            "multiplication), 1 or 4", type=int, metavar="{1,2,3,4}", arch=True)
    lee_samples: int | None = arith_(None, "multiplication, --digits 2: Lee et al.'s data instead, N samples (the "
                                           "100 one-digit pairs, then N - 100 drawn with replacement; theirs: "
                                           "3000), unpadded a*b=c, tested on every pair not trained on",
                                     type=int, arch=True, metavar="N")
    data_dir: str | None = vision_(None, "folder holding the dataset files (e.g. the one with "
                                         "cifar-10-batches-py/; for language models the corpus folder)", **WHERE)
    image_size: int | None = vision_(None, "image side in pixels as stored (CIFAR 32; ImageNet-100 32 or 64)",
                                     type=int, check="positive", arch=True)
    input_size: int | None = vision_(None, "the model's image side (default: the image size); larger upsamples, e.g. "
                                           "224 for CIFAR as the paper preset's recipe does", type=int,
                                     check="positive", arch=True)
    patch_size: int | None = vision_(None, "ViT patch side in pixels", type=int, check="positive", arch=True)
    pool: str | None = vision_(None, "ViT readout: global average pooling or a CLS token",
                               choices=("mean", "cls"), arch=True)
    impulse: str = vision_("fixed", "impulse offsets per head: fixed order (self, up, right, ...; the default) or "
                                    "random (drawn by the seed)", metavar="{fixed,random}", arch=True,
                           needs={"pattern": ("impulse", "soft", "graded")})
    soft_alpha: float = vision_(1.0, "--pattern soft: log sigmoid(M) = -alpha x squared distance (in patches) to the "
                                     "head's offset (default 1.0)", type=float, arch=True, needs={"pattern": ("soft",)})
    window: int = vision_(3, "--pattern local: the side of every head's window, in patches (odd; default 3)", type=int,
                          arch=True, needs={"pattern": ("local",)})
    label_smoothing: float | None = vision_(None, None, type=float, check="fraction")
    mixup: float = vision_(0.0, "mixup Beta(alpha, alpha); 0 = off", type=float, check="non_negative")
    cutmix: float = vision_(0.0, "cutmix Beta(alpha, alpha); 0 = off", type=float, check="non_negative")
    crop: str = vision_("pad", "training crop: pad 4 and crop back, or a random resized crop to the input size (scale "
                               "0.08-1); a flip either way", metavar="{pad,rrc}")
    crop_pct: float = vision_(0.875, "evaluation at another input size: resize to input / crop-pct, keep the centre "
                                     "(default 0.875)", type=float, needs={"input_size": GIVEN})
    randaug: float = vision_(0.0, "RandAugment magnitude in [0, 10] (0 = off; the recipe: 9)", type=float)
    randaug_std: float = vision_(0.5, "RandAugment: std of the per-image magnitude noise (default 0.5)", type=float,
                                 check="non_negative", needs={"randaug": ON})
    randaug_ops: int = vision_(2, "RandAugment: ops per image (default 2)", type=int, needs={"randaug": ON})
    reprob: float = vision_(0.0, "random erasing probability (0 = off; the recipe: 0.25)", type=float)
    context: int | None = lm_(None, "context length in tokens (also the model's positions)", type=int, arch=True)
    val_tokens: int | None = lm_(None, "evaluate on the first N validation tokens (0 = all)", type=int)
    positions: str = lm_("learned", "the positional embedding: a learned table of --context positions (the default), "
                                    "or none (the order from the causal mask and the prior, as ALiBi: the model serves "
                                    "any length)", metavar="{learned,none}", arch=True)
    eval_context: int = lm_(0, "also evaluate in windows of N tokens, e.g. twice --context (long_val_loss, "
                               "long_val_ppl; past --context it needs --positions none; 0 = off)", type=int,
                            metavar="N", resumable=True)
    mask_window: int | None = lm_(None, "a relative M of N distances, the last read past them (default: --context); "
                                        "its gradient costs O(T N)", type=int, metavar="N", arch=True,
                                  needs={"init": MASK_INITS, "mask_param": ("relative",)}, excludes=("prior_from",))
    sample: str | None = sample_(None, "print a continuation of PROMPT from the checkpoint in "
                                       "--out and exit (no training)", metavar="PROMPT", **WHERE)
    sample_tokens: int = sample_(100, "tokens to generate (default 100)", type=int,
                                 check="positive", needs={"sample": GIVEN}, **WHERE)
    temperature: float = sample_(0.8, "0 = greedy (default 0.8)", type=float, check="non_negative",
                                 needs={"sample": GIVEN}, **WHERE)
    top_k: int = sample_(40, "sample among the k likeliest (0 = all; default 40)", type=int,
                         check="non_negative", needs={"sample": GIVEN}, **WHERE)


FIELDS = {f.name: f for f in fields(Config)}
DEFAULTS = {name: f.default for name, f in FIELDS.items()}
RESUMABLE = {name for name, f in FIELDS.items() if f.metadata["resumable"]}
ARCH = {name for name, f in FIELDS.items() if f.metadata["arch"]}
NOT_TELLING_APART = {name for name, f in FIELDS.items() if not f.metadata["tells_apart"]}
ALTERNATIVES = {name: f.metadata["alternative"] for name, f in FIELDS.items() if f.metadata["alternative"]}
TASK_FLAGS = {name for name, f in FIELDS.items() if f.metadata["group"] in runfiles.KINDS}
NEEDS = {name: f.metadata["needs"] for name, f in FIELDS.items() if f.metadata["needs"]}
EXCLUDES = {name: f.metadata["excludes"] for name, f in FIELDS.items() if f.metadata["excludes"]}


def say(text: str) -> None:
    """A line of progress on standard output, from one process (under torchrun, rank 0's)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


def resolve(flags: argparse.Namespace, explicit: set) -> Config:
    """Each field: the flag given, else --config's run (`rerun`) or the task's preset, less the given flags'
    alternatives, else its default."""
    given = {k: getattr(flags, k) for k in explicit}
    for name, other in ALTERNATIVES.items():
        if name in explicit and other in explicit:
            raise UsageError(f"give either {flag(name)} or {flag(other)}, not both")
    base = rerun(flags.config, given) if getattr(flags, "config", None) is not None else {}
    task, init, preset = (given.get(k, base.get(k, DEFAULTS[k])) for k in ("task", "init", "preset"))
    if task not in tasks.TASKS:
        raise UsageError(f"unknown task {task!r}; choose from {', '.join(tasks.TASKS)}")
    if init not in INITS:
        raise UsageError(f"unknown init {init!r}; choose from {', '.join(INITS)}")
    task_cls = tasks.TASKS[task]
    if preset not in task_cls.presets():
        raise UsageError(f"unknown preset {preset!r}; choose from {', '.join(task_cls.presets())}")
    values = {**DEFAULTS, **(base or task_cls.preset(preset)), **given,
              **{ALTERNATIVES[name]: DEFAULTS[ALTERNATIVES[name]] for name in explicit & set(ALTERNATIVES)}}
    if values["out"] is None:
        values["out"] = os.path.join("runs", f"{task}-{init}-s{values['seed']}")
    return Config(**values)


def rerun(path: str, given: dict) -> dict:
    """--config RUN/args.json: the flags that run saved (`saved_config`), as a new run's (not resumed, not halted),
    each flag given beside them said in a line; refused where --out is not given and the folder the file names is
    there (the rerun would write into that run)."""
    try:
        saved = asdict(saved_config(runfiles.read_json(path), path))
    except UsageError as e:
        raise UsageError(f"--config: {e}; it reads the args.json a run wrote in its folder") from None
    if "out" not in given and os.path.lexists(saved["out"]):
        raise UsageError(f"--config {path}: its run folder {saved['out']} is there; give the rerun its own --out")
    for name, value in ((n, given[n]) for n in FIELDS if n in given):
        alt = ALTERNATIVES.get(name)
        dropped = f"; {flag(alt)} {saved[alt]} dropped" if alt and saved[alt] != DEFAULTS[alt] else ""
        say(f"--config: {flag(name)}{'' if value is True else f' {value}'} (was {saved[name]}{dropped})")
    return {**saved, "resume": False, "halt_after": None}


SEED_MAX = 2 ** 32 - 1          # torch's CPU generator keeps the low 32 bits of a seed


def betas_pair(text: str) -> bool:
    """--betas: two numbers in [0, 1) separated by a comma."""
    try:
        b = tuple(float(x) for x in text.split(","))
    except ValueError:
        return False
    return len(b) == 2 and all(0 <= x < 1 for x in b)


# a field's `check`: (holds(value), what the value must be)
CHECKS = {"positive": (lambda v: v > 0, "> 0"), "non_negative": (lambda v: v >= 0, ">= 0"),
          "fraction": (lambda v: 0 <= v < 1, "in [0, 1)"), "unit": (lambda v: 0 <= v <= 1, "in [0, 1]"),
          "seed": (lambda v: 0 <= v <= SEED_MAX, f"in 0 .. {SEED_MAX} (torch's CPU generator keeps 32 bits, so a "
                                                 "larger seed would train the same weights as a smaller one)"),
          "betas": (betas_pair, "two numbers in [0, 1) like 0.9,0.999"),
          # the library's bound on a QK init's gains and an embedding's std (mp.MAX_GAIN: its solve overflows past it)
          "gain": (lambda v: 0 < v <= mp.MAX_GAIN, f"> 0 and <= {mp.MAX_GAIN:,.0f}"),
          "gain0": (lambda v: 0 <= v <= mp.MAX_GAIN, f">= 0 and <= {mp.MAX_GAIN:,.0f}")}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def out_of_range(name: str, value) -> str | None:
    """The line refusing a value of field `name` that its `check` does not hold (None: it holds)."""
    check = FIELDS[name].metadata["check"]
    if check is None or value is None:
        return None
    holds, what = CHECKS[check]
    if isinstance(value, str):
        return None if holds(value) else f"{flag(name)} must be {what}, got {value!r}"
    if (isinstance(value, int) or math.isfinite(value)) and holds(value):
        return None
    kind = "an integer" if isinstance(value, int) else "a finite number"
    return f"{flag(name)} must be {kind} {what}, got {value}"


def applied_value(config: Config, key: str):
    """What a `needs` condition reads: the task's family ("kind"), or a field's resolved value (task default)."""
    task = tasks.TASKS[config.task]
    if key == "kind":
        return task.KIND
    if key == "pattern":
        return config.pattern or task.DEFAULT_PATTERN
    if key == "prior_kind":
        return config.prior_kind or task.TEACHER_KINDS[0]
    return getattr(config, key)


def unmet(key: str, allowed, value) -> str | None:
    """What a flag needs of `key` when `value` does not meet `allowed` (None: it does)."""
    if allowed == GIVEN:
        return None if value is not None else f"with {flag(key)}"
    if allowed == ON:
        return None if value else f"with {flag(key)} above 0 (here {value})"
    if value in allowed:
        return None
    if key == "kind":
        return f"to the {' and '.join(allowed)} tasks (this task is {value})"
    return f"with {flag(key)} {' or '.join(map(str, allowed))} (here {value})"


def not_applying(config: Config, name: str, explicit) -> str | None:
    """The line refusing flag `name` given where it does not apply (None: it applies): a task option of another task
    (its constructor does not take it), a field's `needs` unmet, or given with what it `excludes`."""
    task = tasks.TASKS[config.task]
    options = [o for o in task.options() if o in FIELDS]
    if name in TASK_FLAGS and name not in options:
        what = f" (use --pool for {config.task})" if name == "readout" and task.KIND == "vision" else ""
        return (f"{flag(name)} does not apply to task {config.task} ({task.KIND}){what}; its task options "
                f"are: {', '.join(flag(o) for o in options if o != 'heads')}")
    for key, allowed in NEEDS.get(name, {}).items():
        if need := unmet(key, allowed, applied_value(config, key)):
            return f"{flag(name)} applies only {need}; leave it out or give what it needs"
    for other in EXCLUDES.get(name, ()):
        if other in explicit:
            return f"give {flag(name)} or {flag(other)}, not both ({flag(name)} replaces {flag(other)})"
    return None


# The rules between flags, read once the task is built: (broken(config, task), the line that says so)
RULES = (
    (lambda c, t: c.steps is None and c.epochs is None,
     lambda c, t: "give --steps or --epochs (no preset sets them for this task)"),
    (lambda c, t: c.init not in t.inits(),
     lambda c, t: f"init {c.init!r} does not apply to task {c.task} ({t.KIND}); choose from "
                  f"{', '.join(t.inits())}{getattr(t, 'inits_why', '')}"),
    (lambda c, t: c.head_dim is None and c.dim % c.heads,
     lambda c, t: f"--dim {c.dim} is not divisible by --heads {c.heads}; set --head-dim"),
    (lambda c, t: c.pattern == "",
     lambda c, t: f"--pattern needs a name; {c.task}'s patterns are {', '.join(t.PATTERNS)} (leave the flag "
                  f"out for the default, {t.pattern_name(None)})"),
    (lambda c, t: not t.pattern_name(c.pattern), None),          # the task refuses a pattern it has not
    (lambda c, t: c.attention == "flex" and (c.init not in MASK_INITS or pick_device(c.device).type != "cuda"),
     lambda c, t: "--attention flex runs M through torch's flex_attention: it needs --init mask or mask-impulse "
                  "and CUDA (it has no backward on the CPU); use --attention fused or explicit"),
    (lambda c, t: getattr(t, "positions", "learned") == "none" and c.init not in ("default", *MASK_INITS),
     lambda c, t: f"--init {c.init} fits its pattern on the positional embedding, which --positions none leaves "
                  "out; use --init mask or default there, or --positions learned"),
    (lambda c, t: (getattr(t, "eval_context", 0) > getattr(t, "context", 0) and c.init in MASK_INITS
                   and c.mask_param == "full"),
     lambda c, t: f"--eval-context {t.eval_context} is past --context {t.context}, which a full M (N x N) cannot "
                  "serve: give --mask-param relative (its distances serve any length)"),
    (lambda c, t: c.mask_param == "grid" and t.KIND != "vision",
     lambda c, t: f"--mask-param grid is a 2-D relative M over an image's patch grid, and {c.task} is a "
                  f"{t.KIND} task: use full or relative"),
    (lambda c, t: c.prior_kind not in (None, *t.TEACHER_KINDS),
     lambda c, t: f"--prior-kind {c.prior_kind} does not apply to task {c.task}; choose from "
                  f"{', '.join(t.TEACHER_KINDS)}"),
)


def check(config: Config, explicit=frozenset(), rules: bool = True) -> tasks.Task | None:
    """The one check of a run's flags, before anything is built or written: each field's value in its range (its
    `check`), each flag given where it applies (`not_applying`), then (rules) the task they name built (`task_for`,
    returned) and the rules between flags (RULES). The first thing wrong is one line (UsageError)."""
    for name in FIELDS:
        line = out_of_range(name, getattr(config, name))
        if line is None and name in explicit:
            line = not_applying(config, name, explicit)
        if line is not None:
            raise UsageError(line)
    if not rules:
        return None
    task = task_for(config)
    for broken, line in RULES:
        if broken(config, task):
            raise UsageError(line(config, task))
    return task


def task_for(config) -> tasks.Task:
    """The task of config.task, given its options (flags of the same names) and the seed."""
    options = {k: getattr(config, k) for k in tasks.TASKS[config.task].options()
               if k in FIELDS and getattr(config, k) is not None}
    task = tasks.make_task(config.task, seed=config.seed, **options)
    task.say = say                  # the task's word on its slow work (the exact MDI), from one process
    return task


# --attention auto on the CPU: a masked model of at most this many positions runs the explicit softmax, faster
# there than the fused kernel with M's gradient (bench_context.py --paths all)
EXPLICIT_UP_TO = 128


def use_fused(attention: str, masked: bool = False, device: torch.device = torch.device("cpu"), n: int = 0) -> bool:
    """--attention auto: fused, but explicit for a masked model of at most EXPLICIT_UP_TO positions on the CPU."""
    if attention == "auto":
        return not (masked and device.type == "cpu" and n <= EXPLICIT_UP_TO)
    return attention == "fused"


def model_config(config, task, device=torch.device("cpu")):
    """The model config of a run: the task's arch() family (mp.family_of), its trunk and own fields from flags."""
    arch = task.arch()
    family = mp.family_of(arch)
    trunk = dict(dim=config.dim, n_layers=config.layers, n_heads=config.heads, head_dim=config.head_dim,
                 mlp_dim=config.mlp_dim, learnable_mask=config.init in MASK_INITS, flex=config.attention == "flex",
                 qkv_bias=bool(config.qkv_bias), dropout=config.dropout, pos_init_std=config.pos_init_std,
                 drop_path=config.drop_path, mask_param=config.mask_param, mask_window=config.mask_window)
    own = {k: v for k, v in dict(emb_init_std=config.emb_init_std).items() if k in {f.name for f in fields(family)}}
    cfg = family(**arch, **trunk, **own)
    cfg = replace(cfg, fused=use_fused(config.attention, cfg.learnable_mask, device, cfg.n_positions))
    return sized(cfg, device)


def sized(cfg, device: torch.device):
    """`cfg` where its model fits this machine: its parameters (counted on the meta device) at 16 bytes each (weights,
    gradients, Adam's two moments) within the device's memory; else one line (not the allocator's traceback)."""
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in mp.build_model(cfg).parameters())
    except (RuntimeError, OverflowError, ValueError):
        params = None
    memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
              else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    if params is not None and 16 * params <= memory:
        return cfg
    size = "more parameters than torch can count" if params is None else f"{params:,} parameters"
    raise UsageError(f"the model of these flags has {size}, and training it takes 16 bytes each (weights, gradients, "
                     f"Adam's moments): more than this {device.type}'s {memory / 2 ** 30:.0f} GiB; give a smaller "
                     "--dim, --mlp-dim, --layers or --heads")


def pick_device(name: str) -> torch.device:
    """--device: auto (cuda, else mps, else cpu) or one torch has."""
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
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
    if dev.type == "mps" and not mps:
        raise UsageError("--device mps asked for, but torch sees no Apple GPU (MPS); use --device cpu")
    return dev


def saved_config(saved: dict, where: str) -> Config:
    """The Config of flags a run saved (a checkpoint's, args.json's): every flag of this version, each of its
    field's type and choices (`value_fits`), in range (`check`); anything else is one line naming the flag."""
    if not isinstance(saved, dict):
        raise UsageError(f"{where} holds a {type(saved).__name__}, not the object of a run's flags")
    missing = [name for name in FIELDS if name not in saved]
    unknown = sorted(set(saved) - set(FIELDS))
    if missing or unknown:
        what = f"no {missing[0]}" if missing else f"{unknown[0]}, which is no flag of this version"
        raise UsageError(f"{where} holds the flags of another version of train.py ({what}); "
                         "continue the run with the version that wrote it, or start a new run")
    for name, value in saved.items():
        if not value_fits(name, value):
            raise UsageError(f"{where} has {name}={value!r}, which {flag(name)} cannot take")
    config = Config(**saved)
    try:
        check(config, rules=False)
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
    choices = m["choices"] or {"task": tuple(tasks.TASKS), "init": tuple(INITS)}.get(name)
    return ok and (not choices or value in choices)
