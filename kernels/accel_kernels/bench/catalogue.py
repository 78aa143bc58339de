"""The op catalogue: for each op, its shapes, an input maker, the eager formula it replaces
(transformers' own code in plain torch), accel_kernels' call and Liger Kernel's.

Shapes: "gpu" is llama-3-8B scale in bf16 (hidden 4096, intermediate 14336, 32 q / 8 kv heads of
128, vocab 128256; 8192 tokens = batch 4 x seq 2048); "cpu" is small float32 shapes for the
plain-torch twins; "check" is the tiny float32 shape of the correctness guard.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import accel_kernels


class Op(NamedTuple):
    shapes: dict  # "gpu", "cpu", "check" -> keyword arguments of make
    make: Callable  # (device, dtype, **shape) -> list of inputs; the ones to differentiate require grad
    eager: Callable  # the transformers-style formula in plain torch
    ours: Callable
    liger: Callable | None  # imports liger_kernel when called; None where Liger has no such op
    bytes_moved: Callable | None  # (element size, **shape) -> bytes fwd+bwd must move; None if not memory-bound


def _randn(*shape, device, dtype, grad=True):
    return torch.randn(*shape, device=device).to(dtype).requires_grad_(grad)


def _labels(n, vocab, device):
    labels = torch.randint(0, vocab, (n,), device=device)
    return labels.masked_fill(torch.rand(n, device=device) < 0.1, -100)  # some ignored tokens, as in SFT


# --- rms_norm: transformers' LlamaRMSNorm ---
def _eager_rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _liger_rms_norm(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)  # in_place=False


RMS_NORM = Op(
    shapes={"gpu": dict(batch=4, seq=2048, hidden=4096), "cpu": dict(batch=4, seq=512, hidden=1024),
            "check": dict(batch=2, seq=8, hidden=256)},
    make=lambda device, dtype, batch, seq, hidden: [
        _randn(batch, seq, hidden, device=device, dtype=dtype),
        (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()],
    eager=_eager_rms_norm,
    ours=lambda x, w: accel_kernels.rms_norm(x, w, eps=1e-6),
    liger=_liger_rms_norm,
    # fwd reads x, writes y; bwd reads dy, x, writes dx (the weight and its grad are one row)
    bytes_moved=lambda e, batch, seq, hidden: 5 * batch * seq * hidden * e,
)


# --- layer_norm: torch.nn.LayerNorm with a weight and a bias (the DSA indexers' k_norm, GPT-NeoX) ---
def _liger_layer_norm(x, w, b):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    return LigerLayerNormFunction.apply(x, w, b, 1e-6)


LAYER_NORM = Op(
    shapes={"gpu": dict(batch=4, seq=2048, hidden=4096), "cpu": dict(batch=4, seq=512, hidden=1024),
            "check": dict(batch=2, seq=8, hidden=256)},
    make=lambda device, dtype, batch, seq, hidden: [
        _randn(batch, seq, hidden, device=device, dtype=dtype),
        (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_(),
        (0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()],
    eager=lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-6),
    ours=lambda x, w, b: accel_kernels.layer_norm(x, w, b, eps=1e-6),
    liger=_liger_layer_norm,
    # as rms_norm's: fwd reads x, writes y; bwd reads dy, x, writes dx (weight, bias and their grads are rows)
    bytes_moved=lambda e, batch, seq, hidden: 5 * batch * seq * hidden * e,
)


# --- swiglu / geglu: LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) ---
def _liger_swiglu(g, u):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    return LigerSiLUMulFunction.apply(g, u)


def _liger_geglu(g, u):
    from liger_kernel.ops.geglu import LigerGELUMulFunction  # tanh approximation only
    return LigerGELUMulFunction.apply(g, u)


def _glu_op(eager, ours, liger):
    return Op(
        shapes={"gpu": dict(tokens=8192, intermediate=14336), "cpu": dict(tokens=2048, intermediate=2816),
                "check": dict(tokens=16, intermediate=300)},
        make=lambda device, dtype, tokens, intermediate: [
            _randn(tokens, intermediate, device=device, dtype=dtype) for _ in range(2)],
        eager=eager, ours=ours, liger=liger,
        # fwd reads gate, up, writes out; bwd reads dout, gate, up, writes dgate, dup
        bytes_moved=lambda e, tokens, intermediate: 8 * tokens * intermediate * e,
    )


SWIGLU = _glu_op(lambda g, u: F.silu(g) * u, accel_kernels.swiglu, _liger_swiglu)
# tanh, as Gemma's gelu_pytorch_tanh: the GeGLU Liger implements
GEGLU = _glu_op(lambda g, u: F.gelu(g, approximate="tanh") * u,
                lambda g, u: accel_kernels.geglu(g, u, approximate="tanh"), _liger_geglu)


# --- rope: transformers' apply_rotary_pos_emb on q, k as attention makes them ---
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _make_rope(device, dtype, batch, seq, q_heads, kv_heads, head_dim):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(seq, device=device).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
    # q, k as projections give them, (B, S, H, D); every implementation sees the (B, H, S, D) view
    return [_randn(batch, seq, q_heads, head_dim, device=device, dtype=dtype),
            _randn(batch, seq, kv_heads, head_dim, device=device, dtype=dtype),
            emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()]


def _heads_first(fn):
    return lambda q, k, cos, sin: fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _liger_rope(q, k, cos, sin):
    from liger_kernel.ops.rope import LigerRopeFunction
    return LigerRopeFunction.apply(q, k, cos, sin, None, 1)


ROPE = Op(
    shapes={"gpu": dict(batch=4, seq=2048, q_heads=32, kv_heads=8, head_dim=128),
            "cpu": dict(batch=1, seq=512, q_heads=32, kv_heads=8, head_dim=128),
            "check": dict(batch=2, seq=16, q_heads=4, kv_heads=2, head_dim=64)},
    make=_make_rope,
    eager=_heads_first(_eager_rope),
    ours=_heads_first(accel_kernels.rope),
    liger=_heads_first(_liger_rope),
    # each pass reads q, k, cos, sin and writes q, k
    bytes_moved=lambda e, batch, seq, q_heads, kv_heads, head_dim:
        2 * (2 * (q_heads + kv_heads) + 2) * batch * seq * head_dim * e,
)


# --- cross_entropy: transformers' loss, logits upcast to float32 ---
def _liger_ce(logits, labels):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    return LigerCrossEntropyFunction.apply(logits, labels, None, -100)  # (input, target, weight, ignore_index)


CROSS_ENTROPY = Op(
    shapes={"gpu": dict(tokens=8192, vocab=128256), "cpu": dict(tokens=1024, vocab=32000),
            "check": dict(tokens=64, vocab=1000)},
    make=lambda device, dtype, tokens, vocab: [
        _randn(tokens, vocab, device=device, dtype=dtype), _labels(tokens, vocab, device)],
    eager=lambda logits, labels: F.cross_entropy(logits.float(), labels, ignore_index=-100),
    ours=lambda logits, labels: accel_kernels.cross_entropy(logits, labels),
    liger=_liger_ce,
    bytes_moved=lambda e, tokens, vocab: 2 * tokens * vocab * e,  # read the logits, write their grad
)


# --- fused linear cross-entropy: lm_head matmul + loss without the full logits ---
def _liger_flce(hidden, weight, labels):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    return LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)


FLCE = Op(
    shapes={"gpu": dict(tokens=8192, hidden=4096, vocab=128256), "cpu": dict(tokens=4096, hidden=1024, vocab=32000),
            "check": dict(tokens=64, hidden=128, vocab=1000)},
    make=lambda device, dtype, tokens, hidden, vocab: [
        _randn(tokens, hidden, device=device, dtype=dtype),
        (torch.randn(vocab, hidden, device=device) / math.sqrt(hidden)).to(dtype).requires_grad_(),
        _labels(tokens, vocab, device)],
    eager=lambda hidden, weight, labels: F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100),
    ours=lambda hidden, weight, labels: accel_kernels.fused_linear_cross_entropy(hidden, weight, labels),
    liger=_liger_flce,
    bytes_moved=None,  # matmul-bound
)



# --- moe_experts: transformers' default experts path (grouped_mm), Qwen3-MoE's layout ---
def _make_moe(device, dtype, tokens, hidden, intermediate, experts, top_k):
    index = torch.topk(torch.randn(tokens, experts, device=device), top_k, dim=-1).indices
    return [_randn(tokens, hidden, device=device, dtype=dtype), index,
            torch.rand(tokens, top_k, device=device).to(dtype).requires_grad_(),
            (torch.randn(experts, 2 * intermediate, hidden, device=device) / math.sqrt(hidden)).to(dtype).requires_grad_(),
            (torch.randn(experts, hidden, intermediate, device=device) / math.sqrt(intermediate)).to(dtype).requires_grad_()]


def _grouped(a, b, offs):
    """torch._grouped_mm(a, b, offs=offs); group by group where it takes no such dtype (float64: the
    reference `accel-patch check` runs)."""
    if a.dtype != torch.float64:
        return torch._grouped_mm(a, b, offs=offs)
    starts = [0] + offs.tolist()[:-1]
    return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, offs.tolist()))])


def _eager_moe(x, index, w, gate_up, down):
    """transformers' grouped_mm_experts_forward (integrations/moe.py) in plain torch."""
    top_k, experts = index.shape[1], gate_up.shape[0]
    ids, perm = torch.sort(index.reshape(-1))
    offs = torch.cumsum(torch.bincount(ids, minlength=experts), 0).to(torch.int32)
    gate, up = _grouped(x[perm // top_k], gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    y = _grouped(F.silu(gate) * up, down.transpose(1, 2), offs) * w.reshape(-1)[perm, None]
    return torch.zeros_like(x).index_add_(0, perm // top_k, y.to(x.dtype))


MOE_EXPERTS = Op(
    shapes={"gpu": dict(tokens=4096, hidden=2048, intermediate=768, experts=128, top_k=8),  # Qwen3-30B-A3B
            "cpu": dict(tokens=512, hidden=256, intermediate=128, experts=16, top_k=4),
            "check": dict(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2)},
    make=_make_moe,
    eager=_eager_moe,
    ours=accel_kernels.moe_experts,
    liger=None,  # LigerExperts is a module, not an op on these tensors
    bytes_moved=None,  # matmul-bound
)

# --- moe_experts, gpt-oss's path: transposed [E, H, 2I], gate/up interleaved, biases, its clamped
# GLU driven past the clamp, and PEFT's split LoRA on both projections (base weights frozen) ---
GPT_OSS_ALPHA, GPT_OSS_LIMIT = 1.702, 7.0


def _make_gpt_oss_moe(device, dtype, tokens, hidden, intermediate, experts, top_k, rank):
    index = torch.topk(torch.randn(tokens, experts, device=device), top_k, dim=-1).indices
    # gate_up scaled so that about 1 pre-activation in 10 passes the clamp (|x| > 7)
    gate_up = (torch.randn(experts, hidden, 2 * intermediate, device=device) * 4.0 / math.sqrt(hidden)).to(dtype)
    down = (torch.randn(experts, intermediate, hidden, device=device) / math.sqrt(intermediate)).to(dtype)
    inputs = [_randn(tokens, hidden, device=device, dtype=dtype), index,
              torch.rand(tokens, top_k, device=device).to(dtype).requires_grad_(), gate_up, down,
              (torch.randn(experts, 2 * intermediate, device=device) * 0.3).to(dtype).requires_grad_(),
              (torch.randn(experts, hidden, device=device) * 0.3).to(dtype).requires_grad_()]
    for fan_in, fan_out in ((hidden, 2 * intermediate), (intermediate, hidden)):  # PEFT's lora_A, lora_B weights
        inputs.append((torch.randn(rank * experts, fan_in, device=device) / math.sqrt(fan_in)).to(dtype).requires_grad_())
        inputs.append((torch.randn(fan_out, rank * experts, device=device) * 0.3).to(dtype).requires_grad_())
    return inputs


def _lora_views(a_w, b_w, experts):
    """PEFT's ParamWrapper weights as the op takes them: A [E, r, in], B [E, out, r] (a strided view)."""
    return a_w.view(experts, -1, a_w.shape[1]), b_w.view(b_w.shape[0], -1, experts).permute(2, 0, 1)


def _ours_gpt_oss_moe(x, index, w, gate_up, down, gu_bias, d_bias, gu_a, gu_b, d_a, d_b):
    experts = gate_up.shape[0]
    lora = {"gate_up": _lora_views(gu_a, gu_b, experts), "down": _lora_views(d_a, d_b, experts), "scaling": 2.0}
    return accel_kernels.moe_experts(x, index, w, gate_up, down, gu_bias, d_bias, transposed=True, interleaved=True,
                                     activation="gpt_oss", alpha=GPT_OSS_ALPHA, limit=GPT_OSS_LIMIT, lora=lora)


def _eager_gpt_oss_moe(x, index, w, gate_up, down, gu_bias, d_bias, gu_a, gu_b, d_a, d_b):
    """transformers' GptOssExperts loop on the weights PEFT's LoRA merges into (W + scaling * B @ A)."""
    experts = gate_up.shape[0]
    a, b = _lora_views(gu_a, gu_b, experts)
    gate_up = gate_up + 2.0 * (b @ a).transpose(1, 2)
    a, b = _lora_views(d_a, d_b, experts)
    down = down + 2.0 * (b @ a).transpose(1, 2)
    out = torch.zeros_like(x)
    for e in range(experts):
        token, slot = torch.where(index == e)
        if token.numel() == 0:
            continue
        gu = x[token] @ gate_up[e] + gu_bias[e]
        gate = gu[..., ::2].clamp(max=GPT_OSS_LIMIT)
        up = gu[..., 1::2].clamp(-GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        y = ((up + 1) * (gate * torch.sigmoid(gate * GPT_OSS_ALPHA))) @ down[e] + d_bias[e]
        out = out.index_add(0, token, (y * w[token, slot, None]).to(x.dtype))
    return out


MOE_EXPERTS_GPT_OSS = Op(
    shapes={"gpu": dict(tokens=4096, hidden=2880, intermediate=2880, experts=32, top_k=4, rank=16),  # gpt-oss-20b
            "cpu": dict(tokens=256, hidden=128, intermediate=64, experts=8, top_k=4, rank=8),
            "check": dict(tokens=16, hidden=32, intermediate=16, experts=4, top_k=2, rank=4)},
    make=_make_gpt_oss_moe,
    eager=_eager_gpt_oss_moe,
    ours=_ours_gpt_oss_moe,
    liger=None,
    bytes_moved=None,  # matmul-bound
)

OPS = {"rms_norm": RMS_NORM, "layer_norm": LAYER_NORM, "swiglu": SWIGLU, "geglu": GEGLU, "rope": ROPE,
       "cross_entropy": CROSS_ENTROPY, "fused_linear_cross_entropy": FLCE, "moe_experts": MOE_EXPERTS,
       "moe_experts_gpt_oss": MOE_EXPERTS_GPT_OSS}
