"""What the rank-sync guard costs: the checksum of a Llama-3.2-1B-sized parameter set, and one check
per step against the step time of a 2-rank DDP run on CPU (gloo).

    python benchmarks/rank_sync.py                     # CPU: the checksum, then a 2-rank torchrun
    python benchmarks/rank_sync.py --device cuda       # the checksum on the GPU (no 2-rank run)
    python benchmarks/rank_sync.py --layers 4          # a scaled parameter set (4 of 16 layers)
    python benchmarks/rank_sync.py --json r.json       # (written after each part)
    python benchmarks/rank_sync.py --dry-run           # the same code on a tiny parameter set, no DDP run

1. The checksum (`core.rank_sync.digest_tensors`, what every check computes before its one
   collective) of the trainable parameters of a full fine-tune of Llama-3.2-1B (bf16: embedding
   128256 x 2048, 16 layers; 1.24e9 elements) and of a LoRA r=16 fine-tune of it (all linear
   layers, float32 adapters: 11.3e6 elements in 224 tensors). Best of `--repeats`.
2. `--ranks 2` processes under torchrun, gloo, a small Llama (hidden 512, 4 layers, vocabulary
   8000; 21e6 parameters, float32) in DDP with AdamW: the step time alone, and one
   `accel_patch.check_rank_sync` (checksum + all_gather + verdict) after each step, timed on its
   own; the share of one check in one step, and the interval the automatic schedule picks to keep
   it under 0.5% (ACCEL_PATCH_SYNC_EVERY unset).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

LLAMA_1B = dict(vocab=128256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8)
#: --dry-run: the same shapes' structure at a tiny size.
DRY = dict(vocab=512, hidden=64, heads=4, kv_heads=2, intermediate=128)
SHAPE = LLAMA_1B


def llama_shapes(layers: int) -> list[tuple[int, ...]]:
    """The parameter shapes of Llama-3.2-1B (tied embedding) with `layers` decoder layers."""
    c = SHAPE
    head_dim = c["hidden"] // c["heads"]
    kv = c["kv_heads"] * head_dim
    layer = [(c["hidden"], c["hidden"]), (kv, c["hidden"]), (kv, c["hidden"]), (c["hidden"], c["hidden"]),
             (c["intermediate"], c["hidden"]), (c["intermediate"], c["hidden"]), (c["hidden"], c["intermediate"]),
             (c["hidden"],), (c["hidden"],)]
    return [(c["vocab"], c["hidden"])] + layer * layers + [(c["hidden"],)]


def lora_shapes(layers: int, r: int = 16) -> list[tuple[int, ...]]:
    """A LoRA adapter (A: r x in, B: out x r) on each linear layer of each decoder layer."""
    shapes = []
    for shape in llama_shapes(layers)[1:]:
        if len(shape) == 2:
            out, inp = shape
            shapes += [(r, inp), (out, r)]
    return shapes


def time_digest(shapes, dtype, device, repeats: int) -> dict:
    import torch

    from accel_patch.core.rank_sync import digest_tensors

    g = torch.Generator(device=device).manual_seed(0)
    tensors = [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(dtype) for s in shapes]
    elements = sum(t.numel() for t in tensors)

    def once():
        t0 = time.perf_counter()
        h, s = digest_tensors(tensors)
        h.cpu(), s.cpu()  # waits for the device
        return time.perf_counter() - t0

    once()  # the constants' first build, allocator warm-up
    samples = [once() for _ in range(repeats)]
    best = min(samples)
    del tensors
    return dict(elements=elements, tensors=len(shapes), dtype=str(dtype).replace("torch.", ""), best_s=best,
                median_s=statistics.median(samples), elements_per_s=elements / best)


# --- the 2-rank run (each rank is this script under torchrun) -------------------------------------
def ddp_child(steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import accel_patch
    from accel_patch.core import rank_sync

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 8000, (4, 128), generator=g)

    def step():
        loss = ddp(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    step_s, check_s, results = [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        result = accel_patch.check_rank_sync(ddp, step=i)
        t2 = time.perf_counter()
        step_s.append(t1 - t0)
        check_s.append(t2 - t1)
        results.append(result.state)
    step_med, check_med = statistics.median(step_s), statistics.median(check_s)
    figures = dict(rank=rank, params=sum(p.numel() for p in model.parameters()), step_s=step_med,
                   check_s=check_med, check_share=check_med / step_med,
                   auto_every=rank_sync.auto_every(check_med, step_med), states=sorted(set(results)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(figures, f)
    dist.destroy_process_group()


def ddp_run(ranks: int, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--rdzv-backend=static",
               "--master_addr=127.0.0.1", "--master_port=29577", __file__, "--ddp-child", out, "--steps",
               str(steps)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(ranks)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=16, help="decoder layers of the 1B parameter set (16: all)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads for the checksum (default: torch's)")
    p.add_argument("--ranks", type=int, default=2, help="processes of the CPU DDP run (0: skip it)")
    p.add_argument("--steps", type=int, default=10, help="timed steps of the DDP run")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dry-run", action="store_true", help="a tiny parameter set on the CPU, one repeat, no DDP run")
    p.add_argument("--ddp-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dry_run:
        global SHAPE
        SHAPE = DRY
        args.device, args.layers, args.repeats, args.ranks = "cpu", 2, 1, 0
    if args.ddp_child:
        ddp_child(args.steps, args.ddp_child)
        return 0

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    figures = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=platform.node(),
                   cpus=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__, device=str(device),
                   device_name=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor())
    full = time_digest(llama_shapes(args.layers), torch.bfloat16, device, args.repeats)
    scale = "" if args.layers == 16 else f" (scaled: {args.layers} of 16 layers)"
    print(f"checksum, Llama-3.2-1B full fine-tune{scale}: {full['elements'] / 1e9:.3f}e9 bf16 elements in "
          f"{full['tensors']} tensors: {full['best_s'] * 1e3:.1f} ms (median {full['median_s'] * 1e3:.1f}), "
          f"{full['elements_per_s'] / 1e9:.2f}e9 elements/s")
    lora = time_digest(lora_shapes(args.layers), torch.float32, device, args.repeats)
    print(f"checksum, Llama-3.2-1B LoRA r=16 adapters{scale}: {lora['elements'] / 1e6:.1f}e6 float32 elements in "
          f"{lora['tensors']} tensors: {lora['best_s'] * 1e3:.2f} ms (median {lora['median_s'] * 1e3:.2f})")
    figures.update(full_finetune=full, lora=lora, layers=args.layers, dry_run=args.dry_run)
    save(args.json, figures)
    if args.ranks and device.type == "cpu":
        ranks = ddp_run(args.ranks, args.steps)
        r0 = ranks[0]
        print(f"{args.ranks}-rank DDP on CPU (gloo), Llama {r0['params'] / 1e6:.1f}e6 parameters: step "
              f"{r0['step_s'] * 1e3:.1f} ms, one check {r0['check_s'] * 1e3:.2f} ms = {r0['check_share'] * 100:.2f}% "
              f"of a step; automatic interval: every {max(r['auto_every'] for r in ranks)} step(s) "
              f"({r0['check_share'] * 100 / max(r['auto_every'] for r in ranks):.3f}% per step); "
              f"verdicts {r0['states']}")
        figures["ddp"] = ranks
    save(args.json, figures)
    return 0


def save(path, figures) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
