"""The head of a swapped model's loss: which linear layer a training call fuses, decided per call.

A plain linear head is fused with its own weight; a PEFT `modules_to_save` copy with the copy's
weight; a LoRA adapter on the head (PEFT may add one after the swap) makes the call stand aside
and run stock, so the adapter trains. `capturing` binds, for one call, a forward on that linear
layer that returns `DeferredLogits` instead of computing them.

Under sharding engines the fused loss reads the head's weight after the head's own forward has
returned, so the weight must still be whole then (`head_weight_for_loss`):

- FSDP2 (`fully_shard`) or FSDP1 with the head in the root's unit (the usual wrapping: each decoder
  layer, then the model): the root unshards its parameters before the model's forward runs and
  keeps them through it (FSDP2 does not reshard the root after forward; the fused kernel keeps
  the weight's gradient, not the weight, for backward), so the head's weight is a whole, plain
  tensor for the whole call: fused. Gradients reach the unsharded parameter as in stock and FSDP
  reduce-scatters them.
- The head in its own FSDP2 unit that keeps its parameters unsharded after forward
  (`reshard_after_forward=False`: accelerate 1.15 carves [final norm, lm_head] into such a "tail"
  unit): a DTensor when the model's forward starts, whole from the head's forward until backward:
  fused (the capture sees the unsharded parameter).
- The head in its own FSDP2 unit that reshards after forward (the default for a non-root unit):
  its storage is freed right after the head's forward, before the loss: the call stands aside
  (stock head), with the reason counted.
- DeepSpeed ZeRO-3: a partitioned parameter (`ds_id`, `ds_status`; its `.data` empty outside the
  module's forward, released by ZeRO-3 right after it): the call stands aside (stock head, which
  ZeRO-3 gathers for its forward and again for its backward), with the reason counted. Gathering it
  ourselves (`GatheredParameters`) would hand ZeRO-3 a gradient for a parameter it has released.
"""
from __future__ import annotations

import types

import torch

from .. import sites
from .deferred import DeferredLogits, deferred_head

def _fsdp2_kept_whole(module) -> bool:
    """True when `module` is in an FSDP2 unit that keeps its parameters unsharded from its forward
    until backward (reshard_after_forward=False, or the root's default). Reads FSDP2's state:
    `_fsdp_param_groups` (torch 2.13) or `_fsdp_param_group` (earlier 2.x); anything else: False."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return False
    try:
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        return bool(groups) and all(g.post_forward_mesh_info is None for g in groups)
    except Exception:  # FSDP2's internals moved: stand aside rather than guess
        return False


def _plain_linear(module) -> bool:
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        return False
    plain = (torch.nn.Parameter, torch.Tensor)
    weight_ok = type(module.weight) in plain or (sites.is_dtensor(module.weight) and _fsdp2_kept_whole(module))
    return weight_ok and (module.bias is None or type(module.bias) in plain or sites.is_dtensor(module.bias))


def head_leaf(head):
    """The linear layer `head` computes with, looking through PEFT's wrappers; None if not plain."""
    if head is None:
        return None
    if _plain_linear(head):
        return head
    if hasattr(head, "lora_A") and hasattr(head, "get_base_layer"):
        return head_leaf(head.get_base_layer())
    if hasattr(head, "modules_to_save") and hasattr(head, "original_module"):
        active = list(getattr(head, "active_adapters", []) or [])
        if getattr(head, "disable_adapters", False) or not active or active[0] not in head.modules_to_save:
            return head_leaf(head.original_module)
        return head_leaf(head.modules_to_save[active[0]])
    return None


def _sharded(weight, module=None) -> str | None:
    """Why `weight` (of `module`) cannot be read whole for the loss, else None."""
    if hasattr(weight, "ds_id"):
        return ("LM head weight is a DeepSpeed ZeRO-3 partition (released outside the head's forward; "
                "stock head, which ZeRO-3 gathers)")
    if sites.is_dtensor(weight):
        if module is not None and _fsdp2_kept_whole(module):
            return None  # unsharded by the head's own forward and kept until backward
        return ("LM head weight is an FSDP2 shard (DTensor) that its unit reshards right after the "
                "head's forward, before the loss; stock head")
    try:
        if sites.storage_freed(weight):
            return "LM head weight has no storage here (freed by a sharding engine); stock head"
    except (RuntimeError, NotImplementedError):
        return f"LM head weight of type {type(weight).__name__} has no readable storage; stock head"
    return None


def head_weight_for_loss(leaf):
    """(the weight the fused loss may read for this call, None), or (None, why the call stands
    aside): a ZeRO-3 partition, an FSDP2 shard or a freed storage is never read."""
    weight = getattr(leaf, "weight", None)
    if weight is None:
        return None, "LM head has no weight"
    why = _sharded(weight, leaf)
    return (None, why) if why else (weight, None)


def head_plan(head):
    """(the linear layer to fuse, None) for this call, or (None, why the call stands aside)."""
    weight = getattr(head, "weight", None)
    why = _sharded(weight, head) if isinstance(weight, torch.Tensor) else None
    if why:  # before the plain-linear test, for the reason
        return None, why
    if hasattr(head, "lora_A") and hasattr(head, "active_adapters"):
        adds = (not getattr(head, "disable_adapters", False) and not getattr(head, "merged", False)
                and any(a in head.lora_A for a in head.active_adapters))
        if adds:
            return None, "a LoRA adapter on the LM head (stock head, so the adapter trains)"
    leaf = head_leaf(head)
    if leaf is None:
        return None, f"LM head {type(head).__name__} is not a plain linear layer"
    _, why = head_weight_for_loss(leaf)
    return (None, why) if why else (leaf, None)


class capturing:
    """Bind a deferring forward on the head's linear layer for one call, then put back what was there."""

    def __init__(self, leaf, state) -> None:
        self.leaf, self.state = leaf, state

    def __enter__(self):
        leaf, state = self.leaf, self.state

        def capture(module, *args, **kwargs):
            return deferred_head(DeferredLogits, module, state, args, kwargs)

        self.bound = sites.bind_for_call(leaf, types.MethodType(capture, leaf))

    def __exit__(self, *exc):
        sites.unbind(self.leaf, self.bound)
        return False
