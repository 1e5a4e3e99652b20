"""Time one training step of the same model with and without the learnable mask, side by side.

    python benchmarks/bench_attention.py                      # the small Boolean preset, CPU
    python benchmarks/bench_attention.py --device cuda --amp  # on a GPU, bf16 autocast
    python benchmarks/bench_attention.py --layers 12 --dim 256 --heads 6 --head-dim 64 --batch-size 256

Variants are timed in interleaved rounds (warm-up excluded) so drifts in machine load hit
all of them alike; the table gives the median step time and its ratio to `default`.
"""
import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import tasks  # noqa: E402
import runconfig  # noqa: E402
import train  # noqa: E402


def build(args, masked: bool, fused: bool, device, targs, task, batch):
    """train.py's step (its schedule, the task's loss, backward, the update) of a fresh model of this size."""
    small = tasks.BooleanTask.preset("small")
    cfg = mp.TransformerConfig(vocab_size=2, seq_len=args.seq_len, n_layers=args.layers or small["layers"],
                               n_heads=args.heads or small["heads"], dim=args.dim or small["dim"],
                               head_dim=args.head_dim, mlp_dim=args.mlp_dim or small["mlp_dim"],
                               learnable_mask=masked, fused=fused)
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    if masked:
        mp.init_mask_(model, mp.banded_pattern(cfg.n_positions, 2), 5.0, 5.0)
    model.to(device)
    opt = train.make_optimizer(model, targs)
    return functools.partial(train.train_step, model, model, opt, task, batch, targs, device, 0)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_rounds(steps: dict, device, rounds: int, per_round: int) -> dict:
    """{name: [seconds per step, one a round]}: each step function run `per_round` times a round,
    the variants taking turns for `rounds` rounds, so that drifts in machine load hit all alike."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(per_round):
                step()
            sync(device)
            times[name].append((time.perf_counter() - t0) / per_round)
    return times


def interleaved(steps: dict, device, rounds: int, per_round: int) -> dict:
    """{name: median seconds per step} of `timed_rounds`."""
    return {name: statistics.median(ts) for name, ts in timed_rounds(steps, device, rounds, per_round).items()}


def round_ratios(times: dict, base: str) -> dict:
    """{name: (median, min, max)} of each name's per-round time over `base`'s in the same round
    (`timed_rounds`' rounds): paired by round, so that load a round shares cancels, and the
    min-max shows how far the rest of the noise moves a ratio."""
    ratios = {name: [t / b for t, b in zip(ts, times[base])] for name, ts in times.items()}
    return {name: (statistics.median(rs), min(rs), max(rs)) for name, rs in ratios.items()}


def synthetic_images(task, device, n_test: int = 0, n: int = 4096):
    """Give an image task `n` random uint8 training images of its stored size (timing only), so that its whole
    augmentation pipeline (train_batch) runs as in training, and, `n_test` > 0, a test set of that size."""
    g, s = torch.Generator().manual_seed(0), task.image_size
    task.device = torch.device(device)
    task.x_train = torch.randint(0, 256, (n, 3, s, s), generator=g, dtype=torch.uint8).to(device)
    task.y_train = torch.randint(0, task.n_classes, (n,), generator=g).to(device)
    if n_test:
        task.x_test = torch.randint(0, 256, (n_test, 3, s, s), generator=g, dtype=torch.uint8).to(device)
        task.y_test = torch.randint(0, task.n_classes, (n_test,), generator=g).to(device)
    task.mean, task.std = torch.full((1, 3, 1, 1), 0.5, device=device), torch.full((1, 3, 1, 1), 0.25, device=device)
    task.n_train = n
    return task


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    for flag in ("--layers", "--heads", "--dim", "--head-dim", "--mlp-dim"):
        p.add_argument(flag, type=int)
    p.add_argument("--seq-len", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=tasks.BooleanTask.preset("small")["batch_size"])
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--explicit", action="store_true", help="also time default with the explicit attention path")
    args = p.parse_args()
    device = torch.device(args.device)
    x = torch.randint(0, 2, (args.batch_size, args.seq_len), device=device)
    y = torch.randn(args.batch_size, device=device)
    # "mask" uses what train.py's --attention auto picks on this device; the other path is shown beside it
    auto_fused = runconfig.use_fused("auto", True, device, args.seq_len + 1)
    other = "mask explicit" if auto_fused else "mask fused"
    variants = {"default": (False, True), "mask": (True, auto_fused), other: (True, not auto_fused)}
    if args.explicit:
        variants["default explicit"] = (False, False)
    # train.py's config and task of the Boolean model timed here (parity2, the small preset; the task's data is never
    # read: the batch is random), so that each variant takes train.py's own step
    targs = runconfig.resolve(*train.parse_args(["--task", "parity2", "--device", str(device), "--steps", "1000000"]))
    task = runconfig.task_for(targs)
    targs = dataclasses.replace(targs, amp="bf16" if args.amp else "off")
    steps = {}
    for name, (masked, fused) in variants.items():
        steps[name] = build(args, masked, fused, device, targs, task, (x, y))
        for _ in range(5):          # warm-up: allocator, kernels, autotuning
            steps[name]()
    times = interleaved(steps, device, args.rounds, args.steps)
    base = times["default"]
    print(f"device {device} | batch {args.batch_size} | seq {args.seq_len + 1} | torch "
          f"{torch.__version__} | {args.rounds} rounds x {args.steps} steps, median")
    print(f"{'variant':<18}{'ms/step':>10}{'ratio':>8}")
    for name, med in times.items():
        print(f"{name:<18}{med * 1e3:>10.2f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
