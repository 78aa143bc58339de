"""A site whose forward another tool rebinds after the swap (Axolotl's LoRA kernels rebind
`mlp.forward` per instance) is reported as replaced, by whom, and no longer claimed; a wrapper
that calls through the swapped forward keeps the claim."""
from __future__ import annotations

import functools
import types

import pytest
import torch

import accel_patch
from accel_patch.swaps import sites

from _models import build, rel


def _their_forward(self, x):
    return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_a_forward_rebound_after_the_swap_drops_its_claim_and_names_who():
    model = build("llama")
    accel_patch.swap_kernels(model)
    before = accel_patch.report(model)
    mlp = model.model.layers[0].mlp
    ours = mlp.forward

    @functools.wraps(ours)
    def wrapper(*args, **kwargs):  # calls through ours: still ours that runs
        return ours(*args, **kwargs)

    mlp.forward = wrapper
    assert accel_patch.report(model).replaced == []
    mlp.forward = types.MethodType(_their_forward, mlp)
    report = accel_patch.report(model)
    assert report.swapped["glu"] == before.swapped["glu"] - 1
    assert report.swapped["tiled_mlp"] == before.swapped["tiled_mlp"] - 1
    rows = {(where, op) for where, op, _ in report.replaced}
    assert ("model.layers.0.mlp", "glu") in rows and ("model.layers.0.mlp", "tiled_mlp") in rows, rows
    assert all(by.endswith("_their_forward") for _, _, by in report.replaced)
    assert "replaced after the swap" in report.short() and "_their_forward" in str(report)
    accel_patch.restore_kernels(model)


def test_a_loaded_model_keeps_its_swapped_norms_when_transformers_kernelizes_again_at_train(tmp_path):
    """transformers (5.25, with the `kernels` package installed) loads with hub kernels on by default
    and kernelizes again at every train()/eval() switch: hub layers (the RMSNorms) get the hub
    kernel or their class's forward back. The swap goes on top of what that binds."""
    pytest.importorskip("kernels")
    build("llama").save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # swapped by the load hook
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers does not kernelize at load")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path)
    accel_patch.restore_kernels(stock)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    assert len(norms) == 5 and all(sites.is_swapped(m) for m in norms)
    ids = torch.arange(3, 13).view(1, 10)
    for mode in (True, False, True):  # each switch kernelizes again
        model.train(mode)
        stock.train(mode)
        assert all(sites.is_swapped(m) for m in norms), mode
        assert accel_patch.report(model).replaced == []
        with torch.no_grad():
            assert rel(model(ids).logits, stock(ids).logits) <= 1e-5
    accel_patch.restore_kernels(model)  # as kernelize left it: the class's forward (no hub kernel on CPU)
    assert not any(sites.is_swapped(m) or "forward" in m.__dict__ for m in norms)
    assert not any(k.startswith("_accel_patch") for m in model.modules() for k in m.__dict__)


def _hub_forward(self, x):
    return type(self).forward(self, x)


def test_a_hub_kernel_bound_at_a_mode_switch_runs_beneath_the_swap_and_is_what_restore_puts_back(tmp_path,
                                                                                                 monkeypatch):
    """Where the hub has a kernel for the device (a GPU), kernelize binds that layer's forward on the
    RMSNorms, not the class's: the swap goes on top of it, and restore leaves it there."""
    pytest.importorskip("kernels")
    import transformers.modeling_utils as modeling
    from transformers import AutoModelForCausalLM

    build("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers does not kernelize at load")

    def kernelize(m, **kwargs):  # as transformers' kernelize with a hub RMSNorm kernel for the device
        for module in m.modules():
            if getattr(type(module), "kernel_layer_name", None) == "RMSNorm":
                module.forward = types.MethodType(_hub_forward, module)

    monkeypatch.setattr(modeling, "kernelize", kernelize)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    stock = AutoModelForCausalLM.from_pretrained(tmp_path)
    accel_patch.restore_kernels(stock)
    ids = torch.arange(3, 13).view(1, 10)
    for mode in (True, False):
        model.train(mode)
        stock.train(mode)
        assert all(sites.is_swapped(m) for m in norms) and accel_patch.report(model).replaced == []
        with torch.no_grad():
            assert rel(model(ids).logits, stock(ids).logits) <= 1e-5
    accel_patch.restore_kernels(model)
    assert all(m.forward.__func__ is _hub_forward for m in norms)
    assert not any(k.startswith("_accel_patch") for m in model.modules() for k in m.__dict__)


def test_binding_again_that_fails_never_raises_out_of_train_and_is_recorded(tmp_path, monkeypatch):
    pytest.importorskip("kernels")
    from transformers import AutoModelForCausalLM

    from accel_patch.core import registry
    from accel_patch.swaps import apply

    build("llama").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers does not kernelize at load")
    monkeypatch.setitem(registry._states, "kernels", registry._states["kernels"])  # put back after the test
    monkeypatch.setattr(registry, "_logged", set())

    def broken(m):
        raise RuntimeError("rebind broke")

    monkeypatch.setattr(apply, "rebind_after_kernelize", broken)
    model.train()  # loaded in eval mode: the switch kernelizes again; the failure is recorded, never raised
    (kernels,) = [s for s in registry.status() if s.name == "kernels"]
    assert kernels.state == registry.FAILED and "rebind broke" in kernels.reason, kernels
    accel_patch.restore_kernels(model)
