import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def untimed_lora(monkeypatch):
    """The LoRA sites run fused, untimed: on a GPU each test would otherwise time the fused function
    against PEFT's forward at its own shapes and might run PEFT's, so its counts and its rounding
    would depend on the device's speed. The timing's own tests turn it on (test_lora_timing.py)."""
    from accel_patch.swaps.lora import timing

    monkeypatch.setattr(timing, "TIMED_DEVICE_TYPES", ())


@pytest.fixture
def released():
    """Swapped models of earlier tests are collected, so the RoPE interceptions they held are
    released (their finalizers run) before this test looks at the module globals. (A full
    collection costs ~0.3 s here: only the tests that count holders ask for it.)"""
    gc.collect()
    yield


@pytest.fixture
def gloo_group(tmp_path, monkeypatch):
    """A one-process gloo group (FSDP2's fully_shard runs on it, on CPU)."""
    import torch.distributed as dist

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
