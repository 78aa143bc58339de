"""One training step of a stock model against the same model with accel-patch's kernels swapped in.

    python benchmarks/e2e.py                 # CPU: tiny Llama, vocab 32000, 2048 tokens, float32
    python benchmarks/e2e.py --json e2e.json # also every figure as JSON
    python benchmarks/e2e.py --device cuda   # GPU: Llama-3.2-1B shape, bf16, full fine-tune and LoRA r=16
    python benchmarks/e2e.py --compile       # eager and torch.compile (Inductor), stock and swapped, full fine-tune
    python benchmarks/e2e.py --dry-run       # the same code at a tiny shape on CPU, in seconds (one step each)

Each variant (stock, swapped, swapped + tiled MLP; on GPU also with LoRA) runs in a fresh process (forked from this one in a dry run: benchmarks/_children.py):
build the model from a config (random weights, nothing downloaded) and one batch, run `--warmup`
steps, then time `--steps` forward+backward steps (the optimizer step is the same for all and is
left out). "swapped" is the default swap (`swap_kernels(model)`): without gradient checkpointing it
does not tile the MLP; "swapped+tiled" names every op (`ops=OPS`), so the tiled MLP runs too: its
own column, never mixed into the others.

- loss and gradient norm of the first step (the same weights and tokens in every variant): a
  swapped variant whose loss or gradient norm differs from stock's by more than LOSS_BOUND /
  GRAD_BOUND (relative) fails the run (exit 1) whatever its speed: a wrong kernel does not look fast.

- tokens/s: tokens of the batch / median step time.
- peak memory growth of a step: on GPU, torch.cuda.max_memory_allocated() during a step minus what
  was allocated before it (weights, inputs); on CPU, the rise of the process's peak RSS (ru_maxrss)
  over the first step (measured before any warm-up, so the high-water mark is the step's).
- ratios are swapped / stock for memory and stock / swapped for speed (tokens/s of swapped over
  stock), so > 1 is faster and < 1 is smaller; targets are printed beside them with PASS or MISS
  (a MISS is a figure, not a failure).
- --json PATH is written again after every variant, so a run cut short keeps what finished.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time

import _children  # benchmarks/: one process per variant, forked in a dry run

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
    # --dry-run: the code of a GPU run (every variant, LoRA included) at a tiny shape on CPU.
    "dry": dict(config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                batch=1, seq=64, dtype="float32"),
}
TARGETS = {"cpu": {"memory": 0.5, "speed": 1 / 1.25}, "cuda": {"memory": 0.6, "speed": 1.3},
           "dry": {"memory": 0.5, "speed": 1 / 1.25}}
COMPILE_BACKEND = "inductor"  # --backend (a child's)
#: Largest relative difference from stock of a swapped variant's first-step loss and gradient norm,
#: by dtype: bf16 rounds every activation and the kernels round where stock does not; float32
#: agrees to rounding.
LOSS_BOUND = {"bfloat16": 2e-2, "float32": 1e-4}
GRAD_BOUND = {"bfloat16": 5e-2, "float32": 1e-3}


def child(variant: str, device: str, warmup: int, steps: int, shape_name: str) -> dict:
    """One variant, in this process: {"tokens_per_s", "step_s", "peak_growth_mib", "loss", ...}."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import accel_patch
    from accel_patch.swaps import OPS

    shape = SHAPES[shape_name]
    dtype = getattr(torch, shape["dtype"])
    torch.manual_seed(0)
    config = LlamaConfig(**shape["config"], attn_implementation="sdpa")
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    if "lora" in variant:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    report = None
    if "swapped" in variant:  # "+tiled": every op named, so the tiled MLP runs without checkpointing
        report = accel_patch.swap_kernels(model, OPS if "+tiled" in variant else None).summary()
    model.train()
    if "compile" in variant:
        model = torch.compile(model, backend=COMPILE_BACKEND)  # the warm-up steps pay for the compilation
    gen = torch.Generator().manual_seed(0)  # the same tokens in every variant, whatever the swap drew
    ids = torch.randint(0, config.vocab_size, (shape["batch"], shape["seq"]), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}

    first = {}

    def step():
        loss = model(**batch).loss
        loss.backward()
        if not first:  # the first step's loss and gradient norm: the same weights and tokens everywhere
            grads = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
            first.update(loss=loss.item(), grad_norm=torch.stack(grads).norm().item())
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
                peak_growth_mib=growth, steps=steps, swap=report, **first)


def run_variant(variant: str, device: str, warmup: int, steps: int, shape_name: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_KERNELS")}
    env["ACCEL_PATCH_KERNELS"] = "0"  # the variant swaps (or not) by itself; CPU: the plain-torch paths
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--device", device,
           "--warmup", str(warmup), "--steps", str(steps), "--shape", shape_name, "--backend", COMPILE_BACKEND]
    proc = _children.run(cmd, env, dry=shape_name == "dry")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(variant=variant, error=f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}")


def compare(stock: dict, swapped: dict, targets: dict, dtype: str) -> dict:
    """Ratios and verdicts of a swapped variant against stock; "correct": its first-step loss and
    gradient norm agree with stock's (LOSS_BOUND, GRAD_BOUND)."""
    if "error" in stock or "error" in swapped:
        return {}
    memory = swapped["peak_growth_mib"] / max(stock["peak_growth_mib"], 1e-9)
    speed = swapped["tokens_per_s"] / stock["tokens_per_s"]
    loss_diff = abs(swapped["loss"] - stock["loss"]) / max(abs(stock["loss"]), 1e-30)
    grad_diff = abs(swapped["grad_norm"] - stock["grad_norm"]) / max(abs(stock["grad_norm"]), 1e-30)
    correct = loss_diff <= LOSS_BOUND[dtype] and grad_diff <= GRAD_BOUND[dtype]  # (NaN fails)
    return dict(memory_ratio=memory, speed_ratio=speed, loss_rel_diff=loss_diff, grad_norm_rel_diff=grad_diff,
                correct=correct, memory_verdict="PASS" if memory <= targets["memory"] else "MISS",
                speed_verdict="PASS" if speed >= targets["speed"] else "MISS")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default: 1 on CPU, 3 on GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 3 on CPU, 10 on GPU)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON (after every variant)")
    p.add_argument("--compile", action="store_true",
                   help="eager and torch.compile (Inductor) of stock and swapped, full fine-tune only")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of --compile (default: inductor)")
    p.add_argument("--dry-run", action="store_true",
                   help="every variant of a GPU run (LoRA included) at a tiny shape on CPU, one step each")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape_name = args.shape or ("dry" if args.dry_run else device)
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" else 1)
    steps = args.steps if args.steps is not None else (10 if device == "cuda" else (1 if args.dry_run else 3))
    if warmup < 1 or steps < 1:
        p.error(f"--warmup and --steps must be >= 1, got {warmup} and {steps}")
    global COMPILE_BACKEND
    COMPILE_BACKEND = args.backend
    if args.child:
        print(json.dumps(child(args.child, device, warmup, steps, shape_name)))
        return 0

    import triton
    import transformers

    shape = SHAPES[shape_name]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"accel-patch end-to-end step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
          f"{', DRY RUN (tiny shape, no figures)' if args.dry_run else ''}")
    c = shape["config"]
    print(f"Llama: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, vocab {c['vocab_size']}, "
          f"{shape['batch']} x {shape['seq']} tokens, {shape['dtype']}, sdpa; {warmup} warm-up, median of {steps} steps")
    if args.compile:
        runs = [("eager", ("stock", "swapped")), ("compiled", ("stock+compile", "swapped+compile"))]
    else:
        runs = [("full", ("stock", "swapped", "swapped+tiled"))]
        if device == "cuda" or args.dry_run:
            runs.append(("LoRA r=16", ("stock+lora", "swapped+lora", "swapped+tiled+lora")))
    targets = TARGETS[shape_name]
    results = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, device=device,
                   dry_run=args.dry_run, shape=shape, torch=torch.__version__, triton=triton.__version__,
                   transformers=transformers.__version__, loss_bound=LOSS_BOUND[shape["dtype"]],
                   grad_bound=GRAD_BOUND[shape["dtype"]], rows=[])

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    save()
    print(f"\n{'run':<11}{'variant':<20}{'tokens/s':>11}{'step s':>9}{'peak growth MiB':>17}{'loss':>10}{'grad norm':>11}")
    ok = True
    for label, variants in runs:
        row = dict(run=label)
        results["rows"].append(row)
        for v in variants:
            r = run_variant(v, device, warmup, steps, shape_name)
            row[v] = r
            if "error" in r:
                ok = False
                print(f"{label:<11}{v:<20}FAILED: {r['error']}", flush=True)
            else:
                print(f"{label:<11}{v:<20}{r['tokens_per_s']:>11.0f}{r['step_s']:>9.3f}{r['peak_growth_mib']:>17.0f}"
                      f"{r['loss']:>10.4f}{r['grad_norm']:>11.4g}", flush=True)
            if v != variants[0]:
                verdict = compare(row[variants[0]], r, targets, shape["dtype"])
                row.setdefault("against_stock", {})[v] = verdict
                if verdict:
                    ok = ok and verdict["correct"]
                    print(f"{'':<11}{v}/stock: tokens/s {verdict['speed_ratio']:.2f}x (target >= {targets['speed']:.2f}x: "
                          f"{verdict['speed_verdict']}), peak growth {verdict['memory_ratio']:.2f}x "
                          f"(target <= {targets['memory']:.2f}x: {verdict['memory_verdict']}); loss "
                          f"{verdict['loss_rel_diff']:.1e}, grad norm {verdict['grad_norm_rel_diff']:.1e} from stock "
                          f"({'OK' if verdict['correct'] else 'WRONG'}: bounds {LOSS_BOUND[shape['dtype']]:g}, "
                          f"{GRAD_BOUND[shape['dtype']]:g})", flush=True)
                if r.get("swap"):
                    print(f"{'':<11}{r['swap']}")
            save()  # after every variant: a run cut short keeps what finished
    if args.compile and len(results["rows"]) == 2:
        eager, compiled = results["rows"]
        for who, e_name, c_name in (("stock", "stock", "stock+compile"), ("swapped", "swapped", "swapped+compile")):
            e, c = eager[e_name], compiled[c_name]
            if "error" not in e and "error" not in c:
                print(f"compiled/eager {who}: tokens/s {c['tokens_per_s'] / e['tokens_per_s']:.2f}x, "
                      f"peak growth {c['peak_growth_mib'] / e['peak_growth_mib']:.2f}x")
    results["correct"] = ok
    save()
    if not ok:
        print("FAILED: a variant did not run, or a swapped variant's loss or gradient norm is not stock's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
