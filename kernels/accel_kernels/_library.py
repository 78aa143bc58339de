"""The torch.library side of the ops: every op is a custom op in the namespace `accel_kernels`.

Each op module registers, in its "torch.library ops" section, a forward op and the backward op(s)
its autograd formula calls (`torch.ops.accel_kernels.rms_norm`, `.rms_norm_backward`, `.layer_norm`, `.layer_norm_backward`, `.rope`,
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
alias inputs and have the strides the fake implementations promise: contiguous, but for RoPE's,
which an argument may lay out with dims 1 and 2 swapped in memory (`ops/rope.py`: the layout a
function of the arguments, never of the inputs' strides, which Inductor does not hand the fake as
the real call gets them); an output an op does not need is an empty (0,) tensor, never None.

float64 calls of rms_norm and rope do not go through the ops: they run the module's formula in
plain differentiable torch, so that second derivatives through them stay exact (a custom op's
backward is opaque to autograd; every registered backward refuses create_graph=True, see
`_dispatch.check_first_order`).

Eager calls go around the op (`Op.__call__`). Through the custom-op boundary one call of a norm,
RoPE or GLU cost 130-250 us of host work forward + backward (benchmarks/overhead.py, launches
stubbed: dispatcher redispatch, `fill_defaults`, the alias check of every output, the generated
autograd Function, the same again for the backward op), several times a small kernel's GPU time.
So the op is what the compiler sees, and only it: under `torch.compiler.is_compiling()` (dynamo
folds it to True) the public functions call `torch.ops.accel_kernels.<op>`, one graph node each;
in eager they call the same implementation directly, in the dispatch state an op's kernel runs in
(`below_op`: autograd's keys excluded, autocast as the caller has it, as through the op: the
tests compare both under bf16 autocast bit for bit),
inside a plain `torch.autograd.Function` whose setup and backward are the op's registered formula,
and whose backward calls the backward op's implementation directly too (`Op.backward_call`: by a
flag on ctx, since AOTAutograd traces the registered formula with `is_compiling()` False on torch
2.11). The op path stays for: compiling, an active TorchDispatchMode (FlopCounterMode, opcheck,
make_fx: they must see one op), functorch transforms, and tensor subclasses (DTensor...), whose
dispatch the op gives.
Launch recording, capture, the allocator hooks, float64 and every check of the public functions
are the same code on both paths.
"""
from __future__ import annotations

import contextlib
import inspect

import torch

NAMESPACE = "accel_kernels"


def custom_op(name: str, used: int | None = None):
    """Decorator: the function becomes the `Op` `torch.ops.accel_kernels.<name>` (no input mutated).

    used: how many leading outputs of a tuple the public function reads (the rest are for the
    backward: rstd, lse, ...); a direct call returns only those (`Op.register_autograd`)."""
    return lambda impl: Op(name, impl, used)


class Op:
    """One kernel's custom op (what the compiler sees) and its direct eager call (module docstring).

    `register_fake` and `register_autograd` register on the op (the same signatures as
    torch.library's); calling the Op runs it: `op(*args)` with every schema argument positional,
    defaults at the end may be left out.
    """

    def __init__(self, name: str, impl, used: int | None = None):
        self.name, self.impl, self.used = name, impl, used
        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=())(impl)
        params = list(inspect.signature(impl).parameters.values())
        self._n_params = len(params)
        self._defaults = tuple(p.default for p in params if p.default is not inspect.Parameter.empty)
        # the positions whose schema type is a tensor (or an optional one): the ones checked per call
        self._tensor_positions = tuple(i for i, p in enumerate(params) if "Tensor" in str(p.annotation))
        self._apply = None
        self.node_type = None
        self.__doc__ = impl.__doc__

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def register_autograd(self, backward, *, setup_context):
        self.op.register_autograd(backward, setup_context=setup_context)
        impl, used = self.impl, self.used

        # the op's formula (its setup_context and backward) on a plain Function; setup_context is
        # called from forward, as torch's own Function for the op does: a Function that defines
        # setup_context binds its arguments with inspect.signature on every call (15 us). The
        # outputs only the backward reads are not the Function's (`used`): each output costs the
        # node about a microsecond, and the backward formula is called without their gradients.
        def forward(ctx, *args):
            with below_op():
                output = impl(*args)
                ctx.direct = True  # its backward calls the backward ops' implementations directly
                setup_context(ctx=ctx, inputs=args, output=output)
            return output if used is None else output[:used]

        function = type(f"{self.name}_direct", (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward)})
        # Function.apply's C half: its Python half binds defaults and unwraps functorch's dead
        # wrappers (3 us), neither of which a call from `__call__` has (`__call__` sends functorch
        # to the op)
        self._apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
        # the type of the autograd node a direct call makes (its ctx): what `grad_fn` of an output is
        self.node_type = function._backward_cls

    def _eager(self, args: tuple) -> bool:
        """Whether this call may go around the op: not compiling, no TorchDispatchMode or functorch
        transform active, plain tensors only."""
        if torch.compiler.is_compiling() or _dispatch_modes() or _functorch_active():
            return False
        n = len(args)
        for i in self._tensor_positions:
            if i < n:
                t = args[i]
                if t is not None and (type(t) not in _PLAIN or _functorch_wrapped(t)):
                    return False
        return True

    def __call__(self, *args):
        if not self._eager(args):
            return getattr(torch.ops.accel_kernels, self.name)(*args)
        if self._apply is not None and torch.is_grad_enabled() and _any_requires_grad(*args):
            n = len(args)  # the defaults left out, added back: the Function takes every argument
            return self._apply(*(args + self._defaults[n - self._n_params:] if n < self._n_params else args))
        with below_op():  # nothing to differentiate: the implementation alone
            return self.impl(*args)

    def backward_call(self, ctx, *args):
        """The backward op called from a forward op's autograd formula: its implementation
        directly when the formula runs for the direct Function (`ctx.direct`), else the op."""
        if direct(ctx):
            with below_op():
                return self.impl(*args)
        return getattr(torch.ops.accel_kernels, self.name)(*args)


def direct(ctx) -> bool:
    """Whether an autograd formula runs for the direct Function (the forward was eager on plain
    tensors) and outside a trace (compiled autograd may trace the formula): then its backward may
    call implementations directly, and may do what the op's schema could not declare."""
    return getattr(ctx, "direct", False) and not torch.compiler.is_compiling()


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_functorch_active = torch._C._are_functorch_transforms_active
_dispatch_modes = torch._C._len_torch_dispatch_stack
_any_requires_grad = torch._C._any_requires_grad


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


def below_op():
    """Context manager: the dispatch state an op's implementation runs in, for the implementation
    called directly: autograd's keys excluded (torch's own `_AutoDispatchBelowAutograd`, the guard
    around the op's redispatch). Autocast stays as the caller has it, as it does inside an eager
    op: no autocast kernel is registered for our ops, so its key falls through (torch 2.13 and
    2.11, CPU: `torch.mm` in an op's implementation under bf16 autocast gives bf16). A C++ guard:
    under a microsecond."""
    return torch._C._AutoDispatchBelowAutograd()


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
