"""Which calls the fused functions can compute: a projection as they see it (`Proj`: base weight,
plain or bitsandbytes 4-bit, bias, one adapter), the reason when they cannot (PEFT's forward
runs), and the candidate sites, found by structure at swap time."""
from __future__ import annotations

from collections import namedtuple

import torch

from .. import families
from ..sites import autocast_dtype
from ..layers import mlp

MLP_OP, QKV_OP, O_OP = "lora_mlp", "lora_qkv", "lora_o"
OPS = (MLP_OP, QKV_OP, O_OP)


class Proj(namedtuple("Proj", "weight bias kind compute adapted scale dropout autocast lora_cast peft_cast")):
    """One projection of one call, as PEFT computes it.

    weight: the base weight (a Params4bit for kind "4bit"); compute: the dtype the base matmul runs
    in (autocast's, the weight's, or a 4-bit layer's compute dtype); adapted: whether A and B follow
    in the function's inputs; scale: PEFT's scaling; dropout: the p of the adapter's dropout this
    call (0.0: none, e.g. in eval mode); autocast: the autocast dtype in force for the input's
    device at the call (None: off), under which the adapter's matmuls run; lora_cast: whether PEFT
    casts the input to the adapter's dtype before dropout; peft_cast: how PEFT adds the adapter's
    output ("promote": in the promoted dtype, then back to the base result's dtype (lora.Linear);
    "cast": the adapter's output cast to the base result's dtype first (lora.bnb.Linear4bit);
    "none": in the promoted dtype, kept (lora.bnb.Linear4bit under CUDA autocast))."""

    __slots__ = ()


class Dtypes(namedtuple("Dtypes", "base result lora_in lora add out")):
    """The dtypes of one projection's computation for an input dtype (`dtypes`): base matmul,
    base result, the adapter's input (what dropout sees), the adapter's matmuls, the sum, the output."""

    __slots__ = ()


def dtypes(p: Proj, x_dtype: torch.dtype, adapter_dtype: torch.dtype | None) -> Dtypes:
    """What PEFT's forward computes in, for projection `p` on an input of `x_dtype` (autocast,
    where on, runs every matmul in its dtype, as `F.linear` does under it)."""
    base = p.autocast or p.compute
    result = x_dtype if p.kind == "4bit" else base
    if not p.adapted:
        return Dtypes(base, result, x_dtype, result, result, result)
    lora_in = adapter_dtype if p.lora_cast else x_dtype
    lora = p.autocast or adapter_dtype
    promoted = torch.promote_types(result, lora)
    if p.peft_cast == "cast":
        return Dtypes(base, result, lora_in, lora, result, result)
    return Dtypes(base, result, lora_in, lora, promoted, result if p.peft_cast == "promote" else promoted)


def _is_lora_layer(m) -> bool:
    # PEFT's LoRA layers hold lora_A and lora_B as submodules: two dict lookups (hasattr on a module
    # without them goes through nn.Module.__getattr__ and a raised AttributeError)
    children = m._modules
    return "lora_A" in children and "lora_B" in children and callable(getattr(m, "get_base_layer", None))


def _own_get_base_layer(cls) -> bool:
    """Whether the class keeps PEFT's `BaseTunerLayer.get_base_layer` (the walk down `base_layer`):
    asked once per class in eager (`_per_class`)."""
    return _per_class(_GET_BASE_LAYER, cls, _keeps_pefts_get_base_layer)


def _keeps_pefts_get_base_layer(cls) -> bool:
    method = getattr(cls, "get_base_layer", None)
    return (getattr(method, "__qualname__", "") == "BaseTunerLayer.get_base_layer"
            and getattr(method, "__module__", "").startswith("peft."))


_GET_BASE_LAYER: dict = {}


def _per_class(cache: dict, cls, answer) -> bool:
    """answer(cls), kept in `cache` in eager; asked afresh while dynamo traces (a dict the trace
    writes to would be guarded on, and a new class would recompile every graph that read it)."""
    if torch.compiler.is_compiling():
        return answer(cls)
    known = cache.get(cls)
    if known is None:
        known = cache[cls] = answer(cls)
    return known


def base_layer(m):
    """`m.get_base_layer()` of a LoRA layer: PEFT's walk down the nested `base_layer`s, as submodule
    lookups where the class keeps PEFT's method (its `hasattr` ends in a raised AttributeError:
    about 3 us a call, for every projection of every fused call)."""
    if not _own_get_base_layer(type(m)):
        return m.get_base_layer()
    base = m
    while True:
        inner = base._modules.get("base_layer")
        if inner is None:
            break
        base = inner
    if "base_layer" in base.__dict__ or hasattr(type(base), "base_layer"):
        return m.get_base_layer()  # a base_layer that is not a submodule: PEFT's own walk
    return base


def _is_4bit(m) -> bool:
    return type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")


def _plain_linear(m) -> bool:
    if not _plain_linear_class(type(m)):
        return False
    weight = m._parameters.get("weight")
    return type(weight if weight is not None else getattr(m, "weight", None)) in (torch.nn.Parameter, torch.Tensor)


def _plain_linear_class(cls) -> bool:
    return _per_class(_PLAIN_LINEAR, cls, _is_plain_linear_class)


def _is_plain_linear_class(cls) -> bool:
    return issubclass(cls, torch.nn.Linear) and cls.forward is torch.nn.Linear.forward


_PLAIN_LINEAR: dict = {}


def base_kind(m) -> str | None:
    """"plain" or "4bit" for a base layer the fused functions compute, else None."""
    if _plain_linear(m):
        return "plain"
    if _is_4bit(m) and getattr(m.weight, "quant_state", None) is not None:
        return "4bit"
    return None


def layer_kind(m) -> str | None:
    """The base kind of a projection (looking through a PEFT LoRA layer), None when not computable."""
    return base_kind(base_layer(m) if _is_lora_layer(m) else m)


def _hooked(m) -> str | None:
    """Why `m` must be called: a hook registered on it (forward, pre-forward, backward,
    accelerate's), or its forward replaced on the instance (X-LoRA's way, a user's wrapper); None
    when neither. The fused functions do not call the module, so neither would run."""
    if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
            or "_hf_hook" in m.__dict__):
        return "hooks on a projection"
    if "forward" in m.__dict__:
        return "a forward set on a projection's instance"
    return None


_AUTOCASTABLE = (torch.float32, torch.bfloat16, torch.float16)  # what autocast casts (not float64)

#: Adapters of this dtype on a float32 input outside autocast, over a bitsandbytes 4-bit base:
#: TRL's trainers cast a quantized model's adapters to bfloat16 whatever the precision flags, and
#: `prepare_model_for_kbit_training` leaves the hidden states in float32, so `bf16=False` trains
#: in exactly this pairing. PEFT casts x to the adapters' dtype, computes the adapter there and adds
#: it cast back (`lora.bnb.Linear4bit`); the LoRA probe checks the pairing on 4-bit bases
#: (`probe._probe_configs`), so it is taken only there.
HALF_ADAPTERS_4BIT = torch.bfloat16




def _dropout_p(dropout) -> float | str:
    """The p PEFT's dropout applies this call (0.0 in eval mode), or a refusal reason."""
    if isinstance(dropout, torch.nn.Identity):
        return 0.0
    if type(dropout) is not torch.nn.Dropout:
        return f"dropout module {type(dropout).__name__}"
    if not dropout.training or dropout.p == 0:
        return 0.0
    if dropout.inplace or not 0 < dropout.p < 1:
        return f"dropout p={dropout.p}{' in place' if dropout.inplace else ''}"
    return float(dropout.p)


def _compute_4bit(base, x: torch.Tensor) -> torch.dtype:
    """The dtype bitsandbytes' Linear4bit computes in for `x` (its first call sets it from a
    float32 or bfloat16 input: `set_compute_type`)."""
    if not getattr(base, "compute_type_is_set", True) and x.dtype in (torch.float32, torch.bfloat16):
        return x.dtype
    return getattr(base, "compute_dtype", None) or x.dtype


def projection(m, x: torch.Tensor):
    """(Proj, (A, B) or ()) for this call of projection `m` on input `x`, or the reason the fused
    path cannot reproduce it (PEFT's own forward runs). Called for every projection of every fused
    call: each submodule is looked up once (a module attribute read costs about half a microsecond)."""
    p = 0.0
    lora_A = lora_B = None
    if _is_lora_layer(m):
        base = base_layer(m)
        adapter = None
        children = m._modules  # the LoRA layer's submodules read from its dict, not through __getattr__
        if m.disable_adapters:
            if m.merged:
                return "adapters disabled while merged (PEFT unmerges in its forward)"
        elif not m.merged:
            held = children["lora_A"]
            if not isinstance(held, torch.nn.ModuleDict):  # AdaLoRA's ParameterDict of factors
                return f"adapters held as a {type(held).__name__} (AdaLoRA's SVD form)"
            lora_A = held._modules
            active = [a for a in m.active_adapters if a in lora_A]
            if len(active) > 1:
                return f"more than one active adapter ({', '.join(active)})"
            if active:
                adapter = active[0]
        if adapter is not None:
            if adapter in getattr(m, "lora_variant", {}):
                return f"a LoRA variant ({type(m.lora_variant[adapter]).__name__}, e.g. DoRA)"
            if getattr(m, "use_dora", {}).get(adapter, False):
                return "DoRA"
            if getattr(m, "lora_bias", {}).get(adapter, False):
                return "lora_bias"
            if getattr(m, "fan_in_fan_out", False):
                return "fan_in_fan_out"
            dropout = children["lora_dropout"]._modules[adapter]
            p = _dropout_p(dropout)
            if isinstance(p, str):
                return p
            lora_A, lora_B = lora_A[adapter], children["lora_B"]._modules[adapter]
            hooked = _hooked(lora_A) or _hooked(lora_B) or _hooked(dropout)
            if hooked:
                return hooked
        hooked = _hooked(m)
        if hooked:
            return hooked
        immediate = children.get("base_layer")
        if immediate is not None and immediate is not base and "base_layer" in immediate._modules:
            # PEFT's forward calls its immediate base layer: another adapter layer (LoHa, LoKr or
            # LoRA of a mixed or twice-wrapped model) adds its own term there
            return f"an adapter layer ({type(immediate).__module__}.{type(immediate).__qualname__}) under the LoRA layer"
    else:
        base, adapter = m, None
    kind = base_kind(base)
    if kind is None:
        return f"base layer {type(base).__name__} is neither a plain nor a bitsandbytes 4-bit linear"
    hooked = _hooked(base)
    if hooked:
        return hooked
    params = base._parameters
    weight = params["weight"] if "weight" in params else base.weight  # a weight held as a plain tensor too
    bias = params["bias"] if "bias" in params else getattr(base, "bias", None)
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "a trainable base weight"
    if weight.device != x.device:
        return f"input on {x.device}, weight on {weight.device}"
    autocast = autocast_dtype(x.device.type)
    if kind == "plain":
        compute = weight.dtype
        if autocast is None and (x.dtype != compute or (bias is not None and bias.dtype != compute)):
            return f"mixed dtypes (input {x.dtype}, base {compute})"
    else:
        compute = _compute_4bit(base, x)
    if autocast is not None:
        if x.dtype not in _AUTOCASTABLE:
            return f"{x.dtype} under autocast"
        for t in ((bias,) if kind == "4bit" else (weight, bias)):
            if t is not None and t.dtype not in _AUTOCASTABLE:
                return f"{t.dtype} under autocast"
    if adapter is None:
        return Proj(weight, bias, kind, compute, False, 0.0, 0.0, autocast, False, None), ()
    a_params, b_params = lora_A._parameters, lora_B._parameters
    if "weight" not in a_params or "weight" not in b_params:
        return "an adapter weight that is not a parameter (parametrized)"
    A, B = a_params["weight"], b_params["weight"]
    if a_params.get("bias") is not None or b_params.get("bias") is not None:
        return "lora_bias"
    if A.dtype != B.dtype:
        return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}/{B.dtype})"
    cast_enabled = getattr(m, "cast_input_dtype_enabled", True)
    if kind == "4bit":  # lora.bnb.Linear4bit casts only outside CUDA autocast (`torch.is_autocast_enabled()`)
        converts = not torch.is_autocast_enabled()
        lora_cast, peft_cast = cast_enabled and converts, "cast" if converts else "none"
    else:
        lora_cast, peft_cast = cast_enabled, "promote"
    if autocast is None:
        if A.dtype != x.dtype and not (A.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)) \
                and not (kind == "4bit" and A.dtype == HALF_ADAPTERS_4BIT and x.dtype == torch.float32):
            return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}/{B.dtype})"
        if A.dtype != x.dtype and not lora_cast:
            return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}, input casting disabled)"
    elif A.dtype not in _AUTOCASTABLE:
        return f"{A.dtype} under autocast"
    return Proj(weight, bias, kind, compute, True, float(m.scaling[adapter]), p, autocast, lora_cast, peft_cast), (A, B)


# --------------------------------------------------------------------------------------------
# Candidates (by structure, at swap time)
# --------------------------------------------------------------------------------------------


def mlp_candidate(module):
    """((projection names), kernel activation) for a gated MLP whose projections the fused
    function can compute; a refusal reason; or None for anything else."""
    found = mlp.candidate(module)
    if found is None or isinstance(found, str):
        return found
    names, act = found
    for name in names:
        if layer_kind(getattr(module, name)) is None:
            proj = getattr(module, name)
            base = base_layer(proj) if _is_lora_layer(proj) else proj
            return f"projection {name} is {type(base).__name__}: neither a plain nor a bitsandbytes 4-bit linear"
    return names, act


def attention_candidate(module):
    """(input projection names, output projection name or None, {op: refusal reason}) of an
    attention block (an op absent from the dict can be swapped), or None for anything else."""
    children = dict(module.named_children())
    for inputs in families.LORA_ATTENTION_INPUTS:
        if all(isinstance(children.get(n), torch.nn.Module) for n in inputs):
            break
    else:
        return None
    out = next((n for n in families.LORA_ATTENTION_OUTPUTS if isinstance(children.get(n), torch.nn.Module)), None)
    reasons = {}
    if out is None:
        reasons[O_OP] = "no output projection (" + "/".join(families.LORA_ATTENTION_OUTPUTS) + ")"
    for op, names in ((QKV_OP, inputs), (O_OP, (out,) if out else ())):
        for name in names:
            if op not in reasons and layer_kind(children[name]) is None:
                proj = children[name]
                base = base_layer(proj) if _is_lora_layer(proj) else proj
                reasons[op] = f"projection {name} is {type(base).__name__}: neither a plain nor a bitsandbytes 4-bit linear"
    return inputs, out, reasons


def structure(module, names) -> tuple:
    """What the probe verdict depends on besides the class: the names and base kinds."""
    return tuple((n, layer_kind(getattr(module, n))) for n in names)
