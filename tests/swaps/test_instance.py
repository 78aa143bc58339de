"""Per instance and reversible: bystanders compute bit-identically, restore puts everything back."""
from __future__ import annotations

import copy
import inspect

import torch
import transformers.models.llama.modeling_llama as modeling_llama

from accel_kernels import _launch

from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import sites
from accel_patch.swaps.layers import rope

from _models import build, padded_batch, pair, rel, training_step

STOCK_ROPE = modeling_llama.apply_rotary_pos_emb


def snapshot(model):
    """Every module's class and the identity of every attribute in its __dict__."""
    return {name: (type(m), {k: id(v) for k, v in m.__dict__.items()}) for name, m in model.named_modules()}


def run(model, batch):
    loss, grads, out = training_step(model, batch)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return loss, grads, logits


def test_a_model_not_swapped_computes_bit_identically_after_another_one_is():
    bystander = build("llama")
    batch = padded_batch()
    before = run(bystander, batch)
    swapped = build("llama")
    swap_kernels(swapped)
    run(swapped, batch)  # the swapped model's kernels run in between
    with _launch.recording() as launched:
        after = run(bystander, batch)
    assert launched == []  # no kernel of accel-patch ran for it (the RoPE global passed the calls through)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert not any(sites.is_swapped(m) for m in bystander.modules())


def test_restore_puts_back_the_same_classes_attributes_objects_and_outputs(released):
    model = build("llama")
    batch = padded_batch()
    before = run(model, batch)
    shot = snapshot(model)
    report = swap_kernels(model)
    assert report.swapped and snapshot(model) != shot
    assert modeling_llama.apply_rotary_pos_emb is not STOCK_ROPE
    assert restore_kernels(model) is True
    assert snapshot(model) == shot
    assert modeling_llama.apply_rotary_pos_emb is STOCK_ROPE
    after = run(model, batch)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert all(torch.equal(before[1][n], after[1][n]) for n in before[1])
    assert restore_kernels(model) is False  # nothing left to restore


def test_the_rope_global_goes_back_with_the_last_swapped_model(released):
    first, second = build("llama"), build("llama")
    swap_kernels(first)
    swap_kernels(second)
    assert rope.interceptions.held()["transformers.models.llama.modeling_llama.apply_rotary_pos_emb"] == 2
    restore_kernels(first)
    assert modeling_llama.apply_rotary_pos_emb is not STOCK_ROPE  # still held by the second
    restore_kernels(second)
    assert modeling_llama.apply_rotary_pos_emb is STOCK_ROPE
    assert not rope.interceptions.held()


def test_the_interception_passes_every_call_through_outside_a_swapped_attention():
    model = build("llama")
    swap_kernels(model)
    dispatcher = modeling_llama.apply_rotary_pos_emb
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    with _launch.recording() as launched:
        out = dispatcher(q, k, cos, sin)
    assert launched == []
    for a, b in zip(out, STOCK_ROPE(q, k, cos, sin)):
        assert torch.equal(a, b)
    assert inspect.signature(dispatcher) == inspect.signature(STOCK_ROPE)
    restore_kernels(model)


def test_forward_signatures_read_as_stock():
    stock, twin = pair("llama")
    swap_kernels(twin)
    assert inspect.signature(twin.forward) == inspect.signature(stock.forward)
    assert "labels" in inspect.signature(twin.forward).parameters  # Trainer keeps the labels column
    norm, mlp = twin.model.layers[0].input_layernorm, twin.model.layers[0].mlp
    assert inspect.signature(norm.forward) == inspect.signature(stock.model.layers[0].input_layernorm.forward)
    assert inspect.signature(mlp.forward) == inspect.signature(stock.model.layers[0].mlp.forward)
    assert inspect.signature(twin.model.layers[0].self_attn.forward) == inspect.signature(
        stock.model.layers[0].self_attn.forward)


def test_a_deep_copy_of_a_swapped_model_is_swapped_on_its_own_modules():
    stock, twin = pair("llama")
    swap_kernels(twin)
    clone = copy.deepcopy(twin)
    norm = clone.model.layers[0].input_layernorm
    assert norm.forward.__self__ is norm and clone.forward.__self__ is clone
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = training_step(clone, batch)
    assert rel(loss1, loss0) <= 1e-5 and out.logits is None
    assert all(p.grad is None for p in twin.parameters())  # the original was not touched
    restore_kernels(clone)
    assert not any(sites.is_swapped(m) for m in clone.modules())
    assert sites.is_swapped(twin.model.norm)
    restore_kernels(twin)


def test_a_module_copied_after_the_swap_is_restored_too():
    model = build("llama")
    swap_kernels(model)
    model.model.extra_norm = copy.deepcopy(model.model.norm)  # as PEFT's modules_to_save copies a module
    assert sites.is_swapped(model.model.extra_norm)
    restore_kernels(model)
    assert "forward" not in model.model.extra_norm.__dict__


def test_modules_under_accelerate_hooks_are_swapped_inside_the_hooks_and_restored():
    """A model dispatched over devices (device_map) has accelerate hooks owning each module's
    forward: the swap goes where the hook calls, and the hook still runs."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    stock, twin = pair("llama")
    for module in (twin.model.norm, twin.model.layers[0].mlp, twin.lm_head, twin):
        add_hook_to_module(module, Counting())
    hooked = {n: m.__dict__["forward"] for n, m in twin.named_modules() if "_hf_hook" in m.__dict__}
    original_old = twin.model.norm.__dict__["_old_forward"]
    report = swap_kernels(twin)
    assert report.swapped["rms_norm"] == 5 and report.swapped["glu"] == 2
    assert {n: m.__dict__["forward"] for n, m in twin.named_modules() if n in hooked} == hooked
    assert sites.is_swapped(twin.model.norm) and sites.is_swapped(twin)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = training_step(twin, batch)
    assert Counting.calls == 4 and out.logits is None  # every hook ran once, the loss was fused
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    restore_kernels(twin)
    assert twin.model.norm.__dict__["_old_forward"] is original_old and not sites.is_swapped(twin.model.norm)
    assert {n: m.__dict__["forward"] for n, m in twin.named_modules() if n in hooked} == hooked
