"""The fused loss while torch.compile traces a swapped model: the head's logits are never built.

The eager path (deferred.py) hands the family's forward a `DeferredLogits` tensor subclass; dynamo
cannot trace a storage-less wrapper subclass made inside the graph. Here the head's linear layer
returns `LogitsStandIn` instead: a plain Python object (not a tensor) that dynamo follows as an
object of the trace. It is the other carrier of the same deferred form: its tensor methods and
operators go through the `__torch_function__` and the table of rules of deferred.py, and its head
call is deferred.py's `_Head`, so each rule is written once for both paths:

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
fails at every call, i.e. a recompile: the head call's state is None); the graph itself shows
what ran (tests/swaps/test_compile.py). What differs from eager is deferred.py's to decide, by
`torch.compiler.is_compiling()`: every row reaches the kernel (`all_rows`), and the weight's
storage is not read.
"""
from __future__ import annotations

import functools

import torch

from .. import sites
from .deferred import Deferred, _Head, deferred_head


class LogitsStandIn(Deferred):
    """The compile carrier: the head's logits, not computed, as a plain object dynamo traces.

    The form, the rules and the head call are deferred.py's, shared with `DeferredLogits`: each
    tensor method and operator below is that method's `__torch_function__` call on the stand-in,
    so it reads the same table. `shape` and `dtype` are attributes, the other metadata answers
    from them and the head's input.
    """

    def __init__(self, head: _Head, chain, hidden, shape, dtype, pre=1.0, tanh=False, post=1.0) -> None:
        self._head, self._chain, self._hidden = head, chain, hidden
        self.shape, self.dtype = torch.Size(shape), dtype
        self._pre, self._tanh, self._post = pre, tanh, post

    @property
    def computed(self) -> bool:
        return self._head.computed

    # --- metadata --------------------------------------------------------------------------
    @property
    def device(self):
        return self._hidden.device

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
        return self._hidden.requires_grad or self._head.weight.requires_grad

    def __len__(self) -> int:
        return self.shape[0]

    # --- everything else computes the logits -----------------------------------------------
    def __getattr__(self, name):
        if name.startswith("__") or name in ("_head", "_hidden", "shape", "dtype", "_chain", "_pre", "_tanh", "_post"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LogitsStandIn(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


def _tensor_method(name: str):
    func = getattr(torch.Tensor, name)

    def method(self, *args, **kwargs):
        return Deferred.__torch_function__(func, (), (self, *args), kwargs)

    method.__name__ = method.__qualname__ = name
    return method


# The tensor methods and operators families use on logits: through the shared rules (the deferred
# ones) or the real logits (the others: arithmetic families do not do before the loss).
for _name in ("contiguous", "float", "bfloat16", "half", "double", "to", "type_as", "mul", "div", "tanh",
              "view", "reshape", "__getitem__", "__mul__", "__rmul__", "__truediv__",
              "__add__", "__radd__", "__sub__", "__rsub__", "__neg__"):
    setattr(LogitsStandIn, _name, _tensor_method(_name))


def capture(module, *args, **kwargs):
    """The head's linear forward for one compiled fused call: a stand-in instead of the logits."""
    return deferred_head(LogitsStandIn, module, None, args, kwargs)


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
    fail that guard at every call, a recompile per step. Where the head's forward slot is empty (a
    plain linear layer), it gets an instance forward that runs the class's (`sites.class_forward`),
    so that `fused_call` puts a forward back rather than removing one: dynamo in torch 2.11 cannot
    trace removing an instance attribute (2.13 can)."""
    state.set(leaf, CAPTURE_ATTR, functools.partial(capture, leaf))
    slot = sites.forward_slot(leaf)
    if slot not in leaf.__dict__:
        state.set(leaf, slot, functools.partial(sites.class_forward, leaf))


def fused_call(model, leaf, args, kwargs):
    """The model's own forward with `leaf` (the head's linear layer) returning a stand-in, traced.
    The slot is rebound for the call only, with a functools.partial: dynamo cannot build a
    types.MethodType; it replays the slot's final state (as it was) after the graph."""
    forward = leaf.__dict__.get(CAPTURE_ATTR)
    if not (isinstance(forward, functools.partial) and forward.args[0] is leaf):
        forward = functools.partial(capture, leaf)  # a head copied after the swap: made per call
    bound = sites.bind_for_call(leaf, forward)
    try:
        output = sites.call_inner(model, *args, **kwargs)
    finally:
        sites.unbind(leaf, bound)
    return without_stand_in(output)
