"""Which sites are swapped: by structure, verified by the probe; impostors are refused with the reason."""
from __future__ import annotations

import pytest
import torch
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import accel_patch
from accel_patch import swap_kernels
from accel_patch.swaps import probe, sites
from accel_patch.swaps.layers import norms
from accel_patch.swaps.report import SwapReport
from accel_kernels import _launch as launch

from _models import build, padded_batch, rel, training_step


def refusals(report, op):
    return {r.where: r.reason for r in report.refused if r.op == op}


class OffsetNorm(LlamaRMSNorm):
    """Looks like LlamaRMSNorm (weight, variance_epsilon) but adds a constant."""

    def forward(self, hidden_states):
        return super().forward(hidden_states) + 0.01


# Says it is SiLU (same class name); computes GELU.
GeluNamedSilu = type("SiLUActivation", (SiLUActivation,), {"forward": lambda self, x: torch.nn.functional.gelu(x)})


class UpGateMLP(LlamaMLP):
    """Shaped like LlamaMLP, with gate and up exchanged."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_a_norm_subclass_that_overrides_forward_is_refused_and_stays_stock():
    model = build("llama")
    model.model.norm.__class__ = OffsetNorm
    stock_out = model.model.norm(torch.randn(2, 64))
    report = swap_kernels(model)
    why = refusals(report, "rms_norm")
    assert set(why) == {"model.norm"}, report
    assert "differs from every RMSNorm variant" in why["model.norm"]
    assert report.swapped["rms_norm"] == 4  # the layers' own norms
    assert not sites.is_swapped(model.model.norm)
    torch.manual_seed(0)
    x = torch.randn(2, 64)
    assert torch.equal(model.model.norm(x), LlamaRMSNorm.forward(model.model.norm, x) + 0.01)
    assert stock_out.shape == (2, 64)


def test_an_activation_that_is_not_what_its_name_says_is_refused():
    model = build("llama")
    model.model.layers[1].mlp.act_fn.__class__ = GeluNamedSilu
    report = swap_kernels(model)
    why = refusals(report, "glu")
    assert set(why) == {"model.layers.1.mlp"}, report
    assert "does not compute silu" in why["model.layers.1.mlp"]
    assert report.swapped["glu"] == 1


def test_an_mlp_subclass_computing_another_function_is_refused():
    model = build("llama")
    model.model.layers[0].mlp.__class__ = UpGateMLP
    report = swap_kernels(model)
    why = refusals(report, "glu")
    assert set(why) == {"model.layers.0.mlp"} and "differs from down(silu(gate) * up)" in why["model.layers.0.mlp"]


def test_an_activation_without_a_kernel_is_refused_by_name():
    model = build("llama", hidden_act="quick_gelu")
    report = swap_kernels(model)
    assert "glu" not in report.swapped
    assert all("QuickGELUActivation has no kernel" in r for r in refusals(report, "glu").values())
    assert len(refusals(report, "glu")) == 2


def test_a_refused_model_still_trains_exactly_as_stock():
    stock, twin = build("llama"), build("llama")
    for m in (stock, twin):
        m.model.layers[0].mlp.__class__ = UpGateMLP
        m.model.norm.__class__ = OffsetNorm
    swap_kernels(twin)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4


def test_ops_narrow_the_swap_and_a_second_call_swaps_nothing_twice():
    model = build("llama")
    first = swap_kernels(model, ops="rms_norm, rope")
    assert set(first.swapped) == {"rms_norm", "rope"} and first.new == 7
    forwards = {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}
    again = swap_kernels(model, ops=["rope", "rms_norm"])
    assert again.new == 0 and again.swapped == first.swapped
    assert {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__} == forwards
    rest = swap_kernels(model)
    # glu 2, the loss 1, lora_mlp 2, one LoRA site per attention (serving lora_qkv and lora_o) 2, tiled_mlp 2
    assert rest.new == 9 and set(rest.swapped) == {"rms_norm", "rope", "glu", "fused_linear_cross_entropy", "tiled_mlp"}
    assert rest.waiting == {"lora_mlp": 2, "lora_qkv": 2, "lora_o": 2}  # no adapter: not swapped in effect
    assert swap_kernels(model, ops=["swiglu"]).new == 0  # an alias of glu
    # every swapped module holds exactly one swapped forward, nothing wrapped twice
    assert not any(sites.INNER_ATTR in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("ops, word", [("rms_norm,attention", "'attention'"), (["relu"], "'relu'"), (3, "3")])
def test_unknown_ops_are_a_clear_error(ops, word):
    with pytest.raises(ValueError) as info:
        swap_kernels(build("llama"), ops=ops)
    assert word in str(info.value)
    assert "rms_norm" in str(info.value)  # says what is valid


def test_a_non_module_is_a_clear_error():
    with pytest.raises(TypeError, match="torch.nn.Module.*got dict"):
        swap_kernels({"model": 1})


def test_the_probe_past_the_limits_warns_nothing_stock_does_not(recwarn):
    # under the interpreter numpy computes the kernels: a tanh-GELU probed past its limits takes
    # exp of 1e4-sized inputs to inf on purpose (the sigmoid is 0, as on a GPU), which numpy would
    # tell a user whose stock model is silent
    probe.cache.clear()
    with launch.recording() as launched:
        report = swap_kernels(build("gemma2"), ops="glu")
    assert report.swapped["glu"] == 2 and any("glu" in k for k in launched), launched
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in recwarn]


def test_the_probe_runs_once_per_class_dtype_and_device(monkeypatch):
    probe.cache.clear()
    calls = []
    real = norms.probe_verdict
    monkeypatch.setattr(norms, "probe_verdict", lambda *a, **k: calls.append(type(a[0])) or real(*a, **k))
    swap_kernels(build("llama"))
    swap_kernels(build("llama"))
    assert calls == [LlamaRMSNorm]
    swap_kernels(build("llama", rms_norm_eps=1e-5).to(torch.bfloat16))
    assert calls == [LlamaRMSNorm, LlamaRMSNorm]
    assert len(probe.cache) >= 2


def test_report_reads_as_a_table_and_one_line():
    report = swap_kernels(build("cohere", logit_scale=0.5))
    table = str(report)
    assert table.splitlines()[0] == "kernel swap report for CohereForCausalLM"
    assert "glu" in table and "swapped" in table and "refused" in table
    assert "LayerNorm (mean-centred): no kernel" in table and "interleaved" in table
    assert "waiting" in table and "no LoRA adapter on these modules yet" in table  # sites without adapters
    line = report.summary()
    assert line.startswith("CohereForCausalLM: swapped glu 2, fused_linear_cross_entropy 1, tiled_mlp 2; refused rms_norm x")
    assert line.endswith("; waiting for LoRA adapters: lora_mlp 2, lora_qkv 2, lora_o 2")
    assert report.to_dict()["swapped"] == {"glu": 2, "fused_linear_cross_entropy": 1, "tiled_mlp": 2}
    assert report.short() == f"glu+tiled 2, fused_linear_cross_entropy 1; {len(report.refused)} refused"
    ops = {"rms_norm": 65, "rope": 32, "glu": 32, "fused_linear_cross_entropy": 1, "lora_mlp": 32, "lora_qkv": 32,
           "lora_o": 32, "tiled_mlp": 32}
    big = SwapReport("LlamaForCausalLM", ops, refused=report.refused[:1])
    assert len(big.short()) <= 100, big.short()  # a logged value (AccelPatchCallback)
    # TRL's head and 64 more refusals: a 108-character line once overflowed; it now fits, still naming every op
    ran = {"fused_linear_cross_entropy": {"fused (in TRL's head)": 2}}
    trl = SwapReport("LlamaForCausalLM", ops, refused=report.refused[:1] * 65, head="ours", calls=ran)
    assert len(trl.short()) <= 100 and trl.short().endswith("; 65 refused; LM head: ours, in TRL's place"), trl.short()
    # installed, and no call asked for it (GKD's loss never does): never "ours" then
    idle = SwapReport("LlamaForCausalLM", {"rms_norm": 5, "fused_linear_cross_entropy": 1}, head="ours",
                      calls={"fused_linear_cross_entropy": {"stock head: a training call without labels": 2}})
    assert idle.head_ran() == "ours, never called"
    assert idle.short() == "rms_norm 5; LM head: ours, never called; loss: not run (see fall-backs)", idle.short()
    assert trl.short().startswith("norm 65, rope 32, glu+tiled 32, loss 1, lora mlp/qkv/o 32;")
    # the head line says whose head ran the counted calls, never ours where TRL's ran
    fell = {"fused_linear_cross_entropy": {"TRL's head: MoE router logits": 3}}
    assert SwapReport("M", ops, head="ours", calls=fell).head_ran() == "TRL's (ours stood aside, see fall-backs)"
    assert SwapReport("M", ops, head="ours", calls=fell).to_dict()["head"] == "TRL's (ours stood aside, see fall-backs)"
    assert SwapReport("M", ops, head="ours", calls=fell).to_dict()["head_installed"] == "ours"
    both = {"fused_linear_cross_entropy": {"TRL's head: no labels": 1, "fused (in TRL's head)": 3,
                                           "fused (in TRL's head, no grad)": 2, "TRL's head: evaluation mode": 4}}
    assert SwapReport("M", ops, head="ours", calls=both).head_ran() == "ours, TRL's in 1 of 6 calls"
    assert SwapReport("M", {"rms_norm": 5}, head="ours", calls=both).short().endswith("; LM head: ours, TRL's in 1 of 6 calls")


def test_status_has_a_kernels_record_that_counts_swapped_models():
    model = build("llama")
    swap_kernels(model)
    record = next(s for s in accel_patch.status() if s.name == "kernels")
    assert "LlamaForCausalLM: swapped rms_norm 5, rope 2, glu 2, fused_linear_cross_entropy 1" in record.reason
    assert "live model(s)" in record.reason


def test_one_log_line_per_swapped_model(caplog):
    with caplog.at_level("INFO", logger="accel_patch"):
        swap_kernels(build("mixtral"))
        swap_kernels(build("mixtral"))
    lines = [r.getMessage() for r in caplog.records if r.name == "accel_patch"]
    assert len(lines) == 2
    assert lines[0] == ("accel_patch: MixtralForCausalLM: swapped rms_norm 5, rope 2, fused_linear_cross_entropy 1, "
                        "experts 2; waiting for LoRA adapters: lora_qkv 2, lora_o 2")


def test_a_family_nobody_listed_is_swapped_where_it_matches_t5():
    """T5 calls its RMSNorm "T5LayerNorm", has no rotate-half RoPE, a gated MLP named wi_0/wi_1/wo,
    and computes its loss with nn.CrossEntropyLoss: the norms and the loss are swapped, and one
    training step equals stock."""
    import copy

    import transformers as T

    torch.manual_seed(0)
    stock = T.T5ForConditionalGeneration(T.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                    num_heads=4, decoder_start_token_id=0, dropout_rate=0.0,
                                                    feed_forward_proj="gated-gelu"))
    twin = copy.deepcopy(stock)
    report = swap_kernels(twin)
    assert report.swapped == {"rms_norm": 12, "fused_linear_cross_entropy": 1}, report
    ids, labels = torch.randint(1, 64, (2, 7)), torch.randint(1, 64, (2, 5))
    labels[0, 3:] = -100
    batch = {"input_ids": ids, "labels": labels}
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    assert out.logits is None
