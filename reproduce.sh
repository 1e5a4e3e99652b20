#!/usr/bin/env bash
# Reproduce the paper's tables and the persistence curves. See `bash reproduce.sh --help`.
set -uo pipefail

usage() {
    cat <<'EOF'
usage: bash reproduce.sh [--quick] [--only TABLE] [--seeds "0 1 2"] [--jobs N] [--gpus N] [--data DIR]
                         [--runs DIR] [--results DIR] [--dry-run] [--help]

Runs every experiment of the paper with train.py, then writes the tables (RESULTS/*.md) and
the persistence curves (RESULTS/persistence.csv, and .png when matplotlib is installed).

  (default)      the paper presets on one GPU: Boolean (parity2, majority3, cyclic3),
                 arithmetic (addition, multiplication), vision (CIFAR-10, CIFAR-100,
                 ImageNet-100), language modelling (WikiText-2, TinyStories)
  --quick        a CPU-sized version: the Boolean tasks and addition at the `small`
                 presets, 3 seeds, 2 runs at a time (about 50 minutes on an idle 2-core CPU);
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
  --dry-run      list the runs it would start or skip, run nothing
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

QUICK=0; ONLY=""; SEEDS="0 1 2"; JOBS=""; JOBS_GIVEN=0; GPUS=0; DATA=""; RUNS=""; RESULTS=""; DRY=0
value() {   # value OPTION NEXT-ARG: the option's value, or exit 2 when there is none
    if [ -z "${2:-}" ] || [[ "$2" == --* ]]; then
        echo "reproduce.sh: $1 needs a value (see bash reproduce.sh --help)" >&2; exit 2
    fi
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
        -h|--help) usage; exit 0 ;;
        *) echo "reproduce.sh: unknown option $1 (see bash reproduce.sh --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$ONLY" in
    ""|boolean|arithmetic|vision|lm|persistence|ablation|data|mult2|visionprior|oraclefree|lee) ;;
    *) echo "reproduce.sh: --only takes boolean, arithmetic, vision, lm, persistence, ablation, data, mult2," \
            "visionprior, oraclefree or lee, not '$ONLY'" >&2
       exit 2 ;;
esac
[[ -z "${SEEDS// /}" || ! "$SEEDS" =~ ^[0-9\ ]+$ ]] && { echo "reproduce.sh: --seeds needs numbers, e.g. \"0 1 2\"" >&2; exit 2; }
DUP=$(printf '%s\n' $SEEDS | sed 's/^0*\([0-9]\)/\1/' | sort | uniq -d | head -n 1)
[ -n "$DUP" ] && { echo "reproduce.sh: --seeds lists seed $DUP twice (two runs would share one folder)" >&2; exit 2; }
PY="${PYTHON:-python}"
absolute() { if [ -z "$1" ] || [[ "$1" = /* ]]; then echo "$1"; else echo "$PWD/$1"; fi; }
# folders given are read from where the script is started; the defaults live beside it
RUNS=$(absolute "$RUNS"); RESULTS=$(absolute "$RESULTS"); DATA=$(absolute "$DATA"); DATA="${DATA:-data}"
cd "$(dirname "$0")"
if [[ " ablation data mult2 visionprior oraclefree " == *" $ONLY "* ]] && [ -n "$ONLY" ] && [ "$QUICK" = 0 ]; then
    echo "reproduce.sh: --only $ONLY runs at the small preset (as with --quick)"
    QUICK=1
fi
if [ "$QUICK" = 1 ]; then
    PRESET=small; RUNS="${RUNS:-runs/quick}"; RESULTS="${RESULTS:-results/quick}"; JOBS="${JOBS:-2}"
else
    PRESET=paper; RUNS="${RUNS:-runs/paper}"; RESULTS="${RESULTS:-results}"; JOBS="${JOBS:-1}"
fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "reproduce.sh: --jobs needs a positive integer" >&2; exit 2; }
[[ "$GPUS" =~ ^[0-9]+$ ]] || { echo "reproduce.sh: --gpus needs a number of GPUs" >&2; exit 2; }
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

want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }

# ---- datasets: where each is looked for, and where to get it
MISSING=()
have() {    # have NAME PATH... : true if any PATH exists
    local name="$1"; shift
    for p in "$@"; do [ -e "$DATA/$p" ] && return 0; done
    MISSING+=("$name: none of [$*] in $DATA/")
    return 1
}
URL_CIFAR="https://www.cs.toronto.edu/~kriz/cifar.html"
URL_IMAGENET="https://image-net.org/download-images.php (Imagenet32 + devkit map_clsloc.txt)"
URL_WIKITEXT="https://huggingface.co/datasets/Salesforce/wikitext"
URL_TINY="https://huggingface.co/datasets/roneneldan/TinyStories"

# ---- the run list: "TABLE TASK INIT SEED TAG EXTRA-FLAGS..."; the run is RUNS/TABLE/TASK-INIT-sSEED[-TAG]
# (@DATA in the flags stands for the --data folder, passed as one argument whatever it holds)
LIST=()
add() {    # add TABLE TASK "INITS" ["EXTRA FLAGS"] [TAG]
    for s in $SEEDS; do for i in $3; do LIST+=("$1 $2 $i $s ${5:--}${4:+ $4}"); done; done
}
QK="default mask qk-svd qk-opt"
if want boolean || want persistence; then
    for t in parity2 majority3 cyclic3; do add boolean "$t" "$QK"; done
fi
# arithmetic at the preset's budget (convergence); with --quick also at 250 steps, the budget at which the
# small preset shows the paper's numbers (the paper does not state its budget)
SHORT="--steps 250 --log-every 10 --eval-points 500"
if want arithmetic; then
    if [ "$QUICK" = 0 ]; then
        add arithmetic addition "$QK"
        add arithmetic multiplication "$QK"
    else    # --quick: convergence for default and mask (all four with --only arithmetic), 250 steps for all four
        FULL="default mask"; [ "$ONLY" = arithmetic ] && FULL="$QK"
        add arithmetic addition "$FULL"
        add arithmetic addition "$QK" "$SHORT" 250steps
        if [ "$ONLY" = arithmetic ]; then
            add arithmetic multiplication "$QK"
            add arithmetic multiplication "$QK" "$SHORT" 250steps
        fi
    fi
fi
if [ "$ONLY" = data ]; then
    add arithmetic addition "default mask"          # 0.4%: the arithmetic table's own runs
    for f in 0.0005 0.001 0.002 0.008; do add data addition "default mask" "--data-frac $f" "frac$f"; done
fi
if [ "$QUICK" = 0 ] && want vision; then
    VI="default mimetic impulse mask mask-impulse"     # mask-impulse: the mask with impulse's positions and V (issue 34)
    have "cifar10 ($URL_CIFAR)" cifar-10-batches-py/data_batch_1 cifar-10-batches-bin/data_batch_1.bin \
        && add vision cifar10 "$VI" "--data-dir @DATA"
    have "cifar100 ($URL_CIFAR)" cifar-100-python/train cifar-100-binary/train.bin \
        && add vision cifar100 "$VI" "--data-dir @DATA"
    have "imagenet100 ($URL_IMAGENET)" imagenet100/map_clsloc.txt \
        && add vision imagenet100 "$VI" "--data-dir @DATA/imagenet100"
fi
if [ "$QUICK" = 0 ] && want lm; then
    have "wikitext2 ($URL_WIKITEXT)" wikitext-2/wiki.train.tokens wikitext-2-raw/wiki.train.raw \
        && add lm wikitext2 "$QK" "--data-dir @DATA"
    have "tinystories ($URL_TINY)" TinyStoriesV2-GPT4-train.txt TinyStories-train.txt \
        TinyStories/TinyStoriesV2-GPT4-train.txt TinyStories/TinyStories-train.txt \
        && add lm tinystories "default mask" "--data-dir @DATA"
fi
if [ "$ONLY" = mult2 ]; then
    for f in 0.03 0.3; do
        add mult2 multiplication "$QK" "--digits 2 --data-frac $f --answer-order lsb --steps 1000 --log-every 50" "d2-frac$f"
        add mult2 multiplication mask "--digits 2 --data-frac $f --answer-order lsb --steps 1000 --log-every 50 --pattern partial" \
            "d2-frac$f-partial"
    done
fi
if [ "$ONLY" = lee ]; then
    LEE="--digits 2 --lee-samples 3000"
    if [ "$QUICK" = 0 ]; then       # their batch: 256 windows x 256 characters / 10.25 characters an example
        add lee multiplication "default mask" "$LEE --answer-order msb --batch-size 6400 --log-every 250" msb-nanogpt
    else                            # a log step every 1/20 of a run (24 steps an epoch at batch 128)
        for o in msb lsb; do
            add lee multiplication "default mask" "$LEE --answer-order $o --epochs 40 --log-every 48" "$o-ep40"
            add lee multiplication "default mask" "$LEE --answer-order $o --epochs 150 --log-every 180" "$o-ep150"
            add lee multiplication "default mask" "$LEE --answer-order $o --epochs 500 --log-every 600" "$o-ep500"
        done
    fi
fi
if [ "$ONLY" = visionprior ]; then
    have "a CIFAR-10 layout (python train.py make-digits DIR)" cifar-10-batches-py/data_batch_1 \
        cifar-10-batches-bin/data_batch_1.bin && {
        for p in impulse soft local graded; do add visionprior cifar10 mask "--data-dir @DATA --pattern $p" "$p"; done
        add visionprior cifar10 "default impulse" "--data-dir @DATA"
        # the prior's strength: the hard impulse's off level, the soft bump's width
        for m in 2 5; do add visionprior cifar10 mask "--data-dir @DATA --pattern impulse --mask-off $m" "impulse-off$m"; done
        for a in 0.3 3; do add visionprior cifar10 mask "--data-dir @DATA --pattern soft --soft-alpha $a" "soft-alpha$a"; done
        # impulse taken apart: its QK part alone, then with the positions x18 (impulse adds the mimetic V)
        add visionprior cifar10 qk-svd "--data-dir @DATA"
        add visionprior cifar10 qk-svd "--data-dir @DATA --qk-svd-pos-scale 18" pos18
        # the mask with impulse's positions x18 and mimetic V-proj: only where the pattern lives differs
        for p in impulse soft; do add visionprior cifar10 mask-impulse "--data-dir @DATA --pattern $p" "$p"; done
    }
fi
if [ "$ONLY" = ablation ]; then
    # the cells at a task's own preset are its Boolean-table runs (all four inits); the others go to ablation/
    for t in parity2 majority3 cyclic3; do
        add boolean "$t" "$QK"
        layout=$("$PY" -c "from reporting.report import preset_layout; print('%s-pos%s' % preset_layout('$t'))") \
            || { echo "reproduce.sh: cannot read the presets with $PY" >&2; exit 1; }
        for r in cls mean; do for p in 0.02 0.5; do
            [ "$r-pos$p" = "$layout" ] || add ablation "$t" "default mask" "--readout $r --pos-init-std $p" "$r-pos$p"
        done; done
    done
fi
if [ "$ONLY" = oraclefree ]; then
    # teachers first (a WAIT item lets every run before it finish), then the students that read them
    OF=oraclefree; TEACHER="--prior-from @RUNS/$OF"
    boolean_flags() { case "$1" in kparity) echo "--bits random:2 --unseen bits:2" ;;
                                    kmajority) echo "--bits random:3 --unseen bits:2" ;; *) echo "" ;; esac; }
    # the teacher's and the student's budget together: each task's preset steps (the digits': epochs), doubled
    declare -A TWICE
    while read -r task n; do TWICE[$task]=$n; done < <("$PY" -c "
import train
for t in ('parity2', 'kparity', 'majority3', 'kmajority', 'addition', 'wikitext2', 'cyclic3', 'cifar10'):
    c = train.resolve(*train.parse_args(['--task', t]))
    print(t, 2 * int(c.steps or c.epochs))")
    [ -n "${TWICE[cyclic3]:-}" ] || { echo "reproduce.sh: cannot read the presets with $PY" >&2; exit 1; }
    VISION=0; LM=0
    have "a CIFAR-10 layout (python train.py make-digits DIR)" cifar-10-batches-py/data_batch_1 \
        cifar-10-batches-bin/data_batch_1.bin && VISION=1
    have "two WikiText-2 layouts (python train.py make-wikitext DIR/vimtext-a FILES...; vimtext-b)" \
        vimtext-a/wikitext-2/wiki.train.tokens && have "vimtext-b" vimtext-b/wikitext-2/wiki.train.tokens && LM=1
    # the cheap tasks first, cyclic3 (8,000 steps a run) last
    for group in "parity2 kparity majority3 kmajority addition" vision lm cyclic3; do
        [ "$group" = vision ] && [ "$VISION" = 0 ] && continue
        [ "$group" = lm ] && [ "$LM" = 0 ] && continue
        case "$group" in
            vision) add $OF cifar10 "default impulse" "--data-dir @DATA" ;;
            lm) add $OF wikitext2 default "--data-dir @DATA/vimtext-a" corpusA ;;
            *) for t in $group; do add $OF "$t" default "$(boolean_flags $t)"; done ;;
        esac
        LIST+=("WAIT")
        case "$group" in
            vision)
                add $OF cifar10 mask "--data-dir @DATA"
                for s in $SEEDS; do
                    LIST+=("$OF cifar10 mask $s teacher --data-dir @DATA $TEACHER/cifar10-default-s$s")
                    LIST+=("$OF cifar10 mask $s teacher-impulse --data-dir @DATA $TEACHER/cifar10-impulse-s$s")
                done
                add $OF cifar10 default "--data-dir @DATA --epochs ${TWICE[cifar10]}" budget2x ;;
            lm)
                add $OF wikitext2 "default mask" "--data-dir @DATA/vimtext-b" corpusB
                for s in $SEEDS; do
                    LIST+=("$OF wikitext2 mask $s corpusB-teacher --data-dir @DATA/vimtext-b $TEACHER/wikitext2-default-s$s-corpusA")
                done
                add $OF wikitext2 default "--data-dir @DATA/vimtext-b --steps ${TWICE[wikitext2]}" corpusB-budget2x ;;
            *)
                for t in $group; do   # addition's default is at 98% by its preset's 1,500 steps: no room
                    [ "$t" = addition ] && continue
                    f=$(boolean_flags $t)
                    add $OF "$t" mask "$f"
                    add $OF "$t" mask "$f --pattern discovered" discovered
                    for s in $SEEDS; do for i in mask qk-svd; do
                        LIST+=("$OF $t $i $s teacher $f $TEACHER/$t-default-s$s")
                    done; done
                    add $OF "$t" default "$f --steps ${TWICE[$t]}" budget2x
                done
                # addition's students at 250 steps, the paper's regime (where the hand mask leads: results/README.md);
                # the teachers are the 1,500-step defaults, so the same-budget default gets 1,750 steps
                if [[ " $group " == *" addition "* ]]; then
                    SHORT250="--steps 250 --log-every 10 --eval-points 500"
                    add $OF addition "default mask" "$SHORT250" 250steps
                    add $OF addition mask "$SHORT250 --pattern discovered" 250steps-discovered
                    for s in $SEEDS; do for i in mask qk-svd; do
                        LIST+=("$OF addition $i $s 250steps-teacher $SHORT250 $TEACHER/addition-default-s$s")
                    done; done
                    add $OF addition default "--steps $(( TWICE[addition] / 2 + 250 )) --log-every 50 --eval-points 500" 250steps-samebudget
                fi ;;
        esac
    done
fi
[ "$ONLY" = persistence ] && LIST=()

# ---- one run: skip if finished, resume if interrupted, else start
run_one() {
    local table="$1" task="$2" init="$3" seed="$4" tag="$5"; shift 5
    local name="$task-$init-s$seed"
    [ "$tag" = - ] || name="$name-$tag"
    local out="$RUNS/$table/$name" log="$RUNS/$table/$name.log" extra=() a
    for a in "$@"; do
        case "$a" in @DATA*) extra+=("$DATA${a#@DATA}") ;; @RUNS*) extra+=("$RUNS${a#@RUNS}") ;; *) extra+=("$a") ;; esac
    done
    if [ -f "$out/result.json" ]; then echo "skip    $out (finished)"; return 0; fi
    if [ "$DRY" = 0 ] && [ -d "$out" ] && command -v flock >/dev/null && ! flock -n "$out" true 2>/dev/null; then
        echo "busy    $out (another process trains it; not started here)" | tee -a "$STATE/busy"
        return 0
    fi
    local resume=() what=start launch
    [ -f "$out/ckpt.pt" ] && { resume=(--resume); what=resume; }
    read -ra launch <<< "$LAUNCH_LINE"
    local cmd=("$PY" "${launch[@]}" --task "$task" --init "$init" --seed "$seed" --preset "$PRESET" --out "$out"
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
LAUNCH_LINE="${LAUNCH[*]}"

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
N_RUNS=0; for item in "${LIST[@]}"; do [ "$item" = WAIT ] || N_RUNS=$((N_RUNS + 1)); done
echo "reproduce.sh: $N_RUNS runs (preset $PRESET, seeds $SEEDS, $JOBS at a time) into $RUNS"
[ "$DRY" = 0 ] && mkdir -p "$RUNS"
# this invocation's own failed / busy / interrupted lists: another reproduce.sh on the same --runs keeps its own
STATE=$(mktemp -d "${TMPDIR:-/tmp}/reproduce.XXXXXX") || { echo "reproduce.sh: cannot make a temporary folder" >&2; exit 1; }
trap 'rm -rf "$STATE"' EXIT
STATUS=0
set -m
for item in "${LIST[@]}"; do
    [ -n "$SIGNAL" ] || [ -f "$STATE/interrupted" ] && break
    if [ "$item" = WAIT ]; then                 # the runs after it read the ones before (teachers)
        while [ -n "$(jobs -rp)" ]; do wait 2>/dev/null; done
        continue
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n 2>/dev/null; done
    [ -n "$SIGNAL" ] || [ -f "$STATE/interrupted" ] && break
    read -ra fields <<< "$item"
    if [ "$DRY" = 1 ]; then run_one "${fields[@]}"; else run_one "${fields[@]}" & fi
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
for m in "${MISSING[@]}"; do echo "missing dataset, its runs skipped: $m" >&2; done
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
