"""Resolve the run's topology: how many processes, which one this is, and what devices it sees.

The module is `topology_resolver` and the function `accel_patch.topology()`, so that a dotted
path means one thing (`mock.patch("accel_patch.topology_resolver.x")` patches this module).

One resolver, read when a decision is made (never cached at import: launchers such as
notebook_launcher set the environment after the user's imports). Importing this module is cheap;
torch is imported only when the accelerator count is needed.

Rules (see docs/decisions.md):
- An initialized torch.distributed group wins over every variable.
- Otherwise the first launcher whose variables are present: DeepSpeed, torchrun/accelerate,
  Open MPI, MVAPICH, Intel MPI/MPICH Hydra (PMI), SLURM step. SLURM_NTASKS alone is not trusted:
  sbatch exports it to the one-process batch script; only a step (srun) sets SLURM_STEP_NUM_TASKS.
- An empty or blank value means unset. Any other value must be a whole number >= 0, else
  TopologyError names the variable, its value and what is valid.
"""
from __future__ import annotations

import os
import sys
from collections import namedtuple
from types import MappingProxyType

__all__ = [
    "LAUNCHER_VARIABLES",
    "Topology",
    "TopologyError",
    "local_accelerators",
    "scrub_blank_env",
    "topology",
]


class TopologyError(ValueError):
    """A launcher variable holds a value that is not a whole number >= 0."""


# (launcher, variable that identifies it, world size, rank, local rank, local world size)
_LAUNCHERS: tuple[tuple[str, str, str, str, str, str | None], ...] = (
    ("openmpi", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
     "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("intel-mpi", "PMI_SIZE", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID", None),
)
_TORCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
_OTHER_VARIABLES = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "SLURM_NODEID", "SLURM_STEP_NUM_NODES", "SLURM_NTASKS")

#: Every variable the resolver reads as a number; blank values of these count as unset.
LAUNCHER_VARIABLES: tuple[str, ...] = tuple(
    dict.fromkeys(
        _TORCH_VARIABLES
        + tuple(v for spec in _LAUNCHERS for v in spec[2:] if v)
        + _OTHER_VARIABLES
    )
)


_TOPOLOGY_FIELDS = (
    "world_size rank local_rank local_world_size num_nodes "
    "device_type "  # "cuda", "xpu", "npu", "mps" or "cpu"
    "device_count "  # accelerators this process can see; 0 when device_type is "cpu"
    "launcher "  # torchrun, accelerate, deepspeed, openmpi, mvapich, intel-mpi, slurm, env, torch.distributed, none
    "sources"  # field -> the variable it came from (read-only mapping)
)


# A frozen record; a namedtuple rather than a dataclass because `import accel_patch` must stay cheap.
class Topology(namedtuple("Topology", _TOPOLOGY_FIELDS, defaults=(MappingProxyType({}),))):
    """Where this process sits in the run. `device_count` is the accelerators it can see."""

    __slots__ = ()

    @property
    def single_device(self) -> bool:
        """One process and at most one local accelerator: nothing to distribute."""
        return self.world_size <= 1 and self.device_count <= 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        where = f"{self.device_count} x {self.device_type}" if self.device_count else "cpu"
        return (
            f"world_size={self.world_size} rank={self.rank} local_rank={self.local_rank} "
            f"local_world_size={self.local_world_size} nodes={self.num_nodes} devices={where} "
            f"launcher={self.launcher}"
        )


def _blank(value: str | None) -> bool:
    return value is None or value.strip() == ""


def _read_int(env: dict, name: str | None) -> int | None:
    """The variable as a whole number >= 0; None when absent or blank."""
    if name is None:
        return None
    raw = env.get(name)
    if _blank(raw):
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is True, but int() rejects it
        raise TopologyError(
            f"{name}={raw!r} is not a valid process count or index: it must be a whole number >= 0 "
            f"(for example {name}=0 or {name}=2), or unset"
        )
    return int(text)


def scrub_blank_env(environ: dict | None = None) -> list[str]:
    """Remove launcher variables whose value is empty or blank, so that accelerate and
    transformers (which parse them with int()) see them as unset. Returns the names removed."""
    env = os.environ if environ is None else environ
    removed = [name for name in LAUNCHER_VARIABLES if name in env and _blank(env[name])]
    for name in removed:
        del env[name]
    return removed


def local_accelerators() -> tuple[str, int]:
    """(device type, count) of the accelerators this process can see, CUDA_VISIBLE_DEVICES respected.

    Imports torch. A CPU-only process returns ("cpu", 0).
    """
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    for name in ("xpu", "npu", "mlu", "musa"):
        module = getattr(torch, name, None)
        try:
            if module is not None and module.is_available() and module.device_count() > 0:
                return name, module.device_count()
        except Exception:  # a half-installed backend must not break the resolver
            continue
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps", 1
    return "cpu", 0


def _initialized_group() -> tuple[int, int] | None:
    """(world size, rank) of an initialized default process group, without importing torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size(), dist.get_rank()


def _detect_torch_launcher(env: dict) -> str:
    if not _blank(env.get("CROSS_RANK")) or not _blank(env.get("CROSS_SIZE")):
        return "deepspeed"
    if any(k.startswith("ACCELERATE_") and k != "ACCELERATE_CONFIG_FILE" for k in env):
        return "accelerate"
    if any(k.startswith("TORCHELASTIC_") for k in env) or not _blank(env.get("GROUP_RANK")):
        return "torchrun"
    return "env"


def topology(environ: dict | None = None) -> Topology:
    """Resolve the topology now, from an initialized process group or the launcher's variables.

    Raises TopologyError when a launcher variable holds something other than a whole number >= 0.
    """
    env = os.environ if environ is None else environ
    sources: dict[str, str] = {}
    launcher = "none"
    world = rank = local_rank = local_world = None

    # Validate every variable we might read, so a bad value is never silently ignored.
    values = {name: _read_int(env, name) for name in LAUNCHER_VARIABLES}

    torch_world = values["WORLD_SIZE"]
    if torch_world is not None or values["LOCAL_RANK"] is not None or values["RANK"] is not None:
        launcher = _detect_torch_launcher(env)
        world, rank, local_rank = torch_world, values["RANK"], values["LOCAL_RANK"]
        local_world_var = "LOCAL_WORLD_SIZE" if values["LOCAL_WORLD_SIZE"] is not None else "LOCAL_SIZE"
        local_world = values[local_world_var]
        sources.update(world_size="WORLD_SIZE", rank="RANK", local_rank="LOCAL_RANK", local_world_size=local_world_var)
    else:
        for name, marker, v_world, v_rank, v_local, v_local_world in _LAUNCHERS:
            if values[marker] is None:
                continue
            launcher = name
            world, rank, local_rank = values[v_world], values[v_rank], values[v_local]
            local_world = values[v_local_world] if v_local_world else None
            sources.update(world_size=v_world, rank=v_rank, local_rank=v_local, local_world_size=v_local_world)
            break

    # Name only the variables that were set; the other fields are defaults.
    sources = {field: var for field, var in sources.items() if var and values[var] is not None}

    group = _initialized_group()
    if group is not None:
        world, rank = group
        sources.update(world_size="torch.distributed", rank="torch.distributed")
        if launcher == "none":
            launcher = "torch.distributed"

    world = world if world is not None else 1
    rank = rank if rank is not None else 0
    local_rank = local_rank if local_rank is not None else (rank if world <= 1 else 0)
    if local_world is None:
        local_world = world if launcher in ("none", "torch.distributed") else None
    num_nodes, nodes_var = _num_nodes(values, world, local_world)
    if nodes_var:
        sources["num_nodes"] = nodes_var
    if local_world is None:
        local_world = max(1, world // num_nodes)

    device_type, device_count = local_accelerators()
    return Topology(
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
        num_nodes=num_nodes,
        device_type=device_type,
        device_count=device_count,
        launcher=launcher,
        sources=MappingProxyType(sources),
    )


def _num_nodes(values: dict, world: int, local_world: int | None) -> tuple[int, str | None]:
    """The node count, and the variable it came from (None when derived)."""
    for name in ("GROUP_WORLD_SIZE", "CROSS_SIZE", "SLURM_STEP_NUM_NODES"):
        if values.get(name):
            return values[name], name
    if local_world:
        return max(1, -(-world // local_world)), None
    return 1, None
