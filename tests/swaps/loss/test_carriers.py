"""The two carriers of deferred logits read one set of rules: what the eager tensor subclass keeps
deferred, the compile path's plain stand-in keeps deferred too, with the same loss and gradients,
and what one computes the other computes. (The stand-in is exercised here outside torch.compile,
where it obeys the same rules; tests/swaps/test_compile.py traces it.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accel_patch.swaps import sites
from accel_patch.swaps.loss.compiled_loss import LogitsStandIn
from accel_patch.swaps.loss.deferred import DeferredLogits, _Head

from _models import rel

TRANSFORMS = [
    lambda z: z.float(),
    lambda z: z.to(torch.float64).type_as(torch.ones(1)),
    lambda z: z / 3.0,
    lambda z: torch.div(z, 4.0),
    lambda z: 0.5 * z,
    lambda z: torch.tanh(z / 2.0) * 2.0,            # final-logit soft-capping
    lambda z: z[:, :-1, :].contiguous(),           # a shift on the logits
    lambda z: z[..., 1:, :],
    lambda z: z.to("cpu").reshape(-1, 50),          # a move to its own device: nothing to do
    lambda z: z.to(torch.float32).reshape(-1, 50),
]


def carriers(h, w, b):
    shape = torch.Size((*h.shape[:-1], w.shape[0]))
    state = sites.SwapState()
    return [(DeferredLogits(_Head(h, w, b, state), (), h, shape, w.dtype), state),
            (LogitsStandIn(_Head(h, w, b), (), h, shape, w.dtype), None)]


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_both_carriers_keep_the_same_operations_deferred_with_the_stock_loss(transform):
    torch.manual_seed(0)
    h = torch.randn(2, 6, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    y = torch.randint(0, 50, (12,))
    y[3] = -100
    for z, state in carriers(h, w, b):
        out = transform(z)
        assert type(out) is type(z) and not z._head.computed
        if state is not None:
            assert state.loss_calls == {}  # nothing counted before the loss runs
        n = out.shape[:-1].numel()
        fused = F.cross_entropy(out.reshape(-1, 50), y[:n])
        assert not z._head.computed  # the fused kernel ran: the logits were never built
        fused_grads = torch.autograd.grad(fused, (h, w, b))
        stock = F.cross_entropy(transform(F.linear(h, w, b)).reshape(-1, 50).float(), y[:n])
        stock_grads = torch.autograd.grad(stock, (h, w, b))
        assert rel(fused, stock) <= 1e-5
        assert all(rel(a, s) <= 1e-4 for a, s in zip(fused_grads, stock_grads))
        assert torch.equal(out.materialize(), transform(F.linear(h, w, b)))  # computed: the stock values
        if state is not None:
            assert state.loss_calls == {"fused": 1}


@pytest.mark.parametrize("op", [
    lambda z: z + 1.0, lambda z: 1.0 - z, lambda z: z.softmax(-1), lambda z: z[..., :10], lambda z: z * z,
    lambda z: torch.tanh(torch.tanh(z)), lambda z: z.to(torch.int32), lambda z: z.sum(),
])
def test_both_carriers_compute_the_real_logits_for_any_other_operation(op):
    h, w = torch.randn(2, 3, 8), torch.randn(20, 8)
    for z, state in carriers(h, w, None):
        out = op(z)
        assert not isinstance(out, (DeferredLogits, LogitsStandIn)) and z._head.computed
        assert torch.equal(out, op(F.linear(h, w)))
        if state is not None:  # the eager carrier counts why the logits were computed
            assert len(state.loss_calls) == 1 and next(iter(state.loss_calls)).startswith("logits computed for")
