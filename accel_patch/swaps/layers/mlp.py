"""Gated-MLP sites: `down(act(gate(x)) * up(x))`, split or with one fused `gate_up` projection.

A module is a candidate by its children (families.GLU_SPLIT_NAMES / GLU_FUSED_NAMES: Llama's
gate/up/down, Phi3's gate_up_proj, Granite's shared MLP's `input_linear` / `output_linear`) and its
activation attribute. A non-gated MLP, `down(act(up(x)))` (families.MLP_PLAIN_NAMES), runs the
ReLU² kernel where its activation says it is ReLU² (Nemotron-H: families.PLAIN_ACTIVATION_NAMES,
`site_candidate`); any other (Apertus's xIELU) is refused with its form named (the tiled MLP tiles
it, layers/tiled_mlp.py). The activation must say what it is (families.ACTIVATION_NAMES) and the
probe checks that it computes that, in float32; then the whole module runs against the swapped
forward in the activation dtype (for a fused projection, both halves' orders are tried). The
projections are still called as modules, so LoRA and 4-bit layers keep working inside.
MoE experts stored as 3-D parameters are not gated MLPs here: the experts site takes them
(swaps/experts/).

Where the kernel cannot run (CPU tensors without Triton's interpreter), the swapped forward calls
the module's own forward: the twin is slower than the stock MLP there (benchmarks/overhead.py).
"""
from __future__ import annotations

import inspect
import math
from collections import namedtuple

import torch

from .. import families, probe, sites
from . import norms

OP = "glu"
#: On a swapped MLP: what its forward counts the input norm's recomputes with (a
#: norms.RecomputeCounter of the model's call table).
COUNTER_ATTR = "_accel_patch_glu_norm_counter"


class GluPlan(namedtuple("GluPlan", "names act order limit", defaults=(None,))):
    """names: (gate, up, down) or (gate_up, down), or (up, down) for act "relu2" (non-gated:
    `down(relu(up(x))²)`); act: "silu" | "gelu" | "gelu_tanh" | "relu2"; order: for a fused
    projection, "gate_up" (gate first) or "up_gate"; "plain" for the non-gated form; limit: the
    clamp the SwiGLU kernel applies first (gate at most, up within plus or minus it: DeepSeek V4's
    and GLM-5-next's `swiglu_limit`), None for none."""

    __slots__ = ()


def activation(module):
    """The module's activation: its first callable attribute of families.ACTIVATION_ATTRIBUTES,
    else the one `torch.nn.functional` activation its forward calls by name (LFM2's
    `F.silu(self.w1(x))`), else None. The probe then checks the whole module either way."""
    for name in families.ACTIVATION_ATTRIBUTES:
        act = getattr(module, name, None)
        if act is not None and callable(act):
            return act
    try:
        code = inspect.unwrap(type(module).forward).__code__
    except (AttributeError, ValueError):
        return None
    called = [n for n in families.INLINE_ACTIVATIONS if n in code.co_names]
    return getattr(torch.nn.functional, called[0]) if len(called) == 1 else None


def declared_activation(act) -> tuple[str, str | None]:
    """(the activation's own name, the kernel activation it says it is, or None)."""
    if isinstance(act, torch.nn.GELU):
        return f"nn.GELU(approximate={act.approximate!r})", "gelu_tanh" if act.approximate == "tanh" else "gelu"
    name = type(act).__name__ if isinstance(act, torch.nn.Module) else getattr(act, "__name__", type(act).__name__)
    return name, families.ACTIVATION_NAMES.get(name.lower())


def _linear_like(proj) -> bool:
    """A projection the site can call on rows: a 2-D weight (plain, LoRA-wrapped, 4-bit) or none it
    can see; not experts held as a module with a 3-D weight (JetMoE's `input_linear`)."""
    weight = getattr(proj, "weight", None)
    return not isinstance(weight, torch.Tensor) or weight.dim() == 2


def _find(module, tables) -> tuple[str, ...] | None:
    children = dict(module.named_children())
    for names in tables:
        if all(isinstance(children.get(n), torch.nn.Module) and _linear_like(children[n]) for n in names):
            return names
    return None


def _names(module) -> tuple[str, ...] | None:
    return _find(module, families.GLU_SPLIT_NAMES + families.GLU_FUSED_NAMES)


def plain_names(module) -> tuple[str, ...] | None:
    """(up, down) of a non-gated MLP `down(act(up(x)))` (families.MLP_PLAIN_NAMES: Nemotron-H's
    ReLU², Apertus's xIELU), or None: a gated MLP, MoE experts or anything else."""
    if _expert_parameters(module) or _names(module) is not None:
        return None
    return _find(module, families.MLP_PLAIN_NAMES)


def plain_refusal(module, names: tuple[str, ...]) -> str:
    """Why a non-gated MLP gets no gated-MLP kernel, naming its form and activation."""
    act = activation(module)
    own_name = declared_activation(act)[0] if act is not None else "act"
    up, down = names
    return (f"non-gated MLP {down}({own_name}({up}(x))): no fused kernel for this form (the GLU kernels and the "
            f"fused LoRA MLP compute act(gate) * up; glu's one non-gated kernel is ReLU²); the tiled MLP tiles it")


def site_candidate(module):
    """The glu site's candidate: `candidate`'s answer, except that a non-gated MLP whose activation
    says it is one of families.PLAIN_ACTIVATION_NAMES is a candidate ((up, down), "relu2"); the
    fused LoRA MLP keeps `candidate` (it computes a GLU only)."""
    found = candidate(module)
    plain = plain_names(module) if isinstance(found, str) else None
    act = activation(module) if plain is not None else None
    if act is None:
        return found
    kernel_act = families.PLAIN_ACTIVATION_NAMES.get(declared_activation(act)[0].lower())
    if kernel_act is None:
        return found
    if sites.single_input(type(module)) is None:
        return "forward takes more than one input"
    return plain, kernel_act


def _expert_parameters(module) -> bool:
    own = dict(module.named_parameters(recurse=False))
    known = {n for names in families.GLU_SPLIT_NAMES + families.GLU_FUSED_NAMES for n in names}
    return any(p.dim() == 3 for n, p in own.items() if n in known)


def candidate(module) -> tuple[tuple[str, ...], str] | str | None:
    """((projection names), kernel activation) for a candidate; a refusal reason for a module
    that has the shape but cannot be swapped; None for anything else."""
    if _expert_parameters(module):
        return None  # MoE experts: the experts site's (swaps/experts/)
    names = _names(module)
    if names is None:
        plain = plain_names(module)
        return plain_refusal(module, plain) if plain is not None else None
    act = activation(module)
    if act is None:
        return ("gated projections but no activation attribute (" + "/".join(families.ACTIVATION_ATTRIBUTES) +
                ") and no single torch.nn.functional activation called in its forward")
    if sites.single_input(type(module)) is None:
        return "forward takes more than one input"
    own_name, kernel_act = declared_activation(act)
    if kernel_act is None:
        return f"activation {own_name} has no kernel (swiglu: SiLU; geglu: GELU, tanh-GELU)"
    return names, kernel_act


_REFERENCE = {
    "silu": lambda t: t * torch.sigmoid(t),
    "gelu": lambda t: 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0))),
    "gelu_tanh": lambda t: 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3))),
    "relu2": lambda t: torch.relu(t) ** 2,
}


def glu(act: str, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    from accel_kernels import geglu, swiglu

    if act == "silu":
        return swiglu(gate, up, limit=limit)
    return geglu(gate, up, approximate="tanh" if act == "gelu_tanh" else "none")


def _in_features(module, name: str) -> int | None:
    proj = getattr(module, name)
    for attr in ("in_features", "input_size"):
        if isinstance(getattr(proj, attr, None), int):
            return getattr(proj, attr)
    weight = getattr(proj, "weight", None)
    return weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def probe_verdict(module, act_dtype: torch.dtype, names: tuple[str, ...], act: str):
    """The GluPlan that reproduces this module, or a refusal reason."""
    device = probe.module_device(module)
    act_fn = activation(module)
    own_name, _ = declared_activation(act_fn)
    hidden = _in_features(module, names[0])
    if hidden is None:
        return f"cannot tell the input width of {names[0]}"
    with probe.probing(module):
        t = torch.linspace(-8.0, 8.0, 4001, device=device)
        try:
            err = probe.rel_err(act_fn(t), _REFERENCE[act](t.double()))
        except Exception as exc:
            return f"activation {own_name} failed on a float32 probe: {type(exc).__name__}: {exc}"
        if err > probe.FP32_BOUND:
            return f"activation {own_name} does not compute {act} (relative error {err:.2e} in float32)"
        x = probe.randn((2, 3, hidden), act_dtype, device).requires_grad_()
        try:
            probe.seeded()
            ref = module(x)
        except Exception as exc:
            return f"module's own forward failed on a {act_dtype} probe: {type(exc).__name__}: {exc}"
        orders = ("plain",) if act == "relu2" else ("gate_up", "up_gate") if len(names) == 2 else ("gate_up",)
        named = sorted(set(probe.limits(module)))
        # a module whose weights already reach its clamp on these inputs: its clamped plan too
        clamps = (None, named[0]) if act == "silu" and len(named) == 1 else (None,)
        errors = {}
        for order in orders:
            for clamp in clamps:
                probe.seeded()
                out = forward_for(GluPlan(names, act, order, clamp), stock_without_triton=False)(module, x)
                if not isinstance(ref, torch.Tensor) or out.dtype != ref.dtype:
                    return (f"module returns {getattr(ref, 'dtype', type(ref).__name__)}, the swapped forward "
                            f"{out.dtype} in {act_dtype}")
                errors[order, clamp] = probe.rel_err(out, ref)  # inf when the shapes differ
    order, clamp = min(errors, key=errors.get)  # the unclamped plan first where both are equal
    limit = probe.bound(act_dtype)
    if errors[order, clamp] > limit:
        return (f"output differs from {_form(act)} in {act_dtype}: relative error "
                f"{errors[order, clamp]:.2e} > {limit:.1e}")
    plan = GluPlan(names, act, order, clamp)
    # The same function where it can differ: pre-activations driven past every clamp the module or
    # its configuration names (DeepSeek V4 and GLM-5-next clamp gate and up at swiglu_limit).
    magnitude = probe.reach(module)
    with probe.probing(module):
        with torch.no_grad():
            pre = getattr(module, names[0])(x)
        far = probe.past_limits(x, pre, magnitude)
        probe.seeded()
        ref = module(far)
        probe.seeded()
        out = forward_for(plan, stock_without_triton=False)(module, far)
        refusal = probe.past_limits_refusal(module, out, ref, _form(act), magnitude, act_dtype)
        if refusal and act == "silu" and len(named) == 1:
            # the module clamps at the limit it names: the kernel clamps too, proved past it
            clamped = plan._replace(limit=named[0])
            probe.seeded()
            out = forward_for(clamped, stock_without_triton=False)(module, far)
            if not probe.past_limits_refusal(module, out, ref, _form(act), magnitude, act_dtype):
                return clamped
    return refusal or plan


def _form(act: str) -> str:
    return "down(relu(up)²)" if act == "relu2" else f"down({act}(gate) * up)"


_forwards: dict[tuple, object] = {}


@sites.made_by  # a pickled model makes its forward again
def forward_for(plan: GluPlan, stock_without_triton: bool = True):
    """The swapped forward for one plan: the module's own projections around the GLU kernel.
    `stock_without_triton`: where the kernel cannot run, call the module's own forward instead
    (the probe asks for the kernel's computation itself: False)."""
    key = (plan, stock_without_triton)
    if key not in _forwards:
        from accel_kernels import _dispatch

        names, act, order, _ = plan
        if act == "relu2":
            from accel_kernels import relu_squared

            up_name, down_name = names

            def forward(self, *args, **kwargs):
                x = sites.the_input(args, kwargs)
                if stock_without_triton and not _dispatch.use_triton(x):  # CPU without Triton: stock is faster than the twin
                    norms.stood_aside(self, OP, COUNTER_ATTR)
                    return sites.call_inner(self, *args, **kwargs)
                with norms.recompute_scope(x, self.__dict__.get(COUNTER_ATTR)):  # up keeps the norm's call
                    up = getattr(self, up_name)(x)
                return getattr(self, down_name)(relu_squared(up))
        elif len(names) == 3:
            gate_name, up_name, down_name = names

            def forward(self, *args, **kwargs):
                x = sites.the_input(args, kwargs)
                if stock_without_triton and not _dispatch.use_triton(x):  # CPU without Triton: stock is faster than the twin
                    norms.stood_aside(self, OP, COUNTER_ATTR)
                    return sites.call_inner(self, *args, **kwargs)
                # both keep the norm's call instead of x (norms.recompute_scope)
                with norms.recompute_scope(x, self.__dict__.get(COUNTER_ATTR)):
                    gate = getattr(self, gate_name)(x)  # gate before up, as stock: same RNG order for dropout
                    up = getattr(self, up_name)(x)
                return getattr(self, down_name)(glu(act, gate, up, plan.limit))
        else:
            fused_name, down_name = names
            gate_first = order == "gate_up"

            def forward(self, *args, **kwargs):
                x = sites.the_input(args, kwargs)
                if stock_without_triton and not _dispatch.use_triton(x):  # CPU without Triton: stock is faster than the twin
                    norms.stood_aside(self, OP, COUNTER_ATTR)
                    return sites.call_inner(self, *args, **kwargs)
                with norms.recompute_scope(x, self.__dict__.get(COUNTER_ATTR)):  # keeps the norm's call
                    projected = getattr(self, fused_name)(x)
                first, second = projected.chunk(2, dim=-1)
                gate, up = (first, second) if gate_first else (second, first)
                return getattr(self, down_name)(glu(act, gate, up, plan.limit))

        _forwards[key] = forward
    return _forwards[key]
