"""One LoRA r=16 training step (q, k, v, o, gate, up, down adapted): stock PEFT, swapped today (the
kernel ops and the fused loss, without the LoRA ops: the same step without fused LoRA), swapped
with fused LoRA (on a GPU each LoRA call shape timed against PEFT's forward, the faster run: the
default), fused LoRA untimed (every reproducible call fused: ACCEL_PATCH_LORA_PATH=fused), fused
LoRA with the tiled MLP (its own column: "fused LoRA" never includes it),
and Liger Kernel + PEFT ("liger": `apply_liger_kernel_to_llama()` before the model is built).

    python benchmarks/lora.py                  # CPU: hidden 1024, inter 2816, 4 layers, vocab 32000, 2048 tokens, fp32
    python benchmarks/lora.py --quick          # CPU, smaller: hidden 512, 2 layers, vocab 8000, 512 tokens
    python benchmarks/lora.py --qlora          # the same with a bitsandbytes 4-bit (nf4) base
    python benchmarks/lora.py --device cuda    # GPU: Llama-3.2-1B shape, bf16 (add --qlora where bitsandbytes is)
    python benchmarks/lora.py --device cuda --small  # the same model at 1 x 512 tokens: where the host's
                                               # work per call (fused LoRA's plan, masks, one Function)
                                               # is not hidden behind the device's
    python benchmarks/lora.py --json lora.json # also every figure as JSON
    python benchmarks/lora.py --autocast bf16  # the step under bf16 (or fp16) autocast, as Trainer(bf16=True) runs it
    python benchmarks/lora.py --dropout 0.1    # LoRA dropout 0.1 (combinable with --autocast and --compile)
    python benchmarks/lora.py --compile inductor   # every variant torch.compile'd (inductor, or aot_eager)
    python benchmarks/lora.py --dry-run        # the same code at a tiny shape on CPU, in seconds
    python benchmarks/lora.py --variants "stock,liger,swapped today,fused LoRA"   # some of VARIANTS

Each variant's memory is measured in a fresh process on CPU (forked in a dry run, benchmarks/_children.py; random weights from a config, nothing downloaded; a 4-bit
base is saved once to a temporary directory and loaded quantized), without TRITON_INTERPRET. On GPU
the variants run in turn in one process (max_memory_allocated over what was allocated before the
step is the step's alone; a fresh interpreter costs ~10 s), Liger's last (its patch is
process-wide), each timed there after its memory step; a variant that raises is a row with the
first line of its error, and a process that dies loses only the variant it was in.

- tokens/s: tokens of the batch / median step time (forward + backward; the optimizer is the same
  for all and left out); on CPU the variants (not Liger's) timed round-robin in one process (the
  machine's load then changes for all alike), memory measured in a fresh process per variant.
- peak memory growth: on GPU, max_memory_allocated() during a step minus what was allocated
  before it; on CPU, the rise of the process's peak RSS over the first step.
- saved bytes per layer: what autograd keeps for backward during the forward of one decoder
  layer and of its MLP (torch.autograd.graph.saved_tensors_hooks; parameters and their 4-bit
  packs excluded, each storage counted once), beside the MLP's theoretical minimum: x plus the
  gate and up pre-activations.
- loss: the first step's loss of each variant (the same weights, adapters and tokens); a swapped
  variant more than LOSS_BOUND (relative) from stock fails the run (exit 1): a wrong kernel does
  not look fast. With dropout the masks differ between stock and fused (each draws its own), so
  the bound is then a sanity bound, not a match.
- --json PATH is written again after every variant, so a run cut short keeps what finished.
- ratios: fused LoRA / swapped today (and / stock) for memory, tokens/s ratio for speed; the CPU
  targets (peak growth <= 0.85x of swapped today, time <= 1.0x; compiled: peak growth <= 0.8x)
  print PASS or MISS beside them (a MISS is a figure, not a failure); the tiled MLP's variant
  against fused LoRA.
- --compile: each variant's model is `torch.compile`d (not fullgraph) with the backend named; the
  warm-up steps pay for the compilation. The CPU peak is then the rise of the resident set's
  high-water mark (VmHWM, reset through /proc/self/clear_refs after the warm-up) over a later
  step, with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_) so that freed
  tensors leave the resident set (else the warm-up's freed heap hides the step's peak: 128 MiB
  instead of 628 MiB for "swapped today" at the CPU shape, aot_eager); the saved-bytes columns are
  left out (module hooks would recompile the model).
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
import tempfile
import time

import _children  # benchmarks/: one process per variant, forked in a dry run

SHAPES = {
    "cpu": dict(config=dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048),
                batch=1, seq=2048, dtype="float32"),
    "quick": dict(config=dict(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=2,
                              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512),
                  batch=1, seq=512, dtype="float32"),
    "dry": dict(config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                batch=1, seq=64, dtype="float32"),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, vocab 128256, tied.
    "cuda": dict(config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0),
                 batch=4, seq=2048, dtype="bfloat16"),
}
# The same model at a batch adapter users train with on one GPU, where a call's device work is short
# enough that the host's may show: fused LoRA against PEFT's layers there decides whether a per-call
# fall-back at few tokens would pay (docs/lora.md, "The per-call rule").
SHAPES["cuda-small"] = dict(SHAPES["cuda"], batch=1, seq=512)
VARIANTS = ("stock", "liger", "swapped today", "fused LoRA", "fused LoRA untimed", "fused LoRA + tiled MLP")
DEFAULT_VARIANTS = ("stock", "swapped today", "fused LoRA", "fused LoRA + tiled MLP")
TODAY_OPS = "rms_norm,rope,glu,fused_linear_cross_entropy"
#: The ops each swapped variant names (the tiled MLP only in its own variant).
VARIANT_OPS = {"swapped today": TODAY_OPS,
               "fused LoRA": "rms_norm,rope,glu,fused_linear_cross_entropy,lora_mlp,lora_qkv,lora_o",
               "fused LoRA untimed": "rms_norm,rope,glu,fused_linear_cross_entropy,lora_mlp,lora_qkv,lora_o",
               "fused LoRA + tiled MLP": "rms_norm,rope,glu,fused_linear_cross_entropy,lora_mlp,lora_qkv,lora_o,tiled_mlp"}
#: Largest relative difference of a swapped variant's first-step loss from stock's, by the step's
#: compute dtype (dropout: a sanity bound, see the docstring).
LOSS_BOUND = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4, "dropout": 0.2}
# fused LoRA against swapped today on CPU; against stock PEFT on GPU (the targets)
TARGETS = {"cpu": dict(memory=0.85, time=1.0, against="swapped today"),
           "cuda": dict(memory=0.6, time=1 / 1.5, against="stock")}
COMPILED_TARGET = 0.8  # CPU: compiled fused LoRA's peak growth against compiled swapped today
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}


class Run:
    """How every variant steps: autocast dtype name or None, LoRA dropout, compile backend or None."""

    def __init__(self, autocast=None, dropout=0.0, compile=None) -> None:
        self.autocast, self.dropout, self.compile = autocast, dropout, compile

    def args(self) -> list[str]:
        return ((["--autocast", self.autocast] if self.autocast else []) + ["--dropout", repr(self.dropout)]
                + (["--compile", self.compile] if self.compile else []))

    def describe(self) -> str:
        parts = [f"{self.autocast} autocast" if self.autocast else "no autocast", f"LoRA dropout {self.dropout:g}",
                 f"torch.compile ({self.compile})" if self.compile else "eager"]
        return ", ".join(parts)


def build(shape_name: str, device: str, qlora: bool, checkpoint: str | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = SHAPES[shape_name]
    dtype = getattr(torch, shape["dtype"])
    if qlora:
        from transformers import BitsAndBytesConfig

        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
        return LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant, dtype=dtype,
                                                device_map={"": device}, attn_implementation="sdpa")
    torch.manual_seed(0)
    config = LlamaConfig(**shape["config"], attn_implementation="sdpa")
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def saved_bytes(model, batch, run: Run) -> dict:
    """Bytes autograd saves in the forward of decoder layer 0 and of its MLP (one storage once)."""
    import torch

    layer = model.get_base_model().model.layers[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where = []
    seen: dict[str, dict[int, int]] = {"layer": {}, "mlp": {}}

    def pack(t):
        if where:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                for tag in where:
                    seen[tag][ptr] = t.untyped_storage().nbytes()
        return t

    hooks = []
    for tag, module in (("layer", layer), ("mlp", layer.mlp)):
        hooks.append(module.register_forward_pre_hook(lambda m, a, tag=tag: where.append(tag)))
        hooks.append(module.register_forward_hook(lambda m, a, o, tag=tag: where.remove(tag)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(model, batch, run)
    for h in hooks:
        h.remove()
    return {tag: sum(d.values()) for tag, d in seen.items()}


def prepared(variant: str, shape_name: str, device: str, qlora: bool, checkpoint: str | None, run: Run):
    """(model to step, batch, swap report or None) of one variant."""
    import torch
    from peft import LoraConfig, get_peft_model

    import accel_patch

    shape = SHAPES[shape_name]
    model = build(shape_name, device, qlora, checkpoint)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(**{**LORA, "lora_dropout": run.dropout}))
    report = None
    if variant in VARIANT_OPS:
        # "fused LoRA" times each LoRA call shape against PEFT's forward on a GPU and runs the faster;
        # "fused LoRA untimed" runs every reproducible call fused (the switch is read as the sites are made)
        from unittest import mock

        from accel_patch.swaps.lora.timing import PATH_SWITCH

        untimed = {PATH_SWITCH: "fused"} if variant == "fused LoRA untimed" else {}
        with mock.patch.dict(os.environ, untimed):
            report = accel_patch.swap_kernels(model, VARIANT_OPS[variant])
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["config"]["vocab_size"], (shape["batch"], shape["seq"]), generator=gen).to(device)
    if run.compile:
        model = torch.compile(model, backend=run.compile)
    return model, {"input_ids": ids, "labels": ids}, report


def step(model, batch, run: Run) -> float:
    import torch

    device = batch["input_ids"].device.type
    dtype = getattr(torch, AUTOCAST[run.autocast]) if run.autocast else None
    with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return loss.detach()


def _resident_mib(field: str) -> float | None:
    """VmRSS or VmHWM of this process in MiB (Linux), None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_resident_peak() -> bool:
    """Reset this process's VmHWM to its current resident set (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def group_child(variants: list[str], shape_name: str, device: str, qlora: bool, checkpoint: str | None,
                warmup: int, steps: int, run: Run) -> None:
    """memory_child of each variant in turn, in this process (Liger's last: its patch is process-wide);
    one JSON line each on stdout as it finishes."""
    import gc

    import torch

    liger = False
    for variant in variants:
        if variant == "liger" and not liger:
            try:
                from liger_kernel.transformers import apply_liger_kernel_to_llama
            except ImportError as e:
                print(json.dumps(dict(variant=variant, skipped=f"liger-kernel is not installed ({e})")), flush=True)
                continue
            apply_liger_kernel_to_llama()
            liger = True
        elif liger:
            raise SystemExit(f"variant {variant!r} after Liger's: the Liger patch is process-wide")
        try:
            result = memory_child(variant, shape_name, device, qlora, checkpoint, warmup, run, steps)
        except Exception as e:  # noqa: BLE001 - a variant that raises is a row, not a dead run
            result = dict(variant=variant, error=_children.first_line(e))
        print(json.dumps(result), flush=True)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if run.compile:
            torch._dynamo.reset()


def memory_child(variant: str, shape_name: str, device: str, qlora: bool, checkpoint: str | None, warmup: int,
                 run: Run, steps: int = 0) -> dict:
    """Peak growth of one step and saved bytes per layer, for one variant; on GPU also the median
    time of `steps` steps after it."""
    import torch

    model, batch, report = prepared(variant, shape_name, device, qlora, checkpoint, run)
    first_loss = None
    if device == "cuda":
        for _ in range(warmup):
            loss = step(model, batch, run)
            first_loss = loss.item() if first_loss is None else first_loss
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(model, batch, run)
        torch.cuda.synchronize()
        growth = (torch.cuda.max_memory_allocated() - base) / 2**20
        times = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, batch, run)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        if run.compile:  # compile in the warm-up, then the high-water mark of a later step
            for _ in range(warmup):
                loss = step(model, batch, run)
                first_loss = loss.item() if first_loss is None else first_loss
            if not _reset_resident_peak():
                return dict(variant=variant, error="--compile on CPU needs /proc/self/clear_refs (Linux)")
            base = _resident_mib("VmRSS")
            step(model, batch, run)
            growth = _resident_mib("VmHWM") - base
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            first_loss = step(model, batch, run).item()  # the first step sets the high-water mark: its rise is the step's peak growth
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    saved = saved_bytes(model, batch, run) if not run.compile else {"layer": None, "mlp": None}
    shape = SHAPES[shape_name]
    c = shape["config"]
    tokens = shape["batch"] * shape["seq"]
    element = torch.finfo(getattr(torch, AUTOCAST[run.autocast] if run.autocast else shape["dtype"])).bits // 8
    mib = (lambda b: None if b is None else b / 2**20)
    timed = dict(step_s=statistics.median(times)) if device == "cuda" and times else {}
    del model, batch
    return dict(variant=variant, peak_growth_mib=growth, loss=first_loss, **timed,
                saved_layer_mib=mib(saved["layer"]), saved_mlp_mib=mib(saved["mlp"]),
                mlp_minimum_mib=tokens * (c["hidden_size"] + 2 * c["intermediate_size"]) * element / 2**20,
                calls=(report.calls if report is not None else None),
                swap=(report.summary() if report is not None else None))


def timing_child(variants: list[str], shape_name: str, device: str, qlora: bool, checkpoint: str | None, warmup: int,
                 steps: int, run: Run) -> dict:
    """Median step time of every variant, timed round-robin in one process: on a shared machine a
    change of load then hits all variants alike."""
    import torch

    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    runs = {v: prepared(v, shape_name, device, qlora, checkpoint, run)[:2] for v in variants}
    times = {v: [] for v in variants}
    for i in range(warmup + steps):
        for v, (model, batch) in runs.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(model, batch, run)
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
    return {v: statistics.median(t) for v, t in times.items()}


def child_env(device: str, run: Run) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_KERNELS")}
    env["ACCEL_PATCH_KERNELS"] = "0"  # the 4-bit load: swapped (or not) by the variant, after PEFT
    if run.compile and device == "cpu":  # glibc returns every freed tensor to the OS: VmHWM follows the live bytes
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    return env


def child_command(what: str, variants: list[str], shape_name, device, qlora, checkpoint, warmup, steps,
                  run: Run) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--variants", ",".join(variants),
           "--shape", shape_name, "--device", device, "--warmup", str(warmup), "--steps", str(steps), *run.args()]
    if qlora:
        cmd += ["--qlora", "--checkpoint", checkpoint]
    return cmd


def run_timing(variants, shape_name, device, qlora, checkpoint, warmup, steps, run: Run) -> dict:
    cmd = child_command("timing", variants, shape_name, device, qlora, checkpoint, warmup, steps, run)
    proc = _children.run(cmd, child_env(device, run), dry=shape_name == "dry")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(variant="timing", error=f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")


def save_base(shape_name: str, path: str) -> None:
    import torch

    model = build(shape_name, "cpu", False, None)
    model.to(torch.float32).save_pretrained(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument("--quick", action="store_true", help="the smaller CPU shape")
    p.add_argument("--small", action="store_true", help="on a GPU: the Llama-3.2-1B shape at 1 x 512 tokens")
    p.add_argument("--dry-run", action="store_true", help="the same code at a tiny shape on CPU, one step each")
    p.add_argument("--qlora", action="store_true", help="a bitsandbytes 4-bit (nf4) base")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing (default: 1 on CPU, 3 on GPU)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 2 on CPU, 10 on GPU)")
    p.add_argument("--autocast", choices=sorted(AUTOCAST), help="step under this autocast (as Trainer(bf16=True))")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    p.add_argument("--compile", choices=("inductor", "aot_eager", "eager"), help="torch.compile every variant with this backend (eager: dynamo alone, for --dry-run)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON (after every variant)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, among: {', '.join(VARIANTS)} (default: all but liger)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch

    device = "cpu" if args.dry_run else (args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.small and device != "cuda" and not args.dry_run:
        p.error("--small is a GPU shape (--device cuda); on CPU, --quick")
    gpu_shape = "cuda-small" if args.small else "cuda"
    shape_name = args.shape or ("dry" if args.dry_run else gpu_shape if device == "cuda" else ("quick" if args.quick else "cpu"))
    warmup = args.warmup if args.warmup is not None else (3 if device == "cuda" else 1)
    steps = args.steps if args.steps is not None else (10 if device == "cuda" else (1 if args.dry_run else 2))
    if warmup < 1 or steps < 1:
        p.error(f"--warmup and --steps must be >= 1, got {warmup} and {steps}")
    if not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    run = Run(args.autocast, args.dropout, args.compile)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants) or ("stock" not in variants and not args.child):
        p.error(f"--variants: stock and any of {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.child == "timing":
        print(json.dumps(timing_child(variants, shape_name, device, args.qlora, args.checkpoint, warmup, steps, run)))
        return 0
    if args.child:
        group_child(variants, shape_name, device, args.qlora, args.checkpoint, warmup, steps, run)
        return 0

    import peft
    import transformers

    shape = SHAPES[shape_name]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    c = shape["config"]
    print(f"accel-patch fused LoRA step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
          f"{', DRY RUN (tiny shape, no figures)' if args.dry_run else ''}")
    print(f"Llama: hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, {c['num_hidden_layers']} layers, "
          f"vocab {c['vocab_size']}, {shape['batch']} x {shape['seq']} tokens, {shape['dtype']}"
          f"{' 4-bit nf4 base' if args.qlora else ''}, LoRA r=16 on q,k,v,o,gate,up,down; {run.describe()}; "
          f"{warmup} warm-up, median of {steps} steps", flush=True)
    compute = AUTOCAST[run.autocast] if run.autocast else shape["dtype"]
    bound = LOSS_BOUND["dropout"] if run.dropout else LOSS_BOUND[compute]
    results = dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, device=device,
                   dry_run=args.dry_run, shape=shape, qlora=args.qlora, autocast=run.autocast, dropout=run.dropout,
                   compile=run.compile, torch=torch.__version__, transformers=transformers.__version__,
                   peft=peft.__version__, loss_bound=bound, rows=[])

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    save()
    rows = results["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if args.qlora:
            checkpoint = os.path.join(tmp, "base")
            save_base(shape_name, checkpoint)
        ordered = sorted(variants, key=lambda v: v == "liger")  # Liger's process-wide patch: last
        command = (lambda group: child_command("memory", group, shape_name, device, args.qlora, checkpoint, warmup,
                                               steps, run))
        for r in _children.run_each(ordered, command, child_env(device, run), together=device == "cuda",
                                    dry=shape_name == "dry"):
            rows.append(r)
            v = r["variant"]
            print(f"  {v}: " + (f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skipped']}" if "skipped" in r
                                else f"peak growth {r['peak_growth_mib']:.0f} MiB, loss {r['loss']:.4f}"), flush=True)
            save()  # after every variant: a run cut short keeps what finished
        timed = {}
        if device != "cuda":  # on GPU each variant was timed in its own run above
            timed = run_timing([v for v in variants if v != "liger"], shape_name, device, args.qlora, checkpoint,
                               warmup, steps, run)
    for r in rows:
        if "error" in timed:
            r.setdefault("error", "timing: " + timed["error"])
        elif "error" not in r and "skipped" not in r:
            if r["variant"] in timed:
                r["step_s"] = timed[r["variant"]]
            if "step_s" in r:
                r["tokens_per_s"] = shape["batch"] * shape["seq"] / r["step_s"]
            else:
                r["error"] = "not timed (Liger runs on CUDA only)"
    save()
    print(f"\n{'variant':<24}{'tokens/s':>10}{'step s':>9}{'peak growth MiB':>17}{'saved/layer MiB':>17}"
          f"{'saved/MLP MiB':>15}{'MLP minimum MiB':>17}{'loss':>10}")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r['variant']:<24}" + (f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"))
        else:
            cols = [f"{r[k]:>{w}.1f}" if r[k] is not None else f"{'-':>{w}}"
                    for k, w in (("saved_layer_mib", 17), ("saved_mlp_mib", 15))]
            print(f"{r['variant']:<24}{r['tokens_per_s']:>10.0f}{r['step_s']:>9.2f}{r['peak_growth_mib']:>17.0f}"
                  f"{''.join(cols)}{r['mlp_minimum_mib']:>17.1f}{r['loss']:>10.4f}")
    byname = {r["variant"]: r for r in rows}
    measured = {v: r for v, r in byname.items() if "error" not in r and "skipped" not in r}
    target = dict(TARGETS[device])
    if run.compile and device == "cpu":  # the compiled target: memory only
        target.update(memory=COMPILED_TARGET, time=None)
    verdicts = {}
    # Liger's error is a figure; ours or stock's fails the run
    ok = not any("error" in r for r in rows if r["variant"] != "liger")
    if "stock" in measured:
        stock_loss = measured["stock"]["loss"]
        for v, r in measured.items():
            if v == "stock":
                continue
            r["loss_rel_diff"] = abs(r["loss"] - stock_loss) / max(abs(stock_loss), 1e-30)
            r["correct"] = r["loss_rel_diff"] <= bound  # (NaN fails)
            ok = ok and (r["correct"] or v == "liger")
            print(f"{v}: loss {r['loss_rel_diff']:.1e} from stock's ({'OK' if r['correct'] else 'WRONG'}: "
                  f"bound {bound:g})")
    fused = measured.get("fused LoRA")
    if fused:
        for against in ("swapped today", "stock", "liger"):
            other = measured.get(against)
            if other is None:
                continue
            memory = ratio(fused["peak_growth_mib"], other["peak_growth_mib"])
            t = fused["step_s"] / other["step_s"]
            line = f"fused LoRA / {against}: peak growth {shown(memory)}, time {t:.2f}x, tokens/s {1 / t:.2f}x"
            if against == target["against"]:
                verdicts.update(memory_ratio=memory, time_ratio=t, memory_verdict=verdict(memory, target["memory"]))
                line += f"  (targets: <= {target['memory']:.2f}x {verdicts['memory_verdict']}"
                if target["time"] is not None:
                    verdicts["time_verdict"] = "PASS" if t <= target["time"] else "MISS"
                    line += f", time <= {target['time']:.2f}x {verdicts['time_verdict']}"
                line += ")"
            if against == "swapped today":  # the same step without the LoRA ops
                verdicts.update(without_lora_ops_time_ratio=t, without_lora_ops_memory_ratio=memory)
            print(line)
        tiled = measured.get("fused LoRA + tiled MLP")
        if tiled:
            tiled_memory, tiled_time = (ratio(tiled["peak_growth_mib"], fused["peak_growth_mib"]),
                                        tiled["step_s"] / fused["step_s"])
            verdicts.update(tiled_memory_ratio=tiled_memory, tiled_time_ratio=tiled_time)
            print(f"fused LoRA + tiled MLP / fused LoRA: peak growth {shown(tiled_memory)}, time {tiled_time:.2f}x "
                  "(no checkpointing here: the tiled MLP's recompute is one more MLP forward)")
        untimed = measured.get("fused LoRA untimed")
        if untimed:
            t = fused["step_s"] / untimed["step_s"]
            verdicts.update(untimed_time_ratio=t)
            print(f"fused LoRA / fused LoRA untimed: time {t:.2f}x, peak growth "
                  f"{shown(ratio(fused['peak_growth_mib'], untimed['peak_growth_mib']))} (what timing each call shape "
                  "against PEFT's forward changed)")
        print(f"fused LoRA calls: {fused['calls']}")
    results.update(verdicts, correct=ok)
    save()
    if not ok:
        print("FAILED: a variant did not run, or a swapped variant's loss is not stock's")
    return 0 if ok else 1


def ratio(growth: float, base: float) -> float | None:
    """growth / base, None where the base step added no resident memory (a ratio to 0 means nothing)."""
    return growth / base if base > 0 else None


def shown(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "n/a (the step it is compared with added no memory)"


def verdict(r: float | None, target: float) -> str:
    return "n/a" if r is None else "PASS" if r <= target else "MISS"


if __name__ == "__main__":
    sys.exit(main())
