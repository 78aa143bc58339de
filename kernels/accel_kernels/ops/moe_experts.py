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
bounds, as torch's clamp). An expert id < 0 or >= E means "no expert" (transformers' masks use E):
that slot adds nothing and gets a zero routing-weight gradient.

How. The T*K (token, slot) pairs are sorted by expert once (a stable argsort of the flattened
index; `order`, and `offsets` [E+1], the first sorted row of each expert). Every GEMM is one
launch for all experts over those sorted rows:

- gate/up: x rows gathered by token, times each expert's gate_up, bias added and the GLU applied
  in the GEMM's epilogue: only act(gate) * up [T*K, I] is written, never the [T*K, 2I] gate/up;
- down: that times each expert's down, bias added and the routing weight applied in the epilogue,
  each row written to its (token, slot) place; a combine sums a token's K slots in fp32 and
  writes hidden's dtype once (transformers: `out * w` then `index_add_`, in hidden's dtype).

Backward recomputes gate/up from x (one more grouped GEMM, as the fused LoRA MLP recomputes), so
what is saved is x, the routing weights and the sort. Then, per sorted row r of expert e, token t
and upstream gradient g = grad_out[t]:

    dh_u = g @ down_e (grouped)           dw[t, k] = <dh_u, h> + <g, down_bias_e>  (= <g, y_e>)
    dgate, dup = GLU backward of (w * dh_u), recomputing gate/up in the same kernel
    dx[t] += dgu @ gate_up_e (grouped, then a combine over the K slots)
    d gate_up_e = dgu_e^T x_e, d down_e = (w g)_e^T h_e (grouped weight gradients, one launch each;
    an expert without tokens gets zeros), d biases = per-expert sums

Split LoRA. lora = {"gate_up": (A, B) or None, "down": (A, B) or None, "scaling": s} with, for a
projection with in/out features (gate_up: H -> 2I; down: I -> H, whatever `transposed` says),
A [E, r, in] and B [E, out, r], any strides (PEFT's ParamWrapper views: lora_A.weight [r*E, in] as
[E, r, in], lora_B.weight [out, r*E] as [out, r, E] permuted to [E, out, r], not contiguous: read
through their strides, never copied). y_e = x_e W_e^T + s * (x_e A_e^T) B_e^T: the base grouped
GEMM plus the adapters' grouped low-rank GEMMs; W_e + s B_e A_e is never formed. Gradients go to
every input that requires grad: with PEFT the base weights are frozen and only A, B, hidden and
the routing weights get gradients; without LoRA gate_up, down, the biases, hidden and the routing
weights (the router trains through them).

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

Saved for backward, per layer (T tokens, K slots, H hidden, E experts): hidden [T, H], the
routing weights [T, K], `order` [T*K] int32 and `offsets` [E+1] int32 (the parameters are saved
by reference, no bytes). At Qwen3-30B-A3B (T 4096, H 2048, K 8, E 128, bf16): 16 MiB + 64 KiB +
128 KiB + 516 B = 16.19 MiB, against a minimum of 16.06 MiB (hidden and the router's index and
weights, int64 index: what any backward needs to redo the layer) and, for transformers' grouped_mm
path, the gathered x [T*K, H], gate/up [T*K, 2I], act(gate) * up [T*K, I], and y [T*K, H] (about
13 activation-sized tensors over 400 MiB). `tests/kernels/test_moe_experts.py` measures it.

Paths. Triton on GPU tensors and under the interpreter; the plain-torch twin elsewhere, with the
same saved tensors and the same hand-written backward (so the memory holds on CPU too), computing
with `torch._grouped_mm` where it takes the operands (float32/bf16/fp16 with 16-byte strides:
torch >= 2.9 on CPU, feature-detected per call) and a loop over the experts elsewhere (float64).
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

SILU, GELU_ERF, GELU_TANH, GPT_OSS = 0, 1, 2, 3
ACTIVATIONS = {"silu": SILU, "gelu": GELU_ERF, "gelu_tanh": GELU_TANH, "gpt_oss": GPT_OSS}


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


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


def _forward_triton(hidden, top_k_weights, order, offsets, p):
    return _forward_torch(hidden, top_k_weights, order, offsets, p)  # until the kernels land


def _backward_triton(grad_out, hidden, top_k_weights, order, offsets, p, needs):
    return _backward_torch(grad_out, hidden, top_k_weights, order, offsets, p, needs)  # until the kernels land


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


@_library.custom_op("moe_experts")
def _moe_experts_op(
    hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
    gate_up_lora_a: Optional[torch.Tensor], gate_up_lora_b: Optional[torch.Tensor],
    down_lora_a: Optional[torch.Tensor], down_lora_b: Optional[torch.Tensor], lora_scaling: float,
    transposed: bool, interleaved: bool, activation: str, alpha: float, limit: float,
    autocast: Optional[torch.dtype], triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [T, H] in hidden's dtype, order [T*K] int32, offsets [E+1] int32); autocast: the
    compute dtype (None: hidden's)."""
    order, offsets = _route(top_k_index, gate_up.shape[0])
    params = _Params(gate_up, down, gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b, down_lora_a,
                     down_lora_b, lora_scaling, transposed, interleaved, ACTIVATIONS[activation], alpha, limit,
                     _compute_dtype(hidden, autocast))
    out = (_forward_triton if triton_path else _forward_torch)(hidden, top_k_weights, order, offsets, params)
    return out, order, offsets


@_moe_experts_op.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_lora_a,
      gate_up_lora_b, down_lora_a, down_lora_b, lora_scaling, transposed, interleaved, activation, alpha, limit,
      autocast, triton_path):
    return (hidden.new_empty(hidden.shape), top_k_index.new_empty((top_k_index.numel(),), dtype=torch.int32),
            top_k_index.new_empty((gate_up.shape[0] + 1,), dtype=torch.int32))


# the gradients the backward op returns, in the order of the forward op's tensor inputs that have one
_GRADS = ("hidden", "top_k_weights", "gate_up", "down", "gate_up_bias", "down_bias", "gate_up_lora_a",
          "gate_up_lora_b", "down_lora_a", "down_lora_b")


@_library.custom_op("moe_experts_backward")
def _moe_experts_backward_op(
    grad_out: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, order: torch.Tensor,
    offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Optional[torch.Tensor],
    down_bias: Optional[torch.Tensor], gate_up_lora_a: Optional[torch.Tensor],
    gate_up_lora_b: Optional[torch.Tensor], down_lora_a: Optional[torch.Tensor],
    down_lora_b: Optional[torch.Tensor], lora_scaling: float, transposed: bool, interleaved: bool,
    activation: str, alpha: float, limit: float, autocast: Optional[torch.dtype], needs: list[bool],
    triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients named by _GRADS, each in its input's dtype and shape where `needs` (one bool
    each, in that order) asks for it and the input exists, else (0,)."""
    params = _Params(gate_up, down, gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b, down_lora_a,
                     down_lora_b, lora_scaling, transposed, interleaved, ACTIVATIONS[activation], alpha, limit,
                     _compute_dtype(hidden, autocast))
    inputs = (hidden, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b,
              down_lora_a, down_lora_b)
    needs = tuple(bool(n) and t is not None for n, t in zip(needs, inputs))
    grads = (_backward_triton if triton_path else _backward_torch)(grad_out, hidden, top_k_weights, order, offsets,
                                                                   params, needs)
    return tuple(g.contiguous() if g is not None else _library.nothing(hidden) for g in grads)


@_moe_experts_backward_op.register_fake
def _(grad_out, hidden, top_k_weights, order, offsets, gate_up, down, gate_up_bias, down_bias, gate_up_lora_a,
      gate_up_lora_b, down_lora_a, down_lora_b, lora_scaling, transposed, interleaved, activation, alpha, limit,
      autocast, needs, triton_path):
    inputs = (hidden, top_k_weights, gate_up, down, gate_up_bias, down_bias, gate_up_lora_a, gate_up_lora_b,
              down_lora_a, down_lora_b)
    return tuple(t.new_empty(t.shape) if n and t is not None else _library.nothing(hidden)
                 for n, t in zip(needs, inputs))


def _setup_context(ctx, inputs, output):
    (hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gu_a, gu_b, d_a, d_b,
     lora_scaling, transposed, interleaved, activation, alpha, limit, autocast, triton_path) = inputs
    _, order, offsets = output
    # x, the routing weights and the sort: gate/up are recomputed, nothing [T*K, ...] is kept
    ctx.save_for_backward(hidden, top_k_weights, order, offsets, gate_up, down, gate_up_bias, down_bias,
                          gu_a, gu_b, d_a, d_b)
    ctx.options = (lora_scaling, transposed, interleaved, activation, alpha, limit, autocast, triton_path)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, *_unused):
    _dispatch.check_first_order("moe_experts")
    n = ctx.needs_input_grad
    # hidden, top_k_weights, gate_up, down, the biases, the four LoRA tensors (top_k_index has none)
    needs = [n[0], n[2], n[3], n[4], n[5], n[6], n[7], n[8], n[9], n[10]]
    if grad_out is None or not any(needs):
        return (None,) * 19
    hidden, top_k_weights, order, offsets, gate_up, down, gub, db, gu_a, gu_b, d_a, d_b = ctx.saved_tensors
    lora_scaling, transposed, interleaved, activation, alpha, limit, autocast, triton_path = ctx.options
    grads = torch.ops.accel_kernels.moe_experts_backward(
        grad_out, hidden, top_k_weights, order, offsets, gate_up, down, gub, db, gu_a, gu_b, d_a, d_b,
        lora_scaling, transposed, interleaved, activation, alpha, limit, autocast, needs, triton_path)
    g = [grad if need else None for grad, need in zip(grads, needs)]
    return (g[0], None, g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], *(None,) * 8)


_moe_experts_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


class _Params:
    """The experts' weights and options of one call, with the math views the paths share:
    every weight as [E, in, out] (y = x @ w[e])."""

    def __init__(self, gate_up, down, gate_up_bias, down_bias, gu_a, gu_b, d_a, d_b, scaling, transposed,
                 interleaved, act, alpha, limit, compute_dtype):
        self.gate_up, self.down, self.gate_up_bias, self.down_bias = gate_up, down, gate_up_bias, down_bias
        self.gu_a, self.gu_b, self.d_a, self.d_b = gu_a, gu_b, d_a, d_b
        self.scaling, self.transposed, self.interleaved = scaling, transposed, interleaved
        self.act, self.alpha, self.limit, self.ct = act, alpha, limit, compute_dtype
        self.num_experts = gate_up.shape[0]
        self.intermediate = down.shape[1] if transposed else down.shape[2]

    def in_out(self, w: torch.Tensor) -> torch.Tensor:
        """gate_up or down as [E, in, out]."""
        return w if self.transposed else w.transpose(1, 2)


def _compute_dtype(hidden: torch.Tensor, autocast: Optional[torch.dtype]) -> torch.dtype:
    return autocast if autocast is not None and hidden.dtype != torch.float64 else hidden.dtype


# Whether torch._grouped_mm took operands of a (device type, dtype) before: it wants 16-byte strides
# and float32/bf16/fp16 (torch >= 2.9 on CPU); a loop over the experts does the rest.
_GROUPED_MM: dict = {}


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: list[int], ends: torch.Tensor) -> torch.Tensor:
    """rows of expert e (x sorted by expert, counts[e] rows each) times w[e] ([E, in, out])."""
    key = (x.device.type, x.dtype)
    if hasattr(torch, "_grouped_mm") and _GROUPED_MM.get(key, True) and x.shape[0]:
        try:
            out = torch._grouped_mm(x, w, offs=ends)
            _GROUPED_MM[key] = True
            return out
        except (RuntimeError, NotImplementedError, TypeError):
            if key not in _GROUPED_MM:
                _GROUPED_MM[key] = x.dtype in (torch.float32, torch.bfloat16, torch.float16)  # strides: retry
    parts = [xe @ w[e] for e, xe in enumerate(torch.split(x, counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[2]))


def _grouped_weight_grad(a: torch.Tensor, b: torch.Tensor, counts: list[int], ends: torch.Tensor) -> torch.Tensor:
    """[E, p, q]: a_e^T b_e for the rows of each expert (zeros for an expert without rows), fp32."""
    a, b = a.float(), b.float()
    key = (a.device.type, "weight_grad")
    if hasattr(torch, "_grouped_mm") and _GROUPED_MM.get(key, True) and a.shape[0]:
        try:
            out = torch._grouped_mm(a.t(), b, offs=ends)
            _GROUPED_MM[key] = True
            # an expert without rows: grouped_mm leaves its block as it finds it
            return out.masked_fill_((ends.diff(prepend=ends.new_zeros(1)) == 0)[:, None, None], 0.0)
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    out = a.new_zeros((len(counts), a.shape[1], b.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[e] = a[start:start + c].t() @ b[start:start + c]
        start += c
    return out


def _act_torch(gate, up, p: _Params):
    """act(gate, up) on fp32 (or float64) gate and up."""
    if p.act == GPT_OSS:
        g, u = gate.clamp(max=p.limit), up.clamp(-p.limit, p.limit)
        return (u + 1) * g * torch.sigmoid(p.alpha * g)
    if p.act == GELU_ERF:
        return 0.5 * gate * (1 + torch.erf(gate * 0.7071067811865476)) * up
    if p.act == GELU_TANH:
        return gate * torch.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate ** 3)) * up
    return gate * torch.sigmoid(gate) * up


def _act_backward_torch(gate, up, dh, p: _Params):
    """(dgate, dup) for upstream dh, fp32 (or float64)."""
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
        if p.act == SILU:
            z, dz = gate, 1.0
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


class _Sorted:
    """The sorted rows of one call on the twin: slot and token of each valid row, its expert, the
    per-expert counts (on the host) and ends (int32, for grouped_mm)."""

    def __init__(self, order, offsets, top_k):
        self.rows = int(offsets[-1])  # the twin runs on the CPU: a host sync costs nothing
        self.slots = order[:self.rows].long()
        self.tokens = self.slots // top_k
        self.counts = offsets.diff().tolist()
        self.ends = offsets[1:].contiguous()
        self.experts = torch.repeat_interleave(torch.arange(len(self.counts), device=order.device),
                                               offsets.diff().long(), output_size=self.rows)


def _lora_in(x, a, s: _Sorted, p: _Params):
    """x A_e^T for the sorted rows (A [E, r, in]), rounded to the compute dtype."""
    return _grouped(x, a.to(p.ct).transpose(1, 2), s.counts, s.ends)


def _gate_up_torch(x, s: _Sorted, p: _Params):
    """(gate, up) in fp32 (float64 stays) for the sorted rows x (compute dtype)."""
    acc = torch.float64 if p.ct == torch.float64 else torch.float32
    gu = _grouped(x, p.in_out(p.gate_up).to(p.ct), s.counts, s.ends).to(acc)
    if p.gu_a is not None:
        xa = _lora_in(x, p.gu_a, s, p)
        gu = gu + p.scaling * _grouped(xa, p.gu_b.to(p.ct).transpose(1, 2), s.counts, s.ends).to(gu.dtype)
    if p.gate_up_bias is not None:
        gu = gu + p.gate_up_bias.to(p.ct)[s.experts].to(gu.dtype)
    return _split_gate_up(gu, p)


def _forward_torch(hidden, top_k_weights, order, offsets, p: _Params) -> torch.Tensor:
    T, K = top_k_weights.shape
    s = _Sorted(order, offsets, K)
    acc = torch.float64 if p.ct == torch.float64 else torch.float32
    x = hidden[s.tokens].to(p.ct)
    gate, up = _gate_up_torch(x, s, p)
    h = _act_torch(gate, up, p).to(p.ct)
    del gate, up
    y = _grouped(h, p.in_out(p.down).to(p.ct), s.counts, s.ends).to(acc)
    if p.d_a is not None:
        ha = _lora_in(h, p.d_a, s, p)
        y += p.scaling * _grouped(ha, p.d_b.to(p.ct).transpose(1, 2), s.counts, s.ends).to(acc)
    if p.down_bias is not None:
        y += p.down_bias.to(p.ct)[s.experts].to(acc)
    y *= top_k_weights.reshape(-1)[s.slots].to(acc)[:, None]
    out = torch.zeros((T, hidden.shape[1]), dtype=acc, device=hidden.device)
    return out.index_add_(0, s.tokens, y).to(hidden.dtype)


def _backward_torch(grad_out, hidden, top_k_weights, order, offsets, p: _Params, needs):
    """The gradients named by _GRADS (None where not needed), by the math of the module docstring."""
    T, K = top_k_weights.shape
    s = _Sorted(order, offsets, K)
    acc = torch.float64 if p.ct == torch.float64 else torch.float32
    x = hidden[s.tokens].to(p.ct)
    gate, up = _gate_up_torch(x, s, p)  # recomputed: the forward kept none of it
    h = _act_torch(gate, up, p).to(p.ct)
    g = grad_out[s.tokens].to(p.ct)
    w = top_k_weights.reshape(-1)[s.slots].to(acc)[:, None]
    dh = _grouped(g, p.in_out(p.down).to(p.ct).transpose(1, 2), s.counts, s.ends).to(acc)
    if p.d_a is not None:
        gb_d = _grouped(g, p.d_b.to(p.ct), s.counts, s.ends)  # g B_e  [rows, r]
        dh += p.scaling * _grouped(gb_d, p.d_a.to(p.ct), s.counts, s.ends).to(acc)
    grads = dict.fromkeys(_GRADS)
    (need_x, need_w, need_gu, need_d, need_gub, need_db, need_gua, need_gub_l, need_da, need_db_l) = needs
    if need_w:
        dw = (dh * h.to(acc)).sum(-1)
        if p.down_bias is not None:
            dw += (g.to(acc) * p.down_bias.to(p.ct)[s.experts].to(acc)).sum(-1)
        flat = torch.zeros(T * K, dtype=acc, device=hidden.device)
        grads["top_k_weights"] = flat.index_put_((s.slots,), dw).view(T, K).to(top_k_weights.dtype)
    dgate, dup = _act_backward_torch(gate, up, dh * w, p)
    del gate, up, dh
    dgu = _join_gate_up(dgate, dup, p).to(p.ct)
    del dgate, dup
    gw = (g.to(acc) * w).to(p.ct) if (need_d or need_db or need_da or need_db_l) else None
    if need_x or need_gua:
        dgu_b = _grouped(dgu, p.gu_b.to(p.ct), s.counts, s.ends) if p.gu_a is not None else None
    if need_x:
        dx = _grouped(dgu, p.in_out(p.gate_up).to(p.ct).transpose(1, 2), s.counts, s.ends).to(acc)
        if p.gu_a is not None:
            dx += p.scaling * _grouped(dgu_b, p.gu_a.to(p.ct), s.counts, s.ends).to(acc)
        out = torch.zeros((T, hidden.shape[1]), dtype=acc, device=hidden.device)
        grads["hidden"] = out.index_add_(0, s.tokens, dx).to(hidden.dtype)
    if need_gu:
        grads["gate_up"] = _from_in_out(_grouped_weight_grad(x, dgu, s.counts, s.ends), p, p.gate_up)
    if need_d:
        grads["down"] = _from_in_out(_grouped_weight_grad(h, gw, s.counts, s.ends), p, p.down)
    if need_gub:
        grads["gate_up_bias"] = _expert_sums(dgu, s, p).to(p.gate_up_bias.dtype)
    if need_db:
        grads["down_bias"] = _expert_sums(gw, s, p).to(p.down_bias.dtype)
    if need_gua:  # dA = s (dgu B)^T x
        grads["gate_up_lora_a"] = (p.scaling * _grouped_weight_grad(dgu_b, x, s.counts, s.ends)).to(p.gu_a.dtype)
    if need_gub_l:  # dB = s dgu^T (x A^T)
        xa = _lora_in(x, p.gu_a, s, p)
        grads["gate_up_lora_b"] = (p.scaling * _grouped_weight_grad(dgu, xa, s.counts, s.ends)).to(p.gu_b.dtype)
    if need_da:  # dA = s ((w g) B)^T h
        gwb = _grouped(gw, p.d_b.to(p.ct), s.counts, s.ends)
        grads["down_lora_a"] = (p.scaling * _grouped_weight_grad(gwb, h, s.counts, s.ends)).to(p.d_a.dtype)
    if need_db_l:  # dB = s (w g)^T (h A^T)
        ha = _lora_in(h, p.d_a, s, p)
        grads["down_lora_b"] = (p.scaling * _grouped_weight_grad(gw, ha, s.counts, s.ends)).to(p.d_b.dtype)
    return tuple(grads[name] for name in _GRADS)


def _from_in_out(grad: torch.Tensor, p: _Params, like: torch.Tensor) -> torch.Tensor:
    """An [E, in, out] gradient in the layout (and dtype) of the weight `like`."""
    return (grad if p.transposed else grad.transpose(1, 2)).to(like.dtype).contiguous()


def _expert_sums(rows: torch.Tensor, s: _Sorted, p: _Params) -> torch.Tensor:
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    out = torch.zeros((p.num_experts, rows.shape[1]), dtype=acc, device=rows.device)
    return out.index_add_(0, s.experts, rows.to(acc))


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, transposed,
                  interleaved, activation, alpha, limit, lora, autocast_dtype) -> None:
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
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a float, got {value!r}")
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
    """(gate_up A, gate_up B, down A, down B, scaling) from the `lora` argument (None each where absent)."""
    if lora is None:
        return None, None, None, None, 0.0
    if not isinstance(lora, dict) or not set(lora) <= {"gate_up", "down", "scaling"} or "scaling" not in lora:
        raise ValueError(f"lora must be None or a dict with keys 'gate_up', 'down' (each (A, B) or None) and "
                         f"'scaling' (float), got {lora!r}")
    scaling = lora["scaling"]
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise ValueError(f"lora['scaling'] must be a float, got {scaling!r}")
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
    return (*parts, float(scaling))


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------

# Whether the Triton path exists yet (the kernels follow the same API)
_TRITON_READY = False


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, *, transposed: bool = False, interleaved: bool = False,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, lora: dict | None = None,
                autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The experts of a MoE layer: [T, H] in hidden's dtype, sum_k w[t, k] * expert_e(x_t).

    hidden [T, H]; top_k_index [T, K] integer expert ids (< 0 or >= E: no expert, skipped);
    top_k_weights [T, K] floating. gate_up [E, 2I, H] (F.linear layout) or [E, H, 2I]
    (transposed=True, `x @ w`); down [E, H, I] or [E, I, H] likewise; gate_up_bias [E, 2I] and
    down_bias [E, H] optional. interleaved: gate and up alternate along 2I (gpt-oss) instead of
    being its two halves. activation "silu", "gelu", "gelu_tanh" or "gpt_oss" (alpha, limit: its
    clamped GLU). lora: None or {"gate_up": (A [E, r, H], B [E, 2I, r]) or None, "down": (A [E, r,
    I], B [E, H, r]) or None, "scaling": float}, any strides. autocast_dtype: the autocast dtype in
    force at the caller (None: off; read it outside, e.g. `_library.autocast_dtype(device_type)`).
    The module docstring says which casts happen and what is saved for backward.

    Differentiable in hidden, top_k_weights, gate_up, down, the biases and the LoRA tensors (each
    only if it requires grad); first order only. Raises ValueError naming the argument for a
    wrong shape, dtype, device or option.
    """
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, transposed,
                  interleaved, activation, alpha, limit, lora, autocast_dtype)
    inter = down.shape[1] if transposed else down.shape[2]
    gu_a, gu_b, d_a, d_b, scaling = _lora_parts(lora, gate_up.shape[0], hidden.shape[1], inter, hidden.device)
    triton_path = _TRITON_READY and _dispatch.use_triton(hidden) and hidden.dtype != torch.float64
    return torch.ops.accel_kernels.moe_experts(
        hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, gu_a, gu_b, d_a, d_b, scaling,
        transposed, interleaved, activation, float(alpha), float(limit), autocast_dtype, triton_path)[0]
