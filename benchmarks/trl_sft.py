"""TRL SFT side by side: TRL's own LM head (`loss_type="nll"`, and `"chunked_nll"`, its alias in
trl 1.16) against accel-patch's fused loss in its place; and the fused loss alone with all labels
against half of them ignored.

    python benchmarks/trl_sft.py                  # CPU: tiny Llama, vocab 32000, 2 x 1024 tokens, fp32
    python benchmarks/trl_sft.py --json trl.json  # also every figure as JSON

Each variant runs in a fresh process (TRITON_INTERPRET unset: the CPU path a user gets) and
builds the model from a config (random weights, nothing downloaded), a local WordLevel tokenizer
and a dataset made in-process, then an `SFTTrainer` with TRL's defaults except those a benchmark
needs (`max_length=1024`, batch 2, no saving or reporting, `use_cpu=True`). TRL 1.16's defaults
that matter here: `bf16=True` (autocast to bfloat16 around the forward, also on CPU), `loss_type
"nll"` (`"chunked_nll"` is rewritten to `"nll"` in `SFTConfig.__post_init__`), `packing=False`,
`padding_free=False`, `completion_only_loss=None` (prompt tokens ignored for prompt-completion
data). The labels: "all" (plain text: every token is labelled) or "completion" (prompt-completion
rows, a 512-token prompt: half the labels ignored).

A step is `trainer.compute_loss` under bfloat16 autocast (what accelerate wraps the prepared
model's forward in when bf16 is on) and the backward; the optimizer step is the same for every
variant and left out. Peak memory growth: the rise of the process's peak RSS over the first step
(measured before any warm-up). Time: the median of `--steps` steps after `--warmup`.

The loss-alone rows time `F.cross_entropy` on a swapped head's deferred logits (the fused kernel,
2048 tokens, float32 weights, no autocast), forward and backward, with every label kept and with
every other one ignored: the fused loss computes only the labelled rows.
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

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=2048)
BATCH, SEQ, PROMPT = 2, 1024, 512
TARGETS = {"memory": 0.5, "time": 1.1, "ignored": 0.6}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(4000)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _dataset(labels: str):
    import datasets
    import torch

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"w{int(i)}" for i in torch.randint(0, 4000, (n,), generator=g))

    if labels == "all":  # SEQ - 1 words and the EOS TRL appends
        return datasets.Dataset.from_dict({"text": [words(SEQ - 1) for _ in range(BATCH)]})
    return datasets.Dataset.from_dict({"prompt": [words(PROMPT) for _ in range(BATCH)],
                                       "completion": [words(SEQ - PROMPT - 1) for _ in range(BATCH)]})


def sft_child(variant: str, labels: str, warmup: int, steps: int) -> dict:
    if variant == "accel-patch":
        import accel_patch  # noqa: F401  (before transformers and trl, as a user would)
    import torch
    import trl
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa"))
    loss_type = "chunked_nll" if variant == "trl chunked_nll" else "nll"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(output_dir="/tmp/accel_patch_trl_sft_bench", max_length=SEQ, per_device_train_batch_size=BATCH,
                             save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
                             dataloader_num_workers=0, loss_type=loss_type)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_dataset(labels), processing_class=_tokenizer())
    batch = next(iter(trainer.get_train_dataloader()))
    kept = int((batch["labels"][:, 1:] != -100).sum())
    model.train()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = trainer.compute_loss(model, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loss = step()
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    state = model.__dict__.get("_accel_patch_swap_state")
    head = state.head if state is not None and state.head else "TRL's"
    return dict(variant=variant, labels=labels, loss=loss, step_s=statistics.median(times), peak_growth_mib=growth,
                bf16=args.bf16, loss_type=args.loss_type, tokens=BATCH * SEQ, labelled=kept, head=head,
                calls=dict(state.loss_calls) if state is not None else None)


def loss_child(labels: str, warmup: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from accel_patch.swaps.loss.deferred import DeferredLogits, _Head
    from accel_patch.swaps.sites import SwapState

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    n, width, vocab = BATCH * SEQ, CONFIG["hidden_size"], CONFIG["vocab_size"]
    h = torch.randn(n, width, requires_grad=True)
    w = (torch.randn(vocab, width) / width**0.5).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    if labels == "half ignored":
        y[::2] = -100

    def step():
        state = SwapState()
        z = DeferredLogits(_Head(h, w, None, state), (), h, torch.Size((n, vocab)), w.dtype)
        loss = F.cross_entropy(z, y)
        loss.backward()
        h.grad = w.grad = None
        assert state.loss_calls == {"fused": 1}
        return float(loss.detach())

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step()
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    for _ in range(max(0, warmup - 1)):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return dict(variant="fused loss", labels=labels, step_s=statistics.median(times), peak_growth_mib=growth,
                labelled=int((y != -100).sum()), tokens=n)


def run(kind: str, variant: str, labels: str, warmup: int, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ACCEL_PATCH_DISABLE")}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, variant, labels, "--warmup", str(warmup),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(variant=variant, labels=labels, error=f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")


def _row(r: dict, ref: dict | None) -> str:
    if "error" in r:
        return f"{r['variant']:<18}{r['labels']:<14}FAILED: {r['error']}"
    ratio = ""
    if ref is not None and "error" not in ref:
        ratio = f"{r['peak_growth_mib'] / ref['peak_growth_mib']:>8.2f}x{r['step_s'] / ref['step_s']:>8.2f}x"
    loss = f"{r['loss']:.5f}" if "loss" in r else "-"
    return (f"{r['variant']:<18}{r['labels']:<14}{r['labelled']:>6}/{r['tokens']:<6}{r['peak_growth_mib']:>11.0f}"
            f"{r['step_s']:>9.3f}{ratio:>18}{loss:>10}  {r.get('head', '')}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error(f"--warmup and --steps must be >= 1, got {args.warmup} and {args.steps}")
    if args.child:
        kind, variant, labels = args.child
        result = (sft_child(variant, labels, args.warmup, args.steps) if kind == "sft"
                  else loss_child(labels, args.warmup, args.steps))
        print(json.dumps(result))
        return 0

    import torch
    import transformers
    import trl

    machine = f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}"
    print(f"TRL SFT step, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {machine}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, trl {trl.__version__}")
    print(f"Llama: hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, vocab {CONFIG['vocab_size']}, "
          f"{BATCH} x {SEQ} tokens, float32 weights; SFTConfig defaults (bf16=True: bfloat16 autocast on CPU); "
          f"{args.warmup} warm-up, median of {args.steps} steps; ratios against TRL's nll: memory, time")
    print(f"\n{'variant':<18}{'labels':<14}{'labelled':>13}{'growth MiB':>11}{'step s':>9}{'mem x':>9}{'time x':>9}"
          f"{'loss':>10}  LM head")
    rows, verdicts = [], []
    for labels in ("all", "completion"):
        stock = run("sft", "trl nll", labels, args.warmup, args.steps)
        chunked = run("sft", "trl chunked_nll", labels, args.warmup, args.steps)
        ours = run("sft", "accel-patch", labels, args.warmup, args.steps)
        for r in (stock, chunked, ours):
            print(_row(r, stock if r is not stock else None))
        if "loss_type" in chunked:
            print(f"{'':<18}(loss_type='chunked_nll' reads {chunked['loss_type']!r} after SFTConfig: the same head)")
        if "error" not in stock and "error" not in ours:
            mem, t = ours["peak_growth_mib"] / stock["peak_growth_mib"], ours["step_s"] / stock["step_s"]
            verdicts.append(mem <= TARGETS["memory"] and t <= TARGETS["time"])
            print(f"{'':<18}accel-patch / TRL nll: memory {mem:.2f}x (target <= {TARGETS['memory']}x: "
                  f"{'PASS' if mem <= TARGETS['memory'] else 'MISS'}), time {t:.2f}x (target <= {TARGETS['time']}x: "
                  f"{'PASS' if t <= TARGETS['time'] else 'MISS'}), loss difference {abs(ours['loss'] - stock['loss']):.1e}")
        rows += [stock, chunked, ours]
    print(f"\n{'fused loss alone':<18}{'labels':<14}{'labelled':>13}{'growth MiB':>11}{'step s':>9}{'mem x':>9}{'time x':>9}")
    full = run("loss", "fused loss", "all", args.warmup, args.steps)
    half = run("loss", "fused loss", "half ignored", args.warmup, args.steps)
    for r in (full, half):
        print(_row(r, full if r is not full else None))
    if "error" not in full and "error" not in half:
        mem, t = half["peak_growth_mib"] / full["peak_growth_mib"], half["step_s"] / full["step_s"]
        verdicts.append(mem <= TARGETS["ignored"] and t <= TARGETS["ignored"])
        print(f"{'':<18}half ignored / all: memory {mem:.2f}x, time {t:.2f}x (target <= {TARGETS['ignored']}x each: "
              f"{'PASS' if mem <= TARGETS['ignored'] and t <= TARGETS['ignored'] else 'MISS'})")
    rows += [full, half]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(date=datetime.datetime.now().astimezone().isoformat(), machine=machine, rows=rows), f, indent=1)
    return 0 if verdicts and all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
