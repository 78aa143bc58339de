"""One training step of a Qwen3-MoE-like model, full fine-tune and PEFT LoRA r=16 on the experts
(all-linear): transformers' experts implementations (eager, grouped_mm, batched_mm) against the
experts site (accel-patch's moe_experts op, `swap_kernels(ops="experts")`).

    python benchmarks/moe.py                   # CPU: hidden 512, moe intermediate 384, 32 experts, top-8, 2 layers, 4096 tokens, fp32
    python benchmarks/moe.py --device cuda     # GPU: Qwen3-30B-A3B layers (hidden 2048, moe inter 768, 128 experts, top-8), 4 layers, bf16, 8192 tokens
    python benchmarks/moe.py --dry-run         # the same code at tiny shapes on CPU, in seconds
    python benchmarks/moe.py --json moe.json   # the figures as JSON, rewritten after each variant
    python benchmarks/moe.py --modes lora      # only LoRA on the experts (or: full)
    python benchmarks/moe.py --variants grouped_mm,ours   # some of eager, grouped_mm, batched_mm, ours, ours-triton-bwd, ours-grouped-bwd, accel_patch
    python benchmarks/moe.py --layers 1 --moe-intermediate 256   # another depth or expert width
    python benchmarks/moe.py --block           # one sparse MoE block alone (router and experts), no model around it
    python benchmarks/moe.py --rounds 3        # each variant's process three times, taking turns (CPU times)

Each variant runs in a fresh process (forked in a dry run: benchmarks/_children.py; random weights from a config, nothing downloaded, without
TRITON_INTERPRET): peak memory growth of its first step (GPU: max_memory_allocated minus what was
allocated before; CPU: the rise of the process's peak RSS, with glibc's mmap threshold fixed), then
the median time of --steps more (on the CPU in a second process with glibc's default allocator:
`run_child` says why).
With --rounds N every variant's process runs N times, the variants taking turns (A, B, A, B: a
CPU's speed drifts by tens of percent over minutes, which variants run one after the other would
carry into their ratio); the time is the median of the rounds' medians, the memory the first
round's (the same in every round).
"ours" swaps only the experts site, on the grouped_mm model, so the ratios are the experts' alone
("ours-triton-bwd", "ours-grouped-bwd": the same with the op's all-Triton backward or its grouped_mm
one, ACCEL_PATCH_EXPERTS_BACKWARD=triton or grouped_mm, where "ours" runs auto's);
"accel_patch" swaps every op on it (`swap_kernels(model)`, what `import accel_patch` does at load:
the fused linear cross-entropy head, RMSNorm, RoPE and the LoRA sites beside the experts), the step a
user gets.

- saved/layer: bytes autograd keeps for backward during the forward of layer 0's experts module
  (saved_tensors_hooks; parameters excluded, one storage once), beside the minimum any backward
  of the layer needs (hidden [T, H] and the router's top-k index and weights).
- batched_mm gathers each routed row's expert weights ([T*K, 2I, H]): a variant whose estimated
  gather passes --batched-limit GiB is not run, and says so.
- Targets: CPU, LoRA on experts: ours / PEFT on grouped_mm (transformers' default) peak growth <=
  0.6x, time <= 1.1x; full fine-tune: ours / grouped_mm peak growth <= 0.8x, time <= 1.1x. GPU
  (both modes): tokens/s >= 1.5x of grouped_mm's, peak growth <= 0.65x. Times on a loaded machine
  are noise; memory is not.
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
    "cpu": dict(config=dict(vocab_size=8000, hidden_size=512, moe_intermediate_size=384, intermediate_size=1024,
                            num_experts=32, num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
                batch=1, seq=4096, dtype="float32"),
    # Qwen3-30B-A3B's layers: hidden 2048, moe intermediate 768, 128 experts, top-8, 32 q / 4 kv heads of 128
    "cuda": dict(config=dict(vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                             num_experts=128, num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32,
                             num_key_value_heads=4, head_dim=128, max_position_embeddings=8192),
                 batch=2, seq=4096, dtype="bfloat16"),
    "dry": dict(config=dict(vocab_size=256, hidden_size=64, moe_intermediate_size=32, intermediate_size=128,
                            num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=128),
                batch=1, seq=64, dtype="float32"),
}
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
SWAPPED = {"ours": "experts", "ours-triton-bwd": "experts", "ours-grouped-bwd": "experts",
           "accel_patch": None}  # variant: the ops it swaps (None: every op)
#: A variant's own environment: "ours-triton-bwd" and "ours-grouped-bwd" are "ours" with the op's
#: all-Triton backward or its grouped_mm one forced (ACCEL_PATCH_EXPERTS_BACKWARD), so one run times
#: each backward; the other variants run with that switch unset (auto: on an sm_90+ GPU in bf16,
#: Triton where the call takes the large tiles, grouped_mm's GEMMs where it takes the small ones;
#: docs/moe.md).
VARIANT_ENV = {"ours-triton-bwd": {"ACCEL_PATCH_EXPERTS_BACKWARD": "triton"},
               "ours-grouped-bwd": {"ACCEL_PATCH_EXPERTS_BACKWARD": "grouped_mm"}}
VARIANTS = IMPLEMENTATIONS + tuple(SWAPPED)
MODES = ("full", "lora")
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")
TARGETS = {"cpu": {"full": dict(memory=0.8, time=1.1), "lora": dict(memory=0.6, time=1.1)},
           "cuda": {"full": dict(memory=0.65, time=1 / 1.5), "lora": dict(memory=0.65, time=1 / 1.5)}}
TARGETS["dry"] = TARGETS["cpu"]
#: Under non-reentrant gradient checkpointing (TRL's default), where the op saves gate/up.
CHECKPOINTED_TARGETS = {"cpu": {"full": dict(memory=0.5, time=1.05), "lora": dict(memory=0.3, time=1.05)},
                        "cuda": {"full": dict(memory=0.65, time=1 / 1.5), "lora": dict(memory=0.65, time=1 / 1.5)}}
CHECKPOINTED_TARGETS["dry"] = CHECKPOINTED_TARGETS["cpu"]


class Block:
    """One Qwen3-MoE sparse block as a model: its call returns an object with a scalar `loss`
    (the mean square of the block's output, in fp32)."""

    def __new__(cls, config):
        import torch
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        class _Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.mlp = Qwen3MoeSparseMoeBlock(config)
                for p in self.mlp.parameters():
                    torch.nn.init.normal_(p, std=0.02)

            def forward(self, hidden_states):
                out = self.mlp(hidden_states)
                out = out[0] if isinstance(out, tuple) else out
                return type("Out", (), {"loss": out.float().pow(2).mean()})()

        return _Block()


def prepared(variant: str, mode: str, shape_name: str, device: str, checkpointing: bool = False,
             block: bool = False):
    """(model, batch, swap report or None) of one variant."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import accel_patch

    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**shape["config"], attn_implementation="sdpa")
    config._experts_implementation = "grouped_mm" if variant in SWAPPED else variant
    dtype = getattr(torch, shape["dtype"])
    with torch.device(device):
        model = (Block(config) if block else Qwen3MoeForCausalLM(config)).to(dtype)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        # the block has no nn.Linear (its router is a parameter): LoRA on the experts' parameters alone
        lora = dict(LORA, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"]) \
            if block else LORA
        model = get_peft_model(model, LoraConfig(**lora))
    if checkpointing:  # TRL's default: non-reentrant, every decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    report = accel_patch.swap_kernels(model, SWAPPED[variant]) if variant in SWAPPED else None
    model.train()
    gen = torch.Generator().manual_seed(0)
    if block:
        hidden = torch.randn(shape["batch"], shape["seq"], shape["config"]["hidden_size"], generator=gen)
        return model, {"hidden_states": hidden.to(device=device, dtype=dtype).requires_grad_()}, report
    ids = torch.randint(0, shape["config"]["vocab_size"], (shape["batch"], shape["seq"]), generator=gen).to(device)
    return model, {"input_ids": ids, "labels": ids}, report


def step(model, batch) -> None:
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)


def saved_bytes(model, batch) -> int:
    import torch

    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen = [], {}

    def pack(t):
        if inside:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
        return t

    def enter(module, args):
        inside.append(1)

    def leave(module, args, out):
        inside.pop()

    hooks = [experts.register_forward_pre_hook(enter), experts.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, batch)
    for h in hooks:
        h.remove()
    return sum(seen.values())


def batched_gather_gib(shape_name: str) -> float:
    shape = SHAPES[shape_name]
    c = shape["config"]
    rows = shape["batch"] * shape["seq"] * c["num_experts_per_tok"]
    element = 2 if shape["dtype"] == "bfloat16" else 4
    return rows * 2 * c["moe_intermediate_size"] * c["hidden_size"] * element / 2**30


def child(variant: str, mode: str, shape_name: str, device: str, steps: int, checkpointing: bool = False,
          block: bool = False, measure: str = "both") -> dict:
    """One variant's figures: "memory" (the first step's peak growth and the saved bytes), "time"
    (the median of `steps` steps after a first one), or "both"."""
    import torch

    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    model, batch, report = prepared(variant, mode, shape_name, device, checkpointing, block)
    figures = dict(variant=variant, mode=mode, calls=(report.calls if report is not None else None))
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, batch)
        torch.cuda.synchronize()
        growth = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        step(model, batch)  # the first step sets the high-water mark: its rise is the step's peak growth
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    if measure in ("time", "both"):
        times = _timed(model, batch, device, steps)
        figures.update(step_s=statistics.median(times),
                       tokens_per_s=batch_tokens(shape_name) / statistics.median(times))
    if measure in ("memory", "both"):
        shape = SHAPES[shape_name]
        c = shape["config"]
        element = torch.finfo(getattr(torch, shape["dtype"])).bits // 8
        minimum = batch_tokens(shape_name) * (c["hidden_size"] * element + c["num_experts_per_tok"] * (8 + element))
        figures.update(peak_growth_mib=growth, saved_layer_mib=saved_bytes(model, batch) / 2**20,
                       minimum_layer_mib=minimum / 2**20)
    return figures


def batch_tokens(shape_name: str) -> int:
    return SHAPES[shape_name]["batch"] * SHAPES[shape_name]["seq"]


def _timed(model, batch, device: str, steps: int) -> list[float]:
    import torch

    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, batch)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def run_child(variant, mode, shape_name, device, steps, checkpointing=False, resized=(), measure="both") -> dict:
    """One child process's figures (see `child`). A CPU memory child fixes glibc's mmap threshold
    at 128 KiB, so freed tensors leave the process and resident memory follows live tensors (as
    max_memory_allocated does on a GPU); a CPU time child keeps glibc's default, since that setting
    makes every large allocation a fresh mapping and its page faults: a step took 6.5 s with it and
    4.4 s without (Qwen3-MoE, two checkpointed layers, 2026-12-04), a cost a caching allocator
    never pays."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_KERNELS", "ACCEL_PATCH_EXPERTS_BACKWARD")}
    env["ACCEL_PATCH_KERNELS"] = "0"  # no swap at load: the variant decides
    env.update(VARIANT_ENV.get(variant, {}))
    if device == "cpu" and measure != "time":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--mode", mode, "--shape", shape_name,
           "--device", device, "--steps", str(steps), "--measure", measure] + \
        (["--checkpointing"] if checkpointing else []) + list(resized)
    proc = _children.run(cmd, env, dry=shape_name == "dry")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(variant=variant, mode=mode, error=f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, in seconds")
    p.add_argument("--modes", default="full,lora", help="full, lora or both (default)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after the measured one (default: 2 on CPU, 10 on GPU)")
    p.add_argument("--rounds", type=int, default=1, help="processes per variant, the variants taking turns (default 1)")
    p.add_argument("--variants", default=",".join(v for v in VARIANTS if v not in VARIANT_ENV),
                   help=f"among {', '.join(VARIANTS)} (default: all but {', '.join(VARIANT_ENV)})")
    p.add_argument("--batched-limit", type=float, default=8.0, help="GiB of batched_mm's weight gather above which it is not run")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON after each variant")
    p.add_argument("--checkpointing", action="store_true",
                   help="non-reentrant gradient checkpointing on every layer (TRL's default)")
    p.add_argument("--block", action="store_true", help="one sparse MoE block alone: no attention, embedding or head")
    p.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    p.add_argument("--moe-intermediate", type=int, help="each expert's intermediate size (default: the shape's)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--measure", default="both", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape_name = args.shape or ("dry" if args.dry_run else device)
    resized = []  # the overrides, passed on to each child
    for flag, key, value in (("--layers", "num_hidden_layers", args.layers),
                             ("--moe-intermediate", "moe_intermediate_size", args.moe_intermediate)):
        if value is not None:
            if value < 1:
                p.error(f"{flag} must be >= 1, got {value}")
            SHAPES[shape_name]["config"][key] = value
            resized += [flag, str(value)]
    if args.block:
        if args.checkpointing:
            p.error("--block measures one block without a decoder layer around it: --checkpointing has no layer to wrap")
        resized.append("--block")
    steps = args.steps if args.steps is not None else (10 if device == "cuda" else 1 if args.dry_run else 2)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if steps < 1 or not modes or any(m not in MODES for m in modes) or not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--steps must be >= 1, --modes among {', '.join(MODES)} and --variants among {', '.join(VARIANTS)}, "
                f"got {steps}, {args.modes!r} and {args.variants!r}")
    if args.child:
        print(json.dumps(child(args.child, args.mode, shape_name, device, steps, args.checkpointing, args.block,
                               args.measure)))
        return 0

    import peft
    import transformers

    shape = SHAPES[shape_name]
    c = shape["config"]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.1f}")
    print(f"accel-patch MoE step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    model = ("one sparse block (router and experts; loss: the mean square of its output)" if args.block
             else f"{c['num_hidden_layers']} layers, vocab {c['vocab_size']}")
    print(f"Qwen3-MoE: hidden {c['hidden_size']}, moe intermediate {c['moe_intermediate_size']}, {c['num_experts']} "
          f"experts, top-{c['num_experts_per_tok']}, {model}, {shape['batch']} x {shape['seq']} tokens, "
          f"{shape['dtype']}; LoRA r=16 " + ("on the experts" if args.block else "all-linear") +
          f"; median of {steps} steps" + (f", median of {args.rounds} rounds taking turns" if args.rounds > 1 else "")
          + ("; non-reentrant gradient checkpointing" if args.checkpointing else ""))
    rows, verdicts = [], {}

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, device=device,
                               shape=shape, torch=torch.__version__, rows=rows, verdicts=verdicts), f, indent=1)

    gather = batched_gather_gib(shape_name)
    for mode in modes:
        first = len(rows)
        for turn in range(args.rounds):
            for i, variant in enumerate(variants):
                if variant == "batched_mm" and gather > args.batched_limit:
                    if turn == 0:
                        rows.append(dict(variant=variant, mode=mode, skipped=f"its weight gather would take {gather:.0f} "
                                                                          f"GiB (> --batched-limit {args.batched_limit:g})"))
                    continue
                if turn == 0 and device == "cpu":  # memory in a child of its own (see run_child)
                    memory = run_child(variant, mode, shape_name, device, steps, args.checkpointing, resized, "memory")
                row = run_child(variant, mode, shape_name, device, steps, args.checkpointing, resized,
                                "time" if device == "cpu" else "both")
                if turn == 0 and device == "cpu":
                    row = memory if "error" in memory else row if "error" in row else dict(memory, **row)
                if turn == 0:
                    row["rounds_step_s"] = [row["step_s"]] if "step_s" in row else []
                    rows.append(row)
                else:
                    kept = rows[first + i]
                    if "error" in row and "error" not in kept:
                        rows[first + i] = row
                    elif "step_s" in row and "step_s" in kept:
                        kept["rounds_step_s"].append(row["step_s"])
                        kept["step_s"] = statistics.median(kept["rounds_step_s"])
                        kept["tokens_per_s"] = batch_tokens(shape_name) / kept["step_s"]
                dump()
    print(f"\n{'mode':<6}{'variant':<12}{'tokens/s':>10}{'step s':>9}{'peak growth MiB':>17}{'saved/layer MiB':>17}"
          f"{'minimum MiB':>13}")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['mode']:<6}{r['variant']:<12}{'FAILED: ' + r['error'] if 'error' in r else 'not run: ' + r['skipped']}")
        else:
            print(f"{r['mode']:<6}{r['variant']:<12}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.2f}"
                  f"{r['peak_growth_mib']:>17.0f}{r['saved_layer_mib']:>17.1f}{r['minimum_layer_mib']:>13.1f}")
    for mode in modes:
        by = {r["variant"]: r for r in rows if r["mode"] == mode and "error" not in r and "skipped" not in r}
        for swapped in [v for v in SWAPPED if v in by]:
            for against in [v for v in IMPLEMENTATIONS if v in by]:
                # a stock growth of 0 (the page resolution of a tiny shape) gives no ratio: not a PASS
                stock_growth = by[against]["peak_growth_mib"]
                memory = by[swapped]["peak_growth_mib"] / stock_growth if stock_growth > 0 else None
                t = by[swapped]["step_s"] / by[against]["step_s"]
                said = f"{memory:.2f}x" if memory is not None else f"not measurable ({against} grew 0 MiB)"
                line = f"{mode}: {swapped} / {against}: peak growth {said}, time {t:.2f}x, tokens/s {1 / t:.2f}x"
                if against == "grouped_mm":
                    target = (CHECKPOINTED_TARGETS if args.checkpointing else TARGETS)[shape_name][mode]
                    memory_verdict = "UNMEASURED" if memory is None else "PASS" if memory <= target["memory"] else "MISS"
                    verdict = dict(memory_ratio=memory, time_ratio=t, memory_verdict=memory_verdict,
                                   time_verdict="PASS" if t <= target["time"] else "MISS")
                    if swapped not in VARIANT_ENV:  # a comparison variant: its line says, the exit code does not
                        verdicts[mode if swapped == "ours" else f"{mode}, {swapped}"] = verdict
                    line += (f"  (targets: <= {target['memory']:.2f}x {verdict['memory_verdict']}, time <= "
                             f"{target['time']:.2f}x {verdict['time_verdict']})")
                print(line)
            print(f"{mode}: {swapped}'s calls: {by[swapped]['calls']}")
    dump()
    failed = any("error" in r for r in rows)
    if args.dry_run:
        return 1 if failed else 0
    return 0 if verdicts and not failed and all(v["memory_verdict"] == v["time_verdict"] == "PASS"
                                                for v in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
