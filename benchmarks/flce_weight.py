"""The fused linear cross-entropy's three ways to the weight's gradient, timed apart, beside Liger's.

    python benchmarks/flce_weight.py              # GPU: 8192 tokens x 4096 hidden x 128256 vocabulary, bf16
    python benchmarks/flce_weight.py --json PATH  # the figures as JSON too
    python benchmarks/flce_weight.py --dry-run    # CPU, tiny shapes: only checks that the script runs

"vocabulary pass": today's rule (the weight's gradient in its own pass over vocabulary blocks once
an fp32 (V, H) sum would exceed `WEIGHT_FP32_BYTES`: one more logits matmul, about Liger's peak).
"fp32 sum": the same op with that budget lifted, so the gradient is summed over the token chunks
in one fp32 (V, H) buffer (three matmuls, 2 GiB more at this shape). "dtype sum": summed over the
forward's 8 token chunks of 1024 in the weight's own bf16 (`WEIGHT_DTYPE_SUM_CHUNKS` = 8: three
matmuls, 8 roundings of each element, the forward's 250 MiB chunk of logits held beside grad W;
off by default). Each row says which way the op took (`way`, from the op's own rule functions at
this shape). Each variant: forward +
backward, the median of --repeats timings of --steps calls (CUDA events on a GPU), and the peak
memory growth of one call over what its inputs hold. The choice between them is the defaults of
`WEIGHT_FP32_BYTES` and `WEIGHT_DTYPE_SUM_CHUNKS` in kernels/accel_kernels/ops/fused_linear_cross_entropy.py.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

import accel_kernels
import accel_kernels.ops.fused_linear_cross_entropy as flce


def _liger(hidden, weight, labels):
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
    # liger-kernel 0.8.5 returns (loss, z_loss, token_accuracy, predicted_tokens); earlier ones the loss
    out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, labels)
    return out[0] if isinstance(out, tuple) else out


def _ours(hidden, weight, labels):
    return accel_kernels.fused_linear_cross_entropy(hidden, weight, labels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    N, H, V = (8192, 4096, 128256) if gpu else (256, 64, 1000)
    torch.manual_seed(0)
    hidden = torch.randn(N, H, device=device, dtype=dtype)
    weight = (torch.randn(V, H, device=device) / math.sqrt(H)).to(dtype)
    labels = torch.randint(0, V, (N,), device=device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)

    # name: (function, WEIGHT_FP32_BYTES or None for the default, WEIGHT_DTYPE_SUM_CHUNKS)
    variants = {"vocabulary pass": (_ours, None, 0), "fp32 sum": (_ours, 1 << 62, 0), "dtype sum": (_ours, None, 8)}
    try:
        import liger_kernel  # noqa: F401
        if gpu:
            variants["liger"] = (_liger, None, 0)
    except ImportError:
        pass
    results = {"shape": dict(tokens=N, hidden=H, vocab=V, dtype=str(dtype)), "variants": {}}
    default_budget, default_chunks = flce.WEIGHT_FP32_BYTES, flce.WEIGHT_DTYPE_SUM_CHUNKS
    triton_path = accel_kernels._dispatch.use_triton(hidden)
    rows = flce.chunk_rows(N, V, hidden.element_size(), flce.CHUNK_BYTES if triton_path else flce.TORCH_CHUNK_BYTES)
    for name, (fn, budget, chunks) in variants.items():
        flce.WEIGHT_FP32_BYTES = default_budget if budget is None else budget
        flce.WEIGHT_DTYPE_SUM_CHUNKS = chunks
        way = ("liger" if fn is _liger else
               "dtype sum" if flce.weight_sum_in_dtype(N, rows, V, H, dtype, triton_path) else
               "vocabulary pass" if flce.weight_grad_by_blocks(V, H, triton_path) else "fp32 sum")
        try:
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()

            def step():
                loss = fn(h, w, labels)
                loss.backward()
                h.grad = w.grad = None

            step()  # warm-up: compiles the kernels
            sync()
            if gpu:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            step()
            sync()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if gpu else None
            times = []
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                times.append((time.perf_counter() - t0) / args.steps * 1e3)
            row = dict(ms=statistics.median(times), peak_mib=peak, way=way)
        except Exception as error:  # a variant that raises is a row, not a dead run
            row = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        finally:
            flce.WEIGHT_FP32_BYTES, flce.WEIGHT_DTYPE_SUM_CHUNKS = default_budget, default_chunks
        results["variants"][name] = row
        shown = row.get("error") or (f"{row['ms']:.2f} ms" + (f", peak growth {row['peak_mib']:.0f} MiB" if gpu else "")
                                     + f" ({row['way']})")
        print(f"flce {name:16s} {shown}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
