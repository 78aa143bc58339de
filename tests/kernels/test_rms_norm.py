import pytest
import torch

import accel_kernels._dispatch as dispatch
import accel_kernels._launch as _launch
import accel_kernels.ops.rms_norm as rms_norm_module
from _checks import assert_close, rel_err
from _quick import matrix
from accel_kernels import rms_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASTINGS = ["llama", "gemma", "none"]


def eager(x, weight, eps=1e-6, offset=0.0, casting="llama"):
    """The module being replaced, in plain torch: LlamaRMSNorm, GemmaRMSNorm, or all in x's dtype.

    On float64 inputs every step stays float64: that is the reference.
    """
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    if casting == "llama":
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (offset + weight) * h.to(x.dtype)
    if casting == "gemma":
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * (offset + weight.to(wide))).type_as(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.to(x.dtype))


def forward_backward(fn, x, weight, dy, x_grad=True, w_grad=True, **kw):
    """fn(x, weight) and the grads of (y * dy).sum() wrt x and weight, on leaf copies of the inputs."""
    x = x.detach().requires_grad_(x_grad)
    weight = weight.detach().requires_grad_(w_grad)
    y = fn(x, weight, **kw)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


def check_against_float64(x, weight, dy=None, **kw):
    """Output, grad of x and grad of weight against float64; bound set by the lowest precision involved."""
    if dy is None:
        dy = torch.randn(x.shape, device=x.device).to(eager(x, weight, **kw).dtype)
    got = forward_backward(rms_norm, x, weight, dy, **kw)
    ref = forward_backward(eager, x.double(), weight.double(), dy.double(), **kw)
    stock = forward_backward(eager, x, weight, dy, **kw)
    expected_dtypes = (stock[0].dtype, x.dtype, weight.dtype)
    for what, g, r, s, dtype in zip(("output", "grad of x", "grad of weight"), got, ref, stock, expected_dtypes):
        assert g.dtype == dtype and g.shape == s.shape, f"{what}: {g.dtype} {tuple(g.shape)}"
        bound_dtype = x.dtype if x.dtype != torch.float32 else g.dtype
        assert_close(g, r, bound_dtype, stock=s, what=what)
    return got


@pytest.fixture
def triton_only(monkeypatch):
    """Fail if the call falls back to the plain-torch path: these tests are about the kernels."""
    def refuse(*args, **kwargs):
        raise AssertionError("rms_norm took the plain-torch path")

    monkeypatch.setattr(rms_norm_module, "_forward_torch", refuse)
    monkeypatch.setattr(rms_norm_module, "_backward_torch", refuse)


def weight_for(n, device, dtype, offset):
    # around 1 for the Llama form, around 0 for the (1 + w) Gemma form
    return (torch.randn(n, device=device) * 0.2 + (1.0 - offset)).to(dtype)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, casting, offset", matrix(
    DTYPES, CASTINGS, [0.0, 1.0], quick=lambda dtype, casting, offset: dtype == torch.float32 or casting == "llama"))
def test_matches_float64(device, dtype, casting, offset):
    x = (torch.randn(2, 5, 300, device=device) * 3).to(dtype)
    check_against_float64(x, weight_for(300, device, dtype, offset), offset=offset, casting=casting)


def rounded_each_step(x, weight, eps=1e-6, offset=0.0):
    """casting="none" as torch computes it on GPU: each op in fp32, rounded to x's dtype.
    (CPU torch rounds sqrt before the reciprocal in bf16 rsqrt, so eager() is not it.)"""
    r = lambda t: t.to(x.dtype).float()  # noqa: E731
    xf = x.float()
    rstd = r(torch.rsqrt(r(r(r(xf * xf).mean(-1, keepdim=True)) + eps)))
    return (r(xf * rstd) * r(r(weight.float()) + offset)).to(x.dtype)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("casting,offset", [("llama", 0.0), ("gemma", 1.0), ("none", 0.0), ("none", 1.0)])
def test_low_precision_forward_rounds_where_the_module_does(device, dtype, casting, offset):
    # bit for bit but for rare 1-ulp flips from summation order: a rounding step lost or added shows up
    x = (torch.randn(16, 160, device=device) * 3).to(dtype)
    weight = weight_for(160, device, dtype, offset)
    y = rms_norm(x, weight, offset=offset, casting=casting)
    expected = rounded_each_step(x, weight, offset=offset) if casting == "none" else eager(x, weight, offset=offset, casting=casting)
    assert (y != expected).float().mean().item() <= 0.01


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, shape", matrix(
    [torch.float32, torch.bfloat16], [(64,), (1, 96), (3, 3), (37, 5), (64, 300), (2, 3, 4, 129), (1, 1, 1, 2)],
    quick=lambda dtype, shape: dtype == torch.float32 or shape == (2, 3, 4, 129)))
def test_shapes(device, dtype, shape):
    # 1-D x is a single row; (64, 300) and (37, 5) spread rows over several backward programs
    x = torch.randn(shape, device=device).to(dtype)
    check_against_float64(x, weight_for(shape[-1], device, dtype, 0.0), eps=1e-5)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype,casting,offset", [
    (torch.float32, "llama", 0.0), (torch.bfloat16, "llama", 0.0), (torch.bfloat16, "gemma", 1.0),
    (torch.float16, "none", 1.0)])
def test_rows_wider_than_one_block(device, monkeypatch, dtype, casting, offset):
    # the block cap is 8192 on GPU; shrink it so a row of 200 spans 4 column blocks, the last partial
    monkeypatch.setattr(rms_norm_module, "_MAX_BLOCK_N", 64)
    x = torch.randn(5, 3, 200, device=device).to(dtype)
    check_against_float64(x, weight_for(200, device, dtype, offset), offset=offset, casting=casting)


@pytest.mark.usefixtures("triton_only")
def test_backward_takes_two_wide_rows_an_iteration(device):
    # rows of 2049-4096 columns (a 4096-wide block): two rows an iteration in the backward, both
    # rows' loads in flight (rms_norm._BWD_TWO_ROWS); 5 rows leave the last pair one masked row
    x = torch.randn(5, 3000, device=device)
    saved = (x, torch.ones(3000, device=device), torch.ones(5, device=device))
    with _launch.capturing() as launches:
        rms_norm_module._backward_triton(x, saved, x.shape, 1e-6, 0.0, "llama", True, True, None)
    assert [(l.meta["BLOCK_M"], l.meta["num_warps"]) for l in launches] == [(2, 16)]
    check_against_float64(x, weight_for(3000, device, torch.float32, 0.0))
    check_against_float64(x.to(torch.bfloat16), weight_for(3000, device, torch.bfloat16, 0.0))


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("casting", CASTINGS)
def test_mixed_dtypes_promote_like_the_module(device, x_dtype, w_dtype, casting):
    x = torch.randn(6, 80, device=device).to(x_dtype)
    y, _, _ = check_against_float64(x, weight_for(80, device, w_dtype, 0.0), casting=casting)
    if casting == "llama":
        assert y.dtype == torch.promote_types(x_dtype, w_dtype)
    else:
        assert y.dtype == x_dtype


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_or_x_without_grad(device, dtype):
    x = torch.randn(4, 7, 48, device=device).to(dtype)
    weight = weight_for(48, device, dtype, 1.0)
    dy = torch.randn(4, 7, 48, device=device).to(dtype)
    kw = dict(offset=1.0, casting="gemma")
    y, dx, dw = forward_backward(rms_norm, x, weight, dy, w_grad=False, **kw)
    assert dw is None
    _, ref_dx, _ = forward_backward(eager, x.double(), weight.double(), dy.double(), **kw)
    _, stock_dx, _ = forward_backward(eager, x, weight, dy, w_grad=False, **kw)
    assert_close(dx, ref_dx, dtype, stock=stock_dx, what="grad of x without weight grad")
    _, dx, dw = forward_backward(rms_norm, x, weight, dy, x_grad=False, **kw)
    _, _, ref_dw = forward_backward(eager, x.double(), weight.double(), dy.double(), **kw)
    _, _, stock_dw = forward_backward(eager, x, weight, dy, x_grad=False, **kw)
    assert dx is None
    assert_close(dw, ref_dw, dtype, stock=stock_dw, what="grad of weight without x grad")


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, dtype):
    n = 130
    x_t = torch.randn(n, 12, device=device).to(dtype).t()  # last dim strided
    x_slice = torch.randn(3, 4, 2 * n, device=device).to(dtype)[..., :n]  # rows padded in memory
    weight = torch.randn(2 * n, device=device).to(dtype)[::2]
    dy = torch.randn(n, 12, device=device).to(dtype).t()
    assert not x_t.is_contiguous() and not x_slice.is_contiguous() and not weight.is_contiguous()
    check_against_float64(x_t, weight, dy)
    check_against_float64(x_slice, weight, casting="gemma", offset=1.0)
    # sum().backward() hands backward an expanded grad with stride 0
    check_against_float64(x_t, weight, torch.ones((), device=device, dtype=dtype).expand(12, n))


@pytest.mark.usefixtures("triton_only")
def test_inputs_are_not_written_and_only_x_and_rstd_are_saved(device):
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(256, device=device, dtype=torch.bfloat16, requires_grad=True)
    x_before, w_before = x.detach().clone(), weight.detach().clone()
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = rms_norm(x, weight)
    y.backward(torch.randn_like(y))
    assert torch.equal(x.detach(), x_before) and torch.equal(weight.detach(), w_before)
    # x, the weight parameter itself, and one float32 rstd per row: nothing the size of x in fp32
    assert sum(saved.values()) == x.nbytes + weight.nbytes + 8 * 4


def test_plain_path_matches_triton_path(device, monkeypatch):
    for dtype, casting, offset in [(torch.float32, "llama", 0.0), (torch.bfloat16, "gemma", 1.0),
                                   (torch.float16, "none", 0.5)]:
        x = torch.randn(5, 200, device=device).to(dtype)
        weight = weight_for(200, device, dtype, offset)
        dy = torch.randn(5, 200, device=device).to(dtype)
        kw = dict(offset=offset, casting=casting)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        triton_result = forward_backward(rms_norm, x, weight, dy, **kw)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        plain_result = forward_backward(rms_norm, x, weight, dy, **kw)
        ref = forward_backward(eager, x.double(), weight.double(), dy.double(), **kw)
        for what, t, p, r in zip(("output", "grad of x", "grad of weight"), triton_result, plain_result, ref):
            assert t.dtype == p.dtype, what
            # the plain path is the stock computation in that dtype: it sets the bound
            assert_close(t, r, dtype, stock=p, what=f"{casting} {dtype} {what}")
            assert rel_err(t, p) <= (1e-6 if dtype == torch.float32 else 1e-2), what


def test_twin_gradients_under_autocast_are_eager_ones(device, monkeypatch):
    # the twin recomputes the formula in backward, which runs outside the autocast block: it must
    # replay the forward's autocast (on CUDA, autocast runs rsqrt and mean of bf16 in float32)
    if device.type != "cuda":
        pytest.skip("CPU autocast changes no op of the formula: nothing to tell apart here")
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    weight = weight_for(64, device, torch.bfloat16, 0.0)
    dy = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    results = []
    for fn in (rms_norm, eager):
        xl, wl = x.detach().requires_grad_(), weight.detach().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(xl, wl, casting="none")
        y.backward(dy.to(y.dtype))
        results.append((y.detach(), xl.grad, wl.grad))
    for what, ours, stock in zip(("output", "grad of x", "grad of weight"), *results):
        assert ours.dtype == stock.dtype and torch.equal(ours, stock), what


def test_the_twin_runs_under_the_callers_autocast_and_no_other(device, monkeypatch):
    # an op's implementation runs with autocast off; the twin replays the caller's. One that ran
    # under autocast the caller had not asked for gave float32 on CUDA for float16 x with
    # casting="none" (CUDA autocast runs pow and rsqrt in float32) where the module, all in x's
    # dtype, and the kernels give float16. On CPU no op of the formula changes: the state is read.
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    seen, reference = [], rms_norm_module._reference

    def spy(x, *args, **kwargs):
        enabled = torch.is_autocast_enabled(x.device.type)
        seen.append(torch.get_autocast_dtype(x.device.type) if enabled else None)
        return reference(x, *args, **kwargs)

    monkeypatch.setattr(rms_norm_module, "_reference", spy)
    x = torch.randn(3, 16, device=device, dtype=torch.float16)
    weight = weight_for(16, device, torch.float16, 0.5)
    dy = torch.randn(3, 16, device=device, dtype=torch.float16)
    y, dx, dw = forward_backward(rms_norm, x, weight, dy, offset=0.5, casting="none")
    assert seen == [None, None], "forward, and its recomputation in backward, without autocast"
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.float16,) * 3
    assert y.dtype == eager(x, weight, offset=0.5, casting="none").dtype
    seen.clear()
    xl, wl = x.detach().requires_grad_(), weight.detach().requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = rms_norm(xl, wl, offset=0.5, casting="none")
    y.backward(dy.to(y.dtype))
    assert seen == [torch.bfloat16, torch.bfloat16], "forward and its recomputation under the caller's autocast"


def test_float64_and_empty_inputs_take_the_plain_path(device):
    x = torch.randn(3, 50, device=device, dtype=torch.float64)
    weight = torch.randn(50, device=device, dtype=torch.float64)
    dy = torch.randn(3, 50, device=device, dtype=torch.float64)
    ref = forward_backward(eager, x, weight, dy)
    # like LlamaRMSNorm, "llama" normalizes in float32 even for float64 x: float32-level agreement
    for what, got, r in zip(("output", "grad of x", "grad of weight"), forward_backward(rms_norm, x, weight, dy), ref):
        assert got.dtype == torch.float64, what
        assert_close(got, r, torch.float32, what=what)
    assert rms_norm(torch.randn(0, 16, device=device), torch.ones(16, device=device)).shape == (0, 16)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_modules(device, dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(2, 9, 160, device=device).to(dtype)
    dy = torch.randn(2, 9, 160, device=device).to(dtype)
    for module, kw in [(LlamaRMSNorm(160, eps=1e-5), dict(eps=1e-5, casting="llama")),
                       (GemmaRMSNorm(160, eps=1e-6), dict(eps=1e-6, offset=1.0, casting="gemma"))]:
        module = module.to(device=device, dtype=dtype)
        with torch.no_grad():
            module.weight.copy_(torch.randn(160, device=device) * 0.3 + (1.0 if kw["casting"] == "llama" else 0.0))
        xs = x.detach().requires_grad_(True)
        y_module = module(xs)
        y_module.backward(dy)
        got = forward_backward(rms_norm, x, module.weight, dy, **kw)
        expected = (y_module.detach(), xs.grad, module.weight.grad)
        for what, g, e in zip(("output", "grad of x", "grad of weight"), got, expected):
            assert g.dtype == e.dtype, what
            if what == "output":  # forward does what the module does, step for step
                torch.testing.assert_close(g, e, msg=f"{type(module).__name__} {what}")
            else:  # our sums run in float32; autograd's in the module's dtype
                assert rel_err(g, e) <= (1e-5 if dtype == torch.float32 else 2e-2), what


def test_bad_inputs_name_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\).*got \(9,\)"):
        rms_norm(x, torch.ones(9, device=device))
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\).*got \(1, 8\)"):
        rms_norm(x, torch.ones(1, 8, device=device))
    with pytest.raises(ValueError, match="weight must be a floating-point tensor, got torch.int64"):
        rms_norm(x, torch.ones(8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="x must be a floating-point tensor, got torch.int32"):
        rms_norm(x.int(), torch.ones(8, device=device))
    with pytest.raises(ValueError, match="x must have at least one dim"):
        rms_norm(torch.tensor(1.0, device=device), torch.ones(1, device=device))
    with pytest.raises(ValueError, match="casting must be one of .*'llama'.*got 'gemma2'"):
        rms_norm(x, torch.ones(8, device=device), casting="gemma2")
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, torch.ones(8, device="meta"))


def test_backward_grid_is_what_fits_the_sms(monkeypatch):
    # the weight-gradient backward needs up to 128 registers a thread: one block of 16 warps fits
    # a SM, two of 8; the grid asks for as many programs as are resident at once, no more
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    assert [rms_norm_module._max_programs(cuda, w) for w in (16, 8, 4)] == [132, 264, 528]


# --- weightless and gated forms ---------------------------------------------------------------


def eager_form(x, weight, gate, activation, eps=1e-6, casting="llama"):
    """The weightless / gated modules' formula (float64 stays float64: the reference): the ungated
    product before its final cast, times act(gate) in float32, cast to x's dtype."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    pre = activation == "pre_silu"  # Mamba2's form: norm(x * silu(gate)), output as without a gate
    if casting == "none":
        x_in = (x.to(wide) * torch.nn.functional.silu(gate.to(wide))).to(x.dtype) if pre else x
        y = x_in * torch.rsqrt(x_in.pow(2).mean(-1, keepdim=True) + eps)
        y = y if weight is None else y * weight.to(x.dtype)
    else:
        h = x.to(wide) * torch.nn.functional.silu(gate.to(wide)) if pre else x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if casting == "llama":
            y = h.to(x.dtype) if weight is None else weight * h.to(x.dtype)
        else:
            y = h if weight is None else h * weight.to(wide)
    if gate is None or pre:
        return y if casting == "llama" else y.to(x.dtype)
    act = torch.nn.functional.silu if activation == "silu" else torch.sigmoid
    return (y * act(gate.to(wide))).to(x.dtype)


def check_form_against_float64(x, weight, gate, activation, casting):
    """Output and the grads of x, weight and gate against float64, bounded as check_against_float64."""
    leaves = [t for t in (x, weight, gate) if t is not None]

    def run(fn, tensors):
        tensors = [t.detach().requires_grad_() for t in tensors]
        it = iter(tensors)
        args = [next(it) if t is not None else None for t in (x, weight, gate)]
        y = fn(args[0], args[1], gate=args[2], activation=activation, casting=casting)
        y.backward(dy.to(y.dtype))
        return [y.detach()] + [t.grad for t in tensors]

    def kernel(x_, w_, gate, activation, casting):
        return rms_norm(x_, w_, casting=casting, gate=gate, activation=activation)

    def formula(x_, w_, gate, activation, casting):
        return eager_form(x_, w_, gate, activation, casting=casting)

    dy = torch.randn(x.shape, device=x.device).to(x.dtype)
    got = run(kernel, leaves)
    ref = run(formula, [t.double() for t in leaves])
    stock = run(formula, leaves)
    names = ["output", "grad of x"] + (["grad of weight"] if weight is not None else []) + (
        ["grad of gate"] if gate is not None else [])
    for what, g, r, s, leaf in zip(names, got, ref, stock, [x] + leaves):
        assert g.dtype == s.dtype and g.shape == s.shape, f"{what}: {g.dtype} {tuple(g.shape)}"
        assert_close(g, r, x.dtype if x.dtype != torch.float32 else g.dtype, stock=s, what=what)
    return got


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("casting", ["gemma", "none"])
def test_weightless_matches_float64(device, dtype, casting):
    x = (torch.randn(2, 5, 96, device=device) * 3).to(dtype)
    got = check_form_against_float64(x, None, None, "", casting)
    assert len(got) == 2  # no weight, no weight gradient


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype,casting,w_dtype", [  # the quick loop: Qwen3-Next's and Kimi Linear's dtypes
    pytest.param(torch.float32, "llama", torch.float32, marks=pytest.mark.slow), (torch.bfloat16, "llama", torch.bfloat16),
    (torch.bfloat16, "gemma", torch.float32), pytest.param(torch.bfloat16, "gemma", torch.bfloat16, marks=pytest.mark.slow),
    pytest.param(torch.float16, "none", torch.float16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("activation", ["silu", "sigmoid", "pre_silu"])
def test_gated_matches_float64(device, dtype, casting, w_dtype, activation):
    x = (torch.randn(2, 5, 96, device=device) * 3).to(dtype)
    gate = (torch.randn(2, 5, 96, device=device) * 3).to(dtype)
    check_form_against_float64(x, weight_for(96, device, w_dtype, 0.0), gate, activation, casting)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("weighted,activation", [(True, "silu"), (False, "silu"), (True, "pre_silu")])
def test_gated_and_weightless_rows_wider_than_one_block(device, monkeypatch, weighted, activation):
    monkeypatch.setattr(rms_norm_module, "_MAX_BLOCK_N", 64)  # a row of 200 spans 4 column blocks
    x = torch.randn(5, 200, device=device).to(torch.bfloat16)
    gate = torch.randn(5, 200, device=device).to(torch.bfloat16)
    weight = weight_for(200, device, torch.bfloat16, 0.0) if weighted else None
    with _launch.recording() as launched:
        check_form_against_float64(x, weight, gate, activation, "llama")
    assert "_rms_norm_bwd_dot_kernel" in launched and "_rms_norm_bwd_kernel" in launched


@pytest.mark.usefixtures("triton_only")
def test_gated_gate_without_grad_and_strided_gate(device):
    x = torch.randn(4, 6, 32, device=device).requires_grad_()
    gate = torch.randn(4, 32, 6, device=device).transpose(1, 2)  # strided, no grad
    w = weight_for(32, device, torch.float32, 0.0).requires_grad_()
    y = rms_norm(x, w, gate=gate, activation="sigmoid")
    y.sum().backward()
    ref = eager_form(x.double(), w.double(), gate.double(), "sigmoid")
    assert_close(y, ref, torch.float32)
    assert x.grad is not None and w.grad is not None and gate.grad is None


def test_bad_form_arguments_name_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match="with weight=None it must be 0.0, got 1.0"):
        rms_norm(x, None, offset=1.0, casting="gemma")
    w = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"gate must have x's shape \(2, 8\), got \(2, 4\)"):
        rms_norm(x, w, gate=torch.ones(2, 4, device=device), activation="silu")
    with pytest.raises(ValueError, match="activation must be one of .*'silu'.*got 'gelu'"):
        rms_norm(x, w, gate=torch.ones(2, 8, device=device), activation="gelu")
    assert torch.equal(rms_norm(x, w, activation="sigmoid"), rms_norm(x, w))  # no gate: unused


def test_gated_backward_rows_of_8192_take_the_dot_pass(device, monkeypatch):
    # one 8192-wide block spilled in the gated backward (codegen check, sm_90): it splits in two
    launches = []
    monkeypatch.setattr(rms_norm_module._launch, "launch", lambda kernel, grid, *a, **meta: launches.append(
        (kernel.__name__ if hasattr(kernel, "__name__") else str(kernel), meta["BLOCK_N"])))
    x = torch.zeros(4, 8192, device=device, dtype=torch.bfloat16)
    w = torch.zeros(8192, device=device, dtype=torch.bfloat16)
    y, saved = rms_norm_module._forward_triton(x, w, 1e-6, 0.0, "llama", x, "pre_silu")
    rms_norm_module._backward_triton(y, saved, x.shape, 1e-6, 0.0, "llama", True, True, None, "pre_silu", True)
    _, saved = rms_norm_module._forward_triton(x, w, 1e-6, 0.0, "llama")
    rms_norm_module._backward_triton(y, saved, x.shape, 1e-6, 0.0, "llama", True, True, None)
    blocks = [b for _, b in launches]
    assert blocks == [8192, 4096, 4096, 8192, 8192], launches  # fwd; dot + bwd (gated); fwd; bwd
