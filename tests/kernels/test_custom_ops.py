"""Every op is a torch.library op: opcheck passes (schema, fake implementation, autograd
registration, AOT dispatch), and torch.compile(fullgraph=True) puts each public function in the
graph as accel_kernels ops, with no graph break, giving eager's outputs and gradients.

The Triton path runs under the interpreter here; `triton_path=False` is the twin path of the same op.
"""
from __future__ import annotations

import os

import pytest
import torch

import accel_kernels
import accel_kernels._dispatch as dispatch
from _quick import matrix

ops = torch.ops.accel_kernels


@pytest.fixture(autouse=True)
def on_device(device, request):
    """Tensors made here live on the test device; the Triton path on CPU tensors needs the
    interpreter (on a GPU machine, run with ACCEL_TEST_DEVICE=cuda)."""
    params = getattr(request.node, "callspec", None)
    path = params.params.get("path", True) if params else True
    if path in (True, "triton") and not dispatch.use_triton(torch.empty(0, device=device)):
        pytest.skip(f"the Triton path does not run on {device} tensors here")
    if device.type == "cpu":
        yield
        return
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)

# opcheck's utilities: all but the slow dynamic-shape AOT check in the quick loop
QUICK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
ALL_UTILS = QUICK_UTILS + ("test_aot_dispatch_dynamic",)


def _t(*shape, dtype=torch.float32, grad=True):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def rms_norm_cases(dtype, path):
    x, w = _t(3, 2, 40, dtype=dtype), (torch.rand(40) + 0.5).to(dtype).requires_grad_()
    for casting, offset in (("llama", 0.0), ("gemma", 1.0), ("none", 0.5)):
        yield ops.rms_norm, (x, w, 1e-6, offset, casting, path, None)
        y, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-6, offset, casting, path, None)
        dy = torch.randn_like(y)
        for need_x, need_w in ((True, True), (True, False), (False, True)):
            yield ops.rms_norm_backward, (dy, x.detach(), w.detach(), rstd, 1e-6, offset, casting, need_x,
                                          need_w, path, None)
    # the weightless form (no weight, no weight gradient) and the gated one (the gate's gradient)
    gate = _t(3, 2, 40, dtype=dtype)
    for weight, gated, casting in ((None, None, "gemma"), (w, gate, "llama"), (None, gate, "gemma")):
        activation = "silu" if gated is not None else ""
        yield ops.rms_norm, (x, weight, 1e-6, 0.0, casting, path, None, gated, activation)
        frozen_w = weight.detach() if weight is not None else None
        frozen_gate = gated.detach() if gated is not None else None  # the backward op's inputs take no grad
        y, rstd = ops.rms_norm(x.detach(), frozen_w, 1e-6, 0.0, casting, path, None, frozen_gate, activation)
        yield ops.rms_norm_backward, (torch.randn_like(y), x.detach(), frozen_w, rstd, 1e-6, 0.0, casting, True,
                                      weight is not None, path, None, frozen_gate, activation, gated is not None)


def layer_norm_cases(dtype, path):
    x = _t(3, 2, 40, dtype=dtype)
    # weight and bias, in x's dtype and (half x) in float32; weight only; neither
    for w_dtype, has_w, has_b in ((dtype, True, True), (torch.float32, True, True), (dtype, True, False),
                                  (dtype, False, False)):
        w = (torch.rand(40) + 0.5).to(w_dtype).requires_grad_() if has_w else None
        b = _t(40, dtype=w_dtype) if has_b else None
        yield ops.layer_norm, (x, w, b, 1e-5, path)
        frozen = [t.detach() if t is not None else None for t in (x, w, b)]
        y, mean, rstd = ops.layer_norm(*frozen, 1e-5, path)
        for needs in ((True, True, True), (True, False, False), (False, True, True)):
            yield ops.layer_norm_backward, (torch.randn_like(y), *frozen, mean, rstd, 1e-5, *needs, path)


def rope_cases(dtype, path):
    for unsqueeze_dim, rot in ((1, 8), (2, 4)):  # full and partial rotary, both layouts
        shape = (lambda h: (2, h, 3, 8)) if unsqueeze_dim == 1 else (lambda h: (2, 3, h, 8))
        q, k = _t(*shape(4), dtype=dtype), _t(*shape(2), dtype=dtype)
        cos, sin = torch.randn(1, 3, rot).to(dtype), torch.randn(1, 3, rot).to(dtype)
        yield ops.rope, (q, k, cos, sin, unsqueeze_dim, path)
        dq, dk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
        yield ops.rope_backward, (dq, dk, None, None, cos, sin, unsqueeze_dim, dtype, dtype, False, False, path)
        if not path:  # cos and sin with gradients: the twin's
            yield ops.rope_backward, (dq, dk, q.detach(), k.detach(), cos, sin, unsqueeze_dim, dtype, dtype,
                                      True, True, path)


def glu_cases(dtype, path):
    gate, up = _t(3, 70, dtype=dtype), _t(3, 70, dtype=dtype)
    for activation in ("silu", "gelu", "gelu_tanh"):
        yield ops.glu, (gate, up, activation, path)
        yield ops.glu_backward, (torch.randn(3, 70).to(dtype), gate.detach(), up.detach(), activation, path)
    big_gate = (torch.randn(3, 70) * 12).to(dtype).requires_grad_()  # past the clamp
    big_up = (torch.randn(3, 70) * 12).to(dtype).requires_grad_()
    yield ops.glu, (big_gate, big_up, "silu", path, 10.0)
    yield ops.glu_backward, (torch.randn(3, 70).to(dtype), big_gate.detach(), big_up.detach(), "silu", path, 10.0)


def relu_squared_cases(dtype, path):
    x = _t(3, 70, dtype=dtype)
    yield ops.relu_squared, (x, path)
    yield ops.relu_squared_backward, (torch.randn(3, 70).to(dtype), x.detach(), path)


def cross_entropy_cases(dtype, path):
    logits = _t(2, 3, 50, dtype=dtype)
    labels = torch.tensor([[1, -100, 7], [49, 0, 3]])
    for softcap in (None, 4.0):
        for reduction in ("mean", "sum", "none"):
            yield ops.cross_entropy, (logits, labels, -100, softcap, reduction, True, path)
            loss, lse, n_valid = ops.cross_entropy(logits.detach(), labels, -100, softcap, reduction, True, path)
            yield ops.cross_entropy_backward, (torch.randn(loss.shape), logits.detach(), labels, lse, n_valid,
                                               -100, softcap, reduction, path)
    yield ops.cross_entropy, (logits, labels.clamp(min=0), 0, None, "mean", True, path)  # another ignore_index


def fused_linear_cross_entropy_cases(dtype, path):
    h, w, b = _t(2, 3, 8, dtype=dtype), _t(30, 8, dtype=dtype), _t(30, dtype=dtype)
    labels = torch.tensor([[1, -100, 7], [29, 0, 3]])
    for bias in (None, b):
        for softcap, reduction in ((None, "mean"), (3.0, "sum"), (None, "none")):
            yield ops.fused_linear_cross_entropy, (h, w, bias, labels, -100, softcap, reduction, 4,
                                                   True, True, bias is not None, True, path)
        frozen_bias = None if bias is None else bias.detach()
        out = ops.fused_linear_cross_entropy(h.detach(), w.detach(), frozen_bias, labels, -100, 3.0, "none", 4,
                                             False, False, False, True, path)
        yield ops.fused_linear_cross_entropy_backward, (torch.randn(2, 3), h.detach(), w.detach(),
                                                        frozen_bias, labels, out[1],
                                                        -100, 3.0, 4, True, True, bias is not None, path)


def moe_experts_cases(dtype, path):
    T, H, I, E, K = 5, 16, 16, 4, 2
    index = torch.tensor([[0, 2], [2, 4], [1, 2], [2, 0], [-1, 2]])  # 4 and -1: no expert; expert 3 empty
    x, w = _t(T, H, dtype=dtype), _t(T, K, dtype=dtype)
    # gpt-oss's layout and activation with biases: forward, and the backward op with every gradient
    gu, dn = _t(E, H, 2 * I, dtype=dtype), _t(E, I, H, dtype=dtype)
    gub, db = _t(E, 2 * I, dtype=dtype), _t(E, H, dtype=dtype)
    options = (True, True, "gpt_oss", 1.702, 7.0, None, path)
    save = not path  # the twin saves gate/up where asked (the Triton path always recomputes)
    yield ops.moe_experts, (x, index, w, gu, dn, gub, db, None, None, None, None, 0.0, 0.0, *options, save, False)
    out, order, offsets, saved = ops.moe_experts(x.detach(), index, w.detach(), gu.detach(), dn.detach(),
                                                 gub.detach(), db.detach(), None, None, None, None, 0.0, 0.0, *options,
                                                 save, False)
    frozen = [t.detach() for t in (x, w, gu, dn, gub, db)]
    # the backward with the Triton path's GEMMs, and (Triton path only) with torch._grouped_mm's
    for grouped in (False, True) if path else (False,):
        yield ops.moe_experts_backward, (torch.randn(T, H).to(dtype), frozen[0], frozen[1], order, offsets, saved,
                                         *frozen[2:], None, None, None, None, 0.0, 0.0, *options[:-1],
                                         [True] * 6 + [False] * 4, path, grouped)
    # split LoRA on strided views (PEFT's lora_B read as [E, out, r]), base frozen, a scaling per projection
    gu, dn = _t(E, 2 * I, H, dtype=dtype, grad=False), _t(E, H, I, dtype=dtype, grad=False)
    a1, a2 = _t(E, 2, H, dtype=dtype), _t(E, 2, I, dtype=dtype)
    b1 = _t(2 * I, 2, E, dtype=dtype).permute(2, 0, 1)
    b2 = _t(H, 2, E, dtype=dtype).permute(2, 0, 1)
    yield ops.moe_experts, (x, index, w, gu, dn, None, None, a1, b1, a2, b2, 2.0, 0.5, False, False, "silu", 1.702, 7.0,
                            None, path, False, False)


CASES = {
    "rms_norm": rms_norm_cases, "layer_norm": layer_norm_cases, "rope": rope_cases, "glu": glu_cases, "relu_squared": relu_squared_cases,
    "cross_entropy": cross_entropy_cases,
    "fused_linear_cross_entropy": fused_linear_cross_entropy_cases, "moe_experts": moe_experts_cases,
}
EVERY_OP = {"rms_norm", "rms_norm_backward", "layer_norm", "layer_norm_backward", "rope", "rope_backward", "glu", "glu_backward", "relu_squared",
            "relu_squared_backward", "cross_entropy",
            "cross_entropy_backward", "fused_linear_cross_entropy", "fused_linear_cross_entropy_backward",
            "moe_experts", "moe_experts_backward"}


@pytest.fixture
def nan_outputs(monkeypatch):
    """Kernel outputs NaN-filled, but not between guards: opcheck compares the real outputs'
    storage offsets with the fake ones' (0), and a guarded buffer starts past its front guard."""
    import accel_kernels._dispatch as dispatch

    def empty(shape, *, dtype, device):
        out = torch.empty(shape, dtype=dtype, device=device)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(dispatch, "empty", empty)
    monkeypatch.setattr(dispatch, "empty_like", lambda t, dtype=None: empty(t.shape, dtype=dtype or t.dtype, device=t.device))


def _opcheck_all(op_family, dtype, path, utils):
    checked = set()
    for op, args in CASES[op_family](dtype, path):
        torch.library.opcheck(op, args, test_utils=utils)
        checked.add(str(op).split(".")[-1])
    return checked


@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("path", [True, False], ids=["triton", "twin"])
@pytest.mark.parametrize("family", list(CASES))
def test_opcheck_float32(family, path):
    checked = _opcheck_all(family, torch.float32, path, QUICK_UTILS)
    assert checked <= EVERY_OP and checked, checked


# opcheck checks the registration (schema, fake and autograd functions, aot dispatch): float16's
# is checked on the twin path, and on the Triton path bfloat16 stands for both half dtypes (their
# numerics are each kernel's own tests, both dtypes); the pair cost 20 s of interpreted kernels
DTYPE_PATHS = [pytest.param(dtype, path, id=f"{str(dtype)[6:]}-{'triton' if path else 'twin'}")
               for dtype in (torch.float32, torch.bfloat16, torch.float16) for path in (True, False)
               if not (dtype == torch.float16 and path)]


@pytest.mark.slow
@pytest.mark.usefixtures("nan_outputs")
@pytest.mark.parametrize("dtype, path", DTYPE_PATHS)
@pytest.mark.parametrize("family", list(CASES))
def test_opcheck_every_dtype_with_aot_dispatch(family, dtype, path):
    _opcheck_all(family, dtype, path, ALL_UTILS)


# slow here, where the kernels are interpreted (3 s); on a GPU (ACCEL_TEST_DEVICE=cuda, gpu_check's
# quick kernel step) the one half-precision opcheck of the real kernels
@pytest.mark.skipif(os.environ.get("ACCEL_TEST_DEVICE", "cpu") == "cpu",
                    reason="interpreted here: the slow aot-dispatch matrix runs bfloat16 with every util")
@pytest.mark.usefixtures("nan_outputs")
def test_opcheck_bfloat16_triton_on_the_test_device():
    for family in CASES:
        _opcheck_all(family, torch.bfloat16, True, ("test_faketensor",))


@pytest.mark.parametrize("family", list(CASES))
def test_every_forward_op_differentiates_through_its_backward_op(family, monkeypatch):
    # register_autograd at work: gradients flow, and through the family's backward op (a custom op
    # without a formula would give outputs that autograd cannot differentiate)
    op, args = next(CASES[family](torch.float32, True))
    called = []
    backward_op = getattr(ops, f"{family}_backward")
    real = backward_op.default

    def spy(*a, **k):
        called.append(True)
        return real(*a, **k)

    monkeypatch.setattr(ops, f"{family}_backward", type("Packet", (), {"default": staticmethod(spy),
                                                                       "__call__": staticmethod(spy)})())
    outs = op(*args)
    first = outs[0] if isinstance(outs, tuple) else outs
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(first.sum() if family != "fused_linear_cross_entropy" else first, leaves,
                                allow_unused=True)
    assert any(g is not None and torch.isfinite(g).all() for g in grads), family
    assert called or family == "fused_linear_cross_entropy", f"{family}: its backward op never ran"


# --------------------------------------------------------------------------------------------
# torch.compile: one node per op, no graph break, eager's numbers
# --------------------------------------------------------------------------------------------


def public_calls():
    """name -> (function of leaf tensors, inputs): every public function with its options."""
    labels = torch.tensor([[1, -100, 7], [49, 0, 3]])
    cos, sin = torch.randn(1, 3, 6), torch.randn(1, 3, 6)
    moe_index = torch.tensor([[0, 2], [2, 4], [1, 2], [2, 0], [-1, 2]])
    moe_gu = torch.randn(4, 32, 16)
    return {
        "rms_norm": (lambda x, w: accel_kernels.rms_norm(x, w, offset=1.0, casting="gemma"),
                     [_t(2, 3, 40), _t(40)]),
        "layer_norm": (lambda x, w, b: accel_kernels.layer_norm(x, w, b, eps=1e-6), [_t(2, 3, 40), _t(40), _t(40)]),
        "rope": (lambda q, k: accel_kernels.rope(q, k, cos, sin), [_t(2, 4, 3, 8), _t(2, 2, 3, 8)]),
        "swiglu": (accel_kernels.swiglu, [_t(3, 70), _t(3, 70)]),
        "geglu": (lambda g, u: accel_kernels.geglu(g, u, approximate="tanh"), [_t(3, 70), _t(3, 70)]),
        "relu_squared": (accel_kernels.relu_squared, [_t(3, 70)]),
        "cross_entropy": (lambda z: accel_kernels.cross_entropy(z, labels, softcap=5.0), [_t(2, 3, 50)]),
        "fused_linear_cross_entropy": (
            lambda h, w: accel_kernels.fused_linear_cross_entropy(h, w, labels, reduction="sum", chunk_size=4),
            [_t(2, 3, 8), _t(50, 8)]),
        "moe_experts": (  # split LoRA on gate_up (B a strided view), down trained: every kind of kernel
            lambda x, w, d, a, b: accel_kernels.moe_experts(
                x, moe_index, w, moe_gu, d, lora={"gate_up": (a, b.view(32, 2, 4).permute(2, 0, 1)),
                                                  "down": None, "scaling": 2.0}),
            [_t(5, 16), _t(5, 2), _t(4, 16, 16), _t(4, 2, 16), _t(32, 8)]),
        "fused_linear_cross_entropy/none": (  # its backward recomputes the logits: a backward op
            lambda h, w: accel_kernels.fused_linear_cross_entropy(h, w, labels, reduction="none", chunk_size=4),
            [_t(2, 3, 8), _t(50, 8)]),
    }


def _outputs_and_grads(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in leaves]


# the graph is the same on both paths (one node per op; the path is chosen inside it): the quick loop
# compiles the twin, the whole suite the interpreted kernels too
@pytest.mark.parametrize("name, path", matrix(list(public_calls()), ["twin", "triton"],
                                              quick=lambda name, path: path == "twin"))
def test_compiles_fullgraph_to_our_ops_and_matches_eager(name, path, monkeypatch):
    import accel_kernels._dispatch as dispatch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    if path == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    fn, inputs = public_calls()[name]
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*[t.detach().requires_grad_() for t in inputs])
    assert explanation.graph_break_count == 0, explanation.break_reasons
    targets = {"forward": [], "backward": []}

    def recorder(kind):
        def compiler(gm, example_inputs):
            targets[kind] += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got = _outputs_and_grads(compiled, inputs)
    expected = _outputs_and_grads(fn, inputs)
    forward_ops = [t for t in targets["forward"] if t.startswith("accel_kernels.")]
    backward_ops = [t for t in targets["backward"] if t.startswith("accel_kernels.")]
    op = "glu" if name in ("swiglu", "geglu") else name.split("/")[0]
    assert forward_ops == [f"accel_kernels.{op}.default"], targets["forward"]
    if name == "fused_linear_cross_entropy":  # "sum": gradients made in the forward, scaled in backward
        assert backward_ops == [], targets["backward"]
    else:
        assert backward_ops == [f"accel_kernels.{op}_backward.default"], targets["backward"]
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_compiled_cpu_label_check_still_raises():
    if torch.get_default_device().type != "cpu":
        pytest.skip("the label range is checked on CPU tensors only")
    labels = torch.tensor([1, 60])
    compiled = torch.compile(lambda z: accel_kernels.cross_entropy(z, labels), fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match="labels contains 60"):
        compiled(torch.randn(2, 50))


# --------------------------------------------------------------------------------------------
# Eager: around the op boundary (its host cost), with the op's numbers
# --------------------------------------------------------------------------------------------


def _op_names():
    return [name for family in ("rms_norm", "layer_norm", "rope", "glu", "relu_squared", "cross_entropy",
                                "fused_linear_cross_entropy", "moe_experts") for name in (family, f"{family}_backward")]


@pytest.mark.parametrize("name", list(public_calls()))
def test_eager_calls_never_cross_the_custom_op_boundary(name, monkeypatch):
    # the boundary costs tens of microseconds a call (docs/kernels.md): in eager the public
    # functions run the implementations directly, forward and backward
    crossed = []
    for op_name in _op_names():
        real = getattr(ops, op_name)
        monkeypatch.setattr(ops, op_name, lambda *a, _name=op_name, _real=real: crossed.append(_name) or _real(*a))
    fn, inputs = public_calls()[name]
    got = _outputs_and_grads(fn, inputs)
    assert crossed == [], f"{name}: eager call went through torch.ops.accel_kernels.{crossed}"
    assert all(torch.isfinite(t).all() for t in got if t is not None)
    # the autograd node of a direct call has only the outputs the public function returns (the op's
    # others, rstd, lse..., are for the backward: each output costs the node host work)
    outs = fn(*[t.detach().clone().requires_grad_() for t in inputs])
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs[0].grad_fn._input_metadata) == len(outs), name


def _through_the_op(monkeypatch):
    import accel_kernels._library as library

    monkeypatch.setattr(library.Op, "_eager", lambda self, args: False)


@pytest.mark.parametrize("name, path", matrix(list(public_calls()), ["twin", "triton"],
                                              quick=lambda name, path: path == "twin" or name == "rms_norm"))
@pytest.mark.parametrize("grad", [True, False])
def test_eager_direct_call_equals_the_op_bit_for_bit_under_autocast(name, path, grad, monkeypatch):
    # an op's implementation runs with autocast excluded; the direct call must too (and the twins
    # that replay the caller's autocast must still see it): bf16 autocast, outputs and gradients
    if path == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    fn, inputs = public_calls()[name]
    device_type = torch.get_default_device().type

    def run():
        with torch.autocast(device_type, dtype=torch.bfloat16):
            if grad:
                return _outputs_and_grads(fn, inputs)
            with torch.no_grad():
                outs = fn(*inputs)
            return list(outs) if isinstance(outs, tuple) else [outs]

    direct = run()
    with monkeypatch.context() as m:
        _through_the_op(m)
        through_op = run()
    assert len(direct) == len(through_op)
    for d, o in zip(direct, through_op):
        assert (d is None) == (o is None)
        if d is not None:
            assert d.dtype == o.dtype and d.shape == o.shape
            torch.testing.assert_close(d, o, rtol=0, atol=0, equal_nan=True)
