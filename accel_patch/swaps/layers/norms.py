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
- a weightless norm whose output is no RMSNorm's (an L2 norm over the sum, not the mean: Dory's).

LayerNorm sites (op "layer_norm", counted in its own report row): torch.nn.LayerNorm over the last
dim, with or without its weight and bias (the DSA indexers' `k_norm` of DeepSeek V3.2, GLM-MoE-DSA,
GLM-5-next and Mistral Large 4; GPT-NeoX's and Phi's norms), and childless classes named LayerNorm
with a 1-D weight and a 1-D bias and an epsilon attribute. A class named LayerNorm with a weight
alone is probed as an RMSNorm first (T5's "LayerNorm" is one); a mean-centred one (Cohere's) is
refused by that probe. The LayerNorm probe runs the module's own forward against
`accel_kernels.layer_norm` with a random weight and bias substituted, on rows far from zero mean (a
norm that is not mean-centred, or drops its bias, differs there), in the activation dtype, float32
and bfloat16, and in float32 on rows whose variance is of the order of the module's eps (an eps
other than the one its attribute names differs there). Refused: a LayerNorm over more than the last
dim (`normalized_shape` of several dims). A LayerNorm class other than torch's, under autocast on
CUDA or XPU (where torch's own layer_norm runs in float32 and such a class's explicit casts may not),
runs its own forward: the probe saw it without autocast.

Where the kernel cannot run (CPU tensors without Triton's interpreter:
`accel_kernels._dispatch.use_triton` false), the swapped forward calls the module's own forward:
the plain-torch twin computes the same function, only slower than the stock module there
(benchmarks/overhead.py). A gated site called without a gate runs the module's own forward too.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections import namedtuple

import torch

from .. import families, probe, sites

OP = "rms_norm"
LAYER_NORM_OP = "layer_norm"
#: A norm output recomputed in backward for the projections that saved it (`recompute_scope`),
#: counted under OP in the model's call table.
RECOMPUTED = "fused (output recomputed in backward)"

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
    """Why a module that looks like a norm (by its class name) is not a candidate; None otherwise
    (a LayerNorm included: the layer_norm op's site, not rms_norm's)."""
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, torch.nn.LayerNorm) or (_named_layer_norm(module) and "bias" in params):
        return None
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
            # a gated norm called without its gate computes another function, not probed
            if not isinstance(x, torch.Tensor) or (inputs and gate is None):
                return sites.call_inner(self, *args, **kwargs)
            if not _dispatch.use_triton(x):  # CPU without Triton: the stock module is faster than the twin
                stood_aside(self, OP)
                return sites.call_inner(self, *args, **kwargs)
            eps = getattr(self, eps_attr)
            eps = torch.finfo(x.dtype).eps if eps is None else float(eps)  # torch.nn.RMSNorm(eps=None)
            if groups > 1:
                return grouped_rms_norm(x, self.weight, gate, groups, eps, casting, activation)
            return rms_norm(x, self.weight if weighted else None, eps=eps, offset=offset, casting=casting,
                            gate=gate, activation=activation)

        _forwards[variant] = forward
    return _forwards[variant]


# --------------------------------------------------------------------------------------------
# LayerNorm sites (op "layer_norm")
# --------------------------------------------------------------------------------------------

#: A LayerNorm's form: its epsilon attribute, whether it has a weight and a bias, and whether its
#: forward is torch.nn.LayerNorm's own (F.layer_norm, whose autocast policy the kernel's entry follows).
LayerNormForm = namedtuple("LayerNormForm", "eps_attr weighted biased torch_forward")


def layer_norm_candidate(module) -> LayerNormForm | str | None:
    """The LayerNorm's form when `module` is a torch.nn.LayerNorm (or subclass) or a childless
    class named LayerNorm with a 1-D weight and bias, an epsilon attribute and one input; a refusal
    reason for a LayerNorm over several dims; else None."""
    if next(module.children(), None) is not None:
        return None
    params = dict(module.named_parameters(recurse=False))
    if isinstance(module, torch.nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            return (f"LayerNorm over its last {len(module.normalized_shape)} dims (normalized_shape="
                    f"{tuple(module.normalized_shape)}): the kernel normalizes over the last dim only")
        if sites.single_input(type(module)) is None:
            return None
        return LayerNormForm("eps", module.weight is not None, module.bias is not None,
                             type(module).forward is torch.nn.LayerNorm.forward)
    if isinstance(module, _TORCH_CENTRED) or not _named_layer_norm(module) or set(params) != {"weight", "bias"}:
        return None
    if any(p.dim() != 1 for p in params.values()) or params["weight"].shape != params["bias"].shape:
        return None
    eps_attr = _eps_attr(module)
    if eps_attr is None or getattr(module, eps_attr) is None or sites.single_input(type(module)) is None:
        return None
    return LayerNormForm(eps_attr, True, True, False)


def _layer_norm_width(module, form: LayerNormForm) -> int:
    if form.weighted:
        return module.weight.shape[0]
    if form.biased:
        return module.bias.shape[0]
    return int(module.normalized_shape[0])


def layer_norm_verdict(module, act_dtype: torch.dtype, form: LayerNormForm, device: torch.device | None = None):
    """`form` when accel_kernels.layer_norm reproduces this module's output (module docstring), else
    a refusal reason."""
    from accel_kernels import layer_norm

    device = device or probe.module_device(module) or torch.device("cpu")
    n = _layer_norm_width(module, form)
    eps = float(getattr(module, form.eps_attr))
    own = {name: getattr(module, name) for name, has in (("weight", form.weighted), ("bias", form.biased)) if has}
    # (dtype, scale, shift): the activation dtype, float32 and bfloat16 on rows far from zero mean;
    # float32 on rows whose variance is of the order of eps, where another eps shows
    cases = [(dtype, 2.0, 3.0) for dtype in dict.fromkeys([act_dtype, torch.float32, torch.bfloat16])]
    cases.append((torch.float32, max(eps, 1e-12) ** 0.5, 0.0))
    with probe.probing(module):
        for dtype, scale, shift in cases:
            # the activation dtype's probe keeps the module's own parameter dtypes; the others cast
            # both, as a model converted with .to(dtype) would
            p_dtype = {name: (p.dtype if dtype == act_dtype else dtype) for name, p in own.items()}
            x = probe.randn((2, 3, n), dtype, device, scale=scale)
            x = (x.float() + shift * (1 + torch.arange(3, device=device, dtype=torch.float32)).view(1, 3, 1)).to(dtype)
            values = {}
            if "weight" in own:
                values["weight"] = (1.0 + 0.5 * torch.randn(n, device=device)).to(p_dtype["weight"])
            if "bias" in own:
                values["bias"] = torch.randn(n, device=device).to(p_dtype["bias"])
            try:
                ref = torch.func.functional_call(module, values, (x,))
            except Exception as exc:  # the module cannot run here: no verdict to trust
                return f"module's own forward failed on a {dtype} probe: {type(exc).__name__}: {exc}"
            try:
                out = layer_norm(x, values.get("weight"), values.get("bias"), eps=eps)
            except ValueError as exc:
                return f"LayerNorm with parameters the kernel does not take: {exc}"
            if not isinstance(ref, torch.Tensor) or out.dtype != ref.dtype:
                return (f"output dtype {getattr(ref, 'dtype', type(ref).__name__)} on a {dtype} probe, where "
                        f"torch's layer_norm gives {out.dtype}")
            err = probe.rel_err(out, ref)
            if err > probe.bound(dtype):
                where = "rows of variance near its eps" if shift == 0.0 else "rows far from zero mean"
                return (f"output differs from LayerNorm (eps={eps:g}{', weight' * form.weighted}"
                        f"{', bias' * form.biased}) in {dtype} on {where}: relative error {err:.1e}")
    return form


_layer_norm_forwards: dict[LayerNormForm, object] = {}


@sites.made_by  # a pickled model makes its forward again
def layer_norm_forward_for(form: LayerNormForm):
    """The swapped forward for one form: layer_norm of the input with the module's own weight and
    bias (those it has) and eps."""
    if form not in _layer_norm_forwards:
        from accel_kernels import _dispatch, layer_norm
        from accel_kernels.ops.layer_norm import AUTOCAST_TO_FLOAT32

        eps_attr, weighted, biased, torch_forward = form

        def forward(self, *args, **kwargs):
            x = sites.the_input(args, kwargs)
            if not isinstance(x, torch.Tensor):
                return sites.call_inner(self, *args, **kwargs)
            if not _dispatch.use_triton(x):  # CPU without Triton: the stock module is faster than the twin
                stood_aside(self, LAYER_NORM_OP)
                return sites.call_inner(self, *args, **kwargs)
            # a class of its own under autocast where torch's layer_norm would run in float32: its
            # own casts decide, unprobed
            if not torch_forward and x.device.type in AUTOCAST_TO_FLOAT32 and torch.is_autocast_enabled(x.device.type):
                return sites.call_inner(self, *args, **kwargs)
            return layer_norm(x, self.weight if weighted else None, self.bias if biased else None,
                              eps=float(getattr(self, eps_attr)))

        _layer_norm_forwards[form] = forward
    return _layer_norm_forwards[form]


def recompute_scope(x, counter, saved_as_is: bool = False):
    """The context the modules that consume `x` run in, in a swapped forward (an attention's
    projections, an MLP's gate and up): where x is a swapped norm's output, the projections keep the
    norm call instead of x, and their backward computes it again
    (`accel_kernels.ops.rms_norm.outputs_recomputed`; docs/kernels.md); elsewhere a context that
    does nothing. `counter()` (None: nothing) is called for each recompute (a `RecomputeCounter`, a
    site's method). `saved_as_is`: the consumers save x itself under autocast too (the fused LoRA
    functions; a plain linear layer saves its autocast cast of x, so there the scope stands aside)."""
    if torch.compiler.is_compiling():  # the compiler decides what a graph saves
        return _NO_SCOPE
    scope = _outputs_recomputed()(x, counter, saved_as_is)
    return _NO_SCOPE if scope is None else scope


_NO_SCOPE = contextlib.nullcontext()


#: Instance attribute of a swapped norm (and of a swapped gated MLP: mlp.COUNTER_ATTR) holding the
#: model's call table, where a call on tensors Triton cannot run is counted (`stood_aside`).
CALLS_ATTR = "_accel_patch_norm_calls"
#: A call on tensors Triton cannot run (CPU without Triton's interpreter): the module's own forward,
#: the faster one there, counted (by design, not a fall-back), so that the report says what ran.
NO_TRITON = "stood aside: no Triton for these tensors (the module's forward)"


class NormCalls:
    """Where a swapped norm counts a call it hands to the module's own forward: the model's call
    table (`calls`, which SwapState.absorb and adopt_copies point elsewhere)."""

    __slots__ = ("calls",)

    def __init__(self, calls: dict) -> None:
        self.calls = calls


def stood_aside(module, op: str, attr: str = CALLS_ATTR) -> None:
    """Count one call of `op` on `module` that ran the module's own forward because Triton cannot run
    these tensors. Not while dynamo traces (a count written per call is a guard that fails at every
    call)."""
    holder = module.__dict__.get(attr)
    if holder is not None and not sites.compiling():
        sites.count_into(holder.calls, op, NO_TRITON)


class RecomputeCounter(NormCalls):
    """Counts one recompute as RECOMPUTED under OP in a model's call table (`calls`, which a state
    that absorbs this one's points elsewhere: `SwapState.absorb`)."""

    __slots__ = ()

    def __call__(self) -> None:
        sites.count_into(self.calls, OP, RECOMPUTED)


@functools.cache
def _outputs_recomputed():
    from accel_kernels.ops.rms_norm import outputs_recomputed

    return outputs_recomputed
