"""Checks shared by the SwiGLU and GeGLU tests: both ops are act(gate) * up with one kernel skeleton."""
from __future__ import annotations

import torch

from _checks import assert_close


def forward_backward(fn, gate, up, dout):
    """fn(gate, up) and the grads of (out * dout).sum() wrt gate and up, on leaf copies of the inputs."""
    gate = gate.detach().requires_grad_(True)
    up = up.detach().requires_grad_(True)
    out = fn(gate, up)
    out.backward(dout)
    return out.detach(), gate.grad, up.grad


def check_against_float64(op, eager, gate, up, dout):
    """op's output and both grads against eager in float64, with the dtype-following bound."""
    dtype = gate.dtype
    got = forward_backward(op, gate, up, dout)
    ref = forward_backward(eager, gate.double(), up.double(), dout.double())
    stock = forward_backward(eager, gate, up, dout) if dtype != torch.float32 else (None,) * 3
    for what, g, r, s in zip(("output", "grad of gate", "grad of up"), got, ref, stock):
        assert g.dtype == dtype and g.shape == gate.shape, what
        assert_close(g, r, dtype, stock=s, what=what)


def saved_bytes(fn, gate, up) -> int:
    """Bytes of distinct storages autograd keeps for backward while building fn(gate, up)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    gate = gate.detach().requires_grad_(True)
    up = up.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(gate, up)
    out.sum().backward()  # what was saved must still be enough for backward
    return sum(storages.values())
