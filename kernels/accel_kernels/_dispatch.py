"""Where an op runs: Triton or the plain-torch reference, chosen per call from the tensors.

Triton runs on GPU tensors, and on CPU tensors when TRITON_INTERPRET=1 was set before triton was
imported (that is how CI exercises the real kernels). Everything else takes the plain-torch path,
so a model with swapped kernels still runs anywhere.
"""
from __future__ import annotations

import os

import torch

_GPU_TYPES = ("cuda", "xpu")


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor `t` should take the Triton path."""
    if t.device.type in _GPU_TYPES:
        return True
    return t.device.type == "cpu" and interpreting()


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the first argument that lives on another device than the first."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                f"all tensors of one call must be on the same device"
            )


# Every op allocates its outputs through these two, so that tests can hand out poisoned, guarded
# buffers and catch an element a kernel fails to write, or a write past an output's end.
def empty(shape, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.empty for kernel outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.empty_like for kernel outputs; always contiguous."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)
