"""The launcher variables a test must not inherit from the host (they would change the topology)."""
from __future__ import annotations


from accel_patch import topology_resolver

LAUNCHER_PREFIXES = (
    "TORCHELASTIC_", "ACCELERATE_", "OMPI_", "PMI_", "MV2_", "MPI_LOCAL", "SLURM_", "ACCEL_PATCH_", "FSDP_",
)
LAUNCHER_NAMES = frozenset(topology_resolver.LAUNCHER_VARIABLES) | {
    "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE",
}


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES)
