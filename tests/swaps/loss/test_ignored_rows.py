"""Ignored tokens never reach the fused kernel in eager mode (the rows are selected before the
matmul), and give the stock loss and gradients for every reduction; under torch.compile every row
goes through (the static-shape form, `deferred.all_rows`) with the same results."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_kernels
from accel_patch.swaps.loss import deferred
from accel_patch.swaps.sites import SwapState
from accel_patch.swaps.loss.token_logprobs import METRICS, token_logprobs

N, H, V = 12, 16, 40


@pytest.fixture
def rows_seen(monkeypatch):
    """The number of rows each call of the fused kernel received."""
    seen = []
    kernel = accel_kernels.fused_linear_cross_entropy

    def spy(hidden, weight, labels, *args, **kwargs):
        seen.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return kernel(hidden, weight, labels, *args, **kwargs)

    monkeypatch.setattr(accel_kernels, "fused_linear_cross_entropy", spy)
    return seen


def inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    y[::2] = -100  # half ignored
    return h, w, y


def fused(h, w, y, reduction):
    z = deferred.DeferredLogits(deferred._Head(h, w, None, SwapState()), (), h, torch.Size((N, V)), w.dtype)
    return F.cross_entropy(z * 0.5, y, reduction=reduction)  # a scale too: applied to the kept rows only


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compile-form"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_only_labelled_rows_reach_the_kernel_with_stock_loss_and_gradients(rows_seen, monkeypatch, reduction,
                                                                             compiling):
    monkeypatch.setattr(deferred.sites, "compiling", lambda: compiling)
    h, w, y = inputs()
    ref = F.cross_entropy(F.linear(h, w) * 0.5, y, reduction=reduction)
    ref.sum().backward()
    ref_grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = fused(h, w, y, reduction)
    got.sum().backward()
    assert rows_seen == [N if compiling else N // 2]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((h.grad, w.grad), ref_grads, rtol=1e-5, atol=1e-6)
    if reduction == "none":
        assert (got[::2] == 0).all()


def test_token_logprobs_score_only_labelled_rows_and_zero_the_rest(rows_seen):
    h, w, y = inputs()
    out = token_logprobs(h, w, None, y, scale=0.7, outputs=("log_probs", *METRICS))
    assert rows_seen == [N // 2]
    z = F.linear(h, w) * 0.7  # a temperature of 1/0.7 (TRL's head divides the logits by it)
    keep = y != -100
    ref = torch.zeros(N).masked_scatter(keep, -F.cross_entropy(z[keep], y[keep], reduction="none"))
    torch.testing.assert_close(out["log_probs"], ref, rtol=1e-5, atol=1e-6)
    p = z.softmax(-1)
    ref_entropy = torch.where(keep, -(p * z.log_softmax(-1)).sum(-1), 0.0)
    torch.testing.assert_close(out["entropy"], ref_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["mean_logits"], torch.where(keep, z.mean(-1), 0.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["log_sum_sq_probs"], torch.where(keep, (p * p).sum(-1).log(), 0.0),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(out["is_top1"], keep & (z.argmax(-1) == y))
    assert out["log_probs"].requires_grad and out["entropy"].requires_grad
    assert not out["mean_logits"].requires_grad and not out["log_sum_sq_probs"].requires_grad
    # the entropy's gradient (GRPO's entropy bonus trains on it): to hidden and weight, as autograd's
    dy = torch.randn(N)
    ref_grads = torch.autograd.grad((ref_entropy * dy).sum(), (h, w))
    torch.testing.assert_close(torch.autograd.grad((out["entropy"] * dy).sum(), (h, w)), ref_grads,
                               rtol=1e-4, atol=1e-6)


def test_a_batch_with_no_label_gives_zeros_and_a_graph(rows_seen):
    h, w, _ = inputs()
    y = torch.full((N,), -100)
    log_probs = token_logprobs(h, w, None, y)["log_probs"]
    (-log_probs.sum()).backward()  # an all-ignored micro-batch still trains (a zero gradient), as TRL's head
    assert rows_seen == [0] and (log_probs == 0).all() and (w.grad == 0).all()


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compile-form"])
@pytest.mark.parametrize("count", ["mean", "num_items_in_batch=0"])
def test_a_batch_with_every_label_ignored_gives_stock_s_nan_loss_and_zero_gradients(monkeypatch, count, compiling):
    # transformers' mean over no token (`reduction="mean"`, or a sum over `num_items_in_batch` = 0 in
    # a fully masked accumulation) is NaN, stock's too; stock's gradients stay zero (nll_loss writes
    # no term for an ignored token), so the optimizer step leaves the weights finite. The backward's
    # infinite grad_output must not turn the fused loss's zeros into NaN.
    monkeypatch.setattr(deferred.sites, "compiling", lambda: compiling)
    h, w, _ = inputs()
    y = torch.full((N,), -100)

    def loss(z):
        if count == "mean":
            return F.cross_entropy(z * 0.5, y)
        return F.cross_entropy(z * 0.5, y, reduction="sum") / torch.tensor(0)

    ref = loss(F.linear(h, w))
    ref.backward()
    assert torch.isnan(ref) and (h.grad == 0).all() and (w.grad == 0).all()  # stock's behaviour
    h.grad = w.grad = None
    got = loss(deferred.DeferredLogits(deferred._Head(h, w, None, SwapState()), (), h, torch.Size((N, V)), w.dtype))
    got.backward()
    assert torch.isnan(got)
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w)), \
        (h.grad.isnan().sum(), w.grad.isnan().sum())
