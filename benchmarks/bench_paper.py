"""What `bash reproduce.sh` (the paper presets) costs on this device: every (task, init) of its run
list (reporting/plan.py, the one list reproduce.sh reads) timed on its real path, training step and
evaluation, times its steps and evaluations and its runs, as device-hours per table of the paper.

    python benchmarks/bench_paper.py --device cuda --write      # the whole paper on one GPU, bf16; keeps the times
    python benchmarks/bench_paper.py --only vision --steps 3     # one table, fewer timed steps
    python benchmarks/bench_paper.py --quick --device cpu --write   # reproduce.sh --quick on this CPU, 1 thread a run
    python benchmarks/bench_paper.py --plan                      # runs and steps only, no timing

Each (task, init) is built as `train.py --task T --init I --preset paper` builds it (train.build:
same flags, same attention path, the init applied; bf16 autocast on CUDA). A step is train.py's own
step on the batch its task makes (`train_batch`): the Boolean and arithmetic tasks' data; images
drawn as uint8 of the stored size and put through the preset's whole augmentation (random resized
crop to 224, RandAugment, erasing, mixup and cutmix) on the device; token windows of the corpus'
vocabulary. An evaluation is the task's own (`evaluate`) on a test set of the real size (images and
tokens drawn; the Boolean cube and the arithmetic pairs as they are), at the log steps' size
(`--eval-points`) and, once, the final whole-set one. The timed steps follow warm-up steps, with
the device synchronised. With --write the times go to results/step_times.json, which reproduce.sh's
plan reads for its device-hours (or, --quick, its minutes), under keys of preset, task, init and
the flags that change a step's cost (reporting/plan.time_key); a run's start (the process, its
imports, the data and the model built, the init applied) is timed too. On a CPU use `--batch-size 2
--steps 1 --eval-points 64` to check that everything builds and runs (the times are then
meaningless).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import maskprior as mp  # noqa: E402
import reporting.plan  # noqa: E402
import runfiles  # noqa: E402
import tasks  # noqa: E402
import runconfig  # noqa: E402
import train  # noqa: E402
from bench_attention import sync, synthetic_images  # noqa: E402

# WikiText-2's word vocabulary; bytes + end of text
VOCAB = {"wikitext2": 33_278, "tinystories": 257}
# test images as released
TEST_SIZE = {"cifar10": 10_000, "cifar100": 10_000, "imagenet100": 5_000}
# WikiText-2's validation split; the preset's cap
VALID_TOKENS = {"wikitext2": 217_646, "tinystories": 2_000_000}


def flags_of(text: str) -> list:
    """The plan's flags as train.py argv (its data folders and teachers dropped: nothing is read)."""
    out, words = [], iter(text.split())
    for w in words:
        if w in ("--data-dir", "--prior-from"):
            next(words, None)
        else:
            out.append(w)
    return out


def synthetic_data(task, device, args):
    """The data a vision or language task would read, drawn (timing only): `synthetic_images` with a test set of the
    real size; token streams of the corpus' vocabulary for the training windows and the validation split."""
    if task.KIND == "vision":
        return synthetic_images(task, device, TEST_SIZE[task.NAME])
    g = torch.Generator().manual_seed(0)
    task.device = torch.device(device)
    v = task.vocab_size = VOCAB[task.NAME]
    task.train = torch.randint(0, v, (1_000_000,), generator=g).numpy()
    task.valid = torch.randint(0, v, (args.val_tokens or VALID_TOKENS[task.NAME],), generator=g).numpy()
    task.vocab, task.decode = None, None
    return task


def build(task_name: str, init: str, device: torch.device, extra: list, preset: str = "paper"):
    """train.build of one run of a preset, its data drawn where the real files would be read (the
    paper preset's qk-opt at 20 optimisation steps: its start is not what is timed there)."""
    drawn = tasks.TASKS[task_name].KIND in ("vision", "lm")
    flags, explicit = train.parse_args([
        "--task", task_name, "--init", init, "--preset", preset, "--device", str(device),
        *(["--qk-opt-steps", "20"] if init == "qk-opt" and preset == "paper" else []), *extra,
        *(["--data-dir", "."] if drawn else [])])
    args = runconfig.resolve(flags, explicit)
    task = runconfig.task_for(args)
    if drawn:
        synthetic_data(task, device, args)
    else:
        task.setup(device)
    return train.build(args, device, explicit, task)


def time_run(built, device, warmup: int, steps: int, eval_cap: int = 0) -> tuple[float, float, float]:
    """(ms a training step, ms a log-step evaluation, ms the final evaluation) of a built run, on its real path.
    eval_cap n > 0: both evaluations on n points (a check that they run, not their cost)."""
    config, task, model = built.config, built.task, built.model
    trained = torch.compile(model) if config.compile else model
    probe = train.Probe(task, built.prior.pattern.to(device), task.probe_inputs(config.probe_size),
                        mp.prior_snapshot(model), eval_cap or config.eval_points,
                        lambda: train.autocast(device, config))

    def step(i):
        train.train_step(model, trained, built.optimizer, task,
                         task.train_batch(i, config.batch_size), config, device, i)

    for i in range(warmup):
        step(i)
    ms_step = median_ms(step, steps, device)
    ms_eval = median_ms(lambda i: probe.measure(model), 1, device)
    ms_final = (ms_eval if eval_cap or not config.eval_points
                else median_ms(lambda i: probe.measure(model, final=True), 1, device))
    return ms_step, ms_eval, ms_final


def median_ms(fn, n: int, device: torch.device) -> float:
    """The median ms of fn(0), ..., fn(n - 1), the device synchronised around each call."""
    times = []
    for i in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn(i)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def parse_flags():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="the --quick plan (the small presets, reproduce.sh --quick) "
                   "instead of the paper's; on the CPU at --threads 1, as reproduce.sh --quick runs each run")
    p.add_argument("--only", choices=reporting.plan.TABLES, help="one table or study")
    p.add_argument("--task", help="one task of the table(s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after the warm-up steps)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--starts", type=int, default=3, choices=range(1, 11), metavar="1..10",
                   help="processes started to time a run's start (their median; default 3)")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: 1 with --quick, torch's own otherwise)")
    p.add_argument("--batch-size", type=int,
                   help="override the presets' batch (a CPU smoke test); the hours then do not describe the paper")
    p.add_argument("--eval-points", type=int, default=0, help="evaluate on this many points, log and final alike "
                   "(a CPU smoke test); the hours then do not describe the paper")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (train.py --compile)")
    p.add_argument("--plan", action="store_true", help="only the runs and steps per table (nothing is timed)")
    p.add_argument("--write", action="store_true",
                   help=f"keep the times in {os.path.relpath(reporting.plan.STEP_TIMES)}")
    a = p.parse_args()
    if a.write and (a.batch_size or a.eval_points):
        p.error("--write keeps a preset's own times: leave out --batch-size and --eval-points")
    return p, a


def print_plan(runs: list, seeds: int, preset: str) -> None:
    """--plan: reproduce.sh's runs (every dataset taken as present) and steps per table, nothing timed: a row per task
    and extra flags, in the run list's order, with the inits it runs, each `seeds` times."""
    inits = {}
    for r in runs:
        inits.setdefault((r.table, r.task, r.flags), {})[r.init] = None
    print("| table | task | inits | runs | steps per run | evaluations per run | steps |\n"
          "|---|---|---|---|---|---|---|")
    for (table, task_name, flags), names in inits.items():
        n, evals = reporting.plan.steps_of(reporting.plan.Run(table, task_name, [*names][0], 0, "", flags), preset)
        print(f"| {table} | {task_name} | {', '.join(names)} | {len(names) * seeds} | {n:,} | "
              f"{evals:,} | {len(names) * seeds * n:,} |")


def time_runs(a, runs: list, preset: str, device: torch.device, ms_start: float) -> tuple[dict, dict]:
    """Each time key's first run built and timed, a line each: ({time key: times}, {task: {init: ms per step}})."""
    extra = (["--batch-size", str(a.batch_size)] if a.batch_size else []) + (["--compile"] if a.compile else [])
    sharing = {}                    # the runs of each time key, in order: the first is timed
    for r in runs:
        sharing.setdefault(reporting.plan.time_key(r, preset), []).append(r)
    times, ratio = reporting.plan.step_times() if a.write else {}, {}
    for key, (run, *_) in sharing.items():
        t0 = time.perf_counter()
        built = build(run.task, run.init, device, [*flags_of(run.flags), *extra], preset)
        ms_setup = ms_start + 1000 * (time.perf_counter() - t0)
        ms_step, ms_eval, ms_final = time_run(built, device, a.warmup, a.steps, a.eval_points)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
        times[key] = {"ms_step": round(ms_step, 3), "ms_eval": round(ms_eval, 3), "ms_final": round(ms_final, 3),
                      "ms_setup": round(ms_setup, 1), "device": where, "threads": torch.get_num_threads(),
                      "torch": torch.__version__, "batch_size": built.config.batch_size}
        h = sum(reporting.plan.hours(r, times, preset) for r in sharing[key])
        print(f"{run.table:<13}{run.task:<15}{run.init:<13}{ms_step:>9.2f}{ms_eval:>10.1f}{ms_final:>10.1f}"
              f"{ms_setup / 1000:>9.1f}{len(sharing[key]):>6}{h:>8.3f}  {' '.join(flags_of(run.flags))}", flush=True)
        if not run.flags:
            ratio.setdefault(run.task, {})[run.init] = ms_step
    return times, ratio


def print_totals(runs: list, times: dict, ratio: dict, preset: str) -> None:
    per_table = {}
    for r in runs:
        per_table[r.table] = per_table.get(r.table, 0.0) + reporting.plan.hours(r, times, preset)
    for table, h in per_table.items():
        print(f"total {table:<11}{h:>9.2f} device-hours (steps, evaluations, starts)")
    print(f"total            {sum(per_table.values()):>9.2f} device-hours")
    ratio = {t: m["mask"] / m["default"] for t, m in ratio.items() if "mask" in m and "default" in m}
    if ratio:
        print("mask / default step time: " + ", ".join(f"{t} {r:.3f}" for t, r in ratio.items())
              + f" (median {statistics.median(ratio.values()):.3f})")


def main():
    p, a = parse_flags()
    preset = "small" if a.quick or a.only in reporting.plan.STUDIES else "paper"
    plan = reporting.plan.run_list(quick=preset == "small", only=a.only, data=None)
    runs = [r for r in plan.runs if not a.task or r.task == a.task]
    if not runs:
        p.error(f"--task {a.task} is not in the run list{' of ' + a.only if a.only else ''}")
    if a.plan:
        return print_plan(runs, len(plan.seeds), preset)
    device = torch.device(a.device)
    threads = a.threads or (1 if preset == "small" and device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    # a run's process started and train.py imported (torch included), the median of --starts starts
    ms_start = median_ms(lambda i: subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, check=True),
                         a.starts, torch.device("cpu"))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) | preset "
          f"{preset} | torch {torch.__version__} | {torch.get_num_threads()} thread(s) | compile {a.compile} | "
          f"{a.warmup} warm-up + {a.steps} timed steps per run | a run's process starts in {ms_start / 1000:.1f} s "
          "| evaluations on " + (f"{a.eval_points} points (not the paper's cost)" if a.eval_points
                                 else "a test set of the real size"))
    print(f"{'table':<13}{'task':<15}{'init':<13}{'ms/step':>9}{'ms/eval':>10}{'ms/final':>10}{'start s':>9}"
          f"{'runs':>6}{'hours':>8}  flags", flush=True)
    times, ratio = time_runs(a, runs, preset, device, ms_start)
    print_totals(runs, times, ratio, preset)
    if a.write:
        os.makedirs(os.path.dirname(reporting.plan.STEP_TIMES), exist_ok=True)
        runfiles.atomic_write(reporting.plan.STEP_TIMES, json.dumps(times, indent=2) + "\n")
        print(f"wrote {reporting.plan.STEP_TIMES}")


if __name__ == "__main__":
    main()
