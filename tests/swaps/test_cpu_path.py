"""On CPU without Triton a swap earns its place: the swapped norm, MLP and RoPE call the stock
computation (their plain-torch twins are slower than the stock modules there), and the fused loss
runs only where the logits are large (`loss.CPU_MIN_LOGITS`). The rest of the suite runs the
kernels under Triton's interpreter; these tests turn it off the way a user's CPU has it."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel_kernels import _dispatch, _triton

from accel_patch import swap_kernels
from accel_patch.swaps import sites
from accel_patch.swaps.layers import norms
from accel_patch.swaps.loss import site as loss
from accel_patch.swaps.report import outcome_kind

from _models import pair, padded_batch, rel, training_step


class OpsSeen(TorchDispatchMode):
    """The accel_kernels ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "accel_kernels":
            self.seen.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.fixture
def no_triton(monkeypatch):
    """CPU tensors take the plain-torch path, as on a machine without the interpreter."""
    monkeypatch.setattr(_triton, "INTERPRETING", False)
    assert not _dispatch.use_triton(torch.zeros(1))


def test_without_triton_the_swapped_modules_compute_exactly_as_stock(no_triton):
    stock, twin = pair("llama")
    report = swap_kernels(twin)
    # the LoRA sites are installed too (decided per call), waiting: this model has no adapter; the
    # tiled MLP decides per call too
    assert set(report.swapped) == {"rms_norm", "rope", "glu", "fused_linear_cross_entropy", "tiled_mlp"}
    assert set(report.waiting) == {"lora_mlp", "lora_qkv", "lora_o"}
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    with OpsSeen() as mode:
        loss1, grads1, out = training_step(twin, batch)
    assert mode.seen == []  # no op of accel_kernels, no twin: the stock computation
    assert torch.equal(loss1, loss0)
    assert all(torch.equal(grads1[n], g) for n, g in grads0.items())
    assert twin.__dict__[sites.STATE_ATTR].loss_calls == {
        "stood aside: small logits on CPU without Triton (stock is faster there)": 1}
    # stock by choice, not a fall-back: the Trainer's logs do not warn about it (swaps/report.py)
    assert [outcome_kind(o) for o in twin.__dict__[sites.STATE_ATTR].loss_calls] == ["by design"]
    # and the report says what ran, call by call: every norm and MLP call stood aside, by design
    # (none counted while the swap probed them); red when those calls go uncounted
    calls = twin.__dict__[sites.STATE_ATTR].calls
    layers = twin.config.num_hidden_layers
    assert calls["rms_norm"] == {norms.NO_TRITON: 2 * layers + 1} and calls["glu"] == {norms.NO_TRITON: layers}
    assert outcome_kind(norms.NO_TRITON) == "by design"


def test_without_triton_large_logits_still_take_the_fused_loss(no_triton):
    stock, twin = pair("llama", vocab_size=8192, num_hidden_layers=1)
    swap_kernels(twin)
    ids = torch.randint(3, 8192, (1, loss.CPU_MIN_LOGITS // 8192), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    loss0, grads0, _ = training_step(stock, batch)
    with OpsSeen() as mode:
        loss1, grads1, out = training_step(twin, batch)
    assert set(mode.seen) == {"fused_linear_cross_entropy"}  # the twin of the fused loss, nothing else
    assert out.logits is None and twin.__dict__[sites.STATE_ATTR].loss_calls == {"fused": 1}
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4


def test_with_triton_the_kernels_run(monkeypatch):
    """The interpreter (as every other test has it) keeps the kernels in: the check is per call."""
    _, twin = pair("llama")
    swap_kernels(twin)
    with OpsSeen() as mode:
        training_step(twin, padded_batch())
    assert {"rms_norm", "rope", "glu", "fused_linear_cross_entropy"} <= set(mode.seen)
