"""What ran, said out loud: `accel_patch.report(model)` is the live report, the fused
loss's calls are counted in `calls` beside the LoRA sites', one rule says which outcome is a
fall-back, and LoRA sites without an adapter are not reported as swapped."""
from __future__ import annotations

import copy

import pytest
from peft import LoraConfig, get_peft_model

import accel_patch
from accel_patch.swaps import lora, report as report_module
from accel_patch.swaps.layers import tiled_mlp
from accel_patch.swaps.report import SwapReport, fallback_line, fallbacks_since, outcome_kind

from _models import build, padded_batch, training_step


def test_one_rule_says_which_outcome_ran_the_kernel_and_which_fell_back():
    assert report_module.SUCCESSES == ("fused", "tiled")
    for outcome in (lora.FUSED, "fused (in TRL's head)", "tiled"):
        assert outcome_kind(outcome) == "success", outcome
    # nothing for the kernel to do, or stock the faster choice (small logits on CPU without Triton)
    # ... or a call the tiled MLP does not pay for (short, no grad, eval, not checkpointed by default)
    for outcome in (lora.NO_ADAPTER, "TRL's head: evaluation mode",
                    "stood aside: small logits on CPU without Triton (stock is faster there)",
                    tiled_mlp.SHORT, tiled_mlp.NO_GRAD, tiled_mlp.EVAL, tiled_mlp.NO_CHECKPOINTING):
        assert outcome_kind(outcome) == "by design", outcome
    # a site traced by torch.compile counts once per graph: classified by what follows the prefix
    assert outcome_kind(lora.COMPILED + lora.FUSED) == "success"
    assert outcome_kind(lora.COMPILED + "PEFT's forward: DoRA") == "fall-back"
    assert outcome_kind(lora.COMPILED + lora.NO_ADAPTER) == "by design"
    for outcome in ("PEFT's forward: a LoRA variant (DoraLinearVariant, e.g. DoRA)", "stood aside: small logits",
                    "DTensor input or parameters: the module's forward",
                    "logits computed for softmax", "TRL's head: no labels", "fusedness unknown", "tiled-ish"):
        assert outcome_kind(outcome) == "fall-back", outcome


def test_fallbacks_since_the_last_log_fit_one_console_line():
    calls = {"lora_mlp": {"fused": 3, "PEFT's forward: autocast is on": 2},
             "fused_linear_cross_entropy": {"fused": 1, "stood aside: " + "x" * 150: 4}}
    before = report_module.calls_snapshot(calls)
    assert fallbacks_since(calls, before) == []
    calls["lora_mlp"]["PEFT's forward: autocast is on"] += 5
    calls["lora_mlp"]["fused"] += 9
    calls["lora_mlp"][lora.NO_ADAPTER] = 7
    calls["lora_o"] = {"PEFT's forward: dropout in training": 1}
    items = fallbacks_since(calls, before)
    assert items == [("lora_mlp", "PEFT's forward: autocast is on", 5), ("lora_o", "PEFT's forward: dropout in training", 1)]
    assert fallback_line(items) == "lora_mlp x5 PEFT's forward: autocast is on; lora_o x1 PEFT's forward: dropout in training"
    calls["fused_linear_cross_entropy"]["stood aside: " + "x" * 150] += 2
    line = fallback_line(fallbacks_since(calls, before))
    assert len(line) <= 100 and line.startswith("lora_mlp x5 PEFT's forward: autocast is on") and line.endswith("; +2 more")


@pytest.mark.slow  # the probes and a fused step under the Triton interpreter: ~9 s
def test_report_is_live_and_counts_the_fused_loss_and_lora_calls():
    model = build("llama")
    assert accel_patch.report(model) is None  # never swapped
    accel_patch.swap_kernels(model)
    report = accel_patch.report(model)
    # a full fine-tune: the LoRA sites wait for adapters, they are not swapped
    assert set(report.swapped) == {"rms_norm", "rope", "glu", "fused_linear_cross_entropy", "tiled_mlp"}, report.swapped
    assert report.waiting == {"lora_mlp": 2, "lora_qkv": 2, "lora_o": 2}
    assert "lora" not in report.short() and "waiting" in str(report)
    training_step(model, padded_batch())
    # live: the step is counted (the tiled MLP decides per call too: short sequences run the MLP whole)
    assert report.calls == {"fused_linear_cross_entropy": {"fused": 1}, "tiled_mlp": {tiled_mlp.SHORT: 2},
                            "rope": {"fused": 2}}
    assert "fused_linear_cross_entropy" in str(report) and "calls" in str(report)

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True,
                                            lora_dropout=0.0))
    now = accel_patch.report(peft)  # through PEFT's wrapper: the adapters are there now
    assert now.waiting == {} and {"lora_mlp": 2, "lora_qkv": 2, "lora_o": 2}.items() <= now.swapped.items()
    training_step(peft, padded_batch())
    dora = "PEFT's forward: a LoRA variant (DoraLinearVariant, e.g. DoRA)"
    assert now.calls["lora_mlp"] == {dora: 2} and now.calls["fused_linear_cross_entropy"] == {"fused": 2}
    assert "(fall-back)" in str(now)


@pytest.mark.slow
def test_adapters_on_some_modules_only_swap_those_sites():
    model = get_peft_model(copy.deepcopy(build("llama")), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    accel_patch.swap_kernels(model)
    report = accel_patch.report(model)
    assert report.swapped["lora_qkv"] == 2 and "lora_o" not in report.swapped and "lora_mlp" not in report.swapped
    assert report.waiting == {"lora_mlp": 2, "lora_o": 2}
    assert SwapReport("M", {"lora_o": 2}, waiting={"lora_o": 2}).swapped == {}
