"""`AccelPatchCallback`: accel-patch inside `transformers.Trainer` (and TRL's trainers built on it).

- `on_init_end` (the model is on its device, not wrapped, no optimizer yet): swap the kernels into
  the Trainer's model, PEFT-unwrapped, unless it already has them.
- `on_train_begin` (after `accelerator.prepare`): a model that still has none (a `model_init`
  Trainer builds its model late, or the callback was added after construction) gets the swaps that
  are safe after wrapping: the modules' kernels, not the fused loss, which needs the model's own
  forward. Said in the log.
- Every training log carries `tokens_per_second` (tokens of the batches' attention masks, or
  Trainer's `num_input_tokens_seen` when it counts them; summed over all processes),
  `step_time_s` and `peak_memory_mib` (accelerator memory allocated on GPU since the last log; the
  process's peak RSS on CPU); the first one also `accel_patch_swap` and `accel_patch_topology`.
  Trainer copies `logs` into `state.log_history` before callbacks run, and report_to integrations
  are callbacks too, so the callback runs first (the registration patch puts it at the head of
  the list) and writes its keys into both.

After `import accel_patch`, every Trainer gets one (ACCEL_PATCH_CALLBACK=0 turns that off);
passing one explicitly replaces the automatic one, never adds a second.
"""
from __future__ import annotations

import logging
import resource
import sys
import time

import torch
from transformers.trainer_callback import TrainerCallback

log = logging.getLogger("accel_patch")


class AccelPatchCallback(TrainerCallback):
    """Swap kernels at the right moment and log throughput and memory with every training log.

    `ops`: the kernels to swap (as `swap_kernels`); None reads ACCEL_PATCH_KERNELS (unset: all).
    `metrics`: add tokens/s, step time and peak memory to the logs.
    """

    def __init__(self, ops=None, metrics: bool = True) -> None:
        self.ops = ops
        self.metrics = metrics
        self.automatic = False  # set when accel-patch added it to a Trainer on its own
        self.report = None
        self._first_log = True
        self._hook = None
        self._tokens = None  # a device tensor: counting never syncs
        self._mark = None  # (time, step, tokens) at the last log

    # --- swapping ---------------------------------------------------------------------------
    def _ops(self):
        if self.ops is not None:
            return self.ops
        from ..swaps.ops import ops_from_env

        return ops_from_env()

    def _swap(self, model, *, prepared: bool) -> None:
        from ..swaps import swap_kernels
        from ..swaps.apply import unwrap
        from ..swaps.sites import STATE_ATTR

        if model is None:
            return
        try:
            ops = self._ops()
            if ops == ():
                return
            already = STATE_ATTR in unwrap(model).__dict__
            self.report = swap_kernels(model, ops) if not prepared else _swap_prepared(model, ops)
            if prepared and not already and self.report.new:
                log.warning("accel_patch: kernels swapped at on_train_begin, after the model was prepared: the "
                            "modules' kernels only; the fused loss needs the swap before preparation (build the "
                            "model before the Trainer, or let the Trainer see it at construction)")
        except Exception as exc:  # the user's training must go on
            log.warning("accel_patch: swapping kernels in the Trainer failed, training runs stock: %s: %s",
                        type(exc).__name__, exc)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._swap(model, prepared=False)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._swap(model, prepared=True)
        if not self.metrics:
            return
        if model is not None and args.include_num_input_tokens_seen in ("no", False, None):
            self._hook = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._mark = (time.perf_counter(), state.global_step, 0.0)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # --- metrics ----------------------------------------------------------------------------
    def _count_tokens(self, module, args, kwargs):
        if not module.training:
            return None
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(mask, torch.Tensor):
            n = mask.sum()
        elif isinstance(ids, torch.Tensor):
            n = torch.tensor(ids.numel(), device=ids.device)
        else:
            return None
        self._tokens = n.detach().to(torch.float64) if self._tokens is None else self._tokens + n.detach()
        return None

    def _tokens_seen(self, args, state) -> float:
        if args.include_num_input_tokens_seen not in ("no", False, None):
            return float(state.num_input_tokens_seen)  # Trainer's own count, already over all processes
        if self._tokens is None:
            return 0.0
        total = self._tokens.clone()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl" and total.device.type != "cuda":
                total = total.cuda()
            dist.all_reduce(total)  # every rank logs at the same steps
        return float(total.item())

    @staticmethod
    def _peak_memory_mib() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            return peak
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.metrics or logs is None or "loss" not in logs or self._mark is None:
            return  # evaluation logs and the end-of-training summary carry their own figures
        now, tokens = time.perf_counter(), self._tokens_seen(args, state)
        then, step, seen = self._mark
        self._mark = (now, state.global_step, tokens)
        added = {"peak_memory_mib": self._peak_memory_mib()}
        if state.global_step > step and now > then:
            added["step_time_s"] = (now - then) / (state.global_step - step)
            added["tokens_per_second"] = (tokens - seen) / (now - then)
        if self._first_log:
            self._first_log = False
            added["accel_patch_swap"] = self.report.short() if self.report is not None else "no kernels swapped"
            added["accel_patch_topology"] = _topology_line()
        logs.update(added)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and last.get("loss") == logs.get("loss"):
            last.update(added)  # Trainer appended its copy before calling us


def _swap_prepared(model, ops):
    from ..swaps.apply import swap

    return swap(model, ops, top_level=False)


def _topology_line() -> str:
    """The run in a few words (a logged value: under 100 characters), e.g.
    "2 processes on 1 node(s), cpu, torchrun; accelerate: cpu-distributed"."""
    from ..core import registry
    from ..core.accelerate_decision import PATCH_NAME
    from ..core.topology_resolver import topology

    try:
        topo = topology()
        devices = f"{topo.device_count} x {topo.device_type}" if topo.device_count else "cpu"
        line = f"{topo.world_size} process(es) on {topo.num_nodes} node(s), {devices}, {topo.launcher}"
    except Exception as exc:  # a bad variable was reported where it mattered; do not fail the log
        line = f"unresolved: {type(exc).__name__}"
    decision = registry.last_decision(PATCH_NAME)  # read through the registry: no patch is imported
    return f"{line}; accelerate: {decision.action}" if decision else line
