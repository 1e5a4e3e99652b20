"""Where the prior's attention call spends its time: one causal attention call (forward and backward) of batch 4,
4 heads, head dim 32, one CPU thread, timed beside its peers as a ratio to SDPA with is_causal, then torch.profiler's
table of the prior's call (op, self CPU time, share of the call).

    python benchmarks/profile_prior.py                                  # T = 1,024 and 2,048
    python benchmarks/profile_prior.py --sizes 1024 --variants relative --top 12

Variants: default (SDPA, is_causal, no mask), floor (torch's fused CPU kernel with the relative prior's bias as a
constant and is_causal, its own backward), full (M per query and key), relative (M per distance, all T),
relativeW (a table of W distances) - the last three through mp.prior_attention, what a layer with M runs;
`--backward` times the backward alone, ours (which gives M's gradient) against the kernel's own. Times are
this thread's CPU time (a shared machine's other work stretches them less than the wall clock); the profile's is
torch.profiler's own."""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import maskprior_fast  # noqa: E402
from bench_context import cpu_rounds  # noqa: E402

B, H, D = 4, 4, 32


def make(variant: str, t: int):
    """A function running one forward and backward of `variant` at T = t, and its tensors."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, t, D, generator=gen).requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, t, D, generator=gen)
    window = int(variant[len("relative"):] or t) if variant.startswith("relative") else t
    prior = mp.MaskPrior(min(window, t), H, causal=True, param="full" if variant == "full" else "relative",
                         logits=mp.causal_distance_logits(min(window, t), H).clamp(min=-100.0))
    const = prior(t).detach() if variant == "floor" else None

    def run():
        if variant == "default":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif variant == "floor":
            out = maskprior_fast._cpu_kernel()(q, k, v, 0.0, True, attn_mask=const.unsqueeze(0))[0]
        else:
            out = mp.prior_attention(q, k, v, prior)
        out.backward(dout)
    return run


def ratios(t: int, variants: list, rounds: int) -> dict:
    """{variant: (median ms, median ratio to default over interleaved rounds)} in this thread's CPU time."""
    runs = {v: make(v, t) for v in variants}
    for run in runs.values():
        run()
    times = cpu_rounds(runs, rounds)
    return {v: (1000 * statistics.median(ts), statistics.median(a / b for a, b in zip(ts, times["default"])))
            for v, ts in times.items()}


def backwards(t: int, rounds: int) -> str:
    """The backward alone at T = t, this thread's CPU time (the least of `rounds`): the kernel's own (the floor's, no
    gradient for the bias) beside our hand backward (maskprior_fast._backward) of a full and a relative M (M's too)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, t, D, generator=gen) for _ in range(4))
    best = {}
    for param in ("full", "relative"):
        prior = mp.MaskPrior(t, H, causal=True, param=param, logits=mp.causal_distance_logits(t, H).clamp(min=-100.0))
        bias = prior(t).detach()
        out, lse = maskprior_fast._cpu_kernel()(q, k, v, 0.0, True, attn_mask=bias[None])
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        for name, run in (("kernel", lambda: kernel(dout, q, k, v, out, lse, 0.0, True, attn_mask=bias[None])),
                          (param, lambda: maskprior_fast._backward(prior, q, k, v, out, lse, dout, bias))):
            run()
            best[name] = min(best.get(name, float("inf")), 1000 * min(cpu_rounds({name: run}, rounds)[name]))
    return (f"backward alone, T = {t}: the kernel's {best['kernel']:.1f} ms; ours, full M {best['full']:.1f} ms "
            f"({best['full'] / best['kernel']:.2f}x), relative M {best['relative']:.1f} ms "
            f"({best['relative'] / best['kernel']:.2f}x)")


def table(t: int, variant: str, top: int) -> str:
    """torch.profiler's self-CPU table of one call of `variant` at T = t: op, self CPU ms, share, calls."""
    run = make(variant, t)
    run()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    lines = [f"{variant}, T = {t}: {total / 1000:.1f} ms self CPU in all", f"{'op':<58}{'self ms':>9}{'share':>7}"
             f"{'calls':>7}"]
    for e in events[:top]:
        lines.append(f"{e.key[:57]:<58}{e.self_cpu_time_total / 1000:>9.1f}{e.self_cpu_time_total / total:>7.1%}"
                     f"{e.count:>7}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,2048")
    p.add_argument("--variants", default="full,relative,relative128", help="the profiled ones")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=10, help="rows of each profile")
    p.add_argument("--backward", action="store_true", help="also time the backward alone: ours against the kernel's")
    a = p.parse_args()
    torch.set_num_threads(1)
    profiled = a.variants.split(",")
    for t in (int(s) for s in a.sizes.split(",")):
        got = ratios(t, ["default", "floor"] + profiled, a.rounds)
        print(f"T = {t}, one attention call (batch {B}, {H} heads, head dim {D}, forward + backward), one thread, "
              f"{a.rounds} interleaved rounds:")
        print("  ".join(f"{v} {ms:.1f} ms {r:.2f}x" for v, (ms, r) in got.items()))
        if a.backward:
            print(backwards(t, a.rounds))
        for v in profiled:
            print(table(t, v, a.top))
        print()


if __name__ == "__main__":
    main()
