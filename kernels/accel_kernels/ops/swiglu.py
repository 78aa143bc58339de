"""SwiGLU: silu(gate) * up, the activation of LlamaMLP (`act_fn(gate_proj(x)) * up_proj(x)`).

Its kernels, host launch, torch.library ops, plain-torch twin and checks live in `_glu.py`, shared
with GeGLU: the two differ only in the activation. This file is the public entry. The backward is
hand-written and recomputes silu(gate), so only gate and up are saved (eager also keeps silu(gate)).
"""
from __future__ import annotations

import torch

from ._glu import SILU, gated_unit


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up for gate and up of the same shape (..., intermediate), dtype and device;
    with `limit`, silu(gate.clamp(max=limit)) * up.clamp(-limit, limit) (DeepSeek V4's and GLM-5-next's
    `swiglu_limit`), the clamp inside the kernels and its gradient as torch.clamp's.

    Differentiable in both arguments. Computes in fp32 and returns the input dtype. Runs the Triton
    kernels on GPU tensors (and on CPU when the kernels run under Triton's interpreter), its
    plain-torch twin elsewhere. Raises ValueError naming the argument for a non-tensor argument, a
    shape, dtype or device mismatch or a non-float input.
    """
    return gated_unit(gate, up, SILU, limit)
