"""The decision for accelerate's state: what a process under this topology should get.

Single device := world size <= 1 and at most one local accelerator. Decided from the topology
resolved at the moment accelerate creates its state (launchers such as notebook_launcher set the
environment after the user's imports):

- single device (also `torchrun --nproc_per_node=1`): state NO and no process group;
- world size > 1 with no accelerator and `cpu` unset: accelerate's CPU distributed path (gloo or
  MPI), where stock accelerate gives state NO beside a live process group and every rank trains
  alone;
- world size > 1 with accelerators, started by MPI or SLURM (no LOCAL_RANK): export RANK,
  WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE so that accelerate's own GPU path runs;
- any other world size > 1 (one GPU per node, per-process CUDA_VISIBLE_DEVICES, ...): accelerate's
  own set-up;
- FSDP requested with world size > 1 and no accelerator: accelerate's CPU distributed path (gloo),
  and the AcceleratorState built on it runs accelerate's FSDP2 (`fsdp_state`: FSDP2 runs on CPU
  with gloo). Stock accelerate gives state NO there (or, with `cpu=True`, DDP that ignores FSDP).
  FSDP1 there stops with a one-line error naming the fix: accelerate's FSDP1 needs an accelerator;
- a process group that exists before accelerate builds its state (the script's own, or the one
  of a state that TrainingArguments reset and rebuilds: a second Trainer), world size > 1: with
  accelerators, accelerate's own path (it uses the group); without, accelerate's CPU distributed
  path over that group when its backend runs on CPU (gloo, MPI), where stock accelerate gives
  state NO beside it; a group of one process, or of a backend that needs an accelerator, is left
  to accelerate;
- DeepSpeed or FSDP requested with accelerators, started by MPI or SLURM (no LOCAL_RANK): the
  launcher's variables are exported, as above, then accelerate's own set-up (its DeepSpeed and
  FSDP paths start only where LOCAL_RANK is set: without it every rank trains alone);
- DeepSpeed or FSDP requested otherwise, XLA or SageMaker: untouched.

Pure decision: nothing here wraps or changes accelerate (patches/accelerate_state.py applies it).
"""
from __future__ import annotations

import os
import sys
from collections import namedtuple

from .topology_resolver import Topology

#: The registry name of the patch that applies the decision (patches/accelerate_state.py) and
#: records the last one: `registry.last_decision(PATCH_NAME)`.
PATCH_NAME = "accelerate-state"

SINGLE_DEVICE = "single-device"
CPU_DISTRIBUTED = "cpu-distributed"
EXPORT_LAUNCHER_ENV = "export-launcher-env"
CPU_FSDP = "cpu-fsdp"  # the CPU distributed path, then accelerate's FSDP2 on it
FSDP1_WITHOUT_ACCELERATOR = "fsdp1-without-accelerator"  # stop: nothing accelerate has can run it
ACCELERATE = "accelerate"  # accelerate's own set-up, untouched
UNTOUCHED = "untouched"

#: What AcceleratorState becomes on the CPU distributed path when it is given an FSDP plugin.
FSDP2 = "fsdp2"

_TRUE = ("1", "true", "yes")


class Decision(namedtuple("Decision", "action reason")):
    """What the patch does with accelerate's state for this process, and why. `action` is one of
    single-device, cpu-distributed, export-launcher-env, accelerate, untouched."""

    __slots__ = ()


def _flag(env, name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


#: Backends of an existing process group that accelerate's CPU distributed path can run over.
CPU_BACKENDS = ("gloo", "mpi")


def existing_group():
    """(world size, backend) of a process group initialized before accelerate's state, else None.
    Reads torch only when the program imported it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    backend = str(torch.distributed.get_backend()).lower()
    if backend == "undefined" and hasattr(torch.distributed, "get_backend_config"):
        # a group made without naming a backend (torch picks one per device type): "cpu:gloo", or
        # "cpu:gloo,cuda:nccl"
        backend = str(torch.distributed.get_backend_config()).lower()
    return torch.distributed.get_world_size(), backend


def _xla_available() -> bool:
    try:
        from accelerate.utils import is_torch_xla_available
    except ImportError:
        return False
    return bool(is_torch_xla_available())


def decide(topo: Topology, *, cpu: bool = False, environ=None) -> Decision:
    """The decision for accelerate's state under topology `topo` (see the module docstring)."""
    env = os.environ if environ is None else environ
    group = existing_group()
    for flag, engine in (("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")):
        if not _flag(env, flag):
            continue
        if flag == "ACCELERATE_USE_FSDP" and topo.world_size > 1 and topo.device_count == 0 and group is None:
            return fsdp_without_accelerator(topo, env.get("FSDP_VERSION", "").strip() or None)
        if group is None and _launcher_without_local_rank(topo, env, cpu):
            # accelerate's DeepSpeed and FSDP paths on accelerators start only where LOCAL_RANK is
            # set; without it every rank would train alone
            return Decision(EXPORT_LAUNCHER_ENV, f"{engine} requested ({flag}) by world size {topo.world_size} "
                                                 f"from {topo.launcher}, which does not set LOCAL_RANK: exporting "
                                                 f"RANK/WORLD_SIZE/LOCAL_RANK, then accelerate's own set-up")
        return Decision(UNTOUCHED, f"{engine} requested ({flag}): accelerate's own set-up")
    if _flag(env, "ACCELERATE_USE_SAGEMAKER"):
        return Decision(UNTOUCHED, "SageMaker requested (ACCELERATE_USE_SAGEMAKER): accelerate's own set-up")
    if group is not None:
        return _over_existing_group(topo, group, cpu)
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
    if _launcher_without_local_rank(topo, env, cpu):
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


def _launcher_without_local_rank(topo: Topology, env, cpu: bool) -> bool:
    """Several processes on accelerators started by a launcher that leaves LOCAL_RANK unset (MPI,
    SLURM): accelerate's distributed paths need the torch variables exported."""
    return topo.world_size > 1 and topo.device_count > 0 and not cpu and not env.get("LOCAL_RANK", "").strip()


def _over_existing_group(topo: Topology, group, cpu: bool) -> Decision:
    """The decision beside a process group that exists already (`group`: its world size and backend)."""
    size, backend = group
    where = (f"a process group already exists ({backend}, {size} process{'es' if size != 1 else ''}: the "
             f"script's own, or the one a rebuilt state found)")
    if size > 1 and topo.device_count == 0 and not cpu and any(b in backend for b in CPU_BACKENDS):
        return Decision(CPU_DISTRIBUTED, f"{where}, no accelerator: accelerate's CPU distributed path over it "
                                         f"(stock accelerate would let every rank train alone beside it)")
    return Decision(UNTOUCHED, f"{where}: accelerate's own set-up uses it")


def _fsdp1_refusal(topo: Topology) -> str:
    return (f"FSDP1 cannot run on this machine: world size {topo.world_size} with no accelerator, and "
            f"accelerate's FSDP1 needs one; use FSDP2, which runs on CPU with gloo (accelerate launch "
            f"--use_fsdp --fsdp_version 2, or FullyShardedDataParallelPlugin(fsdp_version=2)), or drop "
            f"--use_fsdp for DDP")


def fsdp_without_accelerator(topo: Topology, version) -> Decision:
    """FSDP asked for by several processes on a machine without accelerators (`version`: FSDP_VERSION,
    None when unset: the plugin's own version then decides, in `fsdp_state`)."""
    if version == "1":
        return Decision(FSDP1_WITHOUT_ACCELERATOR, _fsdp1_refusal(topo))
    return Decision(
        CPU_FSDP,
        f"FSDP requested (ACCELERATE_USE_FSDP) by world size {topo.world_size} with no accelerator: "
        f"accelerate's CPU distributed path (gloo), then its FSDP2 on it (stock accelerate gives state "
        f"NO and every rank trains alone)",
    )


def fsdp_state(previous: Decision | None, fsdp_version, topo: Topology) -> Decision | None:
    """What an AcceleratorState built on the CPU distributed path does with an FSDP plugin of
    `fsdp_version` (None: no plugin). `previous`: the decision its PartialState was made by.

    FSDP2 when the plugin asks for version 2 (stock accelerate keeps MULTI_CPU: DDP, FSDP dropped
    without a word); FSDP1 is refused (Decision FSDP1_WITHOUT_ACCELERATOR, to raise); None: nothing
    to change (no plugin, or the state was not made by the CPU distributed path)."""
    if fsdp_version is None or previous is None or previous.action not in (CPU_DISTRIBUTED, CPU_FSDP, FSDP2):
        return None
    if topo.device_count:
        return None
    if int(fsdp_version) == 1:
        return Decision(FSDP1_WITHOUT_ACCELERATOR, _fsdp1_refusal(topo))
    return Decision(FSDP2, f"world size {topo.world_size} with no accelerator, FSDP plugin version "
                           f"{fsdp_version}: accelerate's FSDP2 on gloo (stock accelerate would run DDP "
                           f"or let every rank train alone)")
