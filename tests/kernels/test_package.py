"""The package as a user meets it: imports without triton, keeps the interpreter mode of its import,
one meaning per dotted path, and input checks that say what was wrong."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import accel_kernels
import accel_kernels._dispatch as dispatch
from _checks import FP32_BOUND

OPS = ["cross_entropy", "fused_linear_cross_entropy", "geglu", "layer_norm", "moe_experts", "relu_squared", "rms_norm", "rope", "swiglu"]


def run_python(code: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh process (from tmp_path, so the checkout is not on sys.path)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ,
                          capture_output=True, text=True, timeout=120)


# Every public op, forward and backward in float32, against its eager formula in float64; prints
# {op: worst relative error} as JSON. Used where triton cannot be imported.
EVERY_OP_AGAINST_FLOAT64 = r'''
import json, torch, torch.nn.functional as F
import accel_kernels as ak

def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)

def eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

labels = torch.tensor([3, -100, 0, 9])
moe_index = torch.tensor([[0, 2], [2, 1], [1, 3], [3, 0]])

def eager_moe(x, w, gu, d):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(2):
            e = int(moe_index[t, k])
            gate, up = F.linear(x[t], gu[e]).chunk(2, -1)
            out[t] += w[t, k] * F.linear(F.silu(gate) * up, d[e])
    return out

CASES = {  # op: (ours, eager, inputs)
    "rms_norm": (lambda x, w: ak.rms_norm(x, w),
                 lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
                 [torch.randn(3, 16), torch.rand(16) + 0.5]),
    "layer_norm": (lambda x, w, b: ak.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (16,), w, b),
                   [torch.randn(3, 16) + 2.0, torch.rand(16) + 0.5, torch.randn(16)]),
    "rope": (lambda q, k, c, s: ak.rope(q, k, c, s), eager_rope,
             [torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(1, 5, 8), torch.randn(1, 5, 8)]),
    "swiglu": (ak.swiglu, lambda g, u: F.silu(g) * u, [torch.randn(4, 24), torch.randn(4, 24)]),
    "geglu": (ak.geglu, lambda g, u: F.gelu(g) * u, [torch.randn(4, 24), torch.randn(4, 24)]),
    "relu_squared": (ak.relu_squared, lambda x: torch.relu(x) ** 2, [torch.randn(4, 24)]),
    "cross_entropy": (lambda z: ak.cross_entropy(z, labels), lambda z: F.cross_entropy(z, labels),
                      [torch.randn(4, 10)]),
    "fused_linear_cross_entropy": (
        lambda h, w: ak.fused_linear_cross_entropy(h, w, labels, chunk_size=3),
        lambda h, w: F.cross_entropy(h @ w.T, labels), [torch.randn(4, 6), torch.randn(10, 6)]),
    "moe_experts": (lambda x, w, gu, d: ak.moe_experts(x, moe_index, w, gu, d), eager_moe,
                    [torch.randn(4, 8), torch.rand(4, 2), torch.randn(4, 12, 8), torch.randn(4, 8, 6)]),
}

def forward_backward(fn, inputs):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(1)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in leaves]

def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("inf")

torch.manual_seed(0)
errors = {}
with ak._launch.recording() as launched:
    for name, (ours, eager, inputs) in CASES.items():
        got = forward_backward(ours, inputs)
        ref = forward_backward(eager, [t.double() for t in inputs])
        assert [g.dtype for g in got[-len(inputs):]] == [t.dtype for t in inputs], name
        errors[name] = max(rel_err(g, r) for g, r in zip(got, ref))
assert launched == [], launched
print(json.dumps(errors))
'''

BLOCK_TRITON = r'''
import importlib.abc, sys

class BlockTriton(importlib.abc.MetaPathFinder):
    """As on a machine without triton: every import of it fails."""
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, BlockTriton())
'''


@pytest.mark.slow  # over 2 s: a subprocess or a Trainer run
def test_every_op_runs_its_twin_without_triton(tmp_path):
    # pyproject installs triton on Linux only; TRITON_INTERPRET=1 asks for kernels that cannot exist
    code = BLOCK_TRITON + r'''
import accel_kernels, torch
from accel_kernels import _dispatch, _triton
assert "triton" not in sys.modules and not _triton.AVAILABLE
assert "ImportError" in _triton.IMPORT_ERROR
assert not _dispatch.interpreting() and not _dispatch.use_triton(torch.zeros(1))
''' + EVERY_OP_AGAINST_FLOAT64
    proc = run_python(code, tmp_path, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(errors) == OPS
    for name, err in errors.items():
        assert err <= FP32_BOUND, f"{name}: relative error {err:.3e} against float64"


def test_a_launch_without_triton_says_why(monkeypatch):
    kernel = accel_kernels._triton._NoTritonKernel(lambda x: x)
    monkeypatch.setattr(accel_kernels._triton, "IMPORT_ERROR", "ImportError: No module named 'triton'")
    with pytest.raises(RuntimeError, match=r"cannot launch <lambda>: triton could not be imported \(ImportError"):
        accel_kernels._launch.launch(kernel, (1,), torch.zeros(1))


@pytest.mark.slow  # over 2 s: a subprocess or a Trainer run
def test_interpreter_mode_is_the_one_at_import(tmp_path):
    # kernels defined for the GPU (no TRITON_INTERPRET at import) never meet CPU tensors, even once
    # the variable appears later, as when a test conftest sets it in a process that already imported
    code = r'''
import os, torch, accel_kernels
from accel_kernels import _dispatch, _launch
assert not _dispatch.interpreting()
os.environ["TRITON_INTERPRET"] = "1"
assert not _dispatch.interpreting() and not _dispatch.use_triton(torch.zeros(1))
with _launch.recording() as launched:
    y = accel_kernels.swiglu(torch.randn(2, 8), torch.randn(2, 8))
assert launched == [] and y.shape == (2, 8)
print("ok")
'''
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_a_dotted_path_means_one_thing():
    for op in OPS:
        function = getattr(accel_kernels, op)
        module = importlib.import_module(f"accel_kernels.ops.{op}")
        assert isinstance(function, types.FunctionType) and isinstance(module, types.ModuleType)
        assert getattr(module, op) is function and function.__module__ == module.__name__
    # accel_kernels.ops exports nothing of its own: only its submodules hang off it
    public = {n for n, v in vars(accel_kernels.ops).items() if not n.startswith("_")}
    assert all(isinstance(getattr(accel_kernels.ops, n), types.ModuleType) for n in public)
    assert sorted(accel_kernels.__all__) == OPS


def _valid_arguments(device="cpu") -> dict:
    """op -> (function, keyword arguments that it accepts), tensors on `device`."""
    with torch.device(device):
        labels = torch.tensor([1, 0, 2])
        cases = {
            "rms_norm": (accel_kernels.rms_norm, dict(x=torch.randn(3, 8), weight=torch.rand(8) + 0.5,
                                                      gate=torch.randn(3, 8))),
            "layer_norm": (accel_kernels.layer_norm, dict(x=torch.randn(3, 8), weight=torch.rand(8) + 0.5,
                                                          bias=torch.randn(8))),
            "rope": (accel_kernels.rope, dict(q=torch.randn(1, 2, 3, 4), k=torch.randn(1, 1, 3, 4),
                                              cos=torch.randn(1, 3, 4), sin=torch.randn(1, 3, 4))),
            "swiglu": (accel_kernels.swiglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 8))),
            "geglu": (accel_kernels.geglu, dict(gate=torch.randn(3, 8), up=torch.randn(3, 8))),
            "relu_squared": (accel_kernels.relu_squared, dict(x=torch.randn(3, 8))),
            "cross_entropy": (accel_kernels.cross_entropy, dict(logits=torch.randn(3, 5), labels=labels)),
            "fused_linear_cross_entropy": (accel_kernels.fused_linear_cross_entropy,
                                           dict(hidden=torch.randn(3, 4), weight=torch.randn(5, 4), labels=labels,
                                                bias=torch.zeros(5))),
            "moe_experts": (accel_kernels.moe_experts,
                            dict(hidden=torch.randn(3, 4), top_k_index=torch.tensor([[0], [1], [0]]),
                                 top_k_weights=torch.rand(3, 1), gate_up=torch.randn(2, 6, 4), down=torch.randn(2, 4, 3),
                                 gate_up_bias=torch.zeros(2, 6), down_bias=torch.zeros(2, 4))),
        }
    return cases


TENSOR_ARGUMENTS = [(op, arg) for op, (_, kwargs) in _valid_arguments().items() for arg in kwargs]


@pytest.mark.parametrize("op, argument", TENSOR_ARGUMENTS)
def test_non_tensor_argument_is_named_with_its_type(op, argument):
    fn, kwargs = _valid_arguments()[op]
    fn(**kwargs)  # the valid call works: what fails below is the one argument
    for value, type_name in ((kwargs[argument].numpy(), "numpy.ndarray"), (kwargs[argument].tolist(), "list")):
        with pytest.raises(ValueError, match=rf"^{argument} must be a torch\.Tensor .+, got {type_name}$"):
            fn(**dict(kwargs, **{argument: value}))


def test_every_tensor_argument_is_covered():
    # a new tensor argument of a public op must join the parametrization above
    import inspect

    for op, (fn, kwargs) in _valid_arguments().items():
        tensor_params = [p.name for p in inspect.signature(fn).parameters.values()
                         if "Tensor" in str(p.annotation)]
        assert tensor_params == list(kwargs), op


def test_float_check_names_the_dtype_and_what_is_valid():
    with pytest.raises(ValueError, match=r"^x must be a floating-point tensor, got torch.int64; expected float32, "
                                         r"bfloat16 or float16 \(float64 runs the plain-torch twin\)$"):
        accel_kernels.rms_norm(torch.ones(2, 8, dtype=torch.long), torch.ones(8))


@pytest.mark.parametrize("path", ["triton", "twin"])
@pytest.mark.parametrize("op", OPS)
def test_second_derivatives_are_right_or_refused(device, monkeypatch, op, path):
    # a backward autograd cannot see through would be a constant in a create_graph=True graph:
    # g.sum() + x.square().sum() would silently lose this op's part of the second derivative
    if path == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    fn, kwargs = _valid_arguments(device)[op]
    if path == "twin" and op in ("rms_norm", "rope", "layer_norm"):
        # these twins are the stock formula differentiated by autograd: second order included
        names = list(kwargs)
        # casting="none": every step in float64 (the others normalize in float32, too coarse for
        # finite differences)
        options = dict(casting="none") if op == "rms_norm" else {}
        inputs = [kwargs[n].double().requires_grad_() for n in names]
        assert torch.autograd.gradgradcheck(lambda *ts: fn(**dict(zip(names, ts)), **options), inputs)
        return
    # cos and sin without grad, as transformers builds them: else rope takes its twin
    leaves = {n: v.requires_grad_(v.is_floating_point() and n not in ("cos", "sin")) for n, v in kwargs.items()}
    outs = fn(**leaves)
    first = outs[0] if isinstance(outs, tuple) else outs
    x = next(v for v in leaves.values() if v.requires_grad)
    with pytest.raises(RuntimeError, match=rf"^{op} gives first-order gradients only"):
        torch.autograd.grad(first.sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(fn(**leaves)[0].sum() if isinstance(outs, tuple) else fn(**leaves).sum(), x)
    assert torch.isfinite(g).all()  # first order still works


def test_numpy_is_what_the_check_names(monkeypatch):
    # the message names the type as a user would import it, not a bare class name
    with pytest.raises(ValueError, match=r"got numpy\.ndarray$"):
        accel_kernels.swiglu(np.zeros((2, 3), dtype=np.float32), torch.zeros(2, 3))
