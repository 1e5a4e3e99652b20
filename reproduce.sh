#!/usr/bin/env bash
# Reproduce the paper's tables and the persistence curves. See `bash reproduce.sh --help`.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash reproduce.sh [--quick] [--only TABLE] [--seeds "0 1 2"] [--jobs N] [--gpus N] [--data DIR]
                         [--runs DIR] [--results DIR] [--download] [--dry-run] [--help]

Runs every experiment of the paper with train.py, then writes the tables (RESULTS/*.md) and
the persistence curves (RESULTS/persistence.csv, and .png when matplotlib is installed).

  (default)      the paper presets on one GPU: Boolean (parity2, majority3, cyclic3),
                 arithmetic (addition, multiplication), vision (CIFAR-10, CIFAR-100,
                 ImageNet-100), language modelling (WikiText-2, TinyStories)
  --quick        a CPU-sized version: the Boolean tasks and addition at the `small`
                 presets, 3 seeds, 2 runs at a time (about 80 minutes on an idle 2-core CPU:
                 the plan's estimate from results/step_times.json; the Boolean table took 59);
                 addition at two budgets: 250 steps (tag 250steps, every init), where the
                 paper's numbers show (the paper's budget is not known), and the preset's
                 1,500 steps, convergence (default and mask)
  --only TABLE   one of: boolean arithmetic vision lm persistence ablation data
                 (persistence only aggregates the Boolean runs already made)
  --quick --only arithmetic  every init at both budgets, for addition and multiplication
                 (a 6,000-step multiplication run takes about 10 minutes on one core)
  --only data    data efficiency, never part of the default or --quick run: addition
                 at the `small` preset, default and mask, --data-frac 0.0005 0.001 0.002
                 0.008 in RUNS/data/, plus the 0.4% runs of the arithmetic table
                 (RUNS/arithmetic/, run if missing); RESULTS/data_efficiency.md and .csv
                 (.png with matplotlib)
  --only ablation  the robustness grid, never part of the default or --quick run: each
                 Boolean task at the `small` preset, readout {cls, mean} x positional std
                 {0.02, 0.5} x init {default, mask}, plus qk-svd and qk-opt at the task's
                 own layout, whose runs are the Boolean table's (RUNS/boolean/, run if
                 missing); the other cells go to RUNS/ablation/; table RESULTS/ablation.md
  --only mult2    two-digit multiplication (Lee et al.'s 10^4 pairs), never part of the
                 default or --quick run: --digits 2 at 3% and 30% of the pairs, answers
                 reversed (Lee et al.'s format), every init, 1,000 steps, and the mask
                 with --pattern partial (a partial product per head); RUNS/mult2/
  --only lee      Lee et al.'s multiplication data (--digits 2 --lee-samples 3000: their
                 3,000 samples, unpadded), default and mask, never part of the default or
                 --quick run. On a GPU (the paper preset): their setting, NanoGPT 6 x 6 x
                 384, 5,000 iterations of 6,400 examples (their 256 windows of 256
                 characters), answers plain. With --quick: the CPU budget ladder, the small
                 preset at 40, 150 and 500 epochs, plain and reversed answers; RUNS/lee/
  --only visionprior  the vision prior study on --data (a CIFAR-10 layout, e.g. the
                 make-digits set), never part of the default or --quick run: --init mask
                 with --pattern impulse, soft, local and graded, --init impulse and
                 default, and the strength: impulse at --mask-off 2 and 5, soft at
                 --soft-alpha 0.3 and 3, and impulse's parts (qk-svd, without and
                 with --qk-svd-pos-scale 18), and --init mask-impulse (the mask with
                 impulse's positions x18 and mimetic V) with --pattern impulse and soft;
                 RUNS/visionprior/
  --only oraclefree  priors without an oracle (no hand pattern on their path), never part of
                 the default or --quick run, at the small presets: per task a default run
                 (the teacher), then the hand pattern's mask, --pattern discovered (from
                 the training data), --prior-from the teacher (mask and qk-svd) and default
                 for the teacher's and the student's steps together (tag budget2x);
                 Boolean tasks (parity2, majority3, cyclic3, kparity and kmajority on bits
                 drawn by the seed), addition at 0.4%, the digits stand-in (--data, a CIFAR-10
                 layout; teachers default and impulse, --prior-kind offsets) and the
                 language stand-in (teacher on --data/vimtext-a, students on vimtext-b, both
                 WikiText-2 layouts; --prior-kind relative); RUNS/oraclefree/, table
                 RESULTS/oraclefree.md and the found patterns beside the hand ones
  --only parity3  does any layout let the mask learn a 3-parity? kparity on bits 2, 7, 11
                 over readout x positional std x depth x the bits frozen on U, 600 steps
                 (the small preset); RUNS/parity3/
  --only mult-ladder  multiplication at the paper preset (a GPU's), never part of the
                 default run: answers msb and lsb, 5,000 steps, default, mask (carry),
                 mask --pattern partial and qk-opt; then the order whose runs average the
                 higher sequence accuracy at 20,000 steps (the plan is read again once the
                 first 24 results are in); RUNS/mult-ladder/
  --seeds LIST   seeds to run (default "0 1 2")
  --jobs N       runs at a time (default 1, --quick 2); each run gets OMP_NUM_THREADS=1
                 on the CPU when N > 1
  --gpus N       each run data-parallel on N GPUs of this machine, through torchrun
                 (python -m torch.distributed.run --standalone --nproc_per_node N); one
                 run at a time
  --data DIR     datasets (default data/): cifar-10-batches-py/ or cifar-10-batches-bin/,
                 cifar-100-python/ or cifar-100-binary/, imagenet100/ (Imagenet32 pickles +
                 map_clsloc.txt), wikitext-2/ or wikitext-2-raw/, TinyStories*.txt
  --runs DIR     run directories (default runs/paper, runs/quick with --quick)
  --results DIR  tables and plots (default results/, results/quick/ with --quick); a
                 relative --runs, --results or --data is read from the current folder,
                 the defaults live beside this script
  --download     first fetch the data sets the plan misses into --data (python train.py
                 download: CIFAR-10, CIFAR-100, WikiText-2, TinyStories; checked against pinned
                 sums, resumable); ImageNet-100 is built from an ImageNet-1k copy you have:
                 python train.py imagenet100 --from IMAGENET_1K_DIR --data DIR
  --dry-run      list the runs it would start or skip, run nothing (with --download: say
                 what it would fetch)
  PYTHON=...     the interpreter (default python)

A run whose result.json exists is skipped, and an interrupted one (a checkpoint, no
result.json) is resumed, so running it again continues where it stopped. Ctrl-C (SIGINT)
or SIGTERM to the script is passed on to every running run, which saves a checkpoint; no
new run starts, and the script waits for them and exits 130 (143). A missing dataset is reported
and its runs are skipped; a failed run makes the script exit 1 and names it (its log is
RUNS/TABLE/NAME.log). Each run folder is locked while it trains: a run another process (another
reproduce.sh on the same --runs) is training is left to it ("busy"), and each invocation reports
only its own runs' failures. A seed may be given once.
EOF
}

QUICK=0; ONLY=""; SEEDS="0 1 2"; JOBS=""; JOBS_GIVEN=0; GPUS=0; DATA=""; RUNS=""; RESULTS=""; DRY=0; DOWNLOAD=0
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
        --dry-run) DRY=1 ;;
        --download) DOWNLOAD=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "reproduce.sh: unknown option $1 (see bash reproduce.sh --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$ONLY" in
    ""|boolean|arithmetic|vision|lm|persistence|ablation|data|mult2|visionprior|oraclefree|parity3|lee|mult-ladder) ;;
    *) echo "reproduce.sh: --only takes boolean, arithmetic, vision, lm, persistence, ablation, data, mult2," \
            "visionprior, oraclefree, parity3, lee or mult-ladder, not '$ONLY'" >&2
       exit 2 ;;
esac
if [ "$ONLY" = mult-ladder ] && [ "$QUICK" = 1 ]; then
    echo "reproduce.sh: --only mult-ladder is the paper preset's (a GPU's); leave out --quick" >&2; exit 2
fi
[[ -z "${SEEDS// /}" || ! "$SEEDS" =~ ^[0-9\ ]+$ ]] && {
    echo "reproduce.sh: --seeds needs numbers, e.g. \"0 1 2\"" >&2; exit 2; }
for s in $SEEDS; do     # torch's CPU generator keeps 32 bits: a seed is 0 .. 2^32 - 1, as train.py checks it
    [ ${#s} -le 10 ] && [ "$((10#$s))" -le 4294967295 ] || {
        echo "reproduce.sh: --seeds: ${s:0:40} is not a seed in 0 .. 4294967295" >&2; exit 2; }
done
for f in "$RUNS" "$RESULTS"; do
    [ -n "$f" ] && [ -e "$f" ] && [ ! -d "$f" ] && {
        echo "reproduce.sh: $f is a file; --runs and --results take a folder" >&2; exit 2; }
done
DUP=$(printf '%s\n' $SEEDS | sed 's/^0*\([0-9]\)/\1/' | sort | uniq -d | head -n 1)
[ -n "$DUP" ] && { echo "reproduce.sh: --seeds lists seed $DUP twice (two runs would share one folder)" >&2; exit 2; }
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

# ---- the run list: reporting/plan.py says which runs each table makes, and which are skipped for want of their
# data (and where to get it); its docstring says what each line of `--list` is (a run, WAIT, REPLAN, DOWNLOAD).
PLAN_ARGS=(--seeds "$SEEDS" --data "$DATA" --runs "$RUNS" --jobs "$JOBS")
[ "$QUICK" = 1 ] && PLAN_ARGS+=(--quick)
[ -n "$ONLY" ] && PLAN_ARGS+=(--only "$ONLY")
read_plan() {
    LIST_TEXT=$("$PY" -m reporting.plan "${PLAN_ARGS[@]}" --list) \
        || { echo "reproduce.sh: cannot read the run list with $PY (python -m reporting.plan)" >&2; exit 1; }
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
