"""Tiny random models of several families, a padded batch, and one training step, for swap tests.

Every family is built from its config (no downloads). `EXPECTED` says which op kinds the swap
must put in (and which it must refuse) for each family: a test fails both when a swap is missing
and when one appears where the family computes something else.
"""
from __future__ import annotations

import copy

import torch
import transformers as T

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

ALL = {"rms_norm", "rope", "glu", "fused_linear_cross_entropy"}

# name: (config class, model class, config overrides, ops swapped, ops refused)
FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}, ALL, set()),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {}, ALL, set()),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}, ALL, set()),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 16}, ALL, set()),  # per-head q/k norms
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {"head_dim": 16}, ALL, set()),  # (1 + w), tanh-GELU
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,  # sandwich norms, final-logit soft-capping
               {"head_dim": 16, "final_logit_softcapping": 5.0}, ALL, set()),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"partial_rotary_factor": 0.5}, ALL, set()),  # fused gate_up, partial rotary
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}, ALL, set()),  # full-width q/k norms, fp32 affine
    "granite": (T.GraniteConfig, T.GraniteForCausalLM,  # logits divided by logits_scaling
                {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0}, ALL, set()),
    "cohere": (T.CohereConfig, T.CohereForCausalLM,  # LayerNorm, interleaved RoPE, logits * logit_scale
               {"logit_scale": 0.5}, {"glu", "fused_linear_cross_entropy"}, {"rms_norm", "rope"}),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM,  # MoE experts as 3-D parameters, aux loss
                {"num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
                 "router_aux_loss_coef": 0.1}, {"rms_norm", "rope", "fused_linear_cross_entropy"}, {"glu"}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,  # LayerNorm, partial rotary inside the function
                 {"rotary_pct": 0.5}, {"rope", "fused_linear_cross_entropy"}, {"rms_norm"}),
}


def build(family: str, dtype=torch.float32, **overrides):
    config_cls, model_cls, extra, _, _ = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    return model_cls(config).to(dtype)


def pair(family: str, dtype=torch.float32, **overrides):
    """(stock, twin): two models with the same weights; swap the twin."""
    stock = build(family, dtype, **overrides)
    return stock, copy.deepcopy(stock)


def padded_batch(vocab: int = 128, batch: int = 3, seq: int = 10, seed: int = 1):
    """Left padding (rows start with 0..4 pad tokens) and labels ignored on the padding and on the
    first tokens of the first row (a prompt), as an SFT batch looks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        pad = (2 * row) % 5
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_step(model, batch, **kwargs):
    """(loss, {parameter name: gradient}, output) of one forward + backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
