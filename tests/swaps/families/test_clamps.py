"""SwiGLU clamped at a limit (DeepSeek V4's and GLM-5-next's `swiglu_limit`): the probe drives the
pre-activations past it (the small random inputs of the first probe stay far below 10), so the plain kernels are refused with the reason instead of training
with wrong gradients; an unclamped module of the same shape still swaps."""
from __future__ import annotations

import types

import pytest
import torch

from accel_patch import swap_kernels
from accel_patch.swaps import probe

transformers = pytest.importorskip("transformers")


def _module(path: str, cls: str, **config):
    modeling = pytest.importorskip(f"transformers.models.{path}")
    if not hasattr(modeling, cls):
        pytest.skip(f"transformers has no {cls}")
    torch.manual_seed(0)
    module = getattr(modeling, cls)(types.SimpleNamespace(**config))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return module


class Holder(torch.nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child


MLP = dict(hidden_size=16, intermediate_size=24, mlp_bias=False, hidden_act="silu", swiglu_limit=10.0)


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.cache.clear()
    yield
    probe.cache.clear()


@pytest.mark.parametrize("path, cls, op", [("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", "glu"),
                                           ("glm5_next.modeling_glm5_next", "Glm5NextTextMLP", "glu")])
def test_a_clamped_gated_mlp_is_refused_with_its_limit(path, cls, op):
    model = Holder(_module(path, cls, **MLP))
    report = swap_kernels(model, ops=[op])
    assert report.swapped.get(op, 0) == 0, report
    (refusal,) = [r for r in report.refused if r.op == op]
    assert "limit of 10" in refusal.reason and "pre-activations" in refusal.reason, refusal


def test_the_same_mlp_with_its_clamp_out_of_reach_swaps():
    # a limit far past anything pre-activations reach (1e6, beyond probe.LIMIT_REACHED): the function is plain SwiGLU, and swaps
    model = Holder(_module("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", **{**MLP, "swiglu_limit": 1e6}))
    report = swap_kernels(model, ops=["glu"])
    assert report.swapped.get("glu") == 1, report
