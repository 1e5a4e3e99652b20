"""Training-step time of an nn.TransformerEncoder with and without a retrofitted mask prior
(`mp.add_mask_prior`), side by side.

    python benchmarks/bench_retrofit.py                      # 4 layers, width 128, 4 heads, 64 tokens, CPU
    python benchmarks/bench_retrofit.py --device cuda --amp  # bf16 autocast on a GPU

One step = forward, backward and AdamW update on a random batch; the two models are timed in
interleaved rounds (warm-up excluded) and the table gives median ms/step and the ratio to the
plain encoder. The prior adds the bias log sigmoid(M) to every layer's logits (and M's gradient);
with a float attn_mask, PyTorch's attention cannot use its mask-free kernels.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
from bench_attention import interleaved  # noqa: E402


def build(args, prior: bool, device):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.dim, args.heads, 4 * args.dim, dropout=0.0, batch_first=True,
                                       norm_first=True)
    enc = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
    if prior:
        mp.add_mask_prior(enc, mp.banded_pattern(args.tokens, 4))
    enc.to(device)
    return enc, torch.optim.AdamW(mp.param_groups(enc, 0.05), lr=1e-4)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    x = torch.randn(args.batch_size, args.tokens, args.dim, generator=torch.Generator().manual_seed(0)).to(device)
    steps = {}
    for name, prior in (("encoder", False), ("encoder + prior", True)):
        enc, opt = build(args, prior, device)

        def step(enc=enc, opt=opt):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp):
                loss = enc(x).float().square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        for _ in range(2):
            step()
        steps[name] = step
    times = interleaved(steps, device, args.rounds, args.steps)
    base = times["encoder"]
    print(f"device {device} | amp {args.amp} | nn.TransformerEncoder {args.layers} x {args.dim}, {args.heads} heads, "
          f"{args.tokens} tokens, batch {args.batch_size} | torch {torch.__version__} | {args.rounds} rounds x "
          f"{args.steps} steps, median")
    print(f"{'model':<18}{'ms/step':>9}{'ratio':>8}")
    for name, med in times.items():
        print(f"{name:<18}{1000 * med:>9.2f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
