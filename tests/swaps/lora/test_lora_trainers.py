"""Fused LoRA as adapter users train: `Trainer(bf16=True)` and TRL's `SFTTrainer` with its defaults
(bf16 autocast) and a LoRA config as recipes write it (r 16, dropout 0.05), swapped by accel-patch's
Trainer callback with no change to the script. Every LoRA call of training runs fused (the model's
live counts), and the losses are within bf16 noise of stock PEFT: no further from stock's bf16 run
than 3x stock's own distance from its float32 run, + 2e-3 (the issue's parity bound)."""
from __future__ import annotations

import pytest

import accel_patch
import torch
from peft import LoraConfig, get_peft_model

from _models import build
from test_lora import calls
from test_trl import stock_accel_patch

pytestmark = pytest.mark.slow
RECIPE = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
LORA_OPS = ("lora_mlp", "lora_qkv", "lora_o")




def assert_within_bf16_noise(ours, stock_bf16, stock_fp32):
    assert len(ours) == len(stock_bf16) == len(stock_fp32) > 0
    for a, b, ref in zip(ours, stock_bf16, stock_fp32):
        assert abs(a - b) <= 3 * abs(b - ref) + 2e-3 * abs(b), (ours, stock_bf16, stock_fp32)


def test_trainer_bf16_lora_with_dropout_runs_every_call_fused_and_trains_as_stock(tmp_path):
    from transformers import Trainer, TrainingArguments

    from test_training import Rows

    def train(bf16: bool, out: str):
        model = build("llama")  # seeded: the same base weights in every run
        torch.manual_seed(3)
        model = get_peft_model(model, LoraConfig(**RECIPE))
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True, bf16=bf16, dataloader_num_workers=0, seed=0,
                                 data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

    with stock_accel_patch():
        stock_fp32, _ = train(False, "fp32")
        stock_bf16, _ = train(True, "bf16")
    ours, model = train(True, "ours")
    # 2 steps x 2 layers, every call of each site fused (training: dropout 0.05 in force)
    assert calls(model) == {op: {"fused": 4} for op in LORA_OPS}
    assert_within_bf16_noise(ours, stock_bf16, stock_fp32)


def test_sft_trainer_defaults_with_a_recipe_lora_config_run_every_call_fused(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from test_trl import tiny_llama, tokenizer, words

    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, 6) for _ in range(8)],
                                       "completion": [words(g, 6) for _ in range(8)]})

    def train(bf16: bool, out: str):
        config = trl.SFTConfig(output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=4,
                               learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                               disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, max_length=32,
                               **({} if bf16 else {"bf16": False}))  # SFTConfig's default: bf16=True
        assert config.bf16 == bf16
        torch.manual_seed(3)
        trainer = trl.SFTTrainer(model=tiny_llama(), args=config, train_dataset=data, processing_class=tokenizer(),
                                 peft_config=LoraConfig(**RECIPE))
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    with stock_accel_patch():
        stock_fp32, _ = train(False, "fp32")
        stock_bf16, _ = train(True, "bf16")
    ours, trainer = train(True, "ours")
    assert trainer.args.gradient_checkpointing  # SFTConfig's default: each forward runs again in backward
    # 2 steps x 2 layers x 2 (checkpointing), every call of each site fused
    assert calls(trainer.model) == {op: {"fused": 8} for op in LORA_OPS}
    assert_within_bf16_noise(ours, stock_bf16, stock_fp32)


@pytest.fixture
def users_cpu(monkeypatch):
    """CPU tensors take the plain-torch path, as on a user's CPU (no Triton interpreter): the
    swapped GLU beneath the LoRA MLP then runs the module's own forward."""
    from accel_kernels import _dispatch, _triton

    monkeypatch.setattr(_triton, "INTERPRETING", False)
    assert not _dispatch.use_triton(torch.zeros(1))


def test_dpo_defaults_with_a_recipe_lora_config_start_exactly_as_stock(tmp_path, users_cpu):
    """TRL's DPO with its defaults (bf16 autocast, gradient checkpointing) and PEFT's reference (the
    adapters off): our head on both passes, the fused LoRA sites on the policy's, and step 1 is
    stock's exactly (loss ln 2, rewards and margins 0), the rest within bf16 noise."""
    import math

    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from accel_patch.patches import trl_fused_head
    from test_trl import _preference_rows, common, steps_of, tiny_llama, tokenizer

    data = datasets.Dataset.from_dict(_preference_rows())

    def train(bf16: bool, out: str):
        args = {k: v for k, v in common(tmp_path / out, max_steps=2, per_device_train_batch_size=4,
                                        learning_rate=1e-3, max_length=24).items() if bf16 is False or k != "bf16"}
        config = trl.DPOConfig(**args)
        assert config.bf16 == bf16 and config.gradient_checkpointing
        torch.manual_seed(3)
        trainer = trl.DPOTrainer(model=tiny_llama(), args=config, train_dataset=data, processing_class=tokenizer(),
                                 peft_config=LoraConfig(**RECIPE))
        trainer.train()
        return steps_of(trainer), trainer

    with stock_accel_patch():
        stock_fp32, _ = train(False, "fp32")
        stock_bf16, _ = train(True, "bf16")
    ours, trainer = train(True, "ours")
    first, stock_first = ours[0], stock_bf16[0]
    assert stock_first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["loss"] == stock_first["loss"]
    assert first["rewards/margins"] == stock_first["rewards/margins"] == 0.0
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    head_calls = accel_patch.report(trainer.model).calls["fused_linear_cross_entropy"]
    assert head_calls == {trl_fused_head.FUSED_CALL: 2, trl_fused_head.FUSED_NO_GRAD: 2}  # policy, reference
    counted = calls(trainer.model)
    assert all(counted[op]["fused"] > 0 for op in LORA_OPS), counted
    assert_within_bf16_noise([h["loss"] for h in ours], [h["loss"] for h in stock_bf16],
                             [h["loss"] for h in stock_fp32])
