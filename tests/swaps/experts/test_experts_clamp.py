"""The clamped SwiGLU experts (DeepSeek V4's `limit`, GLM-5-next's `swiglu_limit` and its F.silu
called in the forward): proved by a probe whose pre-activations reach past the bound, run with the
clamp in the op's epilogue, gradients equal to stock's with about 1% of the pre-activations past
the bound; a clamp the plan cannot name is refused with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

from accel_patch import report as live_report
from accel_patch import swap_kernels
from accel_patch.swaps import experts, probe

from _models import rel

FAMILIES = {  # experts class: (config class, config overrides)
    "DeepseekV4Experts": ("DeepseekV4Config", {"intermediate_size": 16}),
    "Glm5NextTextExperts": ("Glm5NextTextConfig", {"moe_intermediate_size": 16}),
}


def experts_module(name):
    config_name, extra = FAMILIES[name]
    config_cls = getattr(transformers, config_name, None)
    module_path = {"DeepseekV4Experts": "deepseek_v4.modeling_deepseek_v4",
                   "Glm5NextTextExperts": "glm5_next.modeling_glm5_next"}[name]
    try:
        module = __import__(f"transformers.models.{module_path}", fromlist=[name])
    except ImportError:
        module = None
    cls = getattr(module, name, None)
    if config_cls is None or cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config = config_cls(hidden_size=32, num_local_experts=4, num_experts_per_tok=2, **extra)
    torch.manual_seed(0)
    experts_ = cls(config)
    with torch.no_grad():
        experts_.gate_up_proj.normal_(0, 1 / 32 ** 0.5)
        experts_.down_proj.normal_(0, 1 / 16 ** 0.5)
    return experts_


def routed_inputs(tokens=48, hidden=32, experts_count=4, scale=3.9):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=g) * scale
    top = torch.randn(tokens, experts_count, generator=g).softmax(-1).topk(2, dim=-1)
    return x, top.indices, top.values


def fraction_past(module, x, index, limit):
    gu = torch.einsum("th,eih->eti", x, module.gate_up_proj.detach())
    routed = torch.nn.functional.one_hot(index, module.gate_up_proj.shape[0]).sum(1).t().bool()
    gate, up = gu[routed].chunk(2, dim=-1)
    return float(((gate > limit).sum() + (up.abs() > limit).sum()) / (gate.numel() * 2))


def step(module, x, index, weights, dout):
    x = x.clone().requires_grad_()
    weights = weights.clone().requires_grad_()
    module.zero_grad()
    out = module(x, index, weights)
    out.backward(dout)
    return out.detach(), {"hidden": x.grad, "weights": weights.grad,
                          **{n: p.grad for n, p in module.named_parameters()}}


@pytest.fixture(autouse=True)
def fresh_probes():
    probe.cache.clear()
    yield
    probe.cache.clear()


@pytest.mark.slow  # the probe and a step interpreted: 3 s
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_clamped_experts_run_the_clamp_and_equal_stock_past_the_limit(name):
    stock = experts_module(name)
    limit = experts.site.limit_of(stock)
    assert limit == 10.0
    twin = copy.deepcopy(stock)
    holder = torch.nn.Sequential(twin)
    report = swap_kernels(holder, ops="experts")
    assert report.swapped.get(experts.OP) == 1, report
    plan = twin.__dict__[experts.SITE_ATTR].plan
    assert (plan.activation, plan.limit) == ("silu", 10.0), plan
    x, index, weights = routed_inputs()
    assert 0.003 <= fraction_past(stock, x, index, limit) <= 0.03
    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    from accel_kernels import _launch

    out0, grads0 = step(stock, x, index, weights, dout)
    with _launch.recording() as launched:
        out1, grads1 = step(twin, x, index, weights, dout)
    assert "_moe_gate_up_kernel" in launched, launched
    assert live_report(holder).calls[experts.OP] == {"fused": 1}
    assert rel(out1, out0) <= 1e-5
    for n in grads0:
        assert rel(grads1[n], grads0[n]) <= 1e-4, (n, rel(grads1[n], grads0[n]))


@pytest.mark.slow  # the probe interpreted, every reading twice: 0.9 s
def test_a_clamp_no_attribute_names_is_refused_with_the_reason():
    stock = experts_module("DeepseekV4Experts")
    bound = stock.limit
    del stock.limit  # the forward clamps at a bound neither the module nor its configuration declares
    if getattr(stock, "config", None) is not None:
        stock.config.swiglu_limit = 1e6  # "no clamp": past probe.LIMIT_REACHED

    def apply_gate(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return stock.act_fn(gate.clamp(max=bound)) * up.clamp(-bound, bound)

    stock._apply_gate = apply_gate
    report = swap_kernels(torch.nn.Sequential(stock), ops="experts")
    assert experts.OP not in report.swapped
    (reason,) = [r.reason for r in report.refused if r.op == experts.OP]
    assert "differs from every reading of the MoE experts" in reason and "reaching 40" in reason, reason
