"""The measuring harness: the correctness guard, then time and peak memory of one implementation
of one op, on CUDA (triton.testing.do_bench, torch.cuda memory stats) or on CPU (wall time,
ru_maxrss, one fresh process per measurement). Every function returns a record (a dict); none
prints.
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

# do_bench's warm-up and measuring time per figure, ms: --quick, full run
CUDA_BENCH_MS = {True: (10, 50), False: (50, 300)}
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
        fresh = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        outs = _outputs(f(*fresh))
        kept = [o.detach().clone() for o in outs]  # some backwards write into outputs or upstream grads
        gen = torch.Generator().manual_seed(1)
        torch.autograd.backward(outs, [torch.randn(o.shape, generator=gen).to(o) for o in outs])
        results.append(kept + [t.grad for t in fresh if t.requires_grad])
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


def measure_cuda(fn, inputs, warmup_ms, rep_ms) -> dict:
    """Median fwd, bwd, fwd+bwd times (ms) and the peak memory (MiB) each step adds."""
    from triton.testing import do_bench

    leaves = [t for t in inputs if t.requires_grad]

    def clear_grads():
        for t in leaves:
            t.grad = None

    def peak_mib(step) -> float:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    _fwd_bwd(fn, inputs)  # warm-up: compiles (Triton JIT, torch.compile) stay out of the numbers
    clear_grads()
    held = []
    fwd_mib = peak_mib(lambda: held.append(_outputs(fn(*inputs))))
    bwd_mib = peak_mib(lambda: torch.autograd.backward(held[0], _upstream(held[0])))
    held.clear()
    clear_grads()
    fb_mib = peak_mib(lambda: _fwd_bwd(fn, inputs))
    clear_grads()

    def bench(f):
        return do_bench(f, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves, return_mode="median")

    fwd_ms = bench(lambda: fn(*inputs))
    outs = _outputs(fn(*inputs))
    bwd_ms = bench(lambda: torch.autograd.backward(outs, _upstream(outs), retain_graph=True))
    del outs
    fb_ms = bench(lambda: _fwd_bwd(fn, inputs))
    return dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms, fb_ms=fb_ms, fwd_mib=fwd_mib, bwd_mib=bwd_mib, fb_mib=fb_mib)


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
            warmup_ms, rep_ms = CUDA_BENCH_MS[quick]
            row.update(measure_cuda(fn, inputs, warmup_ms=warmup_ms, rep_ms=rep_ms))
        else:
            row.update(measure_cpu(fn, inputs, reps=CPU_REPS[quick]))
        return dict(row, status="ok")
    except Exception as e:  # one broken implementation must not hide the others' figures
        return dict(row, status="FAILED", note=f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")
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
