"""The model-loading patch: quantized and distributed loads land on this rank's own device.

Target `transformers.PreTrainedModel.from_pretrained`, verified on transformers 5.17 and 5.24.
When the load is quantized or the run is distributed, `device_map=None` or a strategy string
("auto", "balanced", "balanced_low_0", "sequential") is replaced by the rank's own map
(core/device_map.py decides: `{"": "cuda:<local rank>"}` and the like), so 4-bit and 8-bit
weights are placed on their rank's device at load and never moved afterwards; that device is made
the current one first where it is not device 0 (`_make_current`). An explicit dict
or device from the user is never touched, and a load under DeepSpeed ZeRO-3, FSDP or tensor
parallelism (core/device_map.py `sharding_engine`) is left exactly as written: those engines place
the weights themselves. Undo: the registry puts back the original classmethod.
"""
from __future__ import annotations

import os

from ..core import registry
from ..core.device_map import PATCH_NAME, choose_device_map, replaceable


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


def _make_current(device_map: dict) -> str | None:
    """Make the rank's device the current one before its load, where it is not device 0: what
    accelerate's state does for every process of a multi-device run, but only once it is created,
    and a training script loads its model first. Until then every process's current device is
    device 0, where anything the load does without naming a device (CUDA's context, a library's
    scratch buffer) lands: every rank of a node would open a context on the first GPU (not
    measured here: no GPU). Returns what was done, for the decision's record; None where nothing was."""
    device = device_map.get("") if len(device_map) == 1 else None
    kind, _, index = device.partition(":") if isinstance(device, str) else ("", "", "")
    if kind == "cpu" or not index.isdigit() or int(index) == 0:
        return None
    import torch

    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu, torch.npu...
    if module is None or not hasattr(module, "set_device") or not module.is_available():
        return None
    module.set_device(int(index))
    return f"current device set to {device} for the load"


class ModelLoadingPatch(registry.Patch):
    name = PATCH_NAME
    module = "transformers.modeling_utils"
    target = "transformers.PreTrainedModel.from_pretrained"
    verified = "transformers 5.17, 5.24"
    switch = "ACCEL_PATCH_DEVICE_MAP"
    safety = True

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
            registry.require_switch(ModelLoadingPatch)  # a bad ACCEL_PATCH_DEVICE_MAP stops the load here
            pretrained = args[0] if args else kwargs.get("pretrained_model_name_or_path")
            requested = kwargs.get("device_map")
            # An explicit map is kept whatever the load: skip reading the checkpoint's config then.
            quantized = replaceable(requested) and _is_quantized(pretrained, kwargs)
            decision = choose_device_map(requested, quantized, kwargs)
            if decision.used is not decision.requested:
                kwargs = dict(kwargs, device_map=decision.used)
                made = _make_current(decision.used)
                if made:
                    decision = decision._replace(reason=f"{decision.reason}; {made}")
            registry.record_decision(ModelLoadingPatch.name, decision)
            return wrapped(*args, **kwargs)

        self.wrap(module.PreTrainedModel, "from_pretrained", from_pretrained_wrapper)


patch = ModelLoadingPatch()
registry.register(patch)
