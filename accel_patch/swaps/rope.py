"""RoPE sites: attention modules whose forward calls a module-level rotate-half RoPE function.

Attention forwards call `apply_rotary_pos_emb` through their modeling module's globals, so the
kernel can only get in by intercepting that global. The interception is shared by every model of
the family and transparent for those not swapped: the global becomes a dispatcher that runs the
kernel only inside the forward of an attention module that was swapped (the swapped attention
forward marks its call in a context variable), and the original function everywhere else, with
the very same arguments. `interceptions` counts the swapped models holding each global and puts
the original object back when the last one is restored.

The probe calls the original function and `accel_kernels.rope` on random q, k, cos, sin with the
attention's head counts and head dim (full and partial rotary, where the function accepts them).
Interleaved conventions (Cohere, GLM) differ and are refused.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from _thread import RLock

import torch

from . import families, probe, sites

OP = "rope"

# The dispatchers allowed to run the kernel in the current call: set by swapped attention forwards.
_ACTIVE: contextvars.ContextVar[frozenset] = contextvars.ContextVar("accel_patch_rope_active", default=frozenset())


def rope_function(module) -> tuple[str, str] | None:
    """(modeling module name, function name) of the RoPE global the module's forward calls, else None."""
    cls = type(module)
    try:
        code = inspect.unwrap(cls.forward).__code__
    except (AttributeError, ValueError):
        return None
    owner = sys.modules.get(inspect.unwrap(cls.forward).__module__)
    for name in families.ROPE_FUNCTIONS:
        if name in code.co_names and owner is not None and callable(owner.__dict__.get(name)):
            return owner.__name__, name
    return None


class Interceptions:
    """The module globals replaced by dispatchers, with how many swapped models hold each."""

    def __init__(self) -> None:
        self._lock = RLock()
        self._held: dict[tuple[str, str], list] = {}  # key -> [original, dispatcher, count]

    def original(self, key: tuple[str, str]):
        """The function the global held before any swap (the global itself when not intercepted)."""
        with self._lock:
            if key in self._held:
                return self._held[key][0]
            module_name, name = key
            return sys.modules[module_name].__dict__[name]

    def acquire(self, key: tuple[str, str]):
        """Put the dispatcher in place (first holder) and count one more holder; returns a release."""
        with self._lock:
            module_name, name = key
            owner = sys.modules[module_name]
            if key not in self._held:
                original = owner.__dict__[name]
                dispatcher = _dispatcher(key, original)
                owner.__dict__[name] = dispatcher
                self._held[key] = [original, dispatcher, 0]
            self._held[key][2] += 1
            released = []

            def release() -> None:
                if not released:
                    released.append(True)
                    self._release(key)

            return release

    def _release(self, key) -> None:
        with self._lock:
            entry = self._held.get(key)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] > 0:
                return
            original, dispatcher, _ = self._held.pop(key)
            owner = sys.modules[key[0]]
            # Someone else replaced the global after us: leave theirs (it may call our dispatcher,
            # which without a holder is a plain pass-through to the original).
            if owner.__dict__.get(key[1]) is dispatcher:
                owner.__dict__[key[1]] = original

    def held(self) -> dict[str, int]:
        with self._lock:
            return {f"{m}.{n}": entry[2] for (m, n), entry in self._held.items()}


interceptions = Interceptions()


def _dispatcher(key, original):
    signature = inspect.signature(original)
    params = list(signature.parameters.values())
    # The first four parameters are q, k, cos, sin whatever their names; `unsqueeze_dim` may be
    # given; any other argument (old `position_ids`, ...) must be left at its default.
    tensors = [p.name for p in params[:4]]
    others = {p.name: p.default for p in params[4:] if p.name != "unsqueeze_dim"}

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if key in _ACTIVE.get():
            try:
                given = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return original(*args, **kwargs)
            if (len(tensors) == 4 and given.get("unsqueeze_dim", 1) == 1
                    and all(given[n] is d for n, d in others.items() if n in given)):
                try:
                    return _kernel(*(given[n] for n in tensors))
                except (KeyError, ValueError):
                    pass  # a shape the kernel does not take: the stock function handles it
        return original(*args, **kwargs)

    dispatch.__accel_patch_original__ = original
    return dispatch


def _kernel(q, k, cos, sin):
    from accel_kernels import rope

    return rope(q, k, cos, sin, unsqueeze_dim=1)


def head_shape(module, config) -> tuple[int, int, int, tuple[int, ...]]:
    """(query heads, key/value heads, head dim, rotary dims to probe) of an attention module."""
    heads = getattr(config, "num_attention_heads", None) or getattr(module, "num_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and heads:
        head_dim = config.hidden_size // heads
    rotary = [head_dim]
    for attr in ("rotary_ndims", "rotary_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            rotary.append(value)
    for attr in families.PARTIAL_ROTARY_ATTRIBUTES:
        value = getattr(config, attr, None)
        if isinstance(value, (int, float)) and 0 < value < 1:
            rotary.append(int(head_dim * value))
    return heads, kv_heads, head_dim, tuple(sorted({r - r % 2 for r in rotary if r and r >= 2}, reverse=True))


def probe_verdict(key, module, config, act_dtype: torch.dtype):
    """`key` (the function to intercept) when the kernel reproduces it at this attention's
    shapes, else a refusal reason."""
    heads, kv_heads, head_dim, rotary_dims = head_shape(module, config)
    if not (heads and kv_heads and head_dim):
        return "cannot tell the attention's head counts and head dim"
    original = interceptions.original(key)
    device = probe.module_device(module)
    ran = 0
    with probe.probing(module):
        for dtype in dict.fromkeys([act_dtype, torch.float32]):
            # q/k of the full head dim with rotary dim r (partial rotary inside the function), and
            # q/k of dim r (the caller slices the rotary part off first, as Phi and StableLM do)
            for dim, r in {(head_dim, r) for r in rotary_dims} | {(r, r) for r in rotary_dims}:
                q = probe.randn((2, heads, 5, dim), dtype, device)
                k = probe.randn((2, kv_heads, 5, dim), dtype, device)
                cos = probe.randn((2, 5, r), dtype, device)
                sin = probe.randn((2, 5, r), dtype, device)
                try:
                    ref = original(q, k, cos, sin)
                except Exception:
                    continue  # this function does not take this shape; the dispatcher never sends it
                ran += 1
                try:
                    out = _kernel(q, k, cos, sin)
                except ValueError as exc:
                    return f"kernel refused the shapes the function takes: {exc}"
                err = max(probe.rel_err(o, s) for o, s in zip(out, ref))
                limit = probe.bound(dtype)
                if err > limit:
                    return (f"{key[0]}.{key[1]} differs from rotate-half RoPE in {dtype} (relative error "
                            f"{err:.2e} > {limit:.1e}; interleaved or another convention)")
    return key if ran else f"{key[1]} could not be called with rotate-half shapes"


_forwards: dict[tuple, object] = {}


def forward_for(key: tuple[str, str]):
    """The swapped attention forward: the module's own forward, with the kernel allowed for `key`."""
    if key not in _forwards:
        allowed = frozenset([key])

        def forward(self, *args, **kwargs):
            token = _ACTIVE.set(_ACTIVE.get() | allowed)
            try:
                return sites.call_inner(self, *args, **kwargs)
            finally:
                _ACTIVE.reset(token)

        _forwards[key] = forward
    return _forwards[key]
