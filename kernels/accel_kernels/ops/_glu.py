"""Gated linear units, out = act(gate) * up: the parts SwiGLU and GeGLU share.

The two ops differ only in the activation and its derivative, so one elementwise kernel pair
(forward, backward) serves both, selected by the constexpr ACT, and this file holds the parts of
both op files in the usual order (kernels, host launch, torch.library ops `glu` and
`glu_backward` with the activation as a str, plain-torch twin,
checks, entry `gated_unit`); swiglu.py and geglu.py hold their public entries only. Kernels walk
the flat, contiguous tensors in 1-D blocks, or, where gate and up are the halves of one fused
gate_up projection (evenly strided rows), read them in place row by row (no contiguous copies);
they compute in fp32; outputs are contiguous, in the input dtype.

Memory: the forward saves only gate and up and the backward recomputes act(gate), so an MLP keeps
two activation-sized tensors for backward where eager `act(gate) * up` keeps three.

`limit` > 0 clamps the pre-activations first, in the kernels (DeepSeek V4's and GLM-5-next's
`swiglu_limit`): gate at most `limit`, up within [-limit, limit], their gradients zero where the
clamp bound them (torch.clamp's rule: passed where the input lies within the bounds, inclusive).
The saved gate and up are the unclamped ones; the backward clamps them again. 0: no clamp.

float64 inputs take the plain-torch twin everywhere (the kernels compute in fp32).
"""
from __future__ import annotations

import sys

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

SILU, GELU_ERF, GELU_TANH = 0, 1, 2

BLOCK = 1024
NUM_WARPS = BLOCK // 256  # 8 elements per thread: one 16-byte load of bf16


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


# SiLU and tanh-GELU are both g * sigmoid(z(g)): z = g for SiLU, and since
# 0.5 * (1 + tanh(y)) = sigmoid(2y), z = 2 * sqrt(2/pi) * (g + 0.044715 g^3) for tanh-GELU. Then
# d/dg [g * s] = s + g * s * (1 - s) * dz/dg, with no 1 - tanh^2 cancellation.
@jit
def _act_and_grad(g, ACT: tl.constexpr):
    """act(g) and d act / d g for fp32 g (the forward only uses the first; the compiler drops the rest)."""
    if ACT == 1:  # gelu, erf form: g * Phi(g)
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))  # 1/sqrt(2)
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)  # 1/sqrt(2 pi)
    else:
        if ACT == 0:  # silu
            z = g
            dz = 1.0
        else:  # gelu, tanh approximation
            z = 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 sqrt(2/pi)
            dz = 1.5957691216057308 * (1.0 + 0.134145 * g * g)  # 3 * 0.044715
        s = tl.sigmoid(z)
        a = g * s
        da = s + g * s * (1.0 - s) * dz
    return a, da


@jit
def _glu_forward_math(g, u, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """act(g) * u in fp32 (g, u clamped first under CLAMP)."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a, _ = _act_and_grad(g, ACT)
    return a * u


@jit
def _glu_backward_math(dout, g, u, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """(d gate, d up) in fp32."""
    dg_pass = 1.0
    du_pass = 1.0
    if CLAMP:  # torch.clamp's gradient: passed where the input lies within the bounds
        dg_pass = tl.where(g <= limit, 1.0, 0.0)
        du_pass = tl.where((u >= -limit) & (u <= limit), 1.0, 0.0)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a, da = _act_and_grad(g, ACT)
    return dout * u * da * dg_pass, dout * a * du_pass


@jit
def _glu_forward_kernel(gate_ptr, up_ptr, out_ptr, n, limit, ACT: tl.constexpr, CLAMP: tl.constexpr,
                        BLOCK: tl.constexpr):
    # int64 block start: tensors of 2**31 elements and more are common at LLM scale.
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    g = tl.load(gate_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    out = _glu_forward_math(g, u, limit, ACT, CLAMP)
    tl.store(out_ptr + start + offs, cast_rounded(out, out_ptr.dtype.element_ty), mask=mask)


@jit
def _glu_backward_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, limit,
                         ACT: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    mask = offs < n - start
    dout = tl.load(dout_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
    dg, du = _glu_backward_math(dout, g, u, limit, ACT, CLAMP)
    tl.store(dgate_ptr + start + offs, cast_rounded(dg, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + start + offs, cast_rounded(du, dup_ptr.dtype.element_ty), mask=mask)


# The same over rows whose inputs sit a row stride apart (gate and up as halves of one fused
# gate_up projection, `chunk(2, dim=-1)`): read in place, where the flat kernels would need
# contiguous copies of both. A program covers BLOCK columns of one row; outputs are contiguous.
@jit
def _glu_forward_rows_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_row, up_row, limit,
                             ACT: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gate_ptr + row * gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row + cols, mask=mask, other=0.0).to(tl.float32)
    out = _glu_forward_math(g, u, limit, ACT, CLAMP)
    tl.store(out_ptr + row * n_cols + cols, cast_rounded(out, out_ptr.dtype.element_ty), mask=mask)


@jit
def _glu_backward_rows_kernel(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_cols, dout_row, gate_row, up_row,
                              limit, ACT: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dout = tl.load(dout_ptr + row * dout_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_row + cols, mask=mask, other=0.0).to(tl.float32)
    dg, du = _glu_backward_math(dout, g, u, limit, ACT, CLAMP)
    tl.store(dgate_ptr + row * n_cols + cols, cast_rounded(dg, dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + row * n_cols + cols, cast_rounded(du, dup_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _grid(n: int) -> tuple[int]:
    return (_launch.cdiv(n, BLOCK),)


def _row_views(*ts: torch.Tensor) -> list[torch.Tensor] | None:
    """Each tensor as (rows, columns) in place, where all are evenly strided rows (the halves of a
    fused gate_up projection); None where one has no such view (then copied contiguous)."""
    n_cols = ts[0].shape[-1]
    if n_cols > 1 and any(t.stride(-1) != 1 for t in ts):  # e.g. .sum()'s expanded gradient
        return None
    try:
        return [t.view(-1, n_cols) for t in ts]
    except RuntimeError:  # rows not evenly strided
        return None


def _rows_launch(kernel, views, outs, limit, act):
    rows, n_cols = views[0].shape
    block = min(BLOCK, _launch.next_power_of_2(n_cols))
    if rows and n_cols:
        _launch.launch(kernel, (rows, _launch.cdiv(n_cols, block)), *views, *outs, n_cols,
                       *(v.stride(0) for v in views), float(limit), ACT=act, CLAMP=limit > 0, BLOCK=block,
                       num_warps=max(1, block // 256))


def _forward_triton(gate: torch.Tensor, up: torch.Tensor, act: int, limit: float = 0.0) -> torch.Tensor:
    out = _dispatch.empty_like(gate)
    if not (gate.is_contiguous() and up.is_contiguous()):
        views = _row_views(gate, up)
        if views is not None:
            _rows_launch(_glu_forward_rows_kernel, views, (out,), limit, act)
            return out
        gate, up = gate.contiguous(), up.contiguous()
    n = gate.numel()
    if n:
        _launch.launch(_glu_forward_kernel, _grid(n), gate, up, out, n, float(limit), ACT=act,
                       CLAMP=limit > 0, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out


def _backward_triton(dout, gate, up, act: int, limit: float = 0.0, into_inputs: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup); into_inputs (contiguous dout, gate and up): written over gate and up, which
    the kernel reads element by element before it writes the same element."""
    if into_inputs:
        dgate, dup = gate, up
    else:
        dgate, dup = _dispatch.empty_like(gate), _dispatch.empty_like(up)
    if not (dout.is_contiguous() and gate.is_contiguous() and up.is_contiguous()):
        views = _row_views(dout, gate, up)
        if views is not None:
            _rows_launch(_glu_backward_rows_kernel, views, (dgate, dup), limit, act)
            return dgate, dup
        dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    n = gate.numel()
    if n:
        _launch.launch(_glu_backward_kernel, _grid(n), dout, gate, up, dgate, dup, n, float(limit), ACT=act,
                       CLAMP=limit > 0, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return dgate, dup


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------

# the schema's spelling of the activation (an op argument must be schema-able: a str)
ACTIVATIONS = {"silu": SILU, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH}
_ACTIVATION_NAMES = {value: name for name, value in ACTIVATIONS.items()}
_OP_NAMES = {SILU: "swiglu", GELU_ERF: "geglu", GELU_TANH: "geglu"}


@_library.custom_op("glu")
def _glu_op(gate: torch.Tensor, up: torch.Tensor, activation: str, triton_path: bool,
            limit: float = 0.0) -> torch.Tensor:
    """act(gate) * up for activation "silu" (SwiGLU), "gelu" (erf) or "gelu_tanh" (GeGLU); gate
    and up clamped at `limit` first where it is > 0 (module docstring)."""
    act = ACTIVATIONS[activation]
    return (_forward_triton if triton_path else _forward_torch)(gate, up, act, limit).contiguous()


@_glu_op.register_fake
def _(gate, up, activation, triton_path, limit=0.0):
    return gate.new_empty(gate.shape)


@_library.custom_op("glu_backward")
def _glu_backward_op(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str,
                     triton_path: bool, limit: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    act = ACTIVATIONS[activation]
    dgate, dup = (_backward_triton if triton_path else _backward_torch)(dout, gate, up, act, limit)
    return dgate.contiguous(), dup.contiguous()


@_glu_backward_op.register_fake
def _(dout, gate, up, activation, triton_path, limit=0.0):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _setup_context(ctx, inputs, output):
    gate, up, activation, triton_path, limit = inputs
    ctx.save_for_backward(gate, up)  # the originals: a contiguous copy here would be a third tensor
    ctx.options = (activation, triton_path, limit)


def _backward(ctx, dout):
    activation, triton_path, limit = ctx.options
    _dispatch.check_first_order(_OP_NAMES[ACTIVATIONS[activation]])
    gate, up = ctx.saved_tensors
    if (triton_path and dout.is_contiguous() and _library.direct(ctx) and _dispatch.graph_released()
            and gate.is_contiguous() and up.is_contiguous() and _spent(gate) and _spent(up)):
        # the gradients overwrite gate and up, which nothing can read after this backward (the
        # eager path only: an op's schema cannot declare it); no dispatch guard: a backward runs
        # with grad mode off, so nothing here is recorded
        dgate, dup = _backward_triton(dout, gate, up, ACTIVATIONS[activation], limit, into_inputs=True)
        return dgate, dup, None, None, None
    dgate, dup = _glu_backward_op.backward_call(ctx, dout, gate, up, activation, triton_path, limit)
    return dgate, dup, None, None, None


def _spent(t: torch.Tensor) -> bool:
    """Whether t, just unpacked from the saved tensors in `_backward`, is held by nothing else.

    Its TensorImpl has at most two owners (the saved variable and its Python object; a view, a
    `.detach()` or another node's saved variable would add one, to it or to its storage), it is
    no view, and its Python object's references are `_backward`'s local, this parameter and
    getrefcount's argument, plus the one its TensorImpl keeps while C++ shares it (PyObject
    preservation): a user's reference (a forward hook's list, a variable) adds one. Measured on
    torch 2.11 and 2.13 (tests/kernels/test_swiglu.py).

    Those are the counts where CPython runs a Python call inline. Where it cannot (an
    interpreter-wide frame-evaluation hook is installed: dynamo leaves its own installed for the
    rest of the process once a compile has raised, on torch 2.11 and 2.13), the caller keeps its
    own reference to each argument until the call returns: one more on `t`. That is read here,
    on a fresh object through the same kind of call (`_call_refs`), not assumed; any other reading
    gives fresh gradients."""
    if _storage_owners is None:
        return False
    call = _call_refs(object()) - 2  # 0 where the call ran inline, 1 where the caller kept its reference
    owners = t._use_count()
    return (0 <= call <= 1 and owners <= 2 and t._base is None and sys.getrefcount(t) <= 2 + owners + call
            and _storage_owners(t.untyped_storage()._cdata) <= 2)


def _call_refs(x) -> int:
    """x's references inside a Python call: this parameter and getrefcount's argument (2), and the
    caller's where the call did not run inline (3)."""
    return sys.getrefcount(x)


# private API (torch 2.11 and 2.13 have both); where a torch lacks either, `_spent` says False and
# the gradients get fresh tensors
_storage_owners = (getattr(torch._C, "_storage_Use_Count", None) if hasattr(torch.Tensor, "_use_count")
                   else None)


_glu_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


# The same math as the kernels, in fp32 (float64 stays float64), written with
# in-place steps on fresh temporaries so that it holds few activation-sized buffers at once.
# `g`, `u`, `d` may be the caller's tensors: never modified.
def _sigmoid_of_z(g: torch.Tensor, act: int) -> torch.Tensor:
    if act == SILU:
        return torch.sigmoid(g)
    return torch.square(g).mul_(0.044715).add_(1.0).mul_(g).mul_(1.5957691216057308).sigmoid_()


def _clamped(g: torch.Tensor, u: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    if limit > 0:
        return g.clamp(max=limit), u.clamp(-limit, limit)
    return g, u


def _forward_torch(gate: torch.Tensor, up: torch.Tensor, act: int, limit: float = 0.0) -> torch.Tensor:
    ct = _compute_dtype(gate)
    g, u = _clamped(gate.to(ct), up.to(ct), limit)
    if act == GELU_ERF:
        a = torch.mul(g, 0.7071067811865476).erf_().add_(1.0).mul_(0.5).mul_(g)
    else:
        a = _sigmoid_of_z(g, act).mul_(g)
    return a.mul_(u).to(gate.dtype)


def _backward_torch(dout, gate, up, act: int, limit: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    ct = _compute_dtype(gate)
    g, u, d = gate.to(ct), up.to(ct), dout.to(ct)
    if limit > 0:  # torch.clamp's gradient: passed where the input lies within the bounds
        dg_pass, du_pass = (g <= limit).to(ct), ((u >= -limit) & (u <= limit)).to(ct)
        (dgate, dup) = _backward_torch(dout, gate.clamp(max=limit), up.clamp(-limit, limit), act)
        return (dgate.to(ct) * dg_pass).to(gate.dtype), (dup.to(ct) * du_pass).to(up.dtype)
    if act == GELU_ERF:
        cdf = torch.mul(g, 0.7071067811865476).erf_().add_(1.0).mul_(0.5)
        da = torch.square(g).mul_(-0.5).exp_().mul_(0.3989422804014327).mul_(g).add_(cdf)
        dup = cdf.mul_(g).mul_(d)
    else:
        s = _sigmoid_of_z(g, act)
        if act == SILU:
            da = torch.mul(g, s)  # g s dz, dz = 1
        else:
            da = torch.square(g).mul_(0.134145).add_(1.0).mul_(1.5957691216057308).mul_(s).mul_(g)
        da.addcmul_(da, s, value=-1.0).add_(s)  # s + g s (1 - s) dz
        dup = s.mul_(g).mul_(d)
    return da.mul_(u).mul_(d).to(gate.dtype), dup.to(up.dtype)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(gate, up) -> None:
    """ValueError naming the argument when gate and up cannot go through a gated unit together."""
    for name, t in (("gate", gate), ("up", up)):
        _dispatch.check_tensor(name, t, "of shape (..., intermediate)")
    _dispatch.check_same_device(gate=gate, up=up)
    _dispatch.check_floating("gate", gate)
    if up.dtype != gate.dtype:
        raise ValueError(f"up has dtype {up.dtype} but gate has {gate.dtype}; expected up.dtype == gate.dtype")
    if up.shape != gate.shape:
        raise ValueError(
            f"up has shape {tuple(up.shape)} but gate has shape {tuple(gate.shape)}; "
            f"expected both (..., intermediate) with the same shape"
        )


# --------------------------------------------------------------------------------------------
# Entry (swiglu.py and geglu.py call it with their activation)
# --------------------------------------------------------------------------------------------


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def gated_unit(gate: torch.Tensor, up: torch.Tensor, act: int, limit: float | None = None) -> torch.Tensor:
    """Validate, pick the backend from the tensors, and run act(gate) * up with autograd (gate and
    up clamped at `limit` first, when given)."""
    # the checks in one expression where the inputs are what the kernels take; anything else
    # goes through _check_inputs, which raises the error naming the argument
    if not (type(gate) in _PLAIN and type(up) in _PLAIN and gate.dtype in _FLOATS and up.dtype == gate.dtype
            and up.shape == gate.shape and up.device == gate.device):
        _check_inputs(gate, up)
    if limit is not None and not (isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0):
        raise ValueError(f"limit must be a positive number or None, got {limit!r}")
    triton_path = _dispatch.use_triton(gate) and gate.dtype != torch.float64
    if limit is None:  # the op's schema as before: compiled graphs keep their nodes
        return _glu_op(gate, up, _ACTIVATION_NAMES[act], triton_path)
    return _glu_op(gate, up, _ACTIVATION_NAMES[act], triton_path, float(limit))
