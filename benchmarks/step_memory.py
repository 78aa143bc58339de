"""A training step's peak memory growth on a GPU, modelled on the CPU: the e2e step at 1/32 scale.

    python benchmarks/step_memory.py            # stock and accel-patch's variants, MiB at full scale
    python benchmarks/step_memory.py --json PATH

The GPU end-to-end benchmark's step (`benchmarks/e2e.py`: Llama-3.2-1B's shape, bf16, 4 x 2048
tokens, a full fine-tune step, peak growth = max_memory_allocated during the step less what was
allocated before it) with hidden, intermediate, vocabulary, heads x head_dim and sequence each
divided by 32 (16 layers kept), so every activation, weight and logits tensor is 1/1024 of its
full-scale size, and the byte budgets (the fused loss's `CHUNK_BYTES`, `WEIGHT_FP32_BYTES`,
`TILE_BYTES`, the norms' `RECOMPUTE_MIN_BYTES`) with them: the same chunks, blocks and choices at
1/1024 of the bytes. The GPU
path's host code runs with every Triton launch stubbed out (`overhead.launches_stubbed`): the
allocations, views, saved tensors and frees of the GPU path, no kernel math (the values are
garbage; the bytes are not). The CPU-only fp32 gradient matmuls of the fused loss are switched off
(`fp32_gradient_matmuls`), as on a GPU. The step's live bytes are the storages its ops make,
each from the op that made it until it is freed (`peak_growth`), and the peak of their sum x 1024
is the full-scale figure.

What it leaves out: the CUDA caching allocator's rounding (512-byte blocks; nothing at these
sizes), cuBLAS workspaces and the kernels' own scratch (none in ours). Checked against the H200's
measured stock step (docs/benchmarks.md): the model gives 25,883 MiB where the GPU measured
25,738 (2026-12-04, BENCHMARKS.md).

Variants of the full fine-tune: stock; accel-patch as it ships; accel-patch with the fused loss's weight gradient summed
in bf16 over the forward's chunks (`WEIGHT_DTYPE_SUM_CHUNKS` = 8: one logits matmul fewer);
accel-patch with the GLU's gradients in fresh tensors (the backward before it wrote them over
gate and up); accel-patch with the norms' outputs saved by the projections as autograd saves them
(before they were kept as the norm calls and recomputed in backward). Then the e2e LoRA step
(PEFT r=16 on every linear layer, no dropout; `LORA_RANK` says how the rank scales): stock PEFT,
accel-patch, and accel-patch with the norms' outputs saved as autograd saves them. Checked against
the H200's measured stock PEFT step: 32,010 MiB modelled, 31,810 measured.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import sys

SCALE = 32


def model_and_batch():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # benchmarks/e2e.py's "cuda" shape, / SCALE
    config = LlamaConfig(vocab_size=128256 // SCALE, hidden_size=2048 // SCALE, intermediate_size=8192 // SCALE,
                         num_hidden_layers=16, num_attention_heads=32 // 4, num_key_value_heads=8 // 4,
                         head_dim=64 // 8, max_position_embeddings=8192, tie_word_embeddings=True,
                         rope_theta=500000.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (4, 2048 // SCALE), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def variant_settings(name: str):
    """The module settings of one variant (the fused loss's budgets / SCALE**2 in all of them)."""
    from accel_kernels.ops import _glu
    from accel_kernels.ops import fused_linear_cross_entropy as flce
    from accel_kernels.ops import rms_norm

    saved = (flce.CHUNK_BYTES, flce.WEIGHT_FP32_BYTES, flce.TILE_BYTES, flce.WEIGHT_DTYPE_SUM_CHUNKS,
             flce.fp32_gradient_matmuls, _glu._spent, rms_norm.RECOMPUTE_OUTPUTS, rms_norm.RECOMPUTE_MIN_BYTES)
    flce.CHUNK_BYTES //= SCALE ** 2
    flce.WEIGHT_FP32_BYTES //= SCALE ** 2
    flce.TILE_BYTES //= SCALE ** 2
    rms_norm.RECOMPUTE_MIN_BYTES //= SCALE ** 2
    flce.fp32_gradient_matmuls = lambda h: False
    if name == "accel-patch, weight gradient summed in bf16":
        flce.WEIGHT_DTYPE_SUM_CHUNKS = 8
    if name == "accel-patch, GLU gradients in fresh tensors":
        _glu._spent = lambda t: False
    if name == "accel-patch, norm outputs kept":
        rms_norm.RECOMPUTE_OUTPUTS = False
    try:
        yield
    finally:
        (flce.CHUNK_BYTES, flce.WEIGHT_FP32_BYTES, flce.TILE_BYTES, flce.WEIGHT_DTYPE_SUM_CHUNKS,
         flce.fp32_gradient_matmuls, _glu._spent, rms_norm.RECOMPUTE_OUTPUTS, rms_norm.RECOMPUTE_MIN_BYTES) = saved


def peak_growth(model, batch) -> tuple[int, str]:
    """(bytes, the op that reached it) of one training step after a warm-up step: the peak of the
    bytes held at once by the storages the step makes (`accel_kernels.bench.memory.LiveBytes`:
    op outputs, never an op's own scratch). Under a dispatch mode accel_kernels' public
    functions take the custom-op path; here they keep the eager path users run
    (`_library._dispatch_modes` is patched to see no mode), whose backward may write the GLU's
    gradients over its inputs."""
    from accel_kernels import _library
    from accel_kernels.bench.memory import LiveBytes

    def step():
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    step()
    saved = _library._dispatch_modes
    _library._dispatch_modes = lambda: 0
    try:
        with LiveBytes([*model.parameters(), *model.buffers(), *batch.values()]) as live:
            model(**batch).loss.backward()
    finally:
        _library._dispatch_modes = saved
    model.zero_grad(set_to_none=True)
    return live.peak, live.at


VARIANTS = ("stock", "accel-patch", "accel-patch, weight gradient summed in bf16",
            "accel-patch, GLU gradients in fresh tensors", "accel-patch, norm outputs kept")
#: The e2e LoRA step's variants (r=16 all-linear, lora_alpha 32, no dropout, as benchmarks/e2e.py)
LORA_VARIANTS = ("stock + LoRA", "accel-patch + LoRA", "accel-patch + LoRA, norm outputs kept")
#: LoRA's rank at this scale: 16 / 32 is no rank, so 1. The r-wide tensors (tokens x r, a few MiB
#: in all at full scale) read twice their full-scale share; everything else scales as above.
LORA_RANK = 1


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    import torch

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                                            target_modules="all-linear"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels never run: the launches are stubbed
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    import transformers

    import accel_patch
    from overhead import launches_stubbed

    torch.set_num_threads(1)
    base, batch = model_and_batch()
    swapped = copy.deepcopy(base)
    print(accel_patch.swap_kernels(swapped).summary())  # the probes run the CPU path's real math
    swapped.train()
    base.train()
    print(f"accel-patch step memory model, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print("Llama-3.2-1B step (bf16, 4 x 2048 tokens, full fine-tune) at 1/32 of every dimension; "
          "peak growth x 1024, MiB")
    rows = []
    models = {"stock": base, "accel-patch": swapped}
    for name in VARIANTS + LORA_VARIANTS:
        if name == "stock + LoRA":
            print(f"the e2e LoRA step: r=16 all-linear, no dropout (rank {LORA_RANK} at this scale)")
            models = {"stock": with_lora(copy.deepcopy(base)).train(), "accel-patch": with_lora(swapped).train()}
        stock = name.startswith("stock")
        model = models["stock" if stock else "accel-patch"]
        setting = name.replace(" + LoRA", "")
        with variant_settings(setting), (contextlib.nullcontext() if stock else launches_stubbed()):
            peak, where = peak_growth(model, batch)
        rows.append(dict(variant=name, peak_growth_mib=round(peak * SCALE ** 2 / 2 ** 20), at=where))
        print(f"  {name:45s} {rows[-1]['peak_growth_mib']:7,d}   at {where}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(scale=SCALE, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
