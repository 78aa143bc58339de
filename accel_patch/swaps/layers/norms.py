"""RMSNorm sites: a childless module with an epsilon attribute in one of three forms.

- Weighted: one 1-D `weight`, one input (Llama, Gemma, T5, torch.nn.RMSNorm, q/k and sandwich norms).
- Weightless: no parameter, one input, "norm" in its class name (Gemma 4's `with_scale=False`
  value norm, Llama 4's q/k `L2Norm`, DeepSeek V4's and GLM-5-next's `UnweightedRMSNorm`).
- Gated: one 1-D `weight` and two inputs `(hidden_states, gate)`, computing
  `norm(x) * weight * act(gate)` (Qwen3.5 / Qwen3-Next / Olmo hybrid `RMSNormGated` with silu,
  Kimi Linear / GLM-5-next with sigmoid, Falcon-H1 with `norm_before_gate`), or gating before
  normalizing, `norm(x * silu(gate)) * weight` (Mamba2, Nemotron-H, Granite 4 hybrid, Bamba,
  Zamba2 `RMSNormGated`, Falcon-H1 with `norm_before_gate=False`); normalized over the whole width
  or per group (`group_size` below the width, `n_groups` above 1: Mamba2Config's and
  NemotronHConfig's defaults, n_groups=8): per group, the weightless kernel runs on each group and
  the weight multiplies after it (`grouped_rms_norm`), as those modules compute.

The probe runs the module's own forward (with a random weight substituted, so `w` and `1 + w`
differ; a random gate at magnitudes where silu and sigmoid differ) against `accel_kernels.rms_norm`
in each casting variant of families.NORM_VARIANTS (NORM_WEIGHTLESS_VARIANTS without a weight;
times each of NORM_GATE_ACTIVATIONS with a gate), in the activation dtype, float32 and bfloat16;
the variant that matches in all of them is swapped in. Refused, with the form named:
- groups that do not divide the width;
- LayerNorm (mean-centred, with a bias); a weightless norm whose output is no RMSNorm's (an L2
  norm over the sum, not the mean: Dory's).

Where the kernel cannot run (CPU tensors without Triton's interpreter:
`accel_kernels._dispatch.use_triton` false), the swapped forward calls the module's own forward:
the plain-torch twin computes the same function, only slower than the stock module there
(benchmarks/overhead.py). A gated site called without a gate runs the module's own forward too.
"""
from __future__ import annotations

import inspect
from collections import namedtuple

import torch

from .. import families, probe, sites

OP = "rms_norm"

#: A candidate's form: its epsilon attribute, whether it has a weight, for the gated form the
#: names of its two inputs (None for one input), and the groups a gated norm normalizes over
#: (contiguous, equal, across the width; 1: the whole width).
NormForm = namedtuple("NormForm", "eps_attr weighted inputs groups", defaults=(True, None, 1))


class NormVariant(namedtuple("NormVariant", "casting offset eps_attr weighted inputs activation groups",
                             defaults=(True, None, "", 1))):
    __slots__ = ()


# torch's own mean-centred norms (a weightless one has no parameter to tell it by)
_TORCH_CENTRED = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase)


def _eps_attr(module) -> str | None:
    for name in families.NORM_EPS_ATTRIBUTES:
        value = getattr(module, name, "missing")
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return name
    return None


def _named_layer_norm(module) -> bool:
    name = type(module).__name__.lower()
    return any(m in name for m in families.LAYER_NORM_MARKERS) and "rms" not in name


def gated_inputs(cls: type) -> tuple[str, str] | None:
    """(input, gate) names when `cls.forward` takes exactly two inputs, the second possibly
    defaulting to None (`forward(hidden_states, gate=None)`); else None."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    params = [p for p in params if p.kind is not p.VAR_KEYWORD]
    if len(params) != 2 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return None
    x, gate = params
    if x.default is not x.empty or gate.default not in (gate.empty, None):
        return None
    return x.name, gate.name


def _groups(module, n: int) -> int | None:
    """How many contiguous equal groups of the width `n` a gated norm normalizes over, by its
    `group_size` or `n_groups` (1: the whole width); None when they do not divide the width."""
    group_size, n_groups = getattr(module, "group_size", None), getattr(module, "n_groups", None)
    if isinstance(group_size, int) and not isinstance(group_size, bool) and group_size != n:
        return n // group_size if 0 < group_size < n and n % group_size == 0 else None
    if isinstance(n_groups, int) and not isinstance(n_groups, bool) and n_groups != 1:
        return n_groups if 0 < n_groups < n and n % n_groups == 0 else None
    return 1


def _group_refusal(module, n: int) -> str | None:
    if _groups(module, n) is not None:
        return None
    group_size, n_groups = getattr(module, "group_size", None), getattr(module, "n_groups", None)
    return (f"gated RMSNorm normalized per group (group_size={group_size!r}, n_groups={n_groups!r}) that do "
            f"not divide its width {n}: no kernel")


def grouped_rms_norm(x, weight, gate, groups: int, eps: float, casting: str, activation: str):
    """A gated norm normalized per group: the weightless kernel on each group of the width (x and
    gate viewed as (..., groups, n / groups)), then times the weight, as Mamba2's and Nemotron-H's
    `weight * normed.to(input_dtype)` does (the probe proves it for each module)."""
    from accel_kernels import rms_norm

    shape = (groups, x.shape[-1] // groups)
    y = rms_norm(x.unflatten(-1, shape), None, eps=eps, casting=casting, gate=gate.unflatten(-1, shape),
                 activation=activation).flatten(-2)
    return weight * y


def candidate(module) -> NormForm | None:
    """The norm's form when `module` has one of an RMSNorm's structures (module docstring), else
    None. Its name does not matter for a weighted norm: T5's "LayerNorm" is an RMSNorm, Cohere's
    is not, and the probe tells them apart."""
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, _TORCH_CENTRED) or next(module.children(), None) is not None:
        return None
    eps_attr = _eps_attr(module)
    if eps_attr is None:
        return None
    if not params:  # weightless: only a norm by name, proved by the probe
        if "norm" in type(module).__name__.lower() and sites.single_input(type(module)) is not None:
            return NormForm(eps_attr, weighted=False)
        return None
    weight = params.get("weight")
    if set(params) != {"weight"} or weight.dim() != 1:
        return None
    if sites.single_input(type(module)) is not None:
        return NormForm(eps_attr)
    inputs = gated_inputs(type(module))
    groups = _groups(module, weight.shape[0]) if inputs is not None else None
    if groups is None:
        return None
    return NormForm(eps_attr, inputs=inputs, groups=groups)


def refusal(module) -> str | None:
    """Why a module that looks like a norm (by its class name) is not a candidate; None otherwise."""
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, torch.nn.LayerNorm) or (_named_layer_norm(module) and "bias" in params):
        return "LayerNorm (mean-centred, with a bias): no kernel"
    if "norm" not in type(module).__name__.lower() or not params:
        return None
    weight = params.get("weight")
    if set(params) == {"weight"} and weight.dim() == 1 and gated_inputs(type(module)) is not None:
        reason = _group_refusal(module, weight.shape[0])
        if reason:
            return reason
    return (f"not an RMSNorm shape (one 1-D weight or none, an epsilon attribute "
            f"{'/'.join(families.NORM_EPS_ATTRIBUTES)}, one input, or two: (x, gate))")


def structure(module, form: NormForm) -> tuple:
    """The probe's cache key beyond the class: the form and the attributes that change a norm's
    function within one class (Gemma 4's with_scale, a gated norm's activation)."""
    return (form, *(repr(getattr(module, a, None)) for a in families.NORM_FORM_ATTRIBUTES))


def device(module, model) -> torch.device | None:
    """Where the probe runs: the module's own device, else (a weightless norm) the model's, else
    the CPU (a model of weightless modules only: the function does not depend on the device)."""
    return probe.module_device(module) or probe.module_device(model) or torch.device("cpu")


def probe_verdict(module, act_dtype: torch.dtype, form: NormForm, device: torch.device | None = None):
    """The variant the kernel must run to reproduce this module, or a refusal reason."""
    from accel_kernels import rms_norm

    device = device or probe.module_device(module)
    eps_attr, weighted, inputs, groups = form
    weight = module.weight if weighted else None
    n = weight.shape[0] if weighted else 64
    eps = getattr(module, eps_attr)
    dtypes = list(dict.fromkeys([act_dtype, torch.float32, torch.bfloat16]))
    # per group: the weightless kernel's castings, the weight applied after it (grouped_rms_norm)
    base = families.NORM_VARIANTS if weighted and groups == 1 else families.NORM_WEIGHTLESS_VARIANTS
    acts = families.NORM_GATE_ACTIVATIONS if inputs else ("",)
    errors = {(c, o, a): 0.0 for c, o in base for a in acts}
    kind = ("gated " if inputs else "") + ("RMSNorm" if weighted else "weightless RMSNorm") + (
        f" normalized per group ({groups} groups)" if groups > 1 else "")
    with probe.probing(module):
        for dtype in dtypes:
            # The activation dtype probe uses the module's own weight dtype; the others cast both,
            # as a model converted with .to(dtype) would.
            w_dtype = weight.dtype if dtype == act_dtype and weighted else dtype
            x = probe.randn((2, 3, n), dtype, device, scale=2.0)
            gate = probe.randn((2, 3, n), dtype, device, scale=3.0) if inputs else None
            w = (1.0 + 0.5 * torch.randn(n, device=device)).to(w_dtype) if weighted else None
            kernel_eps = torch.finfo(dtype).eps if eps is None else float(eps)
            try:
                ref = torch.func.functional_call(module, {"weight": w} if weighted else {},
                                                 (x,) if gate is None else (x, gate))
            except Exception as exc:  # the module cannot run here: no verdict to trust
                return f"module's own forward failed on a {dtype} probe: {type(exc).__name__}: {exc}"
            limit = probe.bound(dtype)
            for variant in list(errors):
                casting, offset, act = variant
                if groups > 1:
                    out = grouped_rms_norm(x, w, gate, groups, kernel_eps, casting, act)
                else:
                    out = rms_norm(x, w, eps=kernel_eps, offset=offset, casting=casting, gate=gate, activation=act)
                err = probe.rel_err(out, ref) if out.dtype == ref.dtype else float("inf")
                if err > limit:
                    del errors[variant]
                else:
                    errors[variant] = max(errors[variant], err)
            if not errors:
                if _named_layer_norm(module):
                    return f"LayerNorm (mean-centred): no kernel; its output differs from every RMSNorm variant in {dtype}"
                return f"output differs from every {kind} variant in {dtype} (not an RMSNorm?)"
    casting, offset, act = min(errors, key=errors.get)
    return NormVariant(casting, offset, eps_attr, weighted, inputs, act, groups)


_forwards: dict[NormVariant, object] = {}


@sites.made_by  # a pickled model makes its forward again
def forward_for(variant: NormVariant):
    """The swapped forward for one variant: rms_norm of the input with the module's own weight (if
    any) and eps, times act(gate) in the gated form."""
    if variant not in _forwards:
        from accel_kernels import _dispatch, rms_norm

        casting, offset, eps_attr, weighted, inputs, activation, groups = variant

        def forward(self, *args, **kwargs):
            if inputs is None:
                x, gate = sites.the_input(args, kwargs), None
            else:
                x = args[0] if args else kwargs.get(inputs[0])
                gate = args[1] if len(args) > 1 else kwargs.get(inputs[1])
            # CPU without Triton: the stock module is faster than the twin; a gated norm called
            # without its gate computes another function, not probed
            if not isinstance(x, torch.Tensor) or not _dispatch.use_triton(x) or (inputs and gate is None):
                return sites.call_inner(self, *args, **kwargs)
            eps = getattr(self, eps_attr)
            eps = torch.finfo(x.dtype).eps if eps is None else float(eps)  # torch.nn.RMSNorm(eps=None)
            if groups > 1:
                return grouped_rms_norm(x, self.weight, gate, groups, eps, casting, activation)
            return rms_norm(x, self.weight if weighted else None, eps=eps, offset=offset, casting=casting,
                            gate=gate, activation=activation)

        _forwards[variant] = forward
    return _forwards[variant]
