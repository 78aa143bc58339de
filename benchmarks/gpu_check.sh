#!/usr/bin/env bash
# One prepared call on a lent GPU machine (its image has torch, triton, transformers, accelerate,
# peft and wrapt, no bitsandbytes, and no network): versions, the kernel tests on CUDA, the quick
# kernel benchmark, the unit tests, then the demo on one GPU. Logs and the benchmark JSON go to
# $OUT (or ./out). Each step has its own time limit so one hang cannot eat the lease.
#
#   bash benchmarks/gpu_check.sh            # everything
#   STEPS="bench" bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=${STEPS:-"versions kernel-tests bench unit-tests demo"}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
# Import the checkout without installing it: accel_patch from the root, accel_kernels from kernels/.
export PYTHONPATH="$PWD:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH}"
# Liger Kernel, when carried as a wheel in .whl/, is installed beside for the comparison columns.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
run() {  # run NAME LIMIT_S CMD...: log to $OUT/NAME.log, print the tail
    local name=$1 limit=$2; shift 2
    local start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - start )) s"
    tail -n 25 "$OUT/$name.log"
}

if step versions; then
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, torch, triton, transformers, accelerate, peft, wrapt; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__, 'wrapt', wrapt.__version__)"
fi
step kernel-tests && run kernel-tests 150 env TRITON_INTERPRET=0 ACCEL_TEST_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider -x tests/kernels
step bench && run bench 240 python3 -m accel_kernels.bench --quick --json "$OUT/bench.json"
step unit-tests && run unit-tests 75 python3 -m pytest -q -p no:cacheprovider tests --ignore=tests/kernels
step demo && run demo 45 python3 -m accel_patch.demo --steps 40
exit 0
