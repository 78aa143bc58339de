"""PEFT in either order (LoRA on lm_head included), QLoRA, and checkpoints byte-identical to stock."""
from __future__ import annotations

import copy
import filecmp
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

import accel_patch
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import sites

from _models import build, padded_batch, rel, training_step

LORA_ON_HEAD = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                    target_modules=["q_proj", "v_proj", "gate_proj", "lm_head"])
HEAD_COPY = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                 target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])


def peft_model(base, config, order):
    base = copy.deepcopy(base)
    torch.manual_seed(3)  # the same adapter initialisation in every order
    if order == "swap-then-peft":
        swap_kernels(base)
        return get_peft_model(base, LoraConfig(**config))
    model = get_peft_model(base, LoraConfig(**config))
    if order == "peft-then-swap":
        swap_kernels(model)
    return model


def loss_calls(model):
    return model.get_base_model().__dict__[sites.STATE_ATTR].loss_calls


@pytest.mark.parametrize("order", ["swap-then-peft", pytest.param("peft-then-swap", marks=pytest.mark.slow)])
@pytest.mark.parametrize("config, outcome", [
    (LORA_ON_HEAD, "stood aside: a LoRA adapter on the LM head (stock head, so the adapter trains)"),
    (HEAD_COPY, "fused"),
])
def test_peft_in_either_order_trains_every_adapter_as_stock(order, config, outcome):
    base = build("llama")
    stock = peft_model(base, config, "stock")
    twin = peft_model(base, config, order)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert grads1.keys() == grads0.keys()
    head_grads = [k for k in grads0 if "lm_head" in k]
    assert head_grads and all(grads1[k].abs().sum() > 0 for k in head_grads)  # the head's adapter trains
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    assert loss_calls(twin) == {outcome: 1}
    swapped = [n for n, m in twin.named_modules() if sites.is_swapped(m)]
    assert any(n.endswith("mlp") for n in swapped) and any(n.endswith("input_layernorm") for n in swapped)


@pytest.mark.slow  # over 1.5 s: the quick loop keeps to one minute
def test_a_lora_adapter_added_to_the_head_after_the_swap_is_seen_at_call_time():
    base = build("llama")
    twin = peft_model(base, HEAD_COPY, "swap-then-peft")
    batch = padded_batch()
    training_step(twin, batch)
    assert loss_calls(twin) == {"fused": 1}
    with twin.disable_adapter():  # adapters off: the original (frozen) head, fused
        assert twin(**batch).loss is not None
    assert loss_calls(twin) == {"fused": 2}
    twin.base_model.model.lm_head = get_peft_model(  # LoRA on the head added after the swap
        torch.nn.Sequential(twin.base_model.model.lm_head.original_module), LoraConfig(**dict(
            LORA_ON_HEAD, target_modules=["0"]))).base_model.model[0]
    training_step(twin, batch)
    assert loss_calls(twin) == {"fused": 2, "stood aside: a LoRA adapter on the LM head (stock head, so the adapter trains)": 1}


def test_peft_adapter_and_base_checkpoints_are_byte_identical_to_stock(tmp_path):
    base = build("llama")
    stock = peft_model(base, LORA_ON_HEAD, "stock")
    twin = peft_model(base, LORA_ON_HEAD, "swap-then-peft")
    stock.save_pretrained(tmp_path / "stock")
    twin.save_pretrained(tmp_path / "twin")
    assert_same_files(tmp_path / "stock", tmp_path / "twin")


def assert_same_files(a, b):
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_save_pretrained_of_a_swapped_model_writes_the_same_bytes_and_reloads(tmp_path):
    stock = build("gemma2", final_logit_softcapping=5.0)
    twin = copy.deepcopy(stock)
    report = swap_kernels(twin)
    # the four kernel ops and the tiled MLP; the LoRA sites wait for adapters
    assert len(report.swapped) == 5 and len(report.waiting) == 3
    training_step(twin, padded_batch())  # after a step with the kernels: state is still plain
    stock.save_pretrained(tmp_path / "stock")
    twin.save_pretrained(tmp_path / "twin")
    assert_same_files(tmp_path / "stock", tmp_path / "twin")
    assert twin.state_dict().keys() == stock.state_dict().keys()
    assert all(torch.equal(v, stock.state_dict()[k]) for k, v in twin.state_dict().items())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "twin")
    assert sites.is_swapped(reloaded.model.norm)  # swapped by the load hook, not by anything saved
    restore_kernels(reloaded)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    build("llama").save_pretrained(path)
    return path


def test_from_pretrained_and_from_config_return_swapped_models_and_the_constructor_does_not(checkpoint):
    loaded = LlamaForCausalLM.from_pretrained(checkpoint)
    made = AutoModelForCausalLM.from_config(loaded.config)
    built = LlamaForCausalLM(loaded.config)
    assert sites.is_swapped(loaded.model.norm) and sites.is_swapped(made.model.layers[0].mlp)
    assert not any(sites.is_swapped(m) for m in built.modules())
    for m in (loaded, made):
        restore_kernels(m)


@pytest.mark.parametrize("value, swapped", [("0", set()), ("none", set()), ("rms_norm,swiglu", {"rms_norm", "glu"})])
def test_accel_patch_kernels_limits_or_stops_the_automatic_swap(monkeypatch, checkpoint, value, swapped):
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", value)
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    state = model.__dict__.get(sites.STATE_ATTR)
    assert (set(state.counts) if state else set()) == swapped
    restore_kernels(model)


def test_a_bad_accel_patch_kernels_never_fails_the_load_and_says_why(monkeypatch, checkpoint):
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "rms_norm,flash")
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    # the bad name is skipped and said; the rest run
    assert sites.is_swapped(model.model.norm) and not sites.is_swapped(model.model.layers[0].mlp)
    record = next(s for s in accel_patch.status() if s.name == "kernels")
    assert record.state == "active" and "ACCEL_PATCH_KERNELS='rms_norm,flash'" in record.reason
    assert "'flash'" in record.reason
    restore_kernels(model)
    monkeypatch.delenv("ACCEL_PATCH_KERNELS")
    restored = LlamaForCausalLM.from_pretrained(checkpoint)  # a good load clears the complaint
    assert sites.is_swapped(restored.model.norm)
    record = next(s for s in accel_patch.status() if s.name == "kernels")
    assert record.state == "active" and "flash" not in record.reason
    restore_kernels(restored)


@pytest.mark.slow  # over 1.5 s: the quick loop keeps to one minute
def test_qlora_on_cpu_trains_as_stock(monkeypatch, checkpoint):
    pytest.importorskip("bitsandbytes")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "0")
    stock = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant)
    monkeypatch.delenv("ACCEL_PATCH_KERNELS")
    twin = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant)
    assert type(twin.model.layers[0].mlp.gate_proj).__name__ == "Linear4bit"
    assert sites.is_swapped(twin.model.layers[0].mlp)  # the 4-bit projections run inside the kernel swap
    config = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=["q_proj", "gate_proj"])
    torch.manual_seed(3)
    stock = get_peft_model(stock, LoraConfig(**config))
    torch.manual_seed(3)
    twin = get_peft_model(twin, LoraConfig(**config))
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert grads0 and grads1.keys() == grads0.keys()
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
