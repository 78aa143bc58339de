"""The moe_experts op alone, forward and backward timed apart, with each of its backwards against
transformers' grouped_mm experts path (accel_kernels.bench.catalogue's `_eager_moe`): the question
docs/moe.md ("Which backward") leaves to a GPU.

    python benchmarks/moe_backward.py             # GPU: Qwen3-30B-A3B's experts (H 2048, 128 x I 768, top-8), 4096 tokens, bf16
    python benchmarks/moe_backward.py --json PATH # the figures as JSON too

Each variant: the median of --repeats timings of --steps forwards, then of --steps forward +
backward (torch.autograd.grad into fresh tensors, so no .grad accumulation is timed); backward =
the difference. "ours <b>" is moe_experts(..., backward=b); each such line also says what its
backward launched (the Triton weight-gradient kernel or not, torch._grouped_mm calls), and the
last line what auto ran here: the faster backward as it timed them at its first call where
the device's grouped_mm takes the dtype (`choose_backward`, its figures beside), else its rule
(`backward_path`). "small tiles": the same call with the op's
small tiles forced (`LARGE_TILES_MIN_ROWS` out of reach), the launch configuration it took before
the large tiles (docs/moe.md, "Tile sizes"). On a CPU (tiny shapes, the op's
plain-torch twin for every variant) it only checks that the script runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import accel_kernels._launch as launch
import accel_kernels.ops.moe_experts as op
from accel_kernels import moe_experts
from accel_kernels.bench.catalogue import _eager_moe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    T, H, I, E, K = (args.tokens, 2048, 768, 128, 8) if gpu else (256, 64, 32, 8, 2)
    torch.manual_seed(0)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    index = torch.topk(torch.randn(T, E, device=device), K, dim=-1).indices
    weights = torch.rand(T, K, device=device, dtype=dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, device=device) / H ** 0.5).to(dtype).requires_grad_()
    down = (torch.randn(E, H, I, device=device) / I ** 0.5).to(dtype).requires_grad_()
    grad = torch.randn(T, H, device=device, dtype=dtype)
    inputs = (x, weights, gate_up, down)

    def ms(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.repeats):
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                fn()
            if gpu:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / args.steps * 1e3)
        return statistics.median(times)

    variants = {"grouped_mm (transformers)": lambda: _eager_moe(x, index, weights, gate_up, down)}
    for backward in ("triton", "grouped_mm", "auto"):
        variants[f"ours {backward}"] = (lambda b: lambda: moe_experts(x, index, weights, gate_up, down, backward=b))(backward)
    for backward in ("triton", "grouped_mm"):  # the small tiles everywhere: what the large ones changed
        variants[f"ours {backward}, small tiles"] = variants[f"ours {backward}"]
    tiles = op.call_tiles(x, index, gate_up, down)
    rule = op.backward_path(x, "auto", tiles=tiles)
    rows = []

    def auto():
        """(what auto ran: the timed answer once its first call timed the backwards, else the rule;
        the Timing or None). This script's calls have one shape, so at most one timing."""
        timed = list(op.timed_backwards().values())
        return (timed[-1].path, timed[-1]) if timed else (rule, None)

    def save():  # after every variant: a step cut at its time limit keeps what finished
        if args.json:
            path, timing = auto()
            with open(args.json, "w") as f:
                json.dump(dict(shape=dict(tokens=T, hidden=H, intermediate=I, experts=E, top_k=K, dtype=str(dtype)),
                               auto=path, rule=rule, timed=timing.ms if timing else None, tiles=tiles._asdict(),
                               rows=rows), f, indent=1)

    large_from = op.LARGE_TILES_MIN_ROWS
    for name, fn in variants.items():
        op.LARGE_TILES_MIN_ROWS = float("inf") if name.endswith("small tiles") else large_from
        forward = ms(fn)
        both = ms(lambda: torch.autograd.grad(fn(), inputs, grad))
        ran = ""
        if name.startswith("ours"):  # what one backward launched
            real, calls = torch._grouped_mm, []
            torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
            try:
                out = fn()
                with launch.recording() as launched:
                    torch.autograd.grad(out, inputs, grad)
            finally:
                torch._grouped_mm = real
            ran = f"  ran: {len(calls)} grouped_mm, {launched.count('_moe_weight_grad_kernel')} Triton weight grads"
        op.LARGE_TILES_MIN_ROWS = large_from
        rows.append(dict(variant=name, forward_ms=forward, backward_ms=both - forward, total_ms=both, ran=ran.strip()))
        print(f"{name:27s} forward {forward:7.3f} ms  backward {both - forward:7.3f} ms  both {both:7.3f} ms{ran}",
              flush=True)
        save()
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['variant']} / grouped_mm: forward {r['forward_ms'] / base['forward_ms']:.2f}x, backward "
              f"{r['backward_ms'] / base['backward_ms']:.2f}x, both {r['total_ms'] / base['total_ms']:.2f}x")
    print(f"tiles here: {'large' if op.large(tiles) else 'small'} {tiles}")
    path, timing = auto()
    how = timing.note(op.TIMED_NOTE) if timing else "its rule, untimed here"
    print(f"auto here: {path} ({how}; device {torch.cuda.get_device_name() if gpu else 'cpu'}, torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
