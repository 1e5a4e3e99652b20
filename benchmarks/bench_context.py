"""How the language-model prior scales with the context: parameters, training-step time and peak
memory of default (no M), full (M per query and key, heads x N x N) and relative (M per distance,
heads x N), side by side as ratios to default, for each context length N.

    python benchmarks/bench_context.py                              # N = 256 ... 2048, one CPU thread
    python benchmarks/bench_context.py --sizes 256,512,1024,2048,4096 --device cuda
    python benchmarks/bench_context.py --device cuda --amp bf16 --paths all   # every attention path, side by side

`--paths all` runs each M through every attention path in one table: SDPA with the bias (fused), the explicit
softmax, and torch's flex_attention (M read in the kernel; CUDA only, as its backward is).

The model is a 2-layer, width-128, 4-head causal decoder over bytes (vocabulary 257), batch 4,
one step = forward, backward and AdamW update. Each (N, variant) runs in a fresh process, so
that its peak resident memory (CPU) or peak allocated memory (CUDA) is its own; the step time is
the median of the timed steps after warm-up steps. The masked variants run the attention path
train.py picks (`--attention auto`).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import train  # noqa: E402
from bench_attention import sync  # noqa: E402

VARIANTS = ("default", "full", "relative")
PATHS = {"auto": ("auto",), "all": ("fused", "explicit", "flex")}


def worker(n: int, variant: str, device: str, steps: int, amp: str = "off") -> dict:
    """One (N, variant) in this process; variant "full" or "relative" (train.py's attention path for it), or
    "full:PATH" / "relative:PATH" with PATH one of fused, explicit, flex."""
    torch.set_num_threads(1)
    device = torch.device(device)
    kind, _, path = variant.partition(":")
    masked, path = kind != "default", path or "auto"
    cfg = mp.TransformerConfig(vocab_size=257, seq_len=n, n_outputs=257, readout="tokens", causal=True,
                               tie_embeddings=True, n_layers=2, n_heads=4, dim=128, mlp_dim=512, qkv_bias=True,
                               emb_init_std=0.02, pos_init_std=0.02, learnable_mask=masked,
                               fused=train.use_fused(path, "mask" if masked else "default", device), flex=path == "flex",
                               mask_param="relative" if kind == "relative" else "full")
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    if masked:
        mp.init_mask_(model, logits=mp.causal_distance_logits(n, 4))
    model.to(device)
    # train.py's config and task of the language model (the small preset's AdamW; the corpus is never read)
    targs = train.resolve(*train.parse_args(["--task", "wikitext2", "--data-dir", ".", "--device", str(device),
                                             "--amp", amp]))
    task, opt = train.task_for(targs), train.make_optimizer(model, targs)
    x = torch.randint(0, 257, (4, n + 1), generator=torch.Generator().manual_seed(0)).to(device)
    times = []
    for i in range(2 + steps):
        sync(device)
        t0 = time.perf_counter()
        train.train_step(model, model, opt, task, (x[:, :-1], x[:, 1:]), targs, device, 0)    # train.py's step
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) / 2 ** 20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)       # MiB (ru_maxrss is KiB)
    return {"params": sum(p.numel() for p in model.parameters()), "ms": 1000 * statistics.median(times),
            "peak_mib": peak}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="256,512,1024,2048")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="off", choices=("off", "bf16"), help="train.py's --amp (bf16 on a GPU)")
    p.add_argument("--paths", default="auto", choices=tuple(PATHS), help="auto: train.py's path for M; all: each path")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (N, variant), after 2 warm-up steps")
    p.add_argument("--worker", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(int(a.worker[0]), a.worker[1], a.device, a.steps, a.amp)))
        return
    paths = [q for q in PATHS[a.paths] if q != "flex" or a.device.startswith("cuda")]
    variants = ["default"] + [f"{v}:{q}" if a.paths == "all" else v for v in ("full", "relative") for q in paths]
    print(f"device {a.device} | 2 x 128, 4 heads, causal, bytes, batch 4 | amp {a.amp} | torch {torch.__version__} | "
          f"median of {a.steps} steps | params, ms per step and peak MiB as ratios to default")
    print(f"{'N':>6} | {'default':>24} | " + " | ".join(f"{v:>22}" for v in variants[1:]))
    for n in (int(s) for s in a.sizes.split(",")):
        res = {}
        for v in variants:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), v, "--device", a.device,
                                "--steps", str(a.steps), "--amp", a.amp], capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            failed = r.stderr.strip().splitlines()[-1][:60] if r.returncode and r.stderr.strip() else r.returncode
            res[v] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else failed
        d = res["default"]
        if not isinstance(d, dict):
            print(f"{n:>6} | default failed: {d}")
            continue
        cells = [f"{'failed':>22}" if not isinstance(res[v], dict) else
                 f"{res[v]['params'] / d['params']:>5.2f}x {res[v]['ms'] / d['ms']:>6.3f}x {res[v]['peak_mib'] / d['peak_mib']:>6.2f}x"
                 for v in variants[1:]]
        print(f"{n:>6} | {d['params'] / 1e6:>6.2f} M {d['ms']:>7.1f} ms {d['peak_mib']:>5.0f} M | " + " | ".join(cells),
              flush=True)


if __name__ == "__main__":
    main()
