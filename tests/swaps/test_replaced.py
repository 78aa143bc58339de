"""A site whose forward another tool rebinds after the swap (Axolotl's LoRA kernels rebind
`mlp.forward` per instance) is reported as replaced, by whom, and no longer claimed; a wrapper
that calls through the swapped forward keeps the claim."""
from __future__ import annotations

import functools
import types

import torch

import accel_patch

from _models import build


def _their_forward(self, x):
    return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def test_a_forward_rebound_after_the_swap_drops_its_claim_and_names_who():
    model = build("llama")
    accel_patch.swap_kernels(model)
    before = accel_patch.report(model)
    mlp = model.model.layers[0].mlp
    ours = mlp.forward

    @functools.wraps(ours)
    def wrapper(*args, **kwargs):  # calls through ours: still ours that runs
        return ours(*args, **kwargs)

    mlp.forward = wrapper
    assert accel_patch.report(model).replaced == []
    mlp.forward = types.MethodType(_their_forward, mlp)
    report = accel_patch.report(model)
    assert report.swapped["glu"] == before.swapped["glu"] - 1
    assert report.swapped["tiled_mlp"] == before.swapped["tiled_mlp"] - 1
    rows = {(where, op) for where, op, _ in report.replaced}
    assert ("model.layers.0.mlp", "glu") in rows and ("model.layers.0.mlp", "tiled_mlp") in rows, rows
    assert all(by.endswith("_their_forward") for _, _, by in report.replaced)
    assert "replaced after the swap" in report.short() and "_their_forward" in str(report)
    accel_patch.restore_kernels(model)
