"""The norms of the 2026 families beyond the weighted one-input RMSNorm: weightless norms (Gemma 4's
value norm, Llama 4's q/k L2 norm, DeepSeek V4's and GLM-5-next's unweighted norms) and the gated
norms of linear-attention layers (gate after the norm) and Mamba layers (gate before it). Each is built from its family's own class in the
installed transformers (skipped where that release lacks it), swapped with ops=["rms_norm"], and
either runs the kernel with the stock module's outputs and gradients, or is refused with its form
named."""
from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch

from accel_kernels import _launch
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import probe

transformers = pytest.importorskip("transformers")

W = 48  # the normalized width


def _cls(family: str, name: str):
    try:
        return getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    except (ImportError, AttributeError):
        pytest.skip(f"transformers {transformers.__version__} has no {family}.{name}")


# (family, class, constructor keyword arguments, gated); the quick loop takes one class of each
# formula (the rest repeat a formula under another name: slow)
SWAPPED = [
    ("gemma4", "Gemma4RMSNorm", dict(with_scale=False), False),
    ("llama4", "Llama4TextL2Norm", dict(), False),
    ("deepseek_v4", "DeepseekV4UnweightedRMSNorm", dict(), False),
    ("glm5_next", "Glm5NextTextUnweightedRMSNorm", dict(), False, "slow"),
    ("qwen3_next", "Qwen3NextRMSNormGated", dict(hidden_size=W), True),
    ("qwen3_5", "Qwen3_5RMSNormGated", dict(hidden_size=W), True, "slow"),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", dict(hidden_size=W), True, "slow"),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", dict(hidden_size=W), True, "slow"),
    ("kimi_linear", "KimiLinearRMSNormGated", dict(hidden_size=W), True),
    ("glm5_next", "Glm5NextTextRMSNormGated", dict(hidden_size=W), True, "slow"),
    ("falcon_h1", "FalconH1RMSNormGated", dict(hidden_size=W), True, "slow"),
    # gating before normalizing, norm(x * silu(gate)) * weight, one group over the width
    ("nemotron_h", "NemotronHRMSNormGated", dict(hidden_size=W, group_size=W), True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", dict(hidden_size=W, group_size=W), True, "slow"),
    ("mamba2", "MambaRMSNormGated", dict(hidden_size=W, group_size=W), True, "slow"),
    ("bamba", "BambaRMSNormGated", dict(hidden_size=W, group_size=W), True, "slow"),
    ("zamba2", "Zamba2RMSNormGated", dict(hidden_size=W, group_size=W), True, "slow"),
    ("falcon_h1", "FalconH1RMSNormGated", dict(hidden_size=W, norm_before_gate=False), True, "slow"),
    # normalized per group: the weightless kernel per group, then the weight (NemotronHConfig's and
    # Mamba2Config's default n_groups=8)
    ("nemotron_h", "NemotronHRMSNormGated", dict(hidden_size=W, group_size=W // 4), True),
    ("falcon_h1", "FalconH1RMSNormGated", dict(hidden_size=W, n_groups=2), True, "slow"),
]

# (family, class, constructor keyword arguments, words of the refusal)
REFUSED = [
    ("nemotron_h", "NemotronHRMSNormGated", dict(hidden_size=W, group_size=W // 4 + 1), "that do not divide its width"),
    ("dory", "DoryL2Norm", dict(), "differs from every weightless RMSNorm variant"),
    ("hy_v4", "HYV4UnweightedRMSNorm", dict(), "differs from every weightless RMSNorm variant"),  # returns 1/rms
]


def _make(cls, kwargs):
    """`cls(eps=1e-6, **kwargs)`, the width passed by position where the constructor requires one
    that `kwargs` lacks (Gemma 4's weightless norm names it `dim` up to transformers 5.24,
    `hidden_size` from 5.25)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if "group_size" in kwargs and "group_size" not in {p.name for p in params}:
        # transformers 5.17's Mamba2, Bamba and Granite 4 hybrid gated norms: one group over the width
        if kwargs["group_size"] != kwargs.get("hidden_size", W):
            pytest.skip(f"transformers {transformers.__version__}'s {cls.__name__} takes no group_size")
        kwargs = {k: v for k, v in kwargs.items() if k != "group_size"}
    first = params[0] if params else None
    if first is not None and first.default is first.empty and first.name not in kwargs and first.name != "eps":
        return cls(W, eps=1e-6, **kwargs)
    return cls(eps=1e-6, **kwargs)


def _params(cases):
    """pytest params of `cases`, those ending in "slow" marked slow."""
    return [pytest.param(*c[:4], id=f"{c[1]}-{c[3]}"[:40] if isinstance(c[3], str) else c[1],
                         marks=[pytest.mark.slow] if c[4:] == ("slow",) else []) for c in cases]


def _swapped(module, dtype):
    """(stock copy, container swapped with ops=["rms_norm"], report), the norm in `dtype` with a
    random weight (so that w and 1 + w differ)."""
    torch.manual_seed(0)
    module = module.to(dtype)
    if getattr(module, "weight", None) is not None:
        with torch.no_grad():
            module.weight.copy_(1.0 + 0.3 * torch.randn(W))
    stock = copy.deepcopy(module)
    probe.cache.clear()
    container = torch.nn.Sequential(module)
    return stock, container, swap_kernels(container, ops=["rms_norm"])


def _inputs(dtype, gated):
    x = (torch.randn(2, 5, W) * 2).to(dtype).requires_grad_()
    gate = (torch.randn(2, 5, W) * 3).to(dtype).requires_grad_() if gated else None
    return x, gate


def _run(module, x, gate, dy):
    x = x.detach().requires_grad_()
    gate = gate.detach().requires_grad_() if gate is not None else None
    y = module(x) if gate is None else module(x, gate)
    y.backward(dy)
    params = [p.grad for p in module.parameters()]
    return [y.detach(), x.grad] + ([gate.grad] if gate is not None else []) + params


@pytest.mark.parametrize("family,name,kwargs,gated", _params(SWAPPED))
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
def test_the_norm_runs_the_kernel_with_the_stock_outputs_and_gradients(family, name, kwargs, gated, dtype):
    cls = _cls(family, name)
    stock, container, report = _swapped(_make(cls, kwargs), dtype)
    assert report.swapped.get("rms_norm") == 1, report.refused
    x, gate = _inputs(dtype, gated)
    dy = torch.randn(x.shape).to(dtype)
    with _launch.recording() as launched:
        got = _run(container[0], x, gate, dy)
    assert launched.count("_rms_norm_fwd_kernel") == 1 and launched.count("_rms_norm_bwd_kernel") == 1, launched
    want = _run(stock, x, gate, dy)
    bound = 1e-5 if dtype == torch.float32 else 2e-2  # the kernel sums in fp32, autograd in the module's dtype
    assert len(got) == len(want)
    for what, g, w in zip(["output", "grad of x", "grad of gate" if gated else "grad of weight", "grad of weight"],
                          got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        assert probe.rel_err(g, w) <= bound, (what, probe.rel_err(g, w))
    assert restore_kernels(container) is not None and "forward" not in container[0].__dict__


@pytest.mark.parametrize("family,name,kwargs,words", _params(REFUSED))
def test_a_form_without_a_kernel_is_refused_with_the_form_named(family, name, kwargs, words):
    cls = _cls(family, name)
    _, container, report = _swapped(_make(cls, kwargs), torch.float32)
    assert not report.swapped.get("rms_norm"), report
    reasons = [r.reason for r in report.refused if r.op == "rms_norm"]
    assert len(reasons) == 1 and words in reasons[0], reasons
    assert "forward" not in container[0].__dict__  # stock


def test_gemma4_weighted_and_weightless_norms_of_one_class_get_their_own_verdicts():
    cls = _cls("gemma4", "Gemma4RMSNorm")
    probe.cache.clear()
    model = torch.nn.Sequential(cls(W, eps=1e-6, with_scale=False), cls(W, eps=1e-6))
    report = swap_kernels(model, ops=["rms_norm"])
    assert report.swapped.get("rms_norm") == 2, report.refused
    x = torch.randn(3, W)
    for module in model:
        with _launch.recording() as launched:
            y = module(x)
        assert launched == ["_rms_norm_fwd_kernel"]
        stock = type(module).forward(module, x)
        assert probe.rel_err(y, stock) <= 1e-6


def test_a_gated_norm_called_without_its_gate_runs_stock():
    cls = _cls("falcon_h1", "FalconH1RMSNormGated")
    _, container, report = _swapped(cls(W, eps=1e-6), torch.float32)
    assert report.swapped.get("rms_norm") == 1
    x = torch.randn(2, 3, W)
    with _launch.recording() as launched:
        y = container[0](x)
    assert launched == [] and torch.equal(y, type(container[0]).forward(container[0], x))


HYBRIDS = {  # config class: (the names its gated norm's class has had, tiny configuration)
    "Qwen3NextConfig": (("Qwen3NextRMSNormGated",), dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])),
    # n_groups=2: the mixer's norm per group of 16; transformers 5.17 builds it from Zamba2's class
    "NemotronHConfig": (("NemotronHRMSNormGated", "Zamba2RMSNormGated"), dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
        hybrid_override_pattern="M*")),
}


@pytest.mark.slow  # a tiny hybrid model's forward and backward under Triton's interpreter
@pytest.mark.parametrize("config_name", sorted(HYBRIDS))
def test_a_hybrid_model_runs_its_gated_norm_on_the_kernel(config_name):
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers has no {config_name}")
    norm_class, kwargs = HYBRIDS[config_name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**kwargs))
    restore_kernels(model)
    stock = copy.deepcopy(model)
    probe.cache.clear()
    report = swap_kernels(model, ops=["rms_norm"])
    gated = [m for m in model.modules() if type(m).__name__ in norm_class]
    assert len(gated) == 1 and "forward" in gated[0].__dict__, report.refused
    assert not [r for r in report.refused if r.op == "rms_norm"], report.refused
    ids = torch.randint(0, 64, (1, 6))
    in_gated = []  # the launches made inside the gated norm's own calls
    with _launch.recording() as launched:
        gated[0].register_forward_pre_hook(lambda m, a: in_gated.append(len(launched)))
        gated[0].register_forward_hook(lambda m, a, y: in_gated.append(len(launched) - in_gated.pop()))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    want = stock(input_ids=ids, labels=ids).loss
    want.backward()
    assert in_gated == [1] and "_rms_norm_bwd_kernel" in launched, (in_gated, launched)
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    name = next(n for n, p in model.named_parameters() if p is gated[0].weight)
    assert probe.rel_err(gated[0].weight.grad, dict(stock.named_parameters())[name].grad) <= 1e-5


@pytest.mark.slow  # dynamo and AOTAutograd over the gated and weightless ops
@pytest.mark.parametrize("family,name,kwargs", [
    ("qwen3_next", "Qwen3NextRMSNormGated", dict(hidden_size=W)),
    ("llama4", "Llama4TextL2Norm", dict())])
def test_a_swapped_norm_compiles_fullgraph_into_one_op_node(family, name, kwargs):
    cls = _cls(family, name)
    stock, container, report = _swapped(_make(cls, kwargs), torch.float32)
    assert report.swapped.get("rms_norm") == 1
    gated = "gate" in name.lower() or "Gated" in name
    x, gate = _inputs(torch.float32, gated)
    args = (x,) if gate is None else (x, gate)
    torch._dynamo.reset()
    compiled = torch.compile(container[0], backend="aot_eager", fullgraph=True)
    with _launch.recording() as launched:
        y = compiled(*args)
        y.sum().backward()
    assert "_rms_norm_fwd_kernel" in launched and "_rms_norm_bwd_kernel" in launched, launched
    assert probe.rel_err(y, stock(*args)) <= 1e-5
