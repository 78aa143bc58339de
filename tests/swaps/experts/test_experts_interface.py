"""`experts_implementation="accel_patch"`: transformers' own way to pick an experts forward runs
the experts op without the swap, with the swap's probe, counting and LoRA handling."""
from __future__ import annotations

import pytest
import torch

import accel_patch
from accel_patch import restore_kernels
from accel_patch.swaps.experts import interface

from _models import padded_batch, rel, training_step
from _moe_models import build, experts_modules

moe = pytest.importorskip("transformers.integrations.moe")


def on_the_twin(monkeypatch):
    from accel_kernels import _dispatch

    monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)


def unswapped(family, implementation):
    model = build(family)
    restore_kernels(model)  # no swap: the interface alone
    model.set_experts_implementation(implementation)
    return model


def test_the_entry_is_registered_and_a_step_equals_grouped_mms_counted_as_the_op(monkeypatch):
    assert interface.NAME in moe.ALL_EXPERTS_FUNCTIONS
    on_the_twin(monkeypatch)  # the op's twin: the site's plan and counting (the kernel: test_experts)
    stock, ours = unswapped("qwen3_moe", "grouped_mm"), unswapped("qwen3_moe", "accel_patch")
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(ours, batch)
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    n = len(experts_modules(ours))
    assert accel_patch.report(ours).calls["experts"] == {"fused": n}
    assert accel_patch.report(stock) is None  # grouped_mm: nothing of ours ran


def test_a_module_the_probe_refuses_runs_grouped_mm_counted_with_the_reason(monkeypatch):
    on_the_twin(monkeypatch)
    model = unswapped("qwen3_moe", "accel_patch")
    monkeypatch.setattr(interface.experts_site, "probe_verdict", lambda *a: "output differs (a test's refusal)")
    from accel_patch.swaps import probe

    probe.cache.clear()
    batch = padded_batch()
    training_step(model, batch)
    assert accel_patch.report(model).calls["experts"] == {interface.REFUSED: len(experts_modules(model))}
    assert all(m.__dict__[interface.REFUSED_ATTR] == "output differs (a test's refusal)"
               for m in experts_modules(model).values())


@pytest.mark.parametrize("switch", ["ACCEL_PATCH_EXPERTS_TILE_BUDGET", "ACCEL_PATCH_EXPERTS_BACKWARD"])
def test_a_bad_experts_switch_refuses_the_module_with_its_error_and_runs_grouped_mm(monkeypatch, switch):
    on_the_twin(monkeypatch)
    from accel_patch.swaps import probe

    probe.cache.clear()  # the verdict passes: the refusal is the switch's
    monkeypatch.setenv(switch, "lots")
    model = unswapped("qwen3_moe", "accel_patch")
    training_step(model, padded_batch())  # no error reaches the step
    assert accel_patch.report(model).calls["experts"] == {interface.REFUSED: len(experts_modules(model))}
    assert all(m.__dict__[interface.REFUSED_ATTR].startswith(f"BadSwitch: {switch}='lots' is not")
               for m in experts_modules(model).values())


def test_disabling_accel_patch_removes_the_entry():
    accel_patch.disable()
    try:
        assert interface.NAME not in moe.ALL_EXPERTS_FUNCTIONS
    finally:
        accel_patch.enable()
    assert interface.NAME in moe.ALL_EXPERTS_FUNCTIONS
