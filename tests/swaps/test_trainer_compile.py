"""Trainer(torch_compile=True) with `import accel_patch`: the kernels are swapped before the
Trainer compiles the model (its first log says so), the compiled model has no graph break, and
3 steps give stock torch_compile's losses and weights (float32, CPU, Inductor: slow)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import Trainer, TrainingArguments

import accel_patch
from accel_patch.swaps import sites

from _models import build, rel


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 128, (6, 10), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:3] = -100
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(10, dtype=torch.long), "labels": labels}


def train(model, tmp_path):
    torch._dynamo.reset()
    counters.clear()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0, seed=0, data_seed=0, torch_compile=True,
                             torch_compile_backend="inductor")
    trainer = Trainer(model=model, args=args, train_dataset=Rows())
    trainer.train()
    from accel_patch.integrations.callback import training_logs

    logs = training_logs(trainer)  # with the callback's keys (none in the stock run)
    breaks = sum(counters["graph_break"].values())
    captured = counters["stats"]["calls_captured"]
    return logs, {n: p.detach().clone() for n, p in model.named_parameters()}, breaks, captured


@pytest.mark.slow
def test_trainer_torch_compile_swaps_compiles_without_a_break_and_learns_as_stock(monkeypatch, tmp_path):
    stock, twin = build("llama"), build("llama")
    monkeypatch.setenv("ACCEL_PATCH_CALLBACK", "0")  # the stock run: no automatic callback, no swap
    accel_patch.disable()
    accel_patch.enable()
    try:
        logs0, weights0, breaks0, captured0 = train(stock, tmp_path / "stock")
    finally:
        monkeypatch.delenv("ACCEL_PATCH_CALLBACK")
        accel_patch.disable()
        accel_patch.enable()
    assert not sites.is_swapped(stock.model.norm)
    logs1, weights1, breaks1, captured1 = train(twin, tmp_path / "twin")
    assert sites.is_swapped(twin.model.norm) and sites.is_swapped(twin)
    assert logs1[0]["accel_patch_swap"] == "rms_norm 5, rope 2, glu+tiled 2, fused_linear_cross_entropy 1"
    # calls are not counted in a compiled graph: said once, at the first log
    assert logs1[0]["accel_patch_fallbacks"] == "not counted per call: under torch.compile the compiled graph decides"
    assert not any("accel_patch_fallbacks" in h for h in logs1[1:])
    assert captured0 > 0 and captured1 > 0  # both were compiled
    assert breaks0 == 0 and breaks1 == 0
    assert [h["loss"] for h in logs1] == pytest.approx([h["loss"] for h in logs0], rel=1e-5)
    assert max(rel(weights1[n], w) for n, w in weights0.items()) <= 1e-4
