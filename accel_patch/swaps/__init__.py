"""Swapping accel_kernels into model instances: per instance, verified by a probe, reversible.

    report = accel_patch.swap_kernels(model)          # or ops=["rms_norm", "rope"]
    print(report)                                     # what was swapped, what was refused and why
    accel_patch.restore_kernels(model)                # the model exactly as it was

Layout: the walk and the shared machinery at the top: apply.py (the walk over a model), probe.py
(the numeric probe and its cache), sites.py (instance forwards, the undo log, the swap state),
report.py, families.py (what the swap knows, as data), ops.py (which ops a call or
ACCEL_PATCH_KERNELS asks for). Below it, one room per kind of site, each saying in its
`__init__` what lives there: layers/ (norms, the gated MLP, RoPE, the tiled MLP), loss/ (the LM
head and its loss, the deferred logits, TRL's token log-probs), lora/ (fused PEFT LoRA), experts/
(MoE experts).

Importing this package imports neither torch nor transformers; a swap does. swaps/ imports
accel_kernels and at most the core of accel_patch, never patches/, integrations/ or cli/.
"""
from __future__ import annotations

from .families import OPS
from .report import Refusal, SwapReport

__all__ = ["OPS", "Refusal", "SwapReport", "restore_kernels", "swap_kernels"]


def swap_kernels(model, ops=None) -> SwapReport:
    """Swap accel_kernels into `model` (in place) wherever they compute the same function.

    `model`: a transformers `PreTrainedModel`, a PEFT `PeftModel` (before or after
    `get_peft_model`), a bitsandbytes 4/8-bit model, or any of them wrapped in DDP.
    `ops`: None for all, or names among "rms_norm", "layer_norm", "rope", "glu", "fused_linear_cross_entropy",
    "lora_mlp", "lora_qkv", "lora_o", "tiled_mlp", "experts" (a list or a comma-separated string;
    "swiglu"/"geglu" mean "glu", "lora" the three LoRA sites, which fuse PEFT LoRA layers decided
    per call: lora/; "tiled_mlp" runs a long call of a gated MLP chunk by chunk: layers/tiled_mlp.py;
    "experts" runs MoE experts as one grouped-GEMM op, PEFT's LoRA on them included: experts/).

    Each candidate site (found by structure) is swapped only after a numeric probe shows the kernel
    reproduces the module's own output; everything else stays stock and is listed in the report's
    `refused` with the reason. Only this instance changes: other models, classes and transformers'
    functions compute exactly as before. Idempotent: a second call swaps nothing twice. Returns a
    `SwapReport`. Raises ValueError for an unknown op name and TypeError for a non-module.
    """
    from .apply import swap

    return swap(model, ops)


def restore_kernels(model) -> bool:
    """Put `model` back exactly as it was before `swap_kernels`: the same forward objects and
    attributes, bit-identical outputs; a shared RoPE interception is removed with its last model.
    Returns whether the model had been swapped."""
    from .apply import restore

    return restore(model)
