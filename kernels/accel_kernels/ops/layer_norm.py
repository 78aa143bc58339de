"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last dim, with a
hand-written backward.

The function is torch's `F.layer_norm(x, (n,), weight, bias, eps)` (torch.nn.LayerNorm; the DSA
indexers' `k_norm` of DeepSeek V3.2, GLM-MoE-DSA, GLM-5-next and Mistral Large 4): the biased
variance, every step in float32 (float64 stays float64 on the twin), one rounding to x's dtype at
the end. weight and bias are each optional (`elementwise_affine=False`, `bias=False`) and have x's
dtype or, for half-precision x, float32 (what torch accepts); the output has x's dtype.

Autocast: on CUDA and XPU, autocast runs layer_norm in float32 (its inputs cast up, a float32
output); on the CPU it does not (measured, torch 2.13: a bfloat16 x under bfloat16 autocast gives a
bfloat16 output). The public function casts as the caller's device does, so the kernels and the
twin compute what the stock module does under autocast.

The Triton kernels: the forward reads a row once per pass (mean, then the centred sum of squares,
then the output; a row within one block is in registers for all three), saves the per-row mean and
1/std in float32. The backward gives dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with
g = dy * weight, and the weight and bias gradients from per-program partial sums over rows, then
one sum (rms_norm's scheme).

The plain-torch twin is `F.layer_norm` itself; its backward recomputes it from the inputs and
differentiates it with autograd (inside the op: `_library.autograd_inside`), the gradients eager
torch gives, bit for bit. float64 inputs skip the op and run `F.layer_norm`, so that second
derivatives through them are exact.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

_DTYPES = _dispatch.KERNEL_DTYPES
#: Devices whose autocast runs layer_norm in float32 (torch's autocast lists: CUDA's and XPU's
#: float32 policy names layer_norm; the CPU's does not).
AUTOCAST_TO_FLOAT32 = ("cuda", "xpu")

# Widest column block: a row up to this many elements is read from memory once per pass; wider
# rows loop over blocks (rms_norm's choice: 8192 fp32 values keep the backward tile in registers).
_MAX_BLOCK_N = 8192
# Elements per program tile: narrow rows (the DSA indexers' 128-wide k_norm) pack several rows a program.
_TILE = 4096
# Registers a thread of the backward may take when its grid is sized (the codegen check fails a
# build over 128 at 16 warps, the budget of 16 warps; `python -m accel_kernels.codegen`)
_BWD_REGISTERS = 128


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _load_row_param(P, cols, col_ok, HAS: tl.constexpr, default: tl.constexpr):
    if HAS:
        p = tl.load(P + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        p = tl.full(cols.shape, default, tl.float32)
    return p


@jit
def _layer_norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    # pass 1: the mean
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(x, axis=1)
    mean = total / n_cols
    # pass 2: the centred sum of squares (not E[x^2] - mean^2, which cancels when |mean| >> std)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean[:, None], 0.0)
        sq += tl.sum(d * d, axis=1)
    rstd = tl.rsqrt(sq / n_cols + eps)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    # pass 3: scale and shift, one rounding to the output's dtype
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = _load_row_param(W, cols, col_ok, HAS_WEIGHT, 1.0)
        b = _load_row_param(B, cols, col_ok, HAS_BIAS, 0.0)
        y = (x - mean[:, None]) * rstd[:, None] * w[None, :] + b[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_rounded(y, Y.dtype.element_ty), mask=mask)


@jit
def _layer_norm_bwd_dot_kernel(
    DY, X, W, MEAN, RSTD, DOT_G, DOT_GX, n_rows, n_cols, stride_dy, stride_x,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per row, sum_j g_j and sum_j g_j * xhat_j (g = dy * weight); only launched when a row spans
    several blocks."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    dot_g = tl.zeros([BLOCK_M], dtype=tl.float32)
    dot_gx = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = _load_row_param(W, cols, col_ok, HAS_WEIGHT, 1.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        dot_g += tl.sum(g, axis=1)
        dot_gx += tl.sum(g * xhat, axis=1)
    tl.store(DOT_G + rows, dot_g, mask=row_ok)
    tl.store(DOT_GX + rows, dot_gx, mask=row_ok)


@jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DOT_G, DOT_GX, DX, DW_PARTIAL, DB_PARTIAL, n_rows, n_cols, stride_dy, stride_x,
    stride_dx, rows_per_program,
    HAS_WEIGHT: tl.constexpr, ONE_BLOCK: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr,
    COMPUTE_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * w;  dw = sum over rows of dy * xhat;
    # db = sum over rows of dy
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w = _load_row_param(W, cols, col_ok, HAS_WEIGHT, 1.0)
        # this program's share of the weight and bias gradients stays in registers over its rows
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            if COMPUTE_DX:
                g = dy * w[None, :]
                if ONE_BLOCK:
                    dot_g = tl.sum(g, axis=1)
                    dot_gx = tl.sum(g * xhat, axis=1)
                else:
                    dot_g = tl.load(DOT_G + rows, mask=row_ok, other=0.0)
                    dot_gx = tl.load(DOT_GX + rows, mask=row_ok, other=0.0)
                dx = rstd[:, None] * (g - (dot_g / n_cols)[:, None] - xhat * (dot_gx / n_cols)[:, None])
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast_rounded(dx, DX.dtype.element_ty),
                         mask=mask)
            if COMPUTE_DW:
                dw += tl.sum(dy * xhat, axis=0)
            if COMPUTE_DB:
                db += tl.sum(dy, axis=0)
        if COMPUTE_DW:
            tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)
        if COMPUTE_DB:
            tl.store(DB_PARTIAL + pid * n_cols + cols, db, mask=col_ok)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _blocks(n_rows: int, n_cols: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for rows of width n_cols."""
    block_n = min(_launch.next_power_of_2(n_cols), _MAX_BLOCK_N)
    block_m = max(1, min(_TILE // block_n, _launch.next_power_of_2(n_rows)))
    return block_m, block_n


def _num_warps(tile: int, per_thread: int) -> int:
    return max(4, min(16, tile // (32 * per_thread)))


def _max_programs(device: torch.device, num_warps: int) -> int:
    """How many programs share the backward's rows: as many as are resident at once on CUDA (per
    SM, as many as fit its 65536 registers at _BWD_REGISTERS a thread), a few elsewhere."""
    if device.type == "cuda":
        per_sm = max(1, 65536 // (32 * num_warps * _BWD_REGISTERS))
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return 4 if device.type == "cpu" else 64


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as (rows, n_cols) with unit column stride; copies only when a view cannot be had."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _forward_triton(x, weight, bias, eps):
    """(y of x's shape in x's dtype, tensors for the backward: x as (rows, n), weight, bias (each
    or None), mean (rows,) and rstd (rows,) float32)."""
    x2 = _rows(x, x.shape[-1])
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    n_rows, n_cols = x2.shape
    y = _dispatch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device)
    mean = _dispatch.empty((n_rows,), dtype=torch.float32, device=x2.device)
    rstd = _dispatch.empty((n_rows,), dtype=torch.float32, device=x2.device)
    block_m, block_n = _blocks(n_rows, n_cols)
    _launch.launch(
        _layer_norm_fwd_kernel, (_launch.cdiv(n_rows, block_m),),
        x2, weight if weight is not None else x2, bias if bias is not None else x2, y, mean, rstd,
        n_rows, n_cols, x2.stride(0), y.stride(0), eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=_num_warps(block_m * block_n, per_thread=16),
    )
    return y.view(x.shape), (x2, weight, bias, mean, rstd)


def _backward_triton(dy, saved, x_shape, eps, need_x, need_w, need_b):
    """(dx of x_shape in x's dtype or None, dw in weight's dtype or None, db in bias's dtype or None)
    from the forward's saved tensors."""
    x2, weight, bias, mean, rstd = saved
    need_w = need_w and weight is not None
    need_b = need_b and bias is not None
    n_rows, n_cols = x2.shape
    dy2 = _rows(dy, n_cols)
    block_m, block_n = _blocks(n_rows, n_cols)
    num_warps = _num_warps(block_m * block_n, per_thread=8)
    one_block = block_n >= n_cols
    row_tiles = _launch.cdiv(n_rows, block_m)
    rows_per_program = _launch.cdiv(row_tiles, min(row_tiles, _max_programs(x2.device, num_warps))) * block_m
    n_programs = _launch.cdiv(n_rows, rows_per_program)
    dx = _dispatch.empty((n_rows, n_cols), dtype=x2.dtype, device=x2.device) if need_x else mean
    dw_partial = _dispatch.empty((n_programs, n_cols), dtype=torch.float32, device=x2.device) if need_w else mean
    db_partial = _dispatch.empty((n_programs, n_cols), dtype=torch.float32, device=x2.device) if need_b else mean
    w_arg = weight if weight is not None else x2
    dot_g = dot_gx = mean
    if need_x and not one_block:
        dot_g = _dispatch.empty((n_rows,), dtype=torch.float32, device=x2.device)
        dot_gx = _dispatch.empty((n_rows,), dtype=torch.float32, device=x2.device)
        _launch.launch(
            _layer_norm_bwd_dot_kernel, (row_tiles,),
            dy2, x2, w_arg, mean, rstd, dot_g, dot_gx, n_rows, n_cols, dy2.stride(0), x2.stride(0),
            HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    _launch.launch(
        _layer_norm_bwd_kernel, (n_programs,),
        dy2, x2, w_arg, mean, rstd, dot_g, dot_gx, dx, dw_partial, db_partial, n_rows, n_cols,
        dy2.stride(0), x2.stride(0), dx.stride(0) if need_x else 0, rows_per_program,
        HAS_WEIGHT=weight is not None, ONE_BLOCK=one_block, COMPUTE_DX=need_x, COMPUTE_DW=need_w,
        COMPUTE_DB=need_b, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    dw = dw_partial.sum(0).to(weight.dtype) if need_w else None
    db = db_partial.sum(0).to(bias.dtype) if need_b else None
    return (dx.view(x_shape) if need_x else None), dw, db


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


def _n_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


@_library.custom_op("layer_norm", used=1)
def _layer_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float,
                   triton_path: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd): mean and rstd (rows,) float32 for the kernels' backward; (0,) on the twin,
    which recomputes."""
    if triton_path:
        y, (_, _, _, mean, rstd) = _forward_triton(x, weight, bias, eps)
        return y, mean, rstd
    with _library.autograd_inside():
        y, _ = _forward_torch(x, weight, bias, eps)
    return y.contiguous(), _library.nothing(x, torch.float32), _library.nothing(x, torch.float32)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, triton_path):
    rows = _n_rows(x) if triton_path else 0
    return (x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32),
            x.new_empty((rows,), dtype=torch.float32))


@_library.custom_op("layer_norm_backward")
def _layer_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                            bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, eps: float,
                            need_x: bool, need_w: bool, need_b: bool, triton_path: bool,
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx of x's shape, dw of weight's shape, db of bias's shape), each (0,) when not needed."""
    need_w = need_w and weight is not None
    need_b = need_b and bias is not None
    if triton_path:
        dx, dw, db = _kernel_grads(dy, x, weight, bias, mean, rstd, eps, need_x, need_w, need_b)
    else:
        dx, dw, db = _backward_torch(dy, (x, weight, bias), x.shape, eps, need_x, need_w, need_b)
    return (dx.contiguous() if need_x else _library.nothing(x),
            dw.contiguous() if need_w else _library.nothing(x if weight is None else weight),
            db.contiguous() if need_b else _library.nothing(x if bias is None else bias))


def _kernel_grads(dy, x, weight, bias, mean, rstd, eps, need_x, need_w, need_b):
    """(dx, dw, db), each None when not asked for, by the kernels from what the forward saved: the
    backward op's Triton path, and the eager formula's (which needs no (0,) stand-ins)."""
    saved = (_rows(x, x.shape[-1]), weight.contiguous() if weight is not None else None,
             bias.contiguous() if bias is not None else None, mean, rstd)
    return _backward_triton(dy, saved, x.shape, eps, need_x, need_w, need_b)


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd, eps, need_x, need_w, need_b, triton_path):
    need_w = need_w and weight is not None
    need_b = need_b and bias is not None
    return (x.new_empty(x.shape) if need_x else _library.nothing(x),
            weight.new_empty(weight.shape) if need_w else _library.nothing(x if weight is None else weight),
            bias.new_empty(bias.shape) if need_b else _library.nothing(x if bias is None else bias))


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, triton_path = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.options = (eps, triton_path)


def _backward(ctx, dy, _dmean=None, _drstd=None):
    _dispatch.check_first_order("layer_norm")  # the op's backward is opaque to autograd
    x, weight, bias, mean, rstd = ctx.saved_tensors
    eps, triton_path = ctx.options
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if triton_path and _library.direct(ctx):
        # the kernels straight from the formula: what the backward op's implementation does on its
        # Triton path, less its schema's (0,) stand-ins for the gradients not asked for (a frozen
        # weight's and bias's, as in LoRA training; no dispatch guard: a backward runs with grad mode
        # off, so nothing here is recorded)
        dx, dw, db = _kernel_grads(dy, x, weight, bias, mean, rstd, eps, need_x, need_w, need_b)
    else:
        dx, dw, db = _layer_norm_backward_op.backward_call(
            ctx, dy, x, weight, bias, mean, rstd, eps, need_x, need_w, need_b, triton_path)
    return (dx if need_x else None), (dw if need_w else None), (db if need_b else None), None, None


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


def _reference(x, weight, bias, eps):
    """torch.nn.LayerNorm's function over the last dim."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def _forward_torch(x, weight, bias, eps):
    """`_forward_triton` in plain torch: F.layer_norm; saves the inputs themselves."""
    return _reference(x, weight, bias, eps), (x, weight, bias)


def _backward_torch(dy, saved, x_shape, eps, need_x, need_w, need_b):
    """`_backward_triton` in plain torch: autograd's gradients of F.layer_norm, bit for bit
    (recomputed here, so that the forward keeps no intermediate)."""
    x, weight, bias = saved
    needs = (need_x, need_w and weight is not None, need_b and bias is not None)
    if not any(needs):
        return None, None, None
    with _library.autograd_inside():  # this runs inside the op's implementation
        x, weight, bias = (t.detach().requires_grad_(need) if t is not None else None
                           for t, need in zip((x, weight, bias), needs))
        with torch.enable_grad():
            y = _reference(x, weight, bias, eps)
        wanted = [t for t, need in zip((x, weight, bias), needs) if need]
        grads = iter(torch.autograd.grad(y, wanted, dy))
    return tuple(next(grads) if need else None for need in needs)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(x, weight, bias, eps) -> None:
    _dispatch.check_tensor("x", x, "of shape (..., n)")
    _dispatch.check_floating("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the normalized last dim), got a 0-dim tensor")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        _dispatch.check_tensor(name, p, "of shape (n,) or None")
        _dispatch.check_floating(name, p)
        if tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{name} must have shape ({x.shape[-1]},) (x.shape[-1]), got {tuple(p.shape)}")
        # torch.nn.functional.layer_norm's rule: parameters in x's dtype, or float32 for half x
        if p.dtype != x.dtype and not (p.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)):
            raise ValueError(f"{name} must have x's dtype ({x.dtype}) or, for half-precision x, float32; "
                             f"got {p.dtype}")
        _dispatch.check_same_device(x=x, **{name: p})
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise ValueError(f"weight and bias must have one dtype, got {weight.dtype} and {bias.dtype}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of x over its last dim: (x - mean) / sqrt(var + eps) * weight + bias, the biased
    variance; `torch.nn.functional.layer_norm(x, (n,), weight, bias, eps)`.

    x: (..., n) floating point, any leading dims, any strides; weight, bias: (n,) or None, in x's
    dtype or (for bfloat16 / float16 x) float32, on x's device. The output has x's dtype (under
    autocast on CUDA and XPU, float32, as torch's layer_norm there). Differentiable in x, weight
    and bias (each may have requires_grad=False). Inputs are never written. Raises ValueError
    naming a bad argument. float32/bfloat16/float16 run the Triton kernels (on GPU, or on CPU when
    the kernels run under Triton's interpreter); float64 and everything else run the plain-torch
    twin, whose gradients are autograd's of F.layer_norm.
    """
    _check_inputs(x, weight, bias, eps)
    if x.device.type in AUTOCAST_TO_FLOAT32 and torch.is_autocast_enabled(x.device.type):
        # autocast's float32 policy for layer_norm there: inputs cast up, a float32 output
        x, weight, bias = (t.float() if t is not None and t.dtype != torch.float64 else t for t in (x, weight, bias))
    dtypes = {t.dtype for t in (x, weight, bias) if t is not None}
    if torch.float64 in dtypes:
        # F.layer_norm in differentiable torch, outside the op: second derivatives stay exact
        return _reference(x, weight, bias, float(eps))
    # empty inputs take the twin; the kernels accumulate in float32
    triton_path = _dispatch.use_triton(x) and x.numel() > 0 and dtypes <= set(_DTYPES)
    return _layer_norm_op(x, weight, bias, float(eps), triton_path)[0]
