"""Per-rank device maps and the `from_pretrained` hook (DESIGN.md, "Per-rank device map").

Device counts are faked in-process (`fake_accelerators`: a CPU-only box until told otherwise);
the real `from_pretrained` loads a tiny Llama checkpoint on CPU, distributed through the
environment only (loading needs no process group).
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

import accel_patch
from accel_patch import TopologyError, prepare_device_map
from accel_patch.model_loading import STRATEGIES, ModelLoadingPatch, _is_quantized, choose_device_map


@pytest.fixture(autouse=True)
def hook_bound(monkeypatch):
    monkeypatch.setattr(ModelLoadingPatch, "last_load", None)
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


# --- the hook's rules ---------------------------------------------------------------------------

EXPLICIT = [{"": "cpu"}, {"model": 0, "lm_head": "cpu"}, "cpu", "cuda", "cuda:1", torch.device("cuda", 1), 0]


@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_single_process_unquantized_load_is_left_alone(fake_accelerators, requested):
    fake_accelerators(1)
    decision = choose_device_map(requested, quantized=False)
    assert decision.used is requested


@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_distributed_load_goes_to_this_ranks_device(monkeypatch, fake_accelerators, requested):
    set_env(monkeypatch, **torchrun(8, 5, 1, 2, nodes=4))
    fake_accelerators(2)
    assert choose_device_map(requested, quantized=False).used == {"": "cuda:1"}


@pytest.mark.parametrize("count, expected", [(0, {"": "cpu"}), (1, {"": "cuda:0"})])
@pytest.mark.parametrize("requested", [None, *STRATEGIES])
def test_quantized_load_in_one_process_goes_to_its_device(fake_accelerators, requested, count, expected):
    fake_accelerators(count)
    assert choose_device_map(requested, quantized=True).used == expected


def test_one_process_over_several_devices_keeps_its_strategy(fake_accelerators):
    fake_accelerators(2)
    assert choose_device_map("auto", quantized=True).used == "auto"  # spreading is what it asked for
    assert choose_device_map(None, quantized=True).used == {"": "cuda:0"}


@pytest.mark.parametrize("requested", EXPLICIT, ids=repr)
@pytest.mark.parametrize("quantized", [False, True])
def test_explicit_device_map_is_never_overridden(monkeypatch, fake_accelerators, requested, quantized):
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    fake_accelerators(2)
    assert choose_device_map(requested, quantized=quantized).used is requested


def test_distributed_strategy_with_no_device_for_the_local_rank_is_a_clear_error(monkeypatch, fake_accelerators):
    set_env(monkeypatch, **torchrun(4, 3, 3, 4))
    fake_accelerators(2)
    with pytest.raises(TopologyError, match="LOCAL_RANK=3"):
        choose_device_map("auto", quantized=True)


# --- quantized load detection -------------------------------------------------------------------

def write_config(path, **extra) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **extra}))
    return str(path)


QUANT = {"quant_method": "bitsandbytes", "load_in_4bit": True}


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
def test_quantized_load_detected_from_kwargs(tmp_path, kwargs):
    plain = write_config(tmp_path / "plain")
    assert _is_quantized(plain, kwargs)


def test_pre_quantized_local_checkpoint_detected_from_its_config_json(tmp_path):
    quantized = write_config(tmp_path / "q", quantization_config=QUANT)
    plain = write_config(tmp_path / "plain")
    assert _is_quantized(quantized, {})
    assert _is_quantized(os.fspath(tmp_path / "q"), {}) and _is_quantized(tmp_path / "q", {})
    assert _is_quantized(plain, {"config": quantized})  # config given as a path
    assert not _is_quantized(plain, {})
    assert not _is_quantized(plain, {"quantization_config": None, "config": LlamaConfig()})


def test_detection_never_fails_a_load(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    assert not _is_quantized(str(tmp_path / "broken"), {})
    assert not _is_quantized(str(tmp_path / "empty-dir-does-not-exist"), {})
    assert not _is_quantized("some-org/some-hub-model", {})  # hub ids are not fetched


# --- the real from_pretrained -------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture
def received(monkeypatch):
    """The device_map that transformers' own from_pretrained receives, under the hook.

    A spy stands in for the original classmethod and the hook is bound over it, so the test sees
    the call exactly as the hook passes it on.
    """
    from transformers import PreTrainedModel

    seen: list = []
    accel_patch.disable()
    stock = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return stock.__func__(cls, pretrained_model_name_or_path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
        accel_patch.enable()
        yield seen
        accel_patch.disable()
    accel_patch.enable()


@pytest.fixture
def load(checkpoint, received):
    """load(**kwargs) -> (model, device_map transformers received, the hook's LoadDecision)."""

    def run(**kwargs):
        model = LlamaForCausalLM.from_pretrained(checkpoint, **kwargs)
        return model, received[-1], ModelLoadingPatch.last_load

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


def test_distributed_load_of_a_pre_quantized_checkpoint_is_detected(monkeypatch, tmp_path, fake_accelerators):
    # The hook reads the checkpoint's own config.json; the map it would pass for rank 1 of 2 GPUs.
    quantized = write_config(tmp_path / "q", quantization_config=QUANT)
    fake_accelerators(2)
    set_env(monkeypatch, **torchrun(2, 1, 1, 2))
    assert choose_device_map("auto", _is_quantized(quantized, {})).used == {"": "cuda:1"}
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    # One process over two GPUs: quantized with no map goes to the first one rather than "all".
    assert choose_device_map(None, _is_quantized(quantized, {})).used == {"": "cuda:0"}
