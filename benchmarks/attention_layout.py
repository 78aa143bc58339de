"""What the attention's tensors cost around the swapped RoPE, stock against swapped, counted on a CPU
(tiny Llama from tests/swaps/_models.py, SDPA, float32, Triton's interpreter):

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/attention_layout.py

- copies: bytes written by clone/copy_ in one attention layer's forward and backward (an output
  laid out as q is by SDPA, copied by `transpose(1, 2).contiguous()` before o_proj when q is
  (B, H, S, D)-contiguous; gradients copied by the projections' view backward when they are);
- saved: bytes of the distinct storages a training forward keeps for backward (every op swapped);
- compiled: the kernels Inductor generates for a compiled training step's forward and backward
  graphs (its own fused kernels; the ops' and matmuls' calls are counted beside them).

Counts, not times: they hold on any machine, and scale with the token count (docs/kernels.md gives
them at Llama-3.2-1B's shape).
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
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("clone", "copy_"):
            self.bytes += out.numel() * out.element_size()
        return out


def models():
    from _models import pair

    stock, twin = pair("llama")
    swap_kernels(twin)
    return {"stock": stock.train(), "swapped": twin.train()}


def copies(model) -> tuple[int, int]:
    attn = model.model.layers[0].self_attn
    hidden = torch.randn(2, 5, 64, requires_grad=True)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(5)[None].expand(2, 5))
    with Copies() as forward:
        out = attn(hidden, position_embeddings, None)[0]
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
    found = {name: (copies(m), saved(m), compiled(m)) for name, m in models().items()}
    print(f"torch {torch.__version__}; a tiny Llama (2 layers, hidden 64, 4 heads, 2 kv heads), float32")
    print("| model | copies forward, B | copies backward, B | saved for backward, B | compiled: Inductor kernels fwd / bwd "
          "| compiled: other calls fwd / bwd |")
    print("|---|---|---|---|---|---|")
    for name, ((fwd, bwd), kept, graphs) in found.items():
        kernels = " / ".join(str(n) for n, _ in graphs)
        others = " / ".join(str(sum(c.values())) for _, c in graphs)
        print(f"| {name} | {fwd} | {bwd} | {kept} | {kernels} | {others} |")


if __name__ == "__main__":
    main()
