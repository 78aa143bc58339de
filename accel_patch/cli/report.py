"""The report `accel-patch env` prints and `accel-patch check` reads: versions, topology with its
sources, the decisions this process would get, the config entry and `status()`.
"""
from __future__ import annotations

import os
import platform
from importlib import metadata

from .. import status
from ..core.accelerate_decision import decide
from ..core.device_map import prepare_device_map, sharding_engine
from ..core.topology_resolver import scrub_blank_env, topology
from ..integrations import config_entry

DISTRIBUTIONS = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "triton", "trl", "accel-patch")
FIELDS = ("world_size", "rank", "local_rank", "local_world_size", "num_nodes")


def versions() -> dict[str, str]:
    """Installed versions, read from package metadata (nothing is imported)."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def bad_names(environ):
    from ..swaps.ops import bad_names as check

    return check(environ)


def env_report() -> dict:
    """Everything `accel-patch env` shows. Raises TopologyError for a bad launcher variable."""
    environ = dict(os.environ)
    topo = topology(environ)  # before scrubbing: its sources name the variables set but blank
    scrub_blank_env(environ)  # blank means unset, as at decision time
    decision = decide(topo, environ=environ)
    device_map, distributed = prepare_device_map(topo)
    engine = sharding_engine(environ=environ)
    return {
        "versions": versions(),
        "topology": {
            "launcher": topo.launcher,
            **{name: getattr(topo, name) for name in FIELDS},
            "device_type": topo.device_type,
            "device_count": topo.device_count,
            "single_device": topo.single_device,
            "sources": dict(topo.sources),
        },
        "accelerate_state": {"action": decision.action, "reason": decision.reason},
        "device_map": device_map,
        "is_distributed": distributed,
        # A sharding engine places the weights itself: the load hook then leaves from_pretrained alone.
        "load": {"engine": engine, "reason": (
            f"{engine} places the weights itself: from_pretrained untouched" if engine else
            "no sharding engine requested: quantized or distributed loads get the device map above")},
        "config_entry": config_entry.describe(),
        "kernel_list_problem": bad_names(environ),
        # After decide(): it imports accelerate, so the accelerate patch shows as it will bind.
        "status": [
            {"name": s.name, "state": s.state, "reason": s.reason, "target": s.target, "verified": s.verified}
            for s in status()
        ],
    }
