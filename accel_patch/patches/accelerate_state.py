"""The distributed-aware patch of accelerate's `PartialState` (what it decides: core/accelerate_decision.py).

Target `accelerate.state.PartialState.__init__` and `._prepare_backend`, and
`AcceleratorState.__init__`, verified on accelerate 1.15. The decision is made at call time, from the topology resolved then, so one installed patch
is right under every launcher:

- single device: `_prepare_backend` gives `(None, NO)`, and LOCAL_RANK is hidden from `__init__`
  while it runs, since accelerate creates a process group whenever LOCAL_RANK is set, whatever
  `_prepare_backend` said;
- CPU distributed: `_prepare_backend` runs with `cpu=True`, accelerate's own gloo/MPI path; beside
  a process group that exists already (the script's own, or a second Trainer's rebuilt state) it
  runs with that group's backend, and accelerate's CPU path uses the group instead of creating one;
- MPI or SLURM with accelerators: the launcher's variables are exported first;
- FSDP requested by several processes without an accelerator: the CPU path as above, then the
  AcceleratorState built on it (MULTI_CPU, which accelerate turns into FSDP only for accelerators)
  gets `distributed_type` FSDP and its FSDP2 plugin, so `Accelerator.prepare` runs accelerate's
  FSDP2 (`fully_shard`) on gloo; an FSDP1 plugin there raises a one-line ValueError with the fix;
- everything else: accelerate's own code, untouched.

Undo: the registry puts back the three original functions from the classes' `__dict__`.
"""
from __future__ import annotations

import os
from _thread import _local

from ..core import registry
from ..core.accelerate_decision import (
    CPU_BACKENDS, CPU_DISTRIBUTED, CPU_FSDP, EXPORT_LAUNCHER_ENV, FSDP1_WITHOUT_ACCELERATOR, FSDP2, PATCH_NAME,
    SINGLE_DEVICE, decide, existing_group, fsdp_state,
)
from ..core.topology_resolver import Topology, TopologyError, scrub_blank_env, topology


_current = _local()  # the decision of the __init__ in progress, for _prepare_backend


class _Hidden:
    """Remove environment variables for the duration of a with-block, then put them back."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names, self.saved = names, {}

    def __enter__(self) -> None:
        self.saved = {n: os.environ.pop(n) for n in self.names if n in os.environ}

    def __exit__(self, *exc) -> None:
        os.environ.update(self.saved)


def _export_ranks(topo: Topology) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE from the topology, where unset (a value the
    launcher set is never overwritten)."""
    os.environ.setdefault("RANK", str(topo.rank))
    os.environ.setdefault("WORLD_SIZE", str(topo.world_size))
    os.environ.setdefault("LOCAL_RANK", str(topo.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(topo.local_world_size))


def _export_launcher_env(topo: Topology) -> None:
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n, "").strip()]
    if missing:
        raise TopologyError(
            f"{topo.launcher} started {topo.world_size} processes but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: export the address and a free port of "
            f"rank 0 (e.g. MASTER_ADDR=node0 MASTER_PORT=29500) so the processes can form one group"
        )
    _require_ranks(topo)
    _export_ranks(topo)


def _require_ranks(topo: Topology) -> None:
    """Stop where no variable gives this process's rank (or its local rank, with several local
    accelerators): a guess exported would be every process's (rank 0 everywhere: no group forms)."""
    unknown = [(field, name) for field, name in (("rank", "RANK"), ("local_rank", "LOCAL_RANK"))
               if topo.defaulted(field) and (field == "rank" or topo.device_count > 1)]
    if unknown:
        raise TopologyError(
            f"{topo.launcher} gives world size {topo.world_size} but no variable gives this process's "
            f"{' or '.join(field.replace('_', ' ') for field, _ in unknown)}: set "
            f"{' and '.join(name for _, name in unknown)} in each process, or start them with a launcher "
            f"that does (torchrun, accelerate launch, srun, mpirun)")


def _export_cpu_env(topo: Topology) -> None:
    """Before accelerate's CPU distributed path creates the group: it reads the torch variables and
    MPI's, never SLURM's, and defaults MASTER_PORT only, so the topology's ranks are exported where
    unset (without them a SLURM step's ranks would each train alone), and MASTER_ADDR is 127.0.0.1
    where every process is known to be on this node. A run across nodes without MASTER_ADDR, or a
    rank no variable gives, stops here with the fix, before any state is built."""
    _require_ranks(topo)
    if not os.environ.get("MASTER_ADDR", "").strip():
        if topo.local_world_size == topo.world_size and not topo.defaulted("local_world_size"):
            os.environ["MASTER_ADDR"] = "127.0.0.1"  # every process on this node
        else:
            raise TopologyError(
                f"{topo.launcher} started {topo.world_size} processes, not all on this node as far as its "
                f"variables say, but MASTER_ADDR is not set: export the address of rank 0's node (e.g. "
                f"MASTER_ADDR=node0 MASTER_PORT=29500) so the processes can form one group")
    _export_ranks(topo)


def _export_group_env(topo: Topology) -> str | None:
    """Beside an existing process group: its backend, with RANK and WORLD_SIZE (and the local ones)
    exported from the topology where the launcher left them unset (a group made by hand), since
    accelerate's CPU path reads them."""
    group = existing_group()
    if group is None:
        return None
    _export_ranks(topo)
    return next(b for b in CPU_BACKENDS if b in group[1])


class AccelerateStatePatch(registry.Patch):
    name = PATCH_NAME
    module = "accelerate.state"
    target = "accelerate.state.PartialState.__init__ and ._prepare_backend, AcceleratorState.__init__"
    verified = "accelerate 1.15"
    switch = "ACCEL_PATCH_ACCELERATE"
    safety = True

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
        if not hasattr(module, "DistributedType") or not hasattr(module.DistributedType, "FSDP"):
            return "accelerate.state has no DistributedType.FSDP"
        state = getattr(module, "AcceleratorState", None)
        if state is None or "__init__" not in state.__dict__ or "_shared_state" not in state.__dict__:
            return f"accelerate.state.AcceleratorState changed shape (verified on {self.verified})"
        if "fsdp_plugin" not in inspect.signature(state.__dict__["__init__"]).parameters:
            return f"AcceleratorState.__init__ lost its fsdp_plugin argument (verified on {self.verified})"
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
            registry.require_switch(AccelerateStatePatch)  # a bad ACCEL_PATCH_ACCELERATE stops here
            scrub_blank_env()
            bound = init_signature.bind_partial(instance, *args, **kwargs)
            topo = topology()
            decision = decide(topo, cpu=bool(bound.arguments.get("cpu", False)))
            registry.record_decision(AccelerateStatePatch.name, decision)
            # status() says what was decided and why (DESIGN: "untouched, status says why").
            registry.set_state(AccelerateStatePatch.name, registry.ACTIVE,
                          f"patched {AccelerateStatePatch.target}; last decision: {decision.action}: {decision.reason}")
            if decision.action == EXPORT_LAUNCHER_ENV:
                _export_launcher_env(topo)
            if decision.action == CPU_DISTRIBUTED:
                _current.group_backend = _export_group_env(topo)
                if _current.group_backend is None:
                    _export_cpu_env(topo)
            if decision.action == FSDP1_WITHOUT_ACCELERATOR:
                raise ValueError(decision.reason)
            hide = ("LOCAL_RANK",) if decision.action == SINGLE_DEVICE else ()
            _current.decision = decision
            try:
                with _Hidden(hide):
                    return wrapped(*args, **kwargs)
            finally:
                _current.decision = _current.group_backend = None

        def prepare_backend_wrapper(wrapped, instance, args, kwargs):
            decision = getattr(_current, "decision", None)
            bound = backend_signature.bind_partial(instance, *args, **kwargs)
            if decision is None:  # called outside __init__: decide now
                scrub_blank_env()
                decision = decide(topology(), cpu=bool(bound.arguments.get("cpu", False)))
            if decision.action == SINGLE_DEVICE:
                return None, distributed_type.NO
            if decision.action in (CPU_DISTRIBUTED, CPU_FSDP):
                # accelerate's own CPU path picks MULTI_CPU and gloo (or MPI when asked and available);
                # beside an existing group, that group's backend
                bound.arguments["cpu"] = True
                backend = getattr(_current, "group_backend", None)
                if backend is not None and bound.arguments.get("backend") is None:
                    bound.arguments["backend"] = backend
                return wrapped(*bound.args[1:], **bound.kwargs)
            return wrapped(*args, **kwargs)

        state_cls = module.AcceleratorState
        state_signature = inspect.signature(state_cls.__dict__["__init__"])

        def accelerator_state_wrapper(wrapped, instance, args, kwargs):
            shared = state_cls._shared_state  # accelerate's own `initialized`, read before __init__ runs
            fresh = not (shared and shared != cls._shared_state)
            result = wrapped(*args, **kwargs)
            plugin = state_signature.bind_partial(instance, *args, **kwargs).arguments.get("fsdp_plugin")
            if (not fresh or plugin is None or getattr(instance, "fsdp_plugin", None) is plugin
                    or instance.distributed_type not in (distributed_type.MULTI_CPU, distributed_type.FSDP)):
                return result
            change = fsdp_state(registry.last_decision(AccelerateStatePatch.name),
                                getattr(plugin, "fsdp_version", 1), topology())
            if change is None:
                return result
            registry.record_decision(AccelerateStatePatch.name, change)
            registry.set_state(AccelerateStatePatch.name, registry.ACTIVE,
                               f"patched {AccelerateStatePatch.target}; last decision: {change.action}: {change.reason}")
            if change.action == FSDP1_WITHOUT_ACCELERATOR:
                state_cls._reset_state()  # no half-made state left for the next Accelerator
                raise ValueError(change.reason)
            if change.action == FSDP2:
                # What accelerate does for accelerators (AcceleratorState.__init__, MULTI_GPU branch).
                instance.distributed_type = distributed_type.FSDP
                if instance._mixed_precision != "no":
                    plugin.set_mixed_precision(instance._mixed_precision)
                instance.fsdp_plugin = plugin
                cls._shared_state["distributed_type"] = distributed_type.FSDP  # as accelerate's last line does
            return result

        self.wrap(cls, "__init__", init_wrapper)
        self.wrap(cls, "_prepare_backend", prepare_backend_wrapper)
        self.wrap(state_cls, "__init__", accelerator_state_wrapper)


patch = AccelerateStatePatch()
registry.register(patch)
