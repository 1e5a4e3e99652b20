"""What `bash reproduce.sh` (the paper presets) costs on this device: every run's step time,
measured, times its steps and its number of runs, as device-hours per table of the paper.

    python benchmarks/bench_paper.py --device cuda               # the whole paper on one GPU, bf16
    python benchmarks/bench_paper.py --device cuda --compile     # the same with torch.compile
    python benchmarks/bench_paper.py --only vision --steps 3     # one table, fewer timed steps
    python benchmarks/bench_paper.py --plan                      # runs and steps only, no timing

Each (task, init) of reproduce.sh's run list is built as `train.py --task T --init I --preset
paper` builds it (same flags, same attention path, bf16 autocast on CUDA), and one step =
forward, backward and optimiser update on a batch of the task's real shape (Boolean and
arithmetic batches are the tasks' own; image and token batches are random: the content does
not change the cost). Steps per run come from the presets and the datasets' sizes, runs from
reproduce.sh's defaults (3 seeds). The timed steps follow warm-up steps, with the device
synchronised. The last line per table is the mask's step-time ratio to default's at the
paper's shapes. On a CPU use `--batch-size 2 --steps 1` to check that everything builds (the
times are then meaningless).
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tasks as T  # noqa: E402
import train  # noqa: E402
from bench_attention import sync  # noqa: E402

SEEDS = 3                   # reproduce.sh's default seeds "0 1 2"
TRAIN_SIZE = {"cifar10": 50_000, "cifar100": 50_000, "imagenet100": 126_689}      # training images
VOCAB = {"wikitext2": 33_278, "tinystories": 257}           # WikiText-2's word vocabulary; bytes + end of text
# (table, task, inits), as reproduce.sh runs them with the paper presets
RUNS = [("boolean", t, ("default", "mask", "qk-svd", "qk-opt")) for t in ("parity2", "majority3", "cyclic3")] + \
       [("arithmetic", t, ("default", "mask", "qk-svd", "qk-opt")) for t in ("addition", "multiplication")] + \
       [("vision", t, ("default", "mimetic", "impulse", "mask")) for t in ("cifar10", "cifar100", "imagenet100")] + \
       [("lm", "wikitext2", ("default", "mask", "qk-svd", "qk-opt")), ("lm", "tinystories", ("default", "mask"))]


def run_steps(task_name: str, extra: list = ()) -> int:
    """Training steps of one run of the paper preset (its --steps, or its epochs x steps per epoch)."""
    argv = ["--task", task_name, "--preset", "paper", *extra]
    if T.TASKS[task_name].KIND in ("vision", "lm"):
        argv += ["--data-dir", "."]
    args = train.resolve(*train.parse_args(argv))
    if args.steps is not None:
        return args.steps
    task = train.make_task(args)
    if task.KIND == "vision":
        return round(args.epochs * -(-TRAIN_SIZE[task_name] // args.batch_size))
    return round(args.epochs * task.setup().steps_per_epoch(args.batch_size))


def build(task_name: str, init: str, device: torch.device, extra: list):
    """The model, optimiser, flags and a batch maker of one run of the paper preset."""
    argv = ["--task", task_name, "--init", init, "--preset", "paper", "--device", str(device),
            *(["--qk-opt-steps", "20"] if init == "qk-opt" else []), *extra]
    if T.TASKS[task_name].KIND in ("vision", "lm"):
        argv += ["--data-dir", "."]
    args = train.resolve(*train.parse_args(argv))
    task = train.make_task(args)
    kind = task.KIND
    if kind == "lm":
        task.vocab_size = VOCAB[task_name]             # the real vocabulary size, without reading the corpus
    elif kind in ("boolean", "arithmetic"):
        task.setup(device)
    model, cfg = train.build_model(args, task, device)
    train.apply_init(model, train.make_prior(args, task, device), args)
    opt = train.make_optimizer(model, args)
    g = torch.Generator().manual_seed(0)
    b = args.batch_size
    if kind == "vision":
        x = torch.randn(b, 3, cfg.image_size, cfg.image_size, generator=g).to(device)
        batch = (x, torch.softmax(torch.randn(b, cfg.n_classes, generator=g), -1).to(device))
        spe = -(-TRAIN_SIZE[task_name] // b)
    elif kind == "lm":
        x = torch.randint(0, task.vocab_size, (b, args.context + 1), generator=g).to(device)
        batch, spe = (x[:, :-1], x[:, 1:]), None
    else:
        batch, spe = task.train_batch(0, b), task.steps_per_epoch(b)
    steps = args.steps if args.steps is not None else round(args.epochs * spe)
    args = dataclasses.replace(args, steps=steps)      # the schedule's length, as train.py sizes it
    trained = torch.compile(model) if args.compile else model

    def step():                                        # train.py's own step (lr schedule, clip, update)
        train.train_step(model, trained, opt, task, batch, args, device, 0)
    return step, steps, args


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["boolean", "arithmetic", "vision", "lm"], help="one table")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, help="override the presets' batch (a CPU smoke test); the hours "
                   "then do not describe the paper")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (train.py --compile)")
    p.add_argument("--plan", action="store_true", help="only the runs and steps per table (nothing is timed)")
    a = p.parse_args()
    if a.plan:
        print("| table | task | inits | runs | steps per run | steps |\n|---|---|---|---|---|---|")
        for table, task_name, inits in RUNS:
            if not a.only or table == a.only:
                n = run_steps(task_name)
                print(f"| {table} | {task_name} | {', '.join(inits)} | {len(inits) * SEEDS} | {n:,} | "
                      f"{len(inits) * SEEDS * n:,} |")
        return
    device = torch.device(a.device)
    extra = (["--batch-size", str(a.batch_size)] if a.batch_size else []) + (["--compile"] if a.compile else [])
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) | torch "
          f"{torch.__version__} | compile {a.compile} | {a.warmup} warm-up + {a.steps} timed steps per run | "
          f"{SEEDS} seeds per run")
    print(f"{'table':<11}{'task':<15}{'init':<9}{'ms/step':>10}{'steps/run':>11}{'runs':>6}{'hours':>9}")
    hours, per_table, ratio = 0.0, {}, {}
    for table, task_name, inits in RUNS:
        if a.only and table != a.only:
            continue
        ms = {}
        for init in inits:
            step, steps, args = build(task_name, init, device, extra)
            for _ in range(a.warmup):
                step()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            sync(device)
            ms[init] = 1000 * (time.perf_counter() - t0) / a.steps
            h = ms[init] * steps * SEEDS / 3.6e6
            hours += h
            per_table[table] = per_table.get(table, 0.0) + h
            print(f"{table:<11}{task_name:<15}{init:<9}{ms[init]:>10.2f}{steps:>11,}{SEEDS:>6}{h:>9.3f}", flush=True)
        ratio[task_name] = ms["mask"] / ms["default"]
    for table, h in per_table.items():
        print(f"total {table:<11}{h:>9.2f} device-hours")
    print(f"total paper      {hours:>9.2f} device-hours")
    print("mask / default step time: " + ", ".join(f"{t} {r:.3f}" for t, r in ratio.items())
          + f" (median {statistics.median(ratio.values()):.3f})")


if __name__ == "__main__":
    main()
