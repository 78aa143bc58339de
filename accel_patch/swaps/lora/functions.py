"""The fused functions: one autograd function for a gated MLP whose projections are LoRA
layers, one for projections reading the same input (q/k/v, or the output projection alone),
with backward derived by hand (2-D math; the adapter tensors come in as (A, B) pairs)."""
from __future__ import annotations

import torch

from .. import mlp
from .plans import Proj


def base_weight(p: Proj, dtype: torch.dtype) -> torch.Tensor:
    """The base weight in `dtype`: a 4-bit one dequantized by bitsandbytes (a temporary, dropped
    by the caller after its matmul)."""
    if p.kind == "4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(p.weight.data, p.weight.quant_state).to(dtype)
    return p.weight


def proj_forward(x: torch.Tensor, p: Proj, A, B) -> torch.Tensor:
    """x W^T + b + s (x A^T) B^T, adding the adapter as PEFT does for its dtypes."""
    w = base_weight(p, x.dtype)
    bias = p.bias.to(x.dtype) if p.bias is not None else None
    y = torch.nn.functional.linear(x, w, bias)
    del w
    if not p.adapted:
        return y
    if A.dtype == y.dtype:
        return y.addmm_(x @ A.t(), B.t(), alpha=p.scale)
    t = x.to(A.dtype) @ A.t()
    if p.peft_cast == "promote":
        return torch.addmm(y.to(A.dtype), t, B.t(), alpha=p.scale).to(y.dtype)
    return y.add_(torch.mm(t, B.t()).mul_(p.scale).to(y.dtype))


def proj_backward(dy: torch.Tensor, x: torch.Tensor, p: Proj, A, B, dx: torch.Tensor | None):
    """(dx accumulated, dA, dB) of proj_forward for output gradient dy and input x."""
    w = base_weight(p, dy.dtype)
    dx = dy @ w if dx is None else dx.addmm_(dy, w)
    del w
    if not p.adapted:
        return dx, None, None
    dya = dy.to(A.dtype)
    xa = x.to(A.dtype)
    u = dya @ B  # (n, r)
    dB = (dya.t() @ (xa @ A.t())).mul_(p.scale)
    dA = (u.t() @ xa).mul_(p.scale)
    if A.dtype == dx.dtype:
        dx.addmm_(u, A, alpha=p.scale)
    else:
        dx.add_(torch.mm(u, A).mul_(p.scale).to(dx.dtype))
    return dx, dA, dB


def _adapter_pairs(projs, adapters):
    """Per projection, its (A, B) from the flat adapter inputs, or (None, None)."""
    it = iter(adapters)
    return [(next(it), next(it)) if p.adapted else (None, None) for p in projs]


def _adapter_grads(projs, grads):
    out = []
    for p, (dA, dB) in zip(projs, grads):
        if p.adapted:
            out += [dA, dB]
    return out


class _LoraLinearsFunction(torch.autograd.Function):
    """Projections reading the same x (q, k, v; or the output projection alone): saves x once."""

    @staticmethod
    def forward(ctx, x, projs, *adapters):
        x2 = x.reshape(-1, x.shape[-1])
        pairs = _adapter_pairs(projs, adapters)
        outs = tuple(proj_forward(x2, p, A, B).view(*x.shape[:-1], -1) for p, (A, B) in zip(projs, pairs))
        ctx.save_for_backward(x, *adapters)
        ctx.projs = projs
        return outs

    @staticmethod
    def backward(ctx, *douts):
        x, *adapters = ctx.saved_tensors
        projs = ctx.projs
        x2 = x.reshape(-1, x.shape[-1])
        dx, grads = None, []
        for p, (A, B), dout in zip(projs, _adapter_pairs(projs, adapters), douts):
            dx, dA, dB = proj_backward(dout.reshape(-1, dout.shape[-1]), x2, p, A, B, dx)
            grads.append((dA, dB))
        return (dx.view(x.shape), None, *_adapter_grads(projs, grads))


# The activation: accel_kernels' GLU forward (public entry) and its registered backward op, which
# takes the Triton kernel or its plain-torch twin as the forward does.
def glu_forward(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return mlp.glu(act, gate, up)


def glu_backward(act: str, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(dgate, dup) of act(gate) * up: `torch.ops.accel_kernels.glu_backward`, on the Triton path
    where the forward takes it (float64 runs the twin, as the public entry does)."""
    from accel_kernels import _dispatch

    triton_path = _dispatch.use_triton(gate) and gate.dtype != torch.float64
    return torch.ops.accel_kernels.glu_backward(dh, gate, up, act, triton_path)


class _LoraMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) with LoRA on any of the projections; saves x, gate and up.

    projs: (gate, up, down), or (gate_up, down) with `gate_first` saying the fused order."""

    @staticmethod
    def forward(ctx, x, projs, act, gate_first, *adapters):
        x2 = x.reshape(-1, x.shape[-1])
        pairs = _adapter_pairs(projs, adapters)
        if len(projs) == 3:
            gate = proj_forward(x2, projs[0], *pairs[0])
            up = proj_forward(x2, projs[1], *pairs[1])
        else:
            first, second = proj_forward(x2, projs[0], *pairs[0]).chunk(2, dim=-1)
            gate, up = (first, second) if gate_first else (second, first)
        h = glu_forward(act, gate, up)
        out = proj_forward(h, projs[-1], *pairs[-1])
        del h
        ctx.save_for_backward(x, gate, up, *adapters)
        ctx.projs, ctx.act, ctx.gate_first = projs, act, gate_first
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dout):
        x, gate, up, *adapters = ctx.saved_tensors
        projs, act = ctx.projs, ctx.act
        pairs = _adapter_pairs(projs, adapters)
        x2, d2 = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        down, (Ad, Bd) = projs[-1], pairs[-1]
        # the down adapter needs its input: recomputed, never saved
        h = glu_forward(act, gate, up) if down.adapted else None
        dh, dAd, dBd = proj_backward(d2, h, down, Ad, Bd, None)
        del h
        dgate, dup = glu_backward(act, dh, gate, up)
        del dh
        if len(projs) == 3:
            dx, dAg, dBg = proj_backward(dgate, x2, projs[0], *pairs[0], None)
            dx, dAu, dBu = proj_backward(dup, x2, projs[1], *pairs[1], dx)
            grads = [(dAg, dBg), (dAu, dBu), (dAd, dBd)]
        else:
            dgu = torch.cat((dgate, dup) if ctx.gate_first else (dup, dgate), dim=-1)
            del dgate, dup
            dx, dA, dB = proj_backward(dgu, x2, projs[0], *pairs[0], None)
            grads = [(dA, dB), (dAd, dBd)]
        return (dx.view(x.shape), None, None, None, *_adapter_grads(projs, grads))


def fused_mlp(x, projs, adapters, act: str, gate_first: bool) -> torch.Tensor:
    return _LoraMLPFunction.apply(x, tuple(projs), act, gate_first, *adapters)


def fused_linears(x, projs, adapters) -> tuple[torch.Tensor, ...]:
    return _LoraLinearsFunction.apply(x, tuple(projs), *adapters)
