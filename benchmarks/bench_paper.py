"""What `bash reproduce.sh` (the paper presets) costs: every (task, init) of its run list (reporting/plan.py) built
as `train.py --task T --init I --preset paper` builds it (train.build; bf16 autocast on CUDA), its data drawn at the
real shapes (images of the stored size through the preset's whole augmentation, token windows of the corpus'
vocabulary), and timed: train.py's step after warm-up steps, a log step's evaluation and the final whole-set one, a
run's start (process, imports, data, model, init). --write keeps the times in results/step_times.json under
reporting/plan.time_key; reproduce.sh's plan reads them (device-hours; --quick, minutes). --flops counts FLOPs
instead (a step, the evaluations) and checkpoint bytes, into results/step_flops.json, the plan's estimates.

    python benchmarks/bench_paper.py --device cuda --write      # the whole paper on one GPU, bf16; keeps the times
    python benchmarks/bench_paper.py --only vision --steps 3     # one table, fewer timed steps
    python benchmarks/bench_paper.py --quick --device cpu --write   # reproduce.sh --quick on this CPU, 1 thread a run
    python benchmarks/bench_paper.py --flops --write; python benchmarks/bench_paper.py --flops --quick --write
    python benchmarks/bench_paper.py --plan                      # runs and steps only, no timing

On a CPU, `--batch-size 2 --steps 1 --eval-points 64` checks that everything builds and runs (no cost then).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

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
        return synthetic_images(task, device, reporting.plan.TEST_SIZE[task.NAME])
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


def count_flops(run, preset: str) -> dict:
    """A time key's FLOPs (torch.utils.flop_counter: matrix products and attention; elementwise ops, the optimizer's
    update among them, count 0) and its checkpoint's bytes (weights, optimizer moments, the start snapshot). The run
    is built on the CPU as train.py builds it (`build`) and its first batch drawn there; then the model moves to the
    meta device, where train.train_step (forward, backward, optimizer) and the task's own evaluations (a log step's,
    the final one) run at the real shapes, counted and not computed: a ViT-Tiny step at 224 px would take a minute."""
    cpu, meta = torch.device("cpu"), torch.device("meta")
    fast = ["--qk-opt-steps", "20"] if run.init == "qk-opt" and preset != "paper" else []    # Q, K's values: no FLOP
    built = build(run.task, run.init, cpu, [*flags_of(run.flags), *fast], preset)
    config, task, model = built.config, built.task, built.model
    batch = task.train_batch(0, config.batch_size)
    model.to(meta)                  # new parameters: an optimizer of its own, as train.py makes it
    optimizer = train.make_optimizer(model, config)
    if task.KIND == "vision":       # the test images too (their evaluation view: no FLOP counted, none computed)
        task.x_test, task.mean, task.std = (t.to(meta) for t in (task.x_test, task.mean, task.std))
    # autocast knows no meta device: the CPU's (off), which changes no FLOP
    step = counted(lambda: train.train_step(model, model, optimizer, task, tuple(t.to(meta) for t in batch)
                                            if isinstance(batch, tuple) else batch.to(meta), config, cpu, 0))
    def on_meta(x):                 # the model on the meta device (FLOPs counted), its output zeros for the task
        out = model(x.to(meta))
        return torch.zeros(out.shape, dtype=out.dtype)
    final = counted(lambda: task.evaluate(on_meta))
    sample = config.eval_points if task.final_eval_size() else 0    # a log step's sample, else the whole test set
    state = [*model.state_dict().values(), *(t for layer in mp.prior_snapshot(model) for t in layer.values()),
             *(t for s in optimizer.state_dict()["state"].values() for t in s.values())]
    return {"step": step, "eval": counted(lambda: task.evaluate(on_meta, points=sample)) if sample else final,
            "final": final, "layers": config.layers, "ckpt_bytes": sum(t.nbytes for t in state if torch.is_tensor(t)),
            "batch_size": config.batch_size}


def counted(fn) -> int:
    """The FLOPs torch.utils.flop_counter counts in fn()."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


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
    p.add_argument("--batch-size", type=int, help="override the presets' batch (a CPU smoke test, not the cost)")
    p.add_argument("--eval-points", type=int, default=0, help="evaluate on this many points (a smoke test, likewise)")
    p.add_argument("--compile", action="store_true", help="torch.compile every model (train.py --compile)")
    p.add_argument("--plan", action="store_true", help="only the runs and steps per table (nothing is timed)")
    p.add_argument("--flops", action="store_true", help="count each (task, init)'s FLOPs instead (a step, the "
                   "evaluations; on the meta device, nothing timed); --write keeps them for the plan's estimates")
    p.add_argument("--write", action="store_true",
                   help=f"keep the times in {os.path.relpath(reporting.plan.STEP_TIMES)}")
    a = p.parse_args()
    if (a.write or a.flops) and (a.batch_size or a.eval_points):
        p.error("--write and --flops keep a preset's own shapes: leave out --batch-size and --eval-points")
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
    print(f"total {sum(reporting.plan.hours(r, times, preset) for r in runs):.2f} device-hours (steps, evaluations, "
          "starts; per table in the plan, python -m reporting.plan, once they are written)")
    ratio = {t: m["mask"] / m["default"] for t, m in ratio.items() if "mask" in m and "default" in m}
    if ratio:
        print("mask / default step time: " + ", ".join(f"{t} {r:.3f}" for t, r in ratio.items())
              + f" (median {statistics.median(ratio.values()):.3f})")


def count_all(a, runs: list, preset: str) -> None:
    """--flops: each time key's FLOPs and checkpoint (`count_flops`), a line each; --write keeps them."""
    counts = reporting.plan.step_flops() if a.write else {}
    print(f"{'time key':<44}{'TFLOP/step':>11}{'TFLOP/eval':>11}{'final':>9}{'ckpt MiB':>9}")
    first = {}
    for r in runs:
        first.setdefault(reporting.plan.time_key(r, preset), r)
    for key, run in first.items():
        c = counts[key] = count_flops(run, preset)
        print(f"{key:<44}{c['step'] / 1e12:>11.4f}{c['eval'] / 1e12:>11.3f}{c['final'] / 1e12:>9.3f}"
              f"{c['ckpt_bytes'] / 2 ** 20:>9.1f}", flush=True)
    if a.write:
        write(reporting.plan.STEP_FLOPS, counts)


def write(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    runfiles.atomic_write(path, json.dumps(obj, indent=2) + "\n")
    print(f"wrote {path}")


def main():
    p, a = parse_flags()
    preset = "small" if a.quick or a.only in reporting.plan.STUDIES else "paper"
    plan = reporting.plan.run_list(quick=preset == "small", only=a.only, data=None)
    runs = [r for r in plan.runs if not a.task or r.task == a.task]
    if not runs:
        p.error(f"--task {a.task} is not in the run list{' of ' + a.only if a.only else ''}")
    if a.plan:
        return print_plan(runs, len(plan.seeds), preset)
    if a.flops:
        return count_all(a, runs, preset)
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
        write(reporting.plan.STEP_TIMES, times)


if __name__ == "__main__":
    main()
