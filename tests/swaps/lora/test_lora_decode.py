"""Decode steps: a LoRA site called on a few tokens without grad (generation, one token per
sequence a step) runs PEFT's forward, the faster path there, and counts it (by design, not a
fall-back); the prompt's prefill and every training call still run fused."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_patch import swap_kernels
from accel_patch.swaps import lora
from accel_patch.swaps.lora import sites as lora_sites
from accel_patch.swaps.report import outcome_kind

from _models import build
from test_lora import calls


@pytest.mark.slow
def test_generate_runs_pefts_forward_at_decode_steps_and_the_fused_sites_elsewhere():
    torch.manual_seed(0)
    stock = get_peft_model(build("llama"), LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    for p in stock.parameters():  # a trained adapter (B != 0): the outputs depend on it
        p.data.add_(torch.randn_like(p) * 0.02)
    model = get_peft_model(build("llama"), LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.load_state_dict(stock.state_dict())
    swap_kernels(model)
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(1))  # a prefill of 40 tokens
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=ids, **kw)
    assert torch.equal(out, stock.generate(input_ids=ids, **kw))
    counted = calls(model)
    for op in lora.OPS:  # 2 layers: the prefill fused, then 2 decode steps of 2 tokens on PEFT's forward
        assert counted[op] == {lora_sites.FUSED: 2, lora_sites.DECODE: 4}, counted
    assert outcome_kind(lora_sites.DECODE) == "by design"
    model.train()
    x = torch.randn(1, 2, model.config.hidden_size, requires_grad=True)  # a few tokens with grad: training
    model.base_model.model.model.layers[0].mlp(x).sum().backward()
    assert calls(model)[lora.MLP_OP][lora_sites.FUSED] == 3
