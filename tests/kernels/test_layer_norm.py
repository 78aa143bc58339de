"""accel_kernels.layer_norm against torch's F.layer_norm in float64: outputs and the gradients of x,
weight and bias, in float32, bfloat16 and float16, with a weight and a bias, either alone or
neither, odd widths, rows wider than one block, strided inputs; the kernels run (the launches are
counted) and the twin is autograd's."""
import pytest
import torch
import torch.nn.functional as F

import accel_kernels._dispatch as dispatch
import accel_kernels._launch as _launch
import accel_kernels.ops.layer_norm as layer_norm_module
from _checks import assert_close, rel_err
from _quick import matrix
from accel_kernels import layer_norm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (weight, bias) present: torch.nn.LayerNorm's elementwise_affine and bias switches
AFFINE = [(True, True), (True, False), (False, False), (False, True)]
KERNELS = {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"}


def eager(x, weight, bias, eps=1e-5):
    """torch.nn.LayerNorm's function (float64 stays float64: the reference)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def params(n, device, dtype, has_w, has_b):
    w = (torch.randn(n, device=device) * 0.3 + 1.0).to(dtype) if has_w else None
    b = (torch.randn(n, device=device) * 0.3).to(dtype) if has_b else None
    return w, b


def forward_backward(fn, x, w, b, dy, needs=(True, True, True), **kw):
    """fn(x, w, b) and the grads of (y * dy).sum() wrt x, w and b (None where absent or not needed)."""
    leaves = [t.detach().requires_grad_(need) if t is not None else None for t, need in zip((x, w, b), needs)]
    y = fn(*leaves, **kw)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad if t is not None else None for t in leaves]


def check_against_float64(x, w, b, dy=None, eps=1e-5, needs=(True, True, True)):
    """Output and the grads against float64; the bound set by the lowest precision involved (float32:
    1e-5; half: 1.5x stock torch's own error in that dtype plus a floor)."""
    if dy is None:
        dy = torch.randn(x.shape, device=x.device).to(x.dtype)
    wide = [t.double() if t is not None else None for t in (x, w, b)]
    with _launch.recording() as launched:
        got = forward_backward(layer_norm, x, w, b, dy, needs, eps=eps)
    ref = forward_backward(eager, *wide, dy.double(), needs, eps=eps)
    stock = forward_backward(eager, x, w, b, dy, needs, eps=eps)
    for what, g, r, s in zip(("output", "grad of x", "grad of weight", "grad of bias"), got, ref, stock):
        assert (g is None) == (s is None), what
        if g is None:
            continue
        assert g.dtype == s.dtype and g.shape == s.shape, f"{what}: {g.dtype} {tuple(g.shape)}"
        assert_close(g, r, x.dtype if x.dtype != torch.float32 else g.dtype, stock=s, what=what)
    return got, launched


@pytest.fixture
def triton_only(monkeypatch):
    """Fail if the call falls back to the plain-torch path: these tests are about the kernels."""
    def refuse(*args, **kwargs):
        raise AssertionError("layer_norm took the plain-torch path")

    monkeypatch.setattr(layer_norm_module, "_forward_torch", refuse)
    monkeypatch.setattr(layer_norm_module, "_backward_torch", refuse)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, affine", matrix(
    DTYPES, AFFINE, quick=lambda dtype, affine: dtype == torch.float32 or affine == (True, True)))
def test_matches_float64(device, dtype, affine):
    # a mean far from 0 (2.5 std): a variance taken as E[x^2] - mean^2 would lose digits here
    x = (torch.randn(2, 5, 300, device=device) * 3 + 7.5).to(dtype)
    _, launched = check_against_float64(x, *params(300, device, dtype, *affine))
    assert set(launched) == KERNELS, launched


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, shape", matrix(
    [torch.float32, torch.bfloat16], [(64,), (1, 96), (3, 3), (37, 5), (64, 300), (2, 3, 4, 129), (1, 1, 1, 3)],
    quick=lambda dtype, shape: dtype == torch.float32 or shape == (2, 3, 4, 129)))
def test_shapes(device, dtype, shape):
    # odd widths (not 2: a 2-wide LayerNorm gives +-1 whatever x, a gradient of x that is rounding
    # noise, stock's included); 1-D x is one row; (64, 300) and (37, 5) spread rows over several backward programs
    x = torch.randn(shape, device=device).to(dtype)
    check_against_float64(x, *params(shape[-1], device, dtype, True, True), eps=1e-6)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, affine", [(torch.float32, (True, True)), (torch.bfloat16, (True, True)),
                                           (torch.float16, (False, True))])
def test_rows_wider_than_one_block(device, monkeypatch, dtype, affine):
    # the block cap is 8192 on GPU; shrink it so a row of 200 spans 4 column blocks, the last partial:
    # the backward's separate dot pass runs
    monkeypatch.setattr(layer_norm_module, "_MAX_BLOCK_N", 64)
    x = (torch.randn(5, 3, 200, device=device) * 2 + 3).to(dtype)
    _, launched = check_against_float64(x, *params(200, device, dtype, *affine))
    assert set(launched) == KERNELS | {"_layer_norm_bwd_dot_kernel"}, launched


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_float32_parameters_with_half_x_give_xs_dtype(device, x_dtype):
    # what torch accepts for half x (a float32 LayerNorm in a half model): output in x's dtype,
    # parameter gradients in float32
    x = torch.randn(6, 80, device=device).to(x_dtype)
    (y, dx, dw, db), _ = check_against_float64(x, *params(80, device, torch.float32, True, True))
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (x_dtype, x_dtype, torch.float32, torch.float32)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True), (False, False, True)])
def test_each_gradient_alone(device, needs):
    # frozen parameters (LoRA), frozen x: only the gradients asked for are computed, each right
    x = torch.randn(4, 7, 48, device=device)
    got, _ = check_against_float64(x, *params(48, device, torch.float32, True, True), needs=needs)
    assert [g is not None for g in got[1:]] == list(needs)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, dtype):
    n = 130
    x_t = torch.randn(n, 12, device=device).to(dtype).t()  # last dim strided
    x_slice = torch.randn(3, 4, 2 * n, device=device).to(dtype)[..., :n]  # rows padded in memory
    w = torch.randn(2 * n, device=device).to(dtype)[::2]
    b = torch.randn(2 * n, device=device).to(dtype)[1::2]
    assert not x_t.is_contiguous() and not x_slice.is_contiguous() and not w.is_contiguous()
    check_against_float64(x_t, w, b, torch.randn(n, 12, device=device).to(dtype).t())
    check_against_float64(x_slice, w, b)
    # sum().backward() hands backward an expanded grad with stride 0
    check_against_float64(x_t, w, b, torch.ones((), device=device, dtype=dtype).expand(12, n))


@pytest.mark.usefixtures("triton_only")
def test_inputs_are_not_written_and_only_x_mean_and_rstd_are_saved(device):
    x = torch.randn(8, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    w, b = (t.requires_grad_() for t in params(256, device, torch.bfloat16, True, True))
    before = [t.detach().clone() for t in (x, w, b)]
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer_norm(x, w, b)
    y.backward(torch.randn_like(y))
    assert all(torch.equal(t.detach(), t0) for t, t0 in zip((x, w, b), before))
    # x, the parameters themselves, and a float32 mean and 1/std per row: nothing the size of x in fp32
    assert sum(saved.values()) == x.nbytes + w.nbytes + b.nbytes + 2 * 8 * 4


def test_twin_is_autograds_layer_norm_bit_for_bit(device, monkeypatch):
    # off the Triton path the op is F.layer_norm and its autograd gradients, recomputed in backward
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    for dtype in DTYPES:
        x = torch.randn(5, 200, device=device).to(dtype)
        w, b = params(200, device, dtype, True, True)
        dy = torch.randn(5, 200, device=device).to(dtype)
        with _launch.recording() as launched:
            got = forward_backward(layer_norm, x, w, b, dy)
        assert launched == []
        for what, g, e in zip(("output", "dx", "dw", "db"), got, forward_backward(eager, x, w, b, dy)):
            assert g.dtype == e.dtype and torch.equal(g, e), f"{dtype} {what}"


def test_triton_path_is_as_close_to_float64_as_the_twin(device, monkeypatch):
    for dtype in DTYPES:
        x = (torch.randn(5, 200, device=device) * 2 + 1).to(dtype)
        w, b = params(200, device, dtype, True, True)
        dy = torch.randn(5, 200, device=device).to(dtype)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        kernel = forward_backward(layer_norm, x, w, b, dy)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        twin = forward_backward(layer_norm, x, w, b, dy)
        ref = forward_backward(eager, *(t.double() for t in (x, w, b)), dy.double())
        for what, k, t, r in zip(("output", "dx", "dw", "db"), kernel, twin, ref):
            assert k.dtype == t.dtype, what
            assert_close(k, r, dtype, stock=t, what=f"{dtype} {what}")


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_under_autocast_the_output_dtype_and_values_are_torchs_on_the_device(device, param_dtype):
    # CPU autocast leaves layer_norm alone (bfloat16 x stays bfloat16, measured on torch 2.13);
    # CUDA's and XPU's run it in float32 (AUTOCAST_TO_FLOAT32): on a GPU this checks that policy
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    w, b = params(64, device, param_dtype, True, True)
    dy = torch.randn(4, 64, device=device)
    results = []
    for fn in (layer_norm, eager):
        leaves = [t.detach().requires_grad_() for t in (x, w, b)]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = fn(*leaves)
        y.backward(dy.to(y.dtype))
        results.append([y.detach()] + [t.grad for t in leaves])
    # the computation's precision is the output's: float32 under the float32 policy, else bfloat16's
    bound = 1e-5 if results[1][0].dtype == torch.float32 else 1e-2
    for what, ours, stock in zip(("output", "dx", "dw", "db"), *results):
        assert ours.dtype == stock.dtype, what
        assert rel_err(ours, stock) <= bound, what


@pytest.mark.slow  # gradgradcheck: ~4 s here (test_package's second-derivative check runs in the quick loop)
def test_float64_runs_the_formula_and_differentiates_twice(device):
    x = torch.randn(2, 5, device=device, dtype=torch.float64, requires_grad=True)
    w, b = (t.requires_grad_() for t in params(5, device, torch.float64, True, True))
    with _launch.recording() as launched:
        y = layer_norm(x, w, b)
    assert launched == [] and torch.equal(y, eager(x, w, b))
    assert torch.autograd.gradgradcheck(lambda *ts: layer_norm(*ts), (x, w, b))
    assert layer_norm(torch.randn(0, 16, device=device), *params(16, device, torch.float32, True, True)).shape == (0, 16)


def test_bad_inputs_name_the_argument(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\).*got \(9,\)"):
        layer_norm(x, torch.ones(9, device=device))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\).*got \(1, 8\)"):
        layer_norm(x, None, torch.ones(1, 8, device=device))
    with pytest.raises(ValueError, match="bias must be a floating-point tensor, got torch.int64"):
        layer_norm(x, None, torch.ones(8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match=r"weight must have x's dtype \(torch.float32\).*got torch.bfloat16"):
        layer_norm(x, torch.ones(8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight and bias must have one dtype"):
        layer_norm(x.bfloat16(), torch.ones(8, device=device), torch.ones(8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must have at least one dim"):
        layer_norm(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="eps must be a number >= 0, got -1"):
        layer_norm(x, eps=-1)
    with pytest.raises(ValueError, match="bias is on meta"):
        layer_norm(x, None, torch.ones(8, device="meta"))


def test_matches_torch_nn_layer_norm_module(device):
    # the module the swap replaces, its own parameters and eps
    module = torch.nn.LayerNorm(128, eps=1e-6).to(device)
    with torch.no_grad():
        module.weight.normal_(1.0, 0.3)
        module.bias.normal_(0.0, 0.3)
    x = torch.randn(2, 9, 128, device=device, requires_grad=True)
    y_module = module(x)
    y_module.backward(torch.ones_like(y_module))
    got = forward_backward(layer_norm, x, module.weight, module.bias, torch.ones_like(y_module), eps=1e-6)
    for what, g, e in zip(("output", "dx", "dw", "db"), got, (y_module.detach(), x.grad, module.weight.grad,
                                                             module.bias.grad)):
        assert rel_err(g, e) <= 1e-5, what


def test_backward_grid_is_what_fits_the_sms(monkeypatch):
    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    assert [layer_norm_module._max_programs(cuda, w) for w in (16, 8, 4)] == [132, 264, 528]
