"""The LM head and its loss: in a training call with labels, `fused_linear_cross_entropy` on the
head's input instead of the full logits.

The model's own forward still runs, unchanged: whatever the family does around the loss (logit
soft-capping, scaling, label shifting, `num_items_in_batch`, an MoE auxiliary loss) happens as
stock. Only the head's linear layer is different for that call: it returns `DeferredLogits`, a
tensor that holds the head's input and weight instead of values. The few operations families apply
to logits before the loss (a cast, a scalar multiply or divide, `tanh`, a reshape, slicing leading
dims) stay deferred; `F.cross_entropy` on it runs the fused kernel, the head's input scaled and
soft-capped to match; any other operation computes the real logits first (stock values, stock
gradients), so nothing can be dropped silently. The call's output then carries `logits=None` when
the full logits were never built (they are, and are returned, when something needed them).

Decided at every call: the model must be in training mode, called with labels, with a plain linear
head; on CPU without Triton (the kernel's plain-torch twin) the logits must also be large
(`CPU_MIN_LOGITS`), since below that stock is faster. A LoRA adapter on the head (PEFT may add one after the swap) makes the call stand aside and
run stock, so the adapter trains; a `modules_to_save` copy of the head is fused with the copy's own
weight. Evaluation, calls without labels, and `generate` run the stock forward; a training call
without labels that builds a graph is counted (NO_LABELS), since the caller's own loss then runs
on the full logits; one with labels and `return_dict=False` too (TUPLE_OUTPUT): its tuple holds
the full logits. While torch.compile traces the call, the head returns
compiled_loss.LogitsStandIn instead (the same rules and head call, read from deferred.py; dynamo
traces it, it cannot trace the tensor subclass).

Here: the swapped model forward, the candidate test and the probe. The deferred tensor and the
fused loss on it live in deferred.py; which linear layer a call fuses, in head.py.
"""
from __future__ import annotations

import collections
import inspect

import torch
import torch.nn.functional as F

from .. import probe, sites
from . import compiled_loss
from .deferred import DeferredLogits, _Head
from .head import capturing, head_leaf, head_plan

OP = sites.LOSS_OP  # "fused_linear_cross_entropy"
#: A training call with a graph but no labels: the full logits are returned and the caller's own
#: loss runs on them (TRL's ORPO and CPO take log_softmax over them), so the fused loss did not run:
#: a fall-back, logged, and the swap line does not claim the loss (report.SwapReport.short).
NO_LABELS = "stock head: a training call without labels (the caller's own loss on the full logits)"
#: A training call with labels and `return_dict=False`: the tuple holds the full logits in their
#: place, so they are computed whatever the loss does and the call runs stock, counted as such.
TUPLE_OUTPUT = "stock head: return_dict=False (the tuple output holds the full logits)"


def _without_deferred(output):
    """The forward's output with deferred logits replaced: by the real ones if something computed
    them, else by None (removed from a ModelOutput, as transformers does for None fields)."""
    if isinstance(output, tuple):
        return type(output)(o.materialize() if isinstance(o, DeferredLogits) else o for o in output)
    if isinstance(output, collections.OrderedDict):  # transformers' ModelOutput
        for key, value in list(output.items()):
            if isinstance(value, DeferredLogits):
                if value._head.computed:
                    output[key] = value.materialize()
                else:
                    collections.OrderedDict.__delitem__(output, key)
                    object.__setattr__(output, key, None)
    return output


_labels_signature: dict[type, inspect.Signature] = {}


def _labels(model, args, kwargs):
    # keywords first, and the signature cached at swap time (candidate()): nothing here writes
    # state that a compiled call would guard on (a cache filled by the first call recompiles the next)
    if "labels" in kwargs:
        return kwargs["labels"]
    if not args:
        return None
    cls = type(model)
    signature = _labels_signature.get(cls)
    if signature is None:
        signature = _labels_signature[cls] = inspect.signature(cls.forward)
    try:
        return signature.bind(model, *args, **kwargs).arguments.get("labels")
    except TypeError:
        return None


#: On CPU without Triton the fused loss runs its plain-torch twin, which is slower than stock's
#: F.linear + F.cross_entropy while the logits are small (benchmarks/overhead.py, measured
#: 2026-12-01: 1.2x at 14-128 tokens x 32000, 0.5-0.8x from about 8M logits up). Below this many
#: logits (tokens x vocabulary; 32 MiB in float32) such a call runs stock; at and above it, fused.
CPU_MIN_LOGITS = 1 << 23


def _small_on_cpu(leaf, labels) -> bool:
    from accel_kernels import _dispatch

    return (isinstance(labels, torch.Tensor) and not _dispatch.use_triton(leaf.weight)
            and labels.numel() * leaf.weight.shape[0] < CPU_MIN_LOGITS)


def forward(self, *args, **kwargs):
    """The swapped model forward: the model's own forward, with the head deferred when it pays."""
    state = self.__dict__.get(sites.STATE_ATTR)
    if state is None or OP not in state.ops or not self.training or torch.jit.is_tracing():
        return sites.call_inner(self, *args, **kwargs)
    labels = _labels(self, args, kwargs)
    tuple_output = kwargs.get("return_dict") is False
    if labels is None or tuple_output:
        if torch.is_grad_enabled() and not sites.compiling():  # a graph the caller's loss uses
            state.count_call(TUPLE_OUTPUT if labels is not None else NO_LABELS)
        return sites.call_inner(self, *args, **kwargs)
    leaf, why = head_plan(self.get_output_embeddings())
    if leaf is not None and _small_on_cpu(leaf, labels):
        leaf, why = None, "small logits on CPU without Triton (stock is faster there)"
    if sites.compiling():  # dynamo traces this call: compiled_loss.py
        if leaf is None:
            return sites.call_inner(self, *args, **kwargs)
        return compiled_loss.fused_call(self, leaf, args, kwargs)
    if leaf is None:
        state.count_call(f"stood aside: {why}")
        return sites.call_inner(self, *args, **kwargs)
    with capturing(leaf, state):
        output = sites.call_inner(self, *args, **kwargs)
    return _without_deferred(output)


def candidate(model) -> str | None:
    """None when the model's head and loss can be fused; else why not."""
    signature = inspect.signature(type(model).forward)
    if "labels" not in signature.parameters:
        return "forward takes no labels"
    _labels_signature.setdefault(type(model), signature)
    head = model.get_output_embeddings()
    leaf = head_leaf(head)
    if leaf is None:
        return f"LM head {type(head).__name__} is not a plain linear layer (quantized or wrapped)"
    if type(leaf.weight) not in (torch.nn.Parameter, torch.Tensor):  # the probe needs the whole weight
        return f"LM head weight is a {type(leaf.weight).__name__} (sharded already): swap before sharding"
    return None


def probe_verdict(model):
    """True when the fused loss reproduces F.cross_entropy(head(h).float(), y) for this head."""
    from ..sites import SwapState

    leaf = head_leaf(model.get_output_embeddings())
    w = leaf.weight
    vocab, width = w.shape
    scratch = SwapState()
    with probe.probing(leaf):
        h = probe.randn((6, width), w.dtype, w.device)
        y = torch.randint(0, vocab, (6,), device=w.device)
        y[1] = -100
        ref = F.cross_entropy(F.linear(h, w, leaf.bias).float(), y)
        deferred = DeferredLogits(_Head(h, w, leaf.bias, scratch), (), h, torch.Size((6, vocab)), w.dtype)
        got = F.cross_entropy(deferred.float().view(-1, vocab), y)
    err = probe.rel_err(got.reshape(1), ref.reshape(1))
    limit = probe.bound(w.dtype)
    if scratch.loss_calls.get("fused") != 1 or err > limit:
        return f"fused loss differs from the stock loss on this head (relative error {err:.2e} > {limit:.1e})"
    return True
