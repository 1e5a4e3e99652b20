"""How the language-model prior scales with the context, side by side as ratios to default (no M) at each context
length N: parameters, training-step time and peak memory of the floor (default's model reading the relative prior's
bias as a constant through the prior's kernel call), the full M, the relative M, windows of W = 64, 128, 256
distances, and beside each M what a plain implementation pays (:sdpa, SDPA with a learnt mask; :explicit, the
explicit softmax). The legend printed under the table says what each row and column is and which rows compute the
same function; what M itself costs is a row's /floor column.

    python benchmarks/bench_context.py                              # N = 256 ... 2048, one CPU thread
    python benchmarks/bench_context.py --sizes 256,1024,2048,4096 --rounds 5
    python benchmarks/bench_context.py --device cuda --amp bf16 --paths all   # every attention path, side by side
    python benchmarks/bench_context.py --only relative128,relative128:explicit   # these rows (and default, floor)

`--paths all` runs each M through every attention path: ours (mp.prior_attention), the windows' band and far part
forced (:band), SDPA with a learnt mask (:sdpa; on CUDA its memory-efficient kernel), the explicit softmax and
torch's flex_attention (CUDA only, as its backward is).

The model is a 2-layer, width-128, 4-head causal decoder over bytes (vocabulary 257), batch 4, train.py's step (forward,
backward, AdamW update). Every variant of one N runs in one process, timed in interleaved rounds (warm-up excluded) so
that drifts in machine load hit all alike; peak memory on the CPU is measured with each variant alone in a fresh
process. The table is on stdout, with the legend under it; what runs, N by N, on stderr. Why the floor was once slower
than the prior (it was not the prior's kernel call): results/speed/README.md."""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import maskprior_fast  # noqa: E402
import runconfig  # noqa: E402
import train  # noqa: E402
from bench_attention import round_ratios, sync, timed_rounds  # noqa: E402

# the rows: each M through our path (mp.prior_attention), beside what a plain implementation of a learnable bias pays
# (SDPA with the bias as attn_mask, the explicit softmax) for the full and the relative M; windows of W distances
VARIANTS = ("default", "floor", "full", "full:sdpa", "full:explicit", "relative", "relative:sdpa", "relative:explicit",
            "relative64", "relative128", "relative256")
PRIORS = ("full", "relative", "relative64", "relative128", "relative256")
# --paths all: every M through each path this device has (band: the windowed prior's band and far part, forced)
PATHS = {"auto": (), "all": ("auto", "band", "sdpa", "explicit", "flex")}
COLUMNS = (f"{'N':>6}  {'variant':<22}{'params':>9}{'ms/step':>10}{'ratio':>8}{'min-max':>13}{'/floor':>8}"
           f"{'peak MiB':>10}{'ratio':>7}")
LEGEND = """\
params: trainable parameters; ms/step: the median over the rounds (on the CPU this thread's CPU time, which other
  work on a shared machine stretches less than the wall clock; on CUDA the wall clock).
ratio: the median over the rounds of the variant's step time over default's in the same round (the rounds are
  interleaved, so a round's machine load cancels); min-max: the lowest and highest of those per-round ratios:
  two ratios whose ranges overlap differ by noise. /floor: the same per-round ratio to the floor: what M itself
  costs (its gradient, with the backward that gives it, its bias, its optimiser state). peak MiB: on the CPU each
  variant alone in a fresh process (resident memory); on CUDA in the timing process, a step's peak allocation over
  what was resident plus the variant's parameters, gradients and AdamW state; and its ratio to default's.
default: no M (SDPA, is_causal). floor: default's model reading the relative prior's bias as a constant, through
  the kernel call of the prior's fused path (on the CPU the fused kernel with the bias and is_causal), with the
  kernel's own backward: what reading a bias costs the kernel.
full: M per query and key (heads x N x N); relative: M per distance (heads x N); relativeW: a table of W distances
  (W = 64, 128, 256; past W the table's last logit), for every N. A row without a path is ours, mp.prior_attention:
  on the CPU the fused kernel with the bias and our backward, and a relativeW over at least max(2,048, 8 W) tokens
  its band (distances < W, by hand, O(N x W)) and far part (the kernel's causal attention, no bias), merged by
  log-sum-exp (maskprior_fast.BAND_FROM); on CUDA SDPA with the bias. A CPU run of N <= 128 takes the explicit path
  for M (train.py).
The peers, what a plain implementation of a learnable bias pays: :sdpa: F.scaled_dot_product_attention with log
  sigmoid(M) as attn_mask, M learnt (maskprior.py without maskprior_fast.py does the same): a mask that needs a
  gradient takes SDPA's math path on the CPU, its memory-efficient kernel on CUDA; :explicit: the explicit softmax
  (fused=False). --paths all adds :band (the band and far part, forced) and :flex (flex_attention reading M in its
  kernel, CUDA only) for every M.
Exact equivalents (the same function of the same M: outputs and every gradient equal to rounding, test_maskprior.py
  and test_fast.py hold them so): full = full:sdpa = full:explicit = full:flex; relative = relative:sdpa =
  relative:explicit = relative:flex; relativeW = relativeW:band = the explicit softmax (or SDPA) with that
  relative-W M, whose cost is relative:explicit's (relative:sdpa's): a plain implementation builds the whole
  heads x N x N bias whatever W."""


def replaced(attn: mp.Attention, attend):
    """`attn`'s forward with its attention call swapped for attend(q, k, v) (B, heads, N, head dim) -> the same."""
    def forward(x, return_attn=False, cache=None):
        b, t, _ = x.shape
        q, k, v = attn.qkv(x).view(b, t, 3, attn.n_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        return attn.proj(attend(q, k, v).transpose(1, 2).reshape(b, t, -1)), None
    return forward


def floor_attention(attn: mp.Attention, bias: torch.Tensor):
    """`attn`'s forward reading `bias` (heads, N, N) as a constant through the kernel call of the prior's fused path
    (off the CPU: SDPA with the bias as its mask), with the kernel's own backward, no M: LEGEND's floor."""
    def attend(q, k, v):
        mask, kernel = bias.unsqueeze(0).to(q.dtype), maskprior_fast._cpu_kernel()
        return (kernel(q, k, v, 0.0, True, attn_mask=mask)[0] if kernel and q.device.type == "cpu"
                else F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return replaced(attn, attend)


def sdpa_attention(attn: mp.Attention):
    """`attn`'s forward through SDPA with its prior's bias (log sigmoid(M), -inf ahead) as attn_mask: LEGEND's :sdpa."""
    return replaced(attn, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn.prior(q.shape[-2], q.dtype).unsqueeze(0)))


def band_attention(attn: mp.Attention):
    """`attn`'s forward through the windowed prior's band and far part (maskprior_fast._prior_band), whatever N."""
    return replaced(attn, lambda q, k, v: maskprior_fast._prior_band(q, k, v, attn.prior))


def build(n: int, variant: str, device: torch.device, amp: str):
    """(model, its train.py step) of one variant: "default", "floor", or one of PRIORS, ":PATH" for another path."""
    kind, _, path = variant.partition(":")
    masked, path = kind != "default", path or "auto"
    window = int(kind[len("relative"):]) if kind[len("relative"):].isdigit() else None
    table = min(window, n) if window else n                      # the relative M's distances
    fused = path in ("sdpa", "band") or path == "auto" and train.use_fused(path, masked, device, n)
    cfg = mp.TransformerConfig(vocab_size=257, seq_len=n, n_outputs=257, readout="tokens", causal=True,
                               tie_embeddings=True, n_layers=2, n_heads=4, dim=128, mlp_dim=512, qkv_bias=True,
                               emb_init_std=0.02, pos_init_std=0.02, learnable_mask=masked, fused=fused,
                               flex=path == "flex", mask_param="full" if kind == "full" else "relative",
                               mask_window=table if window else None)
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    if masked:              # ALiBi-like; past float32's range (N = 4,096) a logit of -100 is as good as -inf
        mp.init_mask_(model, logits=mp.causal_distance_logits(table, 4).clamp(min=-100.0))
    for block in model.blocks:
        if kind == "floor":                      # the relative prior's bias, a constant: no M
            block.attn.forward = floor_attention(block.attn, block.attn.prior(n).detach().to(device))
            block.attn.prior = None
        elif path in ("sdpa", "band"):
            block.attn.forward = (sdpa_attention if path == "sdpa" else band_attention)(block.attn)
    model.to(device)
    # train.py's config and task of the language model (the small preset's AdamW; the corpus is never read)
    targs = runconfig.resolve(*train.parse_args(["--task", "wikitext2", "--data-dir", ".", "--device",
                                             str(device), "--amp", amp]))
    task, opt = runconfig.task_for(targs), train.make_optimizer(model, targs)
    x = torch.randint(0, 257, (4, n + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        train.train_step(model, model, opt, task, (x[:, :-1], x[:, 1:]), targs, device, 0)
    return model, step


def time_all(n: int, variants: list, device: str, rounds: int, amp: str) -> dict:
    """{variant: {"params" (trainable), "ms" (median), "ms_rounds" (one a round)}} of one N, in interleaved rounds."""
    torch.set_num_threads(1)
    device = torch.device(device)
    built = {v: build(n, v, device, amp) for v in variants}
    for _, step in built.values():
        step(), step()                                             # warm-up
    steps = {v: step for v, (_, step) in built.items()}
    times = timed_rounds(steps, device, rounds, 1) if device.type == "cuda" else cpu_rounds(steps, rounds)
    mib = cuda_peaks(built, device) if device.type == "cuda" else {}
    return {v: {"params": sum(p.numel() for p in built[v][0].parameters() if p.requires_grad),
                "ms": 1000 * statistics.median(times[v]), "ms_rounds": [1000 * t for t in times[v]],
                **({"mib": mib[v]} if v in mib else {})} for v in variants}


def cpu_rounds(steps: dict, rounds: int) -> dict:
    """{name: [seconds per step, one a round]} as bench_attention.timed_rounds gives them, in this thread's CPU time
    (one thread computes each step), which other work on a shared machine stretches less than the wall clock."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.thread_time()
            step()
            times[name].append(time.thread_time() - t0)
    return times


def cuda_peaks(built: dict, device: torch.device) -> dict:
    """{variant: peak MiB} on CUDA, in this process (no process a variant, each compiling its kernels again): a step's
    peak allocation over what was resident, plus its parameters' bytes: 4 x (weight, gradient, AdamW's 2) if trained."""
    peaks = {}
    for v, (model, step) in built.items():
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        sync(device)
        own = sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1) for p in model.parameters())
        peaks[v] = (torch.cuda.max_memory_allocated(device) - base + own) / 2 ** 20
    return peaks


def peak(n: int, variant: str, device: str, amp: str) -> float:
    """Peak MiB of one variant alone in this process: resident memory on the CPU, allocated memory on CUDA."""
    torch.set_num_threads(1)
    device = torch.device(device)
    _, step = build(n, variant, device, amp)
    step(), step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)     # ru_maxrss is KiB


def run(args: list) -> tuple:
    """(the last stdout line as JSON, None) of this script run with `args`, or (None, why it failed)."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1][:60]
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def say(*line):
    """Progress, on stderr: slow work says what it does before it starts."""
    print("bench_context:", *line, file=sys.stderr, flush=True)


def timings(n: int, variants: list, common: list) -> tuple:
    """({variant: time_all's entry}, why the joint run failed or None) at one N: every variant in one process, or,
    if one of them fails there, each in a process of its own (then the rounds are not paired)."""
    times, failed = run(["--time", str(n), "--variants", ",".join(variants), *common])
    if times is None:
        times = {}
        for v in variants:
            t, _ = run(["--time", str(n), "--variants", v, *common])
            times.update(t or {})
    return times, failed


def rows(n: int, variants: list, times: dict, mib: dict) -> list:
    """The table's lines of one N, a variant a line."""
    rounds = {v: t["ms_rounds"] for v, t in times.items()}
    ratio = round_ratios(rounds, "default")
    to_floor = round_ratios(rounds, "floor") if "floor" in rounds else {}
    lines = []
    for v in variants:
        if v not in times or mib[v] is None:
            lines.append(f"{n:>6}  {v:<22}{'failed':>9}")
            continue
        r, lo, hi = ratio[v]
        span = "" if v == "default" else f"{lo:.3f}-{hi:.3f}"
        floor = f"{to_floor[v][0]:.3f}" if v in to_floor and v not in ("default", "floor") else ""
        lines.append(f"{n:>6}  {v:<22}{times[v]['params'] / 1e6:>7.2f} M{times[v]['ms']:>10.1f}{r:>8.3f}"
                     f"{span:>13}{floor:>8}{mib[v]:>10.0f}{mib[v] / mib['default']:>7.2f}")
    return lines


def notes(n: int, times: dict, device: str, paired: bool) -> list:
    """A line for each prior the floor came out above in the table (ratios to default), with why."""
    lines = [] if paired else [f"{'':>6}  one variant failed beside the others: each timed alone, rounds unpaired"]
    if "floor" not in times:
        return lines
    rounds = {v: t["ms_rounds"] for v, t in times.items()}
    shown, floor = round_ratios(rounds, "default"), round_ratios(rounds, "floor")
    for v, (_, lo, hi) in floor.items():
        if v in ("default", "floor") or shown[v][0] >= shown["floor"][0]:
            continue
        kind, _, path = v.partition(":")
        path, window = path or "auto", kind[len("relative"):]
        if window and (path == "band" or path == "auto" and device == "cpu"
                       and n >= max(maskprior_fast.BAND_FROM, 8 * int(window))):
            why = ("it takes the band and far part, which reads no N x N bias: less work than the floor's kernel "
                   "call with the whole bias" + (" (or noise: the range reaches 1)" if hi >= 1 else ""))
        elif path == "auto" and train.use_fused(path, True, torch.device(device), n):
            why = ("the floor is the kernel call of its path without M's gradient, less work, " +
                   ("so noise: the range reaches 1" if hi >= 1 else "yet above it in every round: rerun with more "
                    "--rounds"))
        else:
            way = {"auto": "the explicit path", "explicit": "the explicit path", "flex": "the flex path",
                   "sdpa": "SDPA with a learnt mask"}[path]
            why = (f"{v} runs {way}, not the floor's kernel call: " +
                   ("noise or a faster path (the range reaches 1)" if hi >= 1 else "faster here in every round"))
        lines.append(f"{'':>6}  floor above {v} ({shown['floor'][0]:.3f} against {shown[v][0]:.3f}): {v} / floor "
                     f"per round {lo:.3f}-{hi:.3f}; {why}")
    return lines


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="off", choices=("off", "bf16"), help="train.py's --amp (bf16 on a GPU)")
    p.add_argument("--paths", default="auto", choices=tuple(PATHS), help="auto: each M through our path, the full and "
                   "relative M beside SDPA with a learnt mask and the explicit softmax; all: each M through each path")
    p.add_argument("--only", help="the rows to time (comma-separated variants; default and floor always)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed steps per variant, after 2 warm-up steps")
    p.add_argument("--time", metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--peak", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--variants", help=argparse.SUPPRESS)
    return p.parse_args()


def main():
    a = parse_args()
    if a.time:
        print(json.dumps(time_all(int(a.time), a.variants.split(","), a.device, a.rounds, a.amp)))
        return
    if a.peak:
        print(json.dumps(peak(int(a.peak[0]), a.peak[1], a.device, a.amp)))
        return
    paths = [q for q in PATHS[a.paths] if q != "flex" or a.device.startswith("cuda")]
    variants = list(VARIANTS) if a.paths == "auto" else ["default", "floor"] + [
        v if q == "auto" else f"{v}:{q}" for v in PRIORS for q in paths if q != "band" or v[len("relative"):]]
    if a.only:
        variants = [v for v in variants if v in ("default", "floor") or v in a.only.split(",")]
    sizes, k = [int(s) for s in a.sizes.split(",")], len(variants)
    common = ["--device", a.device, "--amp", a.amp, "--rounds", str(a.rounds)]
    say(f"N = {a.sizes}, {k} variants; at each N one process runs each variant 2 warm-up steps and "
        f"{a.rounds} timed ones ({k * (2 + a.rounds)} steps), then {k} processes 2 steps each for peak memory: "
        f"{len(sizes) * k * (4 + a.rounds)} steps in all, a step's time growing up to N^2")
    print(f"device {a.device} | 2 x 128, 4 heads, causal, bytes, batch 4 | amp {a.amp} | torch "
          f"{torch.__version__} | {a.rounds} interleaved rounds of one step")
    print(COLUMNS)
    for n in sizes:
        t0 = time.perf_counter()
        say(f"N = {n}: timing {k} variants x {2 + a.rounds} steps in one process")
        times, failed = timings(n, variants, common)
        if a.device.startswith("cuda"):
            mib = {v: times[v].get("mib") if v in times else None for v in variants}
        else:
            say(f"N = {n}: peak memory, {k} processes x 2 steps")
            mib = {v: run(["--peak", str(n), v, *common])[0] for v in variants}
        if "default" not in times or mib["default"] is None:
            print(f"{n:>6}  default failed: {failed}", flush=True)
            continue
        print(*rows(n, variants, times, mib), *notes(n, times, a.device, failed is None), sep="\n", flush=True)
        say(f"N = {n}: done in {time.perf_counter() - t0:.0f} s")
    print(LEGEND)


if __name__ == "__main__":
    main()
