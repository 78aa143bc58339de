#!/usr/bin/env bash
# The prepared calls on a lent GPU machine (one H200, 16 cores). Its image: torch 2.11, triton 3.6,
# transformers 5.17, accelerate 1.15, peft 0.21, numpy 2.5, pytest-xdist, no network; liger-kernel,
# bitsandbytes, trl and datasets travel as wheels in the git-ignored .whl/ (fetched here by
# benchmarks/fetch_wheels.sh; 46 MiB with the tree, the limit is 64), installed with --no-deps into
# /tmp/site after the image's packages on PYTHONPATH (none of them shadows torch or numpy). A lease
# gives 10 minutes a call and 15 in all, the machine's start (1-2) included.
#
# The first call, the default plan (its command time at most BUDGET_S = 540 s, then the summary):
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# The second call, if the lease has 5 minutes left:
#   run(command='STEPS="lora-small lora-compile long" BUDGET_S=290 bash benchmarks/gpu_check.sh', carry=[".whl"], timeout_s=300)
#   (lora-small: the LoRA step at 1 x 512 tokens, stock PEFT / without the LoRA ops / fused (timed against PEFT per call shape) / fused untimed, ~50 s: whether
#   fused LoRA's host work shows where a call's device work is short; lora-compile: stock PEFT and fused
#   LoRA under Inductor, one process, ~150 s; long: 16k and 32k tokens with gradient checkpointing, cut
#   to what is left, each length's figures kept as it ends)
# Here:
#   bash benchmarks/fetch_wheels.sh                                   # once: the wheels into .whl/
#   bash benchmarks/gpu_check.sh --dry-run                            # every step on a CPU at tiny shapes
#   STEPS="e2e" bash benchmarks/gpu_check.sh --dry-run                # one step's dry run
#   bash benchmarks/gpu_check.sh --list                               # the steps, their limits, BUDGET_S
#
# The default STEPS, in order of value (limit; estimate on the H200: imports and model builds
# included; the Triton cache the kernel tests fill serves the later steps):
#   versions      20 s (~6)   the versions and the GPU (benchmarks/versions.py)
#   kernel-tests  75 s (~35)  tests/kernels -m "not slow" on CUDA tensors, real kernels, pytest -n 8 (32 s measured)
#   gpu-tests     45 s (~20)  the CUDA-only tests: fused LoRA's dropout against PEFT's on CUDA, the tiled MLP under
#                             checkpoint offloading (tests/swaps/lora/test_lora_dropout.py, tests/swaps/layers/test_tiled_mlp.py -k cuda)
#   e2e          150 s (~90)  the Llama-3.2-1B-shape step, bf16, 4 x 2048 tokens, one process: full fine-tune stock,
#                             accel-patch, accel-patch with the norms' outputs kept (+kept), Liger; LoRA r=16 all-linear stock PEFT, accel-patch, Liger + PEFT; each
#                             judged by its first loss and gradient norm against stock's; plus torch.profiler of
#                             one accel-patch and one Liger step ($OUT/profile.json)
#   lora         100 s (~55)  LoRA as adapter users train it (bf16 autocast, dropout 0.05): stock PEFT, Liger +
#                             PEFT, accel-patch without the LoRA ops ("swapped today"), accel-patch fused LoRA
#   flce          60 s (~35)  the fused loss alone at 8192 x 4096 x 128256 bf16: the weight's gradient by its own
#                             vocabulary pass (the default) against the fp32 sum over token chunks, the bf16 sum
#                             over the forward's 8 chunks (WEIGHT_DTYPE_SUM_CHUNKS=8), and Liger's
#   moe-op        75 s (~40)  the experts op alone at Qwen3-30B-A3B's shape, forward and backward timed apart, each
#                             backward (Triton, grouped_mm, auto) against transformers' grouped_mm path, and
#                             the Triton and grouped_mm backwards again with the op's small tiles forced
#   e2e-compile  240 s (~160) stock + torch.compile and accel-patch + torch.compile (Inductor, cold cache), full
#   bench        120 s (~70)  python -m accel_kernels.bench --quick: each op against eager and Liger, host-inclusive
#                             and device (profiler) times, % of copy bandwidth
#   moe          110 s (~70)  Qwen3-30B-A3B layers (2 of them), full and LoRA: grouped_mm vs accel-patch
#   moe-checkpointed 100 s (~70) the same under gradient checkpointing, full (the step measured slowest against
#                             grouped_mm) then LoRA on the experts
#   qlora        150 s        QLoRA (bitsandbytes 4-bit base): stock PEFT vs fused LoRA, where bitsandbytes is
#   trl-post     150 s        TRL's DPO and GRPO heads with LoRA, stock vs accel-patch, where trl is
# A step starts only if its limit ends inside BUDGET_S, else with what is left if that is at least
# MIN_STEP_S (60 s): every benchmark writes its JSON after each variant, so a step cut by its limit
# keeps what finished. The estimates through moe-checkpointed add up to ~650 s, more than BUDGET_S: the
# steps through moe fit where the compile step's cold cache is quicker than its estimate, and what is
# cut or not started (rc 124 or 125 in the summary) leads the second call's STEPS, before lora-compile.
# Others: lora-small (the lora step at 1 x 512 tokens, 80 s), long
# (benchmarks/long_context.py --no-longest, gradient checkpointing at 16k/32k), rank-sync, lora-compile
# (stock PEFT and fused LoRA compiled, Inductor), moe-block, check (accel-patch check), unit-tests (the
# quick loop without tests/kernels, real kernels). The longest-sequence search (long_context.py
# --only-longest) needs a GPU's memory limit and has no dry run: run it by hand.
#
# Tests run with TRITON_INTERPRET=0 on the GPU (tests/conftest.py sets 1 only where it is unset).
# Output: $OUT (default ./out) gets one JSON per step, written by the step as it goes (after every
# variant or test, so a step stopped by its limit keeps what finished), profile.json (e2e's
# profiles) and gpu_check.log (every step's whole output); more than 8 files are packed into
# gpu_check.tar.gz at the end (at most 8 files come back). Each step prints "== <step>: rc=<n> in
# <s> s" and its last lines; rc 124 is its time limit, 125 not started (BUDGET_S), 3 exited 0 without
# writing its JSON. The output ENDS with one summary table (benchmarks/summary.py): one row per
# measured thing, its ratio against the user's alternative, PASS/MISS against the targets
# (docs/benchmarks.md). The script exits 1 when any step failed, dry run or not.
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
BUDGET_S=${BUDGET_S:-540}   # no step runs past this many seconds after the start (the wheels' install included)
MIN_STEP_S=${MIN_STEP_S:-60}  # a step whose limit would pass BUDGET_S runs with what is left, if at least this
DRY_LIMIT_S=${DRY_LIMIT_S:-600}  # a dry step that hangs stops here
mkdir -p "$OUT"
# A dry run has no figures: one thread, which also lets the benchmarks fork their variants
# (benchmarks/_children.py) instead of importing torch and transformers again for each.
if [ "$DRY" = 1 ]; then OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
export OUT PY PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# Import the checkout without installing it: accel_patch from the root, accel_kernels from kernels/.
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"

NAMES=()
declare -A LIMIT CMD DRYCMD
add() { NAMES+=("$1"); LIMIT[$1]=$2; CMD[$1]=$3; DRYCMD[$1]=$4; }
T='$PY benchmarks/pytest_step.py --json "$OUT/$STEP.json" --per-test 60 -- -q -p no:cacheprovider'  # a pytest step, 60 s a test
GPU_TESTS='-k cuda tests/swaps/lora/test_lora_dropout.py tests/swaps/layers/test_tiled_mlp.py'

#   name          limit  GPU command / dry-run command
add versions        20  '$PY benchmarks/versions.py --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/versions.py --json "$OUT/$STEP.json"'
add kernel-tests    75  "TRITON_INTERPRET=0 ACCEL_TEST_DEVICE=cuda $T -n 8 -m 'not slow' tests/kernels" \
                        "$T -n 2 -m 'not slow' --collect-only tests/kernels"
add gpu-tests       45  "TRITON_INTERPRET=0 $T $GPU_TESTS" \
                        "$T --collect-only $GPU_TESTS"
E2E_VARIANTS=stock,swapped,swapped+kept,liger,stock+lora,swapped+lora,liger+lora
add e2e            150  '$PY benchmarks/e2e.py --device cuda --warmup 2 --steps 5 --variants '$E2E_VARIANTS' --profile "$OUT/profile.json" --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/e2e.py --dry-run --variants '$E2E_VARIANTS' --profile "$OUT/profile.json" --json "$OUT/$STEP.json"'
LORA_VARIANTS='"stock,liger,swapped today,fused LoRA"'
add lora           100  '$PY benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 --warmup 2 --steps 5 --variants '"$LORA_VARIANTS"' --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/lora.py --dry-run --autocast bf16 --dropout 0.05 --variants '"$LORA_VARIANTS"' --json "$OUT/$STEP.json"'
add flce            60  '$PY benchmarks/flce_weight.py --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/flce_weight.py --dry-run --json "$OUT/$STEP.json"'
add moe-op          75  '$PY benchmarks/moe_backward.py --steps 10 --repeats 3 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe_backward.py --steps 2 --repeats 1 --json "$OUT/$STEP.json"'
add e2e-compile    240  '$PY benchmarks/e2e.py --device cuda --warmup 2 --steps 5 --variants stock+compile,swapped+compile --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/e2e.py --dry-run --backend eager --variants stock+compile,swapped+compile --json "$OUT/$STEP.json"'
add bench          120  '$PY -m accel_kernels.bench --quick --json "$OUT/$STEP.json"' \
                        '$PY -m accel_kernels.bench --quick --ops rms_norm --json "$OUT/$STEP.json"'
MOE='--variants grouped_mm,accel_patch --layers 2 --steps 4'
add moe            110  '$PY benchmarks/moe.py --device cuda '"$MOE"' --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run '"$MOE"' --json "$OUT/$STEP.json"'
add moe-checkpointed 100 '$PY benchmarks/moe.py --device cuda --checkpointing --modes full,lora '"$MOE"' --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run --checkpointing --modes full,lora '"$MOE"' --json "$OUT/$STEP.json"'
add qlora          150  'if $PY -c "import bitsandbytes" 2>/dev/null; then $PY benchmarks/lora.py --device cuda --qlora --autocast bf16 --dropout 0.05 --warmup 2 --steps 3 --variants "stock,fused LoRA" --json "$OUT/$STEP.json"; else echo "skipped: bitsandbytes is not installed (no 4-bit base to fuse)"; echo "{\"skipped\": \"no bitsandbytes\"}" > "$OUT/$STEP.json"; fi' \
                        'if $PY -c "import bitsandbytes" 2>/dev/null; then $PY benchmarks/lora.py --dry-run --qlora --variants "stock,fused LoRA" --json "$OUT/$STEP.json"; else echo "{\"skipped\": \"no bitsandbytes\"}" > "$OUT/$STEP.json"; fi'
add trl-post       150  'if $PY -c "import trl" 2>/dev/null; then $PY benchmarks/trl_post.py --device cuda --trainers dpo,grpo --tunings lora --json "$OUT/$STEP.json"; else echo "skipped: trl is not installed"; echo "{\"skipped\": \"no trl\"}" > "$OUT/$STEP.json"; fi' \
                        'if $PY -c "import trl" 2>/dev/null; then $PY benchmarks/trl_post.py --dry-run --trainers dpo,grpo --tunings lora --json "$OUT/$STEP.json"; else echo "{\"skipped\": \"no trl\"}" > "$OUT/$STEP.json"; fi'
add long           150  '$PY benchmarks/long_context.py --device cuda --no-longest --seqs 16384,32768 --warmup 1 --steps 2 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/long_context.py --dry-run --json "$OUT/$STEP.json"'
add rank-sync      120  '$PY benchmarks/rank_sync.py --device cuda --repeats 5 --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/rank_sync.py --dry-run --json "$OUT/$STEP.json"'
add lora-small      80  '$PY benchmarks/lora.py --device cuda --small --autocast bf16 --dropout 0.05 --warmup 3 --steps 10 --variants "stock,swapped today,fused LoRA,fused LoRA untimed" --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/lora.py --dry-run --small --autocast bf16 --dropout 0.05 --variants "stock,swapped today,fused LoRA,fused LoRA untimed" --json "$OUT/$STEP.json"'
add lora-compile   170  '$PY benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 --compile inductor --warmup 2 --steps 3 --variants "stock,fused LoRA" --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/lora.py --dry-run --autocast bf16 --dropout 0.05 --compile eager --variants "stock,fused LoRA" --json "$OUT/$STEP.json"'
add check          120  '$PY -m accel_patch.cli check --json > "$OUT/$STEP.json"' \
                        '$PY -m accel_patch.cli check --json --parts launch > "$OUT/$STEP.json"'
add moe-block      180  '$PY benchmarks/moe.py --device cuda --block --variants grouped_mm,ours,ours-triton-bwd,ours-grouped-bwd --json "$OUT/$STEP.json"' \
                        '$PY benchmarks/moe.py --dry-run --block --variants grouped_mm,ours --json "$OUT/$STEP.json"'
add unit-tests     100  "TRITON_INTERPRET=0 $T -m 'not slow' tests --ignore=tests/kernels" \
                        "$T -m 'not slow' --collect-only tests --ignore=tests/kernels"

DEFAULT_STEPS="versions kernel-tests gpu-tests e2e lora flce moe-op e2e-compile bench moe moe-checkpointed qlora trl-post"
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

START=$(date +%s)
# The wheels carried in .whl/ (benchmarks/fetch_wheels.sh): --no-deps, after the image's packages on
# PYTHONPATH, so that the image's torch, numpy and the rest stay the ones imported.
WHEELS=${WHEELS:-.whl}  # tests/test_gpu_check.py points it elsewhere
if [ "$DRY" = 0 ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
        echo "gpu_check: wheels installed from $WHEELS in $(( $(date +%s) - START )) s: $(ls "$WHEELS" | tr '\n' ' ')"
    else
        echo "gpu_check: installing $WHEELS FAILED: the Liger, QLoRA and TRL rows will say what is missing"
    fi
fi
LOG="$OUT/gpu_check.log"
: > "$LOG"
FAILED=()
RAN=()
echo "gpu_check: $([ "$DRY" = 1 ] && echo "DRY RUN on $(hostname), ")steps: $STEPS; budget ${BUDGET_S} s; out $OUT"
for STEP in $STEPS; do
    if [ "$DRY" = 1 ]; then limit=$DRY_LIMIT_S; cmd=${DRYCMD[$STEP]}; else limit=${LIMIT[$STEP]}; cmd=${CMD[$STEP]}; fi
    elapsed=$(( $(date +%s) - START ))
    clipped=""
    if [ "$DRY" = 0 ] && [ $(( elapsed + limit )) -gt "$BUDGET_S" ]; then
        if [ $(( BUDGET_S - elapsed )) -lt "$MIN_STEP_S" ]; then
            echo "== $STEP: rc=125 (not started: ${elapsed} s gone, less than MIN_STEP_S=${MIN_STEP_S} s left of BUDGET_S=${BUDGET_S} s)"
            FAILED+=("$STEP")
            RAN+=("$STEP:125:0")
            continue
        fi
        limit=$(( BUDGET_S - elapsed ))
        clipped=" (cut to ${limit} s by BUDGET_S)"
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
    [ "$rc" = 124 ] && note=" (its limit: ${limit} s$clipped)"
    { echo "===== $STEP (rc=$rc$note): $cmd"; cat "$steplog"; } >> "$LOG"
    took=$(( $(date +%s) - t0 ))
    echo "== $STEP: rc=$rc in $took s$note$clipped"
    tail -n 12 "$steplog"
    rm -f "$steplog"
    RAN+=("$STEP:$rc:$took")
    [ "$rc" = 0 ] || FAILED+=("$STEP")
done

echo "gpu_check: $(( $(date +%s) - START )) s; failed: ${FAILED[*]:-none}"
# The summary table ends the output (the device tool returns its last 12,000 characters): read
# from the steps' JSON before they are packed; also kept in the log.
python3 benchmarks/summary.py --out "$OUT" --steps "${RAN[*]}" 2>&1 | tee -a "$LOG" > "$OUT/.summary"
if [ "$(find "$OUT" -maxdepth 1 -type f ! -name .summary | wc -l)" -gt 8 ]; then  # at most 8 files come back
    (cd "$OUT" && tar czf gpu_check.tar.gz --remove-files -- $(ls | grep -v '^gpu_check.tar.gz$'))
    echo "gpu_check: packed $OUT into gpu_check.tar.gz"
fi
cat "$OUT/.summary"
rm -f "$OUT/.summary"
[ "${#FAILED[@]}" = 0 ]
