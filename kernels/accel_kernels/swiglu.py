"""SwiGLU: silu(gate) * up, the activation of LlamaMLP (`act_fn(gate_proj(x)) * up_proj(x)`).

Kernels, autograd Function and plain-torch path live in `_glu.py`, shared with GeGLU: the two
differ only in the activation. The backward is hand-written and recomputes silu(gate), so only
gate and up are saved (eager also keeps silu(gate)).
"""
from __future__ import annotations

import torch

from ._glu import SILU, gated_unit


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up of the same shape (..., intermediate), dtype and device.

    Differentiable in both arguments. Computes in fp32 and returns the input dtype. Runs the Triton
    kernels on GPU tensors (and on CPU under TRITON_INTERPRET=1), plain torch elsewhere. Raises
    ValueError naming the argument for a shape, dtype or device mismatch or a non-float input.
    """
    return gated_unit(gate, up, SILU)
