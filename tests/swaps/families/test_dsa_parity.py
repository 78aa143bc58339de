"""The DSA families (DeepSeek V3.2, GLM-MoE-DSA, GLM-5-next, Mistral Large 4), as benchmarks/census.py
builds them (GLM-5-next with its SwiGLU clamp in play, as benchmarks/glm5_next_parity.py builds it):
every norm swapped (the indexers' `k_norm`, and Mistral Large 4's `q_input_norm`, torch.nn.LayerNorms,
run layer_norm's kernel), and one training step in float32 equals stock's: the loss within 1e-5,
each parameter's gradient within GRAD_BOUND or, where stock's own float32 gradient is further from
the float64 one, within GRAD_FACTOR times that distance (the evidence for the factor: docs/swaps.md,
"Parity bounds and summation order", and benchmarks/glm5_next_parity.py).

The indexers' scores only choose keys: no gradient flows back through their norms, and at these
tiny sequence lengths every key is chosen, so the step's numbers do not see the LayerNorm kernel;
its numerics are tests/kernels/test_layer_norm.py's and tests/swaps/layers/test_layer_norm_swap.py's.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from accel_kernels import _launch
from accel_patch import restore_kernels, swap_kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import census  # noqa: E402

transformers = pytest.importorskip("transformers")

GRAD_BOUND = 1e-4
#: A reordering of stock's own RMSNorm sums (benchmarks/glm5_next_parity.py) moved GLM-5-next's
#: hyper-connection gradients by up to 5.0x stock's float32 distance from float64: a swap that
#: reorders the same sums is held to that.
GRAD_FACTOR = 5.0
FAMILIES = ["deepseek_v32", "glm_moe_dsa", "glm5_next", "mistral_large4"]


def _model(key):
    _, _, cls_name, extra = next(f for f in census.FAMILIES if f[0] == key)
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    if key == "glm5_next":  # its gate/up weights scaled until pre-activations pass swiglu_limit
        import glm5_next_parity

        model = glm5_next_parity.build(10.0)
        restore_kernels(model)
        return model
    torch.manual_seed(0)
    model = census.build(transformers, cls_name, cls(**census.tiny_kwargs(cls, extra)))
    restore_kernels(model)  # the load hook may have swapped at from_config
    return model


def _step(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    if model.get_output_embeddings() is not None:
        loss = model(input_ids=ids, labels=ids).loss
    else:  # a text model without an LM head: a fixed weighting of its last hidden states
        h = model(input_ids=ids).last_hidden_state
        loss = (h * torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)).sum()
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.slow  # ~5-10 s a family: three training steps of a tiny model, the kernels interpreted
@pytest.mark.parametrize("family", FAMILIES)
def test_every_norm_is_swapped_and_a_training_step_equals_stock(family):
    stock = _model(family)
    swapped = copy.deepcopy(stock)
    reference = copy.deepcopy(stock).double()
    reference.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    report = swap_kernels(swapped)
    # the indexers' k_norm (and Mistral Large 4's q_input_norm)
    layer_norms = [m for m in swapped.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert layer_norms and report.swapped.get("layer_norm") == len(layer_norms), report
    assert not [r for r in report.refused if r.op in ("rms_norm", "layer_norm")], report.refused
    ids = torch.randint(0, census.VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    loss0, g0 = _step(stock, ids)
    with _launch.recording() as launched:
        loss1, g1 = _step(swapped, ids)
    _, g64 = _step(reference, ids)
    # the indexers' scores only pick keys (no gradient flows back through them): forward launches
    assert launched.count("_layer_norm_fwd_kernel") >= len(layer_norms), launched
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    assert g1.keys() == g0.keys()
    for name in g0:
        bound = max(GRAD_BOUND, GRAD_FACTOR * rel(g0[name], g64[name]))
        assert rel(g1[name], g0[name]) <= bound, (name, rel(g1[name], g0[name]), rel(g0[name], g64[name]))
