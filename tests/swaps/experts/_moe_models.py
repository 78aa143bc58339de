"""Tiny random models of every MoE family of transformers 5.24 that builds from a config, for the
experts site's tests: 4 experts, top-2 (Llama4: top-1, its own routing), 2 layers, nothing
downloaded. A family this transformers lacks is skipped by the tests that ask for it."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from accel_patch.cli import check

MOE = dict(num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           output_router_logits=True)
HYBRID = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"],
              shared_expert_intermediate_size=48)
# family: (config class, model class, overrides)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"shared_expert_intermediate_size": 48}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_shared_experts": 1,
        "num_key_value_heads": 4}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {
        "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                                                          "head_dim": 16}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 16, "intermediate_size_mlp": 128,
                                                         "num_experts_per_tok": 1, "interleave_moe_layer_step": 1}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", HYBRID),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", HYBRID),
}


def build(family: str, dtype=None, **overrides):
    config_name, model_name, extra = FAMILIES[family]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = config_cls(**{**check.COMMON, **MOE, **extra, **overrides})
    recorded = getattr(model_cls, "_can_record_outputs", None) or {"router_logits": None}
    if getattr(config, "output_router_logits", False) and "router_logits" not in recorded:
        # transformers 5.17's GraniteMoe records no router logits: its aux loss is the int 0 and
        # `aux_loss.to(...)` raises in the stock forward
        config.output_router_logits = False
    model = model_cls(config)
    return model.to(dtype) if dtype is not None else model


def pair(family: str, dtype=None, **overrides):
    stock = build(family, dtype, **overrides)
    return stock, copy.deepcopy(stock)


def experts_modules(model) -> dict[str, torch.nn.Module]:
    """Every module of `model` holding 3-D gate_up_proj/down_proj parameters (PEFT's wrappers unwrapped)."""
    return {n: m for n, m in model.named_modules()
            if getattr(m, "gate_up_proj", None) is not None and "gate_up_proj" in m._parameters
            and m._parameters["gate_up_proj"].dim() == 3}
