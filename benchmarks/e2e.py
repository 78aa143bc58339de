"""One training step of a stock model against the same model with accel-patch's kernels swapped in.

    python benchmarks/e2e.py                 # CPU: tiny Llama, vocab 32000, 2048 tokens, float32
    python benchmarks/e2e.py --json e2e.json # also every figure as JSON
    python benchmarks/e2e.py --device cuda   # GPU: Llama-3.2-1B shape, bf16, full fine-tune and LoRA r=16
    python benchmarks/e2e.py --compile       # eager and torch.compile (Inductor), stock and swapped, full fine-tune

Each variant (stock, swapped; on GPU also with LoRA) runs in a fresh process: build the model
from a config (random weights, nothing downloaded) and one batch, run `--warmup` steps, then time
`--steps` forward+backward steps (the optimizer step is the same for both and is left out).

- tokens/s: tokens of the batch / median step time.
- peak memory growth of a step: on GPU, torch.cuda.max_memory_allocated() during a step minus what
  was allocated before it (weights, inputs); on CPU, the rise of the process's peak RSS (ru_maxrss)
  over the first step (measured before any warm-up, so the high-water mark is the step's).
- ratios are swapped / stock for memory and stock / swapped for speed (tokens/s of swapped over
  stock), so > 1 is faster and < 1 is smaller; targets are printed beside them with PASS or MISS.
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
import time

SHAPES = {
    # A tiny Llama whose logits dominate, as a real vocabulary makes them: vocab 32000.
    "cpu": dict(config=dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048),
                batch=1, seq=2048, dtype="float32"),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, vocab 128256, tied.
    "cuda": dict(config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0),
                 batch=4, seq=2048, dtype="bfloat16"),
}
TARGETS = {"cpu": {"memory": 0.5, "speed": 1 / 1.25}, "cuda": {"memory": 0.6, "speed": 1.3}}


def child(variant: str, device: str, warmup: int, steps: int) -> dict:
    """One variant, in this process: {"tokens_per_s", "step_s", "peak_growth_mib", ...}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import accel_patch

    shape = SHAPES[device]
    dtype = getattr(torch, shape["dtype"])
    torch.manual_seed(0)
    config = LlamaConfig(**shape["config"], attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if "lora" in variant:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    report = accel_patch.swap_kernels(model).summary() if "swapped" in variant else None
    model.train()
    if "compile" in variant:
        model = torch.compile(model)  # Inductor; the warm-up steps pay for the compilation
    ids = torch.randint(0, config.vocab_size, (shape["batch"], shape["seq"]), device=device)
    batch = {"input_ids": ids, "labels": ids}

    def step():
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    if device == "cuda":
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        growth = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        step()  # the first step sets the high-water mark: its rise is the step's peak growth
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        for _ in range(max(0, warmup - 1)):
            step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return dict(variant=variant, step_s=step_s, tokens_per_s=shape["batch"] * shape["seq"] / step_s,
                peak_growth_mib=growth, steps=steps, swap=report)


def run_variant(variant: str, device: str, warmup: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: the plain-torch paths
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--device", device,
           "--warmup", str(warmup), "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(variant=variant, error=f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}")


def compare(stock: dict, swapped: dict, targets: dict) -> dict:
    if "error" in stock or "error" in swapped:
        return {}
    memory = swapped["peak_growth_mib"] / stock["peak_growth_mib"]
    speed = swapped["tokens_per_s"] / stock["tokens_per_s"]
    return dict(memory_ratio=memory, speed_ratio=speed,
                memory_verdict="PASS" if memory <= targets["memory"] else "MISS",
                speed_verdict="PASS" if speed >= targets["speed"] else "MISS")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default: 1 on CPU, 3 on GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 3 on CPU, 10 on GPU)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--compile", action="store_true",
                   help="eager and torch.compile (Inductor) of stock and swapped, full fine-tune only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" else 1)
    steps = args.steps if args.steps is not None else (10 if device == "cuda" else 3)
    if warmup < 1 or steps < 1:
        p.error(f"--warmup and --steps must be >= 1, got {warmup} and {steps}")
    if args.child:
        print(json.dumps(child(args.child, device, warmup, steps)))
        return 0

    import triton
    import transformers

    shape = SHAPES[device]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"accel-patch end-to-end step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    c = shape["config"]
    print(f"Llama: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, vocab {c['vocab_size']}, "
          f"{shape['batch']} x {shape['seq']} tokens, {shape['dtype']}, sdpa; {warmup} warm-up, median of {steps} steps")
    if args.compile:
        pairs = [("eager", "stock", "swapped"), ("compiled", "stock+compile", "swapped+compile")]
    else:
        pairs = [("full", "stock", "swapped")] + ([("LoRA r=16", "stock+lora", "swapped+lora")] if device == "cuda" else [])
    targets = TARGETS[device]
    results = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, device=device,
                   shape=shape, torch=torch.__version__, triton=triton.__version__, rows=[])
    print(f"\n{'run':<11}{'variant':<14}{'tokens/s':>11}{'step s':>9}{'peak growth MiB':>17}")
    for label, a, b in pairs:
        stock, swapped = (run_variant(v, device, warmup, steps) for v in (a, b))
        for r in (stock, swapped):
            if "error" in r:
                print(f"{label:<11}{r['variant']:<14}FAILED: {r['error']}")
            else:
                print(f"{label:<11}{r['variant']:<14}{r['tokens_per_s']:>11.0f}{r['step_s']:>9.3f}{r['peak_growth_mib']:>17.0f}")
        verdict = compare(stock, swapped, targets)
        if verdict:
            print(f"{'':<11}swapped/stock: tokens/s {verdict['speed_ratio']:.2f}x (target >= {targets['speed']:.2f}x: "
                  f"{verdict['speed_verdict']}), peak growth {verdict['memory_ratio']:.2f}x "
                  f"(target <= {targets['memory']:.2f}x: {verdict['memory_verdict']})")
        if swapped.get("swap"):
            print(f"{'':<11}{swapped['swap']}")
        results["rows"].append(dict(run=label, stock=stock, swapped=swapped, **verdict))
    if args.compile and len(results["rows"]) == 2:
        eager, compiled = results["rows"]
        for who in ("stock", "swapped"):
            e, c = eager[who], compiled[who]
            if "error" not in e and "error" not in c:
                print(f"compiled/eager {who}: tokens/s {c['tokens_per_s'] / e['tokens_per_s']:.2f}x, "
                      f"peak growth {c['peak_growth_mib'] / e['peak_growth_mib']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r.get("memory_verdict") for r in results["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
