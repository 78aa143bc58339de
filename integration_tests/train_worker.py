"""One training process for the integration tests: tiny random Llama, `transformers.Trainer`.

Started by torchrun, `accelerate launch` or plain python. It imports accel_patch first, like a
user script would, trains a few steps and writes what it saw to `<out>/rank<RANK>.json`, with the
trainable weights before and after training in `<out>/rank<RANK>.pt`.

It never passes `use_cpu`: routing a CPU multi-process run to gloo is the patch's job.

`--save-checkpoint DIR` instead writes a tiny Llama checkpoint to DIR (for the from_pretrained
tests) and exits.

`--without-import` makes it a plain Trainer script that never imports accel_patch itself: accel-patch
then runs only if the start-up hook of `accel-patch config` loads it.

`--own-group` creates the process group itself (`init_process_group("gloo")`) before the Trainer,
as some scripts do; `--second-trainer` then trains a second model with a second Trainer in the
same process (its TrainingArguments rebuilds accelerate's state beside the live group), seeded
per rank again, and writes what it saw under "second" (weights: "second_initial", "second_final").
"""
import sys

if "--without-import" not in sys.argv:
    import accel_patch  # first, before torch / transformers / accelerate, as a user would

import argparse
import hashlib
import json
import os
import time

VOCAB = 128
SEQ_LEN = 16


def tiny_config():
    from transformers import LlamaConfig

    # hidden 64: the smallest width that bitsandbytes' 4-bit blocks (64) quantize cleanly
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ_LEN * 2,
        tie_word_embeddings=False,
    )


class PatternData:
    """Arithmetic token sequences (start, step): the next token is predictable, so loss falls.

    The same on every rank (fixed generator), so ranks differ only by what DDP shards to them.
    """

    def __init__(self, n=64):
        import torch

        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        steps = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (starts + steps * torch.arange(SEQ_LEN)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": ids.new_ones(ids.shape), "labels": ids.clone()}


def flat_trainable(model):
    import torch

    # FSDP2 shards are DTensors: gather each (a collective: every rank calls this in the same order)
    params = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().reshape(-1)
              for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)]
    return torch.cat(params)


def digest(vec):
    return hashlib.sha256(vec.numpy().tobytes()).hexdigest()[:16]


def load_model(args):
    """Build or load the model the way the scenario asks; return (model, load_info)."""
    import torch
    from transformers import LlamaForCausalLM

    info = {}
    if args.checkpoint is None:
        return LlamaForCausalLM(tiny_config()), info

    kwargs = {"device_map": args.device_map}
    if args.qlora:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = LlamaForCausalLM.from_pretrained(args.checkpoint, **kwargs)
    info["hf_device_map"] = getattr(model, "hf_device_map", None)
    gate = model.model.layers[0].mlp.gate_proj
    info["linear_class"] = type(gate).__name__
    info["weight_device"] = str(gate.weight.device)
    info["weight_dtype"] = str(gate.weight.dtype)

    if args.qlora:
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        targets = ["q_proj", "v_proj"] if args.lora_targets == "qv" else [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    return model, info


def train(args):
    t = [time.time()]
    import torch
    from transformers import Trainer, TrainingArguments  # noqa: F401  (timed with the imports)

    t.append(time.time())

    rank = int(os.environ.get("RANK") or 0)
    if args.seed_per_rank:
        # Different weights on each rank before DDP: equal weights at the end prove DDP synced them.
        torch.manual_seed(1000 + rank)
    else:
        torch.manual_seed(1000)

    if args.own_group:
        torch.distributed.init_process_group("gloo")  # the launcher's env:// variables
    model, load_info = load_model(args)
    initial = flat_trainable(model)
    t.append(time.time())

    targs = TrainingArguments(
        output_dir=os.path.join(args.out, f"trainer_rank{rank}"),
        max_steps=args.steps, per_device_train_batch_size=4, learning_rate=args.lr,
        logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0,
        disable_tqdm=True, seed=42,
        ddp_find_unused_parameters=False if args.qlora else None,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=PatternData())
    state = trainer.accelerator.state
    pg_after_trainer = torch.distributed.is_initialized()
    t.append(time.time())
    # Marks that set-up passed: a test of bad input checks that training was never reached.
    open(os.path.join(args.out, f"rank{rank}.training"), "w").close()
    out = trainer.train()
    t.append(time.time())

    final = flat_trainable(trainer.model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # the training logs as the loggers got them (with the callback's keys, which log_history never holds)
    logged = (sys.modules["accel_patch.integrations.callback"].training_logs(trainer)
              if "accel_patch.integrations.callback" in sys.modules else [])
    wrapped = trainer.model_wrapped
    accel = sys.modules.get("accel_patch")  # imported above, or by the start-up hook, or absent
    device_map, is_distributed = accel.prepare_device_map() if accel else (None, None)
    topo = accel.topology() if accel else None
    result = {
        "accel_patch_loaded": accel is not None,
        "startup": getattr(sys, "accel_patch_startup", None),
        # what AccelPatchCallback swapped, from the first training log
        "swap": next((h["accel_patch_swap"] for h in logged if "accel_patch_swap" in h), None),
        # how the swapped loss ran: {"fused": n} or why calls stood aside
        "loss_calls": next((dict(m.__dict__["_accel_patch_swap_state"].loss_calls) for m in trainer.model.modules()
                            if "_accel_patch_swap_state" in m.__dict__), None),
        "fsdp_version": getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None),
        "head_weight_type": type(getattr(getattr(trainer.model, "lm_head", None), "weight", None)).__name__,
        "env_rank": rank,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "distributed_type": str(state.distributed_type).split(".")[-1],
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "device": str(state.device),
        "pg_initialized_after_trainer": pg_after_trainer,
        "pg_initialized_after_train": torch.distributed.is_initialized(),
        "pg_world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
        "ddp_wrapped": isinstance(wrapped, torch.nn.parallel.DistributedDataParallel),
        "wrapped_class": type(wrapped).__name__,
        "initial_digest": digest(initial),
        "final_digest": digest(final),
        "final_norm": float(final.norm()),
        "n_trainable": final.numel(),
        "losses": losses,
        "train_loss": out.training_loss,
        "seconds": dict(zip(("imports", "model", "trainer", "train"),
                            (round(b - a, 2) for a, b in zip(t, t[1:])))),
        "load": load_info,
        "prepare_device_map": [device_map, is_distributed],
        "topology": {k: getattr(topo, k, None) for k in (
            "world_size", "rank", "local_rank", "local_world_size", "num_nodes", "device_type",
            "device_count", "launcher", "single_device")},
        # per-call outcomes of the fused LoRA sites (swapped by the load hook, before PEFT)
        "lora_calls": _lora_calls(trainer.model) if accel else None,
        "status": [{"name": r.name, "state": r.state, "reason": r.reason}
                   for r in (accel.status() if accel else [])],
    }
    weights = {"initial": initial, "final": final}
    if args.second_trainer:
        result["second"], weights["second_initial"], weights["second_final"] = _second_trainer(args, rank)
    torch.save(weights, os.path.join(args.out, f"rank{rank}.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"[worker rank {rank}] {result['distributed_type']} loss {losses[0]:.3f} -> {losses[-1]:.3f}",
          flush=True)
    if torch.distributed.is_initialized():  # ranks leave together: no rank tears gloo down under another
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # Leave without freeing the Trainer: torch 2.13's ProcessGroupGloo destructor (run when the DDP
    # reducer, its last owner, is freed) joins gloo's worker thread while holding the GIL, and that
    # thread can still need the GIL to drop a finished collective's tensors. Seen as a rank hung
    # after its results were written (py-spy: ~Reducer -> ~ProcessGroupGloo -> thread::join; gloo's
    # runLoop -> ~AsyncAllgatherWork -> gil_scoped_acquire), two launches in four suite runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _second_trainer(args, rank):
    """A second model and Trainer in the same process: (what it saw, initial and final weights)."""
    import torch
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(2000 + rank if args.seed_per_rank else 2000)
    model, _ = load_model(args)
    initial = flat_trainable(model)
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, f"trainer2_rank{rank}"), max_steps=args.steps,
        per_device_train_batch_size=4, learning_rate=args.lr, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, disable_tqdm=True, seed=42)
    trainer = Trainer(model=model, args=targs, train_dataset=PatternData())
    trainer.train()
    final = flat_trainable(trainer.model)
    state = trainer.accelerator.state
    seen = {"distributed_type": str(state.distributed_type).split(".")[-1], "num_processes": state.num_processes,
            "process_index": state.process_index,
            "ddp_wrapped": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
            "initial_digest": digest(initial), "final_digest": digest(final),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    return seen, initial, final


def _lora_calls(model):
    from accel_patch.swaps import apply, sites

    state = apply.unwrap(model).__dict__.get(sites.STATE_ATTR)
    return {op: outcomes for op, outcomes in state.calls.items() if op.startswith("lora_")} if state is not None else None


def save_checkpoint(path):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for rank<N>.json / rank<N>.pt")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed-per-rank", action="store_true")
    p.add_argument("--checkpoint", help="from_pretrained this directory instead of building from a config")
    p.add_argument("--device-map", default="auto", help="device_map passed to from_pretrained")
    p.add_argument("--qlora", action="store_true", help="4-bit load + LoRA (needs --checkpoint)")
    p.add_argument("--lora-targets", choices=("qv", "all"), default="qv",
                   help="--qlora adapts q,v (qv) or q,k,v,o,gate,up,down (all)")
    p.add_argument("--save-checkpoint", metavar="DIR")
    p.add_argument("--without-import", action="store_true", help="never import accel_patch in this script")
    p.add_argument("--own-group", action="store_true", help="init_process_group('gloo') before the Trainer")
    p.add_argument("--second-trainer", action="store_true", help="then a second model and Trainer in this process")
    args = p.parse_args(argv)
    if args.save_checkpoint:
        save_checkpoint(args.save_checkpoint)
        return 0
    if not args.out:
        p.error("--out is required")
    if args.qlora and not args.checkpoint:
        p.error("--qlora needs --checkpoint")
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
