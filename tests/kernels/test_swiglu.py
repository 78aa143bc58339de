import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

import accel_kernels._dispatch as dispatch
from _checks import assert_close, rel_err
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


def _projections(device, keep=False):
    """A swiglu of two fresh projections of x, as an MLP makes them (nothing but autograd holds
    gate and up after the call unless keep): x, the weights, the output, the data pointers of gate
    and up, the data pointers their gradients arrive in (filled by backward), and gate and up
    themselves where kept."""
    torch.manual_seed(0)
    x = torch.randn(6, 32, device=device, requires_grad=True)
    w1, w2 = (torch.randn(32, 300, device=device).div(4).requires_grad_() for _ in range(2))
    gate, up = x @ w1, x @ w2
    ptrs, arrived = (gate.data_ptr(), up.data_ptr()), {}
    gate.register_hook(lambda g: arrived.__setitem__("gate", g.data_ptr()))
    up.register_hook(lambda g: arrived.__setitem__("up", g.data_ptr()))
    out = swiglu(gate, up)
    kept = (gate, up) if keep else ()
    del gate, up
    return (x, w1, w2), out, ptrs, arrived, kept


def _weighted(out):
    """(out * a fixed dense weight).sum(): a dense gradient reaches the op, as from a down
    projection (`.sum()` alone hands it an expanded one, which takes the copying path)."""
    return (out * torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view(out.shape)).sum()


def _grads_equal_eager(leaves, loss):
    torch.autograd.backward(loss)
    got = [t.grad.clone() for t in leaves]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    x, w1, w2 = ref_leaves
    torch.autograd.backward(_weighted(eager(x @ w1, x @ w2)))
    for what, g, r in zip(("x", "w1", "w2"), got, ref_leaves):
        assert_close(g, r.grad, torch.float32, what=f"grad of {what}")


def test_gradients_overwrite_gate_and_up_that_nothing_else_holds(device):
    """The backward writes the gradients of gate and up over gate and up when the graph is freed
    behind it and nothing else holds them (an MLP's two projections: 2 x tokens x intermediate
    bytes fewer at the backward's peak). Red when the gradients get fresh tensors."""
    leaves, out, ptrs, arrived, _ = _projections(device)
    _grads_equal_eager(leaves, _weighted(out))
    assert (arrived["gate"], arrived["up"]) == ptrs


@pytest.mark.parametrize("holder", ["user", "retain_graph", "an earlier backward", "dispatch mode"])
def test_gate_and_up_held_elsewhere_are_never_written(device, holder):
    """Fresh gradient tensors whenever gate or up can still be read: the caller keeps them (a
    forward hook's list), the graph is retained for a second backward, another node that runs
    later saved gate (sin: its backward reads gate), or the op path runs (a dispatch mode). Each
    red when the backward writes over them regardless."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    if holder == "an earlier backward":
        torch.manual_seed(0)
        x = torch.randn(6, 32, device=device, requires_grad=True)
        w1, w2 = (torch.randn(32, 300, device=device).div(4).requires_grad_() for _ in range(2))
        gate = x @ w1
        side = gate.sin()  # made before swiglu: its backward runs after swiglu's and reads gate
        loss = _weighted(swiglu(gate, x @ w2)) + side.sum()
        del gate
        torch.autograd.backward(loss)
        ref = [t.detach().double().requires_grad_() for t in (x, w1, w2)]
        g = ref[0] @ ref[1]
        torch.autograd.backward(_weighted(eager(g, ref[0] @ ref[2])) + g.sin().sum())
        for what, t, r in zip(("x", "w1", "w2"), (x, w1, w2), ref):
            assert_close(t.grad, r.grad, torch.float32, what=f"grad of {what}")
        return
    with (Passthrough() if holder == "dispatch mode" else contextlib.nullcontext()):
        leaves, out, ptrs, arrived, kept = _projections(device, keep=holder == "user")
        before = [t.clone() for t in kept]
        if holder == "retain_graph":
            _weighted(out).backward(retain_graph=True)
            assert arrived["gate"] != ptrs[0] and arrived["up"] != ptrs[1]
            first = [t.grad.clone() for t in leaves]
            for t in leaves:
                t.grad = None
        _grads_equal_eager(leaves, _weighted(out))  # a retained graph's last backward may write over them
    if holder != "retain_graph":
        assert arrived["gate"] != ptrs[0] and arrived["up"] != ptrs[1]
    for t, b in zip(kept, before):
        assert torch.equal(t, b), "a tensor the caller holds was written"
    if holder == "retain_graph":
        for t, f in zip(leaves, first):
            assert torch.equal(t.grad, f), "the second backward read overwritten gate and up"


_AFTER_A_RAISED_COMPILE = """
import json, os, sys
import torch

def raises(gm, inputs):
    raise RuntimeError("a backend that raises")

try:
    torch.compile(lambda t: t.sin() + 1, backend=raises, fullgraph=True)(torch.ones(3))
except Exception:
    pass
from accel_kernels.ops import _glu
from test_swiglu import _projections, _weighted

found = {"refs in a call": _glu._call_refs(object())}
for case in ("spent", "held"):
    _, out, ptrs, arrived, kept = _projections("cpu", keep=case == "held")
    before = [t.clone() for t in kept]
    torch.autograd.backward(_weighted(out))
    found[case] = [arrived["gate"] == ptrs[0], arrived["up"] == ptrs[1], all(map(torch.equal, kept, before))]
print(json.dumps(found))
"""


@pytest.mark.slow
def test_the_gradients_overwrite_gate_and_up_after_a_compile_has_raised():
    """Once a torch.compile has raised, dynamo's frame hook stays installed for the rest of the
    process (torch 2.11 and 2.13) and CPython runs no Python call inline: every argument holds one
    reference more inside a call. The backward still writes over gate and up that nothing holds,
    and still never over ones the caller keeps. In a child process: the hook would stay in this
    one. Red when `_spent` counts references as if every call ran inline (the gradients then get
    fresh tensors for the rest of the run), or lets the extra reference pass for a user's."""
    import json
    import pathlib
    import subprocess
    import sys

    from _env import child_env

    here = pathlib.Path(__file__).parent
    path = os.pathsep.join(map(str, (here, here.parent)))
    proc = subprocess.run([sys.executable, "-c", _AFTER_A_RAISED_COMPILE], capture_output=True, text=True,
                          env=child_env(TRITON_INTERPRET="1", PYTHONPATH=path), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["refs in a call"] == 3, f"the raised compile no longer leaves calls out of line: {found}"
    assert found["spent"] == [True, True, True], found
    assert found["held"] == [False, False, True], found


@pytest.mark.parametrize("missing", ["keep_graph", "use counts"])
def test_a_torch_without_the_private_counts_gets_fresh_gradients(device, monkeypatch, missing):
    """The in-place backward rests on private torch API (the graph task's keep_graph, the
    TensorImpl's and the storage's use counts); a torch without it takes the fresh-gradient path
    and trains as before, never raising. Red when a missing function is called."""
    from accel_kernels.ops import _glu

    if missing == "keep_graph":
        monkeypatch.setattr(dispatch, "_keep_graph", None)
    else:
        monkeypatch.setattr(_glu, "_storage_owners", None)
    leaves, out, ptrs, arrived, _ = _projections(device)
    _grads_equal_eager(leaves, _weighted(out))
    assert arrived["gate"] != ptrs[0] and arrived["up"] != ptrs[1]


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
