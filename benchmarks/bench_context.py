"""How the language-model prior scales with the context, side by side as ratios to default (no M)
at each context length N: parameters, training-step time and peak memory of

    floor        the same kernel with a constant float mask (the relative prior's bias, no gradient): what the
                 kernel costs to read a bias, not M
    full         M per query and key, heads x N x N
    relative     M per distance, heads x N
    relative128  a table of 128 distances serving all N (distances past it read its last logit)

so that what M itself costs is a variant's ratio over the floor's.

    python benchmarks/bench_context.py                              # N = 256 ... 2048, one CPU thread
    python benchmarks/bench_context.py --sizes 256,1024,2048,4096 --device cuda
    python benchmarks/bench_context.py --device cuda --amp bf16 --paths all   # every attention path, side by side

`--paths all` runs each M through every attention path: fused (SDPA's kernel; on the CPU M's
gradient computed apart from it, `mp.prior_attention`), the explicit softmax, and torch's
flex_attention (CUDA only, as its backward is).

The model is a 2-layer, width-128, 4-head causal decoder over bytes (vocabulary 257), batch 4,
train.py's step (forward, backward, AdamW update). Step times: every variant of one N in one
process, timed in interleaved rounds (warm-up excluded) so that drifts in machine load hit all
alike, the median of the rounds. Peak memory: each variant alone in a fresh process (peak resident
memory on the CPU, peak allocated on CUDA).
"""
import argparse
import json
import os
import resource
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import runconfig  # noqa: E402
import train  # noqa: E402
from bench_attention import interleaved, sync  # noqa: E402

VARIANTS = ("default", "floor", "full", "relative", "relative128")
PATHS = {"auto": ("auto",), "all": ("fused", "explicit", "flex")}


def floor_attention(attn: mp.Attention, mask: torch.Tensor):
    """`attn`'s forward with `mask` (1, heads, N, N), a constant float mask, through
    F.scaled_dot_product_attention's fused kernel: the floor, what reading a bias costs the kernel
    with no M to learn."""
    def forward(x, return_attn=False, cache=None):
        b, t, _ = x.shape
        q, k, v = attn.qkv(x).view(b, t, 3, attn.n_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        return attn.proj(out.transpose(1, 2).reshape(b, t, -1)), None
    return forward


def build(n: int, variant: str, device: torch.device, amp: str):
    """The model, optimiser and train.py step of one variant ("default", "floor", or one of
    VARIANTS[2:] with ":PATH" for another attention path)."""
    kind, _, path = variant.partition(":")
    masked, path = kind != "default", path or "auto"
    table = min(128, n) if kind == "relative128" else n            # the relative M's distances
    cfg = mp.TransformerConfig(vocab_size=257, seq_len=n, n_outputs=257, readout="tokens",
                               causal=True, tie_embeddings=True, n_layers=2, n_heads=4, dim=128,
                               mlp_dim=512, qkv_bias=True, emb_init_std=0.02, pos_init_std=0.02,
                               learnable_mask=masked,
                               fused=train.use_fused(path, masked, device, n), flex=path == "flex",
                               mask_param="full" if kind == "full" else "relative",
                               mask_window=table if kind == "relative128" else None)
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    if masked:
        mp.init_mask_(model, logits=mp.causal_distance_logits(table, 4))
    # SDPA with a constant 4-D mask, no M
    if kind == "floor":
        for block in model.blocks:
            block.attn.forward = floor_attention(block.attn,
                                                 block.attn.prior(n).detach().unsqueeze(0).to(device))
            block.attn.prior = None
    model.to(device)
    # train.py's config and task of the language model (the small preset's AdamW; the corpus is
    # never read)
    targs = runconfig.resolve(*train.parse_args(["--task", "wikitext2", "--data-dir", ".", "--device",
                                             str(device), "--amp", amp]))
    task, opt = runconfig.task_for(targs), train.make_optimizer(model, targs)
    x = torch.randint(0, 257, (4, n + 1), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        train.train_step(model, model, opt, task, (x[:, :-1], x[:, 1:]), targs, device, 0)
    return model, step


def time_all(n: int, variants: list, device: str, rounds: int, amp: str) -> dict:
    """{variant: {"params", "ms"}} of one N, every variant in this process, in interleaved
    rounds."""
    torch.set_num_threads(1)
    device = torch.device(device)
    built = {v: build(n, v, device, amp) for v in variants}
    for _, step in built.values():
        step(), step()                                             # warm-up
    ms = interleaved({v: step for v, (_, step) in built.items()}, device, rounds, 1)
    return {v: {"params": sum(p.numel() for p in built[v][0].parameters()), "ms": 1000 * ms[v]}
            for v in variants}


def peak(n: int, variant: str, device: str, amp: str) -> float:
    """Peak MiB of one variant alone in this process: resident memory on the CPU, allocated memory
    on CUDA."""
    torch.set_num_threads(1)
    device = torch.device(device)
    _, step = build(n, variant, device, amp)
    step(), step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)     # ru_maxrss is KiB


def run(args: list) -> tuple:
    """(the last stdout line as JSON, None) of this script run with `args`, or (None, why it
    failed)."""
    r = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1][:60]
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="off", choices=("off", "bf16"),
                   help="train.py's --amp (bf16 on a GPU)")
    p.add_argument("--paths", default="auto", choices=tuple(PATHS),
                   help="auto: train.py's path for M; all: each path")
    p.add_argument("--rounds", type=int, default=7,
                   help="interleaved timed steps per variant, after 2 warm-up steps")
    p.add_argument("--time", metavar="N", help=argparse.SUPPRESS)
    p.add_argument("--peak", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--variants", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.time:
        print(json.dumps(time_all(int(a.time), a.variants.split(","), a.device, a.rounds, a.amp)))
        return
    if a.peak:
        print(json.dumps(peak(int(a.peak[0]), a.peak[1], a.device, a.amp)))
        return
    paths = [q for q in PATHS[a.paths] if q != "flex" or a.device.startswith("cuda")]
    variants = ["default", "floor"] + [f"{v}:{q}" if a.paths == "all" else v for v in VARIANTS[2:]
                                       for q in paths]
    common = ["--device", a.device, "--amp", a.amp, "--rounds", str(a.rounds)]
    print(f"device {a.device} | 2 x 128, 4 heads, causal, bytes, batch 4 | amp {a.amp} | torch "
          f"{torch.__version__} | median of {a.rounds} interleaved steps | params, ms per step "
          "and peak MiB as ratios to default")
    print(f"{'N':>6} | {'default':>24} | " + " | ".join(f"{v:>22}" for v in variants[1:]))
    for n in (int(s) for s in a.sizes.split(",")):
        times, failed = run(["--time", str(n), "--variants", ",".join(variants), *common])
        # one variant failed: time the rest without it
        if times is None:
            times = {}
            for v in variants:
                t, _ = run(["--time", str(n), "--variants", v, *common])
                times.update(t or {})
        mib = {v: run(["--peak", str(n), v, *common])[0] for v in variants}
        d = times.get("default")
        if d is None or mib["default"] is None:
            print(f"{n:>6} | default failed: {failed}")
            continue
        cells = [f"{'failed':>22}" if v not in times or mib[v] is None else
                 f"{times[v]['params'] / d['params']:>5.2f}x {times[v]['ms'] / d['ms']:>6.3f}x "
                 f"{mib[v] / mib['default']:>6.2f}x" for v in variants[1:]]
        print(f"{n:>6} | {d['params'] / 1e6:>6.2f} M {d['ms']:>7.1f} ms {mib['default']:>5.0f} M "
              "| " + " | ".join(cells),
              flush=True)


if __name__ == "__main__":
    main()
