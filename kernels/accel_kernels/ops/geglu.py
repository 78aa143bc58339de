"""GeGLU: gelu(gate, approximate) * up, for approximate "none" (erf) and "tanh".

Its kernels, host launch, torch.library ops, plain-torch twin and checks live in `_glu.py`, shared
with SwiGLU: the two differ only in the activation. This file is the public entry and the check of
its one option. The backward is hand-written and recomputes gelu(gate), so only gate and up are
saved (eager also keeps gelu(gate)).
"""
from __future__ import annotations

import torch

from ._glu import GELU_ERF, GELU_TANH, gated_unit

_APPROXIMATIONS = {"none": GELU_ERF, "tanh": GELU_TANH}


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate, approximate) * up, as `torch.nn.functional.gelu(gate, approximate=...) * up`.

    gate and up share shape (..., intermediate), dtype and device; approximate is "none" (erf)
    or "tanh". Differentiable in both tensors; computes in fp32 and returns the input dtype.
    Runs the Triton kernels on GPU tensors (and on CPU when the kernels run under Triton's
    interpreter), its plain-torch twin elsewhere. Raises ValueError naming the argument for bad
    input.
    """
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return gated_unit(gate, up, _APPROXIMATIONS[approximate])
