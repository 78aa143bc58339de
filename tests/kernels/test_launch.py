"""Every kernel launch goes through accel_kernels._launch.launch, which enters the tensors' device
guard and feeds recording(); the kernels keep the interpreter mode they were defined in."""
from __future__ import annotations

import contextlib
import importlib
import inspect
import pkgutil
import threading

import pytest
import torch

import accel_kernels
import accel_kernels._dispatch as dispatch
import accel_kernels._launch as launch
import accel_kernels._triton as triton_support
import accel_kernels.ops
import accel_kernels.ops.layer_norm as layer_norm_module
import accel_kernels.ops.rms_norm as rms_norm_module

JIT_TYPE = type(triton_support.cast_rounded)


def jit_functions() -> dict:
    """name -> @jit function, for every one defined in accel_kernels (the op modules and _triton)."""
    modules = [triton_support] + [importlib.import_module(f"accel_kernels.ops.{m.name}")
                                  for m in pkgutil.iter_modules(accel_kernels.ops.__path__)]
    found = {}
    for module in modules:
        for name, obj in vars(module).items():
            if isinstance(obj, JIT_TYPE) and obj.fn.__module__ == module.__name__:
                assert name not in found, f"two @jit functions named {name}: launch records names"
                found[name] = obj
    return found


def kernels() -> dict:
    return {name: fn for name, fn in jit_functions().items() if name.endswith("_kernel")}


def test_jit_functions_are_kernels_or_called_by_one():
    # the naming rule the enumeration below rests on: launched from the host = named *_kernel
    functions = jit_functions()
    sources = {name: inspect.getsource(fn.fn) for name, fn in functions.items()}
    assert len(kernels()) >= 8
    for name in functions:
        if not name.endswith("_kernel"):
            callers = [other for other, src in sources.items() if other != name and f"{name}(" in src]
            assert callers, f"@jit {name} is called by no other @jit function: a kernel must be named *_kernel"


def run_every_path(device, monkeypatch):
    """Forward and backward of every op, through every kernel-launching path."""
    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    x, w = leaf(3, 40), leaf(40)
    accel_kernels.rms_norm(x, w).sum().backward()
    with monkeypatch.context() as m:  # rows wider than one block: the backward's separate dot pass
        m.setattr(rms_norm_module, "_MAX_BLOCK_N", 16)
        accel_kernels.rms_norm(x, w).sum().backward()
    b = leaf(40)
    accel_kernels.layer_norm(x, w, b).sum().backward()
    with monkeypatch.context() as m:  # the same for layer_norm's dot pass
        m.setattr(layer_norm_module, "_MAX_BLOCK_N", 16)
        accel_kernels.layer_norm(x, w, b).sum().backward()
    q, k = leaf(1, 2, 3, 8), leaf(1, 1, 3, 8)
    cos, sin = torch.randn(1, 3, 8, device=device), torch.randn(1, 3, 8, device=device)
    torch.autograd.backward(accel_kernels.rope(q, k, cos, sin), [torch.ones_like(q), torch.ones_like(k)])
    gate, up = leaf(2, 30), leaf(2, 30)
    accel_kernels.swiglu(gate, up).sum().backward()
    halves = leaf(2, 60).chunk(2, dim=-1)  # a fused gate_up projection's halves: the row kernels
    torch.autograd.backward(accel_kernels.swiglu(*halves), torch.ones(2, 30, device=device))
    accel_kernels.geglu(gate, up, approximate="tanh").sum().backward()
    accel_kernels.relu_squared(up).sum().backward()
    labels = torch.tensor([1, 7, -100, 3], device=device)
    accel_kernels.cross_entropy(leaf(4, 20), labels).backward()
    h, weight = leaf(4, 8), leaf(20, 8)
    # "mean": gradients written by the forward kernel; "none": the backward kernel on recomputed chunks
    accel_kernels.fused_linear_cross_entropy(h, weight, labels, chunk_size=2).backward()
    accel_kernels.fused_linear_cross_entropy(h, weight, labels, reduction="none", chunk_size=2).sum().backward()
    index = torch.tensor([[0, 1], [1, 2], [2, 0]], device=device)
    accel_kernels.moe_experts(leaf(3, 16), index, leaf(3, 2), leaf(3, 32, 16), leaf(3, 16, 16)).sum().backward()


def test_every_kernel_is_launched_and_only_through_launch(device, monkeypatch):
    outside = []
    depth = [0]
    real_launch = launch.launch

    def counted_launch(*args, **kwargs):
        depth[0] += 1
        try:
            return real_launch(*args, **kwargs)
        finally:
            depth[0] -= 1

    real_run = JIT_TYPE.run

    def run(self, *args, **kwargs):  # what kernel[grid](...) ends in
        if depth[0] == 0:
            outside.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(launch, "launch", counted_launch)
    monkeypatch.setattr(JIT_TYPE, "run", run)
    with launch.recording() as launched:
        run_every_path(device, monkeypatch)
    assert outside == [], f"launched without accel_kernels._launch.launch: {outside}"
    assert set(launched) == set(kernels()), f"never launched: {set(kernels()) - set(launched)}"


def test_no_module_writes_a_launch_itself():
    # the runtime check above sees the paths it runs; this one sees every line
    sources = {m.name: inspect.getsource(importlib.import_module(f"accel_kernels.ops.{m.name}"))
               for m in pkgutil.iter_modules(accel_kernels.ops.__path__)}
    for name in kernels():
        for module, src in sources.items():
            assert f"{name}[" not in src, f"ops/{module}.py launches {name} itself: use _launch.launch"


class _FakeTensor(torch.Tensor):
    """Device metadata only: lets a CPU-only machine hand launch() a tensor on cuda:1."""

    @staticmethod
    def __new__(cls, device):
        return torch.Tensor._make_wrapper_subclass(cls, (4,), dtype=torch.float32, device=torch.device(device))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a fake tensor has no data ({func})")


class _FakeKernel:
    __name__ = "_fake_kernel"

    def __init__(self, current):
        self.current, self.calls = current, []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, self.current[-1], args, meta))


def test_launch_enters_the_device_of_its_tensors(monkeypatch):
    # Triton launches on the current device: a layer on cuda:1 must not run on cuda:0
    current = ["cuda:0"]

    @contextlib.contextmanager
    def cuda_device(device):
        current.append(str(torch.device(device)))
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, "device", cuda_device)
    kernel = _FakeKernel(current)
    a, b = _FakeTensor("cuda:1"), _FakeTensor("cuda:1")
    launch.launch(kernel, (3,), a, b, 4, BLOCK=8)
    [(grid, device, args, meta)] = kernel.calls
    assert device == "cuda:1", "launched on the current device, not on its tensors' one"
    assert grid == (3,) and args[0] is a and args[1] is b and args[2] == 4 and meta == {"BLOCK": 8}
    assert current == ["cuda:0"]  # restored after the launch
    launch.launch(kernel, (1,), torch.zeros(2), 4)  # CPU tensors: no device guard entered
    assert kernel.calls[-1][1] == "cuda:0"


def test_launch_enters_no_guard_when_its_device_is_already_current(monkeypatch):
    # entering and leaving torch.cuda.device costs microseconds a launch: skipped on the current device
    entered = []

    @contextlib.contextmanager
    def cuda_device(device):
        entered.append(str(torch.device(device)))
        yield

    monkeypatch.setattr(torch.cuda, "device", cuda_device)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    kernel = _FakeKernel(["cuda:1"])
    launch.launch(kernel, (1,), _FakeTensor("cuda:1"), 4)
    assert entered == [] and len(kernel.calls) == 1
    launch.launch(kernel, (1,), _FakeTensor("cuda:0"), 4)
    assert entered == ["cuda:0"] and len(kernel.calls) == 2


def test_launch_refuses_tensors_on_two_devices():
    kernel = _FakeKernel(["cpu"])
    with pytest.raises(ValueError, match=r"_fake_kernel: tensor arguments on cuda:0 and cuda:1"):
        launch.launch(kernel, (1,), _FakeTensor("cuda:0"), 3, _FakeTensor("cuda:1"))
    with pytest.raises(ValueError, match="_fake_kernel: no tensor argument"):
        launch.launch(kernel, (1,), 3)
    assert kernel.calls == []


def test_recording_sees_every_thread_and_nests():
    kernel = _FakeKernel(["cpu"])
    with launch.recording() as outer:
        launch.launch(kernel, (1,), torch.zeros(1))
        with launch.recording() as inner:
            # autograd runs GPU backwards on its own threads: their launches count too
            worker = threading.Thread(target=launch.launch, args=(kernel, (1,), torch.zeros(1)))
            worker.start()
            worker.join()
        launch.launch(kernel, (1,), torch.zeros(1))
    launch.launch(kernel, (1,), torch.zeros(1))
    assert outer == ["_fake_kernel"] * 3 and inner == ["_fake_kernel"]
    assert len(kernel.calls) == 4


def test_kernels_keep_the_interpreter_mode_they_were_defined_in(monkeypatch):
    # triton fixed each kernel's mode when it decorated it; the environment read later must not
    # send CPU tensors to kernels compiled for a GPU, nor the reverse
    defined_interpreted = type(triton_support.cast_rounded).__name__ == "InterpretedFunction"
    assert dispatch.interpreting() == defined_interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "0" if defined_interpreted else "1")
    assert dispatch.interpreting() == defined_interpreted
    assert dispatch.use_triton(torch.zeros(1)) == defined_interpreted
    with launch.recording() as launched:
        accel_kernels.rms_norm(torch.randn(2, 8), torch.ones(8))
    assert bool(launched) == defined_interpreted
