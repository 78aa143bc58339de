"""RoPE counts its calls as every site does: "fused" only where the kernel ran, and what ran
instead (and why) everywhere else; MLA attentions run the kernel for the function they call."""
from __future__ import annotations

import pytest
import torch

import accel_patch
from accel_patch.swaps import probe
from accel_patch.swaps.layers import rope
from accel_patch.swaps.report import is_fallback

from _models import build, padded_batch, training_step

transformers = pytest.importorskip("transformers")


def _swapped_llama():
    model = build("llama")
    accel_patch.restore_kernels(model)
    accel_patch.swap_kernels(model, ops=["rope"])
    return model


def test_rope_calls_are_counted_fused_where_the_kernel_ran():
    model = _swapped_llama()
    training_step(model, padded_batch())
    calls = accel_patch.report(model).calls["rope"]
    assert calls == {rope.FUSED: len(model.model.layers)}, calls


@pytest.mark.slow  # two aot_eager compiles of a training step: ~7 s
def test_a_compiled_graph_counts_its_rope_once_per_attention_with_what_it_runs(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = _swapped_llama()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # the second call runs the same graph: no second count
        training_step(compiled, padded_batch())
    calls = accel_patch.report(model).calls["rope"]
    assert calls == {"compiled: " + rope.FUSED: len(model.model.layers)}, calls
    # a graph whose attention never reaches the dispatched function says so, never "fused"
    other = _swapped_llama()
    key = (modeling_llama.__name__, "apply_rotary_pos_emb")
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope.interceptions.original(key))
    torch._dynamo.reset()
    training_step(torch.compile(other, backend="aot_eager", fullgraph=True), padded_batch())
    calls = accel_patch.report(other).calls["rope"]
    assert [k for k in calls if rope.FUSED in k] == [] and sum(calls.values()) == len(other.model.layers), calls
    assert all(k.startswith("compiled: another function") and is_fallback(k) for k in calls), calls
    torch._dynamo.reset()


def test_a_call_that_ran_another_function_is_counted_as_a_fallback_not_fused(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = _swapped_llama()
    key = (modeling_llama.__name__, "apply_rotary_pos_emb")
    # the forward now calls something other than the dispatched function (another RoPE form)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope.interceptions.original(key))
    training_step(model, padded_batch())
    calls = accel_patch.report(model).calls["rope"]
    assert rope.FUSED not in calls and sum(calls.values()) == len(model.model.layers), calls
    (outcome,) = calls
    assert "did not call apply_rotary_pos_emb" in outcome and is_fallback(outcome)


def _deepseek_v3(rope_interleave: bool):
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("transformers has no DeepSeek V3")
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        rope_interleave=rope_interleave)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    accel_patch.restore_kernels(model)
    probe.cache.clear()
    return model


@pytest.mark.parametrize("rope_interleave", [True, False])
def test_an_mla_attention_runs_the_kernel_for_the_function_rope_interleave_picks(rope_interleave):
    model = _deepseek_v3(rope_interleave=rope_interleave)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    assert report.swapped.get("rope") == 1 and not [r for r in report.refused if r.op == "rope"], report.refused
    batch = {"input_ids": torch.randint(0, 64, (2, 6)), "labels": torch.randint(0, 64, (2, 6))}
    model.train()
    model(**batch).loss.backward()
    assert accel_patch.report(model).calls["rope"] == {rope.FUSED: 1}
