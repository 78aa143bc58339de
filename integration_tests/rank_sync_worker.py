"""The rank-sync check in a DDP Trainer: one process of a 2-rank torchrun launch, three
Trainer runs in it, so that one launch covers them all.

- "sync": ACCEL_PATCH_SYNC_EVERY=1, 5 steps: every log should say the ranks are in sync.
- "drift": the same, with rank 1 nudging one weight after step 3 (a callback behind ours, so the
  check of step 3 still sees equal ranks): from step 4 on, the logs should name rank 1.
- "error": the drift run with ACCEL_PATCH_SYNC_CHECK=error: the run should stop with the message.

Writes `<out>/rank<RANK>.json`: per run the logged `accel_patch_rank_sync` values by step, the
warnings accel_patch logged, and the error that stopped the run.
"""
import accel_patch  # noqa: F401  first, as a user would

import argparse
import json
import logging
import os
import sys

from train_worker import PatternData, tiny_config  # the worker beside this one (sys.path[0])


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run(variant, targs, rank, warnings):
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback

    class Nudge(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3 and rank == 1:
                with torch.no_grad():
                    model.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3

    os.environ["ACCEL_PATCH_SYNC_EVERY"] = "1"
    os.environ["ACCEL_PATCH_SYNC_CHECK"] = "error" if variant == "error" else "warn"
    torch.manual_seed(1000)
    model = LlamaForCausalLM(tiny_config())
    trainer = Trainer(model=model, args=targs, train_dataset=PatternData(),
                      callbacks=[] if variant == "sync" else [Nudge()])
    del warnings.messages[:]
    error = None
    try:
        trainer.train()
    except RuntimeError as exc:
        error = str(exc)
    from accel_patch.integrations.callback import training_logs

    return {"sync": {h["step"]: h.get("accel_patch_rank_sync") for h in training_logs(trainer)},
            "warnings": list(warnings.messages), "error": error,
            "distributed_type": str(trainer.accelerator.state.distributed_type).split(".")[-1]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from transformers import TrainingArguments

    rank = int(os.environ.get("RANK") or 0)
    warnings = Warnings()
    logging.getLogger("accel_patch").addHandler(warnings)
    # One TrainingArguments for the three runs: a second one rebuilds accelerate's state beside the
    # first run's process group (test_launchers.py covers that case).
    targs = TrainingArguments(output_dir=os.path.join(args.out, f"trainer{rank}"), max_steps=5,
                              per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                              save_strategy="no", report_to="none", dataloader_num_workers=0, disable_tqdm=True,
                              seed=42)
    result = {variant: run(variant, targs, rank, warnings) for variant in ("sync", "drift", "error")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
