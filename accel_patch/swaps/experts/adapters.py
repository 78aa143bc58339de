"""PEFT's LoRA on an experts module's 3-D parameters, read as the op's split-LoRA factors.

PEFT 0.21 wraps a targeted 3-D parameter (`target_parameters`, and `target_modules="all-linear"`,
which reaches the experts' `gate_up_proj`/`down_proj`) in a `ParamWrapper`, nested once per
parameter around the experts module. At each forward the wrapper registers a parametrization on
the experts module for the call, so that `experts.gate_up_proj` reads W + s B A:

- one active adapter on a float base (PEFT 0.21.2): `_LoraFactorsProxy(lhs, rhs, scaling)`, the
  update `W + s lhs @ rhs` folded by one `baddbmm` when the parameter is read;
- several active adapters, a low-precision base, or an older PEFT: `_LoraParameterProxy`, holding
  the delta weight PEFT has already formed.

`factors()` reads the first kind without ever reading the parametrized weight: lhs/rhs are views
of `lora_A.weight` [r*E, in] and `lora_B.weight` [out, r*E] (cast to the base's dtype by PEFT),
laid out like the parameter (`ParamWrapper.get_delta_factors`): for a parameter stored
[E, out, in] (F.linear, `_did_swap_in_out_features`), lhs = B [E, out, r] and rhs = A [E, r, in];
for one stored [E, in, out] (`x @ W`), lhs = A^T and rhs = B^T. The op takes A [E, r, in] and
B [E, out, r] whatever the layout, so `transposed` decides which factor is which. The second kind
(the delta already formed) is PEFT's forward for that call, counted.
"""
from __future__ import annotations

from collections import namedtuple

import torch

from ..sites import Refused

#: Attribute `nn.utils.parametrize` adds to a module: a ModuleDict name -> ParametrizationList.
PARAMETRIZATIONS = "parametrizations"


def parametrized(module) -> bool:
    """Whether any parameter of `module` is parametrized now (PEFT's LoRA is active for this call)."""
    return PARAMETRIZATIONS in module._modules


def base(module, name: str) -> torch.Tensor | None:
    """The stored tensor `name` of `module`, never its parametrized value (reading that would form
    PEFT's W + B A)."""
    plist = module._modules[PARAMETRIZATIONS]._modules.get(name) if parametrized(module) else None
    if plist is not None:
        return plist.original
    return module._parameters.get(name)


class Factors(namedtuple("Factors", "a b scaling")):
    """The op's split-LoRA factors of one projection: A [E, r, in], B [E, out, r], the scaling."""

    __slots__ = ()


def factors(module, name: str, transposed: bool):
    """The `Factors` of the one LoRA adapter PEFT parametrizes `name` with for this call; None when
    it has none; a `sites.Refused` when it has one the op cannot read."""
    if not parametrized(module):
        return None
    plist = module._modules[PARAMETRIZATIONS]._modules.get(name)
    if plist is None:
        return None
    if len(plist) != 1:
        return Refused(f"{len(plist)} parametrizations on {name}")
    proxy = plist[0]
    lhs, rhs, scaling = (getattr(proxy, a, None) for a in ("lhs", "rhs", "scaling"))
    if not isinstance(lhs, torch.Tensor) or not isinstance(rhs, torch.Tensor) or not isinstance(scaling, (int, float)):
        return Refused(f"{type(proxy).__name__} on {name} (the delta weight formed by PEFT: several active "
                       f"adapters, a low-precision base, or a PEFT without factored LoRA)")
    if lhs.dim() != 3 or rhs.dim() != 3:
        return Refused(f"LoRA factors of {name} are not per expert ({tuple(lhs.shape)}, {tuple(rhs.shape)})")
    if transposed:  # W [E, in, out]: delta = A^T B^T
        return Factors(lhs.transpose(-2, -1), rhs.transpose(-2, -1), float(scaling))
    return Factors(rhs, lhs, float(scaling))  # W [E, out, in]: delta = B A
