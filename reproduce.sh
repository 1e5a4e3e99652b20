#!/usr/bin/env bash
# Reproduce the paper's tables and the persistence curves. See `bash reproduce.sh --help`.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash reproduce.sh [--quick] [--only TABLE] [--seeds "0 1 2"] [--jobs N] [--gpus N] [--data DIR]
         [--runs DIR] [--results DIR] [--budget HOURS] [--gpu NAME] [--download] [--dry-run] [--help]

Runs every experiment of the paper with train.py, then writes the tables (RESULTS/*.md) and the
persistence curves (RESULTS/persistence.csv, and .png with matplotlib). The plan it prints first
gives each table's runs and cost: download, disk and GPU-hours (est. from the FLOPs counted in
results/step_flops.json until results/step_times.json holds a measured step).

  (default)      the paper presets on one GPU: Boolean (parity2, majority3, cyclic3), arithmetic
                 (addition, multiplication), vision (CIFAR-10, CIFAR-100, ImageNet-100), language
                 modelling (WikiText-2, TinyStories)
  --quick        the CPU version: the Boolean tasks and addition (at 250 steps, every init, and at
                 1,500, default and mask) at the `small` presets, 2 runs at a time
  --only TABLE   boolean, arithmetic (with --quick: every init, multiplication too), vision, lm,
                 persistence (aggregates the Boolean runs made), or a study at the small presets,
                 never part of the default or --quick run: data, ablation, mult2, lee (the paper's
                 without --quick), visionprior, oraclefree, parity3; mult-ladder (the paper's)
  --budget HOURS the tables that fit in HOURS of one --gpu (A100, H100 by default, or H200), in
                 the order of the paper's claims, each with fewer seeds or left out where it must
                 be; the plan says which, beside each cost. Not with --quick
  --seeds LIST   seeds to run (default "0 1 2"), each once
  --jobs N       runs at a time (default 1, --quick 2); OMP_NUM_THREADS=1 each on a CPU if N > 1
  --gpus N       each run data-parallel on N GPUs of this machine (torchrun), one run at a time
  --data DIR     data sets (default data/), as train.py download and train.py imagenet100 put them
  --runs DIR     run folders (default runs/paper, runs/quick with --quick)
  --results DIR  tables and plots (default results/, results/quick/ with --quick); relative to
                 the current folder, the defaults beside this script
  --download     first fetch the published sets the plan misses (train.py download: checked,
                 resumable); ImageNet-100 is built from your ImageNet-1k copy:
                 python train.py imagenet100 --from IMAGENET_1K_DIR --data DIR
  --dry-run      list the runs it would start or skip (and what --download would fetch); run none
  PYTHON=...     the interpreter (default python)

A finished run (result.json) is skipped, an interrupted one (ckpt.pt) resumed. SIGINT or SIGTERM
reaches every running run, which saves a checkpoint, and the script exits 130 (143) once they have.
A run whose data is missing is skipped; a failed run makes the script exit 1 and names its log
(RUNS/TABLE/NAME.log). A run folder another reproduce.sh is training is left to it ("busy").
EOF
}

QUICK=0; ONLY=""; SEEDS="0 1 2"; JOBS=""; JOBS_GIVEN=0; GPUS=0; DATA=""; RUNS=""; RESULTS=""; DRY=0; DOWNLOAD=0
BUDGET=()
GIVEN=" "
value() {   # value OPTION NEXT-ARG: the option's value, or exit 2 when there is none or the option came before
    if [ -z "${2:-}" ] || [[ "$2" == --* ]]; then
        echo "reproduce.sh: $1 needs a value (see bash reproduce.sh --help)" >&2; exit 2
    fi
    if [[ "$GIVEN" == *" $1 "* ]]; then
        echo "reproduce.sh: $1 is given twice; give each flag once" >&2; exit 2
    fi
    GIVEN="$GIVEN$1 "
}
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) QUICK=1 ;;
        --only) value "$1" "${2:-}"; ONLY="$2"; shift ;;
        --seeds) value "$1" "${2:-}"; SEEDS="$2"; shift ;;
        --jobs) value "$1" "${2:-}"; JOBS="$2"; JOBS_GIVEN=1; shift ;;
        --gpus) value "$1" "${2:-}"; GPUS="$2"; shift ;;
        --data) value "$1" "${2:-}"; DATA="$2"; shift ;;
        --runs) value "$1" "${2:-}"; RUNS="$2"; shift ;;
        --results) value "$1" "${2:-}"; RESULTS="$2"; shift ;;
        --budget|--gpu) value "$1" "${2:-}"; BUDGET+=("$1" "$2"); shift ;;     # the plan checks them
        --dry-run) DRY=1 ;;
        --download) DOWNLOAD=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "reproduce.sh: unknown option $1 (see bash reproduce.sh --help)" >&2; exit 2 ;;
    esac
    shift
done
if [ "$ONLY" = mult-ladder ] && [ "$QUICK" = 1 ]; then
    echo "reproduce.sh: --only mult-ladder is the paper preset's (a GPU's); leave out --quick" >&2; exit 2
fi
for f in "$RUNS" "$RESULTS"; do
    [ -n "$f" ] && [ -e "$f" ] && [ ! -d "$f" ] && {
        echo "reproduce.sh: $f is a file; --runs and --results take a folder" >&2; exit 2; }
done
PY="${PYTHON:-python}"
absolute() { if [ -z "$1" ] || [[ "$1" = /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
# folders given are read from where the script is started; the defaults live beside it
RUNS=$(absolute "$RUNS"); RESULTS=$(absolute "$RESULTS"); DATA=$(absolute "$DATA"); DATA="${DATA:-data}"
cd "$(dirname "$0")"
STUDIES=" ablation data mult2 visionprior oraclefree parity3 "     # run at the small preset only
if [[ "$STUDIES" == *" $ONLY "* ]] && [ -n "$ONLY" ] && [ "$QUICK" = 0 ]; then
    echo "reproduce.sh: --only $ONLY runs at the small preset (as with --quick)"
    QUICK=1
fi
if [ "$QUICK" = 1 ]; then
    PRESET=small; RUNS="${RUNS:-runs/quick}"; RESULTS="${RESULTS:-results/quick}"; JOBS="${JOBS:-2}"
else
    PRESET=paper; RUNS="${RUNS:-runs/paper}"; RESULTS="${RESULTS:-results}"; JOBS="${JOBS:-1}"
fi
# counts as ASCII digits of at most 4 (bash's arithmetic would wrap a longer one in silence)
[[ "$JOBS" =~ ^[1-9][0-9]{0,3}$ ]] || { echo "reproduce.sh: --jobs needs a positive integer up to 9999" >&2; exit 2; }
[[ "$GPUS" =~ ^[0-9]{1,4}$ ]] || { echo "reproduce.sh: --gpus needs a number of GPUs up to 9999" >&2; exit 2; }
LAUNCH=(train.py)
if [ "$GPUS" -gt 0 ]; then
    if [ "$JOBS" -gt 1 ]; then
        if [ "$JOBS_GIVEN" = 1 ]; then
            echo "reproduce.sh: --gpus $GPUS runs one run at a time on $GPUS GPUs; leave --jobs at 1" >&2; exit 2
        fi
        JOBS=1
    fi
    if [ "$DRY" = 0 ]; then
        HAVE=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
        [ "$HAVE" -ge "$GPUS" ] || { echo "reproduce.sh: --gpus $GPUS, but torch sees $HAVE CUDA GPU(s)" >&2; exit 2; }
    fi
    LAUNCH=(-m torch.distributed.run --standalone --nproc_per_node "$GPUS" train.py)
fi

# ---- the run list: reporting/plan.py checks --only, --seeds and --budget (a refusal: its line, exit 2), says which
# runs each table makes and which are skipped for want of their data (and where to get it); its docstring says what
# each line of `--list` is (a run, WAIT, REPLAN, DOWNLOAD).
PLAN_ARGS=(--seeds "$SEEDS" --data "$DATA" --runs "$RUNS" --jobs "$JOBS" "${BUDGET[@]}")
[ "$QUICK" = 1 ] && PLAN_ARGS+=(--quick)
[ -n "$ONLY" ] && PLAN_ARGS+=(--only "$ONLY")
read_plan() {
    LIST_TEXT=$("$PY" -m reporting.plan "${PLAN_ARGS[@]}" --list) || {
        [ $? = 2 ] && exit 2           # the plan refused a flag in its own line: nothing has run
        echo "reproduce.sh: cannot read the run list with $PY (python -m reporting.plan)" >&2; exit 1; }
    LIST=() PLAN_TEXT=() FETCH=""        # the plan's text (its lines led by "# "), the sets to fetch, the runs
    while IFS= read -r line; do
        case "$line" in "# "*) PLAN_TEXT+=("${line#\# }") ;; "DOWNLOAD "*) FETCH="${line#DOWNLOAD }" ;; "") ;;
                        *) LIST+=("$line") ;; esac
    done <<< "$LIST_TEXT"
}
read_plan
if [ "$DOWNLOAD" = 1 ] && [ -n "$FETCH" ]; then
    if [ "$DRY" = 1 ]; then
        echo "reproduce.sh: --download would fetch $FETCH into $DATA first" \
             "(python train.py download $FETCH --data $DATA)"
    else
        echo "reproduce.sh: --download: fetching $FETCH into $DATA"
        # shellcheck disable=SC2086  # FETCH is a list of set names
        "$PY" train.py download $FETCH --data "$DATA" || exit $?
        read_plan                     # the plan again, with the sets now there
    fi
fi

# ---- one run: skip if finished, resume if interrupted, else start
run_one() {
    local table="$1" task="$2" init="$3" seed="$4" tag="$5"; shift 5
    local name="$task-$init-s$seed"
    [ "$tag" = - ] || name="$name-$tag"
    local out="$RUNS/$table/$name" log="$RUNS/$table/$name.log" extra=() a
    for a in "$@"; do
        case "$a" in
            @DATA*) extra+=("$DATA${a#@DATA}") ;;
            @RUNS*) extra+=("$RUNS${a#@RUNS}") ;;
            *) extra+=("$a") ;;
        esac
    done
    if [ -f "$out/result.json" ]; then echo "skip    $out (finished)"; return 0; fi
    if [ "$DRY" = 0 ] && [ -d "$out" ] && command -v flock >/dev/null && ! flock -n "$out" true 2>/dev/null; then
        echo "busy    $out (another process trains it; not started here)" | tee -a "$STATE/busy"
        return 0
    fi
    local resume=() what=start
    [ -f "$out/ckpt.pt" ] && { resume=(--resume); what=resume; }
    local cmd=("$PY" "${LAUNCH[@]}" --task "$task" --init "$init" --seed "$seed" --preset "$PRESET" --out "$out"
               "${resume[@]}" "${extra[@]}")
    if [ "$DRY" = 1 ]; then
        echo "$what   $(printf '%q ' "${cmd[@]}")"
        return 0
    fi
    mkdir -p "$RUNS/$table"
    echo "$(date +%H:%M:%S) $what $out"
    local threads=() rc=0
    [ "$JOBS" -gt 1 ] && threads=(env OMP_NUM_THREADS=1)
    trap ':' INT TERM       # the script passes a signal on to the run; this shell waits for its status
    "${threads[@]}" "${cmd[@]}" >> "$log" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
        echo "$(date +%H:%M:%S) done  $out: $(tail -n 1 "$log")"
    elif [ "$rc" = 75 ]; then          # the folder was locked by another process between the check above and now
        echo "busy    $out (another process trains it; not started here)" | tee -a "$STATE/busy"
    elif [ "$rc" = 130 ] || [ "$rc" = 143 ]; then
        echo "$(date +%H:%M:%S) interrupted $out (its checkpoint is kept; run the same command to resume)" >&2
        touch "$STATE/interrupted"
        return 1
    else
        echo "$(date +%H:%M:%S) FAILED $out (exit $rc): see $log" | tee -a "$STATE/failed" >&2
        return 1
    fi
}

# ---- the runs, JOBS at a time. Each is a job with its own process group (set -m), so Ctrl-C at the
# terminal reaches this script alone; SIGINT or SIGTERM to the script is passed on once to every
# running run, which saves a checkpoint and exits; no new run starts, and the script waits for them.
SIGNAL=""
stop() {
    SIGNAL="$1"
    local job
    for job in $(jobs -p); do kill -s "$1" -- "-$job" 2>/dev/null; done
}
trap 'stop INT' INT
trap 'stop TERM' TERM

START=$(date +%s)
printf '%s\n' "${PLAN_TEXT[@]}"          # the plan first: runs per table, what is skipped and why, hours
echo "reproduce.sh: preset $PRESET, $JOBS at a time, into $RUNS"
[ "$DRY" = 0 ] && mkdir -p "$RUNS"
# this invocation's own failed / busy / interrupted lists: another reproduce.sh on the same --runs keeps its own
STATE=$(mktemp -d "${TMPDIR:-/tmp}/reproduce.XXXXXX") || {
    echo "reproduce.sh: cannot make a temporary folder" >&2; exit 1; }
trap 'rm -rf "$STATE"' EXIT
STATUS=0
set -m
REPLANNED=0 AGAIN=1
while [ "$AGAIN" = 1 ]; do
AGAIN=0
for item in "${LIST[@]}"; do
    [ -n "$SIGNAL" ] || [ -f "$STATE/interrupted" ] && break
    if [ "$item" = REPLAN ] && [ "$DRY" = 1 ]; then
        echo "then    the runs the plan chooses from these runs' results (reproduce.sh reads it again once they are in)"
        continue
    fi
    if [ "$item" = WAIT ] || [ "$item" = REPLAN ]; then     # the runs after it read the ones before (teachers)
        while [ -n "$(jobs -rp)" ]; do wait 2>/dev/null; done
        if [ "$item" = REPLAN ] && [ "$REPLANNED" = 0 ] && [ -z "$SIGNAL" ] && [ ! -s "$STATE/failed" ]; then
            REPLANNED=1 AGAIN=1
            read_plan
            printf '%s\n' "${PLAN_TEXT[@]}"
            break
        fi
        continue
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n 2>/dev/null; done
    [ -n "$SIGNAL" ] || [ -f "$STATE/interrupted" ] && break
    read -ra fields <<< "$item"
    if [ "$DRY" = 1 ]; then run_one "${fields[@]}"; else run_one "${fields[@]}" & fi
done
done
while [ -n "$(jobs -rp)" ]; do wait 2>/dev/null; done      # a signal ends a wait early: wait again
set +m
if [ -n "$SIGNAL" ] || [ -f "$STATE/interrupted" ]; then
    echo "reproduce.sh: interrupted; run the same command again to resume (finished runs are skipped)" >&2
    [ "$SIGNAL" = TERM ] && exit 143
    exit 130
fi
[ -s "$STATE/failed" ] && STATUS=1
[ -s "$STATE/busy" ] && echo "reproduce.sh: $(wc -l < "$STATE/busy") run(s) were in training by another process" \
    "and were left to it; run this again once it is done to report them" >&2
[ "$DRY" = 1 ] && exit 0

if [ -d "$RUNS" ]; then
    "$PY" train.py report "$RUNS" "$RESULTS" || STATUS=1
fi
echo "reproduce.sh: $(( ($(date +%s) - START) / 60 )) min; results in $RESULTS/ (runs in $RUNS/)"
if [ "$STATUS" != 0 ]; then
    echo "reproduce.sh: FAILED runs:" >&2
    cat "$STATE/failed" >&2 2>/dev/null
    exit 1
fi
