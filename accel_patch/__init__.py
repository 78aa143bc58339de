"""accel-patch: right distributed set-up on one device, many GPUs or many nodes, per-rank device
maps for quantized models, and verified Triton kernels, with no change to the training script.

`import accel_patch` registers post-import hooks and returns: it imports neither torch,
transformers nor accelerate. Each patch binds when its target module is imported (at once if it
already is). `ACCEL_PATCH_DISABLE=1` (or true/yes/on) turns everything off; `ACCEL_PATCH_ACCELERATE=0` and
`ACCEL_PATCH_DEVICE_MAP=0` turn off one patch each.

The package is laid out in rooms by role; imports run one way, downward:

    cli/            the face: the `accel-patch` command (env, check, config, demo)
    integrations/   ways in: the Trainer callback and its registration, the config entry, start-up
    patches/        one module per wrapped library target
    swaps/          kernels into model instances
    core/           decides and wraps nothing: topology, the patch registry, decisions, device maps

cli/ may import every room below it; integrations/ and patches/ import swaps/ and core/ (never
each other); swaps/ imports core/ at most; core/ imports no room. accel_kernels (the kernel
library) imports nothing of accel_patch. tests/test_layout.py checks these rules on the source.
"""
from __future__ import annotations

import os

# Each registers its patch; status() lists them in this order.
from .patches import accelerate_state, model_loading, kernels_at_load, trl_fused_head, experts_interface  # noqa: F401, I001
from .integrations import trainer_callbacks  # noqa: F401, I001
from .core.device_map import prepare_device_map
from .core.registry import DISABLED, PatchStatus, disable, enable, status
from .core.topology_resolver import Topology, TopologyError, topology
from .swaps import SwapReport, restore_kernels, swap_kernels

__version__ = "0.1.0"

__all__ = [
    "AccelPatchCallback",
    "PatchStatus",
    "SwapReport",
    "Topology",
    "TopologyError",
    "check_rank_sync",
    "disable",
    "enable",
    "prepare_device_map",
    "report",
    "restore_kernels",
    "status",
    "swap_kernels",
    "topology",
]


def report(model):
    """The live `SwapReport` of `model` (a transformers model, under PEFT, DDP or torch.compile
    wrappers too) swapped by the Trainer callback, the load hook or `swap_kernels`; None for a model
    never swapped. Its `calls` count every call of the ops decided per call (the fused loss, fused
    LoRA) by outcome, as the model runs: `print(accel_patch.report(model))` shows what really ran."""
    from .swaps.apply import report_of

    return report_of(model)


def check_rank_sync(model, step=None, group=None):
    """Compare the trainable parameters every rank holds whole across ranks (one collective: call it
    on every rank at the same point of a hand-written loop) and return a `RankSync`: `.ok` is False
    on drift, `str()` is one line, "in sync (...)" or "DRIFT: rank(s) 1 differ from rank 0 at step
    40: ...". See accel_patch/core/rank_sync.py for what is compared and why equal ranks never alarm."""
    from .core.rank_sync import check_rank_sync as check

    return check(model, step, group)


def __getattr__(name: str):
    # AccelPatchCallback subclasses transformers' TrainerCallback: imported on first use only, so
    # that `import accel_patch` stays free of transformers.
    if name == "AccelPatchCallback":
        from .integrations.callback import AccelPatchCallback

        return AccelPatchCallback
    raise AttributeError(f"module 'accel_patch' has no attribute {name!r}")


def _activate() -> None:
    from .core.switches import BadSwitch, read

    try:
        off, why = read("ACCEL_PATCH_DISABLE"), None
    except BadSwitch as exc:
        # the user reached for the off switch: stay off (never raise at import), and say so
        off, why = True, f"{exc}; accel-patch stays off until it is fixed"
        import logging

        logging.getLogger("accel_patch").warning("accel_patch: %s", why)
    if off:
        from .core import registry

        for record in registry.status():
            registry.set_state(record.name, DISABLED, why or f"turned off by ACCEL_PATCH_DISABLE={os.environ['ACCEL_PATCH_DISABLE']}")
        return
    enable()


_activate()
