"""The distributed-aware patch of accelerate's `PartialState`.

Decided at call time, from the topology resolved then, so one installed patch is right under
every launcher:

- single device (world size <= 1, at most one local accelerator, e.g. `torchrun
  --nproc_per_node=1`): state NO and no process group. `_prepare_backend` gives `(None, NO)`, and
  LOCAL_RANK is hidden from `__init__` while it runs, since accelerate creates a process group
  whenever LOCAL_RANK is set, whatever `_prepare_backend` said.
- world size > 1 with no accelerator and `cpu` unset: accelerate's CPU distributed path (gloo or
  MPI). Stock accelerate gives state NO beside a live process group there: every rank trains
  alone and the weights drift apart.
- world size > 1 with accelerators, started by MPI or SLURM (no LOCAL_RANK): accelerate would not
  see the run at all; RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are exported from the
  resolved topology so that accelerate's own GPU path runs.
- any other world size > 1 (one GPU per node, per-process CUDA_VISIBLE_DEVICES, ...): accelerate's
  own set-up, untouched.
- DeepSpeed or FSDP requested, XLA, SageMaker, or a process group the user created: untouched.
"""
from __future__ import annotations

import os
import sys
from _thread import _local
from collections import namedtuple

from . import patching
from .topology_resolver import Topology, TopologyError, scrub_blank_env, topology

SINGLE_DEVICE = "single-device"
CPU_DISTRIBUTED = "cpu-distributed"
EXPORT_LAUNCHER_ENV = "export-launcher-env"
ACCELERATE = "accelerate"  # accelerate's own set-up, untouched
UNTOUCHED = "untouched"

_TRUE = ("1", "true", "yes")


class Decision(namedtuple("Decision", "action reason")):
    """What the patch does with accelerate's state for this process, and why. `action` is one of
    single-device, cpu-distributed, export-launcher-env, accelerate, untouched."""

    __slots__ = ()


def _flag(env, name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def _xla_available() -> bool:
    try:
        from accelerate.utils import is_torch_xla_available
    except ImportError:
        return False
    return bool(is_torch_xla_available())


def decide(topo: Topology, *, cpu: bool = False, environ=None) -> Decision:
    """The decision for accelerate's state under topology `topo` (see the module docstring)."""
    env = os.environ if environ is None else environ
    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return Decision(UNTOUCHED, "DeepSpeed requested (ACCELERATE_USE_DEEPSPEED): accelerate's own set-up")
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return Decision(UNTOUCHED, "FSDP requested (ACCELERATE_USE_FSDP): accelerate's own set-up")
    if _flag(env, "ACCELERATE_USE_SAGEMAKER"):
        return Decision(UNTOUCHED, "SageMaker requested (ACCELERATE_USE_SAGEMAKER): accelerate's own set-up")
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return Decision(UNTOUCHED, "a process group already exists (created before accelerate): left as it is")
    if _xla_available():
        return Decision(UNTOUCHED, "XLA is available: accelerate's own set-up")
    if topo.single_device:
        where = f"one {topo.device_type} device" if topo.device_count else "cpu"
        return Decision(SINGLE_DEVICE, f"world size {topo.world_size} on {where}: no process group, no DDP")
    if topo.world_size <= 1:
        return Decision(
            ACCELERATE,
            f"one process sees {topo.device_count} {topo.device_type} devices: accelerate's own set-up",
        )
    if topo.device_count == 0 and not cpu:
        return Decision(
            CPU_DISTRIBUTED,
            f"world size {topo.world_size} with no accelerator: accelerate's CPU distributed path "
            f"(stock accelerate would let every rank train alone)",
        )
    if topo.device_count > 0 and not cpu and not env.get("LOCAL_RANK", "").strip():  # blank is unset
        return Decision(
            EXPORT_LAUNCHER_ENV,
            f"world size {topo.world_size} from {topo.launcher}, which does not set LOCAL_RANK: "
            f"exporting RANK/WORLD_SIZE/LOCAL_RANK so accelerate's distributed path runs",
        )
    return Decision(
        ACCELERATE,
        f"world size {topo.world_size} ({topo.num_nodes} node(s), {topo.device_count} local "
        f"{topo.device_type} device(s)): accelerate's own distributed set-up",
    )


_current = _local()  # the decision of the __init__ in progress, for _prepare_backend


class _Hidden:
    """Remove environment variables for the duration of a with-block, then put them back."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.saved = names, {}

    def __enter__(self) -> None:
        self.saved = {n: os.environ.pop(n) for n in self.names if n in os.environ}

    def __exit__(self, *exc) -> None:
        os.environ.update(self.saved)


def _export_launcher_env(topo: Topology) -> None:
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n, "").strip()]
    if missing:
        raise TopologyError(
            f"{topo.launcher} started {topo.world_size} processes but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: export the address and a free port of "
            f"rank 0 (e.g. MASTER_ADDR=node0 MASTER_PORT=29500) so the processes can form one group"
        )
    os.environ.setdefault("RANK", str(topo.rank))
    os.environ.setdefault("WORLD_SIZE", str(topo.world_size))
    os.environ.setdefault("LOCAL_RANK", str(topo.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(topo.local_world_size))


class AccelerateStatePatch(patching.Patch):
    name = "accelerate-state"
    module = "accelerate.state"
    target = "accelerate.state.PartialState.__init__ and ._prepare_backend"
    verified = "accelerate 1.15"
    switch = "ACCEL_PATCH_ACCELERATE"

    last_decision: Decision | None = None

    def check(self, module) -> str | None:
        import inspect

        cls = getattr(module, "PartialState", None)
        if cls is None:
            return "accelerate.state has no PartialState"
        for attr in ("__init__", "_prepare_backend", "_shared_state"):
            if attr not in cls.__dict__:
                return f"PartialState.{attr} is gone (verified on {self.verified})"
        params = list(inspect.signature(cls.__dict__["_prepare_backend"]).parameters)
        if params[:4] != ["self", "cpu", "sagemaker_dp", "backend"]:
            return f"PartialState._prepare_backend{tuple(params)} changed shape (verified on {self.verified})"
        if "cpu" not in inspect.signature(cls.__dict__["__init__"]).parameters:
            return f"PartialState.__init__ lost its cpu argument (verified on {self.verified})"
        if not hasattr(module, "DistributedType"):
            return "accelerate.state has no DistributedType"
        return None

    def too_late(self, module) -> str | None:
        if module.PartialState._shared_state:
            return (
                "an accelerate state already existed when accel_patch bound; it was left as it is, "
                "and states created after it is reset are patched (import accel_patch before "
                "creating the Accelerator, Trainer or TrainingArguments)"
            )
        return None

    def install(self, module) -> None:
        import inspect

        cls = module.PartialState
        distributed_type = module.DistributedType
        init_signature = inspect.signature(cls.__dict__["__init__"])
        backend_signature = inspect.signature(cls.__dict__["_prepare_backend"])

        def init_wrapper(wrapped, instance, args, kwargs):
            if cls._shared_state:  # the state exists: accelerate reuses it, nothing to decide
                return wrapped(*args, **kwargs)
            scrub_blank_env()
            bound = init_signature.bind_partial(instance, *args, **kwargs)
            topo = topology()
            decision = decide(topo, cpu=bool(bound.arguments.get("cpu", False)))
            AccelerateStatePatch.last_decision = decision
            # status() says what was decided and why (DESIGN: "untouched, status says why").
            patching._set(AccelerateStatePatch.name, patching.ACTIVE,
                          f"patched {AccelerateStatePatch.target}; last decision: {decision.action}: {decision.reason}")
            if decision.action == EXPORT_LAUNCHER_ENV:
                _export_launcher_env(topo)
            hide = ("LOCAL_RANK",) if decision.action == SINGLE_DEVICE else ()
            _current.decision = decision
            try:
                with _Hidden(hide):
                    return wrapped(*args, **kwargs)
            finally:
                _current.decision = None

        def prepare_backend_wrapper(wrapped, instance, args, kwargs):
            decision = getattr(_current, "decision", None)
            bound = backend_signature.bind_partial(instance, *args, **kwargs)
            if decision is None:  # called outside __init__: decide now
                scrub_blank_env()
                decision = decide(topology(), cpu=bool(bound.arguments.get("cpu", False)))
            if decision.action == SINGLE_DEVICE:
                return None, distributed_type.NO
            if decision.action == CPU_DISTRIBUTED:
                # accelerate's own CPU path picks MULTI_CPU and gloo (or MPI when asked and available)
                bound.arguments["cpu"] = True
                return wrapped(*bound.args[1:], **bound.kwargs)
            return wrapped(*args, **kwargs)

        self.wrap(cls, "__init__", init_wrapper)
        self.wrap(cls, "_prepare_backend", prepare_backend_wrapper)


patch = AccelerateStatePatch()
patching.register(patch)
