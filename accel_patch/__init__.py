"""accel-patch: right distributed set-up on one device, many GPUs or many nodes, per-rank device
maps for quantized models, and verified Triton kernels, with no change to the training script.

`import accel_patch` registers post-import hooks and returns: it imports neither torch,
transformers nor accelerate. Each patch binds when its target module is imported (at once if it
already is). `ACCEL_PATCH_DISABLE=1` turns everything off; `ACCEL_PATCH_ACCELERATE=0` and
`ACCEL_PATCH_DEVICE_MAP=0` turn off one patch each.
"""
from __future__ import annotations

import os

from . import accelerate_state, model_loading  # noqa: F401  (each registers its patch)
from .device_map import prepare_device_map
from .patching import DISABLED, PatchStatus, disable, enable, status
from .topology_resolver import Topology, TopologyError, topology

__version__ = "0.1.0"

__all__ = [
    "PatchStatus",
    "Topology",
    "TopologyError",
    "disable",
    "enable",
    "prepare_device_map",
    "status",
    "topology",
]


def _activate() -> None:
    if os.environ.get("ACCEL_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        from . import patching

        for record in patching.status():
            patching._set(record.name, DISABLED, "turned off by ACCEL_PATCH_DISABLE=1")
        return
    enable()


_activate()
