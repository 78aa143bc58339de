"""What one LoRA call does, fused against PEFT's layers: every aten op of the forward and of the
backward (inside the fused custom ops too), with its kind, FLOPs, bytes read and written, and its
host time, counted by a TorchDispatchMode on CPU.

    PYTHONPATH=$PWD:$PWD/kernels python tests/swaps/lora/lora_census.py            # the table of docs/lora.md
    PYTHONPATH=$PWD:$PWD/kernels python tests/swaps/lora/lora_census.py --ops      # and every op in order
    PYTHONPATH=$PWD:$PWD/kernels python tests/swaps/lora/lora_census.py --cuda-dropout   # dropout as CUDA runs it

The ops run on real CPU tensors at Llama-3.2-1B widths (hidden 2048, intermediate 8192, 8 of 32
heads for k/v: 512) with few tokens (SMALL_TOKENS); FLOPs and bytes are then given at TOKENS tokens
by scaling every dimension equal to SMALL_TOKENS (no width equals it), which is exact for these ops
(each is linear in the token count or independent of it). Host time is that of the small run: what
an op costs before its work grows, the part a GPU step pays per call on the host.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN, INTER, KV, RANK = 2048, 8192, 512, 16
TOKENS, SMALL_TOKENS = 8192, 24

MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "matmul", "linear"}
CASTS = {"_to_copy", "copy_", "to"}
DROPOUT = {"native_dropout", "native_dropout_backward", "bernoulli_", "bernoulli"}
ALLOCS = {"empty", "empty_like", "new_empty", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
          "new_zeros", "new_ones", "full", "scalar_tensor", "fill_"}
VIEWS = {"view", "t", "transpose", "reshape", "_unsafe_view", "expand", "alias", "slice", "split", "detach",
         "as_strided", "unsqueeze", "squeeze", "permute", "chunk", "split_with_sizes", "select", "_reshape_alias"}
#: Dispatched, but no pass over data and no kernel: counted with the views (no op, no bytes).
NO_KERNEL = {"promote_types", "result_type"}


def kind(name: str) -> str:
    if name in MATMULS:
        return "matmul"
    if name in CASTS:
        return "cast"
    if name in DROPOUT:
        return "dropout"
    if name in ALLOCS:
        return "alloc"
    if name in VIEWS or name in NO_KERNEL:
        return "view"
    return "elementwise"


def _scaled_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape:
        n *= TOKENS if d == SMALL_TOKENS else d
    return n


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class Census(TorchDispatchMode):
    """Records every aten op (and the ops inside accel_patch_lora's custom ops) with its cost: a
    record is (name, kind, FLOPs, bytes read, bytes written, bytes allocated, written dtypes, host
    seconds, output shapes at TOKENS)."""

    def __init__(self, records=None) -> None:
        super().__init__()
        self.records = [] if records is None else records

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "accel_patch_lora":  # count what runs inside the custom op
            from torch._library.custom_ops import OPDEFS

            impl = OPDEFS[f"{func.namespace}::{func.__name__.split('.')[0]}"]._init_fn
            with Census(self.records):
                return impl(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        name = func.__name__.split(".")[0]
        k = kind(name)
        ins = [t for t in _tensors((args, kwargs))]
        outs = list(_tensors(out))
        if any(o is i for o in outs for i in ins) and not name.endswith("_"):
            k = "view"  # a cast to the dtype it has, or another alias: no pass
        if k == "view" or name == "detach":
            read = written = 0
        elif k == "alloc":
            read, written = 0, (sum(_scaled_numel(t) * t.element_size() for t in outs) if name == "fill_" else 0)
        else:
            inplace = name.endswith("_")
            read = sum(_scaled_numel(t) * t.element_size() for t in ins if t.dim() > 0)
            written = sum(_scaled_numel(t) * t.element_size() for t in outs) if not inplace else \
                sum(_scaled_numel(t) * t.element_size() for t in ins[:1])
        flops = 0
        if k == "matmul":
            a, b = [t for t in ins if t.dim() >= 2][-2:]
            m, kk = a.shape[-2], a.shape[-1]
            n = b.shape[0] if name == "linear" else b.shape[-1]
            scale = lambda d: TOKENS if d == SMALL_TOKENS else d  # noqa: E731
            flops = 2 * scale(m) * scale(kk) * scale(n)
        allocs = 0 if k == "view" else sum(_scaled_numel(t) * t.element_size() for t in outs) if k != "view" and not name.endswith("_") else 0
        self.records.append((name, k, flops, read, written, allocs,
                             tuple(sorted({str(t.dtype).replace("torch.", "") for t in outs})), dt,
                             [tuple(TOKENS if d == SMALL_TOKENS else d for d in t.shape) for t in outs]))
        return out


# --------------------------------------------------------------------------------------------
# The two paths of one call
# --------------------------------------------------------------------------------------------


class _Attn(torch.nn.Module):
    def __init__(self, hidden, inter, kv) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv, bias=False)


class _MLP(torch.nn.Module):
    def __init__(self, hidden, inter, kv) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)


def peft_modules(dropout: float, widths=(HIDDEN, INTER, KV), adapter_dtype=None):
    """(attention, MLP) with PEFT's LoRA layers (r=16, alpha 32) on a bf16 base: float32 adapters
    (PEFT's autocast_adapter_dtype) unless adapter_dtype says otherwise, B non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    out = []
    for cls, names in ((_Attn, ["q_proj", "k_proj", "v_proj"]), (_MLP, ["gate_proj", "up_proj", "down_proj"])):
        m = cls(*widths).to(torch.bfloat16)
        model = get_peft_model(m, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=dropout, target_modules=names))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)
            if "lora_" in n and adapter_dtype is not None:
                p.data = p.data.to(adapter_dtype)
        out.append(model.train().base_model.model)
    return out


def _plan(projections, x):
    from accel_patch.swaps.lora import plans

    found = [plans.projection(m, x) for m in projections]
    assert not [f for f in found if isinstance(f, str)], found
    return [f[0] for f in found], [t for f in found for t in f[1]]


def qkv_call(attn, fused: bool):
    from accel_patch.swaps.lora import functions

    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    if fused:
        return lambda x: functions.fused_linears(x, *_plan(projections, x))
    return lambda x: tuple(m(x) for m in projections)


def mlp_call(mlp, fused: bool):
    from accel_patch.swaps.lora import functions

    projections = [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    if fused:
        return lambda x: (functions.fused_mlp(x, *_plan(projections, x), "silu", False, functions.GLU_TORCH),)
    return lambda x: (mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)),)


@contextlib.contextmanager
def cuda_dropout():
    """Dropout as it runs on CUDA, on these CPU tensors: F.dropout (PEFT's layers) as the one
    `native_dropout` kernel it runs there (its backward `native_dropout_backward`), and the fused
    functions on their CUDA branches (the masks drawn in the forward, a mask and its scale in one
    `native_dropout_backward`). CPU's dropout is a sequence of passes (bernoulli_,
    div_, mul) where CUDA's is one, so the two paths' bytes compare as on the GPU only under this."""
    from accel_patch.swaps.lora import functions

    def native(input, p=0.5, training=True, inplace=False):
        assert not inplace
        return torch.native_dropout(input, p, True)[0] if training and p > 0 else input

    saved = F.dropout, functions._FUSED_DROPOUT, functions._ONE_PASS_DROPOUT_BACKWARD
    F.dropout = native
    functions._FUSED_DROPOUT = (*functions._FUSED_DROPOUT, "cpu")
    functions._ONE_PASS_DROPOUT_BACKWARD = (*functions._ONE_PASS_DROPOUT_BACKWARD, "cpu")
    try:
        yield
    finally:
        F.dropout, functions._FUSED_DROPOUT, functions._ONE_PASS_DROPOUT_BACKWARD = saved


def run(call, autocast: bool, tokens: int = SMALL_TOKENS, count: bool = True, hidden: int = HIDDEN, modules=(),
        on_cuda_dropout: bool = False):
    """(forward records, backward records) of one call on a bf16 input of `tokens` tokens. The
    gradients of `modules`' parameters are cleared first, so that each path's backward writes them
    as a first backward does (no accumulation into the other path's). on_cuda_dropout: dropout's
    ops as CUDA runs them (`cuda_dropout`)."""
    with (cuda_dropout() if on_cuda_dropout else contextlib.nullcontext()):
        return _run(call, autocast, tokens, count, hidden, modules)


def _run(call, autocast, tokens, count, hidden, modules):
    for module in modules:
        for param in module.parameters():
            param.grad = None
    torch.manual_seed(1)
    x = torch.randn(1, tokens, hidden, dtype=torch.bfloat16).requires_grad_()
    fwd, bwd = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with (Census(fwd) if count else contextlib.nullcontext()):
            outs = call(x * 1)
    grads = [torch.ones_like(o) for o in outs]
    with (Census(bwd) if count else contextlib.nullcontext()):
        torch.autograd.backward(outs, grads)
    return fwd, bwd


def summary(records) -> dict:
    s = defaultdict(float)
    for name, k, flops, read, written, allocs, dtypes, dt, shapes in records:
        if k == "view":
            continue
        s["ops"] += 1
        s[k] += 1
        s["flops"] += flops
        s["bytes"] += read + written
        s["alloc bytes"] += allocs
        s["host us"] += dt * 1e6
        big = any(len(sh) >= 2 and sh[-2] == TOKENS and sh[-1] >= KV for sh in shapes)
        if big and k in ("elementwise", "cast", "dropout"):
            s["[tokens, width] passes"] += 1
        if big and "float32" in dtypes and k != "matmul":
            s["float32 [tokens, width] outputs"] += 1
    return s


SETTINGS = (("bf16 autocast, fp32 adapters, dropout 0.05", True, 0.05),
            ("pure bf16, fp32 adapters, dropout 0.05", False, 0.05),
            ("bf16 autocast, fp32 adapters, no dropout", True, 0.0),
            # the GPU e2e benchmark's LoRA step (benchmarks/e2e.py: a bf16 model, r=16, no dropout)
            ("pure bf16, fp32 adapters, no dropout", False, 0.0))


def table(show_ops: bool = False, on_cuda_dropout: bool = False) -> str:
    lines = ["| setting | call | pass | path | aten ops | matmuls | casts | elementwise | dropout | allocs "
             "| [T, width] passes | fp32 [T, width] outputs | GFLOP | GB moved | GB allocated | host us |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    detail = []
    for label, autocast, p in SETTINGS:
        attn, mlp = peft_modules(p)
        for call_name, make in (("q/k/v", lambda f: qkv_call(attn, f)), ("MLP", lambda f: mlp_call(mlp, f))):
            results = {}
            for path, fused in (("PEFT", False), ("fused", True)):
                results[path] = run(make(fused), autocast, modules=(attn, mlp), on_cuda_dropout=on_cuda_dropout)
            for i, pass_name in enumerate(("forward", "backward")):
                for path in ("PEFT", "fused"):
                    recs = results[path][i]
                    s = summary(recs)
                    lines.append(
                        f"| {label} | {call_name} | {pass_name} | {path} | {int(s['ops'])} | {int(s['matmul'])} "
                        f"| {int(s['cast'])} | {int(s['elementwise'])} | {int(s['dropout'])} | {int(s['alloc'])} "
                        f"| {int(s['[tokens, width] passes'])} | {int(s['float32 [tokens, width] outputs'])} "
                        f"| {s['flops'] / 1e9:.1f} | {s['bytes'] / 1e9:.2f} | {s['alloc bytes'] / 1e9:.2f} "
                        f"| {s['host us']:.0f} |")
                    if show_ops:
                        detail.append(f"\n{label} / {call_name} / {pass_name} / {path}")
                        for name, k, flops, read, written, allocs, dtypes, dt, shapes in recs:
                            if k != "view":
                                detail.append(f"  {name:28s} {k:11s} {flops / 1e9:7.2f} GF {(read + written) / 1e6:9.1f} MB "
                                              f"{','.join(dtypes):9s} {shapes}")
    return "\n".join(lines + detail)


HOST_WIDTHS, HOST_TOKENS = (64, 256, 16), 8


def _step(call, x, autocast: bool) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = call(x * 1)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def host_us_per_call(repeats: int = 200) -> str:
    """Wall time (us; minimum and median) of forward + backward of one call at HOST_WIDTHS and
    HOST_TOKENS, where the work is negligible: the host's cost of a call. Fused and PEFT
    interleaved (the load changes for both alike)."""
    out = []
    for label, autocast, p in SETTINGS:
        attn, mlp = peft_modules(p, HOST_WIDTHS)
        x = torch.randn(1, HOST_TOKENS, HOST_WIDTHS[0], dtype=torch.bfloat16).requires_grad_()
        for call_name, make in (("q/k/v", lambda f: qkv_call(attn, f)), ("MLP", lambda f: mlp_call(mlp, f))):
            times = {"PEFT": [], "fused": []}
            calls = {"PEFT": make(False), "fused": make(True)}
            for i in range(repeats + 10):
                for path in ("PEFT", "fused"):
                    t0 = time.perf_counter()
                    _step(calls[path], x, autocast)
                    if i >= 10:
                        times[path].append(time.perf_counter() - t0)
            st = {k: (min(v) * 1e6, sorted(v)[len(v) // 2] * 1e6) for k, v in times.items()}
            out.append(f"| {label} | {call_name} | {st['PEFT'][0]:.0f} / {st['PEFT'][1]:.0f} "
                       f"| {st['fused'][0]:.0f} / {st['fused'][1]:.0f} |")
    return "\n".join(["| setting | call | PEFT us (min / median) | fused us (min / median) |", "|---|---|---|---|"] + out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", action="store_true", help="also list every op in order")
    ap.add_argument("--timing", action="store_true", help="instead: the host time per call, interleaved")
    ap.add_argument("--cuda-dropout", action="store_true", help="dropout's ops as CUDA runs them (one native_dropout)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if not a.timing:
        print(table(a.ops, a.cuda_dropout))
    else:
        print()
        print(host_us_per_call())
