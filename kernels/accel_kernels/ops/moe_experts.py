"""MoE experts: the routed gated MLPs of a mixture-of-experts layer as grouped GEMMs over the tokens
sorted by expert, with a hand-written backward and split LoRA on the experts' weights.

    out[t] = sum_k w[t, k] * (down_e(act(gate_up_e(x_t)) ) + down_bias_e),   e = top_k_index[t, k]

what transformers' experts modules compute (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, GLM4-MoE,
gpt-oss...), for every layout they store: `gate_up` [E, 2I, H] used as `F.linear(x, gate_up[e])`
(transposed=False) or [E, H, 2I] used as `x @ gate_up[e]` (transposed=True, gpt-oss); `down`
[E, H, I] or [E, I, H] likewise; gate and up as the halves [gate | up] of the 2I outputs, or
interleaved (gate = [..., ::2], up = [..., 1::2], gpt-oss); biases [E, 2I] and [E, H] optional.
Activations: "silu" (silu(gate) * up), "gelu" (erf) and "gelu_tanh" (gelu(gate) * up), and
"gpt_oss": gate = gate.clamp(max=limit), up = up.clamp(-limit, limit),
(up + 1) * gate * sigmoid(alpha * gate), with the clamps' zero gradient where they clamp (inclusive
bounds, as torch's clamp). A finite `limit` with another activation is the clamped SwiGLU of
DeepSeek V4 and GLM-5-next: gate.clamp(max=limit) and up.clamp(-limit, limit) before act(gate) * up,
the same clamps and gradients, in the same epilogue. An expert id < 0 or >= E means "no expert" (transformers' masks use E):
that slot adds nothing and gets a zero routing-weight gradient.

How. The T*K (token, slot) pairs are sorted by expert once (a stable argsort of the flattened
index; `order`, and `offsets` [E+1], the first sorted row of each expert). Every GEMM is one
launch for all experts over those sorted rows:

- gate/up: x rows gathered by token, times each expert's gate_up, bias added and the GLU applied
  in the GEMM's epilogue: only act(gate) * up [T*K, I] is written, never the [T*K, 2I] gate/up;
- down: that times each expert's down, bias added and the routing weight applied in fp32 in the
  epilogue, one rounding to the compute dtype; a combine kernel sums each token's K slots (read at
  their sorted positions) in fp32 and writes hidden's dtype once (transformers: `out * w`, then
  `index_add_` in hidden's dtype).

The tile list (expert and first sorted row of each BLOCK_M-row tile) is built on the device from
`offsets`, and the grid is the bound cdiv(T*K, BLOCK_M) + E: no host synchronisation, and a
program past the last tile returns at once. Forward: 3 launches (4 with LoRA on down, +1 on
gate_up); its temporaries are act(gate) * up [T*K, I] and the down output [T*K, H] in the compute
dtype, as stock's. Backward: 6 launches without LoRA (dh, gate/up recomputed with the GLU
backward, dx and its combine, one weight gradient each for gate_up and down with the bias sums).

Backward recomputes gate/up from x (one more grouped GEMM, as the fused LoRA MLP recomputes), so
what is saved is x, the routing weights and the sort. Then, per sorted row r of expert e, token t
and upstream gradient g = grad_out[t]:

    dh_u = g @ down_e (grouped)           dw[t, k] = <dh_u, h> + <g, down_bias_e>  (= <g, y_e>)
    dgate, dup = GLU backward of (w * dh_u), recomputing gate/up in the same kernel
    dx[t] += dgu @ gate_up_e (grouped, then a combine over the K slots)
    d gate_up_e = dgu_e^T x_e, d down_e = (w g)_e^T h_e (grouped weight gradients, one launch each;
    an expert without tokens gets zeros), d biases = per-expert sums

Split LoRA. lora = {"gate_up": (A, B) or None, "down": (A, B) or None, "scaling": s} (s a float, or
one per projection: {"gate_up": s, "down": s}) with, for a projection with in/out features (gate_up:
H -> 2I; down: I -> H, whatever `transposed` says), A [E, r, in] and B [E, out, r], any strides
(PEFT's ParamWrapper views: lora_A.weight [r*E, in] as [E, r, in], lora_B.weight [out, r*E] as [out,
r, E] permuted to [E, out, r], not contiguous: read through their strides, never copied). y_e = x_e
W_e^T + s * (x_e A_e^T) B_e^T: the base grouped GEMM plus the adapters' grouped low-rank GEMMs; W_e
+ s B_e A_e is never formed. Gradients go to every input that requires grad: with PEFT the base
weights are frozen and only A, B, hidden and the routing weights get gradients; without LoRA
gate_up, down, the biases, hidden and the routing weights (the router trains through them).

Dtypes. The GEMMs' operands are in the compute dtype: `autocast_dtype` when given (the caller's
autocast dtype, captured outside the op, where autocast still reads true), else hidden's dtype.
Every operand (hidden, gate_up, down, biases, LoRA A and B, PEFT's float32 adapters included) is
cast to it where it is read; products accumulate in fp32; the activation runs in fp32 on the fp32
gate/up, and act(gate) * up is rounded to the compute dtype (it is the down GEMM's operand, as
under stock autocast); the LoRA intermediates x A^T are rounded to the compute dtype likewise;
the routing weight multiplies in fp32; the K slots are summed in fp32 and the output is in
hidden's dtype. Without autocast_dtype, gate_up, down and the biases must have hidden's dtype (as
stock's matmuls demand); LoRA A and B may be of any floating dtype. Gradients come back in each
input's own dtype (a weight's from an fp32 accumulation).

Saved for backward, per layer (T tokens, K slots, H hidden, I intermediate, E experts, S = T*K):
hidden [T, H], the routing weights [T, K], `order` [S] int32 and `offsets` [E+1] int32; the
parameters are saved by reference (no bytes). That is the minimum a backward that recomputes the
layer needs: its input and the routing, with one int32 per (token, slot) for the sort. At
Qwen3-30B-A3B in bf16 with 4096 tokens (H 2048, I 768, E 128, K 8): 16 MiB + 64 KiB + 128 KiB +
516 B = 16.19 MiB. transformers' grouped_mm path keeps S * (4H + 8I + 26) + 64 bytes (the gathered
x, gate/up, silu(gate), act * up, the down output, the sort), 448.8 MiB there (27.7x); its eager
loop keeps more. Measured with saved-tensor hooks at small shapes, where both formulas are exact
(`tests/kernels/test_moe_experts.py` asserts ours).

Paths. Triton on GPU tensors and under the interpreter; the plain-torch twin elsewhere, with the
same saved tensors and the same hand-written backward (so the memory holds on CPU too), computing
with `torch._grouped_mm` where it takes the operands (float32/bf16/fp16 with 16-byte strides:
torch >= 2.9 on CPU, feature-detected per call) and a loop over the experts elsewhere (float64).
The forward and the backward are written once (`_forward`, `_backward`) over two sets of
primitives with one interface (`_TritonOps`: launches over every sorted row; `_TorchOps`: the
valid rows, their count read on the host). The backward holds at once h [rows, I], dgu
[rows, 2I] and one [rows, H] product (two with its LoRA term on the twin): x and g are gathered
where a product reads them (inside the kernels, or as a temporary on the twin), never kept. The
twin runs the plan in windows of whole experts (`_twin_forward`, `_twin_backward`,
`TWIN_WINDOW_BYTES`), so "rows" there are one window's: the CPU's grouped GEMM is a loop over the
experts, so a window changes no product's size, and the per-token sums accumulate into one buffer
in the same order. Within float32's bound of the float64 result, as one window is; not bit for
bit on every host, since torch's CPU kernels round some elements by their place in a tensor (an
elementwise op's vectorized body against its scalar tail; a GEMM by its operands' addresses) and a
window changes the tensors' lengths (docs/moe.md).
On the Triton path the backward's GEMMs and weight gradients can run through torch._grouped_mm
instead (`backward`, `choose_backward`, `_GroupedOps`: by default on sm_90+ CUDA devices in
bf16/fp16 without LoRA where timing the first call of its shape found it the faster), the GLU
backward staying fused; docs/moe.md ("Which backward", "Tile sizes") models both backwards' FLOPs
and bytes.
"""
from __future__ import annotations

import functools
import math
from collections import namedtuple
from typing import Optional

import torch

from .. import _dispatch, _launch, _library, _timing
from .._triton import SOFTWARE_BF16_ROUNDING, cast_rounded, jit, tl
from ._glu import _act_and_grad

SILU, GELU_ERF, GELU_TANH, GPT_OSS = 0, 1, 2, 3
ACTIVATIONS = {"silu": SILU, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH, "gpt_oss": GPT_OSS}


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

# Rows are the (token, slot) pairs sorted by expert; a "tile" is BLOCK_M consecutive sorted rows of
# one expert. The host lists the tiles (`_tiles`: expert and first row of each, E where a program
# has no tile), so one launch covers every expert whatever the routing: an expert with no rows has
# no tile, an expert with every row has many. Compute dtype CT: 0 float32, 1 bfloat16, 2 float16.


@jit
def _to(x, CT: tl.constexpr):
    """x as a GEMM operand of compute dtype CT (rounded to nearest even, also under the interpreter)."""
    # one return: the compiler types every return statement, also those of branches it drops
    if CT == 1:
        if x.dtype == tl.bfloat16:
            y = x
        else:
            y = cast_rounded(x.to(tl.float32), tl.bfloat16)
    elif CT == 2:
        y = x.to(tl.float16)
    else:
        y = x.to(tl.float32)
    return y


@jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b, fp32 accumulation. Triton 3.9's interpreter multiplies bf16 operands wrongly
    (garbage of order 1e10); there they are multiplied as the fp32 they convert to exactly."""
    if SOFTWARE_BF16_ROUNDING and a.dtype == tl.bfloat16:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=PRECISION)
    return out


@jit
def _glu(g, u, alpha, limit, ACT: tl.constexpr, CLAMP: tl.constexpr):
    """(act(g, u), d/dg, d/du) for fp32 gate and up; the forward uses only the first. CLAMP: gate
    and up clamped at limit first (ACT != 3), the clamps' gradient 0 where they clamp."""
    if ACT == 3:  # gpt-oss: clamp, then (up + 1) * glu(gate); the clamps' gradient is 0 where they clamp
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        glu = gc * s
        h = (uc + 1.0) * glu
        dg = tl.where(g <= limit, (uc + 1.0) * (s + alpha * gc * s * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), glu, 0.0)
    elif CLAMP:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        a, da = _act_and_grad(gc, ACT)
        h = a * uc
        dg = tl.where(g <= limit, uc * da, 0.0)
        du = tl.where((u >= -limit) & (u <= limit), a, 0.0)
    else:
        a, da = _act_and_grad(g, ACT)
        h = a * u
        dg = u * da
        du = a
    return h, dg, du


@jit
def _moe_gemm_kernel(
    a_ptr, a_rows_ptr, w_ptr, bias_ptr, scale_ptr, la_ptr, lb_ptr, out_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr,
    N, K, E, rank,
    stride_am, stride_ak, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
    stride_lam, stride_lar, stride_lbe, stride_lbr, stride_lbn, stride_om, stride_on,
    lora_scale,
    GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, LORA: tl.constexpr,
    R: tl.constexpr, CT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[r] = (a[row(r)] @ w[e] (+ lora_scale * la[r] @ lb[e]) (+ bias[e])) (* scale[r]) for the
    sorted rows r of each expert e: w [E, K, N] and lb [E, R, N] by strides, row(r) = a_rows[r]
    when GATHER (the token of a sorted row) else r."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER:
        a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    e64 = e.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + e64 * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(_to(a, CT), _to(w, CT), acc, PRECISION)
    if LORA:
        rr = tl.arange(0, R)
        r_mask = rr < rank
        la = tl.load(la_ptr + rows[:, None].to(tl.int64) * stride_lam + rr[None, :] * stride_lar,
                     mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        lb = tl.load(lb_ptr + e64 * stride_lbe + rr[:, None] * stride_lbr + cols[None, :] * stride_lbn,
                     mask=r_mask[:, None] & col_mask[None, :], other=0.0)
        acc += lora_scale * _dot(_to(la, CT), _to(lb, CT), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + e64 * stride_be + cols * stride_bn, mask=col_mask, other=0.0)
        acc += _to(bias, CT).to(tl.float32)[None, :]
    if HAS_SCALE:  # the routing weight, in fp32, before the one rounding
        acc *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on,
             cast_rounded(acc, out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@jit
def _moe_gate_up_kernel(
    x_ptr, tok_ptr, w_ptr, bias_ptr, la_ptr, lb_ptr, h_ptr, dh_ptr, scale_ptr, dgu_ptr, dw_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr,
    I, H, E, rank, col_mult, up_offset,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_be, stride_bn,
    stride_lam, stride_lar, stride_lbe, stride_lbr, stride_lbn, stride_hm, stride_dhm, stride_dgm, stride_dwn,
    lora_scale, alpha, limit,
    ACT: tl.constexpr, CLAMP: tl.constexpr, FORWARD: tl.constexpr, HAS_BIAS: tl.constexpr, LORA: tl.constexpr, R: tl.constexpr,
    CT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """gate and up of BLOCK_N intermediate columns for a tile of sorted rows: x[token] @ w[e]
    (w [E, H, 2I] by strides; gate column j is output col_mult * j, up col_mult * j + up_offset)
    plus LoRA and bias, in fp32; then the GLU in the epilogue.

    FORWARD: h = act(gate, up) -> h_ptr [rows, I]. Else (backward, gate/up recomputed): with dh_u
    [rows, I] and the routing weight w of each row, h -> h_ptr, the partial sum of dh_u * h over
    these columns -> dw_ptr[pid_n, row] (fp32), and the GLU backward of w * dh_u -> dgu_ptr
    [rows, 2I] in the weight's column order."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e >= E:
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    tokens = tl.load(tok_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    gate_cols = cols * col_mult
    up_cols = gate_cols + up_offset
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * stride_we
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        x = _to(tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :] * stride_xk,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0), CT)
        w_mask = k_mask[:, None] & col_mask[None, :]
        wg = tl.load(w_base + ks[:, None] * stride_wk + gate_cols[None, :] * stride_wn, mask=w_mask, other=0.0)
        wu = tl.load(w_base + ks[:, None] * stride_wk + up_cols[None, :] * stride_wn, mask=w_mask, other=0.0)
        acc_g = _dot(x, _to(wg, CT), acc_g, PRECISION)
        acc_u = _dot(x, _to(wu, CT), acc_u, PRECISION)
    if LORA:
        rr = tl.arange(0, R)
        r_mask = rr < rank
        la = _to(tl.load(la_ptr + rows[:, None].to(tl.int64) * stride_lam + rr[None, :] * stride_lar,
                         mask=row_mask[:, None] & r_mask[None, :], other=0.0), CT)
        lb_base = lb_ptr + e64 * stride_lbe + rr[:, None] * stride_lbr
        lb_mask = r_mask[:, None] & col_mask[None, :]
        lbg = tl.load(lb_base + gate_cols[None, :] * stride_lbn, mask=lb_mask, other=0.0)
        lbu = tl.load(lb_base + up_cols[None, :] * stride_lbn, mask=lb_mask, other=0.0)
        acc_g += lora_scale * _dot(la, _to(lbg, CT), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION)
        acc_u += lora_scale * _dot(la, _to(lbu, CT), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION)
    if HAS_BIAS:
        b_base = bias_ptr + e64 * stride_be
        acc_g += _to(tl.load(b_base + gate_cols * stride_bn, mask=col_mask, other=0.0), CT).to(tl.float32)[None, :]
        acc_u += _to(tl.load(b_base + up_cols * stride_bn, mask=col_mask, other=0.0), CT).to(tl.float32)[None, :]
    h, dg, du = _glu(acc_g, acc_u, alpha, limit, ACT, CLAMP)
    h = _to(h, CT)  # what the down GEMM reads
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    tl.store(h_ptr + rows64[:, None] * stride_hm + cols[None, :], h, mask=mask)
    if not FORWARD:
        dh = tl.load(dh_ptr + rows64[:, None] * stride_dhm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # d out / d w of the row = <g, y> = <dh_u, h> + <g, down_bias>: this block's share of the first
        tl.store(dw_ptr + pid_n * stride_dwn + rows, tl.sum(dh * h.to(tl.float32), axis=1), mask=row_mask)
        dh *= tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        dgu_row = dgu_ptr + rows64[:, None] * stride_dgm
        out_ty = dgu_ptr.dtype.element_ty
        tl.store(dgu_row + gate_cols[None, :], cast_rounded(dh * dg, out_ty), mask=mask)
        tl.store(dgu_row + up_cols[None, :], cast_rounded(dh * du, out_ty), mask=mask)


@jit
def _moe_weight_grad_kernel(
    a_ptr, a_rows_ptr, b_ptr, b_rows_ptr, scale_ptr, out_ptr, bias_out_ptr, offsets_ptr,
    N, K,
    stride_am, stride_an, stride_bm, stride_bk, stride_oe, stride_on, stride_ok, stride_de, stride_dn,
    out_scale,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, HAS_SCALE: tl.constexpr, BIAS_GRAD: tl.constexpr,
    CT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[e] = out_scale * sum over expert e's sorted rows r of (scale[r] a[row_a(r)])^T b[row_b(r)],
    a block of [BLOCK_N, BLOCK_K] per program, written by strides (any layout of the weight);
    zeros for an expert without rows. BIAS_GRAD: also the column sums of scale * a -> bias_out[e]."""
    pid = tl.program_id(0)
    e = tl.program_id(1)
    k_blocks = tl.cdiv(K, BLOCK_K)
    pid_n = pid // k_blocks
    pid_k = pid % k_blocks
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = ns < N
    k_mask = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    col_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        if GATHER_A:
            a_rows = tl.load(a_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            a_rows = rows.to(tl.int64)
        if GATHER_B:
            b_rows = tl.load(b_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            b_rows = rows.to(tl.int64)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + ns[None, :] * stride_an,
                    mask=row_mask[:, None] & n_mask[None, :], other=0.0)
        if HAS_SCALE:
            a = a.to(tl.float32) * tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        a = _to(a, CT)
        if BIAS_GRAD:
            col_sum += tl.sum(a.to(tl.float32), axis=0)
        b = _to(tl.load(b_ptr + b_rows[:, None] * stride_bm + ks[None, :] * stride_bk,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0), CT)
        acc = _dot(tl.trans(a), b, acc, PRECISION)
    e64 = e.to(tl.int64)
    tl.store(out_ptr + e64 * stride_oe + ns[:, None] * stride_on + ks[None, :] * stride_ok,
             cast_rounded(acc * out_scale, out_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
    if BIAS_GRAD:
        if pid_k == 0:
            tl.store(bias_out_ptr + e64 * stride_de + ns * stride_dn,
                     cast_rounded(col_sum, bias_out_ptr.dtype.element_ty), mask=n_mask)


@jit
def _moe_combine_kernel(y_ptr, position_ptr, offsets_ptr, out_ptr, H, E, top_k, stride_ym, stride_om,
                        BLOCK_H: tl.constexpr):
    """out[t] = sum over the token's top_k slots of y[sorted position of the slot], in fp32; a slot
    whose position is past the last expert's rows (no expert) adds nothing."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    n_valid = tl.load(offsets_ptr + E)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, top_k):
        position = tl.load(position_ptr + t.to(tl.int64) * top_k + k)
        valid = (tl.zeros((BLOCK_H,), dtype=tl.int32) + position) < n_valid
        acc += tl.load(y_ptr + position.to(tl.int64) * stride_ym + cols, mask=col_mask & valid,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, cast_rounded(acc, out_ptr.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order [T*K] int32, offsets [E+1] int32): the (token, slot) pairs sorted by expert (stable),
    and where each expert's rows start; pairs with no expert (id < 0 or >= E) sort last, after
    offsets[E]. No host synchronisation."""
    flat = top_k_index.reshape(-1)
    ids = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts).to(torch.int64)
    order = torch.argsort(ids, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return order, offsets


# Launch configuration, chosen per call (`_tiles`): two sets of tile sizes, by how many rows an
# expert holds on average and by the operands' element size.
#
# Small tiles, where experts hold few rows (decode, small batches) or an operand is 4-byte (fp32
# compute, fp32 weights or hidden under autocast): BLOCK_M a power of two from 16 to 64 near the
# mean rows per expert (so decode and tiny test shapes do not pad 64-row tiles), GEMM tiles of
# 64 x 64 (K steps of 64; 32 for the gate/up kernel's two fp32 accumulators), weight-gradient
# blocks of 64 x 64 reduced 32 rows a step; 4 warps (8 for fp32 compute), 3 stages: at most
# 3 * (64 * 64 + 64 * 64) * 4 B = 96 KiB of shared memory for fp32 operands (sm_80 allows 163 KiB).
#
# Large tiles, where every operand the GEMMs stream is 2-byte and an expert holds at least
# LARGE_TILES_MIN_ROWS rows on average (a training step: Qwen3-30B-A3B at 4096 tokens holds 256):
# 128 rows x 256 columns for the plain GEMM, 128 rows x 64 gate and 64 up columns for the gate/up
# kernel, 128 x 128 weight-gradient blocks reduced 64 rows a step; 8 warps, and as many pipeline
# stages, up to 4, as the device's shared memory a block holds at LARGE_STAGE_BYTES a stage (the
# plain GEMM's (128 * 64 + 64 * 256) * 2 B, the largest): 4 on sm_90 (227 KiB), 3 on sm_80
# (163 KiB); a device that holds fewer than 3 takes the small tiles. A 64 x 64 tile loads 2 x 64
# bf16 per 2 x 64 x 64 FLOPs a K step, 32 FLOP/B of traffic from L2 to the SM; 128 x 256 does 85
# FLOP/B, 128 x 128 (gate/up, weight gradients) 64: at the Qwen3-30B-A3B step the GEMMs' L2
# traffic falls from 27 to 14 GB in the backward, padding included (docs/moe.md, "Tile sizes").
# Checked by `python -m accel_kernels.codegen` at the MoE shapes (registers, spills, shared
# memory per target).
NUM_WARPS = 4  # the small tiles' (bf16/fp16) and the combine kernel's
COMBINE_BLOCK_H = 1024
# gpt-oss's interleaved gate/up: stride-2 weight columns and the GLU backward's epilogue spill at
# 4 warps (255 registers, 112-352 B on sm_80/sm_90a at 4096 tokens); 8 warps hold them
GATE_UP_BACKWARD_INTERLEAVED_WARPS = 8
# fp32 operands ("ieee" dots, fp32 tiles in registers) spill 88-6012 B at 4 warps on sm_80/sm_90a
# at every MoE shape of the audit; 8 warps split each tile over twice the threads
FP32_WARPS = 8
#: mean sorted rows per expert from which a call with 2-byte operands takes the large tiles
LARGE_TILES_MIN_ROWS = 64
_CT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class Tiles(namedtuple("Tiles", "block_m gemm_n lora_gemm_n gemm_k gate_up_n gate_up_k grad_m grad_n grad_k "
                               "num_warps num_stages")):
    """One call's tile sizes: block_m sorted rows a GEMM tile (the tile list's unit); the plain
    GEMM's gemm_n output columns (lora_gemm_n where it adds a low-rank product, which holds a
    second accumulator) and gemm_k K step; the gate/up kernel's gate_up_n columns of gate and of
    up (half that in gpt-oss's interleaved backward) and its K step; the weight gradient's
    [grad_n, grad_k] block and its grad_m-row reduction step; the warps and pipeline stages of
    every GEMM launch."""


SMALL_TILES = Tiles(block_m=64, gemm_n=64, lora_gemm_n=64, gemm_k=64, gate_up_n=64, gate_up_k=32, grad_m=32,
                    grad_n=64, grad_k=64, num_warps=NUM_WARPS, num_stages=3)
LARGE_TILES = Tiles(block_m=128, gemm_n=256, lora_gemm_n=128, gemm_k=64, gate_up_n=64, gate_up_k=64, grad_m=64,
                    grad_n=128, grad_k=128, num_warps=8, num_stages=4)
#: shared memory a stage of the large tiles' widest launch holds (the plain GEMM's bf16 operands)
LARGE_STAGE_BYTES = (LARGE_TILES.block_m * LARGE_TILES.gemm_k + LARGE_TILES.gemm_k * LARGE_TILES.gemm_n) * 2


def _tiles(rows: int, experts: int, ct: torch.dtype, operand_bytes: int, device: torch.device) -> Tiles:
    """The tile sizes of a call with `rows` sorted rows over `experts` in compute dtype ct, whose
    widest streamed operand has `operand_bytes` bytes an element, on `device` (see the launch
    configuration)."""
    if ct != torch.float32 and operand_bytes <= 2 and rows // max(1, experts) >= LARGE_TILES_MIN_ROWS:
        shared = _shared_memory(device)
        stages = LARGE_TILES.num_stages if shared is None else min(LARGE_TILES.num_stages, shared // LARGE_STAGE_BYTES)
        if stages >= 3:
            return LARGE_TILES._replace(num_stages=stages)
    return SMALL_TILES._replace(block_m=_block_m(rows, experts),
                                num_warps=FP32_WARPS if ct == torch.float32 else NUM_WARPS)


def _shared_memory(device: torch.device) -> Optional[int]:
    """The bytes of shared memory a block may use on a CUDA device; None off CUDA (the
    interpreter, which has no such limit)."""
    if device.type != "cuda":
        return None
    return _cuda_shared_memory(torch.cuda.current_device() if device.index is None else device.index)


_SHARED: dict = {}


def _cuda_shared_memory(index: int) -> int:
    """Read once per device; a device not read yet counts as none (small tiles) if asked while
    torch.compile traces, when no cache is written (the site and the op do not ask then)."""
    if index not in _SHARED:
        if torch.compiler.is_compiling():
            return 0
        props = torch.cuda.get_device_properties(index)
        _SHARED[index] = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
    return _SHARED[index]


def _block_m(rows: int, experts: int) -> int:
    return max(16, min(64, _launch.next_power_of_2(max(1, rows // max(1, experts)))))


def _block(n: int, most: int) -> int:
    return max(16, min(most, _launch.next_power_of_2(n)))


def _meta(ct: torch.dtype, tiles: Tiles) -> dict:
    return dict(CT=_CT[ct], PRECISION="ieee" if ct == torch.float32 else "tf32",
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def _rank_block(rank: int) -> int:
    return max(16, _launch.next_power_of_2(rank))


class _Routing:
    """What every launch of one call shares: the sorted rows' tokens, positions and weights, and
    the tile list (`tile_expert`, `tile_row`: expert and first sorted row of each program's tile;
    E for a program without one). No host synchronisation: the grid is the bound
    cdiv(rows, BLOCK_M) + E on the number of tiles."""

    def __init__(self, order, offsets, top_k_weights, experts, ct, operand_bytes):
        T, K = top_k_weights.shape
        self.rows, self.top_k, self.experts = T * K, K, experts
        self.order, self.offsets = order, offsets
        self.tokens = torch.div(order, K, rounding_mode="floor").to(torch.int32)
        self.weights = top_k_weights.reshape(-1)[order.long()]
        # position[slot]: the sorted row of each (token, slot) pair
        self.position = torch.empty_like(order).scatter_(
            0, order.long(), torch.arange(self.rows, dtype=torch.int32, device=order.device))
        self.tiles = _tiles(self.rows, experts, ct, operand_bytes, order.device)
        self.block_m = self.tiles.block_m
        counts = offsets.diff()
        per_expert = torch.div(counts + (self.block_m - 1), self.block_m, rounding_mode="floor")  # tiles of each
        ends = torch.cumsum(per_expert, 0)
        self.grid_m = _launch.cdiv(self.rows, self.block_m) + experts
        pid = torch.arange(self.grid_m, device=order.device, dtype=ends.dtype)
        expert = torch.searchsorted(ends, pid, right=True)
        clamped = expert.clamp(max=experts - 1)
        self.tile_row = (offsets[:-1].long()[clamped] + (pid - (ends - per_expert)[clamped]) * self.block_m).to(torch.int32)
        self.tile_expert = expert.to(torch.int32)


def _gemm(a, r: _Routing, w, out_cols: int, ct, *, gather=False, bias=None, scale=None, lora=None,
          lora_scale=0.0) -> torch.Tensor:
    """[rows, out_cols] in ct: each sorted row of a (a[token] when gather) times its expert's w
    ([E, in, out] view), + lora_scale * la[row] @ lb[e] (lora = (la [rows, rank], lb [E, rank, out]
    view)), + bias[e] ([E, out]), * scale[row]."""
    out = _dispatch.empty((r.rows, out_cols), dtype=ct, device=a.device)
    la, lb = lora if lora is not None else (a, w)
    rank = la.shape[1] if lora is not None else 1
    block_n = _block(out_cols, r.tiles.gemm_n if lora is None else r.tiles.lora_gemm_n)
    grid = (r.grid_m, _launch.cdiv(out_cols, block_n))
    _launch.launch(
        _moe_gemm_kernel, grid, a, r.tokens, w, bias if bias is not None else w,
        scale if scale is not None else r.weights, la, lb, out, r.tile_expert, r.tile_row, r.offsets,
        out_cols, a.shape[1], r.experts, rank,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
        *(bias.stride() if bias is not None else (0, 0)), la.stride(0), la.stride(1),
        *(lb.stride() if lora is not None else (0, 0, 0)), out.stride(0), out.stride(1), float(lora_scale),
        GATHER=gather, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, LORA=lora is not None,
        R=_rank_block(rank), BLOCK_M=r.block_m, BLOCK_N=block_n, BLOCK_K=_block(a.shape[1], r.tiles.gemm_k),
        **_meta(ct, r.tiles))
    return out


def _gate_up(hidden, r: _Routing, p: "_Params", xa, *, dh=None) -> tuple:
    """The gate/up GEMM with the GLU in its epilogue: h [rows, I] (ct); with dh (backward) also
    dgu [rows, 2I] (ct) and the partial routing-weight gradients [column blocks, rows] fp32."""
    I, H = p.intermediate, hidden.shape[1]
    w = p.in_out(p.gate_up)
    h = _dispatch.empty((r.rows, I), dtype=p.ct, device=hidden.device)
    forward = dh is None
    block_n = _block(I, r.tiles.gate_up_n if forward or not p.interleaved else r.tiles.gate_up_n // 2)
    n_blocks = _launch.cdiv(I, block_n)
    dgu = h if forward else _dispatch.empty((r.rows, 2 * I), dtype=p.ct, device=hidden.device)
    dw = h if forward else _dispatch.empty((n_blocks, r.rows), dtype=torch.float32, device=hidden.device)
    bias = p.gate_up_bias
    lb = p.gate_up_lora_b.transpose(1, 2) if xa is not None else None  # [E, r, 2I]
    rank = xa.shape[1] if xa is not None else 1
    col_mult, up_offset = (2, 1) if p.interleaved else (1, I)
    _launch.launch(
        _moe_gate_up_kernel, (r.grid_m, n_blocks), hidden, r.tokens, w, bias if bias is not None else w,
        xa if xa is not None else h, lb if lb is not None else w, h, dh if dh is not None else h, r.weights, dgu, dw,
        r.tile_expert, r.tile_row, r.offsets, I, H, r.experts, rank, col_mult, up_offset,
        hidden.stride(0), hidden.stride(1), w.stride(0), w.stride(1), w.stride(2),
        *(bias.stride() if bias is not None else (0, 0)),
        *(xa.stride() if xa is not None else (0, 0)), *(lb.stride() if lb is not None else (0, 0, 0)),
        h.stride(0), dh.stride(0) if dh is not None else 0, dgu.stride(0), dw.stride(0) if not forward else 0,
        float(p.gate_up_scaling), float(p.alpha), float(p.limit),
        ACT=p.act, CLAMP=p.clamp, FORWARD=forward, HAS_BIAS=bias is not None, LORA=xa is not None, R=_rank_block(rank),
        BLOCK_M=r.block_m, BLOCK_N=block_n, BLOCK_K=_block(H, r.tiles.gate_up_k),
        **dict(_meta(p.ct, r.tiles),
               **({} if forward or not p.interleaved else
                  {"num_warps": max(r.tiles.num_warps, GATE_UP_BACKWARD_INTERLEAVED_WARPS)})))
    return (h,) if forward else (h, dgu, dw)


def _weight_grad(a, b, r: _Routing, like: torch.Tensor, layout: tuple[int, int], ct, *, gather_a=False,
                 gather_b=False, scale=None, out_scale=1.0, bias_like=None):
    """Per expert e: out_scale * (scale * a_e)^T b_e, [E, n, k] for a [rows, n], b [rows, k] (a or b
    read by token when gathered), written into a tensor shaped and typed like `like` whose dims
    `layout` = (dim of n, dim of k); and with bias_like the column sums of scale * a per expert."""
    out = _dispatch.empty(like.shape, dtype=like.dtype, device=a.device)
    N, K = a.shape[1], b.shape[1]
    bias = _dispatch.empty(bias_like.shape, dtype=bias_like.dtype, device=a.device) if bias_like is not None else None
    block_n, block_k = _block(N, r.tiles.grad_n), _block(K, r.tiles.grad_k)
    grid = (_launch.cdiv(N, block_n) * _launch.cdiv(K, block_k), r.experts)
    _launch.launch(
        _moe_weight_grad_kernel, grid, a, r.tokens, b, r.tokens, scale if scale is not None else r.weights, out,
        bias if bias is not None else out, r.offsets, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(layout[0]), out.stride(layout[1]), *(bias.stride() if bias is not None else (0, 0)),
        float(out_scale), GATHER_A=gather_a, GATHER_B=gather_b, HAS_SCALE=scale is not None,
        BIAS_GRAD=bias is not None, BLOCK_M=r.tiles.grad_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **_meta(ct, r.tiles))
    return out, bias


def _combine(y, r: _Routing, T: int, dtype) -> torch.Tensor:
    """[T, H] in dtype: each token's slots of y (sorted rows) summed in fp32."""
    H = y.shape[1]
    out = _dispatch.empty((T, H), dtype=dtype, device=y.device)
    block_h = min(COMBINE_BLOCK_H, _launch.next_power_of_2(H))
    _launch.launch(_moe_combine_kernel, (T, _launch.cdiv(H, block_h)), y, r.position, r.offsets, out, H, r.experts,
                   r.top_k, y.stride(0), out.stride(0), BLOCK_H=block_h, num_warps=NUM_WARPS)
    return out


# --------------------------------------------------------------------------------------------
# The plan: forward and backward written once, over two sets of primitives with one interface,
# Triton launches (_TritonOps) and the plain-torch twin (_TorchOps)
# --------------------------------------------------------------------------------------------

# the gradients the backward op returns, in the order of the forward op's tensor inputs that have one
_GRADS = ("hidden", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias", "gate_up_lora_a",
          "gate_up_lora_b", "down_lora_a", "down_lora_b")
#: Which of _GRADS a backward computes, by name.
_Needs = namedtuple("_Needs", _GRADS)


def _ops(path, order, offsets, top_k_weights, p, *streamed):
    """The primitives of one call: `path`'s (_TritonOps or _TorchOps); a call without tokens runs
    the twin (no launch has rows). `streamed`: the activations the GEMMs read besides the weights
    (hidden, and the upstream gradient in backward), whose widest dtype with the weights' picks
    the Triton path's tiles."""
    if path is _TritonOps and top_k_weights.shape[0] == 0:
        path = _TorchOps
    if isinstance(path, type) and issubclass(path, _TritonOps):
        widest = max(t.element_size() for t in (p.gate_up, p.down, *streamed))
        return path(order, offsets, top_k_weights, p, widest)
    return path(order, offsets, top_k_weights, p)


def _forward(hidden, top_k_weights, order, offsets, p, path, save: bool = False):
    """(out [T, H] in hidden's dtype, the fp32 gate/up pre-activations [T*K, 2I] of the sorted rows
    where `save` asks and the path keeps them (the twin), else None)."""
    T = hidden.shape[0]
    ops = _ops(path, order, offsets, top_k_weights, p, hidden)
    xa = ops.gemm(hidden, p.gate_up_lora_a.transpose(1, 2), gather=True) if p.gate_up_lora_a is not None else None
    h, saved = ops.gate_up(hidden, xa, save)
    del xa
    lora = None
    if p.down_lora_a is not None:  # (h A_e^T, B_e^T, s)
        lora = (ops.gemm(h, p.down_lora_a.transpose(1, 2)), p.down_lora_b.transpose(1, 2), p.down_scaling)
    y = ops.gemm(h, p.in_out(p.down), bias=p.down_bias, scaled=True, lora=lora)
    del h, lora
    return ops.combine(y, T, hidden.dtype), saved


def _backward(grad_out, hidden, top_k_weights, order, offsets, p, needs, path, saved=None):
    """The gradients named by _GRADS (None where not needed), by the math of the module docstring;
    gate/up read from `saved` (what the twin's forward kept) where given, else recomputed. What is
    held at once: the sorted rows' h [rows, I] and dgu [rows, 2I], with one [rows, H] product (or
    gathered operand) at a time; x and g are gathered where a product reads them, never kept."""
    needs = _Needs(*needs)
    T, K = top_k_weights.shape
    ops = _ops(path, order, offsets, top_k_weights, p, hidden, grad_out)
    grads = dict.fromkeys(_GRADS)
    # dh = g down_e^T (+ s (g B_e) A_e): the upstream gradient at act(gate, up), before the routing weight
    g_b = down_lora = None
    if p.down_lora_a is not None:
        g_b = ops.gemm(grad_out, p.down_lora_b, gather=True)  # g B_e [rows, r]
        down_lora = (g_b, p.down_lora_a, p.down_scaling)
    dh = ops.gemm(grad_out, p.in_out(p.down).transpose(1, 2), gather=True, lora=down_lora)
    del down_lora
    xa = ops.gemm(hidden, p.gate_up_lora_a.transpose(1, 2), gather=True) if p.gate_up_lora_a is not None else None
    h, dgu, dw = ops.gate_up_backward(hidden, xa, dh, saved)  # dw = <dh, h> per row, fp32
    del dh
    if needs.top_k_weights:
        if p.down_bias is not None:  # + <g, down_bias_e>
            dw = dw + ops.bias_dots(grad_out, p.down_bias)
        grads["top_k_weights"] = ops.per_slot(dw).view(T, K).to(top_k_weights.dtype)
    del dw
    dgu_b = None
    if p.gate_up_lora_a is not None and (needs.hidden or needs.gate_up_lora_a):
        dgu_b = ops.gemm(dgu, p.gate_up_lora_b)  # dgu B_e [rows, r]
    if needs.hidden:
        lora = (dgu_b, p.gate_up_lora_a, p.gate_up_scaling) if p.gate_up_lora_a is not None else None
        grads["hidden"] = ops.combine(ops.gemm(dgu, p.in_out(p.gate_up).transpose(1, 2), lora=lora), T, hidden.dtype)
    layout = (2, 1) if p.transposed else (1, 2)  # where (out, in) of gate_up / down sit in their layout
    if needs.gate_up:
        grads["gate_up"], grads["gate_up_bias"] = ops.weight_grad(
            dgu, hidden, p.gate_up, layout, gather_b=True, bias_like=p.gate_up_bias if needs.gate_up_bias else None)
    elif needs.gate_up_bias:
        grads["gate_up_bias"] = ops.expert_sums(dgu).to(p.gate_up_bias.dtype)
    if needs.down:
        grads["down"], grads["down_bias"] = ops.weight_grad(
            grad_out, h, p.down, layout, gather_a=True, scaled=True, bias_like=p.down_bias if needs.down_bias else None)
    elif needs.down_bias:
        grads["down_bias"] = ops.expert_sums(ops.gathered(grad_out, scaled=True)).to(p.down_bias.dtype)
    if needs.gate_up_lora_a:  # dA = s (dgu B)^T x
        grads["gate_up_lora_a"], _ = ops.weight_grad(dgu_b, hidden, p.gate_up_lora_a, (1, 2), gather_b=True,
                                                     out_scale=p.gate_up_scaling)
    if needs.gate_up_lora_b:  # dB = s dgu^T (x A^T)
        grads["gate_up_lora_b"], _ = ops.weight_grad(dgu, xa, p.gate_up_lora_b, (1, 2), out_scale=p.gate_up_scaling)
    del dgu, dgu_b, xa
    if needs.down_lora_a:  # dA = s (w g B)^T h
        grads["down_lora_a"], _ = ops.weight_grad(g_b, h, p.down_lora_a, (1, 2), scaled=True,
                                                  out_scale=p.down_scaling)
    if needs.down_lora_b:  # dB = s (w g)^T (h A^T)
        h_a = ops.gemm(h, p.down_lora_a.transpose(1, 2))
        grads["down_lora_b"], _ = ops.weight_grad(grad_out, h_a, p.down_lora_b, (1, 2), gather_a=True, scaled=True,
                                                  out_scale=p.down_scaling)
    return tuple(grads[name] for name in _GRADS)


class _TritonOps:
    """The plan's primitives as launches over every sorted row (T*K: the rows past offsets[E] are
    "no expert" slots, which the kernels skip). No host synchronisation."""

    acc = torch.float32

    def __init__(self, order, offsets, top_k_weights, p, operand_bytes=2):
        self.p, self.r = p, _Routing(order, offsets, top_k_weights, p.num_experts, p.ct, operand_bytes)

    def gemm(self, a, w, *, gather=False, bias=None, scaled=False, lora=None):
        """[rows, out] in ct: each sorted row of `a` (a[token] when gather) times its expert's w
        ([E, in, out] view), + s * la[row] @ lb[e] (lora = (la [rows, rank], lb [E, rank, out]
        view), s)), + bias[e], times the routing weight where `scaled`."""
        return _gemm(a, self.r, w, w.shape[2], self.p.ct, gather=gather, bias=bias,
                     scale=self.r.weights if scaled else None, lora=lora and lora[:2],
                     lora_scale=lora[2] if lora else 0.0)

    def gate_up(self, hidden, xa, save=False):
        """(h = act(gate, up) [rows, I] in ct, None): the gate/up GEMM with the GLU in its epilogue
        writes no gate/up, so there is none to save."""
        return _gate_up(hidden, self.r, self.p, xa)[0], None

    def gate_up_backward(self, hidden, xa, dh, saved=None):
        """(h, dgu [rows, 2I] in ct, dw [rows] fp32): gate/up recomputed with the GLU backward of
        w * dh in the same kernel."""
        h, dgu, dw_part = _gate_up(hidden, self.r, self.p, xa, dh=dh)
        return h, dgu, dw_part.sum(0)

    def combine(self, y, T: int, dtype):
        return _combine(y, self.r, T, dtype)

    def weight_grad(self, a, b, like, layout, *, gather_a=False, gather_b=False, scaled=False, out_scale=1.0,
                    bias_like=None):
        """(out_scale * (w a)_e^T b_e per expert, written shaped and typed like `like`, whose dims
        `layout` = (dim of a's columns, dim of b's); with bias_like the per-expert sums of w a)."""
        return _weight_grad(a, b, self.r, like, layout, self.p.ct, gather_a=gather_a, gather_b=gather_b,
                            scale=self.r.weights if scaled else None, out_scale=out_scale, bias_like=bias_like)

    def bias_dots(self, g, bias):
        """[rows] fp32: <g[token], bias[e]> of each sorted row (through [T, E] products)."""
        biased = g.to(self.p.ct).float() @ bias.to(self.p.ct).float().t()
        return biased[self.row_tokens, self.row_experts]

    def gathered(self, a, scaled=False):
        """a's rows by token for each sorted row, in fp32, times the routing weight where `scaled`."""
        rows = a[self.r.tokens.long()].float()
        return rows * self.r.weights.float()[:, None] if scaled else rows

    @property
    def row_tokens(self):
        return self.r.tokens.long()

    @property
    def row_experts(self):
        """Each sorted row's expert (E - 1 past the last: those rows are masked by per_slot)."""
        return self._experts().clamp(max=self.p.num_experts - 1)

    def _experts(self):
        rows = torch.arange(self.r.rows, device=self.r.order.device, dtype=self.r.offsets.dtype)
        return torch.searchsorted(self.r.offsets[1:], rows, right=True)

    def per_slot(self, rows):
        """[T*K] fp32: the value of each (token, slot) pair from its sorted row (0 for no expert)."""
        valid = torch.arange(self.r.rows, device=rows.device) < self.r.offsets[-1]
        flat = torch.empty(self.r.rows, dtype=torch.float32, device=rows.device)
        return flat.scatter_(0, self.r.order.long(), torch.where(valid, rows, 0.0))

    def expert_sums(self, rows):
        """[E, cols] fp32: per expert, the sum of its sorted rows (a bias gradient)."""
        out = torch.zeros((self.p.num_experts + 1, rows.shape[1]), dtype=torch.float32, device=rows.device)
        return out.index_add_(0, self._experts(), rows.float())[:-1]


class _GroupedOps(_TritonOps):
    """The backward's GEMMs through `torch._grouped_mm` on the Triton path's tensors (the
    `grouped_mm` backward, see `backward_path`): dh, dx and every weight gradient are grouped_mm
    calls over the sorted rows (x and g gathered by token with index_select, one [rows, H] operand
    at a time), while what the Triton path fuses stays fused there: the gate/up recompute with the
    GLU backward and the routing-weight dots (one kernel), the combine, the per-slot scatter.
    A product that carries a LoRA term stays the Triton launch (the low-rank dot in the tile loop:
    on grouped_mm it would cost an fp32 [rows, H] sum), and so do the low-rank products and the
    LoRA factors' gradients (a dim under GROUPED_MIN_WIDTH: memory-bound, and the kernels gather
    x and g inside where grouped_mm needs them gathered, [rows, H] each); so does one whose
    operands grouped_mm refuses (`_grouped_mm_or_none`'s record of that kind). Rows past offsets[E] ("no expert"
    slots) are no group's: grouped_mm leaves them unwritten and the combine skips them, as on the
    Triton path. No windows: on a GPU a window would cut each grouped_mm into more launches to
    save one [rows, H] temporary (docs/moe.md counts the bytes). One host sync per call: the list
    of experts without rows, whose weight-gradient blocks are zeroed (Hopper's grouped_mm writes
    zeros there, sm_100's has been reported not to)."""

    def __init__(self, order, offsets, top_k_weights, p, operand_bytes=2):
        super().__init__(order, offsets, top_k_weights, p, operand_bytes)
        self.ends = offsets[1:].contiguous()
        self._empty = None

    def _sorted(self, a, gather):
        """a's row of each sorted row's token when `gather` (all T*K rows), else a; in ct."""
        a = torch.index_select(a, 0, self.row_tokens) if gather else a
        return a.to(self.p.ct)

    def gemm(self, a, w, *, gather=False, bias=None, scaled=False, lora=None):
        if lora is None and bias is None and not scaled and a.shape[0] and min(w.shape[1:]) >= GROUPED_MIN_WIDTH:
            x, wc = self._sorted(a, gather), w.to(self.p.ct)
            out = _grouped_mm_or_none((x.device.type, x.dtype, *_kind(x, wc)), x, wc, offs=self.ends)
            if out is not None:
                return out
        return super().gemm(a, w, gather=gather, bias=bias, scaled=scaled, lora=lora)

    def empty_experts(self) -> torch.Tensor:
        """The ids of the experts without rows (one host sync, once per call)."""
        if self._empty is None:
            self._empty = torch.nonzero(self.r.offsets.diff() == 0).flatten()
        return self._empty

    def weight_grad(self, a, b, like, layout, *, gather_a=False, gather_b=False, scaled=False, out_scale=1.0,
                    bias_like=None):
        ct = self.p.ct
        if min(a.shape[1], b.shape[1]) < GROUPED_MIN_WIDTH or not a.shape[0]:
            return super().weight_grad(a, b, like, layout, gather_a=gather_a, gather_b=gather_b, scaled=scaled,
                                       out_scale=out_scale, bias_like=bias_like)
        sa, sb = self._sorted(a, gather_a), self._sorted(b, gather_b)
        bias = None
        if bias_like is not None:  # the per-expert sums of w a, in fp32 (w a rounded to ct, as the kernel's)
            bias = self.expert_sums(self._scaled(sa) if scaled else sa).to(bias_like.dtype)
        if scaled:  # (w a)^T b = a^T (w b): the routing weight on the narrower operand (h, not g: [rows, I])
            if sa.shape[1] <= sb.shape[1]:
                sa = self._scaled(sa)
            else:
                sb = self._scaled(sb)
        # grad [E, n, k] = sa_e^T sb_e; written as `like` lays it out: for layout (2, 1) the product
        # is taken the other way round (sb_e^T sa_e), so no transposed copy of the gradient is made
        first, second = (sa, sb) if layout == (1, 2) else (sb, sa)
        at = first.t()
        grad = _grouped_mm_or_none((at.device.type, "weight_grad", ct, *_kind(at, second)), at, second,
                                   offs=self.ends)
        if grad is None:
            return super().weight_grad(a, b, like, layout, gather_a=gather_a, gather_b=gather_b, scaled=scaled,
                                       out_scale=out_scale, bias_like=bias_like)
        empty = self.empty_experts()
        if empty.numel():
            grad.index_fill_(0, empty, 0.0)
        if out_scale != 1.0:
            grad = grad.float().mul_(out_scale)
        return grad.to(like.dtype), bias

    def _scaled(self, rows):
        """w * rows in fp32, rounded once to ct (one kernel: the product is stored in ct)."""
        return torch.mul(rows, self.r.weights.float()[:, None], out=torch.empty_like(rows))


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


#: The forward op's tensor inputs in its schema's order (those named in _GRADS have a gradient), and
#: the options the backward op takes after its tensors. The two ops' argument lists, in their
#: schemas' order, are derived from them: the op definitions spell them out (torch.library infers
#: a schema from the annotations), everything else (fakes, the autograd formula) reads them by name.
_TENSORS = ("hidden", "top_k_index", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias",
            "gate_up_lora_a", "gate_up_lora_b", "down_lora_a", "down_lora_b")
_OPTIONS = ("gate_up_lora_scaling", "down_lora_scaling", "transposed", "interleaved", "activation", "alpha", "limit",
            "autocast")
_FORWARD_ARGS = _TENSORS + _OPTIONS + ("triton_path", "save_gate_up", "grouped_backward")
_BACKWARD_ARGS = ("grad_out", "hidden", "top_k_weights", "order", "offsets", "saved_gate_up") + _TENSORS[3:] + \
    _OPTIONS + ("needs", "triton_path", "grouped_backward")


def _params(named: dict) -> "_Params":
    """The _Params of one op call from its arguments by name."""
    return _Params(*(named[name] for name in _TENSORS[3:]), named["gate_up_lora_scaling"],
                   named["down_lora_scaling"], named["transposed"],
                   named["interleaved"], ACTIVATIONS[named["activation"]], named["alpha"], named["limit"],
                   _compute_dtype(named["hidden"], named["autocast"]))


@_library.custom_op("moe_experts", used=1)
def _moe_experts_op(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
    gate_up_lora_a: Optional[torch.Tensor], gate_up_lora_b: Optional[torch.Tensor],
    down_lora_a: Optional[torch.Tensor], down_lora_b: Optional[torch.Tensor], gate_up_lora_scaling: float,
    down_lora_scaling: float, transposed: bool, interleaved: bool, activation: str, alpha: float, limit: float,
    autocast: Optional[torch.dtype], triton_path: bool, save_gate_up: bool, grouped_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H] in hidden's dtype, order [T*K] int32, offsets [E+1] int32, the gate/up
    pre-activations [T*K, 2I] fp32 of the sorted rows where save_gate_up asks (the twin), else
    (0,)); autocast: the compute dtype (None: hidden's); grouped_backward: the backward's GEMMs
    through torch._grouped_mm (`backward_path`), read by the backward only."""
    params = _params(locals())
    order, offsets = _route(top_k_index, gate_up.shape[0])
    if triton_path:
        out, saved = _forward(hidden, top_k_weights, order, offsets, params, _TritonOps)
    else:
        out, saved = _twin_forward(hidden, top_k_weights, order, offsets, params, save_gate_up)
    return out, order, offsets, saved if saved is not None else _library.nothing(hidden, torch.float32)


@_moe_experts_op.register_fake
def _(*args):
    a = dict(zip(_FORWARD_ARGS, args))
    hidden, index, down = a["hidden"], a["top_k_index"], a["down"]
    rows, width = index.numel(), 2 * (down.shape[1] if a["transposed"] else down.shape[2])
    acc = _accumulation(hidden.dtype)
    saved = (hidden.new_empty((rows, width), dtype=acc) if a["save_gate_up"] and not a["triton_path"]
             else _library.nothing(hidden, torch.float32))
    return (hidden.new_empty(hidden.shape), index.new_empty((rows,), dtype=torch.int32),
            index.new_empty((a["gate_up"].shape[0] + 1,), dtype=torch.int32), saved)


@_library.custom_op("moe_experts_backward")
def _moe_experts_backward_op(
    grad_out: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor,
    offsets: torch.Tensor, saved_gate_up: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor], gate_up_lora_a: Optional[torch.Tensor],
    gate_up_lora_b: Optional[torch.Tensor], down_lora_a: Optional[torch.Tensor],
    down_lora_b: Optional[torch.Tensor], gate_up_lora_scaling: float, down_lora_scaling: float,
    transposed: bool, interleaved: bool,
    activation: str, alpha: float, limit: float, autocast: Optional[torch.dtype], needs: list[bool],
    triton_path: bool, grouped_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients named by _GRADS, each in its input's dtype and shape where `needs` (one bool
    each, in that order) asks for it and the input exists, else (0,). saved_gate_up: what the
    forward saved ((0,): nothing, gate/up are recomputed)."""
    named = dict(locals())
    params = _params(named)
    needs = tuple(bool(n) and named[name] is not None for n, name in zip(needs, _GRADS))
    saved = saved_gate_up if saved_gate_up.numel() and not triton_path else None
    if triton_path:
        grads = _backward(grad_out, hidden, top_k_weights, order, offsets, params, needs,
                          _GroupedOps if grouped_backward else _TritonOps)
    else:
        grads = _twin_backward(grad_out, hidden, top_k_weights, order, offsets, params, needs, saved)
    return tuple(g.contiguous() if g is not None else _library.nothing(hidden) for g in grads)


@_moe_experts_backward_op.register_fake
def _(*args):
    a = dict(zip(_BACKWARD_ARGS, args))
    return tuple(a[name].new_empty(a[name].shape) if n and a[name] is not None else _library.nothing(a["hidden"])
                 for n, name in zip(a["needs"], _GRADS))


def _setup_context(ctx, inputs, output):
    named = dict(zip(_FORWARD_ARGS, inputs))
    _, order, offsets, saved = output
    named.update(order=order, offsets=offsets, saved_gate_up=saved)
    # x, the routing weights and the sort; gate/up only where the caller asked to save them (else
    # (0,)); the weights by reference: the backward op's tensors after grad_out, in its order
    ctx.save_for_backward(*(named[name] for name in _BACKWARD_SAVED))
    ctx.options = {name: named[name] for name in _OPTIONS + ("triton_path", "grouped_backward")}
    ctx.set_materialize_grads(False)


#: The backward op's tensor arguments that autograd saves (all but grad_out).
_BACKWARD_SAVED = _BACKWARD_ARGS[1:_BACKWARD_ARGS.index(_OPTIONS[0])]


def _autograd_backward(ctx, grad_out, *_unused):
    _dispatch.check_first_order("moe_experts")
    needs = [ctx.needs_input_grad[_TENSORS.index(name)] for name in _GRADS]
    if grad_out is None or not any(needs):
        return (None,) * len(ctx.needs_input_grad)
    named = dict(zip(_BACKWARD_SAVED, ctx.saved_tensors), grad_out=grad_out, needs=needs, **ctx.options)
    grads = _moe_experts_backward_op.backward_call(ctx, *(named[name] for name in _BACKWARD_ARGS))
    by_name = {name: grad if need else None for name, grad, need in zip(_GRADS, grads, needs)}
    return tuple(by_name.get(name) for name in _TENSORS) + (None,) * (len(ctx.needs_input_grad) - len(_TENSORS))


_moe_experts_op.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


class _Params:
    """The experts' weights and options of one call, with the math views the paths share:
    every weight as [E, in, out] (y = x @ w[e])."""

    def __init__(self, gate_up, down, gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b, down_lora_a,
                 down_lora_b, gate_up_scaling, down_scaling, transposed, interleaved, act, alpha, limit,
                 compute_dtype):
        self.gate_up, self.down, self.gate_up_bias, self.down_bias = gate_up, down, gate_up_bias, down_bias
        self.gate_up_lora_a, self.gate_up_lora_b = gate_up_lora_a, gate_up_lora_b
        self.down_lora_a, self.down_lora_b = down_lora_a, down_lora_b
        self.gate_up_scaling, self.down_scaling = gate_up_scaling, down_scaling
        self.transposed, self.interleaved = transposed, interleaved
        self.act, self.alpha, self.limit, self.ct = act, alpha, limit, compute_dtype
        self.clamp = act != GPT_OSS and math.isfinite(limit)  # the clamped SwiGLU (gpt-oss clamps always)
        self.num_experts = gate_up.shape[0]
        self.intermediate = down.shape[1] if transposed else down.shape[2]

    @property
    def unclamped(self) -> "_Params":
        """These parameters without the SwiGLU clamp (its gradient is applied around them)."""
        other = object.__new__(_Params)
        other.__dict__.update(self.__dict__, clamp=False)
        return other

    def in_out(self, w: torch.Tensor) -> torch.Tensor:
        """gate_up or down as [E, in, out]."""
        return w if self.transposed else w.transpose(1, 2)

    def window(self, first: int, end: int) -> "_Params":
        """These parameters for the experts first..end - 1 alone (views: every per-expert tensor
        has its expert dim first)."""
        other = object.__new__(_Params)
        other.__dict__.update(self.__dict__, num_experts=end - first)
        for name in _EXPERT_TENSORS:
            tensor = getattr(self, name)
            setattr(other, name, tensor[first:end] if tensor is not None else None)
        return other


#: The per-expert tensors of a call (expert dim first), which a window slices.
_EXPERT_TENSORS = ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_lora_a", "gate_up_lora_b",
                   "down_lora_a", "down_lora_b")


def _accumulation(ct: torch.dtype) -> torch.dtype:
    """The twin's accumulation dtype for compute dtype ct: float64 stays, everything else fp32."""
    return torch.float64 if ct == torch.float64 else torch.float32


def _compute_dtype(hidden: torch.Tensor, autocast: Optional[torch.dtype]) -> torch.dtype:
    return autocast if autocast is not None and hidden.dtype != torch.float64 else hidden.dtype


# Whether torch._grouped_mm takes operands of a kind (device type, dtype, 16-byte aligned, which of
# each operand's two last dims is contiguous): it wants 16-byte strides, a row- or column-major
# matrix per group, and float32/bf16/fp16 (torch >= 2.9 on CPU). The first failure of a kind is
# recorded, so an unsupported set-up pays one raised error, not one per call; a loop over the
# experts does the rest.
_GROUPED_MM: dict = {}


def _kind(*tensors: torch.Tensor) -> tuple:
    """(16-byte aligned: every operand starts on 16 bytes and steps 16-byte multiples along its
    non-unit strides; per operand, whether its last and its second-to-last dim are contiguous)."""
    aligned = all(not (t.data_ptr() % 16 or any((st * t.element_size()) % 16
                                                 for st, n in zip(t.stride(), t.shape) if st != 1 and n > 1))
                  for t in tensors)
    return (aligned, *((t.stride(-1) == 1, t.stride(-2) == 1) for t in tensors))


def _grouped_mm_or_none(key, *args, **kwargs):
    """torch._grouped_mm(*args) where operands of this kind were not refused before, else None."""
    if not hasattr(torch, "_grouped_mm") or not _GROUPED_MM.get(key, True):
        return None
    try:
        out = torch._grouped_mm(*args, **kwargs)
    except (RuntimeError, NotImplementedError, TypeError):
        _GROUPED_MM[key] = False
        return None
    _GROUPED_MM[key] = True
    return out


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: list[int], ends: torch.Tensor) -> torch.Tensor:
    """rows of expert e (x sorted by expert, counts[e] rows each) times w[e] ([E, in, out])."""
    if x.shape[0]:
        out = _grouped_mm_or_none((x.device.type, x.dtype, *_kind(x, w)), x, w, offs=ends)
        if out is not None:
            return out
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[2]))


def _grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, counts: list[int], ends: torch.Tensor) -> torch.Tensor:
    """[E, p, q]: a_e^T b_e for the rows of each expert (zeros for an expert without rows), fp32."""
    a, b = a.float(), b.float()
    if a.shape[0]:
        at = a.t()
        out = _grouped_mm_or_none((a.device.type, "weight_grad", *_kind(at, b)), at, b, offs=ends)
        if out is not None:
            # an expert without rows: grouped_mm leaves its block as it finds it
            return out.masked_fill_((ends.diff(prepend=ends.new_zeros(1)) == 0)[:, None, None], 0.0)
    out = a.new_zeros((len(counts), a.shape[1], b.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[e] = a[start:start + c].t() @ b[start:start + c]
        start += c
    return out


def _act_torch(gate, up, p: _Params):
    """act(gate, up) on fp32 (or float64) gate and up."""
    if p.clamp:
        gate, up = gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit)
    if p.act == GPT_OSS:
        g, u = gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit)
        return (u + 1) * g * torch.sigmoid(p.alpha * g)
    if p.act == GELU_ERF:
        return 0.5 * gate * (1 + torch.erf(gate * 0.7071067811865476)) * up
    if p.act == GELU_TANH:
        return gate * torch.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate ** 3)) * up
    return torch.nn.functional.silu(gate) * up  # one fused pass (x * sigmoid(x) is three)


def _act_backward_torch(gate, up, dh, p: _Params):
    """(dgate, dup) for upstream dh, fp32 (or float64)."""
    if p.clamp:  # the clamps' gradient: 0 where they clamp (inclusive bounds, as torch's clamp)
        gate_in, up_in = gate, up
        dgate, dup = _act_backward_torch(gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit), dh, p.unclamped)
        return dgate * (gate_in <= p.limit), dup * ((up_in >= -p.limit) & (up_in <= p.limit))
    if p.act == SILU:  # aten's fused SiLU gradient, as stock's autograd takes it
        return torch.ops.aten.silu_backward(dh * up, gate), dh * torch.nn.functional.silu(gate)
    if p.act == GPT_OSS:
        g, u = gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit)
        s = torch.sigmoid(p.alpha * g)
        glu = g * s
        dglu = s + p.alpha * g * s * (1 - s)
        dgate = dh * (u + 1) * dglu * (gate <= p.limit)
        dup = dh * glu * ((up >= -p.limit) & (up <= p.limit))
        return dgate, dup
    if p.act == GELU_ERF:
        cdf = 0.5 * (1 + torch.erf(gate * 0.7071067811865476))
        a = gate * cdf
        da = cdf + gate * 0.3989422804014327 * torch.exp(-0.5 * gate * gate)
    else:
        z = 1.5957691216057308 * (gate + 0.044715 * gate ** 3)
        dz = 1.5957691216057308 * (1 + 0.134145 * gate * gate)
        s = torch.sigmoid(z)
        a = gate * s
        da = s + gate * s * (1 - s) * dz
    return dh * up * da, dh * a


def _split_gate_up(gu: torch.Tensor, p: _Params):
    if p.interleaved:
        return gu[:, 0::2], gu[:, 1::2]
    return gu[:, :p.intermediate], gu[:, p.intermediate:]


def _join_gate_up(dgate: torch.Tensor, dup: torch.Tensor, p: _Params) -> torch.Tensor:
    if p.interleaved:
        return torch.stack((dgate, dup), dim=-1).flatten(-2)
    return torch.cat((dgate, dup), dim=-1)


class _TorchOps:
    """The plan's primitives on the twin, over the valid sorted rows only (their count read on the
    host: the twin runs on the CPU, where a sync costs nothing). The same roundings as the
    kernels': products accumulate in fp32 (float64 stays) and come back in the compute dtype."""

    def __init__(self, order, offsets, top_k_weights, p, into=None):
        T, K = top_k_weights.shape
        self.p, self.slots_total, self.into = p, T * K, into
        self.acc = _accumulation(p.ct)
        self.rows = int(offsets[-1])
        self.slots = order[:self.rows].long()
        self.row_tokens = self.slots // K
        self.counts = offsets.diff().tolist()
        self.ends = offsets[1:].contiguous()
        self.row_experts = torch.repeat_interleave(torch.arange(len(self.counts), device=order.device),
                                                   offsets.diff().long(), output_size=self.rows)
        self.weights = top_k_weights.reshape(-1)[self.slots].to(self.acc)[:, None]

    def _rows(self, a, gather):
        """a's row of each sorted row's token when `gather` (index_select: 1.5x aten::index's speed
        at [32768, 512] on the CPU), else a."""
        return torch.index_select(a, 0, self.row_tokens) if gather else a

    def gemm(self, a, w, *, gather=False, bias=None, scaled=False, lora=None):
        p = self.p
        out = _grouped(self._rows(a, gather).to(p.ct), w.to(p.ct), self.counts, self.ends)
        if lora is None and bias is None and not scaled:
            return out
        out = out.to(self.acc)
        if lora is not None:
            out.add_(_grouped(lora[0].to(p.ct), lora[1].to(p.ct), self.counts, self.ends), alpha=lora[2])
        if bias is not None:
            out += bias.to(p.ct)[self.row_experts].to(self.acc)
        if scaled:
            out *= self.weights
        return out.to(p.ct)

    def _gate_up_rows(self, hidden, xa) -> torch.Tensor:
        """The gate/up pre-activations [rows, 2I] in fp32 (float64 stays)."""
        p = self.p
        gu = _grouped(self._rows(hidden, True).to(p.ct), p.in_out(p.gate_up).to(p.ct), self.counts,
                      self.ends).to(self.acc)
        if xa is not None:
            gu.add_(_grouped(xa, p.gate_up_lora_b.to(p.ct).transpose(1, 2), self.counts, self.ends),
                    alpha=p.gate_up_scaling)
        if p.gate_up_bias is not None:
            gu += p.gate_up_bias.to(p.ct)[self.row_experts].to(self.acc)
        return gu

    def gate_up(self, hidden, xa, save=False):
        """(h [rows, I] in ct, the rows' gate/up [rows, 2I] fp32 when `save`, else None)."""
        gu = self._gate_up_rows(hidden, xa)
        h = _act_torch(*_split_gate_up(gu, self.p), self.p).to(self.p.ct)
        return h, (gu if save else None)

    def gate_up_backward(self, hidden, xa, dh, saved=None):
        p = self.p
        gu = saved[:self.rows] if saved is not None else self._gate_up_rows(hidden, xa)
        gate, up = _split_gate_up(gu, p)
        h = _act_torch(gate, up, p).to(p.ct)
        dh = dh.to(self.acc)
        dw = (dh * h.to(self.acc)).sum(-1)
        dgate, dup = _act_backward_torch(gate, up, dh * self.weights, p)
        del gate, up, gu, dh
        return h, _join_gate_up(dgate, dup, p).to(p.ct), dw

    def combine(self, y, T: int, dtype):
        """[T, H] in dtype: each token's rows of y summed in the accumulation dtype; with `into`
        (a window's call) added to that accumulator, returned in its dtype, for the caller to round
        once after the last window."""
        if self.into is not None:
            return self.into.index_add_(0, self.row_tokens, y.to(self.acc))
        out = torch.zeros((T, y.shape[1]), dtype=self.acc, device=y.device)
        return out.index_add_(0, self.row_tokens, y.to(self.acc)).to(dtype)

    def weight_grad(self, a, b, like, layout, *, gather_a=False, gather_b=False, scaled=False, out_scale=1.0,
                    bias_like=None):
        a = self._rows(a, gather_a)
        if scaled:
            a = a.to(self.acc) * self.weights
        grad = _grouped_weight_grad(a, self._rows(b, gather_b), self.counts, self.ends)
        if out_scale != 1.0:
            grad = grad * out_scale
        grad = (grad if layout == (1, 2) else grad.transpose(1, 2)).to(like.dtype).contiguous()
        bias = self.expert_sums(a).to(bias_like.dtype) if bias_like is not None else None
        return grad, bias

    def bias_dots(self, g, bias):
        """[rows]: <g[token], bias[e]> of each sorted row, one row at a time (a [T, E] product's
        rounding would depend on how many experts a window holds)."""
        rows = self._rows(g.to(self.p.ct), True).to(self.acc)
        return (rows * bias.to(self.p.ct)[self.row_experts].to(self.acc)).sum(-1)

    def gathered(self, a, scaled=False):
        rows = self._rows(a, True).to(self.acc)
        return rows * self.weights if scaled else rows

    def per_slot(self, rows):
        flat = torch.zeros(self.slots_total, dtype=rows.dtype, device=rows.device)
        return flat.index_put_((self.slots,), rows)

    def expert_sums(self, rows):
        out = torch.zeros((self.p.num_experts, rows.shape[1]), dtype=self.acc, device=rows.device)
        return out.index_add_(0, self.row_experts, rows.to(self.acc))


#: The twin runs a call in windows of whole experts, each holding sorted rows of at most this many
#: bytes per [rows, max(H, 2I)] product in the accumulation dtype (one expert at least): the
#: forward's and the backward's temporaries are a window's, not the call's. On the CPU a grouped
#: GEMM is a loop over the experts, so a window changes no product's size, and every per-token sum
#: accumulates into one buffer in the same order: the results are the unwindowed ones up to the
#: rounding torch's CPU kernels tie to a tensor's length and addresses (within float32's bound).
#: 8 MiB: at the benchmark's MoE shape (4096 tokens, top-8, H 512, 32 experts) eight windows of
#: four experts; against 16 MiB, 29 and 27 MiB less peak growth in its checkpointed LoRA and full
#: steps, the block's time unchanged within its runs' spread (BENCHMARKS.md).
TWIN_WINDOW_BYTES = 8 << 20


def _windows(offsets: torch.Tensor, p: _Params, hidden: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first expert, end expert, first row, end row) of each window, in expert order."""
    ends = offsets.tolist()
    element = _accumulation(p.ct).itemsize
    most = max(1, TWIN_WINDOW_BYTES // (max(hidden.shape[1], 2 * p.intermediate) * element))
    windows, first = [], 0
    for e in range(1, p.num_experts):
        if ends[e + 1] - ends[first] > most:
            windows.append((first, e, ends[first], ends[e]))
            first = e
    windows.append((first, p.num_experts, ends[first], ends[p.num_experts]))
    return windows


def _window_args(order, offsets, p, window):
    """(order, offsets, params) of one window: its sorted rows, offsets from its first row."""
    first, end, row, row_end = window
    return order[row:row_end], offsets[first:end + 1] - row, p.window(first, end)


def _twin_forward(hidden, top_k_weights, order, offsets, p, save: bool):
    """_forward on the twin, window by window: (out, gate/up [T*K, 2I] fp32 where `save`, the
    rows of "no expert" slots zeros, as the op's schema says, else None)."""
    T, K = top_k_weights.shape
    acc = _accumulation(p.ct)
    out = torch.zeros((T, hidden.shape[1]), dtype=acc, device=hidden.device)
    saved = hidden.new_zeros((T * K, 2 * p.intermediate), dtype=acc) if save else None
    for window in _windows(offsets, p, hidden):
        _, gate_up = _forward(hidden, top_k_weights, *_window_args(order, offsets, p, window),
                              functools.partial(_TorchOps, into=out), save)
        if save:
            saved[window[2]:window[3]] = gate_up
        del gate_up
    return out.to(hidden.dtype), saved


def _twin_backward(grad_out, hidden, top_k_weights, order, offsets, p, needs, saved=None):
    """_backward on the twin, window by window: dx summed into one buffer, the routing weights'
    gradient from each window's slots, the per-expert gradients written at each window's experts."""
    T = hidden.shape[0]
    acc = _accumulation(p.ct)
    dx = torch.zeros((T, hidden.shape[1]), dtype=acc, device=hidden.device) if _Needs(*needs).hidden else None
    grads = dict.fromkeys(_GRADS)
    for window in _windows(offsets, p, hidden):
        first, end, row, row_end = window
        parts = _backward(grad_out, hidden, top_k_weights, *_window_args(order, offsets, p, window), needs,
                          functools.partial(_TorchOps, into=dx), saved[row:row_end] if saved is not None else None)
        for name, part in zip(_GRADS, parts):
            if part is None or name == "hidden":
                continue
            if name == "top_k_weights":  # each window's slots, zeros elsewhere
                grads[name] = part if grads[name] is None else grads[name].add_(part)
                continue
            if grads[name] is None:
                grads[name] = part.new_empty((p.num_experts, *part.shape[1:]))
            grads[name][first:end] = part
    if dx is not None:
        grads["hidden"] = dx.to(hidden.dtype)
    return tuple(grads[name] for name in _GRADS)


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, transposed,
                  interleaved, activation, alpha, limit, lora, autocast_dtype, backward="auto") -> None:
    """ValueError naming the argument when the call cannot be an experts forward."""
    _dispatch.check_tensor("hidden", hidden, "of shape (tokens, hidden)")
    _dispatch.check_tensor("top_k_index", top_k_index, "of shape (tokens, top_k)")
    _dispatch.check_tensor("top_k_weights", top_k_weights, "of shape (tokens, top_k)")
    _dispatch.check_tensor("gate_up", gate_up, "of shape (experts, 2 * intermediate, hidden)")
    _dispatch.check_tensor("down", down, "of shape (experts, hidden, intermediate)")
    _dispatch.check_floating("hidden", hidden)
    _dispatch.check_floating("top_k_weights", top_k_weights)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must have shape (tokens, hidden), got {tuple(hidden.shape)}")
    tokens, size = hidden.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != tokens or top_k_index.is_floating_point() \
            or top_k_index.dtype == torch.bool:
        raise ValueError(f"top_k_index must be an integer tensor of shape ({tokens}, top_k) for hidden of shape "
                         f"{tuple(hidden.shape)}, got {top_k_index.dtype} of shape {tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights has shape {tuple(top_k_weights.shape)} but top_k_index has shape "
                         f"{tuple(top_k_index.shape)}; expected the same (tokens, top_k)")
    if not isinstance(transposed, bool) or not isinstance(interleaved, bool):
        raise ValueError(f"transposed and interleaved must be bool, got {transposed!r} and {interleaved!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    # comparisons, not math.isnan/isfinite: under torch.compile(dynamic=True) a config float is a
    # SymFloat, which dynamo compares but cannot hand to `math`
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            raise ValueError(f"{name} must be a float, got {value!r}")
    if activation == "gpt_oss" and not -math.inf < limit < math.inf:
        raise ValueError(f"limit must be finite for activation 'gpt_oss', got {limit!r}")
    if limit <= 0:
        raise ValueError(f"limit must be positive (the clamp's bound), got {limit!r}")
    if gate_up.dim() != 3:
        raise ValueError(f"gate_up must have 3 dimensions (experts, ...), got shape {tuple(gate_up.shape)}")
    experts = gate_up.shape[0]
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    want_gu = (experts, size, two_i) if transposed else (experts, two_i, size)
    if tuple(gate_up.shape) != want_gu or two_i % 2 or two_i == 0:
        layout = "(experts, hidden, 2 * intermediate)" if transposed else "(experts, 2 * intermediate, hidden)"
        raise ValueError(f"gate_up has shape {tuple(gate_up.shape)} but hidden of shape {tuple(hidden.shape)} "
                         f"with transposed={transposed} needs {layout}, hidden = {size}")
    inter = two_i // 2
    want_down = (experts, inter, size) if transposed else (experts, size, inter)
    if tuple(down.shape) != want_down:
        raise ValueError(f"down has shape {tuple(down.shape)} but gate_up of shape {tuple(gate_up.shape)} with "
                         f"transposed={transposed} needs {want_down}")
    for name, bias, want in (("gate_up_bias", gate_up_bias, (experts, two_i)), ("down_bias", down_bias, (experts, size))):
        if bias is not None:
            _dispatch.check_tensor(name, bias, f"of shape {want} or None")
            if tuple(bias.shape) != want:
                raise ValueError(f"{name} has shape {tuple(bias.shape)}; expected {want}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
    if autocast_dtype is not None and autocast_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"autocast_dtype must be None, torch.bfloat16, torch.float16 or torch.float32, got "
                         f"{autocast_dtype!r}")
    if autocast_dtype is None:
        for name, t in (("gate_up", gate_up), ("down", down), ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
            if t is not None and t.dtype != hidden.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but hidden has {hidden.dtype}; without autocast_dtype "
                                 f"they must match (as stock's matmuls demand)")
    _dispatch.check_same_device(hidden=hidden, top_k_index=top_k_index, top_k_weights=top_k_weights,
                                gate_up=gate_up, down=down, gate_up_bias=gate_up_bias, down_bias=down_bias)
    _lora_parts(lora, experts, size, inter, hidden.device)


def _lora_parts(lora, experts: int, size: int, inter: int, device) -> tuple:
    """(gate_up A, gate_up B, down A, down B, gate_up scaling, down scaling) from the `lora`
    argument (None each where absent; a projection without adapters has scaling 0.0)."""
    if lora is None:
        return None, None, None, None, 0.0, 0.0
    if not isinstance(lora, dict) or not set(lora) <= {"gate_up", "down", "scaling"} or "scaling" not in lora:
        raise ValueError(f"lora must be None or a dict with keys 'gate_up', 'down' (each (A, B) or None) and "
                         f"'scaling' (a float, or {{'gate_up': float, 'down': float}}), got {lora!r}")
    scaling = lora["scaling"]
    if isinstance(scaling, dict) and not set(scaling) <= {"gate_up", "down"}:
        raise ValueError(f"lora['scaling'] as a dict takes the keys 'gate_up' and 'down', got {sorted(scaling)}")
    scalings = scaling if isinstance(scaling, dict) else {"gate_up": scaling, "down": scaling}
    for name in ("gate_up", "down"):
        value = scalings.get(name)
        if value is None and lora.get(name) is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            where = f"lora['scaling'][{name!r}]" if isinstance(scaling, dict) else "lora['scaling']"
            raise ValueError(f"{where} must be a float, got {value!r}")
    parts = []
    for name, fan_in, fan_out in (("gate_up", size, 2 * inter), ("down", inter, size)):
        pair = lora.get(name)
        if pair is None:
            parts += [None, None]
            continue
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"lora[{name!r}] must be (A, B) or None, got {type(pair).__name__}")
        a, b = pair
        _dispatch.check_tensor(f"lora[{name!r}] A", a, f"of shape (experts, r, {fan_in})")
        _dispatch.check_tensor(f"lora[{name!r}] B", b, f"of shape (experts, {fan_out}, r)")
        rank = a.shape[1] if a.dim() == 3 else -1
        if tuple(a.shape) != (experts, rank, fan_in) or rank < 1:
            raise ValueError(f"lora[{name!r}] A has shape {tuple(a.shape)}; expected (experts, r, in) = "
                             f"({experts}, r, {fan_in})")
        if tuple(b.shape) != (experts, fan_out, rank):
            raise ValueError(f"lora[{name!r}] B has shape {tuple(b.shape)}; expected (experts, out, r) = "
                             f"({experts}, {fan_out}, {rank})")
        for t, which in ((a, "A"), (b, "B")):
            _dispatch.check_floating(f"lora[{name!r}] {which}", t)
            if t.device != device:
                raise ValueError(f"lora[{name!r}] {which} is on {t.device} but hidden is on {device}")
        parts += [a, b]
    return (*parts, *(float(scalings[n]) if lora.get(n) is not None else 0.0
                     for n in ("gate_up", "down")))


# --------------------------------------------------------------------------------------------
# Which backward
# --------------------------------------------------------------------------------------------

#: The op's `backward` choices (the site's ACCEL_PATCH_EXPERTS_BACKWARD).
BACKWARDS = ("auto", "triton", "grouped_mm")
#: The grouped_mm backward's products and weight gradients with a dim under this (a LoRA rank)
#: stay Triton launches (`_GroupedOps`).
GROUPED_MIN_WIDTH = 64
#: Compute dtypes whose GEMMs `auto` hands to grouped_mm on CUDA, feature-detected once per device:
#: bf16 only. torch's CUDA grouped_mm takes float16 and float32 too, but only bf16 has its CUTLASS
#: kernel; the others fall back to a loop over the groups that copies the offsets to the host (a
#: device synchronization per product), slower than the Triton backward. `backward="grouped_mm"`
#: still forces it for any dtype.
GROUPED_AUTO_DTYPES = (torch.bfloat16,)
_TAKES: dict = {}


def _grouped_mm_takes(device: torch.device, ct: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs both of the backward's forms (rows x [E, k, n] and the
    weight gradient's [n, rows] x [rows, k]) in ct on this CUDA device of compute capability 9.0
    or more: one small trial each, once per (device, dtype); under torch.compile an untried
    device is a no (nothing is launched while tracing)."""
    key = (str(device), ct)
    if key not in _TAKES:
        if torch.compiler.is_compiling():
            return False
        try:
            ok = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device) >= (9, 0)
            if ok:
                a = torch.zeros((32, 16), dtype=ct, device=device)
                offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
                torch._grouped_mm(a, torch.zeros((2, 16, 16), dtype=ct, device=device), offs=offs)
                torch._grouped_mm(a.t(), a, offs=offs)
        except (RuntimeError, NotImplementedError, TypeError, AssertionError):
            ok = False
        _TAKES[key] = ok
    return _TAKES[key]


def call_tiles(hidden: torch.Tensor, top_k_index: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               autocast_dtype: torch.dtype | None = None) -> Tiles:
    """The tile sizes a Triton call of the op on these inputs takes (its forward's; the backward's
    where the upstream gradient has hidden's dtype)."""
    widest = max(t.element_size() for t in (hidden, gate_up, down))
    return _tiles(top_k_index.numel(), gate_up.shape[0], _compute_dtype(hidden, autocast_dtype), widest, hidden.device)


def large(tiles: Tiles) -> bool:
    """Whether `tiles` are the large tiles (at whatever stage count the device took)."""
    return tiles._replace(num_stages=LARGE_TILES.num_stages) == LARGE_TILES


def backward_path(hidden: torch.Tensor, backward: str = "auto", autocast_dtype: torch.dtype | None = None,
                  lora: bool = False, tiles: Tiles | None = None) -> str:
    """Which backward a call of the op on `hidden` runs: "twin" (the plain-torch twin: off the
    Triton path), "triton" or "grouped_mm" (the Triton path's backward with its GEMMs and weight
    gradients through torch._grouped_mm, `_GroupedOps`). `backward` as the op takes it: "auto" is
    grouped_mm on a CUDA device of compute capability 9.0+ where grouped_mm takes the compute
    dtype (bf16 only, GROUPED_AUTO_DTYPES: tried once, `_grouped_mm_takes`), the call has no LoRA (`lora`: every
    product of LoRA's backward carries or is a low-rank term, which stay Triton launches there:
    its grouped_mm backward would be the Triton one) and it takes the small tiles (`tiles`, from
    `call_tiles`: with the large ones the Triton backward is the faster by the bytes model of
    docs/moe.md, "Tile sizes"; None, as its callers pass while torch.compile traces: not asked),
    else triton; "grouped_mm" forces it on any Triton path (under
    Triton's interpreter too: the tests' mixed path), "triton" forbids it. The site counts what
    this says."""
    if not _dispatch.use_triton(hidden) or hidden.dtype == torch.float64:
        return "twin"
    if backward == "grouped_mm":
        return "grouped_mm"
    if backward == "triton" or hidden.device.type != "cuda" or lora or (tiles is not None and large(tiles)):
        return "triton"
    ct = _compute_dtype(hidden, autocast_dtype)
    return "grouped_mm" if ct in GROUPED_AUTO_DTYPES and _grouped_mm_takes(hidden.device, ct) else "triton"


# --------------------------------------------------------------------------------------------
# auto's backward, timed on the device
# --------------------------------------------------------------------------------------------
#
# `backward_path`'s rule follows a bytes model (docs/moe.md, "Tile sizes"). Where a call could run
# either backward (a CUDA device where grouped_mm takes the compute dtype, no LoRA), the first
# eager call of each call shape runs both backwards on that call's own inputs, times them, and
# keeps the faster for every later call of that shape: a model that is wrong on some device or
# shape costs one timing, not every step.

#: The device types whose calls auto times (a CUDA device: where grouped_mm's backward is a
#: candidate beside Triton's; tests add the CPU, where both run under Triton's interpreter).
TIMED_DEVICE_TYPES = ("cuda",)
#: How many call shapes keep a timed answer; a call of a further shape takes the rule.
TIMED_SHAPES = 64
#: Timed rounds per backward, after one untimed run each (Triton's compile): the best counts.
TIMED_ROUNDS = _timing.ROUNDS
_timed: dict = {}
#: What timing auto's backwards on one call shape found (accel_kernels._timing.Timing): the path
#: kept, each backward's best milliseconds and what each that raised said.
Timing = _timing.Timing
#: The words before a timing's figures in a call's count.
TIMED_NOTE = "backward timed"


def timed_backwards() -> dict:
    """{call shape: Timing} of every call shape auto timed in this process (a copy)."""
    return dict(_timed)


def choose_backward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, *, transposed: bool = False, interleaved: bool = False,
                    activation: str = "silu", alpha: float = 1.702, limit: float = math.inf, lora: bool = False,
                    autocast_dtype: torch.dtype | None = None, backward: str = "auto",
                    may_time: bool = True) -> tuple[str, Timing | None]:
    """(path, timing): the backward a call of the op with these arguments runs, as `backward_path`
    names it, and the Timing when this call timed auto's two backwards (else None).

    `backward_path`'s rule (by the call's tiles in eager on CUDA, without them while torch.compile
    or torch.jit traces), except where auto could run either backward (`_timeable`: a CUDA device where
    grouped_mm takes the compute dtype, no LoRA) in an eager call with grad: there the first call of
    each call shape (`_shape_key`: the dtypes, the weights' shapes, the options, which inputs need a
    gradient, and the sorted rows T*K rounded up to a power of two) runs both backwards on its own
    inputs (`_time_backwards`) and every call of that shape runs the faster. Not timed, and the
    rule stands: inside a backward (a reentrant checkpoint's recompute), while a CUDA graph is
    captured, under a TorchDispatchMode or a functorch transform, with saved-tensor hooks disabled,
    on tensor subclasses, past TIMED_SHAPES shapes, and where the caller says `may_time` False (a
    shape timed before keeps its answer there)."""
    eager = not torch.compiler.is_compiling() and not torch.jit.is_tracing()  # a side run would enter a trace
    tiles = call_tiles(hidden, top_k_index, gate_up, down, autocast_dtype) if (
        backward == "auto" and eager and hidden.device.type == "cuda") else None
    path = backward_path(hidden, backward, autocast_dtype, lora, tiles)
    if backward != "auto" or lora or path == "twin" or not eager or not _timeable(hidden, autocast_dtype):
        return path, None
    inputs = (hidden, top_k_weights, gate_up, down, gate_up_bias, down_bias)
    key = _shape_key(top_k_index, inputs, transposed, interleaved, activation, alpha, limit, autocast_dtype)
    known = _timed.get(key)
    if known is not None:
        return known.path, None
    if not may_time or len(_timed) >= TIMED_SHAPES or not _may_time(top_k_index, inputs):
        return path, None
    timing = _time_backwards(path, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                             transposed=transposed, interleaved=interleaved, activation=activation, alpha=alpha,
                             limit=limit, autocast_dtype=autocast_dtype)
    _timed[key] = timing
    return timing.path, timing


def _timeable(hidden: torch.Tensor, autocast_dtype: torch.dtype | None) -> bool:
    """Whether auto could run either backward on hidden's device: a TIMED_DEVICE_TYPES device on
    the Triton path, and on CUDA one where grouped_mm takes the compute dtype (sm_90+, bf16/fp16)."""
    kind = hidden.device.type
    if kind not in TIMED_DEVICE_TYPES or not _dispatch.use_triton(hidden) or hidden.dtype == torch.float64:
        return False
    if kind != "cuda":
        return True
    ct = _compute_dtype(hidden, autocast_dtype)
    return ct in GROUPED_AUTO_DTYPES and _grouped_mm_takes(hidden.device, ct)


def _shape_key(top_k_index, inputs, transposed, interleaved, activation, alpha, limit, autocast_dtype) -> tuple:
    hidden = inputs[0]
    described = tuple(None if t is None else (t.dtype, tuple(t.shape[1:]) if t is hidden or t is inputs[1] else
                                              tuple(t.shape), t.requires_grad) for t in inputs)
    return (str(hidden.device), autocast_dtype, _launch.next_power_of_2(max(1, top_k_index.numel())),
            top_k_index.shape[1], described, transposed, interleaved, activation, float(alpha), float(limit))


def _may_time(top_k_index, inputs) -> bool:
    """Whether this call may run the op's backwards on the side (`_timing.side_runs_allowed`)."""
    return _timing.side_runs_allowed(list(inputs) + [top_k_index], inputs[0].device)


def _time_backwards(rule: str, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                    **options) -> Timing:
    """Both backwards of one call, timed: one untimed run each (Triton compiles its kernels there),
    then TIMED_ROUNDS rounds alternating the two; each run a forward and a backward of the op on
    detached views of the call's inputs (the same storage, no copy; the gradients of what needs
    one, returned and dropped, never accumulated), its own saved-tensor hooks (a checkpoint or
    offload around the call sees none of its saves) and an upstream gradient from its own
    generator (the global RNG is not drawn from). The faster runs the call (the rule's on a tie); a
    backward that raises (out of memory, say) is left out, and if both raise the rule stands."""
    generator = torch.Generator(device=hidden.device).manual_seed(0)

    def run(path):
        return lambda: _backward_seconds(path, generator, hidden, top_k_index, top_k_weights, gate_up, down,
                                         gate_up_bias, down_bias, **options)

    return _timing.best({path: run(path) for path in ("triton", "grouped_mm")}, rule, TIMED_ROUNDS)


def _backward_seconds(path, generator, hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                      **options) -> float:
    """Seconds of one backward of the op on `path` (`_time_backwards`), the device synchronized
    before and after it."""
    def leaf(t):
        return None if t is None else t.detach().requires_grad_(t.requires_grad)

    x, w, gu, dn, gub, db = (leaf(t) for t in (hidden, top_k_weights, gate_up, down, gate_up_bias, down_bias))
    wants = [t for t in (x, w, gu, dn, gub, db) if t is not None and t.requires_grad]
    with _timing.own_saves():
        out = moe_experts(x, top_k_index, w, gu, dn, gub, db, backward=path, **options)
        dy = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32).to(out.dtype)
        _timing.synchronize(hidden.device)
        start = _timing.clock()
        grads = torch.autograd.grad(out, wants, dy, allow_unused=True)
        _timing.synchronize(hidden.device)
        seconds = _timing.clock() - start
    del out, grads
    return seconds


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------

def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, *, transposed: bool = False, interleaved: bool = False,
                activation: str = "silu", alpha: float = 1.702, limit: float | None = None, lora: dict | None = None,
                autocast_dtype: torch.dtype | None = None, save_gate_up: bool = False,
                backward: str = "auto") -> torch.Tensor:
    """The experts of a MoE layer: [T, H] in hidden's dtype, sum_k w[t, k] * expert_e(x_t).

    hidden [T, H]; top_k_index [T, K] integer expert ids (< 0 or >= E: no expert, skipped);
    top_k_weights [T, K] floating. gate_up [E, 2I, H] (F.linear layout) or [E, H, 2I] (transposed=True,
    `x @ w`); down [E, H, I] or [E, I, H] likewise; gate_up_bias [E, 2I] and down_bias [E, H] optional.
    interleaved: gate and up alternate along 2I (gpt-oss) instead of being its two halves. activation
    "silu", "gelu", "gelu_tanh" or "gpt_oss" (alpha, limit: its clamped GLU; limit None is 7.0 there).
    limit with another activation: gate clamped at max=limit and up at [-limit, limit] before it (None
    or inf: no clamp). lora: None or {"gate_up": (A [E, r, H], B [E, 2I, r]) or None, "down": (A [E, r,
    I], B [E, H, r]) or None, "scaling": float, or {"gate_up": float, "down": float} where the
    projections' adapters scale differently (PEFT's rsLoRA on a fused gate/up, whose rank and alpha it
    doubles; rank or alpha patterns)}, any strides. autocast_dtype: the autocast dtype in force at the
    caller (None: off; read it outside, e.g. `_library.autocast_dtype(device_type)`). save_gate_up: keep
    the gate/up pre-activations (fp32, [T*K, 2I]) for backward instead of recomputing them there (one
    grouped GEMM less, for those bytes held until the backward): the plain-torch twin only; the Triton
    path always recomputes. backward: on the Triton path, which backward runs: "triton" (every GEMM a
    Triton launch), "grouped_mm" (the GEMMs and weight gradients through torch._grouped_mm, the GLU
    backward still fused) or "auto" (where a CUDA device's grouped_mm takes the compute dtype and the
    call has no LoRA, the faster of the two, timed at the first eager call of each call shape; else
    Triton's): `choose_backward` says which. The module docstring says which casts happen and what is
    saved for backward.

    Differentiable in hidden, top_k_weights, gate_up, down, the biases and the LoRA tensors (each
    only if it requires grad); first order only. Raises ValueError naming the argument for a
    wrong shape, dtype, device or option.
    """
    if limit is None:
        limit = 7.0 if activation == "gpt_oss" else math.inf
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, transposed,
                  interleaved, activation, alpha, limit, lora, autocast_dtype, backward)
    inter = down.shape[1] if transposed else down.shape[2]
    *adapters, gate_up_scaling, down_scaling = _lora_parts(lora, gate_up.shape[0], hidden.shape[1], inter,
                                                            hidden.device)
    path, _ = choose_backward(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
                              transposed=transposed, interleaved=interleaved, activation=activation, alpha=alpha,
                              limit=limit, lora=any(t is not None for t in adapters), autocast_dtype=autocast_dtype,
                              backward=backward)
    triton_path = path != "twin"
    return _moe_experts_op(
        hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, *adapters, gate_up_scaling,
        down_scaling, transposed, interleaved, activation, float(alpha), float(limit), autocast_dtype, triton_path,
        bool(save_gate_up) and not triton_path, path == "grouped_mm")[0]
