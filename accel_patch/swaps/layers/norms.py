"""RMSNorm sites: any module with one 1-D `weight`, an epsilon attribute and one input.

The probe runs the module's own forward (with a random weight substituted, so `w` and `1 + w`
differ) against `accel_kernels.rms_norm` in each casting variant of families.NORM_VARIANTS, in the
activation dtype, float32 and bfloat16; the variant that matches in all of them is swapped in.
Per-head and full-width q/k norms and pre/post ("sandwich") norms are norms like any other.
LayerNorm (mean-centred) has no kernel: refused with the reason.

Where the kernel cannot run (CPU tensors without Triton's interpreter:
`accel_kernels._dispatch.use_triton` false), the swapped forward calls the module's own forward:
the plain-torch twin computes the same function, only slower than the stock module there
(benchmarks/overhead.py).
"""
from __future__ import annotations

from collections import namedtuple

import torch

from .. import families, probe, sites

OP = "rms_norm"


class NormVariant(namedtuple("NormVariant", "casting offset eps_attr")):
    __slots__ = ()


def _eps_attr(module) -> str | None:
    for name in families.NORM_EPS_ATTRIBUTES:
        value = getattr(module, name, "missing")
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return name
    return None


def _named_layer_norm(module) -> bool:
    name = type(module).__name__.lower()
    return any(m in name for m in families.LAYER_NORM_MARKERS) and "rms" not in name


def candidate(module) -> str | None:
    """The norm's epsilon attribute when `module` has an RMSNorm's structure (one 1-D `weight`,
    no children, an epsilon attribute, one input), else None. Its name does not matter: T5's
    "LayerNorm" is an RMSNorm, Cohere's is not, and the probe tells them apart."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if isinstance(module, torch.nn.LayerNorm) or set(params) != {"weight"} or weight.dim() != 1:
        return None
    if next(module.children(), None) is not None or sites.single_input(type(module)) is None:
        return None
    return _eps_attr(module)


def refusal(module) -> str | None:
    """Why a module that looks like a norm (by its class name) is not a candidate; None otherwise."""
    params = set(dict(module.named_parameters(recurse=False)))
    if isinstance(module, torch.nn.LayerNorm) or (_named_layer_norm(module) and "bias" in params):
        return "LayerNorm (mean-centred, with a bias): no kernel"
    if "norm" not in type(module).__name__.lower() or not params:
        return None
    return (f"not an RMSNorm shape (one 1-D weight, an epsilon attribute "
            f"{'/'.join(families.NORM_EPS_ATTRIBUTES)}, one input)")


def probe_verdict(module, act_dtype: torch.dtype, eps_attr: str):
    """The variant the kernel must run to reproduce this module, or a refusal reason."""
    from accel_kernels import rms_norm

    device = probe.module_device(module)
    weight = module.weight
    n = weight.shape[0]
    eps = getattr(module, eps_attr)
    dtypes = list(dict.fromkeys([act_dtype, torch.float32, torch.bfloat16]))
    errors = {v: 0.0 for v in families.NORM_VARIANTS}
    with probe.probing(module):
        for dtype in dtypes:
            # The activation dtype probe uses the module's own weight dtype; the others cast both,
            # as a model converted with .to(dtype) would.
            w_dtype = weight.dtype if dtype == act_dtype else dtype
            x = probe.randn((2, 3, n), dtype, device, scale=2.0)
            w = (1.0 + 0.5 * torch.randn(n, device=device)).to(w_dtype)
            try:
                ref = torch.func.functional_call(module, {"weight": w}, (x,))
            except Exception as exc:  # the module cannot run here: no verdict to trust
                return f"module's own forward failed on a {dtype} probe: {type(exc).__name__}: {exc}"
            limit = probe.bound(dtype)
            for variant in list(errors):
                casting, offset = variant
                kernel_eps = torch.finfo(dtype).eps if eps is None else float(eps)
                out = rms_norm(x, w, eps=kernel_eps, offset=offset, casting=casting)
                err = probe.rel_err(out, ref) if out.dtype == ref.dtype else float("inf")
                if err > limit:
                    del errors[variant]
                else:
                    errors[variant] = max(errors[variant], err)
            if not errors:
                if _named_layer_norm(module):
                    return f"LayerNorm (mean-centred): no kernel; its output differs from every RMSNorm variant in {dtype}"
                return f"output differs from every RMSNorm variant in {dtype} (not an RMSNorm?)"
    casting, offset = min(errors, key=errors.get)
    return NormVariant(casting, offset, eps_attr)


_forwards: dict[NormVariant, object] = {}


@sites.made_by  # a pickled model makes its forward again
def forward_for(variant: NormVariant):
    """The swapped forward for one variant: rms_norm of the input with the module's own weight and eps."""
    if variant not in _forwards:
        from accel_kernels import _dispatch, rms_norm

        casting, offset, eps_attr = variant

        def forward(self, *args, **kwargs):
            x = sites.the_input(args, kwargs)
            if not _dispatch.use_triton(x):  # CPU without Triton: the stock module is faster than the twin
                return sites.call_inner(self, *args, **kwargs)
            eps = getattr(self, eps_attr)
            eps = torch.finfo(x.dtype).eps if eps is None else float(eps)  # torch.nn.RMSNorm(eps=None)
            return rms_norm(x, self.weight, eps=eps, offset=offset, casting=casting)

        _forwards[variant] = forward
    return _forwards[variant]
