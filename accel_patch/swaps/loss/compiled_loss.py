"""The fused loss while torch.compile traces a swapped model: the head's logits are never built.

The eager path (deferred.py) hands the family's forward a `DeferredLogits` tensor subclass; dynamo
cannot trace a storage-less wrapper subclass made inside the graph. Here the head's linear layer
returns `LogitsStandIn` instead: a plain Python object (not a tensor) that dynamo follows as an
object of the trace. It obeys the same rules as the eager path:

- a cast (`float()`, `to(dtype)`, `type_as`), a scalar multiply or divide (Granite divides by
  `logits_scaling`, Cohere multiplies by `logit_scale`), `torch.tanh` (Gemma2/3's final-logit
  soft-capping as `c * tanh(z / c)`), `contiguous`, reshapes of the leading dims and slicing of
  them stay deferred, as `post * tanh(pre * z)` (or `pre * z`) of the head output z, with the
  scalars known while tracing (dynamo guards on them, as on any config value);
- `F.cross_entropy` on it (transformers' `ForCausalLMLoss` -> `fixed_cross_entropy`, so
  `num_items_in_batch`, `shift_labels` and `ignore_index` are the family's own code) runs
  `accel_kernels.fused_linear_cross_entropy` (the graph node `torch.ops.accel_kernels.
  fused_linear_cross_entropy`) on the head's input, scaled and soft-capped to match, with the
  head's own weight (tied weights get the gradient through it) and bias;
- anything else (a custom loss function, an op with no deferred form) computes the real logits
  first, replaying every recorded call: stock values and gradients, and the logits are returned.

The model's output carries `logits=None` when the logits were never built, as in eager. An MoE
auxiliary loss is added by the family's forward to the fused loss, as stock. Calls are not counted
in `SwapState.loss_calls` under compile (a count read and written per call would be a guard that
fails at every call, i.e. a recompile); the graph itself shows what ran (tests/swaps/test_compile.py).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F

from .. import sites
from .deferred import fusable_cross_entropy, materialized

_DTYPE_METHODS = {"float": torch.float32, "bfloat16": torch.bfloat16, "half": torch.float16, "double": torch.float64}


def _scalar(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _HeadCall:
    """F.linear(hidden, weight, bias) under the autocast state of the call, computed at most once."""

    def __init__(self, hidden, weight, bias) -> None:
        self.hidden, self.weight, self.bias = hidden, weight, bias
        device_type = hidden.device.type
        self.device_type = device_type
        self.autocast = torch.is_autocast_enabled(device_type)
        self.autocast_dtype = torch.get_autocast_dtype(device_type) if self.autocast else None
        self.real = None

    def logits(self):
        if self.real is None:
            self.real = F.linear(self.hidden, self.weight, self.bias)  # under the caller's autocast, as stock
        return self.real

    def out_dtype(self) -> torch.dtype:
        return self.autocast_dtype if self.autocast else self.weight.dtype


class LogitsStandIn:
    """The head's logits, not computed: `post * tanh(pre * z)` (or `pre * z`) of z = head(hidden).

    `hidden` has this stand-in's leading shape; `chain` holds the calls to replay on the real
    logits when something needs their values.
    """

    def __init__(self, head: _HeadCall, hidden, shape, dtype, chain=(), pre=1.0, capped=False, post=1.0) -> None:
        self.head, self.hidden, self.shape, self.dtype = head, hidden, torch.Size(shape), dtype
        self.chain, self.pre, self.capped, self.post = chain, pre, capped, post

    def _derive(self, call, **changes):
        fields = dict(hidden=self.hidden, shape=self.shape, dtype=self.dtype, pre=self.pre, capped=self.capped,
                      post=self.post)
        fields.update(changes)
        return LogitsStandIn(self.head, chain=self.chain + (call,), **fields)

    def materialize(self) -> torch.Tensor:
        """The real logits: the head's output with every recorded call replayed on it, as stock."""
        x = self.head.logits()
        for name, args, kwargs in self.chain:
            x = _replay(x, name, args, kwargs)
        return x

    @property
    def computed(self) -> bool:
        return self.head.real is not None

    # --- metadata --------------------------------------------------------------------------
    @property
    def device(self):
        return self.hidden.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim=None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return True

    @property
    def requires_grad(self) -> bool:
        return self.hidden.requires_grad or self.head.weight.requires_grad

    # --- what stays deferred ---------------------------------------------------------------
    def contiguous(self, *args, **kwargs):
        return self

    def float(self):
        return self._derive(("float", (), {}), dtype=torch.float32)

    def bfloat16(self):
        return self._derive(("bfloat16", (), {}), dtype=torch.bfloat16)

    def half(self):
        return self._derive(("half", (), {}), dtype=torch.float16)

    def double(self):
        return self._derive(("double", (), {}), dtype=torch.float64)

    def type_as(self, other):
        if isinstance(other, torch.Tensor) and other.dtype.is_floating_point:
            return self._derive(("to", (other.dtype,), {}), dtype=other.dtype)
        return self.materialize().type_as(other)

    def to(self, *args, **kwargs):
        dtype, device = kwargs.get("dtype"), kwargs.get("device")
        plain = not (set(kwargs) - {"dtype", "device", "non_blocking"})
        for a in args:
            if isinstance(a, torch.dtype):
                dtype = a
            elif isinstance(a, (str, torch.device)):
                device = a
            elif isinstance(a, torch.Tensor):
                dtype, device = a.dtype, a.device
            else:
                plain = False
        if device is not None:
            device = torch.device(device)
            plain = plain and device.type == self.device.type and device.index in (None, self.device.index)
        if not plain or (dtype is not None and not dtype.is_floating_point):
            return self.materialize().to(*args, **kwargs)
        if dtype is None:
            return self
        return self._derive(("to", (dtype,), {}), dtype=dtype)

    def _scale(self, name, c, divide):
        if not _scalar(c) or (divide and c == 0):
            return _fallback(name, self, c)
        c = 1.0 / float(c) if divide else float(c)
        call = ("mul", (c,), {})
        return self._derive(call, post=self.post * c) if self.capped else self._derive(call, pre=self.pre * c)

    def __mul__(self, c):
        return self._scale("__mul__", c, False)

    def __rmul__(self, c):
        return self._scale("__rmul__", c, False)

    def mul(self, c):
        return self._scale("mul", c, False)

    def __truediv__(self, c):
        return self._scale("__truediv__", c, True)

    def div(self, c, rounding_mode=None):
        if rounding_mode is not None:
            return self.materialize().div(c, rounding_mode=rounding_mode)
        return self._scale("div", c, True)

    def tanh(self):
        if self.capped:
            return self.materialize().tanh()
        return self._derive(("tanh", (), {}), capped=True)

    def view(self, *shape):
        return self._reshape("view", shape)

    def reshape(self, *shape):
        return self._reshape("reshape", shape)

    def _reshape(self, name, shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        if not shape or not all(isinstance(s, int) for s in shape) or shape.count(-1) > 1 or any(s < -1 for s in shape):
            return _fallback(name, self, *shape)
        shape, total = list(shape), self.numel()
        if -1 in shape:
            known = 1
            for s in shape:
                known *= s if s != -1 else 1
            if known == 0 or total % known:
                return _fallback(name, self, *shape)
            shape[shape.index(-1)] = total // known
        size = 1
        for s in shape:
            size *= s
        if size != total or shape[-1] != self.shape[-1]:
            return _fallback(name, self, *shape)  # only leading dims may be regrouped
        hidden = self.hidden.reshape(*shape[:-1], self.hidden.shape[-1])
        return self._derive(("reshape", (tuple(shape),), {}), hidden=hidden, shape=torch.Size(shape))

    def __getitem__(self, index):
        full = index if isinstance(index, tuple) else (index,)
        if any(not (isinstance(i, (int, slice)) and not isinstance(i, bool)) and i is not Ellipsis for i in full):
            return _fallback("__getitem__", self, index)
        if full.count(Ellipsis) > 1:
            return _fallback("__getitem__", self, index)
        if Ellipsis in full:
            at = full.index(Ellipsis)
            full = full[:at] + (slice(None),) * (self.dim() - len(full) + 1) + full[at + 1:]
        if len(full) > self.dim():
            return _fallback("__getitem__", self, index)
        if len(full) == self.dim():
            last = full[-1]
            if not (isinstance(last, slice) and last.start is None and last.stop is None and last.step is None):
                return _fallback("__getitem__", self, index)  # the vocabulary dim is indexed
            full = full[:-1]
        hidden = self.hidden[full + (slice(None),)]
        return self._derive(("getitem", (full + (slice(None),),), {}), hidden=hidden,
                            shape=torch.Size((*hidden.shape[:-1], self.shape[-1])))

    # --- everything else computes the logits -----------------------------------------------
    def __getattr__(self, name):
        if name.startswith("__") or name in ("head", "hidden", "shape", "dtype", "chain", "pre", "capped", "post"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            loss = _cross_entropy(args, kwargs)
            if loss is not NotImplemented:
                return loss
        elif func in (torch.tanh, torch.Tensor.tanh) and len(args) == 1 and not kwargs:
            return args[0].tanh()
        elif func in (torch.mul, torch.Tensor.mul) and len(args) == 2 and not kwargs:
            a, b = args
            return a.mul(b) if isinstance(a, LogitsStandIn) else b.mul(a)
        elif func in (torch.div, torch.true_divide, torch.Tensor.div) and len(args) == 2 and not kwargs:
            if isinstance(args[0], LogitsStandIn):
                return args[0].div(args[1])
        return func(*_real(args), **_real(kwargs))

    # arithmetic the families do not do before the loss: the real logits
    def __add__(self, other):
        return self.materialize() + _real(other)

    def __radd__(self, other):
        return _real(other) + self.materialize()

    def __sub__(self, other):
        return self.materialize() - _real(other)

    def __rsub__(self, other):
        return _real(other) - self.materialize()

    def __neg__(self):
        return -self.materialize()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LogitsStandIn(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _replay(x, name, args, kwargs):
    if name == "getitem":
        return x[args[0]]
    if name == "reshape":
        return x.reshape(args[0])
    if name == "mul":
        return x * args[0]
    return getattr(x, name)(*args, **kwargs)


def _real(obj):
    return materialized(obj, LogitsStandIn)


def _fallback(name, me, *args):
    return getattr(me.materialize(), name)(*_real(args))


# F.cross_entropy's parameters, bound by hand: dynamo cannot read a Signature's mapping proxy
# once the trace has mutated a dict (the head's forward slot is one).
_CE_NAMES = tuple(inspect.signature(F.cross_entropy).parameters)


def _cross_entropy(args, kwargs):
    """F.cross_entropy of a stand-in through the fused kernel, or NotImplemented (then stock)."""
    if len(args) > len(_CE_NAMES) or any(k not in _CE_NAMES for k in kwargs):
        return NotImplemented
    a = dict(zip(_CE_NAMES, args))
    for name, value in kwargs.items():
        if name in a:
            return NotImplemented
        a[name] = value
    fusable = fusable_cross_entropy(a, LogitsStandIn)
    return NotImplemented if fusable is None else fused_loss(*fusable)


def fused_loss(me: LogitsStandIn, target, ignore_index: int, reduction: str):
    """F.cross_entropy(me, target) of the stand-in's logits, through the fused kernel."""
    from accel_kernels import fused_linear_cross_entropy

    head = me.head
    h, w, b = me.hidden, head.weight, head.bias
    if head.autocast:
        cast_to = head.autocast_dtype
        h, w = h.to(cast_to), w.to(cast_to)
        b = b.to(cast_to) if b is not None else None
    elif h.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
        return F.cross_entropy(me.materialize(), target, ignore_index=ignore_index, reduction=reduction)
    if me.capped:
        if not me.post > 0:
            return F.cross_entropy(me.materialize(), target, ignore_index=ignore_index, reduction=reduction)
        softcap, factor = me.post, me.pre * me.post  # post * tanh(pre z) = c tanh((pre c z) / c)
    else:
        softcap, factor = None, me.pre
    if factor != 1.0:
        h = h * factor
        b = b * factor if b is not None else None
    with torch.autocast(head.device_type, enabled=False) if head.autocast else contextlib.nullcontext():
        per_token = fused_linear_cross_entropy(h, w, target, bias=b, ignore_index=ignore_index, softcap=softcap,
                                               reduction="none" if reduction == "none" else "sum")
    if reduction == "mean":
        per_token = per_token / (target != ignore_index).sum()  # as stock: 0 tokens give NaN
    return per_token.to(me.dtype)


def capture(module, *args, **kwargs):
    """The head's linear forward for one compiled fused call: a stand-in instead of the logits."""
    hidden = sites.the_input(args, kwargs)
    head = _HeadCall(hidden, module.weight, module.bias)
    if not head.autocast and hidden.dtype != module.weight.dtype:
        return F.linear(hidden, module.weight, module.bias)  # stock, and its dtype error
    shape = (*hidden.shape[:-1], module.weight.shape[0])
    return LogitsStandIn(head, hidden, shape, head.out_dtype())


def without_stand_in(output):
    """The forward's output with stand-ins replaced: by the real logits if something computed
    them, else by None (the field stays in a ModelOutput, set to None: deleting a key of the output
    inside the trace is one more dict mutation dynamo would have to replay)."""
    if isinstance(output, tuple):
        return type(output)(o.materialize() if isinstance(o, LogitsStandIn) else o for o in output)
    for key in [k for k, v in output.items() if isinstance(v, LogitsStandIn)]:
        value = output[key]
        output[key] = value.materialize() if value.computed else None
    return output


#: Attribute of the head's linear layer holding its capturing forward, made at swap time.
CAPTURE_ATTR = "_accel_patch_compiled_capture"


def prepare(state, leaf) -> None:
    """At swap time: the head's capturing forward, made once (recorded in `state`, undone at
    restore). Where a graph break falls inside the model's forward (stock Mixtral's router-logit
    capture has one), dynamo guards on the identity of the head's forward: one made per call would
    fail that guard at every call, a recompile per step."""
    state.set(leaf, CAPTURE_ATTR, functools.partial(capture, leaf))


def fused_call(model, leaf, args, kwargs):
    """The model's own forward with `leaf` (the head's linear layer) returning a stand-in, traced.
    The slot is rebound for the call only, with a functools.partial: dynamo cannot build a
    types.MethodType; it replays the slot's final state (as it was) after the graph."""
    slot = sites.forward_slot(leaf)
    had = slot in leaf.__dict__
    previous = leaf.__dict__.get(slot)
    forward = leaf.__dict__.get(CAPTURE_ATTR)
    if not (isinstance(forward, functools.partial) and forward.args[0] is leaf):
        forward = functools.partial(capture, leaf)  # a head copied after the swap: made per call
    leaf.__dict__[slot] = forward
    try:
        output = sites.call_inner(model, *args, **kwargs)
    finally:
        if had:
            leaf.__dict__[slot] = previous
        else:
            del leaf.__dict__[slot]
    return without_stand_in(output)
