"""SwiGLU clamped at a limit (DeepSeek V4's and GLM-5-next's `swiglu_limit`): the probe drives the
pre-activations past it (the small random inputs of the first probe stay far below 10); the
kernel clamps as the module does (gate at most the limit, up within it) and equals stock there,
and a clamp of another form is refused with the reason instead of training with wrong
gradients; an unclamped module of the same shape still swaps."""
from __future__ import annotations

import copy
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


CLAMPED = [("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP"), ("glm5_next.modeling_glm5_next", "Glm5NextTextMLP")]


@pytest.mark.parametrize("path, cls", CLAMPED)
def test_a_clamped_gated_mlp_runs_the_clamp_in_the_kernel_and_equals_stock_past_it(path, cls):
    from accel_kernels import _launch
    from accel_patch.swaps.layers import mlp

    module = _module(path, cls, **MLP)
    stock = copy.deepcopy(module)
    model = Holder(module)
    report = swap_kernels(model, ops=["glu"])
    assert report.swapped.get("glu") == 1 and not report.refused, report.refused
    plan = mlp.probe_verdict(stock, torch.float32, *mlp.candidate(stock))
    assert isinstance(plan, mlp.GluPlan) and plan.limit == 10.0, plan
    x = (torch.randn(2, 7, 16) * 60).requires_grad_()  # pre-activations far past 10
    with torch.no_grad():
        pre = torch.cat([stock.gate_proj(x), stock.up_proj(x)], -1)
    assert float((pre.abs() > 10).float().mean()) > 0.05, "the input does not reach the clamp"
    x2 = x.detach().requires_grad_()
    with _launch.recording() as launched:
        y = model.child(x)
        y.sum().backward()
    assert {"_glu_forward_kernel", "_glu_backward_kernel"} <= set(launched), launched
    want = stock(x2)
    want.sum().backward()
    assert probe.rel_err(y, want) <= 1e-5 and probe.rel_err(x.grad, x2.grad) <= 1e-5
    for (name, p), q in zip(model.child.named_parameters(), stock.parameters()):
        assert probe.rel_err(p.grad, q.grad) <= 1e-5, name


def test_a_clamped_mlp_whose_weights_reach_the_clamp_on_small_inputs_swaps_with_the_clamp():
    # weights 25x the census model's: the probe's first, small inputs already pass the limit, where
    # the unclamped function differs; the clamped plan is tried there too (it used to be refused)
    from accel_kernels import _launch
    from accel_patch.swaps.layers import mlp

    module = _module("glm5_next.modeling_glm5_next", "Glm5NextTextMLP", **MLP)
    with torch.no_grad():
        for proj in (module.gate_proj, module.up_proj):
            proj.weight.mul_(200.0)
    stock = copy.deepcopy(module)
    x = torch.randn(2, 7, 16)
    with torch.no_grad():
        pre = torch.cat([stock.gate_proj(x), stock.up_proj(x)], -1)
    assert float((pre.abs() > 10).float().mean()) > 0.05, "small inputs do not reach the clamp"
    model = Holder(module)
    report = swap_kernels(model, ops=["glu"])
    assert report.swapped.get("glu") == 1 and not report.refused, report.refused
    assert mlp.probe_verdict(stock, torch.float32, *mlp.candidate(stock)).limit == 10.0
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with _launch.recording() as launched:
        y = model.child(x1)
        y.sum().backward()
    assert "_glu_forward_kernel" in launched
    want = stock(x2)
    want.sum().backward()
    assert probe.rel_err(y, want) <= 1e-5 and probe.rel_err(x1.grad, x2.grad) <= 1e-5


@pytest.mark.parametrize("path, cls", CLAMPED[:1])
def test_a_clamped_mlp_refuses_the_fused_lora_mlp_which_does_not_clamp(path, cls):
    model = Holder(_module(path, cls, **MLP))
    report = swap_kernels(model, ops=["glu", "lora_mlp"])
    assert report.swapped.get("glu") == 1, report
    (refusal,) = [r for r in report.refused if r.op == "lora_mlp"]
    assert "clamps gate/up at 10" in refusal.reason and "does not clamp" in refusal.reason, refusal


def test_a_clamp_of_another_form_is_refused_with_its_limit():
    # gate clamped on both sides: not the kernel's clamp (gate at most the limit), so past the limit
    # the kernel would compute another function
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

    class BothSides(modeling.DeepseekV4MLP):
        def forward(self, x):
            gate = self.gate_proj(x).clamp(min=-self.limit, max=self.limit)
            up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
            return self.down_proj(self.act_fn(gate) * up)

    torch.manual_seed(0)
    module = BothSides(types.SimpleNamespace(**MLP))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    report = swap_kernels(Holder(module), ops=["glu"])
    assert report.swapped.get("glu", 0) == 0, report
    (refusal,) = [r for r in report.refused if r.op == "glu"]
    assert "limit of 10" in refusal.reason and "pre-activations" in refusal.reason, refusal


def test_a_clamp_no_limit_names_is_seen_up_to_the_reach_the_experts_probe_uses_too():
    # the forward clamps at 35, a bound neither the module nor its configuration names: the dense
    # probe drives pre-activations to families.UNNAMED_REACH (40), past it, as the experts' does
    from accel_patch.swaps import families

    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

    class Hidden(modeling.DeepseekV4MLP):
        def forward(self, x):
            gate = self.gate_proj(x).clamp(max=35.0)
            return self.down_proj(self.act_fn(gate) * self.up_proj(x))

    torch.manual_seed(0)
    module = Hidden(types.SimpleNamespace(**{**MLP, "swiglu_limit": 1e6}))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    assert probe.reach(module) == probe.reach_past([]) == families.UNNAMED_REACH > 35.0
    report = swap_kernels(Holder(module), ops=["glu"])
    assert report.swapped.get("glu", 0) == 0, report
    (refusal,) = [r for r in report.refused if r.op == "glu"]
    assert "pre-activations up to 40" in refusal.reason, refusal
    assert probe.reach_past([10.0]) == 40.0 and probe.reach_past([20.0]) == 80.0  # 4x the largest limit named


def test_two_limits_of_one_class_get_their_own_verdicts():
    # one process, one class, two configurations: the first's plain plan must not serve the second
    from accel_kernels import _launch

    far = Holder(_module("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", **{**MLP, "swiglu_limit": 1e6}))
    near_module = _module("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", **MLP)
    stock = copy.deepcopy(near_module)
    near = Holder(near_module)
    assert swap_kernels(far, ops=["glu"]).swapped.get("glu") == 1
    assert swap_kernels(near, ops=["glu"]).swapped.get("glu") == 1
    x = torch.randn(2, 7, 16) * 60
    with _launch.recording() as launched:
        y = near.child(x)
    assert "_glu_forward_kernel" in launched and probe.rel_err(y, stock(x)) <= 1e-5


def test_the_same_mlp_with_its_clamp_out_of_reach_swaps():
    # a limit far past anything pre-activations reach (1e6, beyond probe.LIMIT_REACHED): the function is plain SwiGLU, and swaps
    model = Holder(_module("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", **{**MLP, "swiglu_limit": 1e6}))
    report = swap_kernels(model, ops=["glu"])
    assert report.swapped.get("glu") == 1, report


@pytest.mark.slow  # dynamo and AOTAutograd over the clamped op
def test_a_clamped_mlp_compiles_fullgraph_with_the_clamp_in_the_graph_and_equals_stock():
    module = _module("deepseek_v4.modeling_deepseek_v4", "DeepseekV4MLP", **MLP)
    stock = copy.deepcopy(module)
    model = Holder(module)
    assert swap_kernels(model, ops=["glu"]).swapped.get("glu") == 1
    x = (torch.randn(2, 7, 16) * 60).requires_grad_()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.child)(x)
    assert explained.graph_break_count == 0
    nodes = [n for g in explained.graphs for n in g.graph.nodes if "accel_kernels.glu" in str(n.target)]
    assert nodes and all(10.0 in n.args for n in nodes), [n.args for n in nodes]
    x1, x2 = x.detach().requires_grad_(), x.detach().requires_grad_()
    y = torch.compile(model.child, backend="aot_eager", fullgraph=True)(x1)
    y.sum().backward()
    want = stock(x2)
    want.sum().backward()
    assert probe.rel_err(y, want) <= 1e-5 and probe.rel_err(x1.grad, x2.grad) <= 1e-5
    torch._dynamo.reset()
