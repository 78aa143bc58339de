"""The torch.library side of the ops: every op is a custom op in the namespace `accel_kernels`.

Each op module registers, in its "torch.library ops" section, a forward op and the backward op(s)
its autograd formula calls (`torch.ops.accel_kernels.rms_norm`, `.rms_norm_backward`, `.rope`,
`.rope_backward`, `.glu`, `.glu_backward`, `.cross_entropy`, `.cross_entropy_backward`,
`.fused_linear_cross_entropy`, `.fused_linear_cross_entropy_backward`, `.moe_experts`,
`.moe_experts_backward`), each with a fake (meta)
implementation (`register_fake`: output shapes, dtypes and strides from the inputs' alone) and,
for the forward ops, an autograd formula (`register_autograd`: setup_context saves what the
backward op needs; backward calls it). Dynamo and AOTAutograd therefore see one node per op and
never trace into a kernel, so `torch.compile(fullgraph=True)` never breaks the graph on one.

Why `torch.library.custom_op` and not `triton_op` + `wrap_triton`: triton_op makes Inductor trace
the implementation's host code at compile time. Ours does at run time what tracing would freeze
or lose: the choice between Triton and the plain-torch twin (an argument `triton_path`, decided
by the public function from the tensors), the device guard and `_launch.recording()` of every
launch, the outputs' allocator that tests poison, the CPU range check of labels, and launches
under Triton's CPU interpreter (which Inductor cannot emit). An opaque custom op keeps all of
that. custom_op, register_fake, register_autograd and opcheck have had this API since torch 2.4,
so torch 2.11 (the GPU image) and 2.13 take the same code (tested here on 2.13; no 2.11 wheel on
the CPU machine). The cost: Inductor cannot fuse into or around our kernels, which are fused
already.

Schemas take tensors, bool, int, float, str, Optional of those and torch.dtype: options travel as
those (casting mode and reduction as str, softcap as float?, ignore_index as int). Outputs never
alias inputs and have the strides the fake implementations promise (contiguous); an output an op
does not need is an empty (0,) tensor, never None.

float64 calls of rms_norm and rope do not go through the ops: they run the module's formula in
plain differentiable torch, so that second derivatives through them stay exact (a custom op's
backward is opaque to autograd; every registered backward refuses create_graph=True, see
`_dispatch.check_first_order`).
"""
from __future__ import annotations

import contextlib

import torch

NAMESPACE = "accel_kernels"


def custom_op(name: str):
    """Decorator: the function becomes the op `torch.ops.accel_kernels.<name>` (no input mutated)."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())


def nothing(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (0,)-shaped tensor an op returns in place of an output it was not asked for."""
    return like.new_empty((0,), dtype=dtype or like.dtype)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for device_type, None when autocast is off (schema-able form of
    `_dispatch.autocast_state`)."""
    from . import _dispatch

    state = _dispatch.autocast_state(device_type)
    return state[2] if state is not None and state[1] else None


def autocast_state(device_type: str, dtype: torch.dtype | None):
    """`_dispatch.autocast_state` back from `autocast_dtype`'s value."""
    return None if dtype is None else (device_type, True, dtype)


_KEYS = torch._C.DispatchKey
# What a custom op's kernel runs without (torch excludes them below its autograd kernel) and
# autograd_inside switches back on: autograd. Autocast is excluded there too and stays so: an
# excluded autocast key is how torch spells autocast off, so switching it back on would turn
# autocast on whatever the caller had (on CUDA, float32 from float16 pow and rsqrt); a twin replays
# the caller's autocast from the dtype its op was given (`autocast_state`, `_dispatch.autocast_as`).
_BELOW_OP_EXCLUDED = [_KEYS.AutogradFunctionality, _KEYS.AutogradOther, _KEYS.AutogradNestedTensor]


@contextlib.contextmanager
def autograd_inside():
    """Inside an op's implementation: autograd works as outside it, for the block; autocast stays
    off unless the twin replays the caller's (`_dispatch.autocast_as`).

    A twin that gets eager's gradients bit for bit by differentiating the module's formula with
    torch.autograd.grad needs them; torch.func.vjp would bring its own, but its wrapper tensors
    break under any TorchDispatchMode (FlopCounterMode, opcheck's checks). Private dispatcher API
    (torch._C._dispatch_tls_is/set_dispatch_key_excluded, unchanged for years; used here on
    torch 2.13); the previous state is restored on exit.
    """
    was = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _BELOW_OP_EXCLUDED]
    for key in _BELOW_OP_EXCLUDED:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, excluded in zip(_BELOW_OP_EXCLUDED, was):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)
