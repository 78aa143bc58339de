"""RMSNorm: y = x / rms(x) * (offset + weight) over the last dim, with a hand-written backward.

Casting modes say in which dtype each step happens, so that the kernel reproduces the module it
replaces:

- "llama": transformers' LlamaRMSNorm. The normalization runs in float32, its result is cast back
  to x's dtype, and `(offset + weight) * that` is computed in the promotion of weight's and x's
  dtypes (which is also the output dtype).
- "gemma": transformers' GemmaRMSNorm (use offset=1.0). Everything in float32,
  `norm(x.float()) * (offset + weight.float())`, cast to x's dtype at the end.
- "none": every step in x's dtype (the weight is cast to x's dtype); the output has x's dtype.

The Triton kernels accumulate in float32 in every mode and round where the stock module rounds.
Forward saves x and the per-row 1/rms in float32; backward gives the gradient of x and of the
weight (the weight gradient from per-program partial sums over rows, then one sum).

The plain-torch twin is the module's own formula (`_reference`). Its forward keeps only the
inputs; its backward recomputes the formula from them and differentiates it with autograd (inside
the op, with autograd switched back on: `_library.autograd_inside`): the gradients eager torch
gives, bit for bit, without the formula's fp32 intermediates held from forward to backward (one
more forward of time, as with activation checkpointing). float64 inputs skip the op and run the
formula itself, so that second derivatives through them are exact.

Two more forms (constexprs of the same kernels): weight=None, the weightless norm (Gemma 4's value
norm, Llama 4's q/k L2 norm): no scale and no weight gradient; and the gated form of
linear-attention layers, `norm(x) * act(gate)` with silu or sigmoid: the gate multiplies, in
float32, the ungated product as the module leaves it before its final cast (ROUND_PRODUCT: rounded
to x's dtype where the module's product is in x's dtype), the output is in x's dtype, and the
backward gives the gate's gradient and feeds dy * act(gate) to the RMSNorm backward.

The backward's grid has as many programs as are resident at once (`_max_programs`); its register
use is checked by `python -m accel_kernels.codegen`.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, constexpr, jit, tl

CASTINGS = ("llama", "gemma", "none")
LLAMA = constexpr(0)
GEMMA = constexpr(1)
NONE = constexpr(2)
_CASTING_IDS = {"llama": 0, "gemma": 1, "none": 2}
#: Gates of the gated form: "" (no gate), "silu" and "sigmoid": rms_norm(x) * act(gate);
#: "pre_silu": rms_norm(x * silu(gate)), the gate applied before normalizing (Mamba2's form).
ACTIVATIONS = ("", "silu", "sigmoid", "pre_silu")
SILU = constexpr(1)
SIGMOID = constexpr(2)
PRE_SILU = constexpr(3)
_GATE_IDS = {"": 0, "silu": 1, "sigmoid": 2, "pre_silu": 3}
_DTYPES = _dispatch.KERNEL_DTYPES
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Widest column block: a row up to this many elements is read from memory once per pass; wider
# rows loop over blocks. 8192 fp32 values per tensor keep the backward tile in registers.
_MAX_BLOCK_N = 8192
# Widest column block of the gated backward, which holds the gate and its activation beside x, dy
# and w: at 8192 it spilled 76 B a thread on sm_90 (Granite 4 hybrid's 8192-wide Mamba norm,
# `python -m accel_kernels.codegen`); wider gated rows take the separate dot pass
_MAX_GATED_BWD_BLOCK_N = 4096
# Elements per program tile: narrow rows (e.g. per-head QK norms) pack several rows per program.
_TILE = 4096
# Elements of the ungated backward's tile where a row is one block of up to 4096 columns: two such
# rows an iteration. Its grid is one 16-warp program a SM, walking its rows one iteration at a
# time, and one 4096-wide row (16 KB of x and dy in bf16) is half of what a SM must keep in flight
# to draw its share of the memory bandwidth; two rows compile to 90 registers, no spill, on sm_90
# (`python -m accel_kernels.codegen`). Unmeasured on a GPU.
_BWD_TWO_ROWS = 8192
# Registers a thread of the backward kernel may take when its grid is sized (measured at 16 warps:
# up to 109, the gated form up to 127; the codegen check fails a build over 128 there, the budget
# of 16 warps)
_BWD_REGISTERS = 128


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype's precision, kept in fp32: a step the stock module does in dtype."""
    return cast_rounded(x, dtype).to(tl.float32)


@jit
def _factors(xhat, w, offset, X, W, CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """The two float32 factors whose product the stock module computes: (normalized x, offset + weight);
    without a weight the second is 1 and only x's rounding is the casting's."""
    if not HAS_WEIGHT:
        if CASTING != GEMMA:
            xhat = _round(xhat, X.dtype.element_ty)
        w = tl.full(w.shape, 1.0, tl.float32)
    elif CASTING == LLAMA:
        # hidden_states.to(input_dtype); `offset + weight` is rounded to weight's dtype
        xhat = _round(xhat, X.dtype.element_ty)
        w = _round(w + offset, W.dtype.element_ty)
    elif CASTING == GEMMA:
        w = w + offset
    else:
        # everything in x's dtype: round each step to it
        xhat = _round(xhat, X.dtype.element_ty)
        w = _round(_round(w, X.dtype.element_ty) + offset, X.dtype.element_ty)
    return xhat, w


@jit
def _gate(g, GATE: tl.constexpr):
    """(act(g), act'(g)) in float32 for the gated form (silu for PRE_SILU)."""
    s = tl.sigmoid(g)
    if GATE == SIGMOID:
        return s, s * (1.0 - s)
    return g * s, s * (1.0 + g * (1.0 - s))


@jit
def _gated_input(x, G, offs, mask, X, CASTING: tl.constexpr, GATE: tl.constexpr):
    """The tensor normalized: x, or x * silu(gate) in float32 for PRE_SILU (in x's dtype for "none")."""
    if GATE == PRE_SILU:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        x = x * _gate(g, GATE)[0]
        if CASTING == NONE:
            x = _round(x, X.dtype.element_ty)
    return x


@jit
def _load_w(W, cols, col_ok, HAS_WEIGHT: tl.constexpr):
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros(cols.shape, dtype=tl.float32)
    return w


@jit
def _rms_norm_fwd_kernel(
    X, W, G, Y, RSTD, n_rows, n_cols, stride_x, stride_g, stride_y, eps, offset,
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    # pass 1: sum of squares in float32, one column block at a time
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _gated_input(x, G, rows[:, None] * stride_g + cols[None, :], mask, X, CASTING, GATE)
        sq = x * x
        if CASTING == NONE:
            sq = _round(sq, X.dtype.element_ty)
        sum_sq += tl.sum(sq, axis=1)
    if CASTING == NONE:
        # x.pow(2).mean() + eps and its rsqrt, each step rounded to x's dtype (summed in fp32)
        rstd = _round(tl.rsqrt(_round(_round(sum_sq / n_cols, X.dtype.element_ty) + eps, X.dtype.element_ty)),
                      X.dtype.element_ty)
    else:
        rstd = tl.rsqrt(sum_sq / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    # pass 2: scale; a row that fits one block was just loaded by this program: the re-read hits cache
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _gated_input(x, G, rows[:, None] * stride_g + cols[None, :], mask, X, CASTING, GATE)
        w = _load_w(W, cols, col_ok, HAS_WEIGHT)
        xhat, w_eff = _factors(x * rstd[:, None], w[None, :], offset, X, W, CASTING, HAS_WEIGHT)
        y = xhat * w_eff
        if GATE == SILU or GATE == SIGMOID:
            # the product in the module's dtype (ROUND_PRODUCT: x's), then times act(gate) in float32
            if ROUND_PRODUCT:
                y = _round(y, X.dtype.element_ty)
            g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = y * _gate(g, GATE)[0]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], cast_rounded(y, Y.dtype.element_ty), mask=mask)


@jit
def _rms_norm_bwd_dot_kernel(
    DY, X, W, G, RSTD, DOT, n_rows, n_cols, stride_dy, stride_x, stride_g, offset,
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per row, sum_j dn_j * w_eff_j * xhat_j (dn: dy, times act(gate) in the gated form); only
    launched when a row spans several blocks."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    dot = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _gated_input(x, G, rows[:, None] * stride_g + cols[None, :], mask, X, CASTING, GATE)
        w = _load_w(W, cols, col_ok, HAS_WEIGHT)
        xhat = x * rstd[:, None]
        _, w_eff = _factors(xhat, w[None, :], offset, X, W, CASTING, HAS_WEIGHT)
        if GATE == SILU or GATE == SIGMOID:
            g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = dy * _gate(g, GATE)[0]
        dot += tl.sum(dy * w_eff * xhat, axis=1)
    tl.store(DOT + rows, dot, mask=row_ok)


@jit
def _rms_norm_bwd_kernel(
    DY, X, W, G, RSTD, DOT, DX, DW_PARTIAL, DG, n_rows, n_cols, stride_dy, stride_x, stride_g, stride_dx,
    stride_dg, offset, rows_per_program,
    CASTING: tl.constexpr, HAS_WEIGHT: tl.constexpr, GATE: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    ONE_BLOCK: tl.constexpr, COMPUTE_DW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # dx = rstd * (g - xhat * mean(g * xhat)) with g = dn * w_eff;  dw = sum over rows of dn * xhat;
    # dn = dy, or in the gated form y = n * act(gate): dn = dy * act(gate), dgate = dy * n * act'(gate)
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    for c0 in range(0, n_cols, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        w = _load_w(W, cols, col_ok, HAS_WEIGHT)
        # this program's share of the weight gradient stays in registers over its rows
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(row_start, row_end, BLOCK_M):
            rows = r0 + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            if GATE == PRE_SILU:  # normalized h = x * silu(gate): dx = dh * silu(gate), dgate = dh * x * silu'
                x_in = x
                gate = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                act, act_grad = _gate(gate, GATE)
                x = x * act
                if CASTING == NONE:
                    x = _round(x, X.dtype.element_ty)
            xhat = x * rstd[:, None]
            xhat_used, w_eff = _factors(xhat, w[None, :], offset, X, W, CASTING, HAS_WEIGHT)
            if GATE == SILU or GATE == SIGMOID:
                gate = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                act, act_grad = _gate(gate, GATE)
                n = xhat_used * w_eff
                if ROUND_PRODUCT:
                    n = _round(n, X.dtype.element_ty)
                tl.store(DG + rows[:, None] * stride_dg + cols[None, :],
                         cast_rounded(dy * n * act_grad, DG.dtype.element_ty), mask=mask)
                dy = dy * act
            g = dy * w_eff
            if ONE_BLOCK:
                dot = tl.sum(g * xhat, axis=1)
            else:
                dot = tl.load(DOT + rows, mask=row_ok, other=0.0)
            dx = rstd[:, None] * (g - xhat * (dot / n_cols)[:, None])
            if GATE == PRE_SILU:
                tl.store(DG + rows[:, None] * stride_dg + cols[None, :],
                         cast_rounded(dx * x_in * act_grad, DG.dtype.element_ty), mask=mask)
                dx = dx * act
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast_rounded(dx, DX.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw += tl.sum(dy * xhat_used, axis=0)
        if COMPUTE_DW:
            tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_ok)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _blocks(n_rows: int, n_cols: int, gated_backward: bool = False) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for rows of width n_cols."""
    cap = min(_MAX_BLOCK_N, _MAX_GATED_BWD_BLOCK_N) if gated_backward else _MAX_BLOCK_N
    block_n = min(_launch.next_power_of_2(n_cols), cap)
    block_m = max(1, min(_TILE // block_n, _launch.next_power_of_2(n_rows)))
    return block_m, block_n


def _num_warps(tile: int, per_thread: int) -> int:
    # the backward keeps x, dy, w and the weight-grad partial live: fewer elements per thread
    return max(4, min(16, tile // (32 * per_thread)))


def _max_programs(device: torch.device, num_warps: int) -> int:
    """How many programs share the backward's rows: as many as are resident at once on CUDA, a
    few elsewhere.

    Per SM, as many as fit its 65536 registers at _BWD_REGISTERS a thread: the backward with the
    weight gradient takes 76-109 (`python -m accel_kernels.codegen`, sm_80 and sm_90a, triton
    3.9), so at 16 warps (512 threads) one block fits a SM, at 8 warps two. The grid used to ask
    for two per SM at 16 warps: the second half waited for a second wave, in which each SM ran
    one program of its share again instead of sharing the rows evenly in one.
    """
    if device.type == "cuda":
        per_sm = max(1, 65536 // (32 * num_warps * _BWD_REGISTERS))
        return per_sm * _sm_count(device)
    return 4 if device.type == "cpu" else 64


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    """The device's SM count, asked of torch once per device (a few microseconds a call); a device
    without an index (the current one, whichever that is) is asked every time. A tensor's device
    always has its index."""
    if device.index is None:
        return torch.cuda.get_device_properties(device).multi_processor_count
    count = _SM_COUNTS.get(device.index)
    if count is None:
        count = _SM_COUNTS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """t as (rows, n_cols) with unit column stride; copies only when a view cannot be had."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _limits() -> tuple:
    """The module's block limits, part of every cached launch configuration's key: a test (or a
    maintainer) that changes one gets configurations made with it."""
    return _MAX_BLOCK_N, _MAX_GATED_BWD_BLOCK_N, _TILE, _BWD_TWO_ROWS


def _row_major(t: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int]:
    """(t as the kernels read it, its row stride): a contiguous t itself, rows n_cols apart (no
    view made: a view costs more host time than the rest of a launch's arithmetic), else `_rows`."""
    if t.is_contiguous():
        return t, n_cols
    t = _rows(t, n_cols)
    return t, t.stride(0)


@functools.lru_cache(maxsize=256)
def _forward_config(n_rows: int, n_cols: int, limits: tuple) -> tuple[tuple, int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, num_warps) of the forward kernel, once per shape and `_limits()`."""
    block_m, block_n = _blocks(n_rows, n_cols)
    return (_launch.cdiv(n_rows, block_m),), block_m, block_n, _num_warps(block_m * block_n, per_thread=16)


@functools.lru_cache(maxsize=256)
def _backward_config(n_rows: int, n_cols: int, gated: bool, limits: tuple) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, row tiles) of the backward kernels, once per shape and
    `_limits()` (the programs sharing the rows depend on the device: `_max_programs`)."""
    block_m, block_n = _blocks(n_rows, n_cols, gated_backward=gated)
    if not gated and block_m == 1 and n_rows > 1 and 2 * block_n <= _BWD_TWO_ROWS:
        block_m = 2  # two rows' loads in flight an iteration (_BWD_TWO_ROWS)
    return block_m, block_n, _num_warps(block_m * block_n, per_thread=8), _launch.cdiv(n_rows, block_m)


def _out_dtype(x: torch.Tensor, weight: Optional[torch.Tensor], casting: str, gated: bool = False) -> torch.dtype:
    """gated: the gate multiplies after the norm (not "pre_silu")."""
    if casting == "llama" and weight is not None and not gated:
        return torch.promote_types(weight.dtype, x.dtype)
    return x.dtype  # the gated form casts to x's dtype at the end


def _round_product(x, weight, casting) -> bool:
    """Gated form: whether the stock module rounds the ungated product to x's dtype before the gate
    (Llama casting with a weight in x's dtype, or everything in x's dtype)."""
    if x.dtype == torch.float32:
        return False
    if casting == "llama":
        return weight is not None and torch.promote_types(weight.dtype, x.dtype) == x.dtype
    return casting == "none"


def _forward_triton(x, weight, eps, offset, casting, gate=None, activation=""):
    """(y of x's shape, tensors for the backward: x, weight (or None), rstd (rows,) float32, gate
    (or None)), x and gate as the kernels read them (`_row_major`)."""
    n_cols = x.shape[-1]
    x2, stride_x = _row_major(x, n_cols)
    n_rows = x.numel() // n_cols
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    g2, stride_g = _row_major(gate, n_cols) if gate is not None else (x2, 0)
    gated_after = gate is not None and activation != "pre_silu"
    # y in x's shape, contiguous: rows n_cols apart
    y = _dispatch.empty_like(x, dtype=_out_dtype(x, weight, casting, gated_after))
    rstd = _dispatch.empty((n_rows,), dtype=torch.float32, device=x.device)
    grid, block_m, block_n, num_warps = _forward_config(n_rows, n_cols, _limits())
    _launch.launch(
        _rms_norm_fwd_kernel, grid,
        x2, weight if weight is not None else x2, g2, y, rstd, n_rows, n_cols, stride_x, stride_g, n_cols, eps, offset,
        CASTING=_CASTING_IDS[casting], HAS_WEIGHT=weight is not None,
        GATE=_GATE_IDS[activation] if gate is not None else 0,
        ROUND_PRODUCT=gated_after and _round_product(x, weight, casting), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, (x2, weight, rstd, gate if gate is None else g2)


def _backward_triton(dy, saved, x_shape, eps, offset, casting, need_x, need_w, forward_autocast, activation="",
                     need_g=False):
    """(dx of x_shape in x's dtype, dw in weight's dtype or None, dgate of x_shape in gate's dtype or
    None) from the forward's saved tensors. (forward_autocast is for the twin, which recomputes the
    forward; the kernels do not.)"""
    x, weight, rstd, *rest = saved
    g = rest[0] if rest else None
    n_cols = x_shape[-1]
    n_rows = rstd.shape[0]
    x2, stride_x = _row_major(x, n_cols)
    dy2, stride_dy = _row_major(dy, n_cols)
    g2, stride_g = _row_major(g, n_cols) if g is not None else (x2, 0)
    gate_id = _GATE_IDS[activation] if g is not None else 0
    need_w = need_w and weight is not None
    w_arg = weight if weight is not None else x2
    block_m, block_n, num_warps, row_tiles = _backward_config(n_rows, n_cols, g is not None, _limits())
    one_block = block_n >= n_cols
    rows_per_program = _launch.cdiv(row_tiles, min(row_tiles, _max_programs(x.device, num_warps))) * block_m
    n_programs = _launch.cdiv(n_rows, rows_per_program)
    # dx (and dgate) in x's shape, contiguous: rows n_cols apart (like x where x has that shape: a
    # microsecond less than allocating by a torch.Size)
    dx = _dispatch.empty_like(x) if x.shape == x_shape else _dispatch.empty(x_shape, dtype=x.dtype, device=x.device)
    dw_partial = _dispatch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device) if need_w else rstd
    # the gate's gradient comes with every gated backward (it costs one store): x's
    dg = _dispatch.empty(x_shape, dtype=g.dtype, device=x.device) if g is not None else dx
    dot = rstd
    if not one_block:
        dot = _dispatch.empty((n_rows,), dtype=torch.float32, device=x.device)
        _launch.launch(
            _rms_norm_bwd_dot_kernel, (row_tiles,),
            dy2, x2, w_arg, g2, rstd, dot, n_rows, n_cols, stride_dy, stride_x, stride_g, offset,
            CASTING=_CASTING_IDS[casting], HAS_WEIGHT=weight is not None, GATE=gate_id,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        )
    _launch.launch(
        _rms_norm_bwd_kernel, (n_programs,),
        dy2, x2, w_arg, g2, rstd, dot, dx, dw_partial, dg, n_rows, n_cols,
        stride_dy, stride_x, stride_g, n_cols, n_cols, offset, rows_per_program,
        CASTING=_CASTING_IDS[casting], HAS_WEIGHT=weight is not None, GATE=gate_id,
        ROUND_PRODUCT=gate_id in (1, 2) and _round_product(x, weight, casting), ONE_BLOCK=one_block,
        COMPUTE_DW=need_w,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    if need_w:
        dw = dw_partial.sum(0)
        if dw.dtype != weight.dtype:
            dw = dw.to(weight.dtype)
    else:
        dw = None
    if g is None:
        return dx, dw
    return dx, dw, (dg if need_g else None)


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


def _n_rows(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


@_library.custom_op("rms_norm", used=1)
def _rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float, casting: str,
                 triton_path: bool, autocast: Optional[torch.dtype], gate: Optional[torch.Tensor] = None,
                 activation: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): rstd (rows,) float32 for the kernels' backward; (0,) on the twin, which needs none.
    autocast: the caller's autocast dtype (None: off), which the twin runs under as eager would
    (an op's implementation runs with autocast off); the kernels ignore it. weight None: no
    scale; gate: the gated form's second input (activation "silu" or "sigmoid")."""
    if triton_path:
        y, (_, _, rstd, _) = _forward_triton(x, weight, eps, offset, casting, gate, activation)
        return y, rstd
    with _library.autograd_inside(), _dispatch.autocast_as(_library.autocast_state(x.device.type, autocast)):
        y, _ = _forward_torch(x, weight, eps, offset, casting, gate, activation)
    return y.contiguous(), _library.nothing(x, torch.float32)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset, casting, triton_path, autocast, gate=None, activation=""):
    if not triton_path and autocast is not None:  # the dtypes autocast gives the formula
        with torch.autocast(x.device.type, dtype=autocast):
            y = _reference(x, weight, eps, offset, casting, gate, activation)
        return y.new_empty(y.shape), x.new_empty((0,), dtype=torch.float32)
    return (x.new_empty(x.shape, dtype=_out_dtype(x, weight, casting, gate is not None and activation != "pre_silu")),
            x.new_empty((_n_rows(x) if triton_path else 0,), dtype=torch.float32))


@_library.custom_op("rms_norm_backward")
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                          eps: float, offset: float, casting: str, need_x: bool, need_w: bool,
                          triton_path: bool, forward_autocast: Optional[torch.dtype],
                          gate: Optional[torch.Tensor] = None, activation: str = "", need_g: bool = False,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx of x's shape, dw of weight's shape, dgate of gate's shape), each (0,) when not needed."""
    need_w = need_w and weight is not None
    need_g = need_g and gate is not None
    if triton_path:
        dx, dw, dg = _kernel_grads(dy, x, weight, rstd, gate, eps, offset, casting, need_x, need_w, activation,
                                   need_g)
    else:
        autocast = _library.autocast_state(x.device.type, forward_autocast)
        dx, dw, *dg = _backward_torch(dy, (x, weight, gate), x.shape, eps, offset, casting, need_x, need_w, autocast,
                                      activation, need_g)
        dg = dg[0] if dg else None
    return (dx.contiguous() if need_x else _library.nothing(x),
            dw.contiguous() if need_w else _library.nothing(x if weight is None else weight),
            dg.contiguous() if need_g else _library.nothing(x if gate is None else gate))


def _kernel_grads(dy, x, weight, rstd, gate, eps, offset, casting, need_x, need_w, activation, need_g):
    """(dx, dw, dgate), dw and dgate None when not asked for (or absent), by the kernels from what the
    forward saved: the backward op's Triton path, and the eager formula's (which needs no (0,)
    stand-ins)."""
    saved = (x, weight.contiguous() if weight is not None else None, rstd, gate)
    dx, dw, *dg = _backward_triton(dy, saved, x.shape, eps, offset, casting, need_x, need_w and weight is not None,
                                   None, activation, need_g and gate is not None)
    return dx, dw, (dg[0] if dg else None)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, eps, offset, casting, need_x, need_w, triton_path, forward_autocast, gate=None,
      activation="", need_g=False):
    need_w = need_w and weight is not None
    need_g = need_g and gate is not None
    return (x.new_empty(x.shape) if need_x else _library.nothing(x),
            weight.new_empty(weight.shape) if need_w else _library.nothing(x if weight is None else weight),
            gate.new_empty(gate.shape) if need_g else _library.nothing(x if gate is None else gate))


def _setup_context(ctx, inputs, output):
    x, weight, eps, offset, casting, triton_path, autocast = inputs[:7]
    gate, activation = inputs[7:9] if len(inputs) > 7 else (None, "")
    # x itself (an op's output cannot be a view of its input): a strided x is made contiguous again
    # in backward, where the old Function saved the forward's copy
    ctx.save_for_backward(x, weight, output[1], gate)
    ctx.options = (eps, offset, casting, triton_path, activation)
    # the twin recomputes the forward in backward: under the forward's autocast
    ctx.autocast = None if triton_path else autocast
    ctx.set_materialize_grads(False)  # rstd gets no gradient: allocate no zeros for it


def _backward(ctx, dy, _drstd=None):
    _dispatch.check_first_order("rms_norm")  # the op's backward is opaque to autograd
    if dy is None:  # y was not used (only rstd, which is internal, could have been)
        return (None,) * len(ctx.needs_input_grad)
    x, weight, rstd, gate = ctx.saved_tensors
    eps, offset, casting, triton_path, activation = ctx.options
    need_x, need_w = ctx.needs_input_grad[:2]
    need_g = len(ctx.needs_input_grad) > 7 and ctx.needs_input_grad[7]
    if triton_path and _library.direct(ctx):
        # the kernels straight from the formula: what the backward op's implementation does on its
        # Triton path, less its schema's (0,) stand-ins for the gradients not asked for (no
        # dispatch guard: a backward runs with grad mode off, so nothing here is recorded)
        dx, dw, dg = _kernel_grads(dy, x, weight, rstd, gate, eps, offset, casting, need_x, need_w, activation, need_g)
    else:
        dx, dw, dg = _rms_norm_backward_op.backward_call(
            ctx, dy, x, weight, rstd, eps, offset, casting, need_x, need_w, triton_path, ctx.autocast, gate, activation,
            need_g)
    grads = [(dx if need_x else None), (dw if need_w else None), None, None, None, None, None]
    return (*grads, (dg if need_g else None), None)[:len(ctx.needs_input_grad)]


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# A norm's output saved as the call that made it
# --------------------------------------------------------------------------------------------
#
# The projections after a norm (q, k and v after the input norm; gate and up after the one before
# the MLP) save its output for their weights' gradients: (tokens, hidden) per norm, which the
# norm's own backward does not need (it keeps x and rstd). Inside `outputs_recomputed`'s scope a
# saved output of an eager kernel call is kept as that call (its autograd node, which holds x, the
# weight and the options) and computed again, once for all of its consumers, when the first of
# them runs its backward: one more forward kernel per norm and step (x read, y written) against y
# held from the forward until the backward reaches the layer. The kernel is deterministic, so the
# recomputed y is the forward's bit for bit.

#: Off: norm outputs are saved as autograd saves them (benchmarks/step_memory.py's variant).
RECOMPUTE_OUTPUTS = True
#: Smaller outputs are saved as they are: the bytes kept are few, and at the token counts that
#: make them (under 2048 tokens at hidden 2048 in bf16, 1024 at 4096) a step's GPU work per layer
#: is short enough that the hooks' host work (tens of microseconds a layer) may be what it waits
#: on. 8 MiB.
RECOMPUTE_MIN_BYTES = 8 << 20

_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class _Output:
    """One norm output saved in a scope: the node that made it, the output (weakly: to tell a
    write into it, which autograd does not check for a tensor its hooks saved), how many saved
    tensors read it, and while a backward reads them, the recomputed tensor (dropped when the last
    has it)."""

    __slots__ = ("node", "output", "users", "left", "value", "on_recompute")

    def __init__(self, node, output, on_recompute):
        self.node, self.output, self.on_recompute = node, weakref.ref(output), on_recompute
        self.users, self.left, self.value = 0, 0, None

    def get(self) -> torch.Tensor:
        output = self.output()
        if output is not None and output._version != 0:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: an rms_norm output of shape {list(output.shape)} is at version {output._version}; "
                f"expected version 0 instead. (accel_kernels kept it for backward as the norm call that made "
                f"it, to compute it again: it must not be written after the layers that read it.)")
        if self.value is None:
            # autograd's own checks: raises as the norm's backward would if x or the weight was
            # modified in place or the graph was freed
            x, weight, _rstd, _gate = self.node.saved_tensors
            eps, offset, casting, _triton_path, _activation = self.node.options
            self.value, _ = _forward_triton(x, weight, eps, offset, casting)
            self.left = self.users
            if self.on_recompute is not None:
                self.on_recompute()
        value = self.value
        self.left -= 1
        if self.left <= 0:  # every consumer has read it (a retained graph's next backward recomputes)
            self.value = None
        return value


class _Saved:
    """What a consumer's saved tensor holds instead of the output: the call, and the saved tensor's
    geometry over the output (None: the output itself)."""

    __slots__ = ("output", "geometry")

    def __init__(self, output, geometry):
        self.output, self.geometry = output, geometry


class _Scope:
    """The saved-tensor hooks of one scope (`outputs_recomputed`)."""

    __slots__ = ("outputs", "on_recompute")

    def __init__(self, on_recompute):
        self.outputs, self.on_recompute = {}, on_recompute

    def pack(self, t):
        base = t._base
        y = t if base is None else base
        node = y.grad_fn
        # output 0 (not rstd, which the norm saves itself) of an ungated kernel call, unmodified,
        # read whole or through a view of the same dtype
        if (type(node) is not _NODE or y.output_nr != 0 or not node.options[3] or node.options[4]
                or y._version != 0 or t.dtype != y.dtype):
            return t
        output = self.outputs.get(id(node))
        if output is None:
            output = self.outputs[id(node)] = _Output(node, y, self.on_recompute)
        output.users += 1
        return _Saved(output, None if t is y else (t.size(), t.stride(), t.storage_offset()))

    @staticmethod
    def unpack(saved):
        if type(saved) is not _Saved:
            return saved
        value = saved.output.get()
        return value if saved.geometry is None else value.as_strided(*saved.geometry)

    def __enter__(self):
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        return self

    def __exit__(self, *exc):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self.outputs = {}  # the saved tensors keep their _Output; a later scope starts afresh
        return False


def outputs_recomputed(x: torch.Tensor, on_recompute=None, saved_as_is: bool = False):
    """A context manager for the modules that consume `x` (an attention's or an MLP's projections),
    or None. Inside it, every tensor autograd saves that is `x` or a view of it, where x is the
    output of an eager rms_norm kernel call (ungated, on the Triton path), is saved as that call
    and recomputed when a backward first needs it (section comment above); `on_recompute()` is
    called for each recompute.

    None, where there is nothing to gain or it cannot apply: x is no such output; grad is off;
    autocast is on in another dtype than x's, so the consumers save their casts of x, not x,
    unless the caller says they save x as it is (`saved_as_is`: accel-patch's fused LoRA functions);
    compiling (the compiler decides what a graph saves); `RECOMPUTE_OUTPUTS` is off; x is under
    `RECOMPUTE_MIN_BYTES`; saved-tensor hooks are active already (non-reentrant checkpointing's,
    `save_on_cpu`, a user's: theirs decide what is kept); torch lacks the private function that
    tells; or the norm's weight may be gone when the consumers' backward runs: a DeepSpeed ZeRO-3
    parameter (released after each module's forward, gathered again only for that module's own
    backward), or a weight whose storage was freed since the norm ran (an FSDP unit of the norm
    alone, resharded after its forward). A weight still there when its consumers run is in their
    FSDP unit, or one around it, which gathers it again before any of their backward."""
    if (torch.compiler.is_compiling() or type(getattr(x, "grad_fn", None)) is not _NODE or not RECOMPUTE_OUTPUTS
            or x.nbytes < RECOMPUTE_MIN_BYTES or _top_hooks is None or _top_hooks(False) is not None
            or not torch.is_grad_enabled()):
        return None
    if not saved_as_is:
        autocast = _dispatch.autocast_state(x.device.type)
        if autocast is not None and autocast[1] and autocast[2] != x.dtype:
            return None
    try:
        weight = x.grad_fn.saved_tensors[1]
    except RuntimeError:  # freed: a backward already ran through the norm (nothing to recompute from)
        return None
    if weight is not None and (hasattr(weight, "ds_id") or weight.untyped_storage().nbytes() < weight.nbytes):
        return None  # may be released before the consumers' backward (docstring)
    return _Scope(on_recompute)


_NODE = _rms_norm_op.node_type


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


def _reference(x, weight, eps, offset, casting, gate=None, activation=""):
    """The stock modules' formula in plain torch: LlamaRMSNorm, GemmaRMSNorm, or all in x's dtype;
    without a weight (Gemma 4's value norm, Llama 4's L2 norm), and gated:
    `(that product before its final cast).float() * act(gate.float())`, cast to x's dtype
    (Qwen3-Next's RMSNormGated with casting "llama", Kimi Linear's with "gemma"), or for
    "pre_silu" the formula of `x.float() * silu(gate.float())` (Mamba2's RMSNormGated, "llama")."""
    pre = gate is not None and activation == "pre_silu"
    wide = torch.promote_types(x.dtype, torch.float32)  # the gate's float32 steps (float64 stays float64)
    if casting in ("llama", "gemma"):
        h = x.float() * torch.nn.functional.silu(gate.float()) if pre else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if casting == "llama":
            y = h.to(x.dtype) if weight is None else (offset + weight) * h.to(x.dtype)
        else:
            y = h if weight is None else h * (offset + weight.float())
    else:
        x_in = (x.to(wide) * torch.nn.functional.silu(gate.to(wide))).to(x.dtype) if pre else x
        h = x_in * torch.rsqrt(x_in.pow(2).mean(-1, keepdim=True) + eps)
        y = h if weight is None else h * (offset + weight.to(x.dtype))
    if gate is not None and not pre:
        act = torch.nn.functional.silu if activation == "silu" else torch.sigmoid
        return (y * act(gate.to(wide))).to(x.dtype)
    return y.type_as(x) if casting == "gemma" else y


def _forward_torch(x, weight, eps, offset, casting, gate=None, activation=""):
    """`_forward_triton` in plain torch: the module's formula; saves the inputs themselves."""
    return _reference(x, weight, eps, offset, casting, gate, activation), (x, weight, gate)


def _backward_torch(dy, saved, x_shape, eps, offset, casting, need_x, need_w, forward_autocast, activation="",
                    need_g=False):
    """`_backward_triton` in plain torch: the gradients autograd gives the module's formula, bit
    for bit (recomputed here, so that the forward keeps no intermediate)."""
    x, weight, gate = (tuple(saved) + (None,))[:3]
    needs = (need_x, need_w and weight is not None, need_g and gate is not None)
    with _library.autograd_inside():  # this runs inside the op's implementation
        x, weight, gate = (t.detach().requires_grad_(need) if t is not None else None
                           for t, need in zip((x, weight, gate), needs))
        # recompute as the forward ran (its autocast); differentiate as eager would (the ambient one)
        with torch.enable_grad(), _dispatch.autocast_as(forward_autocast):
            y = _reference(x, weight, eps, offset, casting, gate, activation)
        wanted = [t for t, need in zip((x, weight, gate), needs) if need]
        grads = iter(torch.autograd.grad(y, wanted, dy))
    out = tuple(next(grads) if need else None for need in needs)
    return out if gate is not None else out[:2]


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(x, weight, casting, offset=0.0, gate=None, activation="") -> None:
    _dispatch.check_tensor("x", x, "of shape (..., n)")
    _dispatch.check_floating("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dim (the normalized last dim), got a 0-dim tensor")
    if weight is not None:
        _dispatch.check_tensor("weight", weight, "of shape (n,) or None")
        _dispatch.check_floating("weight", weight)
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(f"weight must have shape ({x.shape[-1]},) (x.shape[-1]), got {tuple(weight.shape)}")
        _dispatch.check_same_device(x=x, weight=weight)
    elif offset != 0.0:
        raise ValueError(f"offset scales a weight: with weight=None it must be 0.0, got {offset!r}")
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if gate is not None:
        _dispatch.check_tensor("gate", gate, "of x's shape")
        _dispatch.check_floating("gate", gate)
        if gate.shape != x.shape:
            raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
        if activation not in ACTIVATIONS[1:]:
            raise ValueError(f"activation must be one of {ACTIVATIONS[1:]} with a gate, got {activation!r}")
        _dispatch.check_same_device(x=x, gate=gate)


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-6, offset: float = 0.0,
             casting: str = "llama", gate: Optional[torch.Tensor] = None, activation: str = "silu") -> torch.Tensor:
    """RMSNorm of x over its last dim: x / sqrt(mean(x**2) + eps) * (offset + weight).

    weight=None: no scale (offset must be 0), no weight gradient: Gemma 4's `with_scale=False`
    norm, Llama 4's L2 norm, DeepSeek V4's unweighted norm. gate (x's shape) with activation
    "silu" or "sigmoid": the gated form `norm(x) * act(gate)` of linear-attention layers, the gate
    applied in float32 to the product before its final cast, output in x's dtype; activation
    "pre_silu": `norm(x * silu(gate))` (the gate first, in float32; Mamba2's form), output dtype as
    without a gate. Differentiable in gate too.

    x: (..., n) floating point, any leading dims, any strides; weight: (n,) on x's device.
    `casting` ("llama", "gemma", "none") picks the dtype of each step and of the output as the
    module docstring says: casting="llama" (offset 0) matches transformers' LlamaRMSNorm,
    casting="gemma" with offset=1.0 GemmaRMSNorm. Differentiable in x and weight (weight may
    have requires_grad=False). Inputs are never written. Raises ValueError naming a bad argument.
    float32/bfloat16/float16 run the Triton kernels (on GPU, or on CPU when the kernels run under
    Triton's interpreter); float64 and everything else run the plain-torch twin, whose gradients
    are autograd's of the module's formula.
    """
    if (gate is None and type(x) in _PLAIN and type(weight) in _PLAIN and x.dtype in _DTYPES
            and weight.dtype in _DTYPES and casting in _CASTING_IDS and x.dim() > 0
            and weight.shape == x.shape[-1:] and weight.device == x.device):
        # the common call (a weighted norm in a kernel dtype) passes the checks in one expression
        triton_path = x.numel() > 0 and _dispatch.use_triton(x)
    else:
        _check_inputs(x, weight, casting, offset, gate, activation)
        dtypes = {t.dtype for t in (x, weight, gate) if t is not None}
        # float64 inputs take the twin: the kernels accumulate in float32
        if torch.float64 in dtypes:
            # the formula in differentiable torch, outside the op: second derivatives stay exact
            return _reference(x, weight, float(eps), float(offset), casting, gate, activation)
        # empty inputs take the twin
        triton_path = _dispatch.use_triton(x) and x.numel() > 0 and dtypes <= set(_DTYPES)
    autocast = None if triton_path else _library.autocast_dtype(x.device.type)
    if gate is None:  # the ungated op's schema as before: compiled graphs keep their nodes
        return _rms_norm_op(x, weight, float(eps), float(offset), casting, triton_path,
                                                autocast)[0]
    return _rms_norm_op(x, weight, float(eps), float(offset), casting, triton_path,
                                            autocast, gate, activation)[0]
