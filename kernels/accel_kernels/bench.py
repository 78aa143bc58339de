"""Benchmark accel_kernels against eager torch, torch.compile and Liger Kernel.

    python -m accel_kernels.bench [--quick] [--ops rms_norm,rope,...] [--json PATH]

On a CUDA GPU: one table per op at LLM-scale shapes in bf16 (llama-3-8B: hidden 4096,
intermediate 14336, 32 q / 8 kv heads of 128, vocab 128256; 8192 tokens = batch 4 x seq 2048):
forward, backward and forward+backward median times (triton.testing.do_bench, CUDA events, L2
flushed between reps), peak memory of each step (torch.cuda.max_memory_allocated minus what was
allocated before the step), achieved bandwidth of memory-bound ops against a device-to-device copy
measured at start, and speedups vs eager and Liger. --quick takes fewer reps and skips
torch.compile (its compile time alone would not fit the 5 minutes).

On CPU: the plain-torch paths at small float32 shapes, each variant in a fresh subprocess so that
peak memory can be read honestly from the kernel's high-water mark (ru_maxrss after the step minus
ru_maxrss after the inputs were built), then the figure that matters on CPU: fused linear
cross-entropy vs eager `F.cross_entropy(hidden @ weight.T, labels)` in memory and time.

Before timing, every implementation runs once in float32 at a small shape and its output and
input gradients are compared with eager's; a row that disagrees is marked FAILED and not timed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import accel_kernels

IMPLS = ("accel_kernels", "eager", "torch.compile", "liger")
CHECK_TOL = 1e-3  # ||impl - eager|| / ||eager|| in fp32; loose enough for tf32 matmuls, far under a real bug
CPU_FLCE_TARGET = {"memory": 0.25, "time": 1.5}  # fused linear CE vs eager on CPU: at most these ratios


class Op(NamedTuple):
    shapes: dict  # "gpu", "cpu", "check" -> keyword arguments of make
    make: Callable  # (device, dtype, **shape) -> list of inputs; the ones to differentiate require grad
    eager: Callable  # the transformers-style formula in plain torch
    ours: Callable
    liger: Callable | None  # imports liger_kernel when called; None where Liger has no such op
    bytes_moved: Callable | None  # (element size, **shape) -> bytes fwd+bwd must move; None if not memory-bound


def _randn(*shape, device, dtype, grad=True):
    return torch.randn(*shape, device=device).to(dtype).requires_grad_(grad)


def _labels(n, vocab, device):
    labels = torch.randint(0, vocab, (n,), device=device)
    return labels.masked_fill(torch.rand(n, device=device) < 0.1, -100)  # some ignored tokens, as in SFT


# --- rms_norm: transformers' LlamaRMSNorm ---
def _eager_rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _liger_rms_norm(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    return LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)  # in_place=False


RMS_NORM = Op(
    shapes={"gpu": dict(batch=4, seq=2048, hidden=4096), "cpu": dict(batch=4, seq=512, hidden=1024),
            "check": dict(batch=2, seq=8, hidden=256)},
    make=lambda device, dtype, batch, seq, hidden: [
        _randn(batch, seq, hidden, device=device, dtype=dtype),
        (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()],
    eager=_eager_rms_norm,
    ours=lambda x, w: accel_kernels.rms_norm(x, w, eps=1e-6),
    liger=_liger_rms_norm,
    # fwd reads x, writes y; bwd reads dy, x, writes dx (the weight and its grad are one row)
    bytes_moved=lambda e, batch, seq, hidden: 5 * batch * seq * hidden * e,
)


# --- swiglu / geglu: LlamaMLP's act_fn(gate_proj(x)) * up_proj(x) ---
def _liger_swiglu(g, u):
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    return LigerSiLUMulFunction.apply(g, u)


def _liger_geglu(g, u):
    from liger_kernel.ops.geglu import LigerGELUMulFunction  # tanh approximation only
    return LigerGELUMulFunction.apply(g, u)


def _glu_op(eager, ours, liger):
    return Op(
        shapes={"gpu": dict(tokens=8192, intermediate=14336), "cpu": dict(tokens=2048, intermediate=2816),
                "check": dict(tokens=16, intermediate=300)},
        make=lambda device, dtype, tokens, intermediate: [
            _randn(tokens, intermediate, device=device, dtype=dtype) for _ in range(2)],
        eager=eager, ours=ours, liger=liger,
        # fwd reads gate, up, writes out; bwd reads dout, gate, up, writes dgate, dup
        bytes_moved=lambda e, tokens, intermediate: 8 * tokens * intermediate * e,
    )


SWIGLU = _glu_op(lambda g, u: F.silu(g) * u, accel_kernels.swiglu, _liger_swiglu)
# tanh, as Gemma's gelu_pytorch_tanh: the GeGLU Liger implements
GEGLU = _glu_op(lambda g, u: F.gelu(g, approximate="tanh") * u,
                lambda g, u: accel_kernels.geglu(g, u, approximate="tanh"), _liger_geglu)


# --- rope: transformers' apply_rotary_pos_emb on q, k as attention makes them ---
def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _eager_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _make_rope(device, dtype, batch, seq, q_heads, kv_heads, head_dim):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = torch.arange(seq, device=device).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(batch, seq, head_dim)
    # q, k as projections give them, (B, S, H, D); every implementation sees the (B, H, S, D) view
    return [_randn(batch, seq, q_heads, head_dim, device=device, dtype=dtype),
            _randn(batch, seq, kv_heads, head_dim, device=device, dtype=dtype),
            emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()]


def _heads_first(fn):
    return lambda q, k, cos, sin: fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def _liger_rope(q, k, cos, sin):
    from liger_kernel.ops.rope import LigerRopeFunction
    return LigerRopeFunction.apply(q, k, cos, sin, None, 1)


ROPE = Op(
    shapes={"gpu": dict(batch=4, seq=2048, q_heads=32, kv_heads=8, head_dim=128),
            "cpu": dict(batch=1, seq=512, q_heads=32, kv_heads=8, head_dim=128),
            "check": dict(batch=2, seq=16, q_heads=4, kv_heads=2, head_dim=64)},
    make=_make_rope,
    eager=_heads_first(_eager_rope),
    ours=_heads_first(accel_kernels.rope),
    liger=_heads_first(_liger_rope),
    # each pass reads q, k, cos, sin and writes q, k
    bytes_moved=lambda e, batch, seq, q_heads, kv_heads, head_dim:
        2 * (2 * (q_heads + kv_heads) + 2) * batch * seq * head_dim * e,
)


# --- cross_entropy: transformers' loss, logits upcast to float32 ---
def _liger_ce(logits, labels):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    return LigerCrossEntropyFunction.apply(logits, labels, None, -100)  # (input, target, weight, ignore_index)


CROSS_ENTROPY = Op(
    shapes={"gpu": dict(tokens=8192, vocab=128256), "cpu": dict(tokens=1024, vocab=32000),
            "check": dict(tokens=64, vocab=1000)},
    make=lambda device, dtype, tokens, vocab: [
        _randn(tokens, vocab, device=device, dtype=dtype), _labels(tokens, vocab, device)],
    eager=lambda logits, labels: F.cross_entropy(logits.float(), labels, ignore_index=-100),
    ours=lambda logits, labels: accel_kernels.cross_entropy(logits, labels),
    liger=_liger_ce,
    bytes_moved=lambda e, tokens, vocab: 2 * tokens * vocab * e,  # read the logits, write their grad
)


# --- fused linear cross-entropy: lm_head matmul + loss without the full logits ---
def _liger_flce(hidden, weight, labels):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    return LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)


FLCE = Op(
    shapes={"gpu": dict(tokens=8192, hidden=4096, vocab=128256), "cpu": dict(tokens=4096, hidden=1024, vocab=32000),
            "check": dict(tokens=64, hidden=128, vocab=1000)},
    make=lambda device, dtype, tokens, hidden, vocab: [
        _randn(tokens, hidden, device=device, dtype=dtype),
        (torch.randn(vocab, hidden, device=device) / math.sqrt(hidden)).to(dtype).requires_grad_(),
        _labels(tokens, vocab, device)],
    eager=lambda hidden, weight, labels: F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=-100),
    ours=lambda hidden, weight, labels: accel_kernels.fused_linear_cross_entropy(hidden, weight, labels),
    liger=_liger_flce,
    bytes_moved=None,  # matmul-bound
)

OPS = {"rms_norm": RMS_NORM, "swiglu": SWIGLU, "geglu": GEGLU, "rope": ROPE,
       "cross_entropy": CROSS_ENTROPY, "fused_linear_cross_entropy": FLCE}


# --- running one implementation ---
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
    forward+backward time (the one CPU figure; fwd and bwd alone are not timed, to keep the run short)."""
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
    return dict(fwd_ms=None, bwd_ms=None, fb_ms=1e3 * statistics.median(times), fwd_mib=fwd_mib, bwd_mib=None,
                fb_mib=fb_mib, reps=reps)


def run_one(name: str, impl: str, device: str, quick: bool) -> dict:
    """Check, then measure one implementation of one op; a row for the table (never raises)."""
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
            row.update(measure_cuda(fn, inputs, warmup_ms=10 if quick else 50, rep_ms=50 if quick else 300))
        else:
            row.update(measure_cpu(fn, inputs, reps=1 if quick else 3))
        return dict(row, status="ok")
    except Exception as e:  # one broken implementation must not hide the others' figures
        return dict(row, status="FAILED", note=f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}")
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()


def run_one_in_subprocess(name: str, impl: str, quick: bool) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0")  # the plain-torch paths, not the Triton interpreter
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


# --- printing ---
COLUMNS = [("impl", "<14", None), ("fwd ms", ">11.3f", "fwd_ms"), ("bwd ms", ">11.3f", "bwd_ms"), ("f+b ms", ">11.3f", "fb_ms"),
           ("fwd MiB", ">9.1f", "fwd_mib"), ("bwd MiB", ">9.1f", "bwd_mib"), ("f+b MiB", ">9.1f", "fb_mib"),
           ("f+b GB/s", ">10.0f", "fb_gbs"), ("%copy", ">7.0f", "pct_copy"),
           ("x eager", ">9.2f", "x_eager"), ("x liger", ">9.2f", "x_liger")]


def print_table(name: str, rows: list[dict], device: str, copy_gbs: float | None) -> None:
    op = OPS[name]
    shape = op.shapes["gpu" if device == "cuda" else "cpu"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    print(f"\n== {name}: {' '.join(f'{k}={v}' for k, v in shape.items())}, {dtype}, {device} ==")
    by_impl = {r["impl"]: r for r in rows}
    eager, liger = by_impl.get("eager", {}), by_impl.get("liger", {})
    element = 2 if device == "cuda" else 4
    moved = op.bytes_moved(element, **shape) if op.bytes_moved and copy_gbs else None
    print("".join(format(title, spec.split(".")[0].rstrip("f")) for title, spec, _ in COLUMNS))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['impl']:<14}{r['status']}: {r.get('note', '')}")
            continue
        r["fb_gbs"] = moved / (r["fb_ms"] * 1e-3) / 1e9 if moved else None
        r["pct_copy"] = 100 * r["fb_gbs"] / copy_gbs if moved else None
        r["x_eager"] = eager["fb_ms"] / r["fb_ms"] if eager.get("status") == "ok" else None
        r["x_liger"] = liger["fb_ms"] / r["fb_ms"] if liger.get("status") == "ok" else None
        cells = [format(r["impl"], COLUMNS[0][1])]
        for _, spec, key in COLUMNS[1:]:
            cells.append(format("-", spec.split(".")[0]) if r[key] is None else format(r[key], spec))
        print("".join(cells))


def print_cpu_flce_figure(rows: list[dict]) -> dict | None:
    by_impl = {r["impl"]: r for r in rows}
    ours, eager = by_impl.get("accel_kernels", {}), by_impl.get("eager", {})
    shape = FLCE.shapes["cpu"]
    print(f"\n== fused linear cross-entropy vs eager F.cross_entropy(hidden @ weight.T, labels), CPU, float32, "
          f"{shape['tokens']} tokens, hidden {shape['hidden']}, vocab {shape['vocab']}, forward+backward ==")
    if ours.get("status") != "ok" or eager.get("status") != "ok":
        print(f"not measured: accel_kernels {ours.get('status')}, eager {eager.get('status')}")
        return None
    mem = ours["fb_mib"] / eager["fb_mib"]
    tim = ours["fb_ms"] / eager["fb_ms"]
    verdict = {k: "PASS" if v <= CPU_FLCE_TARGET[k] else "MISS" for k, v in (("memory", mem), ("time", tim))}
    print(f"peak memory (ru_maxrss rise over the inputs, fresh process each): {ours['fb_mib']:.0f} MiB vs "
          f"{eager['fb_mib']:.0f} MiB = {mem:.3f}x (target <= {CPU_FLCE_TARGET['memory']}x): {verdict['memory']}")
    print(f"time (median of {ours['reps']} after a warm-up): {ours['fb_ms'] / 1e3:.2f} s vs {eager['fb_ms'] / 1e3:.2f} s = {tim:.2f}x "
          f"(target <= {CPU_FLCE_TARGET['time']}x): {verdict['time']}")
    return dict(memory_ratio=mem, time_ratio=tim, **{f"{k}_verdict": v for k, v in verdict.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel_kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer reps; skips torch.compile")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from: {','.join(OPS)}")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # op:impl, one CPU measurement in this process
    args = parser.parse_args(argv)

    if args.child:
        name, impl = args.child.split(":")
        print(json.dumps(run_one(name, impl, "cpu", args.quick)))
        return 0

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {','.join(OPS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import triton

    machine = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    print(f"accel_kernels bench, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, triton {triton.__version__}{', --quick' if args.quick else ''}")
    if device == "cuda":
        torch._functorch.config.donated_buffer = False  # lets compiled graphs run backward with retain_graph (bwd timing)
        copy_gbs = copy_bandwidth_gbs()
        print(f"copy bandwidth (2 GiB device-to-device, read+write): {copy_gbs:.0f} GB/s")
        print("time: median ms (triton.testing.do_bench, CUDA events, L2 flushed between reps); memory: peak MiB of "
              "the step above what was allocated before it (inputs; for bwd also the forward's saved tensors), "
              "produced grads included; GB/s: bytes fwd+bwd must move / f+b time; x eager, x liger: f+b speedup")
        impls = [i for i in IMPLS if not (args.quick and i == "torch.compile")]
        if args.quick:
            print("--quick: torch.compile skipped (compiling every op would not fit the time)")
    else:
        copy_gbs = None
        print("no GPU: plain-torch paths at CPU shapes, float32, each measurement in a fresh process; memory: rise of "
              "ru_maxrss (peak RSS) over its value after the inputs were built; time: median wall ms of "
              f"{1 if args.quick else 3} forward+backward run(s) after one warm-up; "
              "torch.compile and Liger skipped on CPU")
        impls = ["accel_kernels", "eager"]
    results = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, device=device,
                   torch=torch.__version__, triton=triton.__version__, quick=args.quick, copy_gbs=copy_gbs, rows=[])
    for name in ops:
        rows = [run_one(name, impl, device, args.quick) if device == "cuda" else run_one_in_subprocess(name, impl, args.quick)
                for impl in impls]
        print_table(name, rows, device, copy_gbs)
        results["rows"] += rows
    if device == "cpu" and "fused_linear_cross_entropy" in ops:
        results["cpu_flce"] = print_cpu_flce_figure([r for r in results["rows"] if r["op"] == "fused_linear_cross_entropy"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
