"""A gated MLP that calls its activation in its forward (LFM2's `F.silu(self.w1(x)) * self.w3(x)`)
runs the GLU kernel, probe-verified, and trains as stock."""
from __future__ import annotations

import copy

import pytest
import torch

import accel_patch
from accel_kernels import _launch
from accel_patch.swaps import probe

transformers = pytest.importorskip("transformers")


def test_lfm2s_mlp_runs_the_glu_kernel_and_trains_as_stock():
    if not hasattr(transformers, "Lfm2Config"):
        pytest.skip("transformers has no LFM2")
    cfg = transformers.Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg)
    accel_patch.restore_kernels(stock)
    probe.cache.clear()
    ours = copy.deepcopy(stock)
    report = accel_patch.swap_kernels(ours, ops=["glu"])
    assert report.swapped == {"glu": 2}, report
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    grads = []
    for model in (stock, ours):
        model.train()
        with _launch.recording() as launched:
            loss = model(**batch).loss
            loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, launched))
    (l0, g0, _), (l1, g1, launched) = grads
    assert launched.count("_glu_forward_kernel") == 2 and launched.count("_glu_backward_kernel") == 2, launched
    assert torch.allclose(l0, l1, rtol=1e-6, atol=1e-6)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], rtol=1e-4, atol=1e-6), name
