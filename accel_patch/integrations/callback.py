"""`AccelPatchCallback`: accel-patch inside `transformers.Trainer` (and TRL's trainers built on it).

- `on_init_end` (the model is on its device, not wrapped, no optimizer yet): swap the kernels into
  the Trainer's model, PEFT-unwrapped, unless it already has them.
- `on_train_begin` (after `accelerator.prepare`): a model that still has none (a `model_init`
  Trainer builds its model late, or the callback was added after construction) gets the swaps that
  are safe after wrapping: the modules' kernels, not the fused loss, which needs the model's own
  forward. Said in the log.
- Every training log carries `tokens_per_second`: the tokens the steps train on (`step_tokens`:
  the labels not ignored, else the attention mask in any of its forms, of the model's training
  forwards that build a graph, so not a reference model's pass, KTO's
  KL pass, GRPO's generation or its old log-probs, which run under no_grad; or Trainer's
  `num_input_tokens_seen` when it counts them; summed over all processes) per second since the last
  log; `step_time_s`; and `peak_memory_mib`: on GPU the peak of accelerator memory allocated since
  the last log; on CPU the peak resident memory since the last log over the resident level at its
  start (the growth the steps caused, Linux's resettable peak RSS; elsewhere the process's lifetime
  peak). The first one also carries `accel_patch_swap` and `accel_patch_topology`.
  report_to integrations and the console printer are callbacks too, so the callback runs before
  them (the registration patch puts it first but for transformers' DefaultFlowCallback) and writes
  its keys into `logs`, which each of them gets. Not into `state.log_history`: Trainer appended
  its copy before the callbacks ran, that history is saved with every checkpoint
  (trainer_state.json) and a resumed run's must equal an uninterrupted one's, while these are
  this run's own measurements (a step's time differs every run). `callback.logged` keeps them,
  each with its step.
- Fall-backs: a log after which calls of a swapped op ran another forward (PEFT's for a LoRA
  site, the stock head for the fused loss: `swaps.report.outcome_kind`) carries
  `accel_patch_fallbacks` ("lora_mlp x8 PEFT's forward: ..."), and the logger warns once per op
  and reason; the counts are in `accel_patch.report(model).calls`. Under torch.compile the
  compiled graph decides and calls are not counted: the first log says so.
- Rank sync (more than one process): at the first log and every ACCEL_PATCH_SYNC_EVERY steps
  (automatic by default: the check stays under 0.5% of the step time; 0: off) the trainable
  parameters every rank holds whole are compared with one collective (`core.rank_sync`); the log
  carries `accel_patch_rank_sync`, "in sync (...)" or "DRIFT: rank(s) ... differ from rank 0 ...",
  rank 0's logger warns on drift, and ACCEL_PATCH_SYNC_CHECK=error stops the run instead.

Never breaking the host: every event runs the callback's work in parts (swap, metrics, rank sync,
fall-backs, the log write), each guarded: an exception of its own never reaches the Trainer, it
is logged once, and that part is off for the rest of the run while the others go on. A model that
is not a `torch.nn.Module` (transformers' own tests hand callbacks a string) is skipped by the
parts that need one, said once. Only the stops the user asked for get through: DRIFT under
ACCEL_PATCH_SYNC_CHECK=error, and a bad value of a rank-sync switch in a run of several processes
(`RunStopped`).

Every string the callback logs is at most 100 characters (transformers' console printer replaces
longer ones); the details are in the swap report.

After `import accel_patch`, every Trainer gets one (ACCEL_PATCH_CALLBACK=0 turns that off);
passing one explicitly replaces the automatic one, never adds a second.
"""
from __future__ import annotations

import logging
import math
import resource
import sys
import time

import torch
from transformers.trainer_callback import TrainerCallback

from ..core import rank_sync
from ..core.log_line import fit

log = logging.getLogger("accel_patch")

SWAP, METRICS, RANK_SYNC, FALLBACKS, WRITE = "swap", "metrics", "rank sync", "fall-backs", "log write"


class RunStopped(RuntimeError):
    """A stop the user asked for (ACCEL_PATCH_SYNC_CHECK=error on drift, a bad rank-sync setting in
    a run of several processes): the one exception of the callback that reaches the Trainer."""


class AccelPatchCallback(TrainerCallback):
    """Swap kernels at the right moment and log throughput and memory with every training log.

    `ops`: the kernels to swap (as `swap_kernels`); None reads ACCEL_PATCH_KERNELS (unset: all). A
    swap adds ops and never removes one: a model swapped before the Trainer (at load) keeps what it
    runs, and the callback warns which ops it keeps beyond `ops`.
    `metrics`: add tokens/s, step time and peak memory to the logs.
    """

    def __init__(self, ops=None, metrics: bool = True) -> None:
        self.ops = ops
        self.metrics = metrics
        self.automatic = False  # set when accel-patch added it to a Trainer on its own
        self.report = None
        self._first_log = True
        #: what this callback added to each training log, with its step: the figures are this
        #: run's measurements, so they go to the loggers, never into the saved `state.log_history`
        self.logged: list[dict] = []
        self._hook = None
        self._tokens = None  # a device tensor: counting never syncs
        self._mark = None  # (time, step, tokens) at the last log
        self._calls_seen = {}  # (op, outcome) -> calls at the last log
        self._warned = set()  # (op, outcome) fall-backs warned about, and other once-only notes
        self._sync_every = None  # None: automatic; 0: off
        self._sync_mode = "warn"
        self._sync_next = None  # the step of the next scheduled check (after the first log's)
        self._sync_last = None  # the last RankSync
        self._sync_logged = None  # the RankSync to put in the next log
        self._step_clock = None  # (time, step) at the last step end, for the automatic interval
        self._step_s = None  # mean step time since the last check, the checks' own time left out
        self._off = set()  # parts that raised once: off for the rest of the run

    # --- guarding the host ----------------------------------------------------------------------
    def _guarded(self, part: str, work, *args, **kwargs):
        """`work(*args, **kwargs)`, or None when `part` is off or raises (logged once, then off)."""
        if part in self._off:
            return None
        try:
            return work(*args, **kwargs)
        except RunStopped:
            raise
        except Exception as exc:  # the user's training must go on
            self._off.add(part)
            log.warning("accel_patch: the callback's %s failed and is off for this run (training goes on): %s: %s",
                        part, type(exc).__name__, exc)
            return None

    def _module(self, model, part: str):
        """`model` when it is a torch.nn.Module, else None (said once per part and kind)."""
        if model is None or isinstance(model, torch.nn.Module):
            return model
        if ("not a module", part) not in self._warned:
            self._warned.add(("not a module", part))
            log.warning("accel_patch: the Trainer handed the callback a %s as its model, not a torch.nn.Module: "
                        "no %s for it", type(model).__name__, part)
        return None

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
            if already and self.ops is not None:
                _warn_ops_kept(unwrap(model).__dict__[STATE_ATTR].ops, self.ops)
            if prepared and not already and self.report.new:
                log.warning("accel_patch: kernels swapped at on_train_begin, after the model was prepared: the "
                            "modules' kernels only; the fused loss needs the swap before preparation (build the "
                            "model before the Trainer, or let the Trainer see it at construction)")
        except Exception as exc:  # the user's training must go on
            log.warning("accel_patch: swapping kernels in the Trainer failed, training runs stock: %s: %s",
                        type(exc).__name__, exc)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._guarded(SWAP, self._swap, self._module(model, "kernel swap"), prepared=False)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._guarded(SWAP, self._swap, self._module(model, "kernel swap"), prepared=True)
        self._guarded(RANK_SYNC, self._start_sync, state)
        if self.metrics:
            self._guarded(METRICS, self._start_metrics, args, state, model)

    def _start_sync(self, state) -> None:
        try:
            self._sync_every, self._sync_mode = rank_sync.sync_every(), rank_sync.sync_mode()
        except ValueError as exc:  # a safety switch: never run silently without the guard
            if _distributed():
                raise RunStopped(f"accel_patch: {exc}; the run stops here rather than train its ranks "
                                 f"unchecked") from None
            self._sync_every, self._sync_mode = 0, "warn"
            if "bad sync setting" not in self._warned:
                self._warned.add("bad sync setting")
                log.warning("accel_patch: %s; one process here, so the rank-sync check never runs and training "
                            "goes on (with several processes the run would stop)", exc)
        self._sync_next, self._sync_last, self._sync_logged = None, None, None
        self._step_clock, self._step_s = (time.perf_counter(), state.global_step), None

    def _start_metrics(self, args, state, model) -> None:
        module = self._module(model, "token count")
        if module is not None and args.include_num_input_tokens_seen in ("no", False, None):
            self._hook = module.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        self._reset_peak_memory()
        self._mark = (time.perf_counter(), state.global_step, 0.0)

    def on_train_end(self, args, state, control, **kwargs):
        self._guarded(METRICS, self._stop_counting)

    def _stop_counting(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # --- metrics ----------------------------------------------------------------------------
    def _count_tokens(self, module, args, kwargs):
        # The tokens the step trains on: forwards that build a graph. A reference model's pass,
        # KTO's KL pass, GRPO's generation and old log-probs run under no_grad (or in eval mode).
        if not module.training or not torch.is_grad_enabled():
            return None
        n = step_tokens(kwargs, args)
        if n is None:
            return None
        n = n.detach().to(torch.float64)
        self._tokens = n if self._tokens is None else self._tokens + n
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

    def _reset_peak_memory(self) -> None:
        """Start a new peak-memory window: the accelerator's peak counter, or on CPU the process's
        peak RSS (Linux: `/proc/self/clear_refs`), with the resident level now as its base."""
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            return
        self._rss_base = _reset_rss_peak()

    def _peak_memory_mib(self) -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            return peak
        base = getattr(self, "_rss_base", None)
        peak = _rss_kib("VmHWM") if base is not None else None
        if peak is not None:  # the window's peak over the level it started at; then a new window
            self._rss_base = _reset_rss_peak()
            return max(0.0, peak - base) / 1024
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no resettable peak: the lifetime peak
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB on Linux

    # --- rank sync --------------------------------------------------------------------------
    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._guarded(RANK_SYNC, self._step_end, state, self._module(model, "rank-sync check"))

    def _step_end(self, state, model) -> None:
        now = time.perf_counter()
        if self._step_clock is not None and state.global_step > self._step_clock[1]:
            per_step = (now - self._step_clock[0]) / (state.global_step - self._step_clock[1])
            self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        self._step_clock = (now, state.global_step)
        if self._sync_next is not None and self._sync_every != 0 and state.global_step >= self._sync_next:
            self._check_sync(model, state)

    def _check_sync(self, model, state) -> None:
        if model is None or (self._sync_last is not None and self._sync_last.step == state.global_step):
            return
        previous = self._sync_last.seconds if self._sync_last is not None else 0.0
        try:
            result = rank_sync.check_rank_sync(model, step=state.global_step, step_seconds=self._step_s,
                                               previous_seconds=previous)
        except Exception as exc:  # training goes on; the same failure on every rank skips the collective alike
            self._sync_every, self._sync_next = 0, None
            log.warning("accel_patch: the rank-sync check failed and is off for this run: %s: %s",
                        type(exc).__name__, exc)
            return
        self._sync_last = result
        if self._sync_logged is None or self._sync_logged.ok:  # a drift stays in the log until logged
            self._sync_logged = result
        every = self._sync_every if self._sync_every else result.every
        self._sync_next = state.global_step + every if every else None
        if result.sharded and "sharded" not in self._warned:
            self._warned.add("sharded")
            log.info("accel_patch: rank sync: %d trainable tensor(s) are sharded (FSDP, DeepSpeed ZeRO-3): "
                     "keeping them consistent is the engine's; the check compares the %d others",
                     result.sharded, result.tensors)
        if not result.ok:
            if self._sync_mode == "error":
                raise RunStopped(f"accel_patch: {result.message} ({rank_sync.MODE_VAR}=error)")
            # rank 0 of the group warns (under state NO every rank reads as the Trainer's process
            # zero); every rank keeps the value in its logs
            if _rank() == 0 and ("drift", result.ranks) not in self._warned:
                self._warned.add(("drift", result.ranks))
                log.warning("accel_patch: %s. Those ranks now train other weights than rank 0: check that "
                            "every process wraps the model for data parallelism (DDP, accelerate's prepare) "
                            "and runs the same collectives; %s=error stops the run here",
                            result.message, rank_sync.MODE_VAR)
        # the check's own time is not step time
        self._step_clock = (time.perf_counter(), state.global_step)

    def _rank_sync_value(self, model, state) -> str | None:
        if self._sync_every == 0 or not _distributed():
            return None
        if self._sync_last is None:  # the first log: the first check
            self._check_sync(model, state)
        logged, self._sync_logged = self._sync_logged, None
        return logged.message if logged is not None else None

    # --- fall-backs -------------------------------------------------------------------------
    def _fallbacks_value(self, args, model, first: bool) -> str | None:
        from ..swaps.apply import unwrap
        from ..swaps.report import calls_snapshot, fallback_line, fallbacks_since
        from ..swaps.sites import STATE_ATTR

        if model is None:
            return None
        swap_state = unwrap(model).__dict__.get(STATE_ATTR)
        if swap_state is None:
            return None
        items = fallbacks_since(swap_state.calls, self._calls_seen)
        self._calls_seen = calls_snapshot(swap_state.calls)
        for op, outcome, n in items:
            if (op, outcome) not in self._warned:
                self._warned.add((op, outcome))
                log.warning("accel_patch: %d call(s) of the swapped %s ran another forward: %s "
                            "(counts per outcome: accel_patch.report(model).calls)", n, op, outcome)
        if items:
            return fallback_line(items)
        if first and _compiled(args, model):
            log.info("accel_patch: the model runs under torch.compile: the compiled graph decides which calls "
                     "are fused; calls are not counted per call there (LoRA sites: once per compiled graph, "
                     "as 'compiled: <outcome>')")
            return "not counted per call: under torch.compile the compiled graph decides"
        return None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not isinstance(logs, dict) or "loss" not in logs:
            return  # evaluation logs and the end-of-training summary carry their own figures
        model = kwargs.get("model")
        added = {}
        first, self._first_log = self._first_log, False
        if self.metrics and self._mark is not None:
            added.update(self._guarded(METRICS, self._metrics_values, args, state, model, first) or {})
        # what ran and whether the ranks agree: said whatever `metrics` asks
        # (the rank sync is a collective: every rank calls it at the same logs)
        sync = self._guarded(RANK_SYNC, self._rank_sync_value, self._module(model, "rank-sync check"), state)
        if sync is not None:
            added["accel_patch_rank_sync"] = sync
        fallbacks = self._guarded(FALLBACKS, self._fallbacks_value, args, self._module(model, "fall-back count"),
                                  first)
        if fallbacks is not None:
            added["accel_patch_fallbacks"] = fallbacks
        self._guarded(WRITE, self._write, logs, state, added)

    def _metrics_values(self, args, state, model, first: bool) -> dict:
        added = {}
        now, tokens = time.perf_counter(), self._tokens_seen(args, state)
        then, step, seen = self._mark
        self._mark = (now, state.global_step, tokens)
        added["peak_memory_mib"] = self._peak_memory_mib()
        if state.global_step > step and now > then:
            added["step_time_s"] = (now - then) / (state.global_step - step)
            rate = (tokens - seen) / (now - then)
            if math.isfinite(rate) and rate >= 0:
                added["tokens_per_second"] = rate
            elif "bad token count" not in self._warned:  # never a non-finite figure in report_to
                self._warned.add("bad token count")
                log.warning("accel_patch: the token count is not a finite count (%s): no tokens_per_second", rate)
        if first:
            added["accel_patch_swap"] = self._swap_line(self._module(model, "swap report"))
            added["accel_patch_topology"] = _topology_line()
        return added

    def _swap_line(self, model) -> str:
        from ..swaps.apply import report_of

        report = None
        if model is not None:
            try:
                report = report_of(model)  # as it stands now: adapters added since the swap, TRL's head
            except TypeError:
                report = None
        if report is None:
            report = self.report
        return report.short() if report is not None else "no kernels swapped"

    def _write(self, logs, state, added) -> None:
        if not added:
            return
        added = {k: fit(v) if isinstance(v, str) else v for k, v in added.items()}  # console-sized
        logs.update(added)  # what report_to integrations, the console printer and later callbacks get
        self.logged.append({"step": state.global_step, **added})


def training_logs(trainer) -> list[dict]:
    """The training logs of `trainer` as its loggers received them: each `state.log_history` entry
    with a loss, with what its AccelPatchCallback added at that step (`logged`)."""
    added = {}
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, AccelPatchCallback):
            added = {entry["step"]: entry for entry in cb.logged}
    return [{**h, **added.get(h.get("step"), {})} for h in trainer.state.log_history if "loss" in h]


class AutomaticCallback(AccelPatchCallback):
    """The AccelPatchCallback accel-patch gives every Trainer on its own (integrations/
    trainer_callbacks.py): in `transformers.trainer.DEFAULT_CALLBACKS`, where transformers keeps
    the callbacks every Trainer gets, so code that lists a Trainer's callbacks from that list
    finds it there. One the user passes replaces it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic = True


IGNORE_INDEX = -100  # transformers' and TRL's label for a position no loss is taken on


def step_tokens(kwargs: dict, args: tuple = ()) -> torch.Tensor | None:
    """The tokens one training forward trains on, as a 0-d tensor (None: nothing to count from).

    Token labels (as many dimensions as the inputs) count the positions not labelled -100
    (Trainer's own `num_items_in_batch`). Without them the attention mask counts: a 2-D mask of
    0/1 or of packed-sequence numbers 1, 2, 3 counts its non-zero positions; a 4-D mask (boolean,
    or additive 0 / finfo.min or -inf) counts the positions that may attend to themselves, so a
    padding row counts nothing. With neither, every input position.
    """
    ids = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(ids, torch.Tensor):
        ids = kwargs.get("inputs_embeds")
        ids = ids[..., 0] if isinstance(ids, torch.Tensor) else None
    labels = kwargs.get("labels")
    if isinstance(labels, torch.Tensor) and labels.dim() >= 2 and (ids is None or labels.shape == ids.shape):
        return labels.ne(IGNORE_INDEX).sum()
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        diagonal = mask.diagonal(dim1=-2, dim2=-1)[:, 0]  # (batch, query): may a position see itself
        if mask.dtype == torch.bool:
            return diagonal.sum()
        if mask.is_floating_point():  # additive: 0 where attended, a large negative where not
            return (diagonal > torch.finfo(mask.dtype).min / 2).sum()
        return diagonal.ne(0).sum()
    if isinstance(mask, torch.Tensor):
        return mask.ne(0).sum()
    if ids is not None:
        return torch.tensor(ids.numel(), device=ids.device)
    return None


def _rank() -> int:
    """This process's rank: the process group's, else the launcher's (0 without either)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from ..core.topology_resolver import topology

    try:
        return topology().rank
    except Exception:
        return 0


def _rss_kib(field: str) -> float | None:
    """A VmRSS/VmHWM figure of /proc/self/status in KiB, None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> float | None:
    """Reset the process's peak RSS to its resident size now (Linux >= 4.0: "5" to clear_refs);
    the resident size in KiB, or None where the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _rss_kib("VmRSS")


def _distributed() -> bool:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    from ..core.topology_resolver import topology

    try:
        return topology().world_size > 1  # several processes without a group: said in the log
    except Exception:
        return False


def _compiled(args, model) -> bool:
    return bool(getattr(args, "torch_compile", False)) or "_compiled_call_impl" in getattr(model, "__dict__", {}) \
        or hasattr(model, "_orig_mod")


def _warn_ops_kept(running, asked) -> None:
    """A model swapped before the Trainer (at load: `import accel_patch` swaps every model
    `from_pretrained` returns) keeps what it runs: a swap adds ops, never removes one, so the
    callback's `ops=` cannot narrow it. Said, with the ways to narrow it."""
    from ..swaps.ops import resolve_ops

    extra = sorted(set(running) - set(resolve_ops(asked)))
    if extra:
        log.warning("accel_patch: AccelPatchCallback(ops=%r): the model was swapped before the Trainer and "
                    "keeps %s (a swap adds ops, never removes one); to run only the ops asked for, set "
                    "ACCEL_PATCH_KERNELS before loading, or call accel_patch.restore_kernels(model) first",
                    asked, ", ".join(extra))


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
