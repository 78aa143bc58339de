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


def counting_implementations(monkeypatch):
    """transformers' batched_mm and grouped_mm experts functions, wrapped to count their calls."""
    calls = {"batched_mm": 0, "grouped_mm": 0}
    mapping = dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping)
    for name in calls:
        def counted(*args, _real=mapping[name], _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        mapping[name] = counted
    monkeypatch.setattr(moe.ALL_EXPERTS_FUNCTIONS, "_global_mapping", mapping)
    return calls


def test_an_experts_implementation_set_after_the_swap_runs_counted_as_the_users_choice(monkeypatch):
    # transformers' own tests name each implementation on a loaded (so swapped) model and check it ran
    on_the_twin(monkeypatch)
    from accel_patch.swaps import report as report_rules
    from accel_patch.swaps.experts import site

    model = build("qwen3_moe")
    accel_patch.swap_kernels(model)  # its probe runs the module's own forward (grouped_mm): before counting
    calls = counting_implementations(monkeypatch)
    n, ids = len(experts_modules(model)), torch.randint(0, 50, (2, 7))
    model(ids)
    assert accel_patch.report(model).calls["experts"] == {"fused": n} and calls == {"batched_mm": 0, "grouped_mm": 0}
    for implementation in ("batched_mm", "grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        before = dict(calls)
        model(ids)
        outcome = f"{site.USERS_CHOICE}: experts_implementation {implementation!r} set after the swap"
        assert accel_patch.report(model).calls["experts"][outcome] == n
        assert report_rules.outcome_kind(outcome) == "by design"
        ran = {name: calls[name] - before[name] for name in calls}
        assert ran == {name: n if name == implementation else 0 for name in calls}
    model.set_experts_implementation(interface.NAME)  # the op through the interface: the swap's forward again
    model(ids)
    assert accel_patch.report(model).calls["experts"]["fused"] == 2 * n


def test_transformers_switch_around_decoding_is_not_the_users_choice(monkeypatch):
    # generate() on a GPU switches grouped_mm to batched_mm for decoding and back: the swap stays
    on_the_twin(monkeypatch)
    model = build("qwen3_moe")
    accel_patch.swap_kernels(model)
    switched = []
    real = type(model).set_experts_implementation

    def watched(self, implementation):
        switched.append(implementation)
        return real(self, implementation)

    monkeypatch.setattr(type(model), "set_experts_implementation", watched)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with model._optimize_model_for_decode():
        model(torch.randint(0, 50, (2, 7)))
    model(torch.randint(0, 50, (2, 7)))
    assert len(switched) == 2  # there and back
    assert accel_patch.report(model).calls["experts"] == {"fused": 2 * len(experts_modules(model))}
