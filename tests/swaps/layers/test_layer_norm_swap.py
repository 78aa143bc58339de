"""LayerNorm sites (op "layer_norm"): torch.nn.LayerNorm in each of its affine forms and named
LayerNorm classes with a weight and a bias run accel_kernels.layer_norm with the stock module's
outputs and gradients; a LayerNorm over several dims, one that is not mean-centred, one that drops
its bias and one whose eps is not its attribute's are refused with the reason; restore puts the
stock forward back. The DSA families' indexer norms are in tests/swaps/families/test_dsa_parity.py."""
from __future__ import annotations

import copy

import pytest
import torch

from accel_kernels import _launch
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import probe

W = 48


class Holder(torch.nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child


class NamedLayerNorm(torch.nn.Module):
    """A family's own LayerNorm class (weight, bias, variance_epsilon), computed in float32 and cast back."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.bias = torch.nn.Parameter(torch.zeros(n))
        self.variance_epsilon = eps

    def forward(self, x):
        h = x.float()
        h = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, keepdim=True, unbiased=False) + self.variance_epsilon)
        return (self.weight.float() * h + self.bias.float()).to(x.dtype)


class UncentredLayerNorm(NamedLayerNorm):
    """Named LayerNorm, but an RMSNorm plus a bias."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h + self.bias.float()).to(x.dtype)


class BiasDroppingLayerNorm(NamedLayerNorm):
    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, None, self.variance_epsilon)


class FixedEpsLayerNorm(NamedLayerNorm):
    """Its attribute says one eps, its forward uses 1e-5."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.cache.clear()
    yield
    probe.cache.clear()


def randomized(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name == "weight" else 0.0))
    return module


def assert_step_equals_stock(model, stock, dtype=torch.float32):
    x = (torch.randn(2, 7, W) * 2 + 3).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(2, 7, W)  # (not y**2: a LayerNorm's sum of squares is constant, its gradient noise)
    with _launch.recording() as launched:
        y = model.child(x1)
        (y.float() * dy).sum().backward()
    assert {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"} <= set(launched), launched
    want = stock(x2)
    (want.float() * dy).sum().backward()
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.dtype == want.dtype and probe.rel_err(y, want) <= bound
    assert probe.rel_err(x1.grad, x2.grad) <= bound
    for (name, p), q in zip(model.child.named_parameters(), stock.parameters()):
        assert probe.rel_err(p.grad, q.grad) <= bound, name


@pytest.mark.parametrize("kwargs", [dict(), dict(bias=False), dict(elementwise_affine=False)],
                         ids=["weight-bias", "weight", "neither"])
def test_torch_layer_norm_swaps_in_each_affine_form_and_equals_stock(kwargs):
    stock = randomized(torch.nn.LayerNorm(W, eps=1e-6, **kwargs))
    model = Holder(copy.deepcopy(stock))
    report = swap_kernels(model, ops=["layer_norm"])
    assert report.swapped == {"layer_norm": 1} and not report.refused, report
    assert_step_equals_stock(model, stock)
    assert restore_kernels(model) and "forward" not in model.child.__dict__


@pytest.mark.parametrize("dtype, param_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_half_precision_models_with_half_or_float32_norms(dtype, param_dtype):
    # a bf16 model, and a bf16 model that keeps its LayerNorms in float32 (torch takes both)
    stock = randomized(torch.nn.LayerNorm(W)).to(param_dtype)
    model = Holder(copy.deepcopy(stock))
    model.register_buffer("act", torch.zeros(1, dtype=dtype))  # the model's activation dtype
    model.get_input_embeddings = lambda: model  # noqa: E731 (activation_dtype reads the embedding's weight)
    model.weight = model.act
    report = swap_kernels(model, ops=["layer_norm"])
    assert report.swapped == {"layer_norm": 1}, report
    assert_step_equals_stock(model, stock, dtype)


def test_a_named_layer_norm_class_with_weight_and_bias_swaps():
    stock = randomized(NamedLayerNorm(W, eps=1e-6))
    model = Holder(copy.deepcopy(stock))
    report = swap_kernels(model)
    assert report.swapped == {"layer_norm": 1} and not report.refused, report
    assert_step_equals_stock(model, stock)


@pytest.mark.parametrize("cls, eps, words", [
    (UncentredLayerNorm, 1e-3, "on rows far from zero mean"),
    (BiasDroppingLayerNorm, 1e-3, "on rows far from zero mean"),
    # 1e-6 named, 1e-5 used: invisible on rows of variance ~4 (1e-6 relative), plain near eps
    (FixedEpsLayerNorm, 1e-6, "on rows of variance near its eps"),
])
def test_a_layer_norm_computing_another_function_is_refused_with_the_reason(cls, eps, words):
    module = randomized(cls(W, eps=eps))
    report = swap_kernels(Holder(module))
    assert report.swapped == {}, report
    [refusal] = [r for r in report.refused if r.op == "layer_norm"]
    assert f"output differs from LayerNorm (eps={eps:g}, weight, bias)" in refusal.reason, refusal
    assert words in refusal.reason, refusal


def test_a_layer_norm_over_several_dims_is_refused():
    report = swap_kernels(Holder(torch.nn.LayerNorm((4, W))))
    [refusal] = report.refused
    assert refusal.op == "layer_norm" and "normalized_shape=(4, 48)" in refusal.reason, refusal


def test_rms_norm_alone_leaves_layer_norms_alone_and_says_nothing_of_them():
    model = Holder(torch.nn.LayerNorm(W))
    report = swap_kernels(model, ops=["rms_norm"])
    assert report.swapped == {} and report.refused == [], report
    assert swap_kernels(model, ops="layernorm").swapped == {"layer_norm": 1}  # the alias


@pytest.mark.slow  # dynamo and AOTAutograd over the swapped forward
def test_a_swapped_layer_norm_compiles_fullgraph_to_the_op_and_equals_stock():
    stock = randomized(torch.nn.LayerNorm(W, eps=1e-6))
    model = Holder(copy.deepcopy(stock))
    assert swap_kernels(model, ops=["layer_norm"]).swapped == {"layer_norm": 1}
    x = torch.randn(2, 7, W) * 2 + 3
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.child)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    nodes = [n for g in explained.graphs for n in g.graph.nodes if "accel_kernels.layer_norm" in str(n.target)]
    assert len(nodes) == 1, [str(n.target) for g in explained.graphs for n in g.graph.nodes]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = torch.compile(model.child, backend="aot_eager", fullgraph=True)(x1)
    y.sum().backward()
    want = stock(x2)
    want.sum().backward()
    assert probe.rel_err(y, want) <= 1e-5 and probe.rel_err(x1.grad, x2.grad) <= 1e-5
    torch._dynamo.reset()
