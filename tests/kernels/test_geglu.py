import pytest
import torch
import torch.nn.functional as F

import accel_kernels._dispatch as dispatch
from _checks import rel_err
from _glu_checks import check_against_float64, forward_backward, saved_bytes
from _quick import matrix
from accel_kernels import geglu

# The interpreter evaluates exp in numpy, which warns where it overflows to inf inside sigmoid(x)
# for large |x|; the result (sigmoid -> 0 or 1) is right.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
APPROXIMATIONS = ["none", "tanh"]


def ours(approximate):
    return lambda gate, up: geglu(gate, up, approximate=approximate)


def eager(approximate):
    return lambda gate, up: F.gelu(gate, approximate=approximate) * up


@pytest.mark.parametrize("approximate, dtype, shape", matrix(
    APPROXIMATIONS, DTYPES, [(3, 1000), (2, 5, 333), (1, 1), (1, 7)],
    quick=lambda approximate, dtype, shape: dtype == torch.float32 or shape == (2, 5, 333)))
def test_matches_float64(device, approximate, dtype, shape):
    gate, up, dout = (torch.randn(shape, device=device).mul(3).to(dtype) for _ in range(3))
    check_against_float64(ours(approximate), eager(approximate), gate, up, dout)


def test_default_is_erf(device):
    gate, up = torch.randn(2, 300, device=device), torch.randn(2, 300, device=device)
    torch.testing.assert_close(geglu(gate, up), F.gelu(gate) * up, rtol=1e-5, atol=1e-6)
    assert (geglu(gate, up) - geglu(gate, up, "tanh")).abs().max() > 1e-6  # the two really differ


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_non_contiguous_inputs(device, approximate):
    gate_up = torch.randn(6, 2 * 300, device=device, dtype=torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    dout = torch.randn(300, 6, device=device, dtype=torch.bfloat16).t()
    check_against_float64(ours(approximate), eager(approximate), gate, up, dout)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_plain_path_matches_triton_path(device, monkeypatch, approximate):
    gate, up, dout = (torch.randn(4, 777, device=device).mul(3) for _ in range(3))
    allocations = []
    real_empty_like = dispatch.empty_like
    monkeypatch.setattr(dispatch, "empty_like", lambda *a, **k: allocations.append(1) or real_empty_like(*a, **k))
    triton_result = forward_backward(ours(approximate), gate, up, dout)
    assert len(allocations) == 3, "the Triton path should have run (output, grad of gate, grad of up)"
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    plain_result = forward_backward(ours(approximate), gate, up, dout)
    assert len(allocations) == 3, "the plain path should not have launched kernels"
    for t, p in zip(triton_result, plain_result):
        assert rel_err(t, p) <= 1e-6  # the same fp32 math; only libm-level rounding differs


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_saves_only_gate_and_up(device, approximate):
    gate, up = (torch.randn(8, 1000, device=device, dtype=torch.bfloat16) for _ in range(2))
    assert saved_bytes(ours(approximate), gate, up) == gate.nbytes + up.nbytes
    assert saved_bytes(eager(approximate), gate, up) == 3 * gate.nbytes  # eager also keeps gelu(gate)


def test_bad_inputs_name_the_argument(device):
    gate = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"approximate must be 'none' or 'tanh', got 'erf'"):
        geglu(gate, gate, approximate="erf")
    with pytest.raises(ValueError, match=r"up has shape \(8, 2\)"):
        geglu(gate, torch.randn(8, 2, device=device))
    with pytest.raises(ValueError, match="up has dtype torch.bfloat16"):
        geglu(gate, gate.bfloat16())
    with pytest.raises(ValueError, match="up is on meta"):
        geglu(gate, torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match="gate must be a floating-point tensor"):
        geglu(torch.ones(2, 8, dtype=torch.int64, device=device), torch.ones(2, 8, dtype=torch.int64, device=device))
