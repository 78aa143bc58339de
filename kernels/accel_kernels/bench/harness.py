"""The measuring harness: the correctness guard, then time and peak memory of one implementation
of one op, on CUDA (CUDA events around each call, torch.profiler's kernel times, torch.cuda memory
stats) or on CPU (wall time, ru_maxrss, one fresh process per measurement). Every function returns
a record (a dict); none prints.

On CUDA every call gets fresh inputs, made before the timed region: new leaves, each handed over
through a clone (a non-leaf tensor, as a model's projection hands its output to the next op), so an
implementation that writes into its inputs or its saved tensors (Liger's SwiGLU, GeGLU and RoPE
backwards do) measures as it runs inside a model, and every implementation is timed the same way.
Two times per figure: the host-inclusive time (CUDA events around the call: launches and host code
included, as a training step pays them) and the device time (the sum of the call's kernel durations
from torch.profiler: what the GPU spends, the figure a bytes model is held to).
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from .catalogue import OPS, Op

IMPLS = ("accel_kernels", "eager", "torch.compile", "liger")
CHECK_TOL = 1e-3  # ||impl - eager|| / ||eager|| in fp32; loose enough for tf32 matmuls, far under a real bug

# timed calls per figure on CUDA (host-inclusive, device by the profiler): --quick, full run
CUDA_REPS = {True: (10, 3), False: (50, 10)}
# forward+backward runs after the warm-up on CPU: --quick, full run
CPU_REPS = {True: 1, False: 3}


def _outputs(result) -> tuple:
    """An op's result as a tuple of tensors (Liger's losses come as (loss, None))."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return tuple(t for t in items if t is not None)


def _upstream(outs) -> list:
    """Gradients to feed backward: ones for a loss, else the outputs' own values (no new memory)."""
    return [torch.ones_like(o) if o.dim() == 0 else o.detach() for o in outs]


def _fwd_bwd(fn, inputs):
    outs = _outputs(fn(*inputs))
    torch.autograd.backward(outs, _upstream(outs))
    return outs


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(op: Op, fn, device) -> float:
    """Worst relative error of fn's outputs and input grads vs eager, fp32, small shape (fresh inputs each)."""
    torch.manual_seed(0)
    inputs = op.make(device, torch.float32, **op.shapes["check"])
    results = []
    for f in (fn, op.eager):  # fresh copies: some implementations write into their inputs
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        # handed over as non-leaf tensors, as in a model (an in-place write into a leaf's view raises)
        outs = _outputs(f(*[t.clone() if t.requires_grad else t for t in leaves]))
        kept = [o.detach().clone() for o in outs]  # some backwards write into outputs or upstream grads
        gen = torch.Generator().manual_seed(1)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o) for o in outs])
        results.append(kept + [t.grad for t in leaves if t.requires_grad])
    return max(_rel_err(a, b) for a, b in zip(*results))


def implementation(op: Op, impl: str):
    if impl == "eager":
        return op.eager
    if impl == "accel_kernels":
        return op.ours
    if impl == "torch.compile":
        return torch.compile(op.eager, dynamic=False)
    if op.liger is None:
        raise ImportError("Liger Kernel has no such op")
    import liger_kernel  # noqa: F401  (ImportError: not installed)
    return op.liger


def _fresh(inputs) -> list:
    """New leaves with the inputs' values, each handed over through a clone (a non-leaf tensor);
    tensors that need no grad are passed as they are (labels, indices)."""
    out = []
    for t in inputs:
        if t.requires_grad:
            out.append(t.detach().clone().requires_grad_().clone())
        else:
            out.append(t)
    return out


def _profiled_device_ms(run_once) -> float:
    """Sum of the kernel (and device copy or fill) durations of one `run_once()`, in ms: the device
    events alone (a CPU op's own "device time" is its kernels' again)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_once()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA) / 1e3


def measure_cuda(fn, inputs, reps: int, device_reps: int) -> dict:
    """Median fwd, bwd, fwd+bwd times (ms, host-inclusive: CUDA events around the call), the device
    time of each (ms: kernel durations, torch.profiler, median of `device_reps`) and the peak memory
    (MiB) each step adds. Each call gets fresh inputs made before its timed region (_fresh)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # larger than L2, as do_bench flushes

    def peak_mib(step) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def forward(args):
        return _outputs(fn(*args))

    def backward(outs):
        torch.autograd.backward(outs, _upstream(outs))

    def calls(kind):
        """(untimed preparation -> state, the timed call on that state) of one figure."""
        if kind == "fwd":
            return (lambda: _fresh(inputs)), forward
        if kind == "bwd":
            return (lambda: forward(_fresh(inputs))), backward
        return (lambda: _fresh(inputs)), (lambda args: backward(forward(args)))

    _fwd_bwd(fn, _fresh(inputs))  # warm-up: compiles (Triton JIT, torch.compile) stay out of the numbers
    args = _fresh(inputs)
    held = []
    fwd_mib = peak_mib(lambda: held.append(forward(args)))
    bwd_mib = peak_mib(lambda: backward(held[0]))
    held.clear()
    args = _fresh(inputs)
    fb_mib = peak_mib(lambda: backward(forward(args)))
    del args
    figures = dict(fwd_mib=fwd_mib, bwd_mib=bwd_mib, fb_mib=fb_mib, reps=reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for kind in ("fwd", "bwd", "fb"):
        prepare, call = calls(kind)
        times = []
        for _ in range(reps):
            state = prepare()
            flush.zero_()
            start.record()
            call(state)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            del state
        device = []
        for _ in range(device_reps):
            state = prepare()
            torch.cuda.synchronize()
            device.append(_profiled_device_ms(lambda: call(state)))
            del state
        figures[f"{kind}_ms"] = statistics.median(times)
        figures[f"dev_{kind}_ms"] = statistics.median(device) if device else None
    del flush
    return figures


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_cpu(fn, inputs, reps) -> dict:
    """Peak memory from the process high-water mark (so: one fresh process per measurement), then the
    forward+backward time (the one CPU time; fwd and bwd alone are not timed, to keep the run short)."""
    leaves = [t for t in inputs if t.requires_grad]
    base = _maxrss_mib()
    outs = _outputs(fn(*inputs))
    fwd_mib = _maxrss_mib() - base
    torch.autograd.backward(outs, _upstream(outs))
    fb_mib = _maxrss_mib() - base
    del outs
    times = []
    for _ in range(reps):  # the measured run above was the warm-up
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        _fwd_bwd(fn, inputs)
        times.append(time.perf_counter() - t0)
    return dict(fb_ms=1e3 * statistics.median(times), fwd_mib=fwd_mib, fb_mib=fb_mib, reps=reps)


def run_one(name: str, impl: str, device: str, quick: bool) -> dict:
    """Check, then measure one implementation of one op: a record with status "ok", "FAILED" (and a
    note) or "skipped" (never raises)."""
    op = OPS[name]
    row = dict(op=name, impl=impl)
    try:
        fn = implementation(op, impl)
    except ImportError as e:
        return dict(row, status="skipped", note=f"not installed ({e})" if impl == "liger" else str(e))
    try:
        err = check(op, fn, device)
        row["check_err"] = err
        if not err <= CHECK_TOL:
            return dict(row, status="FAILED", note=f"disagrees with eager in fp32: rel err {err:.2e} > {CHECK_TOL:.0e}")
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        torch.manual_seed(0)
        inputs = op.make(device, dtype, **op.shapes["gpu" if device == "cuda" else "cpu"])
        if device == "cuda":
            reps, device_reps = CUDA_REPS[quick]
            row.update(measure_cuda(fn, inputs, reps=reps, device_reps=device_reps))
        else:
            row.update(measure_cpu(fn, inputs, reps=CPU_REPS[quick]))
        return dict(row, status="ok")
    except Exception as e:  # one broken implementation must not hide the others' figures
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return dict(row, status="FAILED", note=f"{type(e).__name__}: {lines[0][:150] if lines else ''}")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def run_one_in_subprocess(name: str, impl: str, quick: bool) -> dict:
    """run_one on CPU in a fresh process (`python -m accel_kernels.bench --child op:impl`)."""
    env = dict(os.environ, TRITON_INTERPRET="0")  # the plain-torch twins, not the Triton interpreter
    cmd = [sys.executable, "-m", "accel_kernels.bench", "--child", f"{name}:{impl}"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(op=name, impl=impl, status="FAILED", note=f"child exited {proc.returncode}: {proc.stderr.strip()[-200:]}")


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read plus bytes written."""
    from triton.testing import do_bench

    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    gbs = 2 * src.nbytes / (ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return gbs
