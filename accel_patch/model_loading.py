"""The model-loading hook: quantized and distributed loads land on this rank's own device.

Wraps `transformers.PreTrainedModel.from_pretrained`. When the load is quantized or the run is
distributed, `device_map=None` or a strategy string ("auto", "balanced", "balanced_low_0",
"sequential") is replaced by `prepare_device_map()`: `{"": "cuda:<local rank>"}` and the like, so
4-bit and 8-bit weights are placed on their rank's device at load and never moved afterwards.
An explicit dict or device from the user is never touched. One process that sees several
accelerators keeps a strategy string: spreading a model over them is what it asked for.
"""
from __future__ import annotations

import os
from collections import namedtuple

from . import patching
from .device_map import prepare_device_map
from .topology_resolver import scrub_blank_env, topology

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


class LoadDecision(namedtuple("LoadDecision", "requested used reason")):
    """What the hook did to the last `from_pretrained` call's device_map."""

    __slots__ = ()


def _is_quantized(pretrained, kwargs) -> bool:
    if kwargs.get("quantization_config") is not None:
        return True
    if kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit"):
        return True
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return getattr(config, "quantization_config", None) is not None
    # A pre-quantized local checkpoint declares it in its config.json (hub checkpoints are not read
    # here: the hook never touches the network).
    path = config if config is not None else pretrained
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        import json

        try:
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                return "quantization_config" in json.load(f)
        except (OSError, ValueError):
            return False
    return False


def _replaceable(requested) -> bool:
    """None or a strategy string: a device_map the hook may replace."""
    return requested is None or (isinstance(requested, str) and requested in STRATEGIES)


def choose_device_map(requested, quantized: bool) -> LoadDecision:
    """The device_map a load should use, given what the caller asked for. Resolves the topology."""
    if not _replaceable(requested):
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


class ModelLoadingPatch(patching.Patch):
    name = "device-map"
    module = "transformers.modeling_utils"
    target = "transformers.PreTrainedModel.from_pretrained"
    verified = "transformers 5.17, 5.24"
    switch = "ACCEL_PATCH_DEVICE_MAP"

    last_load: LoadDecision | None = None

    def check(self, module) -> str | None:
        import inspect

        cls = getattr(module, "PreTrainedModel", None)
        if cls is None:
            return "transformers.modeling_utils has no PreTrainedModel"
        method = cls.__dict__.get("from_pretrained")
        if not isinstance(method, classmethod):
            return f"PreTrainedModel.from_pretrained is not a classmethod (verified on {self.verified})"
        params = inspect.signature(method.__func__).parameters
        if "pretrained_model_name_or_path" not in params or not any(
            p.kind is p.VAR_KEYWORD for p in params.values()
        ):
            return f"PreTrainedModel.from_pretrained changed shape (verified on {self.verified})"
        return None

    def install(self, module) -> None:
        def from_pretrained_wrapper(wrapped, instance, args, kwargs):
            pretrained = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            requested = kwargs.get("device_map")
            # An explicit map is kept whatever the load: skip reading the checkpoint's config then.
            quantized = _replaceable(requested) and _is_quantized(pretrained, kwargs)
            decision = choose_device_map(requested, quantized)
            ModelLoadingPatch.last_load = decision
            if decision.used is not decision.requested:
                kwargs = dict(kwargs, device_map=decision.used)
            return wrapped(*args, **kwargs)

        self.wrap(module.PreTrainedModel, "from_pretrained", from_pretrained_wrapper)


patch = ModelLoadingPatch()
patching.register(patch)
