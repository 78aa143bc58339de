"""The head of a swapped model's loss: which linear layer a training call fuses, decided per call.

A plain linear head is fused with its own weight; a PEFT `modules_to_save` copy with the copy's
weight; a LoRA adapter on the head (PEFT may add one after the swap) makes the call stand aside
and run stock, so the adapter trains. `capturing` binds, for one call, a forward on that linear
layer that returns `DeferredLogits` instead of computing them.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from . import sites
from .deferred import DeferredLogits, _Head

def _plain_linear(module) -> bool:
    if not isinstance(module, torch.nn.Linear) or type(module).forward is not torch.nn.Linear.forward:
        return False
    return type(module.weight) in (torch.nn.Parameter, torch.Tensor) and (
        module.bias is None or type(module.bias) in (torch.nn.Parameter, torch.Tensor))


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


def head_plan(head):
    """(the linear layer to fuse, None) for this call, or (None, why the call stands aside)."""
    if hasattr(head, "lora_A") and hasattr(head, "active_adapters"):
        adds = (not getattr(head, "disable_adapters", False) and not getattr(head, "merged", False)
                and any(a in head.lora_A for a in head.active_adapters))
        if adds:
            return None, "a LoRA adapter on the LM head (stock head, so the adapter trains)"
    leaf = head_leaf(head)
    if leaf is None:
        return None, f"LM head {type(head).__name__} is not a plain linear layer"
    return leaf, None


class capturing:
    """Bind a deferring forward on the head's linear layer for one call, then put back what was there."""

    def __init__(self, leaf, state) -> None:
        self.leaf, self.state = leaf, state

    def __enter__(self):
        leaf, state = self.leaf, self.state

        def capture(module, *args, **kwargs):
            hidden = sites.the_input(args, kwargs)
            head = _Head(hidden, module.weight, module.bias, state)
            if not head.autocast[1] and hidden.dtype != module.weight.dtype:
                return F.linear(hidden, module.weight, module.bias)  # stock, and its dtype error
            shape = torch.Size((*hidden.shape[:-1], module.weight.shape[0]))
            return DeferredLogits(head, (), hidden, shape, head.out_dtype())

        self.slot = sites.forward_slot(leaf)
        self.had = self.slot in leaf.__dict__
        self.previous = leaf.__dict__.get(self.slot)
        leaf.__dict__[self.slot] = types.MethodType(capture, leaf)

    def __exit__(self, *exc):
        if self.had:
            self.leaf.__dict__[self.slot] = self.previous
        else:
            self.leaf.__dict__.pop(self.slot, None)
        return False
