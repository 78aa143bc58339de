"""QLoRA (bitsandbytes 4-bit + peft LoRA) under 2-process torchrun, loaded with device_map="auto"."""

import pytest

pytest.importorskip("bitsandbytes")

from _launch import (assert_ddp_in_sync, free_port, read_ranks, require_success, run, summary,
                     torchrun_cmd, worker_env)


def test_qlora_two_processes_load_per_rank_and_train_in_sync(tmp_path, out_dir, home, tiny_checkpoint):
    args = ["--out", str(out_dir), "--seed-per-rank", "--checkpoint", str(tiny_checkpoint),
            "--qlora", "--device-map", "auto"]
    proc = run(torchrun_cmd(args, nproc=2, port=free_port()), worker_env(home), tmp_path)
    require_success([proc])
    results = read_ranks(out_dir, 2, [proc])
    info = summary(results) + "\n" + "\n".join(
        f"rank {r['env_rank']}: load={r['load']} prepare_device_map={r['prepare_device_map']}"
        for r in results)
    for res in results:
        # The suite hides accelerators, so each rank's own device is the CPU.
        assert res["load"]["linear_class"] == "Linear4bit", info
        assert res["load"]["weight_dtype"] == "torch.uint8", f"weights not 4-bit packed\n{info}"
        assert res["load"]["weight_device"] == "cpu", info
        device_map, is_distributed = res["prepare_device_map"]
        assert is_distributed is True, info
        assert device_map == {"": "cpu"}, info
    # Only the LoRA adapters train: identical across ranks although initialised with different seeds.
    assert results[0]["n_trainable"] < 10_000, f"more than the adapters is trainable\n{info}"
    assert_ddp_in_sync(results)


def test_fused_qlora_on_every_projection_trains_two_ranks_in_sync(tmp_path, out_dir, home, tiny_checkpoint):
    """The load hook swaps before PEFT; every LoRA MLP, QKV and O call of both ranks is fused, and
    DDP keeps the adapters identical."""
    args = ["--out", str(out_dir), "--seed-per-rank", "--checkpoint", str(tiny_checkpoint),
            "--qlora", "--lora-targets", "all", "--device-map", "auto"]
    proc = run(torchrun_cmd(args, nproc=2, port=free_port()), worker_env(home), tmp_path)
    require_success([proc])
    results = read_ranks(out_dir, 2, [proc])
    info = summary(results) + "\n" + "\n".join(f"rank {r['env_rank']}: {r['lora_calls']}" for r in results)
    for res in results:
        assert res["load"]["linear_class"] == "Linear4bit", info
        calls = {op: outcomes for op, outcomes in res["lora_calls"].items() if op != "tiled_mlp"}  # short: untiled
        assert set(calls) == {"lora_mlp", "lora_qkv", "lora_o"}, info
        assert all(outcomes.keys() == {"fused"} and outcomes["fused"] > 0 for outcomes in calls.values()), info
    assert results[0]["lora_calls"] == results[1]["lora_calls"], info
    assert_ddp_in_sync(results)
