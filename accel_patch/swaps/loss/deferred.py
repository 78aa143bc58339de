"""Deferred logits: the LM head's output before it is computed, and the fused loss on it.

A carrier stands for `F.linear(hidden, weight, bias)` under the autocast state of the call
(`_Head`, the one head call of both carriers). Two carriers share one set of rules (`Deferred`,
its `__torch_function__` and the table `_HANDLERS`, read by both): in eager mode `DeferredLogits`,
a storage-less tensor subclass (here); while torch.compile traces, `LogitsStandIn`, a plain object
dynamo follows (compiled_loss.py). The few operations families apply to logits before the loss
(a cast, a scalar multiply or divide, `tanh`, a reshape, slicing leading dims) stay deferred and
are recorded; `F.cross_entropy` on it runs `fused_linear_cross_entropy` on the head's input, scaled
and soft-capped to match (`fused_loss`), on the labelled rows only (`labelled_rows`: selected
before the matmul; under torch.compile `all_rows`, the static-shape form: every row, the kernel
zeroes the ignored ones); any other operation computes the real logits first, replaying the
recorded calls (stock values, stock gradients), so nothing can be dropped silently.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from .. import sites

_SELF = object()  # marks the deferred tensor's place in a recorded call


class _Head:
    """The head call a carrier stands for: F.linear(hidden, weight, bias) under the autocast state
    of the call, computed at most once. `state` counts the call's outcomes in eager mode; None while
    torch.compile traces (a count read and written per call is a guard that fails at every call)."""

    def __init__(self, hidden, weight, bias, state=None) -> None:
        self.hidden, self.weight, self.bias, self.state = hidden, weight, bias, state
        self.autocast = sites.autocast_state(hidden.device.type)
        self._real = None

    @property
    def computed(self) -> bool:
        return self._real is not None

    def real(self) -> torch.Tensor:
        if self._real is None:
            device_type, enabled, dtype = self.autocast
            with torch.autocast(device_type, dtype=dtype, enabled=enabled) if enabled else contextlib.nullcontext():
                self._real = F.linear(self.hidden, self.weight, self.bias)
        return self._real

    def out_dtype(self) -> torch.dtype:
        _, enabled, dtype = self.autocast
        return dtype if enabled else self.weight.dtype

    def count(self, outcome: str) -> None:
        if self.state is not None:
            self.state.count_call(outcome)


def deferred_head(carrier: type, module, state, args, kwargs):
    """The head's linear forward returning a `carrier` (DeferredLogits or LogitsStandIn) instead
    of the logits; stock F.linear (and its error) when the dtypes would not run stock either."""
    hidden = sites.the_input(args, kwargs)
    head = _Head(hidden, module.weight, module.bias, state)
    if not head.autocast[1] and hidden.dtype != module.weight.dtype:
        return F.linear(hidden, module.weight, module.bias)  # stock, and its dtype error
    shape = torch.Size((*hidden.shape[:-1], module.weight.shape[0]))
    return carrier(head, (), hidden, shape, head.out_dtype())


class Deferred:
    """What both carriers share: the deferred form and the rules (see the module docstring).

    `_head`: the head call; `_chain`: the calls applied since, replayed on the real logits when
    they are needed; `_hidden`: the head's input with the carrier's leading shape; `_pre`,
    `_tanh`, `_post`: the logits as `post * tanh(pre * z)` (or `pre * z`) of the head output z.
    A carrier is built as `carrier(head, chain, hidden, shape, dtype, pre, tanh, post)`.
    """

    def _derive(self, call, **changes):
        fields = dict(hidden=self._hidden, shape=self.shape, dtype=self.dtype, pre=self._pre,
                      tanh=self._tanh, post=self._post)
        fields.update(changes)
        return type(self)(self._head, self._chain + (call,), **fields)

    def materialize(self) -> torch.Tensor:
        """The real logits: the head's output with every recorded call replayed on it, as stock."""
        x = self._head.real()
        for func, args, kwargs in self._chain:
            x = func(*(x if a is _SELF else a for a in args), **kwargs)
        return x

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            result = handler(func, args, kwargs)
            if result is not NotImplemented:
                return result
        # Anything else: the real logits, and the stock operation on them.
        for a in args:
            if isinstance(a, Deferred) and not a._head.computed:
                if a._head.state is not None:  # eager only: dynamo need not read a function's name
                    a._head.count(f"logits computed for {getattr(func, '__name__', func)}")
                break
        args, kwargs = materialized((args, kwargs))
        return func(*args, **kwargs)


class DeferredLogits(Deferred, torch.Tensor):
    """The eager carrier: logits of a linear head not computed yet, as a storage-less tensor."""

    @staticmethod
    def __new__(cls, head, chain, hidden, shape, dtype, pre=1.0, tanh=False, post=1.0):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=hidden.device)
        t._head, t._chain, t._hidden = head, chain, hidden
        t._pre, t._tanh, t._post = pre, tanh, post
        return t

    def __repr__(self, **kwargs):
        return f"DeferredLogits(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"accel_patch: DeferredLogits reached {func} without being computed; please report this")


def materialized(obj):
    """`obj` with every deferred logits in it (nested in lists, tuples and dicts) replaced by its
    real logits."""
    if isinstance(obj, Deferred):
        return obj.materialize()
    if isinstance(obj, (list, tuple)):
        return type(obj)(materialized(o) for o in obj)
    if isinstance(obj, dict):
        return {k: materialized(v) for k, v in obj.items()}
    return obj


# Calls that only read a tensor's metadata: answered from the deferred tensor's own shape, dtype
# and device. (Looked up by name: the set differs a little across torch versions.)
_METADATA = set()
for _name in ("shape", "dtype", "device", "ndim", "requires_grad", "layout", "is_cuda", "is_leaf",
              "grad_fn", "is_sparse", "is_quantized", "is_meta"):
    _attr = getattr(torch.Tensor, _name, None)
    if _attr is not None and hasattr(_attr, "__get__"):
        _METADATA.add(_attr.__get__)
for _name in ("size", "dim", "numel", "nelement", "__len__", "is_floating_point", "is_complex",
              "element_size", "get_device", "stride", "is_contiguous"):
    if hasattr(torch.Tensor, _name):
        _METADATA.add(getattr(torch.Tensor, _name))


# --- the rules: handler(func, args, kwargs) -> the deferred result, or NotImplemented (then the
# real logits and the stock call). Written once; both carriers read this table.

def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _record(func, args, kwargs, me):
    # the type first: under dynamic shapes a scale is a SymFloat, which dynamo cannot compare with
    # a plain object by identity (it raises NotImplementedError from the trace)
    return (func, tuple(_SELF if isinstance(a, type(me)) and a is me else a for a in args), kwargs)


def _h_contiguous(func, args, kwargs):
    return args[0] if isinstance(args[0], Deferred) else NotImplemented


def _h_cast_to(dtype, func, args, kwargs):
    """`float()`, `bfloat16()`, `half()`, `double()`: a cast to `dtype`."""
    me = args[0]
    if not isinstance(me, Deferred) or args[1:] or kwargs:
        return NotImplemented
    return me._derive(_record(func, args, kwargs, me), dtype=dtype)


def _h_type_as(func, args, kwargs):
    me = args[0]
    if not isinstance(me, Deferred) or len(args) != 2 or not isinstance(args[1], torch.Tensor) or kwargs:
        return NotImplemented
    if not args[1].dtype.is_floating_point:
        return NotImplemented
    return me._derive(_record(func, args, kwargs, me), dtype=args[1].dtype)


def _h_to(func, args, kwargs):
    """Tensor.to: to(dtype), to(device, dtype), to(tensor), dtype=/device= keywords, on the
    carrier's own device; a move to the same device without a dtype is the carrier itself."""
    me = args[0]
    if not isinstance(me, Deferred):
        return NotImplemented
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if set(kwargs) - {"dtype", "device", "non_blocking", "copy"} or kwargs.get("copy"):
        return NotImplemented
    for a in args[1:]:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            dtype, device = a.dtype, a.device
        else:
            return NotImplemented
    if device is not None:
        device = torch.device(device)
        if device.type != me.device.type or device.index not in (None, me.device.index):
            return NotImplemented
    if dtype is None:
        return me
    if not dtype.is_floating_point:
        return NotImplemented
    return me._derive(_record(func, args, kwargs, me), dtype=dtype)


def _h_scale(divide, func, args, kwargs):
    if kwargs.get("rounding_mode") is not None or len(args) != 2 or set(kwargs) - {"rounding_mode"}:
        return NotImplemented
    a, b = args
    if isinstance(a, Deferred) and _scalar(b):
        me, c = a, float(b)
    elif not divide and isinstance(b, Deferred) and _scalar(a):
        me, c = b, float(a)
    else:
        return NotImplemented
    if divide:
        if c == 0:
            return NotImplemented
        c = 1.0 / c
    call = _record(func, args, kwargs, me)
    if me._tanh:
        return me._derive(call, post=me._post * c)
    return me._derive(call, pre=me._pre * c)


def _h_tanh(func, args, kwargs):
    me = args[0]
    if not isinstance(me, Deferred) or me._tanh or len(args) != 1 or kwargs:
        return NotImplemented
    return me._derive(_record(func, args, kwargs, me), tanh=True)


def _shape_arg(args):
    shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list, torch.Size)) else args[1:]
    if not shape or not all(isinstance(s, int) for s in shape):
        return None
    return tuple(shape)


def _h_reshape(func, args, kwargs):
    me = args[0]
    if not isinstance(me, Deferred) or kwargs:
        return NotImplemented
    shape = _shape_arg(args)
    if shape is None or shape.count(-1) > 1 or any(s < -1 for s in shape):
        return NotImplemented
    shape, total = list(shape), me.numel()
    if -1 in shape:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if known == 0 or total % known:
            return NotImplemented
        shape[shape.index(-1)] = total // known
    size = 1
    for s in shape:
        size *= s
    if size != total or shape[-1] != me.shape[-1]:
        return NotImplemented  # only leading dims may be regrouped: the vocabulary dim stays last
    hidden = me._hidden.reshape(*shape[:-1], me._hidden.shape[-1])
    return me._derive(_record(func, args, kwargs, me), hidden=hidden, shape=torch.Size(shape))


def _h_getitem(func, args, kwargs):
    me, index = args
    if not isinstance(me, Deferred):
        return NotImplemented
    index = index if isinstance(index, tuple) else (index,)
    if any(not (isinstance(i, (int, slice)) and not isinstance(i, bool)) and i is not Ellipsis for i in index):
        return NotImplemented
    if index.count(Ellipsis) > 1:
        return NotImplemented
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (me.dim() - len(index) + 1) + index[at + 1:]
    if len(index) > me.dim():
        return NotImplemented
    if len(index) == me.dim():
        last = index[-1]
        if not (isinstance(last, slice) and last.start is None and last.stop is None and last.step is None):
            return NotImplemented  # the vocabulary dim is indexed: needs the values
        index = index[:-1]
    hidden = me._hidden[index + (slice(None),)]
    return me._derive(_record(func, args, kwargs, me), hidden=hidden,
                      shape=torch.Size((*hidden.shape[:-1], me.shape[-1])))


# F.cross_entropy's parameters, bound by hand: dynamo cannot read a Signature's mapping proxy
# once the trace has mutated a dict (the head's forward slot is one).
_CE_NAMES = tuple(inspect.signature(F.cross_entropy).parameters)


def _bound_cross_entropy(args, kwargs):
    """F.cross_entropy's arguments by name, or None when they do not bind."""
    if len(args) > len(_CE_NAMES) or any(k not in _CE_NAMES for k in kwargs):
        return None
    a = dict(zip(_CE_NAMES, args))
    for name, value in kwargs.items():
        if name in a:
            return None
        a[name] = value
    return a


def fusable_cross_entropy(a: dict):
    """(logits, target, ignore_index, reduction) when `F.cross_entropy` with the bound arguments
    `a` is one the fused kernel computes exactly (deferred logits, a real target), else None:
    stock cross-entropy then runs."""
    me, target = a.get("input"), a.get("target")
    if not isinstance(me, Deferred) or isinstance(target, Deferred) or not isinstance(target, torch.Tensor):
        return None
    if a.get("weight") is not None or a.get("size_average") is not None or a.get("reduce") is not None:
        return None
    if a.get("label_smoothing", 0.0) != 0.0 or me.dim() != 2 or target.shape != me.shape[:1]:
        return None
    if target.dtype not in (torch.int64, torch.int32) or target.device != me.device:
        return None
    reduction = a.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        return None
    return me, target, a.get("ignore_index", -100), reduction


def _h_cross_entropy(func, args, kwargs):
    a = _bound_cross_entropy(args, kwargs)
    fusable = None if a is None else fusable_cross_entropy(a)
    if fusable is None:
        return NotImplemented
    loss = fused_loss(*fusable)
    if loss is NotImplemented:
        return NotImplemented
    fusable[0]._head.count("fused")
    return loss


def fused_loss(me: Deferred, target, ignore_index: int, reduction: str):
    """F.cross_entropy(me, target) of the deferred logits, through the fused kernel; NotImplemented
    where stock decides (then the real logits and stock cross-entropy)."""
    from accel_kernels import fused_linear_cross_entropy

    head = me._head
    device_type, enabled, cast_to = head.autocast
    h, w, b = me._hidden, head.weight, head.bias
    compiling = sites.compiling()  # a compiled graph takes every row (static shapes) and reads no storage
    if w.dim() != 2 or sites.storage_freed(w):
        # A sharding engine freed or released it after the head's forward: never read it.
        raise RuntimeError(f"accel_patch: the LM head's weight {tuple(w.shape)} lost its storage before "
                           "the fused loss ran (a sharding engine released it); please report this")
    if enabled:
        h, w = h.to(cast_to), w.to(cast_to)
        b = b.to(cast_to) if b is not None else None
    elif h.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        return NotImplemented  # stock F.linear decides what happens (an error)
    if me._tanh:
        if not me._post > 0:
            return NotImplemented
        softcap, factor = me._post, me._pre * me._post  # post * tanh(pre z) = c tanh((pre c z) / c)
    else:
        softcap, factor = None, me._pre
    if compiling:
        rows, labels, keep = all_rows(h, target)
    else:
        rows, labels, keep = labelled_rows(h, target, ignore_index)
    if factor != 1.0:
        rows = rows * factor
        b = b * factor if b is not None else None
    with torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext():
        per_token = fused_linear_cross_entropy(rows, w, labels, bias=b, ignore_index=ignore_index,
                                               softcap=softcap, reduction="none" if reduction == "none" else "sum")
    if reduction == "none" and keep is not None:  # ignored positions: 0, as stock
        per_token = per_token.new_zeros(target.shape).masked_scatter(keep, per_token)
    if reduction == "mean":
        per_token = per_token / (target != ignore_index).sum()  # as stock: 0 tokens give NaN
    return per_token.to(me.dtype)


def labelled_rows(hidden, target, ignore_index: int):
    """(rows of `hidden` whose target is not ignore_index, their targets, the boolean mask kept).

    The eager form: ignored rows never reach the kernel's matmul, so half the labels ignored is
    about half the head's work and memory. Selecting them has a data-dependent shape (and syncs
    with the device once, for the count), which torch.compile cannot trace without a graph break:
    compiled code uses `all_rows` instead.
    """
    keep = target != ignore_index
    return hidden[keep], target[keep], keep


def all_rows(hidden, target):
    """The static-shape form of `labelled_rows` for torch.compile: every row, as they are.

    The kernel itself gives a row whose target is ignore_index zero loss and zero gradient, so
    the result equals the compacted one; the shapes depend only on the input's, never on the
    labels, so a compiled graph neither breaks nor recompiles on them. The ignored rows still
    cost their share of the matmul. Returns (hidden, target, None): nothing to scatter back.
    """
    return hidden, target, None


_HANDLERS = {
    torch.Tensor.contiguous: _h_contiguous,
    torch.Tensor.float: functools.partial(_h_cast_to, torch.float32),
    torch.Tensor.bfloat16: functools.partial(_h_cast_to, torch.bfloat16),
    torch.Tensor.half: functools.partial(_h_cast_to, torch.float16),
    torch.Tensor.double: functools.partial(_h_cast_to, torch.float64),
    torch.Tensor.to: _h_to, torch.Tensor.type_as: _h_type_as,
    torch.Tensor.__mul__: functools.partial(_h_scale, False), torch.Tensor.__rmul__: functools.partial(_h_scale, False),
    torch.Tensor.mul: functools.partial(_h_scale, False), torch.mul: functools.partial(_h_scale, False),
    torch.Tensor.__truediv__: functools.partial(_h_scale, True), torch.Tensor.div: functools.partial(_h_scale, True),
    torch.div: functools.partial(_h_scale, True), torch.true_divide: functools.partial(_h_scale, True),
    torch.Tensor.tanh: _h_tanh, torch.tanh: _h_tanh,
    torch.Tensor.view: _h_reshape, torch.Tensor.reshape: _h_reshape,
    torch.Tensor.__getitem__: _h_getitem,
    F.cross_entropy: _h_cross_entropy,
}
