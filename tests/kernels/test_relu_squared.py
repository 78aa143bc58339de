"""ReLU² (Nemotron-H's non-gated MLP activation): forward and hand-written backward against float64
with the dtype's bound, the Triton path against the twin, what it saves, bad inputs named."""
import pytest
import torch

import accel_kernels._dispatch as dispatch
from _checks import assert_close, rel_err
from accel_kernels import _launch, relu_squared


def eager(x):
    """transformers' ReLUSquaredActivation: square(relu(x))."""
    return torch.square(torch.relu(x))


def forward_backward(fn, x, dout):
    x = x.detach().requires_grad_(True)
    out = fn(x)
    out.backward(dout)
    return out.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 1000), (2, 5, 333), (1, 1)])
def test_matches_float64(device, dtype, shape):
    x, dout = (torch.randn(shape, device=device).mul(3).to(dtype) for _ in range(2))
    with _launch.recording() as launched:
        got = forward_backward(relu_squared, x, dout)
    if dispatch.use_triton(x) and dtype != torch.float64:
        assert launched == ["_relu_squared_forward_kernel", "_relu_squared_backward_kernel"], launched
    ref = forward_backward(eager, x.double(), dout.double())
    stock = forward_backward(eager, x, dout) if dtype != torch.float32 else (None, None)
    for what, g, r, s in zip(("output", "grad of x"), got, ref, stock):
        assert g.dtype == dtype and g.shape == x.shape, what
        assert_close(g, r, dtype, stock=s, what=what)


def test_non_contiguous_and_float64_and_empty(device):
    x = torch.randn(300, 6, device=device).t()
    dout = torch.randn(6, 300, device=device)
    for g, r in zip(forward_backward(relu_squared, x, dout), forward_backward(eager, x.double(), dout.double())):
        assert rel_err(g, r) <= 1e-6
    x64 = torch.randn(3, 50, device=device, dtype=torch.float64)
    for g, r in zip(forward_backward(relu_squared, x64, x64), forward_backward(eager, x64, x64)):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    empty = torch.randn(0, 16, device=device)
    assert forward_backward(relu_squared, empty, empty)[0].shape == (0, 16)


def test_plain_path_matches_triton_path(device, monkeypatch):
    x, dout = (torch.randn(4, 777, device=device) for _ in range(2))
    triton_result = forward_backward(relu_squared, x, dout)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    with _launch.recording() as launched:
        plain_result = forward_backward(relu_squared, x, dout)
    assert launched == []
    for t, p in zip(triton_result, plain_result):
        assert rel_err(t, p) <= 1e-6


def test_saves_only_x(device):
    x = torch.randn(8, 1000, device=device, dtype=torch.bfloat16)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    leaf = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = relu_squared(leaf)
    out.sum().backward()
    assert sum(storages.values()) == x.nbytes


def test_bad_inputs_name_the_argument(device):
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        relu_squared(torch.ones(2, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="x must be a torch.Tensor"):
        relu_squared(1.0)
