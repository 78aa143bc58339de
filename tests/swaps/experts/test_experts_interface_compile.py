"""`experts_implementation="accel_patch"` under torch.compile: a module the swap did not swap runs the
stock forward, counted once per compiled graph in the module's own table (interface.calls), on the
floor's torch (2.11, whose dynamo hands the counting function constants only) as on the newest."""
from __future__ import annotations

import pytest
import torch

from accel_patch import restore_kernels
from accel_patch.swaps.experts import interface

from _models import padded_batch, rel
from _moe_models import build, experts_modules

pytest.importorskip("transformers.integrations.moe")
pytestmark = pytest.mark.slow


def unswapped(implementation):
    model = build("qwen3_moe", output_router_logits=False)
    restore_kernels(model)  # no swap: the interface alone
    model.set_experts_implementation(implementation)
    return model


def test_a_compiled_forward_runs_the_stock_experts_counted_once_per_module_per_graph():
    """A forward without grad: the backward of transformers 5.17's grouped_mm fallback (what the
    interface runs, as stock does) failed AOTAutograd's trace on torch 2.11."""
    stock, ours = unswapped("grouped_mm"), unswapped("accel_patch")
    batch = padded_batch()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            logits0 = stock(**batch).logits
            compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
            logits1 = compiled(**batch).logits
            with torch._dynamo.config.patch(error_on_recompile=True):
                compiled(**batch)  # the same graph again: counted no more
    finally:
        torch._dynamo.reset()
    assert rel(logits1, logits0) <= 1e-5
    assert interface.calls(ours) == {"compiled: " + interface.COMPILING: len(experts_modules(ours))}


def test_layers_compiled_one_by_one_share_one_graph_as_with_grouped_mm():
    """The traced count goes to a table the model's experts share (their config's), so no guard on
    each module's identity: layers compiled on their own share their graph. Red when the count is
    keyed on the module (a trace per layer, then a hard failure past the recompile limit)."""
    from torch._dynamo.utils import counters

    model = build("qwen3_moe", output_router_logits=False, num_hidden_layers=4)
    restore_kernels(model)
    model.set_experts_implementation("accel_patch")
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2):
            model(**padded_batch(), use_cache=False)
    finally:
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1
    assert interface.calls(model) == {"compiled: " + interface.COMPILING: 1}  # one graph, traced once
