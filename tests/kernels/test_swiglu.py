import pytest
import torch
import torch.nn.functional as F

import accel_kernels._dispatch as dispatch
from _checks import rel_err
from _glu_checks import check_against_float64, forward_backward, saved_bytes
from _quick import matrix
from accel_kernels import swiglu


def eager(gate, up):
    """LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)` with act_fn = silu."""
    return F.silu(gate) * up


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype, shape", matrix(
    DTYPES, [(3, 1000), (2, 5, 333), (1, 1), (1, 7), (2, 1, 3, 129)],
    quick=lambda dtype, shape: dtype == torch.float32 or shape == (2, 5, 333)))
def test_matches_float64(device, dtype, shape):
    gate, up, dout = (torch.randn(shape, device=device).mul(3).to(dtype) for _ in range(3))
    check_against_float64(swiglu, eager, gate, up, dout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("plain", [False, True])
def test_a_limit_clamps_gate_and_up_as_torch_clamp_does(device, dtype, plain, monkeypatch):
    # DeepSeek V4's and GLM-5-next's swiglu_limit: gate.clamp(max=L), up.clamp(-L, L), with
    # torch.clamp's gradients (zero where the clamp bound the input, passed on the bound itself)
    from accel_kernels import _launch

    limit = 10.0
    gate, up, dout = (torch.randn(4, 333, device=device).mul(12).to(dtype) for _ in range(3))
    gate[0, :3] = limit  # on the bound: the gradient passes, as torch's
    up[0, 3:6] = -limit
    assert float((gate > limit).float().mean()) > 0.1 and float((up.abs() > limit).float().mean()) > 0.2
    if plain:
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    with _launch.recording() as launched:
        check_against_float64(lambda g, u: swiglu(g, u, limit=limit),
                              lambda g, u: eager(g.clamp(max=limit), u.clamp(-limit, limit)), gate, up, dout)
    assert plain or {"_glu_forward_kernel", "_glu_backward_kernel"} <= set(launched), launched


def test_a_bad_limit_is_refused_by_name():
    gate = up = torch.randn(2, 8)
    for bad in (0.0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="limit must be a positive number or None"):
            swiglu(gate, up, limit=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, dtype):
    # gate and up as halves of one fused projection, and a transposed view; the upstream grad strided too.
    gate_up = torch.randn(6, 2 * 300, device=device, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    dout = torch.randn(300, 6, device=device, dtype=dtype).t()
    assert not gate.is_contiguous() and not dout.is_contiguous()
    check_against_float64(swiglu, eager, gate, up, dout)
    gate_t = torch.randn(300, 6, device=device, dtype=dtype).t()
    check_against_float64(swiglu, eager, gate_t, up, dout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["silu", "silu limit 10", "gelu_tanh"])
def test_the_halves_of_a_fused_gate_up_are_read_in_place(device, dtype, act):
    """Phi3's gate_up_proj output chunked in two: the row kernels read both halves where they lie
    (a row stride of twice the width), forward and backward, where the flat kernels would need a
    contiguous copy of each (two [tokens, width] passes each way); 1100 columns: a full and a
    partial column block. Red with the row kernels unused (the flat ones launch)."""
    from accel_kernels import _launch, geglu

    limit = 10.0 if act.endswith("limit 10") else None
    op, ref = ((lambda g, u: swiglu(g, u, limit=limit)),
               (lambda g, u: eager(g.clamp(max=limit), u.clamp(-limit, limit)) if limit else eager(g, u)))
    if act == "gelu_tanh":
        op, ref = (lambda g, u: geglu(g, u, approximate="tanh")), (lambda g, u: F.gelu(g, approximate="tanh") * u)
    gate, up = torch.randn(2, 3, 2 * 1100, device=device).mul(6).to(dtype).chunk(2, dim=-1)
    dout = torch.randn(2, 3, 1100, device=device).to(dtype)
    with _launch.recording() as launched:
        check_against_float64(op, ref, gate, up, dout)
    assert set(launched) == {"_glu_forward_rows_kernel", "_glu_backward_rows_kernel"}, launched


def test_plain_path_matches_triton_path(device, monkeypatch):
    gate, up, dout = (torch.randn(4, 777, device=device) for _ in range(3))
    allocations = []
    real_empty_like = dispatch.empty_like
    monkeypatch.setattr(dispatch, "empty_like", lambda *a, **k: allocations.append(1) or real_empty_like(*a, **k))
    triton_result = forward_backward(swiglu, gate, up, dout)
    assert len(allocations) == 3, "the Triton path should have run (output, grad of gate, grad of up)"
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    plain_result = forward_backward(swiglu, gate, up, dout)
    assert len(allocations) == 3, "the plain path should not have launched kernels"
    for t, p in zip(triton_result, plain_result):
        assert rel_err(t, p) <= 1e-6  # the same fp32 math; only libm-level rounding differs


def test_float64_and_empty_inputs(device):
    gate, up, dout = (torch.randn(3, 50, device=device, dtype=torch.float64) for _ in range(3))
    for got, ref in zip(forward_backward(swiglu, gate, up, dout), forward_backward(eager, gate, up, dout)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    empty = torch.randn(0, 16, device=device)
    assert forward_backward(swiglu, empty, empty, empty)[0].shape == (0, 16)


def test_saves_only_gate_and_up(device):
    gate, up = (torch.randn(8, 1000, device=device, dtype=torch.bfloat16) for _ in range(2))
    ours, stock = saved_bytes(swiglu, gate, up), saved_bytes(eager, gate, up)
    assert ours == gate.nbytes + up.nbytes
    assert stock == 3 * gate.nbytes  # eager also keeps silu(gate)


def test_bad_inputs_name_the_argument(device):
    gate = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"up has shape \(2, 9\).*\(\.\.\., intermediate\)"):
        swiglu(gate, torch.randn(2, 9, device=device))
    with pytest.raises(ValueError, match="up has dtype torch.float16"):
        swiglu(gate, gate.half())
    with pytest.raises(ValueError, match="up is on meta"):
        swiglu(gate, torch.empty(2, 8, device="meta"))
    with pytest.raises(ValueError, match="gate must be a floating-point tensor"):
        swiglu(torch.ones(2, 8, dtype=torch.int32, device=device), torch.ones(2, 8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="up must be a torch.Tensor"):
        swiglu(gate, 1.0)
