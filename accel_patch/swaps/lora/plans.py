"""Which calls the fused functions can compute: a projection as they see it (`Proj`: base weight,
plain or bitsandbytes 4-bit, bias, one adapter), the reason when they cannot (PEFT's forward
runs), and the candidate sites, found by structure at swap time."""
from __future__ import annotations

from collections import namedtuple

import torch

from .. import families, mlp

MLP_OP, QKV_OP, O_OP = "lora_mlp", "lora_qkv", "lora_o"
OPS = (MLP_OP, QKV_OP, O_OP)


class Proj(namedtuple("Proj", "weight bias kind adapted scale peft_cast")):
    """weight: the base weight (a Params4bit for kind "4bit"); adapted: whether A and B follow in
    the function's inputs; scale: PEFT's scaling; peft_cast: how PEFT adds an adapter of another
    dtype ("promote": add in the promoted dtype, then cast back (lora.Linear); "cast": cast the
    adapter's output first (lora.bnb.Linear4bit))."""

    __slots__ = ()


def _is_lora_layer(m) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "lora_B") and callable(getattr(m, "get_base_layer", None))


def _is_4bit(m) -> bool:
    return type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")


def _plain_linear(m) -> bool:
    return (isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and type(m.weight) in (torch.nn.Parameter, torch.Tensor))


def base_kind(m) -> str | None:
    """"plain" or "4bit" for a base layer the fused functions compute, else None."""
    if _plain_linear(m):
        return "plain"
    if _is_4bit(m) and getattr(m.weight, "quant_state", None) is not None:
        return "4bit"
    return None


def layer_kind(m) -> str | None:
    """The base kind of a projection (looking through a PEFT LoRA layer), None when not computable."""
    return base_kind(m.get_base_layer() if _is_lora_layer(m) else m)


def _hooked(m) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or "_hf_hook" in m.__dict__)


def projection(m, x: torch.Tensor):
    """(Proj, (A, B) or ()) for this call of projection `m` on input `x`, or the reason the fused
    path cannot reproduce it (PEFT's own forward runs)."""
    if _is_lora_layer(m):
        base = m.get_base_layer()
        adapter = None
        if m.disable_adapters:
            if m.merged:
                return "adapters disabled while merged (PEFT unmerges in its forward)"
        elif not m.merged:
            active = [a for a in m.active_adapters if a in m.lora_A]
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
            dropout = m.lora_dropout[adapter]
            if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
                return "dropout > 0 in training"
            if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
                return f"dropout module {type(dropout).__name__}"
        if _hooked(m):
            return "hooks on a projection"
    else:
        base, adapter = m, None
    kind = base_kind(base)
    if kind is None:
        return f"base layer {type(base).__name__} is neither a plain nor a bitsandbytes 4-bit linear"
    if _hooked(base):
        return "hooks on a projection"
    weight, bias = base.weight, base.bias
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "a trainable base weight"
    compute = weight.dtype if kind == "plain" else (getattr(base, "compute_dtype", None) or x.dtype)
    if x.dtype != compute or (bias is not None and bias.dtype != compute and kind == "plain"):
        return f"mixed dtypes (input {x.dtype}, base {compute})"
    if weight.device != x.device:
        return f"input on {x.device}, weight on {weight.device}"
    if adapter is None:
        return Proj(weight, bias, kind, False, 0.0, None), ()
    A, B = m.lora_A[adapter].weight, m.lora_B[adapter].weight
    if m.lora_A[adapter].bias is not None or m.lora_B[adapter].bias is not None:
        return "lora_bias"
    if A.dtype != B.dtype or (A.dtype != x.dtype and not (A.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16))):
        return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}/{B.dtype})"
    if A.dtype != x.dtype and not getattr(m, "cast_input_dtype_enabled", True):
        return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}, input casting disabled)"
    return Proj(weight, bias, kind, True, float(m.scaling[adapter]), "cast" if kind == "4bit" else "promote"), (A, B)


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
            base = proj.get_base_layer() if _is_lora_layer(proj) else proj
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
                base = proj.get_base_layer() if _is_lora_layer(proj) else proj
                reasons[op] = f"projection {name} is {type(base).__name__}: neither a plain nor a bitsandbytes 4-bit linear"
    return inputs, out, reasons


def structure(module, names) -> tuple:
    """What the probe verdict depends on besides the class: the names and base kinds."""
    return tuple((n, layer_kind(getattr(module, n))) for n in names)
