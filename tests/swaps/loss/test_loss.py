"""The fused LM-head loss: the stock forward around it, the stock loss semantics, logits when asked."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_patch
from accel_patch import swap_kernels
from accel_patch.swaps.loss import deferred as deferred_logits
from accel_patch.swaps import sites

from _models import build, padded_batch, pair, rel, training_step


def calls(model):
    return model.__dict__[sites.STATE_ATTR].loss_calls


@pytest.fixture
def models():
    stock, twin = pair("llama")
    swap_kernels(twin)
    return stock, twin


def test_eval_and_calls_without_labels_return_stock_logits(models):
    stock, twin = models
    batch = padded_batch()
    for m in (stock, twin):
        m.eval()
    with torch.no_grad():
        a, b = stock(**batch), twin(**batch)  # eval with labels: stock path, logits returned
        assert torch.allclose(a.logits, b.logits, rtol=0, atol=1e-5) and rel(b.loss, a.loss) <= 1e-6
        stock.train(), twin.train()
        no_labels = {k: v for k, v in batch.items() if k != "labels"}
        a, b = stock(**no_labels), twin(**no_labels)
        assert b.loss is None and torch.allclose(a.logits, b.logits, rtol=0, atol=1e-5)
    assert calls(twin) == {}


def test_generate_is_stock(models):
    stock, twin = models
    ids = padded_batch()["input_ids"][:1, 5:]
    for m in (stock, twin):
        m.eval()
    assert torch.equal(stock.generate(ids, max_new_tokens=4, do_sample=False),
                       twin.generate(ids, max_new_tokens=4, do_sample=False))


def test_num_items_in_batch_normalises_as_stock(models):
    stock, twin = models
    batch = padded_batch()
    n = torch.tensor(37)  # Trainer's token count over all micro-batches of a step
    loss0, grads0, _ = training_step(stock, batch, num_items_in_batch=n)
    loss1, grads1, _ = training_step(twin, batch, num_items_in_batch=n)
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    assert calls(twin) == {"fused": 1}


@pytest.mark.slow  # over 2 s
def test_shift_labels_and_ignore_index_are_honoured(models):
    stock, twin = models
    batch = padded_batch()
    batch = dict(batch, labels=batch["labels"].masked_fill(batch["labels"] == -100, -7))
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-7)
    for extra in ({"ignore_index": -7}, {"ignore_index": -7, "shift_labels": shift}):
        loss0, grads0, _ = training_step(stock, batch, **extra)
        loss1, grads1, _ = training_step(twin, batch, **extra)
        assert rel(loss1, loss0) <= 1e-5, extra
        assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4, extra


def test_all_labels_ignored_gives_what_stock_gives():
    stock, twin = pair("llama")
    swap_kernels(twin)
    batch = dict(padded_batch(), labels=torch.full((3, 10), -100))
    for m in (stock, twin):
        m.train()
    a, b = stock(**batch).loss, twin(**batch).loss
    assert torch.isnan(a) and torch.isnan(b)  # mean over no token, as stock


def test_tied_embeddings_get_the_head_gradient():
    stock, twin = pair("llama", tie_word_embeddings=True)
    assert twin.lm_head.weight is twin.model.embed_tokens.weight
    swap_kernels(twin)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = training_step(twin, batch)
    assert out.logits is None and calls(twin) == {"fused": 1}
    assert rel(grads1["model.embed_tokens.weight"], grads0["model.embed_tokens.weight"]) <= 1e-4


def test_a_tuple_output_keeps_the_logits_in_place(models):
    stock, twin = models
    batch = padded_batch()
    for m in (stock, twin):
        m.train()
    a, b = stock(**batch, return_dict=False), twin(**batch, return_dict=False)
    assert isinstance(b, tuple) and len(a) == len(b)
    assert torch.allclose(a[1], b[1], rtol=0, atol=1e-5)
    # counted as what it is, not as a call without labels
    from accel_patch.swaps.loss import site

    assert calls(twin) == {site.TUPLE_OUTPUT: 1}


def test_a_custom_loss_that_needs_the_logits_gets_the_real_ones():
    stock, twin = pair("llama")
    swap_kernels(twin)

    def log_softmax_loss(logits, labels, vocab_size, **kwargs):
        logp = torch.log_softmax(logits.float(), -1)[:, :-1]
        target = labels[:, 1:]
        keep = target != -100
        return -(logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum() / keep.sum()

    for m in (stock, twin):
        m.loss_function = log_softmax_loss
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    assert out.logits is not None and out.logits.shape == (3, 10, 128)
    assert not isinstance(out.logits, deferred_logits.DeferredLogits)
    # the loss is the custom function of the returned (real) logits, exactly
    assert torch.equal(loss1, log_softmax_loss(out.logits.detach(), batch["labels"], 128))
    assert calls(twin) == {"logits computed for log_softmax": 1}


# --- DeferredLogits on its own: what stays deferred, and the values when computed ---------------

def deferred(hidden, weight, bias=None):
    state = sites.SwapState()
    head = deferred_logits._Head(hidden, weight, bias, state)
    shape = torch.Size((*hidden.shape[:-1], weight.shape[0]))
    return deferred_logits.DeferredLogits(head, (), hidden, shape, weight.dtype), state


def test_cross_entropy_options_the_kernel_lacks_run_stock():
    h, w = torch.randn(4, 8), torch.randn(20, 8)
    y = torch.randint(0, 20, (4,))
    for kwargs in ({"label_smoothing": 0.1}, {"weight": torch.rand(20)}):
        z, state = deferred(h, w)
        got = F.cross_entropy(z, y, **kwargs)
        assert torch.equal(got, F.cross_entropy(F.linear(h, w), y, **kwargs))
        assert "fused" not in state.loss_calls


def test_a_training_call_without_labels_is_a_fall_back_and_the_swap_line_stops_claiming_the_loss():
    """TRL's ORPO and CPO call the model without labels and take log_softmax over the full logits:
    the fused loss never runs there, so the calls are counted as a fall-back and the swap line does
    not list the loss."""
    from accel_patch.swaps.loss import site
    from accel_patch.swaps.report import is_fallback

    model = build("llama")
    swap_kernels(model)
    assert "fused_linear_cross_entropy 1" in accel_patch.report(model).short()
    model.train()
    ids = torch.randint(3, 100, (2, 12))
    logits = model(input_ids=ids).logits  # the caller's own loss follows
    assert logits is not None and logits.requires_grad
    with torch.no_grad():
        model(input_ids=ids)  # no graph (a reference or generation pass): nothing to count
    report = accel_patch.report(model)
    assert report.calls["fused_linear_cross_entropy"] == {site.NO_LABELS: 1} and is_fallback(site.NO_LABELS)
    line = report.short()
    assert "fused_linear_cross_entropy" not in line and "loss 1" not in line
    assert line.endswith("; loss: not run (see fall-backs)") and len(line) <= 100
