"""An op decided per call whose every counted call fell back is "not run": the report, its table,
its log line and the first training log (`short()`) never list it as swapped."""
from __future__ import annotations

import pytest

import accel_patch
from accel_patch.swaps.layers import rope
from accel_patch.swaps.report import SwapReport

from _models import build, padded_batch, training_step

SHAPE = rope.SHAPE  # "a shape the kernel does not take: the function itself": a fall-back


def _report(calls):
    return SwapReport("M", {"rms_norm": 5, "rope": 2, "fused_linear_cross_entropy": 1}, calls=calls)


def test_an_op_whose_every_call_fell_back_is_not_run_and_not_swapped():
    calls = {"rope": {SHAPE: 4}}
    report = _report(calls)
    assert report.swapped == {"rms_norm": 5, "fused_linear_cross_entropy": 1} and report.not_run == {"rope": 2}
    assert report.short() == "rms_norm 5, fused_linear_cross_entropy 1; rope: not run (see fall-backs)"
    assert f"not run rope x2 (every call fell back: {SHAPE})" in report.summary()
    assert "swapped rms_norm 5, fused_linear_cross_entropy 1;" in report.summary()
    rows = [line.split()[:3] for line in str(report).splitlines()[2:]]
    assert ["rope", "2", "not"] in [r[:3] for r in rows] and ["rope", "2", "swapped"] not in rows, rows
    assert report.to_dict()["not_run"] == {"rope": 2} and "rope" not in report.to_dict()["swapped"]
    # live: one call that runs the kernel makes it swapped again
    calls["rope"][rope.FUSED] = 1
    assert report.swapped["rope"] == 2 and report.not_run == {}
    assert report.short().startswith("rms_norm 5, rope 2,")


@pytest.mark.parametrize("calls", [{}, {"rope": {rope.NO_TRITON: 3}}, {"rope": {rope.FUSED: 1, SHAPE: 9}}])
def test_no_calls_yet_by_design_calls_or_some_kernel_calls_leave_the_op_swapped(calls):
    report = _report(calls)
    assert report.swapped["rope"] == 2 and report.not_run == {} and "not run" not in report.short() + str(report)


@pytest.mark.slow  # probes and a training step under the interpreter: ~5-10 s
def test_a_swapped_model_whose_rope_calls_all_ran_another_function_says_not_run(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = build("llama")
    accel_patch.restore_kernels(model)
    assert accel_patch.swap_kernels(model, ops=["rope", "rms_norm"]).swapped["rope"] == len(model.model.layers)
    key = (modeling_llama.__name__, "apply_rotary_pos_emb")
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rope.interceptions.original(key))
    training_step(model, padded_batch())
    report = accel_patch.report(model)
    assert "rope" not in report.swapped and report.not_run == {"rope": len(model.model.layers)}
    assert report.short().startswith("rms_norm ") and report.short().endswith("; rope: not run (see fall-backs)")
