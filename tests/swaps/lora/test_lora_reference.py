"""PEFT's reference pass (adapters disabled, as DPO, KTO and GRPO take it) computes the same base as
the adapted pass: with a fresh adapter (B = 0) a swapped model gives bit-identical logits both ways,
on the CPU path a user has (no Triton: the module's own activation) and on the kernels' path
(Triton's interpreter: accel_kernels' GLU), in float32 and under bf16 autocast. Both passes run the
fused sites (every MLP and attention projection adapted) where they can."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_kernels import _dispatch, _triton

from accel_patch import swap_kernels

from _models import build
from test_lora import calls

RECIPE = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")


@pytest.fixture(params=["no-triton", "interpreter"])
def path(request, monkeypatch):
    if request.param == "no-triton":  # CPU tensors take the plain-torch path, as on a user's CPU
        monkeypatch.setattr(_triton, "INTERPRETING", False)
        assert not _dispatch.use_triton(torch.zeros(1))
    return request.param


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_a_fresh_adapter_and_its_reference_pass_compute_the_same_logits(path, autocast):
    torch.manual_seed(0)
    model = get_peft_model(build("llama"), LoraConfig(**RECIPE))  # B = 0: the adapted model is the base
    swap_kernels(model)
    model.train()  # dropout 0.05 in force on the adapters' inputs
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        policy = model(input_ids=ids).logits  # training pass: grad, fused sites
        with torch.no_grad(), model.disable_adapter():  # PEFT's reference: adapters off
            reference = model(input_ids=ids).logits
    assert torch.equal(policy.detach(), reference)
    counted = calls(model)
    assert counted["lora_mlp"]["fused"] == 2 and counted["lora_qkv"]["fused"] == 2 and counted["lora_o"]["fused"] == 2
    assert all(o == "fused" or o.startswith("no active LoRA adapter") for c in counted.values() for o in c), counted


def test_the_fused_mlp_computes_the_activation_the_way_its_adapters_off_forward_does(monkeypatch):
    """Without Triton the forward beneath is the module's own (F.silu(gate) * up in bf16), so the
    fused MLP's activation is that formula, not accel_kernels' twin, which rounds differently."""
    monkeypatch.setattr(_triton, "INTERPRETING", False)
    torch.manual_seed(0)
    model = get_peft_model(build("llama"), LoraConfig(**{**RECIPE, "lora_dropout": 0.0}))
    swap_kernels(model)
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(1, 64, model.config.hidden_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = mlp(x)
        with model.disable_adapter():
            off = mlp(x)
    assert torch.equal(fused, off)
    assert calls(model)["lora_mlp"] == {"fused": 1, "no active LoRA adapter: the module's forward": 1}
