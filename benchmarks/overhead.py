"""What a swap costs on the host: microseconds per call of each site kind, and the training step.

    python benchmarks/overhead.py              # CPU, the path users get (no TRITON_INTERPRET)
    python benchmarks/overhead.py --quick      # fewer shapes and repeats
    python benchmarks/overhead.py --json o.json
    python benchmarks/overhead.py --host       # only the GPU path's host work, launches stubbed

1. Per site kind, at tiny shapes (so the math is negligible): microseconds per call of the stock
   module and of the swapped one, forward alone and forward + backward. On CPU without Triton the
   swapped norm, MLP and RoPE call the stock computation (one check per call); the fused loss
   runs its plain-torch twin. Beside them, the host work the GPU path does around each launch
   (checks, autograd, grid, allocation; the custom-op dispatch only under torch.compile), timed
   here with the launches stubbed out, and the floor of that harness (an empty
   autograd.Function).
2. One training step (forward + backward) of a tiny Llama (2 layers) on CPU eager, stock vs
   swapped, at hidden 32 to 1024 and vocabulary 99 to 32000, the swapped model with every op
   and without the fused loss: target <= 1.1x stock at every shape.

Run it without TRITON_INTERPRET: under the interpreter the kernels themselves run on the CPU,
which is a test rig, not a path anyone trains on. Stock and swapped are timed interleaved, in
one process, best of repeats (a shared machine's other work only ever adds time).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import sys
import time


def timed(fn, repeats: int, inner: int) -> float:
    """Microseconds per call of fn(): the best of `repeats` batches of `inner` calls (the least
    disturbed by other work on a shared machine)."""
    for _ in range(inner):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return min(samples)


def interleaved(fns: dict, repeats: int, inner: int) -> dict:
    """timed() of several functions, alternating between them so drift hits all alike."""
    samples = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(inner):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - t0) / inner * 1e6)
    return {k: min(v) for k, v in samples.items()}


def tiny_llama(hidden: int, vocab: int, layers: int = 2):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 16)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=512, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def site_rows(repeats: int, inner: int) -> list[dict]:
    """Per-call microseconds of each site kind, stock vs swapped, forward and forward+backward."""
    import torch
    import torch.nn.functional as F

    import accel_patch
    from accel_kernels import fused_linear_cross_entropy
    from accel_patch.swaps.layers import rope as rope_site

    stock = tiny_llama(32, 99)
    twin = copy.deepcopy(stock)
    accel_patch.swap_kernels(twin)
    rows = []

    def pair(name, make_stock, make_swapped):
        for phase in ("forward", "forward+backward"):
            def run(make):
                def call():
                    out = make()
                    if phase != "forward":
                        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
                return call
            if phase == "forward":
                with torch.no_grad():
                    got = interleaved({"stock": run(make_stock), "swapped": run(make_swapped)}, repeats, inner)
            else:
                got = interleaved({"stock": run(make_stock), "swapped": run(make_swapped)}, repeats, inner)
            rows.append(dict(site=name, phase=phase, stock_us=got["stock"], swapped_us=got["swapped"]))

    x = torch.randn(1, 14, 32, requires_grad=True)
    pair("rms_norm", lambda: stock.model.norm(x), lambda: twin.model.norm(x))
    pair("glu", lambda: stock.model.layers[0].mlp(x), lambda: twin.model.layers[0].mlp(x))

    key = (type(twin.model.layers[0].self_attn).__module__, "apply_rotary_pos_emb")
    original = rope_site.interceptions.original(key)
    dispatcher = sys.modules[key[0]].__dict__[key[1]]
    q = torch.randn(1, 2, 14, 16, requires_grad=True)
    k = torch.randn(1, 2, 14, 16, requires_grad=True)
    cos, sin = torch.randn(1, 14, 16), torch.randn(1, 14, 16)
    counter = rope_site.gate(key).counter()

    def swapped_rope():
        counter.depth += 1  # as inside a swapped attention forward
        try:
            return dispatcher(q, k, cos, sin)
        finally:
            counter.depth -= 1

    pair("rope", lambda: original(q, k, cos, sin), swapped_rope)

    h = torch.randn(14, 32, requires_grad=True)
    w = stock.lm_head.weight
    y = torch.randint(0, 99, (14,))
    # the swapped model runs stock below CPU_MIN_LOGITS on CPU without Triton: this is the twin's cost
    pair("fused loss twin vs stock", lambda: F.cross_entropy(F.linear(h, w).float(), y),
         lambda: fused_linear_cross_entropy(h, w, y))
    accel_patch.restore_kernels(twin)
    return rows


@contextlib.contextmanager
def launches_stubbed():
    """The GPU path's host code on CPU tensors: Triton's path chosen, every launch a no-op."""
    from accel_kernels import _launch, _triton

    saved = (_triton.AVAILABLE, _triton.INTERPRETING, _launch.launch)
    _triton.AVAILABLE, _triton.INTERPRETING = True, True
    _launch.launch = lambda kernel, grid, *args, **meta: None
    try:
        yield
    finally:
        _triton.AVAILABLE, _triton.INTERPRETING, _launch.launch = saved


FLOOR = "floor: an empty autograd.Function"
CHAIN = 16  # calls in a chain with one backward (`host_rows`' chain column)


def host_rows(repeats: int, inner: int) -> list[dict]:
    """Microseconds of host work per call of each op on the GPU path (launches stubbed), and
    `FLOOR`: the same harness (call, `.float().sum().backward()`) around a Function that does
    nothing but allocate, which no Python op can go under. The CPU label range check of the fused
    loss (a few CPU ops, skipped on GPU tensors) is in its figure."""
    import torch

    from accel_kernels import fused_linear_cross_entropy, rms_norm, rope, swiglu

    x, wn = torch.randn(14, 32, requires_grad=True), torch.ones(32, requires_grad=True)
    g, u = torch.randn(14, 64, requires_grad=True), torch.randn(14, 64, requires_grad=True)
    q, k = torch.randn(1, 2, 14, 16, requires_grad=True), torch.randn(1, 2, 14, 16, requires_grad=True)
    cos, sin = torch.randn(1, 14, 16), torch.randn(1, 14, 16)
    h, w, y = torch.randn(14, 32, requires_grad=True), torch.randn(99, 32, requires_grad=True), torch.randint(0, 99, (14,))

    class Floor(torch.autograd.Function):
        """What any autograd op costs the host: one Function whose forward and backward only
        allocate their outputs."""

        @staticmethod
        def forward(ctx, a, b):
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, grad):
            return torch.empty_like(grad), torch.empty_like(wn)

    # In a chain: CHAIN calls, each taking the last one's output, and one backward for all of them
    # (the model's way: the engine starts once a step, a call's gradient comes from the next call's
    # backward): what a step pays per call, without the harness's per-call backward set-up.
    ws = [torch.ones(32, requires_grad=True) for _ in range(CHAIN)]
    us = [torch.randn(14, 64, requires_grad=True) for _ in range(CHAIN)]

    def chained(step, start):
        def run():
            outs = start
            for i in range(CHAIN):
                outs = step(i, *outs)
            torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
        return run

    chains = {
        "rms_norm": chained(lambda i, a: (rms_norm(a, ws[i]),), (x,)),
        "glu": chained(lambda i, a: (swiglu(a, us[i]),), (g,)),
        "rope": chained(lambda i, a, b: rope(a, b, cos, sin), (q, k)),
        FLOOR: chained(lambda i, a: (Floor.apply(a, ws[i]),), (x,)),
    }
    calls = {
        "rms_norm": lambda: rms_norm(x, wn),
        "glu": lambda: swiglu(g, u),
        "rope": lambda: rope(q, k, cos, sin),
        "fused loss twin vs stock": lambda: fused_linear_cross_entropy(h, w, y),
        FLOOR: lambda: Floor.apply(x, wn),
    }
    rows = []
    with launches_stubbed():
        for name, call in calls.items():
            with torch.no_grad():
                fwd = timed(call, repeats, inner)

            def both(call=call):
                out = call()
                (out[0] if isinstance(out, tuple) else out).float().sum().backward()

            # as a model's next layer hands it back: a dense gradient for every output, no sum node
            # (the sum's gradient is an expanded, stride-0 tensor the kernels first copy to dense)
            outs = call()
            outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
            grads = [torch.ones_like(o) for o in outs]

            def dense(call=call, grads=grads):
                out = call()
                out = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
                torch.autograd.backward(out, grads)

            row = dict(site=name, forward_us=fwd, both_us=timed(both, repeats, inner),
                       dense_us=timed(dense, repeats, inner))
            if name in chains:
                row["chain_us"] = timed(chains[name], max(1, repeats // 4), inner) / CHAIN
            rows.append(row)
    return rows


def step_rows(shapes, tokens: int, repeats: int) -> list[dict]:
    """Training-step milliseconds, stock vs swapped (all ops; and without the fused loss)."""
    import torch

    import accel_patch

    rows = []
    for hidden, vocab in shapes:
        stock = tiny_llama(hidden, vocab)
        swapped = copy.deepcopy(stock)
        no_loss = copy.deepcopy(stock)
        accel_patch.swap_kernels(swapped)
        accel_patch.swap_kernels(no_loss, ops="rms_norm,rope,glu")
        ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "labels": ids}
        models = {"stock": stock, "swapped": swapped, "swapped, stock loss": no_loss}
        for m in models.values():
            m.train()

        def step(m):
            def run():
                m(**batch).loss.backward()
                m.zero_grad(set_to_none=True)
            return run

        inner = max(1, int(2000 // (hidden * (1 + vocab / 4000))))  # calls per sample: ~a few ms each
        got = interleaved({k: step(m) for k, m in models.items()}, repeats, inner)
        rows.append(dict(hidden=hidden, vocab=vocab, tokens=tokens, **{f"{k}_ms": v / 1e3 for k, v in got.items()}))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    p.add_argument("--tokens", type=int, default=14, help="tokens per training step (default 14)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--host", action="store_true", help="only the GPU path's host work per op (launches stubbed)")
    args = p.parse_args(argv)
    if args.tokens < 2:
        p.error(f"--tokens must be >= 2, got {args.tokens}")
    import torch
    import transformers

    from accel_kernels import _dispatch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    machine = f"CPU, {os.cpu_count()} cores ({torch.get_num_threads()} thread(s) used), {platform.processor() or platform.machine()}"
    print(f"accel-patch host overhead, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, Triton interpreter "
          f"{'ON (kernels run on the CPU: not the user path)' if _dispatch.interpreting() else 'off'}")
    repeats, inner = (5, 20) if args.quick else (9, 50)
    results = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, torch=torch.__version__,
                   interpreter=_dispatch.interpreting())

    if args.host:
        print("\nGPU path's host work per call, launches stubbed, 14 tokens, microseconds"
              " (fwd+bwd: backward of .float().sum(); dense: backward of a dense gradient per output;"
              f" chain: forward + backward per call of {CHAIN} chained calls with one backward)")
        # many short samples: on a loaded machine a long one is rarely left alone
        for r in host_rows(40 * repeats, max(1, inner // 10)):
            chain = f"{'chain':>7}{r['chain_us']:>8.1f}" if "chain_us" in r else ""
            print(f"{r['site']:<40}{'fwd':>5}{r['forward_us']:>8.1f}{'fwd+bwd':>9}{r['both_us']:>8.1f}"
                  f"{'dense':>7}{r['dense_us']:>8.1f}{chain}")
        return 0
    print("\n1. per call, tiny shapes (14 tokens, hidden 32), microseconds")
    sites = site_rows(repeats, inner)
    host = {r["site"]: r for r in host_rows(repeats, inner)}
    print(f"{'site':<29}{'phase':<18}{'stock':>9}{'swapped':>9}{'ratio':>7}{'GPU-path host':>15}")
    for r in sites:
        h = host[r["site"]]
        gpu = h["forward_us"] if r["phase"] == "forward" else h["both_us"]
        print(f"{r['site']:<29}{r['phase']:<18}{r['stock_us']:>9.1f}{r['swapped_us']:>9.1f}"
              f"{r['swapped_us'] / r['stock_us']:>6.2f}x{gpu:>15.1f}")
    floor = host[FLOOR]
    print(f"{FLOOR:<47}{'':>25}{floor['forward_us']:>8.1f} / {floor['both_us']:.1f} (fwd / fwd+bwd)")
    results["sites"], results["gpu_host"] = sites, list(host.values())

    shapes = ([(32, 99), (256, 32000)] if args.quick else
              [(32, 99), (32, 32000), (256, 99), (256, 32000), (1024, 99), (1024, 32000)])
    print(f"\n2. training step, tiny Llama (2 layers), {args.tokens} tokens, float32, CPU eager, milliseconds"
          f" (target: swapped <= 1.10x stock)")
    print(f"{'hidden':>7}{'vocab':>7}{'stock':>9}{'swapped':>9}{'ratio':>8}{'verdict':>8}"
          f"{'swapped, stock loss':>21}{'ratio':>8}")
    steps = step_rows(shapes, args.tokens, 5 if args.quick else 9)
    ok = True
    for r in steps:
        ratio = r["swapped_ms"] / r["stock_ms"]
        ratio2 = r["swapped, stock loss_ms"] / r["stock_ms"]
        ok &= ratio <= 1.10
        print(f"{r['hidden']:>7}{r['vocab']:>7}{r['stock_ms']:>9.2f}{r['swapped_ms']:>9.2f}{ratio:>7.2f}x"
              f"{'PASS' if ratio <= 1.10 else 'MISS':>8}{r['swapped, stock loss_ms']:>21.2f}{ratio2:>7.2f}x")
    results["steps"] = steps
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
