"""Resolve the run's topology: how many processes, which one this is, and what devices it sees.

The module is `topology_resolver` and the function `accel_patch.topology()`, so that a dotted
path means one thing (`mock.patch("accel_patch.topology_resolver.x")` patches this module).

One resolver, read when a decision is made (never cached at import: launchers such as
notebook_launcher set the environment after the user's imports). Importing this module is cheap;
torch is imported only when the accelerator count is needed.

Rules (why: docs/distributed.md):
- An initialized torch.distributed group wins over every variable.
- Otherwise the first launcher whose variables are present: DeepSpeed, torchrun/accelerate,
  Open MPI, MVAPICH, Intel MPI/MPICH Hydra (PMI), SLURM step. SLURM_NTASKS alone is not trusted:
  sbatch exports it to the one-process batch script; only a step (srun) sets SLURM_STEP_NUM_TASKS.
  A step's processes on this node: this node's entry (SLURM_NODEID) of SLURM_STEP_TASKS_PER_NODE,
  which differs between nodes where the tasks do not divide evenly.
  A field that launcher leaves unset comes from the next one whose world size agrees (WORLD_SIZE
  exported by hand before `srun python`: SLURM's rank and local rank; `srun --mpi=pmi2`: PMI's
  rank, SLURM's local rank), then from a lone local rank (PALS_LOCAL_RANKID, PMI_LOCAL_RANK).
- An empty or blank value means unset. Any other value must be a whole number >= 0, else
  TopologyError names the variable, its value and what is valid.
- `Topology.sources` says where every field came from: the variable's name, "default" (nothing
  set), "derived" (computed from other fields), "torch.distributed" (an initialized group) or
  "torch" (the device query). A variable that could have given the field but was set blank is
  named after it: "default (WORLD_SIZE set but blank: read as unset)".
"""
from __future__ import annotations

import os
import re
import sys
from collections import namedtuple
from types import MappingProxyType

__all__ = [
    "DEFAULT",
    "DERIVED",
    "LAUNCHER_VARIABLES",
    "PROCESS_GROUP",
    "TORCH",
    "Topology",
    "TopologyError",
    "local_accelerators",
    "scrub_blank_env",
    "topology",
]


class TopologyError(ValueError):
    """The launcher's variables do not describe a run that can start: a value that is not a whole
    number >= 0, a local rank with no device, or MASTER_ADDR/MASTER_PORT missing where needed."""


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
#: Local ranks some process managers set without the rest of a launcher's variables (Cray PALS;
#: PMI implementations that add a local rank), read only where nothing else gave one.
_LOCAL_RANK_VARIABLES = ("PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
_NODE_VARIABLES = ("GROUP_WORLD_SIZE", "CROSS_SIZE", "SLURM_STEP_NUM_NODES")  # first set one wins

#: Every variable the resolver reads as a number; blank values of these count as unset.
LAUNCHER_VARIABLES: tuple[str, ...] = tuple(
    dict.fromkeys(
        _TORCH_VARIABLES
        + tuple(v for spec in _LAUNCHERS for v in spec[2:] if v)
        + _OTHER_VARIABLES
        + _LOCAL_RANK_VARIABLES
    )
)

#: What `Topology.sources` says for a field that no variable gave.
DEFAULT = "default"  # nothing set: the single-process value
DERIVED = "derived"  # computed from other fields (e.g. nodes = world size / processes per node)
PROCESS_GROUP = "torch.distributed"  # an initialized default process group
TORCH = "torch"  # torch's device query (device_type, device_count)

# field -> every variable that can give it, for naming the ones that were set but blank
_FIELD_VARIABLES = {
    "world_size": ("WORLD_SIZE", *(spec[2] for spec in _LAUNCHERS)),
    "rank": ("RANK", *(spec[3] for spec in _LAUNCHERS)),
    "local_rank": ("LOCAL_RANK", *(spec[4] for spec in _LAUNCHERS), *_LOCAL_RANK_VARIABLES),
    "local_world_size": ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", *(spec[5] for spec in _LAUNCHERS if spec[5])),
    "num_nodes": _NODE_VARIABLES,
    # the markers that name a launcher (WORLD_SIZE, RANK, LOCAL_RANK are noted on their own fields)
    "launcher": ("CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", *(spec[1] for spec in _LAUNCHERS)),
}


_TOPOLOGY_FIELDS = (
    "world_size rank local_rank local_world_size num_nodes "
    "device_type "  # "cuda", "xpu", "npu", "mps" or "cpu"
    "device_count "  # accelerators this process can see; 0 when device_type is "cpu"
    "launcher "  # torchrun, accelerate, deepspeed, openmpi, mvapich, intel-mpi, slurm, env, torch.distributed, none
    "sources"  # field -> where its value came from (read-only mapping; see the module docstring)
)


# A frozen record; a namedtuple rather than a dataclass because `import accel_patch` must stay cheap.
class Topology(namedtuple("Topology", _TOPOLOGY_FIELDS, defaults=(MappingProxyType({}),))):
    """Where this process sits in the run. `device_count` is the accelerators it can see.

    `sources[field]` is the variable that gave the field, or DEFAULT, DERIVED, PROCESS_GROUP or
    TORCH; a note in parentheses follows when a variable for it was set but blank. A record built
    by hand has no sources.
    """

    __slots__ = ()

    @property
    def single_device(self) -> bool:
        """One process and at most one local accelerator: nothing to distribute."""
        return self.world_size <= 1 and self.device_count <= 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def defaulted(self, field: str) -> bool:
        """Whether nothing gave `field` (no variable, no process group): its value is the
        single-process default, a guess once the world size is above 1."""
        return self.sources.get(field, "").startswith(DEFAULT)

    def describe(self) -> str:
        where = f"{self.device_count} x {self.device_type}" if self.device_count else "cpu"
        return (
            f"world_size={self.world_size} rank={self.rank} local_rank={self.local_rank} "
            f"local_world_size={self.local_world_size} nodes={self.num_nodes} devices={where} "
            f"launcher={self.launcher}"
        )


def _blank(value: str | None) -> bool:
    return value is None or value.strip() == ""


#: Variables whose value -1 means unset: accelerate's own reading of LOCAL_RANK
#: (`int(os.environ.get("LOCAL_RANK", -1)) != -1`) and transformers' `local_rank` default, which
#: scripts export as they are.
UNSET_AS_MINUS_ONE = ("LOCAL_RANK",)


def _read_int(env: dict, name: str | None) -> int | None:
    """The variable as a whole number >= 0; None when absent or blank (or -1, for the variables of
    UNSET_AS_MINUS_ONE)."""
    if name is None:
        return None
    raw = env.get(name)
    if _blank(raw):
        return None
    text = raw.strip()
    if text == "-1" and name in UNSET_AS_MINUS_ONE:
        return None
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is True, but int() rejects it
        raise TopologyError(
            f"{name}={raw!r} is not a valid process count or index: it must be a whole number >= 0 "
            f"(for example {name}=0 or {name}=2), or unset"
        )
    return int(text)


#: A SLURM step's tasks on each of its nodes, in node order: "2(x3),1" is 2, 2, 2, 1.
SLURM_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"


def _slurm_tasks_per_node(env: dict) -> list[int] | None:
    """SLURM_STEP_TASKS_PER_NODE as one count per node, in node order; None when unset or blank.
    A step whose tasks do not divide evenly over its nodes (7 on 2: "4,3") has no single per-node
    count: world size / nodes would give each node 3. TopologyError names a value not of this form."""
    raw = env.get(SLURM_TASKS_PER_NODE)
    if _blank(raw):
        return None
    counts = []
    for part in raw.strip().split(","):
        match = _TASKS_PART.fullmatch(part.strip())
        if match is None:
            raise TopologyError(
                f"{SLURM_TASKS_PER_NODE}={raw!r} is not a list of tasks per node: it must read like "
                f"'4' or '2(x3),1' (2 tasks on each of 3 nodes, then 1), or be unset")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


_TASKS_PART = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?", re.ASCII)


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

    Imports torch. A CPU-only process returns ("cpu", 0). CUDA's devices are counted through NVML
    (`torch.cuda.device_count()`), never `torch.cuda.is_available()`, whose CUDA runtime query makes
    every later fork fail to use CUDA: a notebook that loads a model before `notebook_launcher`
    forks its workers would have them fail ("Cannot re-initialize CUDA in forked subprocess").
    accelerate counts the same way.
    """
    import torch

    try:
        count = torch.cuda.device_count()
    except Exception:  # a broken driver or NVML: as is_available() would say, no CUDA device
        count = 0
    if count > 0:
        return "cuda", count
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


# What `accelerate launch` sets in every process it starts, on each of its paths (multi-GPU,
# DeepSpeed, FSDP, one process)
_ACCELERATE_LAUNCH_MARKERS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_DEEPSPEED")


def _detect_torch_launcher(env: dict) -> tuple[str, str]:
    """(launcher, the variable that identified it) for a run that set the torch variables."""
    for name in ("CROSS_RANK", "CROSS_SIZE"):
        if not _blank(env.get(name)):
            return "deepspeed", name
    for name in _ACCELERATE_LAUNCH_MARKERS:  # not any ACCELERATE_*: frameworks set ACCELERATE_LOG_LEVEL under torchrun
        if not _blank(env.get(name)):
            return "accelerate", name
    for name in sorted(env):
        if name.startswith("TORCHELASTIC_"):
            return "torchrun", name
    if not _blank(env.get("GROUP_RANK")):
        return "torchrun", "GROUP_RANK"
    # Set by hand (or by a launcher we do not know): name the variable that was read first.
    return "env", next(n for n in ("WORLD_SIZE", "LOCAL_RANK", "RANK") if not _blank(env.get(n)))


def _fill_from_other_launchers(values: dict, launcher: str, found: dict, sources: dict) -> None:
    """Fields the chosen launcher left unset, from another launcher's variables that describe the
    same run (the same world size): a batch script that exports WORLD_SIZE before `srun python`
    (SLURM_PROCID, SLURM_LOCALID), `srun --mpi=pmi2` (PMI_RANK and PMI_SIZE, no MPI_LOCALRANKID:
    SLURM_LOCALID). Without them every process would read rank 0 and local rank 0. Then a process
    manager's lone local rank (`_LOCAL_RANK_VARIABLES`)."""
    for name, marker, v_world, v_rank, v_local, v_local_world in _LAUNCHERS:
        if name == launcher or values[marker] is None:
            continue
        if "world_size" in found and values[v_world] != found["world_size"]:
            continue
        for field, var in (("world_size", v_world), ("rank", v_rank), ("local_rank", v_local),
                           ("local_world_size", v_local_world)):
            if field not in found and var and values[var] is not None:
                found[field], sources[field] = values[var], var
    if "local_rank" not in found and found.get("world_size", 1) > 1:
        for var in _LOCAL_RANK_VARIABLES:
            if values[var] is not None:
                found["local_rank"], sources["local_rank"] = values[var], var
                break


def topology(environ: dict | None = None) -> Topology:
    """Resolve the topology now, from an initialized process group or the launcher's variables.

    Every field's source is recorded in `sources` (see `Topology`). Raises TopologyError when a
    launcher variable holds something other than a whole number >= 0.
    """
    env = os.environ if environ is None else environ
    # Validate every variable we might read, so a bad value is never silently ignored.
    values = {name: _read_int(env, name) for name in LAUNCHER_VARIABLES}

    # field -> the variable the chosen launcher gives it (None: that launcher has none)
    read: dict[str, str | None] = {}
    launcher, launcher_source = "none", DEFAULT
    if any(values[name] is not None for name in ("WORLD_SIZE", "LOCAL_RANK", "RANK")):
        launcher, launcher_source = _detect_torch_launcher(env)
        read = dict(world_size="WORLD_SIZE", rank="RANK", local_rank="LOCAL_RANK",
                    local_world_size="LOCAL_WORLD_SIZE" if values["LOCAL_WORLD_SIZE"] is not None else "LOCAL_SIZE")
    else:
        for name, marker, v_world, v_rank, v_local, v_local_world in _LAUNCHERS:
            if values[marker] is not None:
                launcher, launcher_source = name, marker
                read = dict(world_size=v_world, rank=v_rank, local_rank=v_local, local_world_size=v_local_world)
                break
    sources = {field: var for field, var in read.items() if var and values[var] is not None}
    found = {field: values[var] for field, var in sources.items()}
    _fill_from_other_launchers(values, launcher, found, sources)

    group = _initialized_group()
    if group is not None:
        found["world_size"], found["rank"] = group
        sources.update(world_size=PROCESS_GROUP, rank=PROCESS_GROUP)
        if launcher == "none":
            launcher, launcher_source = PROCESS_GROUP, PROCESS_GROUP

    def derived(*fields: str) -> str:
        """DERIVED, or DEFAULT when every field it is computed from is itself a default."""
        return DERIVED if any(sources[f] != DEFAULT for f in fields) else DEFAULT

    world = found.get("world_size", 1)
    sources.setdefault("world_size", DEFAULT)
    rank = found.get("rank", 0)
    sources.setdefault("rank", DEFAULT)
    if "local_rank" in found:
        local_rank = found["local_rank"]
    elif world <= 1:  # one process: its local rank is its rank
        local_rank, sources["local_rank"] = rank, derived("rank")
    else:
        local_rank, sources["local_rank"] = 0, DEFAULT
    local_world = found.get("local_world_size")
    if local_world is None and launcher in ("none", PROCESS_GROUP):  # every process on this node
        local_world, sources["local_world_size"] = world, derived("world_size")
    # A SLURM step (or a run that exported WORLD_SIZE before srun) lists its tasks per node: this
    # node's own count, which differs between nodes where the tasks do not divide evenly.
    per_node = _slurm_tasks_per_node(env)
    if not (per_node and sum(per_node) == world == values["SLURM_STEP_NUM_TASKS"]):
        per_node = None
    node = values["SLURM_NODEID"]
    if local_world is None and per_node and node is not None and node < len(per_node):
        local_world, sources["local_world_size"] = per_node[node], SLURM_TASKS_PER_NODE

    for name in _NODE_VARIABLES:
        if values[name]:
            num_nodes, sources["num_nodes"] = values[name], name
            break
    else:
        if per_node:
            num_nodes, sources["num_nodes"] = len(per_node), SLURM_TASKS_PER_NODE
        elif local_world:
            num_nodes, sources["num_nodes"] = max(1, -(-world // local_world)), derived("world_size", "local_world_size")
        else:
            num_nodes, sources["num_nodes"] = 1, DEFAULT
    if local_world is None:
        local_world, sources["local_world_size"] = max(1, world // num_nodes), derived("world_size", "num_nodes")

    device_type, device_count = local_accelerators()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    device_source = TORCH if visible is None else f"{TORCH} (CUDA_VISIBLE_DEVICES={visible!r})"
    sources.update(launcher=launcher_source, device_type=device_source, device_count=device_source)

    blank = {name for name in LAUNCHER_VARIABLES if name in env and _blank(env[name])}
    for field, names in _FIELD_VARIABLES.items():
        unset = [name for name in names if name in blank]
        if unset:
            sources[field] += f" ({', '.join(unset)} set but blank: read as unset)"

    return Topology(
        world_size=world,
        rank=rank,
        local_rank=local_rank,
        local_world_size=local_world,
        num_nodes=num_nodes,
        device_type=device_type,
        device_count=device_count,
        launcher=launcher,
        sources=MappingProxyType({field: sources[field] for field in Topology._fields if field != "sources"}),
    )
