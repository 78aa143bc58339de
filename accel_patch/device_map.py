"""Per-rank device maps: where this process should load a model."""
from __future__ import annotations

import os

from .topology_resolver import Topology, TopologyError, topology


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
