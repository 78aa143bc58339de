"""Every Triton launch in accel_kernels goes through `launch` (tests check that no op module writes
`kernel[grid](...)` itself), so that what every launch needs is done in one place:

- the device guard: triton launches on the backend's *current* device, but the layers of one model
  may live on several GPUs (device_map over GPUs, pipeline stages); `launch` enters the device of
  the kernel's tensor arguments (torch.cuda.device / torch.xpu.device) for the launch, unless that
  device is the current one already (a model on one GPU: no guard, microseconds a launch saved);
- the device check: all tensor arguments of one launch must be on one device;
- recording: `recording()` lists the kernels launched while it is active, so tests can prove that
  a swapped model really ran each kernel;
- capture: under `capturing()` a launch is recorded with everything it was given (kernel, grid,
  arguments, meta) and not run, so host code driven by meta tensors of real shapes shows which
  configurations it launches (`accel_kernels.codegen` compiles them ahead of time for GPUs).

Also here: `cdiv` and `next_power_of_2`, the grid arithmetic of the host functions, so that host
code needs no triton import.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator

import torch


# the lists of the active recordings; appended to under the lock, from any thread
_recorders: list[list[str]] = []
_recorders_lock = threading.Lock()
# the lists of the active captures (same lock): while one is active nothing is launched
_captures: list[list["Launch"]] = []


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch as the host code asked for it (what `capturing()` yields)."""

    kernel: object  # the @jit function
    grid: tuple
    args: tuple
    meta: dict

    @property
    def name(self) -> str:
        return _kernel_name(self.kernel)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def launch(kernel, grid, *args, **meta) -> None:
    """Run `kernel[grid](*args, **meta)` on the device of its tensor arguments.

    kernel: a `@triton.jit` function; grid: a tuple or a callable of the meta-parameters, as
    triton takes it; args: the kernel's positional arguments, of which at least one is a tensor;
    meta: constexpr arguments and launch options (num_warps...). Raises ValueError naming the
    kernel when its tensor arguments are on different devices or when it has none.
    """
    device = _device_of(kernel, args)
    if _recorders:
        name = _kernel_name(kernel)
        with _recorders_lock:
            for names in _recorders:
                names.append(name)
    if _captures:
        with _recorders_lock:
            for launches in _captures:
                launches.append(Launch(kernel, grid, args, dict(meta)))
        return
    if device.type not in _GUARDED or _is_current(device):
        kernel[grid](*args, **meta)
        return
    with _device_guard(device):
        kernel[grid](*args, **meta)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Yield a list that receives the name of every kernel launched while the block runs.

    Names are the kernel functions' names (e.g. "_rms_norm_fwd_kernel"), one entry per launch, in
    launch order. Launches from every thread count: autograd runs CUDA backwards on its own device
    threads. Recordings may nest; each sees every launch made while it is active.

        with accel_kernels._launch.recording() as launched:
            loss = model(**batch).loss
            loss.backward()
        assert "_rms_norm_bwd_kernel" in launched
    """
    names: list[str] = []
    with _recorders_lock:
        _recorders.append(names)
    try:
        yield names
    finally:
        with _recorders_lock:
            # by identity: two recordings with equal contents are still two recordings
            del _recorders[next(i for i, r in enumerate(_recorders) if r is names)]


@contextlib.contextmanager
def capturing() -> Iterator[list[Launch]]:
    """Yield a list that receives every launch made while the block runs, as a `Launch`; none of
    them runs (their outputs keep whatever their allocation held). Made for host code driven by
    meta tensors: the shapes, strides and dtypes are real, there is no data and no GPU.

        with accel_kernels._launch.capturing() as launches:
            rms_norm_module._forward_triton(torch.empty(8192, 4096, device="meta", dtype=torch.bfloat16), ...)
        [(launch.name, launch.grid, launch.meta) for launch in launches]
    """
    launches: list[Launch] = []
    with _recorders_lock:
        _captures.append(launches)
    try:
        yield launches
    finally:
        with _recorders_lock:
            del _captures[next(i for i, c in enumerate(_captures) if c is launches)]


def _kernel_name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def _device_of(kernel, args) -> torch.device:
    device = None
    for a in args:
        if isinstance(a, torch.Tensor):
            if device is None:
                device = a.device
            elif a.device != device:
                raise ValueError(
                    f"{_kernel_name(kernel)}: tensor arguments on {device} and {a.device}; "
                    f"every tensor of one launch must be on one device"
                )
    if device is None:
        raise ValueError(f"{_kernel_name(kernel)}: no tensor argument to take the device from")
    return device


_GUARDED = ("cuda", "xpu")


def _is_current(device: torch.device) -> bool:
    """Whether device is already the backend's current one (then no guard is entered: entering and
    leaving torch.cuda.device costs microseconds a launch, and a model on one GPU never needs it).
    False before CUDA is initialized, and for xpu (always guarded)."""
    return device.type == "cuda" and torch.cuda.is_initialized() and device.index == torch.cuda.current_device()


def _device_guard(device: torch.device):
    # makes `device` the current one for the launch, and restores the previous one after it
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "xpu":
        return torch.xpu.device(device)
    return contextlib.nullcontext()
