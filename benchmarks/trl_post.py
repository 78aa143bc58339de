"""TRL post-training side by side: SFT, DPO, KTO, GRPO and ORPO, with LoRA and as a full fine-tune,
stock TRL against the same script with accel-patch imported first.

    python benchmarks/trl_post.py                       # CPU: tiny Qwen2, vocab 32000, 128 + 192 tokens
    python benchmarks/trl_post.py --trainers dpo,grpo   # some trainers only
    python benchmarks/trl_post.py --device cuda         # GPU: Llama-3.2-1B shape, 1024-token completions
    python benchmarks/trl_post.py --dry-run             # the same code at tiny shapes, in seconds
    python benchmarks/trl_post.py --json post.json      # also every figure as JSON (after each variant)

Every trainer runs with TRL 1.16's defaults (bf16 autocast, also on CPU; gradient checkpointing;
each trainer's own loss), except what a benchmark needs: sequence lengths, batch sizes, no saving or
reporting, `use_cpu=True` on CPU, `logging_steps=1`, and GRPO's `beta=0.04` (its default 0 loads no
reference model; with 0.04 the step has the reference pass DPO and KTO have). LoRA: r 16, alpha 32,
dropout 0.05 on every linear layer (a recipe's config); the reference is the policy with its adapters
off. Full fine-tune: a copy of the policy as `ref_model` (GRPO: loaded from the policy's saved path).
The model is built from a config (random weights) and the tokenizer in-process: nothing downloaded.

Each variant runs `trainer.train()` for `--steps` steps in a fresh process (TRITON_INTERPRET unset:
the CPU path a user gets; glibc's mmap threshold fixed at 128 KiB, so freed tensors leave the
process as on a GPU's allocator). Per step, a callback measures:

- peak growth: on CPU the step's peak RSS over the process's resident level when it began (Linux's
  resettable peak, /proc/self/clear_refs); on GPU max_memory_allocated() during the step minus what
  was allocated before it. The figure is the largest over the steps (the first one allocates
  the optimizer state, the same for both).
- step time: the median over the steps after the first (GRPO's include its generation).
- metrics: the trainer's logs of step 1 (loss, rewards, margins, KL, reward) side by side, and which
  LM head ran (`accel_patch.report(model).calls` of the fused loss).

Ratios are accel-patch / stock; the targets (DPO, KTO, GRPO: peak growth <= 0.5x, time <= 1.0x) print
PASS or MISS. Without trl (the GPU image has none) it prints "skipped: trl not installed" and exits 0.
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

TRAINERS = ("sft", "dpo", "kto", "grpo", "orpo")
TUNINGS = ("lora", "full")
VARIANTS = ("stock", "accel-patch")
TARGETS = {"memory": 0.5, "time": 1.0, "trainers": ("dpo", "kto", "grpo")}
SHAPES = {
    "cpu": dict(model="qwen2", config=dict(vocab_size=32000, hidden_size=256, intermediate_size=704,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=4096),
                prompt=128, completion=192, batch=2, generations=4, generated=64, steps=3),
    # Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 key-value heads of 64, vocab 128256, tied.
    "cuda": dict(model="llama", config=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                            num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                            head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                                            rope_theta=500000.0),
                 prompt=128, completion=1024, batch=2, generations=4, generated=1024, steps=3),
    "dry-run": dict(model="qwen2", config=dict(vocab_size=512, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               max_position_embeddings=256),
                    prompt=6, completion=6, batch=2, generations=2, generated=4, steps=2),
}
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM")
WORDS = 400
#: The logged metrics shown beside the loss, per trainer (those the trainer logs).
SHOWN = {"sft": ("entropy", "mean_token_accuracy"), "dpo": ("rewards/margins", "rewards/accuracies"),
         "kto": ("kl", "rewards/chosen_sum"), "grpo": ("reward", "kl", "entropy"),
         "orpo": ("nll_loss", "log_odds_ratio")}


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def dataset(trainer: str, shape: dict, rows: int):
    import datasets
    import torch

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g))

    prompts = [words(shape["prompt"]) for _ in range(rows)]
    if trainer == "sft":
        return datasets.Dataset.from_dict({"prompt": prompts, "completion": [words(shape["completion"]) for _ in prompts]})
    if trainer == "grpo":
        return datasets.Dataset.from_dict({"prompt": prompts})
    chosen = [words(shape["completion"]) for _ in prompts]
    rejected = [words(shape["completion"]) for _ in prompts]
    if trainer == "kto":
        return datasets.Dataset.from_dict({"prompt": prompts * 2, "completion": chosen + rejected,
                                           "label": [True] * rows + [False] * rows})
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def _reward(completions, **kwargs):
    return [float(len(c)) / 100 for c in completions]


class Meter:
    """A TrainerCallback (built lazily: transformers is imported in the child): per step, its time
    and its peak memory growth over the level when it began."""

    def __new__(cls, device: str):
        from transformers import TrainerCallback

        class _Meter(TrainerCallback):
            def __init__(self):
                self.times, self.growth, self._t, self._base = [], [], None, None

            def on_step_begin(self, args, state, control, **kwargs):
                self._base = _memory_now(device, reset=True)
                self._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter() - self._t)
                self.growth.append(_memory_peak(device) - self._base)

        return _Meter()


def _memory_now(device: str, reset: bool) -> float:
    """MiB in use now (resetting the peak counter when asked)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        if reset:
            torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return _status_kib("VmRSS") / 1024


def _memory_peak(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return _status_kib("VmHWM") / 1024


def _status_kib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def build_model(shape: dict, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if shape["model"] == "qwen2" else (LlamaConfig,
                                                                                              LlamaForCausalLM)
    model = model_cls(config_cls(**shape["config"], pad_token_id=0, bos_token_id=1, eos_token_id=2))
    return model.to(device)


def make_trainer(trainer: str, tuning: str, shape: dict, device: str, out: str):
    import warnings

    import trl

    rows = shape["batch"] * (shape["steps"] + 1) * (2 if trainer == "grpo" else 1)
    data = dataset(trainer, shape, rows)
    common = dict(output_dir=out, max_steps=shape["steps"], logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, dataloader_num_workers=0, per_device_train_batch_size=shape["batch"], seed=0)
    if device == "cpu":
        common["use_cpu"] = True
    length = shape["prompt"] + shape["completion"] + 8
    peft_config = None
    if tuning == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(**LORA)
    model = build_model(shape, device)
    kw = dict(processing_class=tokenizer(), train_dataset=data, peft_config=peft_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trainer == "sft":
            args = trl.SFTConfig(**common, max_length=length)
            return trl.SFTTrainer(model=model, args=args, **kw), model
        if trainer == "dpo":
            args = trl.DPOConfig(**common, max_length=length)
            ref = build_model(shape, device) if tuning == "full" else None
            return trl.DPOTrainer(model=model, ref_model=ref, args=args, **kw), model
        if trainer == "kto":
            args = trl.KTOConfig(**common, max_length=length)
            ref = build_model(shape, device) if tuning == "full" else None
            return trl.KTOTrainer(model=model, ref_model=ref, args=args, **kw), model
        if trainer == "grpo":
            saved = os.path.join(out, "policy")
            model.save_pretrained(saved)  # GRPO builds its reference (beta > 0) from the policy's path
            common["per_device_train_batch_size"] = shape["generations"]  # one prompt's generations a step
            args = trl.GRPOConfig(**common, num_generations=shape["generations"],
                                  max_completion_length=shape["generated"], beta=0.04)
            t = trl.GRPOTrainer(model=saved, reward_funcs=_reward, args=args, **kw)
            return t, t.model
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**common, max_length=length)
        return ORPOTrainer(model=model, args=args, **kw), model


def child(trainer: str, tuning: str, variant: str, device: str) -> dict:
    if variant == "accel-patch":
        import accel_patch  # noqa: F401  (before transformers and trl, as a user would)
    import torch

    if device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    shape = SHAPES[device]
    with tempfile.TemporaryDirectory() as out:
        t, model = make_trainer(trainer, tuning, shape, device, out)
        meter = Meter(device)
        t.add_callback(meter)
        t.train()
    return dict(trainer=trainer, tuning=tuning, variant=variant, **_summary(t, model, meter))


def _summary(t, model, meter) -> dict:
    callback = sys.modules.get("accel_patch.integrations.callback")  # its keys are in the loggers' logs only
    logs = callback.training_logs(t) if callback else [h for h in t.state.log_history if "loss" in h]
    first = {k: v for k, v in (logs[0] if logs else {}).items() if isinstance(v, (int, float))}
    later = meter.times[1:] or meter.times
    head, calls = "stock", None
    try:
        import accel_patch

        if "accel_patch" in sys.modules and accel_patch.status is not None:
            from accel_patch.swaps.apply import report_of, unwrap

            report = report_of(unwrap(model))
            calls = report.calls.get("fused_linear_cross_entropy")
            head = report.short()
    except Exception as exc:  # stock: accel_patch not imported, or no swap state
        head = "stock" if "accel_patch" not in sys.modules else f"no report: {type(exc).__name__}"
    return dict(peak_growth_mib=max(meter.growth), growth_per_step=meter.growth, step_s=statistics.median(later),
                first_log=first, head=head, head_calls=calls)


def run(trainer, tuning, variant, device, dry_run: bool) -> dict:
    if dry_run:  # one process, accel-patch toggled, tiny shapes: the code path, not the figures
        return _in_process(trainer, tuning, variant)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_DISABLE")}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", trainer, tuning, variant, "--device", device,
           "--steps", str(SHAPES[device]["steps"])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(trainer=trainer, tuning=tuning, variant=variant,
                    error=f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}")


def _in_process(trainer, tuning, variant) -> dict:
    import accel_patch

    (accel_patch.enable if variant == "accel-patch" else accel_patch.disable)()
    try:
        with tempfile.TemporaryDirectory() as out:
            t, model = make_trainer(trainer, tuning, SHAPES["dry-run"], "cpu", out)
            meter = Meter("cpu")
            t.add_callback(meter)
            t.train()
        result = dict(trainer=trainer, tuning=tuning, variant=variant, **_summary(t, model, meter))
        if variant == "stock":
            result["head"] = "stock"
        return result
    except Exception as exc:
        return dict(trainer=trainer, tuning=tuning, variant=variant, error=f"{type(exc).__name__}: {exc}")
    finally:
        accel_patch.enable()


def generate_overhead(device: str, rounds: int, shape: dict) -> dict:
    """`generate` of a LoRA model (GRPO's generation: 4 sequences, the shape's prompt and completion
    lengths), stock PEFT against the swapped twin, timed in alternating rounds in one process."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    import accel_patch

    torch.manual_seed(0)
    stock = get_peft_model(build_model(shape, device), LoraConfig(**LORA))
    ours = copy.deepcopy(stock)
    accel_patch.swap_kernels(ours)
    ids = torch.randint(4, WORDS, (shape["generations"], shape["prompt"]), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    kw = dict(max_new_tokens=shape["generated"], min_new_tokens=shape["generated"], do_sample=False, pad_token_id=0)
    times = {"stock": [], "accel-patch": []}
    outs = {}
    for m in (stock, ours):
        m.train()  # as GRPO generates: the policy in training mode, under no_grad
    for _ in range(rounds):
        for name, m in (("stock", stock), ("accel-patch", ours)):
            t0 = time.perf_counter()
            outs[name] = m.generate(input_ids=ids, **kw)
            times[name].append(time.perf_counter() - t0)
    calls = accel_patch.report(ours).calls
    return dict(stock_s=statistics.median(times["stock"]), ours_s=statistics.median(times["accel-patch"]),
                same_tokens=bool(torch.equal(outs["stock"], outs["accel-patch"])),
                lora_calls={op: dict(c) for op, c in calls.items() if op.startswith("lora_")})


def _line(r: dict, ref: dict | None) -> str:
    name = f"{r['trainer']} {r['tuning']}"
    if "error" in r:
        return f"{name:<11}{r['variant']:<12}FAILED: {r['error'][-300:]}"
    ratio = ""
    if ref is not None and "error" not in ref and ref["peak_growth_mib"] > 0:
        ratio = f"{r['peak_growth_mib'] / ref['peak_growth_mib']:>7.2f}x{r['step_s'] / ref['step_s']:>7.2f}x"
    shown = ", ".join(f"{k} {r['first_log'][k]:.5g}" for k in ("loss", *SHOWN[r["trainer"]]) if k in r["first_log"])
    calls = ""
    if r.get("head_calls"):
        calls = "; head " + ", ".join(f"{o} x{n}" for o, n in r["head_calls"].items())
    return (f"{name:<11}{r['variant']:<12}{r['peak_growth_mib']:>10.0f}{r['step_s']:>9.3f}{ratio:>16}  "
            f"{shown}{calls}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--trainers", default=",".join(TRAINERS), help=f"comma-separated, among {','.join(TRAINERS)}")
    p.add_argument("--tunings", default=",".join(TUNINGS), help="lora, full or both")
    p.add_argument("--steps", type=int, help="training steps per variant (default: the shape's, 3; at least 2)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, one process: checks the code runs")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON, after each variant")
    p.add_argument("--generate", type=int, metavar="ROUNDS", default=0,
                   help="also time generate of a LoRA model, stock vs swapped, in ROUNDS alternating rounds")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    trainers = [s for s in args.trainers.split(",") if s]
    tunings = [s for s in args.tunings.split(",") if s]
    bad = [s for s in trainers if s not in TRAINERS] + [s for s in tunings if s not in TUNINGS]
    if bad:
        p.error(f"unknown trainer/tuning {bad}: trainers among {TRAINERS}, tunings among {TUNINGS}")
    if args.steps is not None:
        if args.steps < 2:
            p.error(f"--steps must be >= 2 (the first step is not timed), got {args.steps}")
        for shape in SHAPES.values():
            shape["steps"] = args.steps
    if args.child:
        print(json.dumps(child(*args.child, args.device)))
        return 0
    try:
        import trl
    except ImportError:
        print("trl_post: skipped: trl not installed")
        return 0
    import torch
    import transformers

    device = "cpu" if args.dry_run else args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("trl_post: skipped: --device cuda but torch sees no CUDA device")
        return 0
    shape = SHAPES["dry-run" if args.dry_run else device]
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"TRL post-training steps, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}{load}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
          + (" (dry run: tiny shapes, one process; figures mean nothing)" if args.dry_run else ""))
    c = shape["config"]
    print(f"{shape['model']}: hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, vocab {c['vocab_size']}; "
          f"{shape['prompt']} prompt + {shape['completion']} completion tokens, batch {shape['batch']}; GRPO "
          f"{shape['generations']} generations of {shape['generated']}; {shape['steps']} steps; TRL's defaults "
          f"(bf16 autocast, gradient checkpointing); ratios accel-patch / stock: peak growth, time")
    print(f"\n{'run':<11}{'variant':<12}{'peak MiB':>10}{'step s':>9}{'mem x':>8}{'time x':>8}  step-1 metrics")
    rows, verdicts = [], []

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine + load,
                               device=device, dry_run=args.dry_run, shape=shape, rows=rows), f, indent=1)

    if args.generate:
        g = generate_overhead(device, args.generate, shape)
        rows.append(dict(generate=g))
        save()
        print(f"generate (LoRA, {shape['generations']} x {shape['prompt']} + {shape['generated']} new tokens): stock "
              f"{g['stock_s']:.3f} s, accel-patch {g['ours_s']:.3f} s ({g['ours_s'] / g['stock_s']:.2f}x, target <= "
              f"1.05x); same tokens: {g['same_tokens']}; LoRA calls {g['lora_calls']}")
    for trainer in trainers:
        for tuning in tunings:
            pair = {}
            for variant in VARIANTS:
                pair[variant] = r = run(trainer, tuning, variant, device, args.dry_run)
                rows.append(r)
                save()
                print(_line(r, pair["stock"] if variant != "stock" else None), flush=True)
            stock, ours = pair["stock"], pair["accel-patch"]
            if "error" in ours or "error" in stock:
                verdicts.append(False)
                continue
            print(f"{'':<23}LM head: {ours['head']}")
            if trainer in TARGETS["trainers"] and not args.dry_run and stock["peak_growth_mib"] > 0:
                mem = ours["peak_growth_mib"] / stock["peak_growth_mib"]
                t = ours["step_s"] / stock["step_s"]
                ok = mem <= TARGETS["memory"] and t <= TARGETS["time"]
                verdicts.append(ok)
                print(f"{'':<23}targets: peak growth {mem:.2f}x (<= {TARGETS['memory']}x: "
                      f"{'PASS' if mem <= TARGETS['memory'] else 'MISS'}), time {t:.2f}x (<= {TARGETS['time']}x: "
                      f"{'PASS' if t <= TARGETS['time'] else 'MISS'})")
    save()
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
