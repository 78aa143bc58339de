"""Per-rank device maps: where this process should load a model, and what a load's device_map becomes.

`prepare_device_map()` is the map for this process; `choose_device_map()` is the decision the
model-loading patch applies to one `from_pretrained` call (patches/model_loading.py wraps it).

Sharding engines place the weights themselves, so a load under one is left exactly as the caller
wrote it (`sharding_engine()` names the engine; the load decision and `accel-patch env` say so):

- DeepSpeed ZeRO-3: transformers' `is_deepspeed_zero3_enabled()` (an HfDeepSpeedConfig of stage 3
  exists, e.g. from TrainingArguments(deepspeed=...)), or accelerate's variables
  (ACCELERATE_USE_DEEPSPEED with ACCELERATE_DEEPSPEED_ZERO_STAGE=3). transformers rejects any
  device_map there ("DeepSpeed Zero-3 is not compatible with passing a `device_map`").
- FSDP (ACCELERATE_USE_FSDP), with RAM-efficient loading (FSDP_CPU_RAM_EFFICIENT_LOADING: rank 0's
  weights are the ones FSDP shards; transformers 5.25 still reads the checkpoint on every rank) or
  without (FSDP moves each shard). Also FSDP_CPU_RAM_EFFICIENT_LOADING set with
  ACCELERATE_USE_FSDP unset: a `TrainingArguments(fsdp=...)` built before the load sets it (and
  not ACCELERATE_USE_FSDP, which the Trainer's Accelerator sets later); and an Accelerator already
  built with an FSDP plugin. FSDP configured only after the load cannot be seen: build
  TrainingArguments first.
  A per-rank map would load the whole model on every rank's device: what FSDP exists to avoid.
  A 4-bit load under FSDP follows bitsandbytes' FSDP-QLoRA rule: FSDP shards the 4-bit weights
  only when `bnb_4bit_quant_storage` is the dtype of the model's other weights (`dtype`);
  the decision says whether this load meets it, and changes nothing.
- Tensor parallelism: `tp_plan`, `tp_size`, `device_mesh` or `distributed_config` in the call.
"""
from __future__ import annotations

import os
import sys
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


_TRUE = ("1", "true", "yes")
#: from_pretrained arguments that ask transformers for tensor parallelism (or its own distributed loader)
TP_ARGUMENTS = ("tp_plan", "tp_size", "device_mesh", "distributed_config")


def _flag(env, name: str) -> bool:
    return env.get(name, "").strip().lower() in _TRUE


def _zero3_in_transformers() -> bool:
    # The HfDeepSpeedConfig lives in this module: not imported means no ZeRO-3 config exists.
    module = sys.modules.get("transformers.integrations.deepspeed")
    check = getattr(module, "is_deepspeed_zero3_enabled", None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # a half-built config must not fail the load here: transformers will say
        return False


def _accelerator_fsdp_plugin():
    """The FSDP plugin of an AcceleratorState built already (`Accelerator(fsdp_plugin=...)` before
    the load), else None. Reads accelerate only when the program imported it."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    return shared.get("fsdp_plugin") if isinstance(shared, dict) else None


def sharding_engine(load_kwargs=None, environ=None) -> str | None:
    """The engine that places a load's weights itself, named with what requested it; None when no
    engine does (see the module docstring)."""
    env = os.environ if environ is None else environ
    kwargs = load_kwargs or {}
    if _zero3_in_transformers():
        return "DeepSpeed ZeRO-3 (transformers' is_deepspeed_zero3_enabled())"
    if _flag(env, "ACCELERATE_USE_DEEPSPEED") and env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "").strip() == "3":
        return "DeepSpeed ZeRO-3 (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE=3)"
    if _flag(env, "ACCELERATE_USE_FSDP"):
        how = ("RAM-efficient loading: rank 0 loads, FSDP shards" if _flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING")
               else "FSDP moves each rank's shard")
        return f"FSDP (ACCELERATE_USE_FSDP; {how})"
    if env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").strip() and not env.get("ACCELERATE_USE_FSDP", "").strip():
        # TrainingArguments(fsdp=...) sets this, and only this, when it is built (accelerate's FSDP
        # plugin sets ACCELERATE_USE_FSDP only later, inside the Trainer); ACCELERATE_USE_FSDP set
        # false is the user's "no FSDP" and wins
        return "FSDP (FSDP_CPU_RAM_EFFICIENT_LOADING set: TrainingArguments' fsdp, or accelerate's FSDP config)"
    plugin = _accelerator_fsdp_plugin()
    if plugin is not None:
        return f"FSDP (an Accelerator's FSDP plugin exists: {type(plugin).__name__})"
    given = [name for name in TP_ARGUMENTS if kwargs.get(name) is not None]
    if given:
        return f"tensor parallelism ({', '.join(given)} given)"
    return None


def _dtype_name(value) -> str | None:
    if value is None:
        return None
    name = str(value)
    return name[len("torch."):] if name.startswith("torch.") else name


def quant_storage_rule(load_kwargs) -> str:
    """bitsandbytes' FSDP-QLoRA rule, for a 4-bit load's arguments: FSDP shards 4-bit weights only
    when `bnb_4bit_quant_storage` is the dtype of the model's other weights. Says whether it holds."""
    kwargs = load_kwargs or {}
    config = kwargs.get("quantization_config")
    if isinstance(config, dict):
        four_bit, storage = config.get("load_in_4bit"), config.get("bnb_4bit_quant_storage")
    else:
        four_bit, storage = getattr(config, "load_in_4bit", None), getattr(config, "bnb_4bit_quant_storage", None)
    if not (four_bit or kwargs.get("load_in_4bit")):
        return "no bitsandbytes 4-bit config in the call: bnb_4bit_quant_storage not checked"
    storage = _dtype_name(storage) or "uint8"  # bitsandbytes' default storage
    dtype = _dtype_name(kwargs.get("dtype", kwargs.get("torch_dtype")))
    rule = "bitsandbytes' FSDP-QLoRA rule: bnb_4bit_quant_storage must be the dtype of the other weights"
    if dtype in (None, "auto"):
        return f"{rule}; here bnb_4bit_quant_storage={storage} and dtype={dtype or 'unset'}: pass dtype={storage} to be sure"
    if dtype == storage:
        return f"{rule}; here both are {storage}: met"
    return f"{rule}; here bnb_4bit_quant_storage={storage} but dtype={dtype}: not met, FSDP cannot shard these weights as one"


def choose_device_map(requested, quantized: bool, load_kwargs=None) -> LoadDecision:
    """The device_map a load should use, given what the caller asked for (`load_kwargs`: the rest of
    the `from_pretrained` call). Resolves the topology."""
    if not replaceable(requested):
        return LoadDecision(requested, requested, "explicit device_map from the caller: kept")
    engine = sharding_engine(load_kwargs)
    if engine is not None:
        why = f"{engine} places the weights itself: device_map {requested!r} kept, from_pretrained untouched"
        if quantized and engine.startswith("FSDP"):
            why += f"; quantized: {quant_storage_rule(load_kwargs)}"
        return LoadDecision(requested, requested, why)
    scrub_blank_env()
    topo = topology()
    if not (quantized or topo.is_distributed):
        return LoadDecision(requested, requested, "single process, not quantized: kept")
    if not topo.is_distributed and topo.device_count > 1 and requested is not None:
        return LoadDecision(requested, requested, f"one process over {topo.device_count} devices: kept")
    if topo.is_distributed and topo.device_count > 1 and topo.defaulted("local_rank"):
        return LoadDecision(requested, requested, f"world size {topo.world_size} but no variable gives this "
                                                  f"process's local rank (LOCAL_RANK, or its launcher's): "
                                                  f"{requested!r} kept rather than every process on device 0")
    device_map, _ = prepare_device_map(topo)
    why = "quantized load" if quantized else "distributed load"
    return LoadDecision(requested, device_map, f"{why}, {topo.describe()}: {requested!r} -> {device_map}")
