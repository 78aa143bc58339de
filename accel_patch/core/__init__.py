"""The core: what decides, and wraps nothing.

    topology_resolver.py    the run as resolved now: `topology()`, `Topology`, `TopologyError`
    registry.py             the patch registry: `Patch`, the post-import finder, enable/disable,
                            `status()`, and the last decision each patch recorded
    accelerate_decision.py  what accelerate's state should be under a topology (`decide`)
    device_map.py           where this process loads a model (`prepare_device_map`) and what a
                            load's device_map becomes (`choose_device_map`)

The core imports no other room of accel_patch (patches, integrations, swaps, cli) and neither
torch, transformers nor accelerate at import time (a decision may look at them when it is made).
"""
