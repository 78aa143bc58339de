"""Fused LoRA under autocast (accel_patch/swaps/lora/): a bf16-autocast training step is as close
to the float32 step as stock PEFT's (family by family, both swap orders, float32 models as
Trainer(bf16=True) runs them and bf16 models with PEFT's float32 adapters, QLoRA with a bf16
compute dtype), every LoRA call counted fused; the q/k/v function equals PEFT's layers bit for bit
on CPU, which pins the casts and the dtypes backward replays."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_patch import swap_kernels
from accel_patch.swaps.lora import functions, plans

from _models import build, padded_batch, rel, training_step
from test_lora import ALL_LINEAR, calls, checkpoint, peft_model  # noqa: F401  (checkpoint: a fixture)

GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "cohere"}


def expected_calls(model, family, n=1):
    layers = model.config.num_hidden_layers
    ops = ("lora_mlp", "lora_qkv", "lora_o") if family in GATED else ("lora_qkv", "lora_o")
    return {op: {"fused": layers * n} for op in ops}


def assert_within_stocks_error(reference, stock, twin, batch, dtype=torch.bfloat16):
    """twin's autocast step against the float32 step: loss and every adapter gradient within 3x
    stock's own autocast error + 2e-3, gradients in stock's dtypes."""
    torch.manual_seed(0)
    loss_ref, grads_ref, _ = training_step(reference, batch)
    with torch.autocast("cpu", dtype=dtype):
        torch.manual_seed(0)
        loss0, grads0, _ = training_step(stock, batch)
        torch.manual_seed(0)
        loss1, grads1, _ = training_step(twin, batch)
    assert loss1.dtype == loss0.dtype
    assert rel(loss1, loss_ref) <= 3 * rel(loss0, loss_ref) + 2e-3, (loss1, loss0, loss_ref)
    assert grads_ref and grads1.keys() == grads0.keys() == grads_ref.keys()
    for name, ref in grads_ref.items():
        assert grads1[name].dtype == grads0[name].dtype, name
        assert rel(grads1[name], ref) <= 3 * rel(grads0[name], ref) + 2e-3, name


# (family, swap order, model dtype): float32 models as Trainer(bf16=True) loads them; bf16 models
# with PEFT's float32 adapters; each order over several families.
CASES = [("llama", "peft-then-swap", torch.float32)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [
        ("qwen2", "swap-then-peft", torch.float32),
        ("gemma", "peft-then-swap", torch.float32), ("phi3", "swap-then-peft", torch.float32),
        ("olmo2", "peft-then-swap", torch.float32),
        ("gpt_neox", "swap-then-peft", torch.float32),
        ("llama", "peft-then-swap", torch.bfloat16), ("phi3", "swap-then-peft", torch.bfloat16),
    ]]


@pytest.mark.parametrize("family, order, model_dtype", CASES)
def test_a_lora_step_under_bf16_autocast_is_as_close_to_float32_as_stock(family, order, model_dtype):
    base = build(family, model_dtype)
    reference = peft_model(build(family), "stock")
    stock, twin = peft_model(base, "stock"), peft_model(base, order)
    if model_dtype != torch.float32:  # PEFT's default: float32 adapters on a half-precision base
        assert {p.dtype for n, p in twin.named_parameters() if "lora_" in n} == {torch.float32}
    assert_within_stocks_error(reference, stock, twin, padded_batch())
    assert calls(twin) == expected_calls(base, family)


@pytest.mark.slow
def test_a_lora_step_under_fp16_autocast_is_as_close_to_float32_as_stock():
    base = build("qwen2")
    reference, stock, twin = peft_model(base, "stock"), peft_model(base, "stock"), peft_model(base, "peft-then-swap")
    assert_within_stocks_error(reference, stock, twin, padded_batch(), torch.float16)
    assert calls(twin) == expected_calls(base, "qwen2")


# --- QLoRA: bitsandbytes 4-bit, bf16 compute dtype, double quantization, as users load it -----


def load_4bit(checkpoint, family, compute_dtype, kernels="0"):
    """The checkpoint loaded 4-bit (nf4, double quantization), the load hook swapping `kernels`."""
    import os

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                               bnb_4bit_use_double_quant=True)
    os.environ["ACCEL_PATCH_KERNELS"] = kernels  # the load hook swaps these: swap before PEFT
    try:
        return AutoModelForCausalLM.from_pretrained(checkpoint / family, quantization_config=quant)
    finally:
        del os.environ["ACCEL_PATCH_KERNELS"]


def qlora(checkpoint, family, compute_dtype, kernels="0"):
    model = load_4bit(checkpoint, family, compute_dtype, kernels)
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(**{**ALL_LINEAR, "lora_dropout": 0.05}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    for family in ("llama", "qwen2"):
        build(family).save_pretrained(path / family)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family, order", [("llama", "swap-then-peft"), ("qwen2", "peft-then-swap")])
def test_qlora_with_a_bf16_compute_dtype_under_autocast_is_fused_and_as_close_as_stock(checkpoints, family, order):
    pytest.importorskip("bitsandbytes")
    reference = qlora(checkpoints, family, torch.float32)
    stock = qlora(checkpoints, family, torch.bfloat16)
    twin = qlora(checkpoints, family, torch.bfloat16, "lora" if order == "swap-then-peft" else "0")
    if order == "peft-then-swap":
        swap_kernels(twin, "lora")
    assert type(twin.base_model.model.model.layers[0].mlp.up_proj.base_layer).__name__ == "Linear4bit"
    assert twin.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight.quant_state.nested
    assert_within_stocks_error(reference, stock, twin, padded_batch())
    assert calls(twin) == expected_calls(twin, family)


def trl_qlora(checkpoint, family, kernels="0"):
    """A QLoRA model as TRL's trainers leave it: 4-bit with a bf16 compute dtype, the hidden states
    in float32 (`prepare_model_for_kbit_training`), and every adapter cast to bfloat16, whatever the
    trainer's precision flags."""
    from peft import prepare_model_for_kbit_training

    model = load_4bit(checkpoint, family, torch.bfloat16, kernels)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(3)
    model = get_peft_model(model, LoraConfig(**{**ALL_LINEAR, "lora_dropout": 0.05}))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(torch.bfloat16)
    return model


@pytest.mark.slow  # loads 4-bit models
@pytest.mark.parametrize("order", ["swap-then-peft", "peft-then-swap"])
def test_trls_qlora_without_autocast_is_fused_and_equals_pefts_step_bit_for_bit(checkpoints, order, monkeypatch):
    """SFTTrainer(bf16=False) on a 4-bit model: bf16 adapters on float32 hidden states, dropout on.
    PEFT casts x to bf16 for the adapter and adds its output cast back; the fused functions take
    the same steps: the loss and every adapter gradient equal stock's. The swap's probe ran the
    pairing before any call was fused."""
    pytest.importorskip("bitsandbytes")
    from accel_patch.swaps import probe as swap_probe
    from accel_patch.swaps.lora import probe as lora_probe

    stock = trl_qlora(checkpoints, "qwen2")
    twin = trl_qlora(checkpoints, "qwen2", "lora" if order == "swap-then-peft" else "0")
    if order == "peft-then-swap":
        probed, fused = [], lora_probe.fused_linears

        def spy(x, projs, adapters):
            probed.append((x.dtype, adapters[0].dtype))
            return fused(x, projs, adapters)

        monkeypatch.setattr(lora_probe, "fused_linears", spy)
        monkeypatch.setattr(swap_probe, "cache", swap_probe.ProbeCache())  # probe afresh
        swap_kernels(twin, "lora")
        assert (torch.float32, torch.bfloat16) in probed, probed
    assert {p.dtype for n, p in twin.named_parameters() if "lora_" in n} == {torch.bfloat16}
    batch = padded_batch()
    torch.manual_seed(0)
    loss0, grads0, _ = training_step(stock, batch)
    torch.manual_seed(0)
    loss1, grads1, _ = training_step(twin, batch)
    assert loss1.dtype == loss0.dtype == torch.float32
    assert torch.equal(loss1, loss0), (loss1, loss0)
    assert grads1.keys() == grads0.keys() and grads0
    assert [n for n in grads0 if not torch.equal(grads1[n], grads0[n])] == []
    assert calls(twin) == expected_calls(twin, "qwen2")


# --- the function against PEFT's layers, bit for bit ------------------------------------------


def attention(model_dtype, dropout=0.0, device="cpu", **config):
    torch.manual_seed(3)
    model = get_peft_model(build("qwen2", model_dtype), LoraConfig(**{**ALL_LINEAR, "lora_dropout": dropout, **config}))
    model.to(device).train()
    return model.base_model.model.model.layers[0].self_attn


def fused_qkv(projections, x):
    found = [plans.projection(m, x) for m in projections]
    assert not [f for f in found if isinstance(f, str)], found
    return functions.fused_linears(x, [f[0] for f in found], [t for f in found for t in f[1]])


def assert_qkv_equals_peft(model_dtype, autocast, dropout=0.0, device="cpu", bound=0.0, **config):
    """q/k/v (with biases: qwen2) of the fused function and of PEFT's layers, the same seed: outputs,
    their dtypes, dx and every adapter gradient equal bit for bit (bound 0), or within `bound`.
    config: LoraConfig fields over ALL_LINEAR's (whose scale, 2, is a power of two)."""
    attn = attention(model_dtype, dropout, device, **config)
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    leaf = torch.randn(2, 7, attn.q_proj.in_features, dtype=model_dtype, device=device, requires_grad=True)
    leaves = [leaf] + [t for m in projections for t in (m.lora_A["default"].weight, m.lora_B["default"].weight)]
    results = []
    for run in (lambda x: [m(x) for m in projections], lambda x: fused_qkv(projections, x)):
        with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            torch.manual_seed(0)
            outs = run(leaf * 1)  # not a leaf: autocast caches casts of leaves
        grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o).mul_(0.5).cumsum_(-1) for o in outs])
        results.append((outs, grads))
    (ref, ref_grads), (got, got_grads) = results
    assert [o.dtype for o in got] == [o.dtype for o in ref]
    assert all(rel(g, r) <= bound if bound else torch.equal(g, r) for g, r in zip(got, ref))
    names = ["x"] + [f"{n}.{ab}" for n in "qkv" for ab in "AB"]
    for name, g, r in zip(names, got_grads, ref_grads):
        assert g.dtype == r.dtype and (rel(g, r) <= bound if bound else torch.equal(g, r)), (name, rel(g, r))


@pytest.mark.parametrize("model_dtype, autocast", [
    (torch.float32, torch.bfloat16),  # Trainer(bf16=True) on a float32 load
    (torch.bfloat16, None),  # bf16 base, PEFT's float32 adapters, no autocast
    pytest.param(torch.bfloat16, torch.bfloat16, marks=pytest.mark.slow),
    pytest.param(torch.float32, torch.float16, marks=pytest.mark.slow),
])
def test_the_qkv_function_equals_pefts_layers_bit_for_bit(model_dtype, autocast):
    assert_qkv_equals_peft(model_dtype, autocast)


@pytest.mark.parametrize("config", [
    dict(r=8, lora_alpha=16, use_rslora=True),  # rsLoRA: 16 / sqrt(8), no power of two (never folded)
    dict(r=16, lora_alpha=8),  # 0.5: a power of two below 1 (not folded either)
], ids=["rslora", "scale 0.5"])
@pytest.mark.parametrize("model_dtype, autocast", [(torch.float32, torch.bfloat16), (torch.bfloat16, None),
                                                    (torch.float32, None)])
def test_the_qkv_function_equals_pefts_layers_bit_for_bit_at_scales_it_cannot_fold(model_dtype, autocast, config):
    assert_qkv_equals_peft(model_dtype, autocast, **config)


def test_the_fused_mlp_under_autocast_returns_stocks_dtype_and_is_within_bf16_rounding():
    torch.manual_seed(3)
    model = get_peft_model(build("llama"), LoraConfig(**ALL_LINEAR))
    mlp = model.base_model.model.model.layers[0].mlp
    stock = copy.deepcopy(mlp)
    swap_kernels(model, "lora")
    leaf = torch.randn(2, 7, mlp.gate_proj.in_features, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = stock(leaf * 1), mlp(leaf * 1)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert rel(got, ref) <= 8e-3
    assert calls(model) == {"lora_mlp": {"fused": 1}}


def test_autocast_in_float64_is_refused_per_call_with_the_reason():
    attn = attention(torch.float64)
    x = torch.randn(1, 3, attn.q_proj.in_features, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plans.projection(attn.q_proj, x) == "torch.float64 under autocast"
