"""accel-patch: right distributed set-up on one device, many GPUs or many nodes, per-rank device
maps for quantized models, and verified Triton kernels, with no change to the training script.

`import accel_patch` registers post-import hooks and returns: it imports neither torch,
transformers nor accelerate. Each patch binds when its target module is imported (at once if it
already is). `ACCEL_PATCH_DISABLE=1` turns everything off; `ACCEL_PATCH_ACCELERATE=0` and
`ACCEL_PATCH_DEVICE_MAP=0` turn off one patch each.
"""
from __future__ import annotations

import os

# Each registers its patch; status() lists them in this order.
from . import accelerate_state, model_loading, auto_swap, trainer_hook  # noqa: F401, I001
from .device_map import prepare_device_map
from .patching import DISABLED, PatchStatus, disable, enable, status
from .swaps import SwapReport, restore_kernels, swap_kernels
from .topology_resolver import Topology, TopologyError, topology

__version__ = "0.1.0"

__all__ = [
    "AccelPatchCallback",
    "PatchStatus",
    "SwapReport",
    "Topology",
    "TopologyError",
    "disable",
    "enable",
    "prepare_device_map",
    "restore_kernels",
    "status",
    "swap_kernels",
    "topology",
]


def __getattr__(name: str):
    # AccelPatchCallback subclasses transformers' TrainerCallback: imported on first use only, so
    # that `import accel_patch` stays free of transformers.
    if name == "AccelPatchCallback":
        from .callback import AccelPatchCallback

        return AccelPatchCallback
    raise AttributeError(f"module 'accel_patch' has no attribute {name!r}")


def _activate() -> None:
    if os.environ.get("ACCEL_PATCH_DISABLE", "").strip().lower() in ("1", "true", "yes"):
        from . import patching

        for record in patching.status():
            patching._set(record.name, DISABLED, "turned off by ACCEL_PATCH_DISABLE=1")
        return
    enable()


_activate()
