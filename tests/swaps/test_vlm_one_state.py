"""One model, one report: a VLM built by its class (whose constructor builds its language and
vision models with `from_config`) is not swapped by that constructor, and whoever swaps its parts
first, `report(model)` holds every site and every fused call after a LoRA step."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from accel_patch import report, restore_kernels, swap_kernels
from accel_patch.swaps import sites

LORA_OPS = ("lora_mlp", "lora_qkv", "lora_o")


def tiny_vlm():
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    config.bos_token_id = config.eos_token_id = None
    return Qwen2_5_VLForConditionalGeneration(config)


def states(model):
    return [name for name, m in model.named_modules() if sites.STATE_ATTR in m.__dict__]


@pytest.mark.slow
@pytest.mark.parametrize("first", ["nobody", "language-model"])
def test_a_vlm_built_by_its_class_has_one_report_with_every_fused_lora_call(first):
    model = tiny_vlm()
    assert states(model) == []  # the constructor swapped nothing, parts included
    if first == "language-model":
        swap_kernels(model.model.language_model)  # a part swapped on its own first
    swapped = swap_kernels(model)
    assert states(model) == [""]  # one state, on the top-level model
    assert not [r for r in swapped.refused if r.op in LORA_OPS], swapped.refused
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    ids = torch.randint(3, 128, (2, 8))
    peft.train()
    peft(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    calls = report(peft).calls
    for op in LORA_OPS:
        assert calls.get(op, {}).get("fused", 0) >= 2, calls  # one per decoder layer at least
    assert report(peft).swapped.get("rms_norm", 0) >= 5, report(peft).swapped
    assert report(model.model.language_model) is None  # no second report
    assert restore_kernels(peft) is True
    assert not any(sites.is_swapped(m) for m in model.modules())
