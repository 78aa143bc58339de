"""Long sequences: one training step with gradient checkpointing, stock vs swapped without the
tiled MLP vs swapped (every op), at several sequence lengths; on GPU also the longest sequence each
trains in a fixed memory budget.

    python benchmarks/long_context.py                      # CPU: Llama hidden 512, inter 2048, 2 layers,
                                                           # vocab 32000, fp32, 4096 / 8192 / 16384 tokens
    python benchmarks/long_context.py --seqs 4096,8192     # chosen lengths
    python benchmarks/long_context.py --crossover          # CPU: one MLP's step, tiled vs not, by tokens
    python benchmarks/long_context.py --pairs 4 --seqs 8192  # the two swapped variants timed alternately
    python benchmarks/long_context.py --device cuda        # GPU: Llama-3.2-1B shape, bf16, 8k/16k/32k,
                                                           # then the longest trainable sequence
    python benchmarks/long_context.py --json long.json     # also every figure as JSON (after every length)
    python benchmarks/long_context.py --dry-run            # the same code at a tiny shape on CPU, in seconds

Every step is forward + backward of a causal-LM loss on one sequence (batch 1) with
`gradient_checkpointing_enable({"use_reentrant": False})` (transformers' default); the optimizer
step is the same for all and left out. Random weights from a config, nothing downloaded.

- peak memory growth: on GPU, max_memory_allocated() during a step minus what was allocated before
  it; on CPU, the rise of the process's peak RSS over the first step (a fresh process per variant
  and length, so the high-water mark is that step's), with glibc's mmap threshold fixed at 128 KiB
  (MALLOC_MMAP_THRESHOLD_) so that a freed tensor's memory leaves the process as on a GPU's
  allocator: by default glibc raises the threshold after the first large free and keeps later
  freed blocks in its heap, so peak RSS then counts the allocator's retention (`--malloc default`
  measures that way; the timed process always runs with glibc's defaults).
- tokens/s: tokens / median step time; the three variants are timed round-robin in one process
  per length (a change of the machine's load then hits all alike).
- loss: the first step's loss of each variant (the same weights and tokens): they must agree.
- ratios: swapped / "no tiled MLP" for memory and time; the CPU targets at 8192 tokens (peak
  growth <= 0.6x, time <= 1.25x) print PASS or MISS.
- longest (GPU): per variant (stock or swapped, full fine-tune or QLoRA, with or without
  transformers' checkpoint offloading: TrainingArguments' `gradient_checkpointing_kwargs={"offload":
  True}`, which Trainer passes as `offload=True`), the
  longest power-of-two multiple of --start tokens whose step fits in --budget-gib
  (torch.cuda.set_per_process_memory_fraction), each length in a fresh process; QLoRA is skipped
  without bitsandbytes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import _children  # benchmarks/: one process per variant, forked in a dry run

SHAPES = {
    "cpu": dict(config=dict(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=131072),
                seqs=(4096, 8192, 16384), dtype="float32"),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, vocab 128256, tied.
    "cuda": dict(config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=1048576, tie_word_embeddings=True, rope_theta=500000.0),
                 seqs=(8192, 16384, 32768), dtype="bfloat16"),
    # --dry-run: the code of a run at a tiny shape on CPU (too short to tile: the paths, not figures).
    "dry": dict(config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
                seqs=(128,), dtype="float32"),
}
VARIANTS = ("stock", "no tiled MLP", "swapped")


def torch_device(device: str) -> str:
    """The torch device of a --device value ("dry": the CPU)."""
    return "cpu" if device == "dry" else device
TARGETS = {"memory": 0.6, "time": 1.25, "at": 8192}  # swapped / no tiled MLP, CPU
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def ops_of(variant: str):
    from accel_patch.swaps import OPS

    return {"stock": None, "no tiled MLP": [o for o in OPS if o != "tiled_mlp"], "swapped": list(OPS)}[variant]


def build(device: str, qlora: bool = False, checkpoint: str | None = None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[device]
    dtype = getattr(torch, shape["dtype"])
    if qlora:
        from peft import LoraConfig, get_peft_model
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant, dtype=dtype,
                                                 device_map={"": device}, attn_implementation="sdpa")
        torch.manual_seed(1)
        return get_peft_model(model, LoraConfig(**LORA))
    torch.manual_seed(0)
    config = LlamaConfig(**shape["config"], attn_implementation="sdpa")
    with torch.device(torch_device(device)):
        return LlamaForCausalLM(config).to(dtype)


def prepared(variant: str, device: str, seq: int, qlora=False, checkpoint=None, offload=False):
    import torch

    import accel_patch

    model = build(device, qlora, checkpoint)
    ops = ops_of(variant)
    report = accel_patch.swap_kernels(model, ops) if ops is not None else None
    # what Trainer does with TrainingArguments(gradient_checkpointing_kwargs={"offload": True, ...})
    if offload:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPES[device]["config"]["vocab_size"], (1, seq), generator=gen).to(torch_device(device))
    return model, {"input_ids": ids, "labels": ids}, report


def step(model, batch) -> float:
    loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.item()


def memory_child(variant: str, device: str, seq: int) -> dict:
    import torch

    model, batch, report = prepared(variant, device, seq)
    if device == "cuda":
        step(model, batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = step(model, batch)
        growth = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        loss = step(model, batch)  # the first step sets the high-water mark: its rise is the step's peak growth
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return dict(variant=variant, seq=seq, peak_growth_mib=growth, loss=loss,
                calls=(report.calls.get("tiled_mlp") if report is not None else None))


def timed_step(model, batch, device: str) -> float:
    """Seconds of one training step (the GPU synchronized before and after)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step(model, batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def timing_child(device: str, seq: int, warmup: int, steps: int) -> dict:
    import torch

    if device != "cuda":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    runs = {v: prepared(v, device, seq)[:2] for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for i in range(warmup + steps):
        for v, (model, batch) in runs.items():
            seconds = timed_step(model, batch, device)
            if i >= warmup:
                times[v].append(seconds)
    return {v: statistics.median(t) for v, t in times.items()}


def pairs(device: str, seq: int, n: int) -> dict:
    """The two swapped variants timed alternately in this process, the order reversed every round,
    after one warm-up round: medians and the pairwise ratios (robust to the machine's load drifting)."""
    import torch

    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    runs = {v: prepared(v, device, seq)[:2] for v in ("no tiled MLP", "swapped")}
    times = {v: [] for v in runs}
    for i in range(n + 1):
        for v, (model, batch) in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
            seconds = timed_step(model, batch, device)
            if i:
                times[v].append(seconds)
    ratios = [b / a for a, b in zip(times["no tiled MLP"], times["swapped"])]
    return dict(seq=seq, median_s={v: statistics.median(t) for v, t in times.items()}, ratios=ratios,
                median_ratio=statistics.median(ratios))


def fits_child(variant: str, seq: int, qlora: bool, offload: bool, checkpoint: str | None, budget_gib: float) -> dict:
    """Whether one step of `variant` at `seq` tokens fits in the budget (GPU)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_gib * 2**30 / total))
    try:
        model, batch, _ = prepared(variant, "cuda", seq, qlora, checkpoint, offload)
        t0 = time.perf_counter()
        step(model, batch)
        torch.cuda.synchronize()
        return dict(fits=True, step_s=time.perf_counter() - t0, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    except torch.cuda.OutOfMemoryError:
        return dict(fits=False)


def crossover() -> None:
    """One MLP (hidden 512, intermediate 2048, fp32) forward + backward, its own forward vs tiled,
    by tokens: seconds (median of 3) and peak RSS growth (fresh process each)."""
    print("tokens  tokens x inter  untiled s  tiled s  time ratio  untiled MiB  tiled MiB")
    for tokens in (256, 512, 1024, 2048, 4096, 8192):
        r = {}
        for mode in ("untiled", "tiled"):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"mlp:{mode}:{tokens}"],
                                 env=_child_env(), capture_output=True, text=True)
            r[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{tokens:>6}  {tokens * 2048:>14}  {r['untiled']['s']:>9.4f}  {r['tiled']['s']:>7.4f}  "
              f"{r['tiled']['s'] / r['untiled']['s']:>10.2f}  {r['untiled']['mib']:>11.0f}  {r['tiled']['mib']:>9.0f}")


def mlp_child(mode: str, tokens: int) -> dict:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from accel_patch.swaps.layers import tiled_mlp

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    module = LlamaMLP(LlamaConfig(hidden_size=512, intermediate_size=2048))
    x = torch.randn(1, tokens, 512, requires_grad=True)
    chunk = tiled_mlp.chunk_tokens(512, 2048)

    def once():
        out = tiled_mlp.tiled(module, x, chunk) if mode == "tiled" else module(x)
        out.backward(torch.ones_like(out))

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    once()
    mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return dict(s=statistics.median(times), mib=mib)


def _child_env():
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_KERNELS")} | {
        "ACCEL_PATCH_KERNELS": "0"}  # the variant swaps (or not) by itself


#: glibc's mmap threshold for the memory children (bytes): see the module docstring.
MMAP_THRESHOLD = 131072


def run_child(args: list[str], malloc: str = "default") -> dict:
    env = _child_env()
    if malloc == "fixed":
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    dry = "--device" in args and args[args.index("--device") + 1] == "dry"
    proc = _children.run([sys.executable, os.path.abspath(__file__), *args], env, dry=dry)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(error=f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")


def longest(budget_gib: float, start: int, cap: int) -> list[dict]:
    """The longest sequence (start x 2^k, up to cap) each GPU variant trains in the budget."""
    try:
        import bitsandbytes  # noqa: F401
        qlora_modes = (False, True)
    except ImportError:
        qlora_modes = (False,)
        print("QLoRA: skipped (bitsandbytes is not installed)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if True in qlora_modes:
            import torch

            checkpoint = os.path.join(tmp, "base")
            build("cuda").to(torch.bfloat16).save_pretrained(checkpoint)
        for qlora in qlora_modes:
            for offload in (False, True):
                for variant in ("stock", "swapped"):
                    best, seq, last = None, start, None
                    while seq <= cap:
                        args = ["--child", "fits", "--variant", variant, "--seq", str(seq), "--budget-gib", str(budget_gib)]
                        args += ["--qlora", "--checkpoint", checkpoint] if qlora else []
                        args += ["--offload"] if offload else []
                        last = run_child(args)
                        if not last.get("fits"):
                            break
                        best = dict(seq=seq, **last)
                        seq *= 2
                    row = dict(variant=variant, qlora=qlora, offload=offload, longest=best and best["seq"],
                               step_s=best and best["step_s"], failed_at=seq if seq <= cap else None,
                               error=(last or {}).get("error"))
                    rows.append(row)
                    print(f"  {'QLoRA' if qlora else 'full':<6} offload {'on ' if offload else 'off'}  {variant:<8} "
                          f"longest {row['longest']}  ({'OOM at ' + str(row['failed_at']) if row['failed_at'] else 'cap'})"
                          f"{'  ' + row['error'] if row['error'] else ''}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda", "dry"), help="default: cuda when available (dry: --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="the same code at a tiny shape on CPU, one step each, no longest search")
    p.add_argument("--seqs", help="comma-separated sequence lengths (default: the device's)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default: 1 on CPU, 2 on GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 2 on CPU, 5 on GPU)")
    p.add_argument("--crossover", action="store_true", help="CPU: one MLP's step, tiled vs not, by tokens")
    p.add_argument("--memory-only", action="store_true", help="peak growth and loss only, no timed steps")
    p.add_argument("--pairs", type=int, metavar="N", help="only: N alternating timed pairs of the two swapped variants")
    p.add_argument("--no-longest", action="store_true", help="GPU: skip the longest-sequence search")
    p.add_argument("--only-longest", action="store_true", help="GPU: only the longest-sequence search")
    p.add_argument("--budget-gib", type=float, default=24.0, help="GPU memory budget of the search (GiB)")
    p.add_argument("--start", type=int, default=16384, help="first length of the search")
    p.add_argument("--cap", type=int, default=131072, help="longest length tried")
    p.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                   help="CPU memory children: glibc's mmap threshold fixed at 128 KiB (default) or glibc's own")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--qlora", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child and args.child.startswith("mlp:"):
        _, mode, tokens = args.child.split(":")
        print(json.dumps(mlp_child(mode, int(tokens))))
        return 0
    if args.crossover:
        crossover()
        return 0
    import torch

    device = "dry" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    warmup = args.warmup if args.warmup is not None else (2 if device == "cuda" else 1)
    steps = args.steps if args.steps is not None else (5 if device == "cuda" else 1 if device == "dry" else 2)
    if args.pairs:
        for seq in ([int(v) for v in args.seqs.split(",")] if args.seqs else SHAPES[device]["seqs"]):
            r = pairs(device, seq, args.pairs)
            print(f"{seq} tokens: no tiled MLP {r['median_s']['no tiled MLP']:.2f} s, swapped "
                  f"{r['median_s']['swapped']:.2f} s (medians of {args.pairs}); swapped / no tiled MLP per pair "
                  f"{', '.join(f'{x:.2f}' for x in r['ratios'])}: median {r['median_ratio']:.2f}x", flush=True)
        return 0
    if args.child == "fits":
        print(json.dumps(fits_child(args.variant, args.seq, args.qlora, args.offload, args.checkpoint, args.budget_gib)))
        return 0
    if args.child == "timing":
        print(json.dumps(timing_child(device, args.seq, warmup, steps)))
        return 0
    if args.child:
        print(json.dumps(memory_child(args.child, device, args.seq)))
        return 0
    try:
        seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else list(SHAPES[device]["seqs"])
    except ValueError:
        p.error(f"--seqs must be comma-separated whole numbers, got {args.seqs!r}")

    import transformers

    shape = SHAPES[device]
    c = shape["config"]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"accel-patch long-context step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, load {os.getloadavg()[0]:.1f}")
    print(f"Llama: hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, {c['num_hidden_layers']} layers, "
          f"vocab {c['vocab_size']}, batch 1, {shape['dtype']}, gradient checkpointing (non-reentrant); "
          f"{warmup} warm-up, median of {steps} steps"
          f"{'; glibc mmap threshold ' + ('fixed' if args.malloc == 'fixed' else 'default') if device == 'cpu' else ''}",
          flush=True)
    def save(results, long_rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=device, machine=machine, shape=shape, malloc=args.malloc, results=results,
                               longest=long_rows), f, indent=1)

    save([], [])
    print(f"\n{'tokens':>7}  {'variant':<13}{'tokens/s':>10}{'step s':>9}{'peak growth MiB':>17}{'loss':>10}  tiled_mlp calls")
    results = []
    for seq in ([] if args.only_longest else seqs):
        malloc = args.malloc if device != "cuda" else "default"
        rows = {v: run_child(["--device", device, "--child", v, "--seq", str(seq)], malloc) for v in VARIANTS}
        timed = ({v: float("nan") for v in VARIANTS} if args.memory_only else
                 run_child(["--device", device, "--child", "timing", "--seq", str(seq),
                            "--warmup", str(warmup), "--steps", str(steps)]))
        for v, r in rows.items():
            if "error" in r or "error" in timed:
                print(f"{seq:>7}  {v:<13}error: {r.get('error') or timed.get('error')}")
                continue
            r["step_s"] = timed[v]
            r["tokens_per_s"] = seq / timed[v]
            print(f"{seq:>7}  {v:<13}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.3f}{r['peak_growth_mib']:>17.0f}"
                  f"{r['loss']:>10.4f}  {r['calls'] or ''}")
        base, new, stock = rows["no tiled MLP"], rows["swapped"], rows["stock"]
        if not any("error" in r for r in rows.values()) and "error" not in timed:
            memory, speed = new["peak_growth_mib"] / base["peak_growth_mib"], new["step_s"] / base["step_s"]
            timed_ratio = (lambda r: "" if args.memory_only else f", time {r:.2f}x")
            line = (f"{seq:>7}  swapped / no tiled MLP: peak growth {memory:.2f}x{timed_ratio(speed)}; "
                    f"swapped / stock: peak growth {new['peak_growth_mib'] / stock['peak_growth_mib']:.2f}x"
                    f"{timed_ratio(new['step_s'] / stock['step_s'])}; loss difference "
                    f"{abs(new['loss'] - base['loss']):.1e}")
            if device == "cpu" and seq == TARGETS["at"]:
                line += (f"  [targets: memory <= {TARGETS['memory']}x {'PASS' if memory <= TARGETS['memory'] else 'MISS'}, "
                         + (f"time <= {TARGETS['time']}x {'PASS' if speed <= TARGETS['time'] else 'MISS'}]"
                            if not args.memory_only else "time not measured]"))
            print(line, flush=True)
        results.append(dict(seq=seq, rows=rows))
        save(results, [])  # after every length: a run cut short keeps what finished
    long_rows = []
    if device == "cuda" and not args.no_longest or args.only_longest:
        print(f"\nlongest sequence in {args.budget_gib:g} GiB (one step, gradient checkpointing; lengths "
              f"{args.start} x 2^k up to {args.cap})", flush=True)
        long_rows = longest(args.budget_gib, args.start, args.cap)
    save(results, long_rows)
    failed = [r for res in results for r in res["rows"].values() if "error" in r]
    failed += [r for r in long_rows if r.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
