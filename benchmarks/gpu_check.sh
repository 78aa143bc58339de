#!/usr/bin/env bash
# The prepared calls on a lent GPU machine. Its image: torch 2.11, triton 3.6, transformers 5.17,
# accelerate 1.15, peft 0.21, numpy 2.5, no bitsandbytes, no trl, no network. A lease gives 10
# minutes a call and 15 in all, the machine's start (about 2) included: the first call below is the
# run plan, it decides (correctness first, then the e2e step judged by its losses, then LoRA) and
# stops its steps by BUDGET_S (540 s) so that it ends inside one call; the second fits what is left.
#
#   bash benchmarks/gpu_check.sh                                      # <= 520 s: the run plan (default STEPS)
#   STEPS="long" bash benchmarks/gpu_check.sh                         # <= 240 s: long sequences, if the lease has it
# Later leases:
#   STEPS="compile rank-sync" bash benchmarks/gpu_check.sh            # <= 420 s: eager vs torch.compile, checksum
#   STEPS="lora-compile" bash benchmarks/gpu_check.sh                 # <= 420 s: fused LoRA compiled (Inductor)
#   STEPS="bench check" bash benchmarks/gpu_check.sh                  # <= 360 s: kernel timings, accel-patch check
#   STEPS="moe" bash benchmarks/gpu_check.sh                          # <= 300 s: MoE experts, Qwen3-30B-A3B layers
#   STEPS="moe-checkpointed" bash benchmarks/gpu_check.sh             # <= 300 s: the same under gradient checkpointing
#   STEPS="trl-post" bash benchmarks/gpu_check.sh                     # <= 300 s: TRL heads (skipped: no trl on the image)
# Here:
#   bash benchmarks/gpu_check.sh --dry-run                            # every step on a CPU at tiny shapes
#   bash benchmarks/gpu_check.sh --list                               # the steps, their limits, BUDGET_S
#
# The default STEPS, in order:
#   versions      the versions and the GPU (benchmarks/versions.py)
#   kernel-tests  tests/kernels -m "not slow" on CUDA tensors with real kernels, every test (no -x), 60 s a test
#   gpu-tests     the CUDA-only tests: LoRA dropout on CUDA (tests/swaps/lora/test_lora_dropout.py) and the tiled
#                 MLP under checkpoint offloading on CUDA (tests/swaps/layers/test_tiled_mlp.py), -k cuda
#   e2e           one training step at the Llama-3.2-1B shape, bf16, full and LoRA r=16: stock, swapped, swapped +
#                 tiled MLP (benchmarks/e2e.py); a swapped loss or gradient norm off stock's fails the step
#   lora          LoRA r=16 as adapter users train it (bf16 autocast, dropout 0.05): stock PEFT, swapped today,
#                 fused LoRA, fused LoRA + tiled MLP (benchmarks/lora.py); losses judged the same way
# Others: long (benchmarks/long_context.py --no-longest, gradient checkpointing at 8k/16k/32k), rank-sync
# (the rank-sync checksum of a 1B parameter set), compile (e2e eager vs Inductor), lora-compile, qlora
# (only where bitsandbytes is), moe (benchmarks/moe.py: Qwen3-30B-A3B experts, 4 layers, bf16, full and
# LoRA on experts, against transformers' grouped_mm; "ours" the experts alone, "accel_patch" every op), moe-checkpointed (the same, non-reentrant
# gradient checkpointing, where the op recomputes gate/up and the Triton path tiles), moe-block (one
# Qwen3-30B-A3B sparse block alone: the experts' forward and backward peak without a model around it), trl-post (benchmarks/trl_post.py: DPO, KTO, GRPO
# with LoRA against TRL's head; the image has no trl, so it says skipped), bench (python -m accel_kernels.bench --quick), check (accel-patch check),
# unit-tests (the quick loop without tests/kernels, real kernels: the versions themselves are tested by
# .ci/run's floor job on a CPU, since triton 3.6's interpreter cannot run with numpy 2.5). The
# longest-sequence search (long_context.py --only-longest) needs a GPU's memory limit and has no dry
# run: run it by hand.
#
# Tests run with TRITON_INTERPRET=0 on the GPU (tests/conftest.py sets 1 only where it is unset).
# Output: $OUT (default ./out) gets one JSON per step, written by the step as it goes (after every
# variant or test, so a step stopped by its limit keeps what finished), and gpu_check.log (every
# step's whole output); more than 7 steps are packed into gpu_check.tar.gz at the end (at most 8
# files come back). Each step prints "== <step>: rc=<n> in <s> s"; rc 124 is its time limit, 125
# not started (BUDGET_S), 3 exited 0 without writing its JSON. The script exits 1 when any step
# failed, dry run or not.
#
# --dry-run runs every step (or STEPS) on this CPU machine through the same scripts and arguments at
# tiny shapes, pytest steps collecting their tests (--collect-only: imports and selections), each
# writing its JSON; tests/test_gpu_check.py runs it.
#
# Adding a step: one `add` line below (name, limit in seconds, GPU command, dry-run command, both run
# by bash with $OUT and $PY set; each must write "$OUT/<name>.json"), and the name in STEPS where it
# belongs. A benchmark follows the convention of benchmarks/*.py: `--json PATH` written after each
# variant, `--dry-run` for the tiny CPU shapes; pytest steps go through benchmarks/pytest_step.py.
set -u
cd "$(dirname "$0")/.."
DRY=0 LIST=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY=1 ;;
        --list) LIST=1 ;;  # the steps: name, limit, in the default STEPS or not; then BUDGET_S
        -h|--help) sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (valid: --dry-run, --list, --help)" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-$PWD/out}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-540}   # no step starts that could end past this many seconds after the start
DRY_LIMIT_S=${DRY_LIMIT_S:-600}  # a dry step that hangs stops here
mkdir -p "$OUT"
# A dry run has no figures: one thread, which also lets the benchmarks fork their variants
# (benchmarks/_children.py) instead of importing torch and transformers again for each.
if [ "$DRY" = 1 ]; then OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
export OUT PY PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Import the checkout without installing it: accel_patch from the root, accel_kernels from kernels/.
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
# Liger Kernel, when carried as a wheel in .whl/, is installed beside for comparison columns.
if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

NAMES=()
declare -A LIMIT CMD DRYCMD
add() { NAMES+=("$1"); LIMIT[$1]=$2; CMD[$1]=$3; DRYCMD[$1]=$4; }
T='$PY benchmarks/pytest_step.py --json "$OUT/$STEP.json" --per-test 60 -- -q -p no:cacheprovider'  # a pytest step, 60 s a test
GPU_TESTS='-k cuda tests/swaps/lora/test_lora_dropout.py tests/swaps/layers/test_tiled_mlp.py'

#   name          limit  GPU command / dry-run command
add versions        20  '$PY benchmarks/versions.py --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/versions.py --json "$OUT/$STEP.json"'
add kernel-tests   120  "TRITON_INTERPRET=0 ACCEL_TEST_DEVICE=cuda $T -m 'not slow' tests/kernels" \
                        "$T -m 'not slow' --collect-only tests/kernels"
add gpu-tests       60  "TRITON_INTERPRET=0 $T $GPU_TESTS" \
                        "$T --collect-only $GPU_TESTS"
add e2e            180  '$PY benchmarks/e2e.py --device cuda --warmup 2 --steps 5 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/e2e.py --dry-run --json "$OUT/$STEP.json"'
add lora           140  '$PY benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 --steps 5 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/lora.py --dry-run --autocast bf16 --dropout 0.05 --json "$OUT/$STEP.json"'
add long           240  '$PY benchmarks/long_context.py --device cuda --no-longest --steps 3 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/long_context.py --dry-run --json "$OUT/$STEP.json"'
add rank-sync      120  '$PY benchmarks/rank_sync.py --device cuda --repeats 5 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/rank_sync.py --dry-run --json "$OUT/$STEP.json"'
add compile        300  '$PY benchmarks/e2e.py --device cuda --compile --warmup 2 --steps 5 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/e2e.py --dry-run --compile --backend eager --json "$OUT/$STEP.json"'
add lora-compile   420  '$PY benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 --compile inductor --warmup 2 --steps 3 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/lora.py --dry-run --autocast bf16 --dropout 0.05 --compile eager --json "$OUT/$STEP.json"'
add qlora          240  'if $PY -c "import bitsandbytes" 2>/dev/null; then $PY benchmarks/lora.py --device cuda --qlora --autocast bf16 --dropout 0.05 --steps 5 --json "$OUT/$STEP.json"; else echo "skipped: bitsandbytes is not installed (no 4-bit base to fuse)"; echo "{\"skipped\": \"no bitsandbytes\"}" > "$OUT/$STEP.json"; fi' \
                        'if $PY -c "import bitsandbytes" 2>/dev/null; then $PY benchmarks/lora.py --dry-run --qlora --json "$OUT/$STEP.json"; else echo "{\"skipped\": \"no bitsandbytes\"}" > "$OUT/$STEP.json"; fi'
add bench          240  '$PY -m accel_kernels.bench --quick --json "$OUT/$STEP.json"' \
                        '$PY -m accel_kernels.bench --quick --ops rms_norm --json "$OUT/$STEP.json"'
add check          120  '$PY -m accel_patch.cli check --json > "$OUT/$STEP.json"' \
                        '$PY -m accel_patch.cli check --json --parts launch > "$OUT/$STEP.json"'
add moe            300  '$PY benchmarks/moe.py --device cuda --variants eager,grouped_mm,ours,accel_patch --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run --variants eager,grouped_mm,ours,accel_patch --json "$OUT/$STEP.json"'
add moe-checkpointed 300  '$PY benchmarks/moe.py --device cuda --checkpointing --variants grouped_mm,ours,accel_patch --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run --checkpointing --modes lora --variants grouped_mm,ours,accel_patch --json "$OUT/$STEP.json"'
add moe-block      180  '$PY benchmarks/moe.py --device cuda --block --variants grouped_mm,ours --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run --block --variants grouped_mm,ours --json "$OUT/$STEP.json"'
add trl-post       300  'if $PY -c "import trl" 2>/dev/null; then $PY benchmarks/trl_post.py --device cuda --trainers dpo,kto,grpo --tunings lora --json "$OUT/$STEP.json"; else echo "skipped: trl is not installed"; echo "{\"skipped\": \"no trl\"}" > "$OUT/$STEP.json"; fi' \
                        'if $PY -c "import trl" 2>/dev/null; then $PY benchmarks/trl_post.py --dry-run --trainers dpo,grpo --tunings lora --json "$OUT/$STEP.json"; else echo "{\"skipped\": \"no trl\"}" > "$OUT/$STEP.json"; fi'
add unit-tests     100  "TRITON_INTERPRET=0 $T -m 'not slow' tests --ignore=tests/kernels" \
                        "$T -m 'not slow' --collect-only tests --ignore=tests/kernels"

DEFAULT_STEPS="versions kernel-tests gpu-tests e2e lora"
if [ "$LIST" = 1 ]; then
    for s in "${NAMES[@]}"; do
        case " $DEFAULT_STEPS " in *" $s "*) d=default ;; *) d=other ;; esac
        echo "$s ${LIMIT[$s]} $d"
    done
    echo "BUDGET_S $BUDGET_S"
    exit 0
fi
if [ -n "${STEPS:-}" ]; then
    for s in $STEPS; do
        [ -n "${LIMIT[$s]:-}" ] || { echo "gpu_check.sh: unknown step '$s' in STEPS (valid: ${NAMES[*]})" >&2; exit 2; }
    done
elif [ "$DRY" = 1 ]; then
    STEPS="${NAMES[*]}"
else
    STEPS=$DEFAULT_STEPS
fi

LOG="$OUT/gpu_check.log"
: > "$LOG"
START=$(date +%s)
FAILED=()
echo "gpu_check: $([ "$DRY" = 1 ] && echo "DRY RUN on $(hostname), ")steps: $STEPS; budget ${BUDGET_S} s; out $OUT"
for STEP in $STEPS; do
    if [ "$DRY" = 1 ]; then limit=$DRY_LIMIT_S; cmd=${DRYCMD[$STEP]}; else limit=${LIMIT[$STEP]}; cmd=${CMD[$STEP]}; fi
    elapsed=$(( $(date +%s) - START ))
    if [ "$DRY" = 0 ] && [ $(( elapsed + limit )) -gt "$BUDGET_S" ]; then
        echo "== $STEP: rc=125 (not started: its limit ${limit} s would end past BUDGET_S=${BUDGET_S} s, at ${elapsed} s)"
        FAILED+=("$STEP")
        continue
    fi
    rm -f "$OUT/$STEP.json"
    steplog=$(mktemp)
    t0=$(date +%s)
    STEP=$STEP timeout -k 10 "$limit" bash -c "$cmd" >"$steplog" 2>&1
    rc=$?
    note=""
    if [ "$rc" = 0 ] && ! python3 -c 'import json, sys; assert json.load(open(sys.argv[1]))' "$OUT/$STEP.json" 2>/dev/null; then
        rc=3
        note=" (exited 0 without writing valid JSON to $OUT/$STEP.json)"
    fi
    [ "$rc" = 124 ] && note=" (its limit: ${limit} s)"
    { echo "===== $STEP (rc=$rc$note): $cmd"; cat "$steplog"; } >> "$LOG"
    echo "== $STEP: rc=$rc in $(( $(date +%s) - t0 )) s$note"
    tail -n 25 "$steplog"
    rm -f "$steplog"
    [ "$rc" = 0 ] || FAILED+=("$STEP")
done

if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then  # at most 8 files come back
    (cd "$OUT" && tar czf gpu_check.tar.gz --remove-files -- $(ls | grep -v '^gpu_check.tar.gz$'))
    echo "gpu_check: packed $OUT into gpu_check.tar.gz"
fi
echo "gpu_check: $(( $(date +%s) - START )) s; failed: ${FAILED[*]:-none}"
[ "${#FAILED[@]}" = 0 ]
