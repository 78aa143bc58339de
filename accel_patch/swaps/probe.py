"""The numeric probe: a candidate is swapped only if the kernel reproduces the module's own output.

The module's forward and the kernel both run on the same small random inputs, on the module's
device, in the dtype activations will have and in float32 (norms also in bfloat16, where the
casting variants differ). The relative error (||out - ref|| / ||ref||) must be within a bound
derived from the dtype: `bound(dtype)`. Verdicts are cached per (op, class, dtype, device type,
structure), so a model of 32 layers probes each kind of site once.
"""
from __future__ import annotations

import contextlib
from _thread import RLock

import torch

#: Floor of the bound: float32 results of a different but equivalent evaluation order.
FP32_BOUND = 1e-5
#: Units of the dtype's machine epsilon a low-precision result may differ by (one rounding of the
#: stock module's intermediate results that the kernel keeps in float32, seen through a matmul).
EPS_UNITS = 4


def bound(dtype: torch.dtype) -> float:
    """The largest relative error at which a kernel counts as computing a module's function."""
    if not dtype.is_floating_point:
        raise ValueError(f"a probe needs a floating-point dtype, got {dtype}")
    return max(FP32_BOUND, EPS_UNITS * torch.finfo(dtype).eps)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out is not finite or the shapes differ."""
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor) or out.shape != ref.shape:
        return float("inf")
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


class ProbeCache:
    """Verdicts of past probes, keyed by (op, class, dtype, device type, structure).

    A verdict is whatever the op's probe returns: the variant to run, or a refusal reason (a str,
    kept as a `sites.Refused`, so a cached refusal reads as a fresh one does).
    """

    def __init__(self) -> None:
        self._lock = RLock()
        self._verdicts: dict[tuple, object] = {}

    def get_or_probe(self, key: tuple, probe):
        with self._lock:
            if key not in self._verdicts:
                verdict = probe()
                if isinstance(verdict, str):
                    from .sites import Refused

                    verdict = Refused(verdict)
                self._verdicts[key] = verdict
            return self._verdicts[key]

    def clear(self) -> None:
        with self._lock:
            self._verdicts.clear()

    def __len__(self) -> int:
        return len(self._verdicts)


#: The process-wide cache (tests clear it to probe afresh).
cache = ProbeCache()


@contextlib.contextmanager
def probing(module: torch.nn.Module):
    """Run a probe without side effects: the global RNG state is put back afterwards, and the
    module keeps its training flag. Within, call `seeded()` before each forward so that stock and
    swapped see the same dropout masks. Grad stays enabled and inputs should require grad: some
    layers change themselves on a first call in eval mode without grad (bitsandbytes' Linear4bit
    repacks its weight for CPU inference, after which its gradients are wrong)."""
    devices = [d for d in {p.device for p in module.parameters()} if d.type == "cuda"]
    with torch.random.fork_rng(devices=devices, enabled=True), torch.enable_grad(), _interpreter_quiet():
        yield


def _interpreter_quiet():
    """Under Triton's CPU interpreter, numpy's overflow warnings off for the probe: its inputs past
    the limits (`past_limits`) drive an activation's exp to inf on purpose (a sigmoid of -1e4 is
    1 / (1 + inf) = 0, as a GPU's exp2 gives it silently), and numpy, which computes the interpreted
    kernels, would say "overflow encountered in exp" to a user whose stock model says nothing. The
    results are still compared against the module's: a kernel that overflows where stock does not
    is refused as before."""
    from accel_kernels import _triton

    if not _triton.INTERPRETING:
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(over="ignore")


def seeded() -> None:
    torch.manual_seed(1234)


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (None when it has neither)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def layer_config(config, module):
    """The configuration that describes `module`: its layer's own entry where the configuration
    is per layer (transformers' heterogeneous configs, e.g. Gemma 4's global-attention layers with
    their own key/value heads), else `config`. A global read of a per-layer attribute raises
    there (not an AttributeError), so the layer's entry is read instead."""
    layers = None
    try:
        if getattr(config, "is_heterogeneous", False):
            layers = config.per_layer_config
    except Exception:
        layers = None
    index = getattr(module, "layer_idx", None)
    if layers is not None and isinstance(index, int) and 0 <= index < len(layers):
        return layers[index]
    return config


#: Limits past this are out of any pre-activation's reach (a "no clamp" written as a huge number).
LIMIT_REACHED = 1e4


def limits(module, config=None) -> list[float]:
    """The clamp limits a module or its configuration names (families.LIMIT_ATTRIBUTES), up to
    LIMIT_REACHED."""
    from .families import LIMIT_ATTRIBUTES

    found = []
    for owner in (module, getattr(module, "config", None), config):
        for name in LIMIT_ATTRIBUTES:
            try:
                value = getattr(owner, name, None) if owner is not None else None
            except Exception:  # a per-layer configuration's global read
                value = None
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= LIMIT_REACHED:
                found.append(float(value))
    return found


def reach_past(bounds) -> float:
    """The pre-activation magnitude the past-limits probe drives to, given the clamp bounds in
    play: families.PAST_LIMIT times the largest, at least families.UNNAMED_REACH."""
    from .families import PAST_LIMIT, UNNAMED_REACH

    return max([UNNAMED_REACH] + [PAST_LIMIT * v for v in bounds])


def reach(module, config=None) -> float:
    """`reach_past` of the limits the module (or its configuration) names."""
    return reach_past(limits(module, config))


def past_limits(x: torch.Tensor, pre: torch.Tensor, magnitude: float) -> torch.Tensor:
    """`x` scaled so that the pre-activations it gives (`pre`, computed from `x` by linear maps)
    reach `magnitude` at their largest: a probe input past every clamp below it. A new leaf that
    requires grad, in x's dtype."""
    peak = pre.detach().abs().max().item()
    scale = magnitude / peak if peak > 0 else 1.0
    return (x.detach().float() * scale).to(x.dtype).requires_grad_()


def past_limits_refusal(module, out, ref, what: str, magnitude: float, dtype: torch.dtype) -> str | None:
    """The refusal reason when `out` (the kernel's) differs from `ref` (the module's) on the
    past-limits input, naming the limits the module names; None when they agree or when `ref`
    is not finite (a half-precision overflow at that scale cannot be judged)."""
    if not isinstance(ref, torch.Tensor) or not torch.isfinite(ref).all():
        return None
    err, limit = rel_err(out, ref), bound(dtype)
    if err <= limit:
        return None
    named = ", ".join(f"{v:g}" for v in limits(module))
    why = f" (it names a limit of {named}: a clamp the kernel does not apply)" if named else ""
    return (f"output differs from {what} with gate/up pre-activations up to {magnitude:g} in {dtype}: "
            f"relative error {err:.2e} > {limit:.1e}{why}")


def randn(shape, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Random normal values made in float32 and rounded to dtype (the probe's inputs)."""
    return (torch.randn(shape, device=device) * scale).to(dtype)
