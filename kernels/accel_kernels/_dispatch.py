"""Where an op runs (Triton or its plain-torch twin, chosen per call from the tensors), the input
checks every op shares, and the allocator of kernel outputs.

Triton runs on GPU tensors, and on CPU tensors when the kernels were defined for Triton's CPU
interpreter (TRITON_INTERPRET=1 when accel_kernels was imported: that is how CI exercises the real
kernels). Everything else, and everything when triton cannot be imported, takes the plain-torch
twin, so a model with swapped kernels still runs anywhere.
"""
from __future__ import annotations

import contextlib

import torch

from . import _triton

def interpreting() -> bool:
    """True when the kernels run under Triton's CPU interpreter.

    Fixed for the life of the process: it is what TRITON_INTERPRET said when the kernels were
    defined (accel_kernels' import), which is what triton itself obeys. Setting or clearing the
    variable later changes nothing, here or in triton. False when triton cannot be imported.
    """
    return _triton.INTERPRETING


#: The floating dtypes the kernels take (they compute in float32; float64 runs the plain-torch twins).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor `t` takes the Triton path (else its plain-torch twin)."""
    # a CUDA tensor by its flag first: building `t.device` costs more than the rest of this
    # function, which runs once a call of every op (dynamo traces `is_cuda` too)
    if t.is_cuda:
        return _triton.AVAILABLE
    kind = t.device.type
    if kind == "xpu":
        return _triton.AVAILABLE
    return kind == "cpu" and _triton.AVAILABLE and _triton.INTERPRETING


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_tensor(name: str, value, expected: str) -> None:
    """ValueError "<name> must be a torch.Tensor <expected>, got <type>" unless value is a tensor.

    `expected` says what a valid argument looks like, e.g. "of shape (..., n)".
    """
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {expected}, got {_type_name(value)}")


def check_floating(name: str, t: torch.Tensor) -> None:
    """ValueError naming the argument when tensor t is not floating point."""
    if not t.is_floating_point():
        raise ValueError(
            f"{name} must be a floating-point tensor, got {t.dtype}; expected float32, bfloat16 or "
            f"float16 (float64 runs the plain-torch twin)"
        )


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


_KERNELS_WAY_OUT = ("call backward without create_graph (rms_norm and rope on float64 inputs, which run "
                    "their plain-torch twins, do support it)")


def check_first_order(op: str, way_out: str = _KERNELS_WAY_OUT) -> None:
    """Call first thing in a backward that is not itself differentiable (the kernels' backwards,
    and any caller's whose backward uses tensors its forward made with autograd off).

    Under backward(create_graph=True) autograd would record such a backward's outputs as constants,
    and a second derivative through the op would silently lose its part: raise instead, naming
    `way_out`.
    """
    if torch.is_grad_enabled():  # autograd runs backwards with grad mode on only for create_graph
        raise RuntimeError(f"{op} gives first-order gradients only, but its backward ran under "
                           f"create_graph=True; {way_out}")


@torch.compiler.assume_constant_result
def _autocast_available(device_type: str) -> bool:
    """Asked at trace time and kept as a constant of the graph: dynamo in torch 2.11 cannot trace
    `torch._C._is_autocast_available` (a graph break)."""
    return torch.amp.is_autocast_available(device_type)


def autocast_state(device_type: str) -> tuple | None:
    """The autocast setting in force for device_type (None where autocast does not exist): a
    twin that recomputes its forward in backward replays it with `autocast_as`, so that the
    recomputation matches the forward (backward usually runs outside the autocast block)."""
    if not _autocast_available(device_type):
        return None
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def autocast_as(state: tuple | None):
    """Context manager: the autocast setting `autocast_state` recorded (nothing for None)."""
    if state is None:
        return contextlib.nullcontext()
    device_type, enabled, dtype = state
    return torch.autocast(device_type, dtype=dtype, enabled=enabled)


# Every op allocates its outputs through these two, so that tests can hand out poisoned, guarded
# buffers and catch an element a kernel fails to write, or a write past an output's end.
def empty(shape, *, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.empty for kernel outputs."""
    return torch.empty(shape, dtype=dtype, device=device)


def empty_like(t: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.empty_like for kernel outputs; always contiguous."""
    return torch.empty_like(t, dtype=dtype, memory_format=torch.contiguous_format)


# private autograd API (torch 2.11 and 2.13 have it); where a torch lacks it, graph_released says
# False and what depends on it takes the path that holds for a retained graph
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_released() -> bool:
    """Inside a backward: whether the graph is freed behind it (no retain_graph, no create_graph),
    so a saved tensor is read by no later backward. False where torch cannot say."""
    return _keep_graph is not None and not _keep_graph()
