"""Images/s of one ViT training step for every init, side by side.

    python benchmarks/bench_vit.py                                   # the small vision preset, CPU
    python benchmarks/bench_vit.py --preset paper --device cuda      # ViT-Tiny, patch 16 at 224, bf16 autocast
    python benchmarks/bench_vit.py --preset paper32 --device cuda    # the earlier preset: patch 2 at 32 x 32
    python benchmarks/bench_vit.py --inits default,mask --batch-size 64

Each init is built exactly as `train.py --task cifar10 --init NAME` builds it (same flags, same preset, same
attention path), then one step = forward, backward and AdamW update on a random batch (timing only: the images'
content does not change the cost). Inits are timed in interleaved rounds so drifts in machine load hit all alike;
the table gives the median images/s and the ratio of each init's step time to `default`'s. Only `mask` adds work
(the additive bias and the gradient of M); the other inits change weights, not the graph. The last line times the
preset's whole augmentation of one batch on the device (crop, RandAugment, erasing, mixup / cutmix, on random uint8
images of the stored size) against a training step.
"""
import argparse
import dataclasses
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks  # noqa: E402
import runconfig  # noqa: E402
import train  # noqa: E402
from bench_attention import interleaved, synthetic_images  # noqa: E402


def build(init: str, args, device: torch.device):
    argv = ["--task", "cifar10", "--init", init, "--data-dir", ".", "--device", str(device), "--preset", args.preset,
            *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
            *(["--qk-opt-steps", str(args.qk_opt_steps)] if init == "qk-opt" else [])]
    targs = runconfig.resolve(*train.parse_args(argv))
    targs = dataclasses.replace(targs, steps=targs.steps or 10 ** 6)         # a schedule length for train_step's lr
    task = runconfig.task_for(targs)
    model, cfg = train.build_model(targs, task, device)
    train.apply_init(model, task.prior(targs.pattern, targs.mask_on, targs.mask_off), targs)
    return model, train.make_optimizer(model, targs), cfg, targs, task


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="small", choices=list(tasks.ImageTask.presets()))
    p.add_argument("--inits", default="default,mask,impulse,mimetic,qk-svd,qk-opt")
    p.add_argument("--batch-size", type=int, help="default: the preset's")
    p.add_argument("--steps", type=int, default=5, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--qk-opt-steps", type=int, default=50, help="qk-opt fitting steps (its cost is not timed)")
    args = p.parse_args()
    device = torch.device(args.device)
    inits, steps = args.inits.split(","), {}
    for init in inits:
        model, opt, cfg, targs, task = build(init, args, device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(targs.batch_size, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
        y = torch.randint(0, cfg.n_classes, (targs.batch_size,), generator=g)
        y = torch.nn.functional.one_hot(y, cfg.n_classes).float().to(device)     # the task's soft targets
        # train.py's own step
        steps[init] = functools.partial(train.train_step, model, model, opt, task, (x, y), targs, device, 0)
        for _ in range(2):          # warm-up
            steps[init]()
    counter = iter(range(10 ** 9))
    steps["augmentation"] = lambda task=synthetic_images(task, device), b=targs.batch_size: task.train_batch(
        next(counter), b)                 # the preset's augmentation of one batch, on the device
    times = interleaved(steps, device, args.rounds, args.steps)
    augment, base, batch = times.pop("augmentation"), times[inits[0]], targs.batch_size
    print(f"device {device} | preset {args.preset} | ViT {cfg.n_layers}x{cfg.dim}, {cfg.n_heads} "
          f"heads, {cfg.n_positions} tokens | batch {batch} | amp {targs.amp} | torch "
          f"{torch.__version__} | {args.rounds} rounds x {args.steps} steps, median")
    print(f"{'init':<10}{'attention':>11}{'images/s':>10}{'ratio':>8}")
    for init, med in times.items():
        fused = runconfig.use_fused(targs.attention, init in runconfig.MASK_INITS, device, cfg.n_positions)
        path = "fused" if fused else "explicit"
        print(f"{init:<10}{path:>11}{batch / med:>10.0f}{med / base:>8.3f}")
    print(f"augmentation of a batch on {device}: {1e3 * augment:.1f} ms, {augment / (augment + base):.1%} of a "
          f"{inits[0]} step with it (crop {targs.crop}, RandAugment {targs.randaug}, erasing {targs.reprob}, mixup "
          f"{targs.mixup}, cutmix {targs.cutmix})")


if __name__ == "__main__":
    main()
