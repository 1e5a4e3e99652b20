#!/usr/bin/env bash
# The GPU paths in one short script (15-20 minutes on one H200; STEPS= runs a part): the CUDA tests, then the
# measurements results/README.md waits for, each under its own time limit so that one hang costs only its own slot.
#
#   bash benchmarks/gpu_check.sh [OUT]        # OUT (default $OUT, else gpu_check/): one log per step
#
#   1. the tests that need CUDA (bf16 fused = explicit with M, flex_attention trains M as explicit does,
#      a bf16 vision run, compile = eager, a CUDA run that resumes exactly)
#   2. bench_vit.py --preset paper: ViT-Tiny patch 16 at 224, bf16, every init side by side, and the augmentation
#   3. bench_context.py --paths all, bf16, N = 1024, 4096, 8192: the full, relative and windowed (W = 64, 128, 256)
#      M through SDPA's memory-efficient kernel with the bias (mp.prior_attention on CUDA), the windows' band route
#      (band by hand, far part the efficient kernel, merged by log-sum-exp), flex_attention reading M in its kernel
#      and the explicit softmax: the CPU's table, each as its ratio to the plain model (is_causal) and to the floor;
#      and bench_retrofit.py: GPT-2 small with the relative prior inside flex_attention (an AttentionInterface
#      function), N = 1024 ... 8192: each as its ratio to the plain model (is_causal; goal <= 1.15x)
#   4. bench_paper.py --write: step, log evaluation and final evaluation of every (task, init) of the paper
#      presets -> results/step_times.json (reproduce.sh's plan then prints device-hours)
#   5. 300 steps of the paper parity2 model (12 layers), default and mask, as train.py runs them
#   6. Lee et al.'s two NanoGPT runs (reproduce.sh --only lee), as far as LEE_SECONDS allows
#   7. multiplication's ladder (reproduce.sh --only mult-ladder, seed 0): timed by bench_paper, then run as far
#      as LADDER_SECONDS allows
# Each step's exit status is in OUT/status.txt; the script goes on after a failure and exits 1 if any failed.
# STEPS="tests context" (names as in status.txt, or their first word: tests vit context retrofit paper parity2 lee
# ladder) runs those alone, e.g. STEPS=context for the speed table (up to 7 minutes: flex_attention compiles each N).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu_check}}
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check.sh: no CUDA device (torch.cuda.is_available() is False); run it on a machine with a GPU" >&2
  exit 2
}
mkdir -p "$out"
failed=0
wanted() {   # wanted NAME: whether STEPS (default: all) names this step (or its family, before the first -)
  [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* || " $STEPS " == *" ${1%%-*} "* ]]
}
step() {   # step NAME SECONDS COMMAND...: run COMMAND under a time limit, its output to the screen and OUT/NAME.log
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  echo "== $name ($*)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name $rc" >> "$out/status.txt"
  [ "$rc" -eq 0 ] || failed=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.txt" 2>&1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$out/device.txt"
step tests 150 python -m pytest -q -x test_maskprior.py test_fast.py test_train.py test_reproduce.py \
  -k "cuda or flex or bf16 or compile"
step vit 90 python benchmarks/bench_vit.py --preset paper --device cuda --steps 5 --rounds 3
step context 420 python benchmarks/bench_context.py --device cuda --amp bf16 --paths all --sizes 1024,4096,8192 \
  --rounds 5 --only full,full:explicit,full:flex,relative,relative:explicit,relative:flex,relative64:band,\
relative128,relative128:band,relative128:flex,relative256:band
for n in 1024 2048 4096 8192; do
  step "retrofit-flex-$n" 60 python benchmarks/bench_retrofit.py --device cuda --amp --models gpt2 --tokens "$n" \
    --flex --batch-size 1 --steps 2 --rounds 3
done
step paper 180 python benchmarks/bench_paper.py --device cuda --write
cp results/step_times.json "$out/" 2>/dev/null
for init in default mask; do
  step "parity2-$init" 60 python train.py --task parity2 --init "$init" --preset paper --steps 300 --log-every 100 \
    --device cuda --amp bf16 --out "$out/runs/parity2-$init"
done
# 6. Lee et al.'s two NanoGPT runs (seed 0) for what is left of LEE_SECONDS (default 120): a run cut short keeps
#    its checkpoint, and the same line later resumes it
if wanted lee; then
echo "== lee"
timeout "${LEE_SECONDS:-120}" bash reproduce.sh --only lee --seeds 0 --runs "$out/runs" --results "$out/lee" 2>&1 \
  | tee "$out/lee.log"
echo "lee ${PIPESTATUS[0]} (124: cut at LEE_SECONDS; the same line resumes it)" >> "$out/status.txt"
fi
# 7. the ladder's (task, init)s timed into step_times.json, then its runs (seed 0) for LADDER_SECONDS (default 120);
#    cut short, a run keeps its checkpoint and the same line resumes it
step ladder-times 90 python benchmarks/bench_paper.py --device cuda --only mult-ladder --write
cp results/step_times.json "$out/" 2>/dev/null
if wanted ladder; then
echo "== mult-ladder"
timeout "${LADDER_SECONDS:-120}" bash reproduce.sh --only mult-ladder --seeds 0 --runs "$out/runs" \
  --results "$out/mult-ladder" 2>&1 | tee "$out/mult-ladder.log"
echo "mult-ladder ${PIPESTATUS[0]} (124: cut at LADDER_SECONDS; the same line resumes it)" >> "$out/status.txt"
fi
echo "== status"; cat "$out/status.txt"
exit $failed
