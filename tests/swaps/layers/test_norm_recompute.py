"""A swapped attention's projections and a swapped MLP's gate and up keep the input norm's call
instead of its output (norms.recompute_scope): the gradients bit for bit as with the output kept,
one recompute a norm counted, and nothing done under gradient checkpointing, whose hooks decide."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

import accel_kernels.ops.rms_norm as kernel
from accel_patch import swap_kernels
from accel_patch.swaps import apply, sites
from accel_patch.swaps.layers import norms

from _models import build, padded_batch, training_step


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The tiny models' norm outputs are a few kilobytes: under the size the scope opens for, which
    the first test keeps."""
    monkeypatch.setattr(kernel, "RECOMPUTE_MIN_BYTES", 0)


def _recomputes(model) -> int:
    return apply.unwrap(model).__dict__[sites.STATE_ATTR].calls.get(norms.OP, {}).get(norms.RECOMPUTED, 0)


def _step_both_ways(model, monkeypatch, **kwargs):
    """(gradients with the norms recomputed, the recomputes counted, gradients with the outputs kept)."""
    batch = padded_batch()
    _, recomputed, _ = training_step(model, batch, **kwargs)
    counted = _recomputes(model)
    monkeypatch.setattr(kernel, "RECOMPUTE_OUTPUTS", False)
    _, kept, _ = training_step(model, batch, **kwargs)
    assert _recomputes(model) == counted  # switched off: nothing more recomputed
    monkeypatch.setattr(kernel, "RECOMPUTE_OUTPUTS", True)
    assert kept.keys() == recomputed.keys()
    for name in kept:
        assert torch.equal(kept[name], recomputed[name]), name
    return counted


# Qwen3: q/k norms inside the attention's scope (their rstd saved as they are); Phi3: a fused
# gate_up. Llama in the quick loop; the kernel's own tests hold the scope's rules there too.
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                    pytest.param("phi3", marks=pytest.mark.slow)])
def test_each_layer_recomputes_its_two_norms_with_the_same_gradients(family, monkeypatch):
    model = build(family, torch.bfloat16)
    swap_kernels(model)
    assert _step_both_ways(model, monkeypatch) == 2 * model.config.num_hidden_layers


def test_small_outputs_are_saved_as_they_are(monkeypatch):
    """Under RECOMPUTE_MIN_BYTES (8 MiB by default: these outputs are 5 KB) nothing is kept as a call."""
    model = build("llama", torch.bfloat16)
    swap_kernels(model)
    monkeypatch.setattr(kernel, "RECOMPUTE_MIN_BYTES", 8 << 20)
    assert _step_both_ways(model, monkeypatch) == 0


@pytest.mark.slow  # 1.6 s each
@pytest.mark.parametrize("reentrant", [False, True])
def test_under_gradient_checkpointing(monkeypatch, reentrant):
    """Non-reentrant: its saved-tensor hooks decide what is kept, the scope stands aside. Reentrant:
    the forward runs without grad, and again in backward, where the scope keeps the norms' calls
    for the backward of that recomputed layer."""
    model = build("llama", torch.bfloat16)
    swap_kernels(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert _step_both_ways(model, monkeypatch) == (2 * model.config.num_hidden_layers if reentrant else 0)


@pytest.mark.slow  # 1 s
def test_lora_sites_recompute_the_input_norms(monkeypatch):
    """PEFT's adapters with no dropout: the fused q/k/v group and the fused MLP save the norm's
    output itself, kept as the call. Layer 0's input norm has no backward (its input, the frozen
    embedding's output, needs no gradient): nothing to keep there."""
    base = build("llama", torch.bfloat16)
    swap_kernels(base)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                                           target_modules="all-linear"))
    assert _step_both_ways(model, monkeypatch) == 2 * model.config.num_hidden_layers - 1


@pytest.mark.slow  # 2 s
def test_under_fsdp2_the_recompute_reads_the_weight_unsharded_again(gloo_group, monkeypatch):
    """Each layer its own FSDP2 unit, resharded after forward: the norm's weight the recompute
    reads is the one the unit gathers again before its backward, as the norm's own backward reads."""
    from torch.distributed.fsdp import fully_shard

    model = build("llama", torch.bfloat16)
    swap_kernels(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert _step_both_ways(model, monkeypatch) == 2 * model.config.num_hidden_layers


@pytest.mark.slow  # 2 s
def test_under_autocast_only_the_fused_lora_functions_keep_the_call(monkeypatch):
    """fp32 weights under bf16 autocast, as recipes train: a plain projection saves its bf16 cast of
    the norm's output, so the full fine-tune's scopes stand aside (nothing to keep); the fused LoRA
    groups save the output itself, dropout or not, and keep the call: the attention's (on top of
    the swapped attention forward, whose scope stands aside there) and the MLP's."""
    base = build("llama", torch.float32)
    swap_kernels(base)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, init_lora_weights=False,
                                                          target_modules="all-linear"))
    for model, recomputes in ((base, 0), (lora, 2 * base.config.num_hidden_layers - 1)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            training_step(model, padded_batch())
        assert _recomputes(model) == recomputes
