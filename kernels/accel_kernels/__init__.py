"""accel_kernels: Triton kernels for LLM fine-tuning, each with a hand-written backward and a
plain-torch twin of the same math.

    from accel_kernels import rms_norm, layer_norm, rope, swiglu, geglu, relu_squared, cross_entropy, fused_linear_cross_entropy, moe_experts

Importing this package patches nothing. It imports torch and, when it can, triton; never
accel_patch, transformers or accelerate. Without triton (it is installed on Linux only) every op
runs its plain-torch twin.

Layout: a dotted path means one thing. `accel_kernels.<op>` is the function;
`accel_kernels.ops.<op>` is the module that defines it.

    ops/<op>.py      one module per op (swiglu.py and geglu.py share ops/_glu.py)
    _triton.py       the one place triton is imported (or found missing); shared Triton helpers
    _launch.py       launch(): the only way a kernel is launched; recording() and capturing() of
                     launches
    _library.py      the torch.library side: every op is torch.ops.accel_kernels.<op> (why
                     custom_op and not triton_op is written there)
    _dispatch.py     Triton or twin for a tensor (use_triton, interpreting), shared input checks,
                     the output allocator tests poison
    _timing.py       two ways of computing one call timed on the device on its own inputs, the
                     faster kept (the experts' backward; accel_patch's fused LoRA against PEFT)
    bench/           python -m accel_kernels.bench
    codegen.py       python -m accel_kernels.codegen: the launches at real model shapes compiled
                     for sm_80 / sm_90a without a GPU, within register, spill and shared budgets

Every op module has the same parts in the same order, so reading one is reading them all:

1. Triton kernels: `@jit` functions; the ones launched from the host are named `_*_kernel`, the
   others are device functions they call.
2. Host launch: `_forward_triton` / `_backward_triton` choose the grid and allocate outputs
   through `_dispatch.empty`, and launch only through `_launch.launch(kernel, grid, *args, **meta)`,
   which enters the tensors' device guard.
3. The torch.library ops (`torch.ops.accel_kernels.<op>` and `<op>_backward`, see `_library.py`):
   each implementation calls the host functions or their twins as its `triton_path` argument
   says; a fake implementation each; the autograd formula (setup_context saves, backward calls
   the backward op). Every backward starts with `_dispatch.check_first_order(op)`: under
   create_graph=True it raises rather than let a second derivative silently lose the op (a
   custom op's backward is opaque to autograd; rms_norm and rope on float64 inputs run their
   formula in plain torch outside the ops, second derivatives included).
4. The plain-torch twin: `_forward_torch` / `_backward_torch`, the same signatures as the host
   functions and the same math in plain torch.
5. Input checks: `_check_inputs`, raising ValueError that names the argument, e.g. "x must be a
   torch.Tensor of shape (..., n), got numpy.ndarray".
6. The public entry: checks, `triton_path = _dispatch.use_triton(t) and <dtype/size conditions>`,
   then `torch.ops.accel_kernels.<op>(..., triton_path)`. Everything it does before the op is
   traceable by dynamo, so `torch.compile(fullgraph=True)` gives one node per op.

A part an op does not need is a section with a one-line note (fused_linear_cross_entropy has no
kernels of its own: it runs cross_entropy's row functions on chunks of logits).

Triton runs on GPU tensors and, when the kernels were defined under Triton's CPU interpreter
(TRITON_INTERPRET=1 at import: `_dispatch.interpreting()`), on CPU tensors; everything else runs
the twin.
"""
from .ops.cross_entropy import cross_entropy
from .ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from .ops.geglu import geglu
from .ops.layer_norm import layer_norm
from .ops.moe_experts import moe_experts
from .ops.rms_norm import rms_norm
from .ops.rope import rope
from .ops.relu_squared import relu_squared
from .ops.swiglu import swiglu

__all__ = ["cross_entropy", "fused_linear_cross_entropy", "geglu", "layer_norm", "moe_experts", "relu_squared", "rms_norm", "rope",
           "swiglu"]
