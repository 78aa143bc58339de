"""One training step of a stock model against the same model with accel-patch's kernels swapped in.

    python benchmarks/e2e.py                 # CPU: tiny Llama, vocab 32000, 2048 tokens, float32
    python benchmarks/e2e.py --json e2e.json # also every figure as JSON
    python benchmarks/e2e.py --device cuda   # GPU: Llama-3.2-1B shape, bf16, full fine-tune and LoRA r=16
    python benchmarks/e2e.py --compile       # eager and torch.compile (Inductor), stock and swapped, full fine-tune
    python benchmarks/e2e.py --dry-run       # the same code at a tiny shape on CPU, in seconds (one step each)
    python benchmarks/e2e.py --variants stock,swapped,liger,stock+lora,swapped+lora,liger+lora --profile prof.json

Variants: stock, swapped, swapped+tiled, liger (Liger Kernel's `apply_liger_kernel_to_llama()`,
applied before the model is built, as its users do), each also +lora (PEFT LoRA r=16, all-linear)
or +compile (torch.compile, Inductor). A run's baseline is its stock variant (stock, stock+lora,
stock+compile); swapped variants are also compared with the run's Liger variant.

Variants run in one process per --variants list on GPU (a fresh interpreter costs ~10 s of imports
and CUDA start; the peak is max_memory_allocated over what was allocated before the step, which
another variant's freed memory does not touch), Liger's last (its patch replaces transformers'
Llama classes and functions for the whole process), stock's first. A variant that raises is reported with the
first line of its error and the next runs; a process that dies (a CUDA fault) loses the variant it
was in, and the ones after it run in a fresh process. On CPU (figures from the peak RSS) each variant
has a process of its own (forked in a dry run: benchmarks/_children.py). Each builds the model
from a config (random weights, nothing downloaded) and one batch, runs `--warmup` steps, then times
`--steps` forward+backward steps (the optimizer step is the same for all and is left out). "swapped" is the default swap (`swap_kernels(model)`): without gradient checkpointing it
does not tile the MLP; "swapped+tiled" names every op (`ops=OPS`), so the tiled MLP runs too: its
own column, never mixed into the others. "swapped+kept": the default swap with the norms' outputs
saved by the projections as autograd saves them (`accel_kernels.ops.rms_norm.RECOMPUTE_OUTPUTS`
off), beside "swapped", which keeps the norm calls and recomputes them in backward: what that
trade costs and saves, side by side.

- loss and gradient norm of the first step (the same weights and tokens in every variant): every
  variant is judged against its baseline's; a swapped variant whose loss or gradient norm differs
  by more than LOSS_BOUND / GRAD_BOUND (relative), or that raises, fails the run (exit 1) whatever
  its speed: a wrong kernel does not look fast. A Liger variant that is wrong or raises is a
  figure (WRONG, or its error), not our failure; one not installed is "skipped".
- --profile PATH: one more step of each --profile-variants variant (default swapped, liger) under
  torch.profiler, written compactly to PATH (benchmarks/_profile.py): top kernels by device time,
  top ops by host time, the kernel libraries' own ops; a short top-N goes to the log.

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


def child(variants: list[str], device: str, warmup: int, steps: int, shape_name: str, profile: set[str]) -> None:
    """Each variant in turn, in this process: one JSON line on stdout per variant as it finishes
    ({"tokens_per_s", "step_s", "peak_growth_mib", "loss", ...} or {"error"} / {"skipped"})."""
    import gc

    import torch

    liger = False
    for variant in variants:
        if "liger" in variant and not liger:  # Liger's patch is for the whole process: its variants come last
            try:
                from liger_kernel.transformers import apply_liger_kernel_to_llama
            except ImportError as e:
                result = dict(variant=variant, skipped=f"liger-kernel is not installed ({e})")
                print(json.dumps(result), flush=True)
                continue
            apply_liger_kernel_to_llama()
            liger = True
        elif "liger" not in variant and liger:
            raise SystemExit(f"variant {variant!r} after a Liger variant: the Liger patch is process-wide")
        try:
            result = one_variant(variant, device, warmup, steps, shape_name, variant in profile)
        except Exception as e:  # noqa: BLE001 - a variant that raises is a row, not a dead run
            result = dict(variant=variant, error=_children.first_line(e))
        print(json.dumps(result), flush=True)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if "compile" in variant:
            torch._dynamo.reset()


def one_variant(variant: str, device: str, warmup: int, steps: int, shape_name: str, profile: bool) -> dict:
    """One variant: {"tokens_per_s", "step_s", "peak_growth_mib", "loss", "grad_norm", ...}."""
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
        from accel_kernels.ops import rms_norm

        rms_norm.RECOMPUTE_OUTPUTS = "+kept" not in variant  # set for each variant: one process runs several
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
    result = dict(variant=variant, step_s=step_s, tokens_per_s=shape["batch"] * shape["seq"] / step_s,
                  peak_growth_mib=growth, steps=steps, swap=report, **first)
    if report is not None:  # what the swapped ops decided per call over every step (the norms' recomputes)
        result["calls"] = {op: dict(o) for op, o in accel_patch.report(model).calls.items()}
    if profile:
        import _profile

        try:
            result["profile"] = _profile.profile_step(step, device)
        except Exception as e:  # noqa: BLE001 - a profiler that fails costs the profile, not the figures
            result["profile"] = dict(error=_children.first_line(e))
    del model, batch
    return result




def run_variants(variants: list[str], device: str, warmup: int, steps: int, shape_name: str, profile: set[str]):
    """Yield each variant's result as its process reports it: one process for all of them on GPU
    (a fresh one after a process that died, which loses the variant it was in), one each on CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_KERNELS")}
    env["ACCEL_PATCH_KERNELS"] = "0"  # the variant swaps (or not) by itself; CPU: the plain-torch paths
    # stock first (nothing of ours or Liger's yet in the process), Liger's last (its patch is process-wide)
    ordered = sorted(variants, key=lambda v: 2 if v.startswith("liger") else 1 if v.startswith("swapped") else 0)

    def command(group: list[str]) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), "--child", ",".join(group), "--device", device,
                "--warmup", str(warmup), "--steps", str(steps), "--shape", shape_name, "--backend", COMPILE_BACKEND,
                "--profile-variants", ",".join(sorted(profile))]

    return _children.run_each(ordered, command, env, together=device == "cuda", dry=shape_name == "dry")


def run_of(variant: str) -> tuple[str, str]:
    """(the run a variant belongs to, that run's baseline variant)."""
    if "+compile" in variant:
        return "compiled", "stock+compile"
    if "+lora" in variant:
        return "LoRA r=16", "stock+lora"
    return "full", "stock"


def compare(stock: dict, swapped: dict, targets: dict, dtype: str) -> dict:
    """Ratios and verdicts of a swapped variant against stock; "correct": its first-step loss and
    gradient norm agree with stock's (LOSS_BOUND, GRAD_BOUND)."""
    if any(k in r for r in (stock, swapped) for k in ("error", "skipped")):
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
    p.add_argument("--variants", help="comma-separated variants (default: full and, on GPU, LoRA: stock, swapped, "
                   "swapped+tiled; with --compile: stock, swapped and their +compile); any of stock, swapped, "
                   "swapped+tiled, liger, each also +lora or +compile")
    p.add_argument("--profile", metavar="PATH", help="profile one step of --profile-variants into PATH (JSON)")
    p.add_argument("--profile-variants", default="swapped,liger", help="the variants --profile profiles")
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
    profile = {v for v in args.profile_variants.split(",") if v} if (args.profile or args.child) else set()
    if args.child:
        child(args.child.split(","), device, warmup, steps, shape_name, profile)
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
    if args.variants:
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    elif args.compile:
        variants = ["stock", "swapped", "stock+compile", "swapped+compile"]
    else:
        variants = ["stock", "swapped", "swapped+tiled"]
        if device == "cuda" or args.dry_run:
            variants += ["stock+lora", "swapped+lora", "swapped+tiled+lora"]
    bad = [v for v in variants if v.split("+")[0] not in ("stock", "swapped", "liger")
           or not set(v.split("+")[1:]) <= {"tiled", "lora", "compile", "kept"}
           or ("kept" in v.split("+") and not v.startswith("swapped"))]
    if bad:
        p.error(f"unknown variant(s) {bad}: stock, swapped, swapped+tiled, swapped+kept or liger, "
                "each also +lora or +compile")
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
    rows: dict[str, dict] = {}
    profiles = {}
    for r in run_variants(variants, device, warmup, steps, shape_name, profile):
        v = r["variant"]
        label, baseline = run_of(v)
        if label not in rows:
            rows[label] = dict(run=label)
            results["rows"].append(rows[label])
        row = rows[label]
        row[v] = r
        ours = v.startswith("swapped")
        if "profile" in r:
            profiles[v] = r.pop("profile")
        if "skipped" in r:
            print(f"{label:<11}{v:<20}skipped: {r['skipped']}", flush=True)
        elif "error" in r:
            ok = ok and v.startswith("liger")  # Liger's error is a figure; ours or stock's fails the run
            print(f"{label:<11}{v:<20}FAILED: {r['error']}", flush=True)
        else:
            print(f"{label:<11}{v:<20}{r['tokens_per_s']:>11.0f}{r['step_s']:>9.3f}{r['peak_growth_mib']:>17.0f}"
                  f"{r['loss']:>10.4f}{r['grad_norm']:>11.4g}", flush=True)
        if v != baseline and baseline in row:  # every variant judged against its run's stock
            verdict = compare(row[baseline], r, targets, shape["dtype"])
            row.setdefault("against_stock", {})[v] = verdict
            if verdict:
                if ours:
                    ok = ok and verdict["correct"]
                print(f"{'':<11}{v}/{baseline}: tokens/s {verdict['speed_ratio']:.2f}x (target >= {targets['speed']:.2f}x: "
                      f"{verdict['speed_verdict']}), peak growth {verdict['memory_ratio']:.2f}x "
                      f"(target <= {targets['memory']:.2f}x: {verdict['memory_verdict']}); loss "
                      f"{verdict['loss_rel_diff']:.1e}, grad norm {verdict['grad_norm_rel_diff']:.1e} from {baseline} "
                      f"({'OK' if verdict['correct'] else 'WRONG'}: bounds {LOSS_BOUND[shape['dtype']]:g}, "
                      f"{GRAD_BOUND[shape['dtype']]:g})", flush=True)
        if r.get("swap"):
            print(f"{'':<11}{r['swap']}")
        if v.startswith("liger") and v.replace("liger", "swapped") in row:  # ours ran first (Liger's come last)
            mine = v.replace("liger", "swapped")
            verdict = compare(r, row[mine], targets, shape["dtype"])
            row.setdefault("against_liger", {})[mine] = verdict
            if verdict:
                print(f"{'':<11}{mine}/{v}: tokens/s {verdict['speed_ratio']:.2f}x, peak growth "
                      f"{verdict['memory_ratio']:.2f}x", flush=True)
        save()  # after every variant: a run cut short keeps what finished
    if args.profile:
        import _profile

        with open(args.profile, "w") as f:
            json.dump(dict(date=results["date"], machine=machine, shape=shape, profiles=profiles), f, indent=1)
        for v, prof in profiles.items():
            if "error" in prof:
                print(f"profile {v}: FAILED: {prof['error']}")
            else:
                print("\n".join(_profile.top_lines(v, prof)))
    eager, compiled = rows.get("full", {}), rows.get("compiled", {})
    for who, e_name, c_name in (("stock", "stock", "stock+compile"), ("swapped", "swapped", "swapped+compile")):
        e, c = eager.get(e_name), compiled.get(c_name)
        if e and c and not any(k in x for x in (e, c) for k in ("error", "skipped")):
            print(f"compiled/eager {who}: tokens/s {c['tokens_per_s'] / e['tokens_per_s']:.2f}x, "
                  f"peak growth {c['peak_growth_mib'] / e['peak_growth_mib']:.2f}x")
    results["correct"] = ok
    save()
    if not ok:
        print("FAILED: a variant did not run, or a swapped variant's loss or gradient norm is not stock's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
