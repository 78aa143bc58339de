"""What the tensors around the swapped ops cost, stock against swapped, counted on a CPU (tiny
models from tests/swaps/_models.py, SDPA, float32, Triton's interpreter):

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/copies.py

- copies: bytes written by copies (clone, copy_, a contiguous() that copies) in one layer's
  attention (Llama; around RoPE: an output laid out as q is by SDPA, copied by
  `transpose(1, 2).contiguous()` before o_proj when q is (B, H, S, D)-contiguous; gradients copied
  by the projections' view backward when they are) and MLP (Phi3: gate and up as the halves of one
  fused projection), forward and backward, inside the ops too (there, clone and contiguous only:
  the interpreter's own copies of a launch's arguments are not the kernel's);
- saved: bytes of the distinct storages a Llama training forward keeps for backward (every op
  swapped);
- compiled: the kernels Inductor generates for a compiled Llama training step's forward and
  backward graphs (its own fused kernels; the ops' and matmuls' calls are counted beside them).

Counts, not times: they hold on any machine, and scale with the token count (docs/kernels.md gives
them at real shapes).
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "swaps"), str(ROOT / "tests")]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from accel_patch import swap_kernels  # noqa: E402


class Copies(TorchDispatchMode):
    def __init__(self, inside: bool = False) -> None:
        super().__init__()
        self.bytes, self.inside = 0, inside

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if func.namespace == "accel_kernels":  # count inside the op
            from torch._library.custom_ops import OPDEFS

            with Copies(inside=True) as inner:
                out = OPDEFS[f"accel_kernels::{name}"]._init_fn(*args, **kwargs)
            self.bytes += inner.bytes
            return out
        out = func(*args, **kwargs)
        copied = name == "clone" or (name == "copy_" and not self.inside) or (
            name == "contiguous" and out.data_ptr() != args[0].data_ptr())
        if copied:
            self.bytes += out.numel() * out.element_size()
        return out


def models(family: str = "llama", ops: str | None = None):
    from _models import pair

    stock, twin = pair(family)
    swap_kernels(twin, ops=ops)
    return {"stock": stock.train(), "swapped": twin.train()}


def copies(model, part: str = "attention") -> tuple[int, int]:
    """Bytes copied in layer 0's attention or MLP, forward and backward."""
    layer = model.model.layers[0]
    hidden = torch.randn(2, 5, model.config.hidden_size, requires_grad=True)
    if part == "attention":
        position_embeddings = model.model.rotary_emb(hidden, torch.arange(5)[None].expand(2, 5))
        run = lambda: layer.self_attn(hidden, position_embeddings, None)[0]  # noqa: E731
    else:
        run = lambda: layer.mlp(hidden)  # noqa: E731
    with Copies() as forward:
        out = run()
    with Copies() as backward:
        out.backward(torch.randn_like(out))
    return forward.bytes, backward.bytes


def saved(model) -> int:
    from _models import padded_batch

    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**padded_batch())
    return sum(storages.values())


def compiled(model) -> list[tuple[int, Counter]]:
    """(Inductor's fused kernels called, other calls by name) of each graph of a compiled step."""
    from torch._inductor import graph as inductor_graph

    from _models import padded_batch, training_step

    sources = []
    compile_to_module = inductor_graph.GraphLowering.compile_to_module

    def keep_source(self, *args, **kwargs):
        module = compile_to_module(self, *args, **kwargs)
        sources.append(Path(module.__file__).read_text())
        return module

    torch._dynamo.reset()
    inductor_graph.GraphLowering.compile_to_module = keep_source
    try:
        with torch._inductor.config.patch(force_disable_caches=True):
            training_step(torch.compile(model, fullgraph=True), padded_batch())
    finally:
        inductor_graph.GraphLowering.compile_to_module = compile_to_module
    out = []
    for source in sources:
        body = source[source.index("def call("):]
        fused = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)\(", body, re.M)
        others = Counter(name.split(".")[-2] if name.startswith("torch.ops") else name.split(".")[-1]
                         for name in re.findall(r"(extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(", body))
        out.append((len(fused), others))
    return out


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; tiny models (2 layers, hidden 64), float32")
    print("| model | part | copies forward, B | copies backward, B |")
    print("|---|---|---|---|")
    for family, part in (("llama", "attention"), ("phi3", "mlp")):
        for name, model in models(family).items():
            fwd, bwd = copies(model, part)
            print(f"| {family} {name} | {part} | {fwd} | {bwd} |")
    print()
    print("| Llama | saved for backward, B | compiled: Inductor kernels fwd / bwd | compiled: other calls fwd / bwd |")
    print("|---|---|---|---|")
    for name, model in models("llama").items():
        graphs = compiled(model)
        kernels = " / ".join(str(n) for n, _ in graphs)
        others = " / ".join(str(sum(c.values())) for _, c in graphs)
        print(f"| {name} | {saved(model)} | {kernels} | {others} |")


if __name__ == "__main__":
    main()
