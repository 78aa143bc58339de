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
