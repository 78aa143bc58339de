"""Per-rank device maps: where this process should load a model, and what a load's device_map becomes.

`prepare_device_map()` is the map for this process; `choose_device_map()` is the decision the
model-loading patch applies to one `from_pretrained` call (patches/model_loading.py wraps it).
"""
from __future__ import annotations

import os
from collections import namedtuple

from .topology_resolver import Topology, TopologyError, scrub_blank_env, topology

#: The registry name of the patch that applies `choose_device_map` to loads (patches/model_loading.py).
PATCH_NAME = "device-map"

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class LoadDecision(namedtuple("LoadDecision", "requested used reason")):
    """What the hook did to the last `from_pretrained` call's device_map."""

    __slots__ = ()


def prepare_device_map(topo: Topology | None = None) -> tuple[dict[str, str], bool]:
    """Return `(device_map, is_distributed)` for loading a model in this process.

    - world size > 1 with accelerators: `{"": "<type>:<i>"}`, i the local rank, or 0 when the
      process sees exactly one device (per-process CUDA_VISIBLE_DEVICES, torchrun
      --virtual-local-rank). Never the global rank. A local rank with no device is a TopologyError.
    - world size > 1 without accelerators: `{"": "cpu"}`.
    - one process: its first accelerator, else cpu.
    """
    topo = topology() if topo is None else topo
    if topo.device_count == 0:
        return {"": "cpu"}, topo.is_distributed
    if topo.device_type == "mps":
        return {"": "mps"}, topo.is_distributed
    if not topo.is_distributed or topo.device_count == 1:
        return {"": f"{topo.device_type}:0"}, topo.is_distributed
    if topo.local_rank >= topo.device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise TopologyError(
            f"LOCAL_RANK={topo.local_rank} has no device: this process sees {topo.device_count} "
            f"{topo.device_type} device(s) (CUDA_VISIBLE_DEVICES={visible!r}). Start at most "
            f"{topo.device_count} processes per node, or give each process its own device"
        )
    return {"": f"{topo.device_type}:{topo.local_rank}"}, True


def replaceable(requested) -> bool:
    """None or a strategy string: a device_map the hook may replace."""
    return requested is None or (isinstance(requested, str) and requested in STRATEGIES)


def choose_device_map(requested, quantized: bool) -> LoadDecision:
    """The device_map a load should use, given what the caller asked for. Resolves the topology."""
    if not replaceable(requested):
        return LoadDecision(requested, requested, "explicit device_map from the caller: kept")
    scrub_blank_env()
    topo = topology()
    if not (quantized or topo.is_distributed):
        return LoadDecision(requested, requested, "single process, not quantized: kept")
    if not topo.is_distributed and topo.device_count > 1 and requested is not None:
        return LoadDecision(requested, requested, f"one process over {topo.device_count} devices: kept")
    device_map, _ = prepare_device_map(topo)
    why = "quantized load" if quantized else "distributed load"
    return LoadDecision(requested, device_map, f"{why}, {topo.describe()}: {requested!r} -> {device_map}")
