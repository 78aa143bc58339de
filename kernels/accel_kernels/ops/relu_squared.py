"""ReLU², out = relu(x)²: the activation of Nemotron-H's non-gated MLP (`down(relu2(up(x)))`).

One elementwise kernel pair (forward, backward) over the flat, contiguous tensor in 1-D blocks,
computing in fp32; outputs are in the input dtype, rounded once. The backward is hand-written,
d out / d x = 2 relu(x), from x alone: the op saves x (the up projection's output, which stock
keeps too) and nothing else, and makes one pass each way where eager `square(relu(x))` makes two
forward and three backward (relu, square, their gradients) with relu(x) kept for backward.

float64 inputs take the plain-torch twin everywhere (the kernels compute in fp32).
"""
from __future__ import annotations

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

BLOCK = 1024
NUM_WARPS = BLOCK // 256  # 8 elements per thread: one 16-byte load of bf16


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _relu_squared_forward_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # int64 block start: tensors of 2**31 elements and more are common at LLM scale.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    r = tl.maximum(tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + start + offs, cast_rounded(r * r, out_ptr.dtype.element_ty), mask=mask)


@jit
def _relu_squared_backward_kernel(dout_ptr, x_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    dout = tl.load(dout_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.maximum(tl.load(x_ptr + start + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(dx_ptr + start + offs, cast_rounded(2.0 * r * dout, dx_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _grid(n: int) -> tuple[int]:
    return (_launch.cdiv(n, BLOCK),)


def _forward_triton(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = _dispatch.empty_like(x)
    n = x.numel()
    if n:
        _launch.launch(_relu_squared_forward_kernel, _grid(n), x, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def _backward_triton(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    dout, x = dout.contiguous(), x.contiguous()
    dx = _dispatch.empty_like(x)
    n = x.numel()
    if n:
        _launch.launch(_relu_squared_backward_kernel, _grid(n), dout, x, dx, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dx


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


@_library.custom_op("relu_squared")
def _relu_squared_op(x: torch.Tensor, triton_path: bool) -> torch.Tensor:
    """relu(x)² in x's dtype."""
    return (_forward_triton if triton_path else _forward_torch)(x).contiguous()


@_relu_squared_op.register_fake
def _(x, triton_path):
    return x.new_empty(x.shape)


@_library.custom_op("relu_squared_backward")
def _relu_squared_backward_op(dout: torch.Tensor, x: torch.Tensor, triton_path: bool) -> torch.Tensor:
    return (_backward_triton if triton_path else _backward_torch)(dout, x).contiguous()


@_relu_squared_backward_op.register_fake
def _(dout, x, triton_path):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, triton_path = inputs
    ctx.save_for_backward(x)
    ctx.triton_path = triton_path


def _backward(ctx, dout):
    _dispatch.check_first_order("relu_squared")
    (x,) = ctx.saved_tensors
    return _relu_squared_backward_op.backward_call(ctx, dout, x, ctx.triton_path), None


_relu_squared_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


def _forward_torch(x: torch.Tensor) -> torch.Tensor:
    ct = _compute_dtype(x)
    return torch.relu(x.to(ct)).square_().to(x.dtype)


def _backward_torch(dout: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ct = _compute_dtype(x)
    return torch.relu(x.to(ct)).mul_(2.0).mul_(dout.to(ct)).to(x.dtype)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(x) -> None:
    """ValueError naming the argument when x cannot go through the op."""
    _dispatch.check_tensor("x", x, "of shape (..., intermediate)")
    _dispatch.check_floating("x", x)


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x)² for a floating tensor x of any shape, in x's dtype (computed in fp32).

    Differentiable (d/dx = 2 relu(x), from the saved x). Runs the Triton kernels on GPU tensors (and
    on CPU when the kernels run under Triton's interpreter), its plain-torch twin elsewhere. Raises
    ValueError naming the argument for a non-tensor or non-float input.
    """
    _check_inputs(x)
    triton_path = _dispatch.use_triton(x) and x.dtype != torch.float64
    return _relu_squared_op(x, triton_path)
