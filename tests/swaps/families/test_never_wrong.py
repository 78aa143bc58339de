"""The 2026 families where a swap could raise, be wrong or claim what did not run (tiny configs,
random weights): each is refused with its reason where it cannot be proved, and the rest swaps."""
from __future__ import annotations

import pytest
import torch

from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import probe

transformers = pytest.importorskip("transformers")


def _gemma4_per_layer():
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("transformers has no Gemma 4")
    cfg = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, attention_k_eq_v=True,
        num_global_key_value_heads=1, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    restore_kernels(model)  # the load hook swapped it: each test swaps afresh
    probe.cache.clear()
    return model


def test_a_per_layer_configuration_never_raises_out_of_the_swap_and_the_rest_swaps():
    # Gemma 4's 26B-A4B / 31B shape: a global read of num_key_value_heads raises (not an AttributeError)
    model = _gemma4_per_layer()
    report = swap_kernels(model, ops=["rms_norm", "glu", "rope"])
    assert report.swapped.get("rms_norm", 0) > 0 and report.swapped.get("glu", 0) > 0
    # the full-attention layer's own entry is read: no refusal names the ambiguous global read
    assert not [r for r in report.refused if "per-layer" in r.reason or "Ambiguous" in r.reason], report.refused


def test_a_site_whose_structure_read_raises_is_refused_with_the_error_not_the_swap(monkeypatch):
    from accel_patch.swaps.layers import rope

    model = _gemma4_per_layer()

    def unreadable(module, config):
        raise RuntimeError("per-layer attribute read")

    monkeypatch.setattr(rope, "head_shape", unreadable)
    report = swap_kernels(model, ops=["rms_norm", "rope"])
    reasons = [r.reason for r in report.refused if r.op == "rope"]
    assert reasons and all("RuntimeError: per-layer attribute read" in r for r in reasons), report.refused
    assert report.swapped.get("rms_norm", 0) > 0


def test_a_one_tensor_rope_function_runs_the_kernel_on_each_tensor():
    # Gemma 4's apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=2): the kernel rotates x alone
    from accel_patch import report as report_of
    from accel_patch.swaps.layers import rope

    model = _gemma4_per_layer()
    report = swap_kernels(model, ops=["rope"])
    assert report.swapped.get("rope") == 2 and not [r for r in report.refused if r.op == "rope"], report.refused
    model.train()
    ids = torch.randint(0, 128, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert report_of(model).calls["rope"] == {rope.FUSED: 2}
