"""accel-patch demo: fine-tuning of a small Llama with `transformers.Trainer` (LoRA when peft is
installed, else every weight), on whatever this machine has (GPU if present, else CPU), under
plain python or any launcher:

    python -m accel_patch.demo [--steps N] [--output-dir DIR]
    torchrun --nproc_per_node=2 -m accel_patch.demo
    accelerate launch --multi_gpu --num_processes 2 -m accel_patch.demo

Nothing is downloaded: the model is built from a config with random weights and the text is a toy
language made here, in which each of 16 words is usually followed by the same next word, so the
loss visibly falls. The script is an ordinary Trainer script: `use_cpu` is never passed, and the
only accel-patch line it needs is the import; topology and status are printed to show what the
patch decided. It needs only accel-patch's core install (torch, transformers, accelerate);
`pip install 'accel-patch[lora]'` adds peft, and with it the LoRA fine-tune.
"""

import accel_patch  # before torch/transformers/accelerate, as in any user script

import argparse
import contextlib
import importlib.util
import logging
import math
import os
import sys
import tempfile
import time
import warnings

VOCAB, SEQ_LEN, N_WORDS, FOLLOW_P = 128, 32, 16, 0.9


def toy_language(n_rows, seed):
    """Rows of SEQ_LEN tokens: N_WORDS words of the vocabulary, each followed by its fixed successor
    with probability FOLLOW_P, else by a random word. The same on every rank (fixed seeds)."""
    import torch

    g = torch.Generator().manual_seed(1234)  # the language itself: same for train and eval
    words = torch.randperm(VOCAB, generator=g)[:N_WORDS]
    successor = torch.zeros(VOCAB, dtype=torch.long)
    successor[words] = words[torch.randperm(N_WORDS, generator=g)]

    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(n_rows, SEQ_LEN, dtype=torch.long)
    cur = words[torch.randint(0, N_WORDS, (n_rows,), generator=g)]
    for j in range(SEQ_LEN):
        ids[:, j] = cur
        random_word = words[torch.randint(0, N_WORDS, (n_rows,), generator=g)]
        cur = torch.where(torch.rand(n_rows, generator=g) < FOLLOW_P, successor[cur], random_word)
    return [{"input_ids": row, "labels": row} for row in ids]


def describe(topo):
    where = (f"{topo.device_count} x {topo.device_type}" if topo.device_count
             else "CPU only (no accelerator)")
    launcher = topo.launcher if topo.launcher != "none" else "no launcher (plain python)"
    if topo.single_device:
        plan = "single device: one process, no process group, no DDP"
    else:
        plan = (f"distributed data-parallel: {topo.world_size} processes on {topo.num_nodes} "
                f"node(s), {topo.local_world_size} on this node, gradients synced by DDP")
    return (f"  launcher   : {launcher}\n"
            f"  this node  : {where}\n"
            f"  this proc  : rank {topo.rank} of {topo.world_size}, local rank {topo.local_rank}\n"
            f"  decision   : {plan}")


def status_table(records):
    rows = [("patch", "state", "why"), *((r.name, r.state, r.reason) for r in records)]
    w0, w1 = (max(len(str(r[i])) for r in rows) for i in (0, 1))
    return "\n".join(f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)


def whole_number_at_least_1(text):
    """argparse type of --steps: argparse prefixes the option's name to the message."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (for example 20), got {text!r}")
    return value


def directory_path(text):
    """argparse type of --output-dir: a directory, or a path where one can be made."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must be a directory path, got {text!r}")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return text


def add_parser(commands):
    """`accel-patch demo`: its options are parsed by `main`, so that `--help` shows them."""
    return commands.add_parser("demo", help="fine-tune a small Llama on this machine (LoRA when peft is installed)",
                               add_help=False)


def run(args) -> int:
    """The `accel-patch demo` subcommand."""
    return main(args.rest)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="accel-patch demo", description=(
        "Fine-tuning of a small random Llama on a toy language with transformers.Trainer (LoRA when peft "
        "is installed, else every weight); prints what accel-patch decided and the loss before and after."))
    p.add_argument("--steps", type=whole_number_at_least_1, default=80, metavar="N",
                   help="training steps, a whole number >= 1 (default: 80)")
    p.add_argument("--output-dir", type=directory_path, metavar="DIR",
                   help="Trainer output directory (default: a temporary directory, removed at the "
                   "end; nothing is saved in it either way)")
    return p.parse_args(argv)


@contextlib.contextmanager
def quiet_demo_noise():
    """Silence, while the demo runs, what its own set-up makes other libraries print and the
    user cannot act on; each by category or logger, module and message, nothing else."""

    def drop_bitsandbytes_probe(record):
        # Printed when transformers' Trainer imports peft, which imports bitsandbytes: the demo
        # never runs a 4-bit layer, so a missing optional CPU kernel for one does not concern it.
        return not record.getMessage().startswith("Failed to load CPU gemm_4bit_forward")

    bitsandbytes_log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with warnings.catch_warnings():
        # peft's get_peft_model reads the model's `is_gradient_checkpointing`, deprecated in
        # transformers 5: peft's business, not the demo user's.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning, module=r"transformers\.modeling_utils")
        bitsandbytes_log.addFilter(drop_bitsandbytes_probe)
        try:
            yield
        finally:
            bitsandbytes_log.removeFilter(drop_bitsandbytes_probe)


def labelled_progress():
    """Trainer's progress bars with a label: "train", and `eval_label` for evaluations."""
    from transformers import ProgressCallback

    class LabelledProgress(ProgressCallback):
        eval_label = "eval"

        def on_train_begin(self, args, state, control, **kwargs):
            super().on_train_begin(args, state, control, **kwargs)
            if self.training_bar is not None:  # None on every rank but the main one
                self.training_bar.set_description("train")

        def on_prediction_step(self, args, state, control, **kwargs):
            new = self.prediction_bar is None
            super().on_prediction_step(args, state, control, **kwargs)
            if new and self.prediction_bar is not None:
                self.prediction_bar.set_description(self.eval_label)

    return LabelledProgress()


def main(argv=None):
    args = parse_args(argv)
    with quiet_demo_noise():
        return fine_tune(args)


def fine_tune(args):
    """The fine-tune, with checked arguments; prints on the main process only."""
    try:
        topo = accel_patch.topology()
    except accel_patch.TopologyError as e:
        print(f"accel-patch demo: {e}", file=sys.stderr)
        return 2
    main_proc = topo.rank == 0

    def say(*lines):
        if main_proc:
            print(*lines, sep="\n", flush=True)

    lora = importlib.util.find_spec("peft") is not None
    say(f"accel-patch demo: {'LoRA' if lora else 'full'} fine-tuning of a small random Llama on a toy language",
        *(() if lora else ("  (peft is not installed: every weight trains; pip install 'accel-patch[lora]' "
                           "for the LoRA fine-tune)",)), "",
        "Topology (accel_patch.topology()):", describe(topo), "")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, ProgressCallback, Trainer, TrainingArguments

    if not topo.device_count and "OMP_NUM_THREADS" not in os.environ:
        # A model this small gains nothing from intra-op threads, and on a busy CPU they spin:
        # measured on a loaded 2-core box, 0.14 s/step with one thread, 1.5-5 s/step with two.
        torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    with tempfile.TemporaryDirectory(prefix="accel-patch-demo-") as tmp:
        targs = TrainingArguments(
            output_dir=args.output_dir or tmp, max_steps=args.steps,
            per_device_train_batch_size=16, per_device_eval_batch_size=32,
            learning_rate=1e-2 if lora else 2e-3, lr_scheduler_type="cosine", warmup_steps=args.steps // 10,
            logging_steps=max(1, args.steps // 5), save_strategy="no", report_to="none",
            dataloader_num_workers=0, ddp_find_unused_parameters=False, seed=0,
            # Pinning needs an accelerator; without one torch warns at every DataLoader.
            dataloader_pin_memory=topo.device_count > 0)
        trainer = Trainer(model=model, args=targs, train_dataset=toy_language(4096, seed=1),
                          eval_dataset=toy_language(64, seed=2))
        progress = None
        if trainer.pop_callback(ProgressCallback) is not None:  # None when tqdm is turned off
            progress = labelled_progress()
            trainer.add_callback(progress)
        # The Trainer's AccelPatchCallback swapped the kernels into the model when the Trainer was
        # built; asking again swaps nothing twice and says what was done.
        report = accel_patch.swap_kernels(model)
        state = trainer.accelerator.state
        say(str(report), "",
            "accelerate state after Trainer set-up:",
            f"  {state.distributed_type.value}, {state.num_processes} process(es), "
            f"device {state.device}", "",
            "Patch status (accel_patch.status()):", status_table(accel_patch.status()), "",
            f"Model: Llama, 2 layers, hidden 128, vocab {VOCAB}; "
            f"{'LoRA r=16 on all linear layers' if lora else 'full fine-tune'}: "
            f"{trainable:,} of {total:,} parameters train.", "")

        if progress is not None:
            progress.eval_label = "eval before training"
        before = trainer.evaluate()["eval_loss"]
        t0 = time.time()
        trainer.train()
        seconds = time.time() - t0
        if progress is not None:
            progress.eval_label = "eval after training"
        after = trainer.evaluate()["eval_loss"]

    say("", f"Held-out loss: {before:.3f} before -> {after:.3f} after {args.steps} steps "
            f"({seconds:.1f} s of training)",
        f"  (guessing uniformly over the vocabulary gives {math.log(VOCAB):.3f}; "
        f"knowing only which {N_WORDS} words occur gives {math.log(N_WORDS):.3f})")
    if not after < before:
        say("The loss did not fall: something is wrong with this set-up.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
