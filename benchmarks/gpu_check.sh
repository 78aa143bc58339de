#!/usr/bin/env bash
# The prepared calls on a lent GPU machine (its image has torch, triton, transformers, accelerate,
# peft and wrapt, no bitsandbytes, and no network). Logs and JSON figures go to $OUT (or ./out).
# Each step has its own time limit so one hang cannot eat the lease. A lease gives 10 minutes a
# call and 15 in all, the machine's start included: the four calls below do not all fit in one
# lease; run the first and one other (the next lease takes the rest), the figures first.
#
#   STEPS="versions e2e bench" bash benchmarks/gpu_check.sh            # ~7 min: the GPU figures
#   STEPS="versions lora" bash benchmarks/gpu_check.sh                  # ~4 min: fused LoRA figures
#   STEPS="versions lora-compile" bash benchmarks/gpu_check.sh          # ~7 min: fused LoRA compiled (Inductor)
#   STEPS="kernel-tests check unit-tests demo" bash benchmarks/gpu_check.sh   # ~5 min: correctness
#   STEPS="versions compile" bash benchmarks/gpu_check.sh              # ~6 min: eager vs torch.compile
#   STEPS="versions rank-sync" bash benchmarks/gpu_check.sh            # ~1 min: the rank-sync checksum
#   STEPS="versions long tiled-tests" bash benchmarks/gpu_check.sh     # ~6 min: long sequences, offloading
#   STEPS="versions longest" bash benchmarks/gpu_check.sh              # ~7 min: longest trainable sequence
#
# e2e: one training step of stock vs swapped at a Llama-3.2-1B shape, bf16, full and LoRA r=16
# (benchmarks/e2e.py); bench: python -m accel_kernels.bench --quick; check: accel-patch check;
# compile: the e2e shape eager and compiled (Inductor), stock and swapped, full fine-tune, 2 warm-up
# steps (they pay for the compilation) and 5 timed ones; then the swapped model's compiled training
# forward must show no graph break (torch._dynamo.explain).
# lora: one LoRA r=16 step at the Llama-3.2-1B shape as adapter users train it (bf16 weights under
# bf16 autocast, as Trainer(bf16=True); LoRA dropout 0.05), stock PEFT (SDPA) vs swapped today vs
# fused LoRA (benchmarks/lora.py): tokens/s and peak memory, targets >= 1.5x and <= 0.6x of stock;
# then the same with a 4-bit (nf4) base where bitsandbytes is installed (not in this image: skipped,
# said so). lora-compile: the same three variants torch.compile'd with Inductor (2 warm-up steps
# pay for the compilation, 3 timed).
# rank-sync: the rank-sync guard's checksum of a Llama-3.2-1B parameter set (1.24e9 bf16 elements)
# and of its LoRA r=16 adapters on the GPU (benchmarks/rank_sync.py; one GPU: no 2-rank run). It
# fits beside "versions lora" in one lease.
# long: one step with gradient checkpointing at 8k/16k/32k tokens, Llama-3.2-1B shape, bf16, stock vs
# swapped without the tiled MLP vs swapped (benchmarks/long_context.py); longest: the longest sequence
# (16k x 2^k up to 128k) each of stock and swapped trains in 24 GiB, full fine-tune (and QLoRA where
# bitsandbytes is), with and without transformers' checkpoint offloading; tiled-tests: the tiled MLP
# under TRL's activation offloading on the GPU (tests/swaps/layers/test_tiled_mlp.py -m gpu).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=${STEPS:-"versions e2e bench kernel-tests check unit-tests demo"}  # compile: on its own call
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
step e2e && run e2e 200 python3 benchmarks/e2e.py --device cuda --json "$OUT/e2e.json"
if step lora; then
    run lora 240 python3 benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 --steps 5 \
        --json "$OUT/lora.json"
    if python3 -c "import bitsandbytes" >/dev/null 2>&1; then
        run qlora 240 python3 benchmarks/lora.py --device cuda --qlora --autocast bf16 --dropout 0.05 --steps 5 \
            --json "$OUT/qlora.json"
    else
        echo "== qlora: skipped (bitsandbytes is not installed in this image: no 4-bit base to fuse)"
    fi
fi
step lora-compile && run lora-compile 420 python3 benchmarks/lora.py --device cuda --autocast bf16 --dropout 0.05 \
    --compile inductor --warmup 2 --steps 3 --json "$OUT/lora_compile.json"
step rank-sync && run rank-sync 120 python3 benchmarks/rank_sync.py --device cuda --repeats 5 \
    --json "$OUT/rank_sync.json"
step long && run long 300 python3 benchmarks/long_context.py --device cuda --no-longest --steps 3 \
    --json "$OUT/long.json"
step longest && run longest 420 python3 benchmarks/long_context.py --device cuda --only-longest \
    --json "$OUT/longest.json"
step tiled-tests && run tiled-tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/swaps/layers/test_tiled_mlp.py
step kernel-tests && run kernel-tests 150 env TRITON_INTERPRET=0 ACCEL_TEST_DEVICE=cuda \
    python3 -m pytest -q -p no:cacheprovider -x tests/kernels
step bench && run bench 240 python3 -m accel_kernels.bench --quick --json "$OUT/bench.json"
step check && run check 120 python3 -m accel_patch.cli check --json
step unit-tests && run unit-tests 100 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests --ignore=tests/kernels
step demo && run demo 45 python3 -m accel_patch.demo --steps 40
step compile && run compile 420 python3 benchmarks/e2e.py --device cuda --compile --warmup 2 --steps 5 \
    --json "$OUT/e2e_compile.json"
step compile && run compile-breaks 120 python3 - <<'PY'
import torch, torch._dynamo
from transformers import LlamaConfig, LlamaForCausalLM
import accel_patch
config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=8, attn_implementation="sdpa")
model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
print(accel_patch.swap_kernels(model).summary())
ids = torch.randint(0, 32000, (2, 256), device="cuda")
explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
ops = sorted({str(n.target) for g in explained.graphs for n in g.graph.nodes if str(n.target).startswith("accel_kernels.")})
print("graph breaks", explained.graph_break_count, "accel_kernels nodes", ops)
assert explained.graph_break_count == 0 and "accel_kernels.fused_linear_cross_entropy" in ops
PY
exit 0
