"""A model swapped before its weights exist (built under accelerate's `init_empty_weights`, whose
`from_config` the load hook swaps) gets its kernels at the next swap once the weights are loaded,
and a site walked twice (a part swapped on its own, then the whole model) is refused once."""
from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from accel_patch import report, swap_kernels
from accel_patch.swaps import apply, probe
from accel_patch.swaps.layers import norms

from _models import build, padded_batch, training_step

OPS = ("rms_norm", "rope", "glu", "fused_linear_cross_entropy")


def test_a_model_loaded_after_an_empty_init_gets_its_kernels_at_the_next_swap(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    stock = build("llama")
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(stock.config)  # swapped by the load hook: nothing to probe
    at_load = report(model)
    assert at_load is not None and not at_load.swapped
    assert {r.op for r in at_load.refused if r.reason == apply.META} >= set(OPS), at_load.refused

    model.load_state_dict(stock.state_dict(), assign=True)
    swapped = swap_kernels(model)  # what the Trainer callback calls at its start
    assert swapped.new > 0
    assert not [r for r in swapped.refused if r.reason == apply.META], swapped.refused
    for op in OPS:
        assert swapped.swapped.get(op, 0) > 0, (op, swapped.swapped)

    batch = padded_batch()
    loss, grads, _ = training_step(model, batch)
    ref_loss, ref_grads, _ = training_step(stock, batch)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), name
    assert report(model).calls["fused_linear_cross_entropy"].get("fused") == 1  # the kernels ran

    again = swap_kernels(model)  # decided: nothing walked twice, nothing refused twice
    assert again.new == 0 and again.swapped == swapped.swapped and again.refused == swapped.refused


def test_a_site_walked_again_is_refused_once(monkeypatch):
    probe.cache.clear()
    monkeypatch.setattr(norms, "probe_verdict", lambda *args, **kwargs: "refused by this test")
    try:
        model = build("llama")
        swap_kernels(model.model, ops="rms_norm")  # a part on its own first
        whole = swap_kernels(model, ops="rms_norm")
    finally:
        probe.cache.clear()
    refused = [r for r in whole.refused if r.op == "rms_norm"]
    n_norms = sum(1 for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    assert len(refused) == n_norms == len(set(refused)), refused


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
