"""The RoPE forms of the 2026 families run the kernel where the probe proves it computes the
family's own function: DeepSeek V3's interleave function (and its heirs), the V3.2 indexer's
(B, S, H, D) calls, GPT-J pairs (ERNIE 4.5), the one-tensor form (Gemma 4). Each tiny model
(its own config class; skipped where transformers lacks it) trains one step swapped
(ops=["rope"]) and stock: every RoPE call is counted fused, loss and gradients agree. Forms the
kernel does not rotate (Llama 4's complex RoPE, DeepSeek V4's) are refused with the form named."""
from __future__ import annotations

import copy

import pytest
import torch

import accel_patch
from accel_patch.swaps import probe
from accel_patch.swaps.layers import rope

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, index_n_heads=2, index_head_dim=16, index_topk=4)

# family: (config class, overrides, the attention classes that must run the kernel)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", {**MLA, "rope_interleave": True}, {"DeepseekV3Attention"}),
    "deepseek_v32": ("DeepseekV32Config", MLA, {"DeepseekV32Attention", "DeepseekV32Indexer"}),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", MLA, {"Glm4MoeLiteAttention"}),
    "mistral4": ("Mistral4Config", {**MLA, "head_dim": 16}, {"Mistral4Attention"}),
    "longcat_flash": ("LongcatFlashConfig", {**MLA, "num_layers": 1, "ffn_hidden_size": 48,
                                             "expert_ffn_hidden_size": 16}, {"LongcatFlashMLA"}),
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 16}, {"Ernie4_5Attention"}),
    "gemma4": ("Gemma4TextConfig", {"head_dim": 16, "global_head_dim": 16, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 64},
               {"Gemma4TextAttention"}),
}
QUICK = {"deepseek_v32"}  # the interleave function and the indexer's (B, S, H, D) calls


def _model(family: str, **extra):
    cls_name, overrides, _ = FAMILIES[family] if family in FAMILIES else (family, {}, None)
    config_class = getattr(transformers, cls_name, None)
    if config_class is None:
        pytest.skip(f"transformers has no {cls_name}")
    config = config_class(**{**TINY, **overrides, **extra})
    torch.manual_seed(0)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # the class itself, not from_config: the load hook would swap (and probe) every op first
    own = {"Mistral4Config": "Mistral4ForCausalLM"}.get(cls_name)  # not in the Auto mapping
    cls = getattr(transformers, own) if own else MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = cls(config).float()
    probe.cache.clear()
    return model


def _step(model):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (2, 6))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fused_classes(model):
    """Attention classes of the model whose RoPE calls are counted (swapped sites), with their counts."""
    per_class = {}
    for module in model.modules():
        site = module.__dict__.get(rope.SITE_ATTR)
        if site is not None:
            outcomes = per_class.setdefault(type(module).__name__, {})

            def count(outcome, outcomes=outcomes, real=site.count):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                real(outcome)

            site.count = count
    return per_class


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in QUICK else pytest.mark.slow) for f in FAMILIES])
def test_the_family_rope_runs_the_kernel_and_trains_like_stock(family):
    stock = _model(family)
    swapped = copy.deepcopy(stock)
    report = accel_patch.swap_kernels(swapped, ops=["rope"])
    assert not [r for r in report.refused if r.op == "rope"], report.refused
    per_class = _fused_classes(swapped)
    want_loss, want_grads = _step(stock)
    loss, grads = _step(swapped)
    calls = accel_patch.report(swapped).calls["rope"]
    assert calls.get(rope.FUSED, 0) > 0 and set(calls) == {rope.FUSED}, calls
    assert set(per_class) == FAMILIES[family][2], per_class
    assert all(outcomes == {rope.FUSED: outcomes.get(rope.FUSED)} and outcomes[rope.FUSED] > 0
               for outcomes in per_class.values()), per_class
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_llama4_complex_rope_is_refused_with_its_form_named():
    model = _model("Llama4TextConfig", num_local_experts=4, intermediate_size_mlp=48, head_dim=16)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    reasons = {r.reason for r in report.refused if r.op == "rope"}
    assert reasons and all("apply_rotary_emb" in r and "complex" in r for r in reasons), reasons
    assert "rope" not in report.swapped


@pytest.mark.slow
def test_deepseek_v4_one_tensor_rope_is_refused_with_its_form_named():
    # it rotates the last dims of each head, in pairs, on half-width tables: no form the kernel takes
    model = _model("DeepseekV4Config", **{**MLA, "head_dim": 16})  # 8 rotary dims of 16: the last ones
    report = accel_patch.swap_kernels(model, ops=["rope"])
    reasons = {r.reason for r in report.refused if r.op == "rope"}
    assert reasons and all("one-tensor form" in r and "(x, cos, sin)" in r for r in reasons), reasons


def _call_swapped(key, *args, **kwargs):
    """The module global of `key` called as a swapped attention forward calls it (gate open)."""
    import sys

    counter = rope.gate(key).counter()
    counter.depth += 1
    try:
        return sys.modules[key[0]].__dict__[key[1]](*args, **kwargs)
    finally:
        counter.depth -= 1


def test_the_interleave_dispatcher_sends_only_the_calls_the_probe_proved():
    from accel_kernels import _launch

    model = _model("deepseek_v3")
    attention = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention")
    key = rope.rope_function(attention, model.config)
    plan = rope.probe_verdict(key, attention, model.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and plan.form == "interleave", plan
    # DeepSeek's function takes (B, S, H, D) calls, not k=None nor heads wider than the tables
    assert plan.bshd and not plan.q_alone and not plan.partial and not plan.cast_back, plan
    hold = rope.Hold(plan)
    try:
        original = rope.interceptions.original(key)
        q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
        cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        with _launch.recording() as launched:
            got = _call_swapped(key, q, k, cos, sin, unsqueeze_dim=2)
        assert launched == ["_rope_kernel"]
        for g, w in zip(got, original(q, k, cos, sin, unsqueeze_dim=2)):
            torch.testing.assert_close(g, w)
        # a partial-rotary call the function rejects: it runs (and raises) as stock, no kernel
        with _launch.recording() as launched, pytest.raises(RuntimeError):
            _call_swapped(key, torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), cos[..., :4], sin[..., :4])
        assert launched == []
    finally:
        hold.release()


@pytest.mark.slow
def test_deepseek_interleave_function_of_transformers_4_gets_its_own_form(monkeypatch):
    # before transformers 5 the function de-interleaved q and k (view/transpose) and applied
    # rotate-half on the whole table: a different function on tables other than cat(freqs, freqs)
    model = _model("deepseek_v3")
    module = __import__(type(model).__module__, fromlist=["_"])

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        b, h, s, d = q.shape
        q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        b, h, s, d = k.shape
        k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    monkeypatch.setattr(module, "apply_rotary_pos_emb_interleave", apply_rotary_pos_emb_interleave)
    attention = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention")
    plan = rope.probe_verdict(rope.rope_function(attention, model.config), attention, model.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and plan.form == "interleave_table", plan
    stock = copy.deepcopy(model)
    accel_patch.swap_kernels(model, ops=["rope"])
    want_loss, want_grads = _step(stock)
    loss, grads = _step(model)
    assert accel_patch.report(model).calls["rope"] == {rope.FUSED: len(model.model.layers)}
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
