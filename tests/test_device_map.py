"""Per-rank device maps and the `from_pretrained` hook (DESIGN.md, "Per-rank device map").

Device counts are faked in-process (`fake_accelerators`: a CPU-only box until told otherwise).
The hook is tested through `LlamaForCausalLM.from_pretrained` with transformers' own
implementation replaced, under the hook, by a recorder (`transformers_side`): it records the
device_map transformers would receive and, unless told to load, loads nothing, so quantized loads
need no bitsandbytes run. The real loads are of a tiny Llama checkpoint on CPU, distributed
through the environment only (loading needs no process group).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import accel_patch
from accel_patch import TopologyError, prepare_device_map
from accel_patch.core import registry
from accel_patch.core.device_map import PATCH_NAME, STRATEGIES


@pytest.fixture(autouse=True)
def hook_bound(monkeypatch):
    monkeypatch.setitem(registry._decisions, PATCH_NAME, None)
    accel_patch.enable()  # idempotent; binds the hook if an earlier test left it off
    assert next(s for s in accel_patch.status() if s.name == "device-map").state == "active"


def set_env(monkeypatch, **env: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def torchrun(world: int, rank: int, local_rank: int, local_world: int, nodes: int = 1) -> dict[str, str]:
    return dict(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(local_world), GROUP_WORLD_SIZE=str(nodes), TORCHELASTIC_RUN_ID="none")


# id: (environment, device count, device kind, expected (device_map, is_distributed))
MAPS = {
    "torchrun-rank1-of-2-two-gpus": (torchrun(2, 1, 1, 2), 2, "cuda", ({"": "cuda:1"}, True)),
    "torchrun-rank5-of-8-eight-gpus": (torchrun(8, 5, 5, 8), 8, "cuda", ({"": "cuda:5"}, True)),
    # Global rank 5 is local rank 1 on its node: cuda:5 does not exist there.
    "rank5-local1-two-gpus": (torchrun(8, 5, 1, 2, nodes=4), 2, "cuda", ({"": "cuda:1"}, True)),
    "rank5-local1-eight-gpus": (torchrun(8, 5, 1, 2, nodes=4), 8, "cuda", ({"": "cuda:1"}, True)),
    "two-nodes-one-gpu-each": (torchrun(2, 1, 0, 1, nodes=2), 1, "cuda", ({"": "cuda:0"}, True)),
    # Per-process CUDA_VISIBLE_DEVICES (or torchrun --virtual-local-rank): the one device is index 0.
    "visible-devices-per-process": (dict(torchrun(2, 1, 1, 2), CUDA_VISIBLE_DEVICES="1"), 1, "cuda",
                                    ({"": "cuda:0"}, True)),
    "openmpi-local1": ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, 2, "cuda",
                       ({"": "cuda:1"}, True)),
    "slurm-step-local1": ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                           "SLURM_STEP_NUM_NODES": "2"}, 8, "cuda", ({"": "cuda:1"}, True)),
    "xpu-rank1": (torchrun(2, 1, 1, 2), 2, "xpu", ({"": "xpu:1"}, True)),
    "cpu-world-2": (torchrun(2, 1, 1, 2), 0, "cpu", ({"": "cpu"}, True)),
    "single-cpu": ({}, 0, "cpu", ({"": "cpu"}, False)),
    "single-gpu": ({}, 1, "cuda", ({"": "cuda:0"}, False)),
    "torchrun-nproc1-one-gpu": (torchrun(1, 0, 0, 1), 1, "cuda", ({"": "cuda:0"}, False)),
    "one-process-eight-gpus": ({}, 8, "cuda", ({"": "cuda:0"}, False)),
    "empty-world-size": ({"WORLD_SIZE": "", "LOCAL_RANK": ""}, 2, "cuda", ({"": "cuda:0"}, False)),
}


@pytest.mark.parametrize("case", list(MAPS))
def test_prepare_device_map(monkeypatch, fake_accelerators, case):
    env, count, kind, expected = MAPS[case]
    set_env(monkeypatch, **env)
    fake_accelerators(count, kind)
    assert prepare_device_map() == expected


@pytest.mark.parametrize("visible", [None, "0,1"])
def test_local_rank_without_a_device_is_a_clear_error(monkeypatch, fake_accelerators, visible):
    set_env(monkeypatch, **torchrun(4, 3, 3, 4))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    fake_accelerators(2)
    with pytest.raises(TopologyError) as info:
        prepare_device_map()
    message = str(info.value)
    assert "LOCAL_RANK=3" in message
    assert "2 cuda device" in message  # the visible count
    assert f"CUDA_VISIBLE_DEVICES={visible!r}" in message


def test_invalid_local_rank_is_reported_when_the_map_is_needed(monkeypatch, fake_accelerators):
    set_env(monkeypatch, WORLD_SIZE="2", LOCAL_RANK="-3")  # set after import: the import did not fail
    with pytest.raises(TopologyError, match="LOCAL_RANK='-3'"):
        prepare_device_map()


# --- the hook, through from_pretrained ----------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


QUANT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def with_config(source: str, path, **changes) -> str:
    """A copy of checkpoint `source` whose config.json has `changes` (None deletes a key)."""
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return str(path)


@pytest.fixture(scope="module")
def pre_quantized(checkpoint, tmp_path_factory) -> str:
    """The tiny checkpoint, its config.json declaring 4-bit bitsandbytes weights, as a pre-quantized
    save writes it (the weights stay plain: transformers' side never loads them here)."""
    return with_config(checkpoint, tmp_path_factory.mktemp("q") / "pre-quantized", quantization_config=QUANT)


class TransformersSide:
    """transformers' own `from_pretrained`, as the hook calls it: records the device_map of each
    call; loads for real when `load` is set, else returns None (no bitsandbytes run)."""

    def __init__(self, stock) -> None:
        self.stock, self.load, self.device_maps = stock, False, []

    def from_pretrained(self, cls, pretrained_model_name_or_path, *args, **kwargs):
        self.device_maps.append(kwargs.get("device_map"))
        return self.stock.__func__(cls, pretrained_model_name_or_path, *args, **kwargs) if self.load else None


@pytest.fixture
def transformers_side(monkeypatch):
    from transformers import PreTrainedModel

    accel_patch.disable()
    side = TransformersSide(PreTrainedModel.__dict__["from_pretrained"])
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # the shape the hook checks
        return side.from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs)

    with monkeypatch.context() as m:
        # The recorder takes the original's place; the hook binds over it, as over the original.
        m.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
        accel_patch.enable()
        assert next(s for s in accel_patch.status() if s.name == "device-map").state == "active"
        yield side
        accel_patch.disable()
    accel_patch.enable()


def received(side: TransformersSide, checkpoint, **kwargs):
    """The device_map transformers receives for `from_pretrained(checkpoint, **kwargs)`."""
    LlamaForCausalLM.from_pretrained(checkpoint, **kwargs)
    return side.device_maps[-1]


def test_the_recorder_sits_under_the_hook(transformers_side, checkpoint, monkeypatch, fake_accelerators):
    # Control for every test below: what the recorder sees is what the hook passed on.
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    assert received(transformers_side, checkpoint, device_map="auto") == {"": "cpu"}
    assert "distributed load" in registry.last_decision(PATCH_NAME).reason


EXPLICIT = [{"": "cpu"}, {"model": 0, "lm_head": "cpu"}, "cpu", "cuda", "cuda:1", torch.device("cuda", 1), 0]
BNB_4BIT = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)}


@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_single_process_unquantized_load_is_left_alone(transformers_side, checkpoint, fake_accelerators, requested):
    fake_accelerators(1)
    assert received(transformers_side, checkpoint, device_map=requested) is requested


@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_distributed_load_goes_to_this_ranks_device(transformers_side, checkpoint, monkeypatch, fake_accelerators, requested):
    set_env(monkeypatch, **torchrun(8, 5, 1, 2, nodes=4))
    fake_accelerators(2)
    assert received(transformers_side, checkpoint, device_map=requested) == {"": "cuda:1"}


@pytest.fixture
def current_devices(monkeypatch):
    """Every `torch.cuda.set_device` call, recorded, with CUDA said available (none here to set)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return calls


def test_a_rank_s_device_is_made_current_before_its_load(transformers_side, checkpoint, monkeypatch,
                                                        fake_accelerators, current_devices):
    # accelerate makes each rank's device current only once its state is created, after the load;
    # before, anything the load puts on the current device lands on device 0
    fake_accelerators(2)
    set_env(monkeypatch, **torchrun(8, 5, 1, 2, nodes=4))
    assert received(transformers_side, checkpoint, **BNB_4BIT) == {"": "cuda:1"} and current_devices == [1]
    assert registry.last_decision(PATCH_NAME).reason.endswith("; current device set to cuda:1 for the load")
    current_devices.clear()
    set_env(monkeypatch, **torchrun(8, 4, 0, 2, nodes=4))  # device 0: current already
    assert received(transformers_side, checkpoint, **BNB_4BIT) == {"": "cuda:0"} and current_devices == []
    set_env(monkeypatch, **torchrun(8, 5, 1, 2, nodes=4))  # the caller's own map: nothing touched
    assert received(transformers_side, checkpoint, device_map={"": "cuda:0"}, **BNB_4BIT) == {"": "cuda:0"}
    assert current_devices == [] and "current device" not in registry.last_decision(PATCH_NAME).reason


@pytest.mark.parametrize("count, expected", [(0, {"": "cpu"}), (1, {"": "cuda:0"})])
@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_quantized_load_in_one_process_goes_to_its_device(transformers_side, checkpoint, fake_accelerators,
                                                          requested, count, expected):
    fake_accelerators(count)
    assert received(transformers_side, checkpoint, device_map=requested, **BNB_4BIT) == expected


def test_one_process_over_several_devices_keeps_its_strategy(transformers_side, checkpoint, fake_accelerators):
    fake_accelerators(2)
    # Spreading is what "auto" asked for; with no map, a quantized load goes to the first device.
    assert received(transformers_side, checkpoint, device_map="auto", **BNB_4BIT) == "auto"
    assert received(transformers_side, checkpoint, **BNB_4BIT) == {"": "cuda:0"}


@pytest.mark.parametrize("requested", EXPLICIT, ids=repr)
@pytest.mark.parametrize("quantized", [False, True])
def test_explicit_device_map_is_never_overridden(transformers_side, checkpoint, monkeypatch, fake_accelerators,
                                                 requested, quantized):
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    fake_accelerators(2)
    kwargs = BNB_4BIT if quantized else {}
    assert received(transformers_side, checkpoint, device_map=requested, **kwargs) is requested


def test_distributed_strategy_with_no_device_for_the_local_rank_is_a_clear_error(
        transformers_side, checkpoint, monkeypatch, fake_accelerators):
    set_env(monkeypatch, **torchrun(4, 3, 3, 4))
    fake_accelerators(2)
    with pytest.raises(TopologyError, match="LOCAL_RANK=3"):
        LlamaForCausalLM.from_pretrained(checkpoint, device_map="auto", **BNB_4BIT)
    assert transformers_side.device_maps == []  # stopped before transformers


# --- quantized loads: told by the arguments, or by a local checkpoint's config.json ---------------

@pytest.mark.parametrize(
    "kwargs",
    [
        {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)},
        {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)},
        {"quantization_config": dict(QUANT)},
        {"load_in_4bit": True},
        {"load_in_8bit": True},
        {"config": LlamaConfig(quantization_config=dict(QUANT))},
    ],
    ids=["bnb-4bit", "bnb-8bit", "dict", "load_in_4bit", "load_in_8bit", "config-object"],
)
def test_quantized_load_detected_from_the_arguments(transformers_side, checkpoint, fake_accelerators, kwargs):
    assert received(transformers_side, checkpoint, device_map="auto", **kwargs) == {"": "cpu"}
    assert "quantized load" in registry.last_decision(PATCH_NAME).reason


@pytest.mark.parametrize("requested", [None, "auto"])
@pytest.mark.parametrize("count, expected", [(0, {"": "cpu"}), (1, {"": "cuda:0"})])
@pytest.mark.parametrize("how", ["positional", "keyword", "path-object"])
def test_pre_quantized_local_checkpoint_loads_on_this_process_device(
        transformers_side, pre_quantized, fake_accelerators, requested, count, expected, how):
    # Nothing in the call says "quantized": only the checkpoint's config.json does. One process on
    # one device: an unquantized load would keep `requested` (see the control test below).
    fake_accelerators(count)
    if how == "positional":
        LlamaForCausalLM.from_pretrained(pre_quantized, device_map=requested)
    elif how == "keyword":
        LlamaForCausalLM.from_pretrained(pretrained_model_name_or_path=pre_quantized, device_map=requested)
    else:
        from pathlib import Path

        LlamaForCausalLM.from_pretrained(Path(pre_quantized), device_map=requested)
    assert transformers_side.device_maps == [expected]
    assert "quantized load" in registry.last_decision(PATCH_NAME).reason


def test_unquantized_local_checkpoint_keeps_its_device_map(transformers_side, checkpoint, fake_accelerators):
    # Control for the test above: the same call on the checkpoint as saved.
    fake_accelerators(1)
    assert received(transformers_side, checkpoint, device_map="auto") == "auto"
    assert received(transformers_side, checkpoint) is None


def test_config_given_as_the_path_of_a_pre_quantized_checkpoint(transformers_side, checkpoint, pre_quantized,
                                                                 fake_accelerators):
    assert received(transformers_side, checkpoint, config=pre_quantized, device_map="auto") == {"": "cpu"}
    # A config object without quantization wins over the directory's config.json.
    assert received(transformers_side, pre_quantized, config=LlamaConfig(), device_map="auto") == "auto"


def test_distributed_load_of_a_pre_quantized_checkpoint(transformers_side, pre_quantized, monkeypatch,
                                                        fake_accelerators):
    fake_accelerators(2)
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    assert received(transformers_side, pre_quantized, device_map="auto") == {"": "cuda:1"}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    # One process over two GPUs: quantized with no map goes to the first one rather than "all".
    assert received(transformers_side, pre_quantized) == {"": "cuda:0"}


def test_detection_never_fails_a_load(transformers_side, checkpoint, fake_accelerators, tmp_path):
    broken = with_config(checkpoint, tmp_path / "broken")
    (tmp_path / "broken" / "config.json").write_text("{not json")
    for path in (broken, str(tmp_path / "does-not-exist"), "some-org/some-hub-model"):  # hub ids: not fetched
        assert received(transformers_side, path, device_map="auto") == "auto"


# --- the real from_pretrained -------------------------------------------------------------------

@pytest.fixture
def load(checkpoint, transformers_side):
    """load(**kwargs) -> (model, device_map transformers received, the hook's LoadDecision)."""
    transformers_side.load = True

    def run(**kwargs):
        model = LlamaForCausalLM.from_pretrained(checkpoint, **kwargs)
        return model, transformers_side.device_maps[-1], registry.last_decision(PATCH_NAME)

    return run


@pytest.mark.parametrize("requested", [None, "auto", "balanced"])
def test_distributed_cpu_load_replaces_strategy_with_this_ranks_device(monkeypatch, fake_accelerators, load, requested):
    set_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    model, device_map, decision = load(device_map=requested)
    assert device_map == {"": "cpu"}
    assert decision.requested == requested and "distributed load" in decision.reason
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_explicit_map_reaches_transformers_unchanged(monkeypatch, fake_accelerators, load):
    set_env(monkeypatch, WORLD_SIZE="2", RANK="1", LOCAL_RANK="1")
    explicit = {"": "cpu"}
    model, device_map, _ = load(device_map=explicit)
    assert device_map is explicit
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_single_process_load_keeps_auto_and_none(fake_accelerators, load):
    assert load(device_map="auto")[1] == "auto"
    assert load()[1] is None


def test_empty_world_size_loads_as_one_process(monkeypatch, fake_accelerators, load):
    # A template wrote WORLD_SIZE="": stock transformers crashes in int("") for device_map="auto".
    monkeypatch.setenv("WORLD_SIZE", "")
    model, device_map, _ = load(device_map="auto")
    assert device_map == "auto"
    assert model.config.vocab_size == 64
    assert "WORLD_SIZE" not in os.environ


def test_invalid_world_size_fails_the_load_with_a_clear_message(monkeypatch, fake_accelerators, checkpoint):
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(TopologyError, match=r"WORLD_SIZE='two'.*whole number"):
        LlamaForCausalLM.from_pretrained(checkpoint, device_map="auto")


# --- sharding engines place the weights themselves: the load is left as written ----------------

class Zero3Config:
    """What transformers' `is_deepspeed_zero3_enabled()` reads: the HfDeepSpeedConfig that
    TrainingArguments(deepspeed=...) registers (here of stage 3, without DeepSpeed itself)."""

    config = {"zero_optimization": {"stage": 3}}

    def is_zero3(self) -> bool:
        return True


@pytest.fixture
def engine(monkeypatch):
    """engine(name) turns on one sharding engine the way a user's run would; returns the extra
    from_pretrained arguments it needs."""
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = []

    def turn_on(name: str) -> dict:
        if name == "zero3-config":
            registered.append(Zero3Config())
            hf_deepspeed.set_hf_deepspeed_config(registered[-1])
            assert hf_deepspeed.is_deepspeed_zero3_enabled()
        elif name == "zero3-accelerate":  # accelerate launch --use_deepspeed --zero_stage 3
            set_env(monkeypatch, ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
        elif name == "fsdp-ram-efficient":  # accelerate launch --use_fsdp (its default)
            set_env(monkeypatch, ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
        elif name == "fsdp":
            set_env(monkeypatch, ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="false")
        elif name == "fsdp-training-arguments":  # TrainingArguments(fsdp=...) built before the load sets
            # this alone, "false" by default (test_training_arguments_fsdp_sets_only_the_loading_variable)
            set_env(monkeypatch, FSDP_CPU_RAM_EFFICIENT_LOADING="false")
        elif name == "fsdp-plugin":  # Accelerator(fsdp_plugin=...) built before the load
            from accelerate.state import AcceleratorState

            monkeypatch.setitem(AcceleratorState._shared_state, "fsdp_plugin", object())
        elif name == "tp-plan":
            return {"tp_plan": "auto"}
        return {}

    yield turn_on
    if registered:
        hf_deepspeed.unset_hf_deepspeed_config()


ENGINE_WORDS = {"zero3-config": "ZeRO-3", "zero3-accelerate": "ACCELERATE_DEEPSPEED_ZERO_STAGE=3",
                "fsdp-ram-efficient": "RAM-efficient", "fsdp": "FSDP", "tp-plan": "tp_plan",
                "fsdp-training-arguments": "TrainingArguments' fsdp", "fsdp-plugin": "FSDP plugin exists"}


@pytest.mark.parametrize("quantized", [False, True], ids=["plain", "4bit"])
@pytest.mark.parametrize("requested", [None, "auto"])
@pytest.mark.parametrize("name", list(ENGINE_WORDS))
def test_load_under_a_sharding_engine_reaches_transformers_as_written(
        transformers_side, checkpoint, monkeypatch, fake_accelerators, engine, name, requested, quantized):
    # Rank 1 of a 2-GPU node: without the engine this load becomes {"": "cuda:1"} (the control below).
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    fake_accelerators(2)
    extra = engine(name)
    kwargs = dict(extra, **(BNB_4BIT if quantized else {}))
    assert received(transformers_side, checkpoint, device_map=requested, **kwargs) is requested
    decision = registry.last_decision(PATCH_NAME)
    assert ENGINE_WORDS[name] in decision.reason and "from_pretrained untouched" in decision.reason
    assert decision.used is requested


def test_a_distributed_load_with_no_local_rank_is_kept_rather_than_put_on_device_0(
        transformers_side, checkpoint, monkeypatch, fake_accelerators):
    # WORLD_SIZE alone (exported by hand, no launcher's local rank): every process would take cuda:0
    set_env(monkeypatch, WORLD_SIZE="4", RANK="1")
    fake_accelerators(2)
    assert received(transformers_side, checkpoint, device_map="auto", **BNB_4BIT) == "auto"
    assert "no variable gives this process's local rank" in registry.last_decision(PATCH_NAME).reason
    fake_accelerators(1)  # one device a process: device 0 is right whatever the local rank
    assert received(transformers_side, checkpoint, device_map="auto", **BNB_4BIT) == {"": "cuda:0"}


def test_training_arguments_fsdp_sets_only_the_loading_variable(monkeypatch):
    # what the "fsdp-training-arguments" engine above stands for: transformers' TrainingArguments
    # with fsdp sets FSDP_CPU_RAM_EFFICIENT_LOADING when built; ACCELERATE_USE_FSDP only comes with
    # the Trainer's Accelerator, after the model is loaded
    from transformers import TrainingArguments

    for name in ("FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_USE_FSDP"):
        monkeypatch.delenv(name, raising=False)
    TrainingArguments(output_dir="unused", fsdp="full_shard", report_to="none")
    assert os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING") == "false"
    assert "ACCELERATE_USE_FSDP" not in os.environ
    os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING")


@pytest.mark.parametrize("env", [
    {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"},
    {"ACCELERATE_USE_DEEPSPEED": "false", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
    {"ACCELERATE_USE_FSDP": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"},
], ids=["zero2", "deepspeed-off", "fsdp-off"])
def test_engines_that_do_not_place_weights_keep_the_per_rank_map(transformers_side, checkpoint, monkeypatch,
                                                                 fake_accelerators, env):
    # Control for the test above: ZeRO-1/2 keep whole weights per rank; a flag set false is no request.
    set_env(monkeypatch, **torchrun(2, 1, 1, 2), **env)
    fake_accelerators(2)
    assert received(transformers_side, checkpoint) == {"": "cuda:1"}


def test_fsdp_load_on_a_faked_two_gpu_node_loads_as_stock(monkeypatch, fake_accelerators, load):
    # The hook used to send this load to cuda:1, which does not exist here: the load failed where
    # stock transformers loads (on CPU, for FSDP to shard).
    set_env(monkeypatch, **torchrun(2, 1, 1, 2), ACCELERATE_USE_FSDP="true", FSDP_CPU_RAM_EFFICIENT_LOADING="true")
    fake_accelerators(2)
    model, device_map, decision = load()
    assert device_map is None and "FSDP" in decision.reason
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize("kwargs, verdict", [
    ({"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16),
      "dtype": torch.bfloat16}, "both are bfloat16: met"),
    ({"quantization_config": BitsAndBytesConfig(load_in_4bit=True), "dtype": torch.bfloat16},
     "bnb_4bit_quant_storage=uint8 but dtype=bfloat16: not met"),
    ({"quantization_config": {"load_in_4bit": True, "bnb_4bit_quant_storage": "float32"}, "torch_dtype": "float32"},
     "both are float32: met"),
    ({"load_in_4bit": True}, "dtype=unset: pass dtype=uint8"),
    ({"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}, "no bitsandbytes 4-bit config"),
], ids=["met", "default-storage", "dict", "no-dtype", "8bit"])
def test_quantized_fsdp_load_says_whether_bitsandbytes_quant_storage_rule_holds(
        transformers_side, checkpoint, monkeypatch, fake_accelerators, engine, kwargs, verdict):
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    fake_accelerators(2)
    engine("fsdp-ram-efficient")
    assert received(transformers_side, checkpoint, **kwargs) is None  # nothing changed, only said
    reason = registry.last_decision(PATCH_NAME).reason
    assert verdict in reason, reason
    if "4-bit config" not in verdict:
        assert "bnb_4bit_quant_storage must be the dtype of the other weights" in reason


def test_env_report_names_the_engine_that_places_the_weights(monkeypatch, fake_accelerators):
    from accel_patch.cli.report import env_report

    assert env_report()["load"]["engine"] is None
    set_env(monkeypatch, ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
    load_report = env_report()["load"]
    assert "ZeRO-3" in load_report["engine"] and "from_pretrained untouched" in load_report["reason"]
