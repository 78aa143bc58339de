"""The fused loss where a sharding engine owns the LM head's weight (swaps/loss/head.py,
`head_weight_for_loss`): fused where the weight is whole for the whole call, standing aside (stock
head, reason counted) where it is a shard or a released partition, and never reading an empty one.

DeepSpeed ZeRO-3 is faked here with the attributes a partitioned parameter has (`ds_id`,
`ds_status`, `ds_numel`, `ds_shape`, `.data` empty outside the module's forward) and ZeRO-3's
fetch/release around the head's forward, so the test runs without DeepSpeed. FSDP2 runs for real
on a one-process gloo group; two-process FSDP2 and FSDP1 runs are in integration_tests/.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import accel_patch
from accel_patch.swaps import sites
from accel_patch.swaps.loss.deferred import DeferredLogits, _Head
from accel_patch.swaps.sites import SwapState

from _models import pair, padded_batch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def loss_calls(model) -> dict:
    return model.__dict__[sites.STATE_ATTR].loss_calls


class FakeZero3:
    """ZeRO-3 on one module, as DeepSpeed leaves a parameter: partitioned (`.data` empty, the shape
    in `ds_shape`) except between the module's forward pre-hook (fetch) and forward hook (release)."""

    NOT_AVAILABLE, AVAILABLE = "NOT_AVAILABLE", "AVAILABLE"

    def __init__(self, module) -> None:
        self.param = module.weight
        self.full = self.param.data.clone()
        p = self.param
        p.ds_id, p.ds_numel, p.ds_shape = 7, self.full.numel(), self.full.shape
        self.release()
        module.register_forward_pre_hook(lambda m, args: self.fetch())
        module.register_forward_hook(lambda m, args, out: self.release())

    def fetch(self) -> None:
        self.param.data, self.param.ds_status = self.full, self.AVAILABLE

    def release(self) -> None:
        self.param.data, self.param.ds_status = torch.empty(0, dtype=self.full.dtype), self.NOT_AVAILABLE


@pytest.mark.slow
def test_a_zero3_partitioned_head_stands_aside_and_gives_the_stock_loss():
    stock, twin = pair("llama")
    # only the loss is swapped: the other kernels (interpreted here) would change the last bits of
    # the hidden states, and this test asks for the stock loss exactly
    accel_patch.swap_kernels(twin, ops=["fused_linear_cross_entropy"])
    FakeZero3(stock.lm_head)
    FakeZero3(twin.lm_head)
    batch = padded_batch()
    stock.train(), twin.train()

    want, got = stock(**batch).loss, twin(**batch).loss

    assert torch.equal(got, want)
    calls = loss_calls(twin)
    assert "fused" not in calls
    assert any("DeepSpeed ZeRO-3 partition" in k for k in calls), calls


def test_the_fused_loss_never_reads_a_weight_whose_storage_was_freed():
    # What FSDP2 does to a head that is its own unit, right after the head's forward.
    w = torch.randn(16, 8)
    h, y = torch.randn(5, 8), torch.randint(0, 16, (5,))
    deferred = DeferredLogits(_Head(h, w, None, SwapState()), (), h, torch.Size((5, 16)), w.dtype)
    w.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="lost its storage before the fused loss"):
        F.cross_entropy(deferred, y)


# --- FSDP2 (fully_shard) on a one-process gloo group -------------------------------------------

def shard(model, head_unit):
    """Each layer, then the model (the head in the root's unit); `head_unit` "tail": [final norm,
    lm_head] kept unsharded after forward, as accelerate 1.15 carves it; "own": lm_head alone, FSDP2's
    default (resharded after forward)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if head_unit == "tail":
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    elif head_unit == "own":
        fully_shard(model.lm_head)
    fully_shard(model)
    return model


# A tied head shares the embedding's parameter: it is never its own unit.
@pytest.mark.slow
@pytest.mark.parametrize("head_unit, tied", [(None, False), (None, True), ("tail", False), ("own", False)],
                         ids=["head-in-root-untied", "head-in-root-tied", "head-in-tail-unit", "head-own-unit"])
def test_fsdp2_fused_loss_where_the_head_stays_whole_or_stock_where_it_is_resharded(gloo_group, tied, head_unit):
    stock, twin = pair("llama", tie_word_embeddings=tied)
    accel_patch.swap_kernels(twin)
    stock, twin = shard(stock, head_unit), shard(twin, head_unit)
    batch = padded_batch()
    stock.train(), twin.train()

    want, got = stock(**batch).loss, twin(**batch).loss
    want.backward()
    got.backward()

    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(stock.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad.full_tensor(), a.grad.full_tensor(), rtol=1e-4, atol=1e-6, msg=name)
    calls = loss_calls(twin)
    if head_unit == "own":
        assert "fused" not in calls and any("FSDP2 shard" in k for k in calls), calls
    else:
        assert calls == {"fused": 1}, calls


def test_head_plan_stands_aside_for_a_zero3_partition_or_a_freed_weight():
    from accel_patch.swaps.loss.head import head_plan

    zero3 = torch.nn.Linear(8, 16, bias=False)
    FakeZero3(zero3)
    leaf, why = head_plan(zero3)
    assert leaf is None and "DeepSpeed ZeRO-3 partition" in why

    freed = torch.nn.Linear(8, 16, bias=False)
    freed.weight.untyped_storage().resize_(0)
    leaf, why = head_plan(freed)
    assert leaf is None and "no storage" in why

    whole = torch.nn.Linear(8, 16, bias=False)  # control: the same head, whole
    assert head_plan(whole) == (whole, None)


@pytest.mark.slow
def test_a_model_sharded_before_the_swap_keeps_its_stock_loss_with_the_reason(gloo_group):
    from torch.distributed.fsdp import fully_shard

    stock, twin = pair("llama")
    fully_shard([twin.model.norm, twin.lm_head], reshard_after_forward=False)
    fully_shard(twin)
    report = accel_patch.swap_kernels(twin)
    assert "fused_linear_cross_entropy" not in report.swapped
    assert any("(sharded already): swap before sharding" in r.reason for r in report.refused), str(report)
