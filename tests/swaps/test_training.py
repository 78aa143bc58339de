"""Swapped models under the training set-ups users run: Trainer with gradient accumulation,
gradient checkpointing."""
from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from accel_patch import swap_kernels
from accel_patch.swaps import sites

from _models import padded_batch, pair, rel, training_step


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_stock_gradients(reentrant):
    stock, twin = pair("llama")
    swap_kernels(twin)
    for m in (stock, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4


class Rows(torch.utils.data.Dataset):
    """Micro-batches with very different numbers of labelled tokens (1 to 9 of 10)."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 128, (8, 10), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: 9 - i] = -100  # row i has i + 1 labelled tokens
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(10, dtype=torch.long), "labels": labels}


def train(model, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-2, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0, seed=0, data_seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_trainer_with_gradient_accumulation_logs_and_learns_as_stock(tmp_path):
    stock, twin = pair("llama")
    swap_kernels(twin)
    losses0, weights0 = train(stock, tmp_path / "stock")
    losses1, weights1 = train(twin, tmp_path / "twin")
    assert len(losses0) == 2 and losses1 == pytest.approx(losses0, rel=1e-5)
    assert max(rel(weights1[n], w) for n, w in weights0.items()) <= 1e-4
    # every micro-batch took the fused loss, normalised by the step's token count
    assert twin.__dict__[sites.STATE_ATTR].loss_calls == {"fused": 4}


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # a Trainer of another test fixed mixed precision "no"
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_a_model_prepared_for_bf16_autocast_keeps_autocast_and_stock_accuracy(fresh_accelerate_state):
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    reference, _ = pair("llama")
    stock, twin = pair("llama")
    stock, twin = accelerator.prepare(stock), accelerator.prepare(twin)
    autocast_forward = twin.__dict__["forward"]  # accelerate's autocast wrapper
    swap_kernels(twin)  # wraps it, keeps it
    assert twin.__dict__[sites.INNER_ATTR] is autocast_forward
    batch = padded_batch()
    loss_ref, grads_ref, _ = training_step(reference, batch)  # float32, no autocast
    loss0, grads0, out0 = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert twin.__dict__[sites.STATE_ATTR].loss_calls == {"fused": 1}
    # autocast ran: stock's bf16 error against float32 is far above float32 rounding
    assert max(rel(grads0[n], g) for n, g in grads_ref.items()) > 1e-3
    assert rel(loss1, loss_ref) <= 1.5 * rel(loss0, loss_ref) + 1e-5
    for name, ref in grads_ref.items():
        assert rel(grads1[name], ref) <= 1.5 * rel(grads0[name], ref) + 2e-3, name
