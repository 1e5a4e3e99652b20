"""How the language-model prior scales with the context: parameters, training-step time and peak
memory of default (no M), full (M per query and key, heads x N x N) and relative (M per distance,
heads x N), side by side as ratios to default, for each context length N.

    python benchmarks/bench_context.py                              # N = 256 ... 2048, one CPU thread
    python benchmarks/bench_context.py --sizes 256,512,1024,2048,4096 --device cuda

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


def worker(n: int, variant: str, device: str, steps: int) -> dict:
    torch.set_num_threads(1)
    device = torch.device(device)
    masked = variant != "default"
    cfg = mp.TransformerConfig(vocab_size=257, seq_len=n, n_outputs=257, readout="tokens", causal=True,
                               tie_embeddings=True, n_layers=2, n_heads=4, dim=128, mlp_dim=512, qkv_bias=True,
                               emb_init_std=0.02, pos_init_std=0.02, learnable_mask=masked,
                               fused=train.use_fused("auto", "mask" if masked else "default", device),
                               mask_param="relative" if variant == "relative" else "full")
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    if masked:
        mp.init_mask_(model, logits=mp.causal_distance_logits(n, 4))
    model.to(device)
    # train.py's config and task of the language model (the small preset's AdamW; the corpus is never read)
    targs = train.resolve(*train.parse_args(["--task", "wikitext2", "--data-dir", ".", "--device", str(device),
                                             "--amp", "off"]))
    task, opt = train.make_task(targs), train.make_optimizer(model, targs)
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
    p.add_argument("--steps", type=int, default=3, help="timed steps per (N, variant), after 2 warm-up steps")
    p.add_argument("--worker", nargs=2, metavar=("N", "VARIANT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(int(a.worker[0]), a.worker[1], a.device, a.steps)))
        return
    print(f"device {a.device} | 2 x 128, 4 heads, causal, bytes, batch 4 | torch {torch.__version__} | "
          f"median of {a.steps} steps | ratios to default")
    print(f"{'N':>6} | {'params default':>14} {'full':>9} {'relative':>9} | {'ms default':>10} {'full':>7} "
          f"{'relative':>8} | {'MiB default':>11} {'full':>7} {'relative':>8}")
    for n in (int(s) for s in a.sizes.split(",")):
        res = {}
        for v in VARIANTS:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), v, "--device", a.device,
                                "--steps", str(a.steps)], capture_output=True, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode != 0:
                res[v] = None
                print(f"{n:>6} | {v}: failed ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
                continue
            res[v] = json.loads(r.stdout.strip().splitlines()[-1])
        d = res.get("default")
        if not d or not res.get("full") or not res.get("relative"):
            continue
        f, rl = res["full"], res["relative"]
        print(f"{n:>6} | {d['params'] / 1e6:>12.2f} M {f['params'] / d['params']:>8.2f}x {rl['params'] / d['params']:>8.2f}x"
              f" | {d['ms']:>10.1f} {f['ms'] / d['ms']:>6.2f}x {rl['ms'] / d['ms']:>7.2f}x"
              f" | {d['peak_mib']:>11.0f} {f['peak_mib'] / d['peak_mib']:>6.2f}x {rl['peak_mib'] / d['peak_mib']:>7.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
