"""The swap under FSDP, for real: 2 processes on CPU with gloo.

- torchrun of integration_tests/fsdp_worker.py, one launch for every mode (FSDP2 `fully_shard` and
  FSDP1 `FullyShardedDataParallel`, tied and untied embeddings, LoRA with and without an adapter on
  lm_head, checkpoints): the swapped model against stock, sharded the same way.
- `accelerate launch --use_fsdp --fsdp_version 2` of the Trainer worker: one FSDP2 job on CPU (stock
  accelerate gives state NO on every rank there: each trains alone), the fused loss running.
- DeepSpeed ZeRO-3, one process on gloo, where DeepSpeed is installed (it is not a test dependency).
- A tiny Qwen3-MoE with its experts swapped, under DDP and under FSDP2 (one torchrun of the FSDP
  worker's moe modes), without the interpreter: the experts run the op's CPU twin.
"""
import filecmp
import importlib.util
import json
import math
import sys

import pytest

from _launch import (accelerate_fsdp2_cmd, free_port, read_ranks, require_success, run, summary,
                     tails, torchrun_cmd, worker_env)

FSDP_WORKER = __import__("pathlib").Path(__file__).with_name("fsdp_worker.py")
MODES = ("fsdp2-untied", "fsdp2-tied", "fsdp1-untied", "fsdp1-tied")


# The ranks run the Triton kernels under Triton's CPU interpreter, as the unit tests do: on a CPU
# without it, a swapped model runs the stock computation below 2**23 logits (swaps/loss/site.py's
# CPU_MIN_LOGITS) and these tiny models would never reach the fused loss under test.
KERNELS_ON_CPU = {"TRITON_INTERPRET": "1"}


def launch_worker(tmp_path_factory, name: str, args: list[str], **env):
    """Both ranks' results of one torchrun of fsdp_worker.py (every mode it ran without an error),
    and the directory they saved into."""
    root = tmp_path_factory.mktemp(name)
    out = root / "out"
    out.mkdir()
    proc = run(torchrun_cmd(["--out", str(out), *args], nproc=2, port=free_port(), target=(str(FSDP_WORKER),)),
               worker_env(root / "hf_home", **env), root)
    require_success([proc])
    ranks = []
    for r in (0, 1):
        path = out / f"fsdp_rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result\n\n{tails([proc])}")
        res = json.loads(path.read_text())
        broken = {m: v["traceback"] for m, v in res.items() if isinstance(v, dict) and "error" in v}
        assert not broken, "\n".join(f"{m}: {tb}" for m, tb in broken.items())
        ranks.append(res)
    return ranks, out


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """Both ranks' results of one torchrun of every mode, and the directory they saved into."""
    ranks, out = launch_worker(tmp_path_factory, "fsdp", [], **KERNELS_ON_CPU)
    for res in ranks:
        assert res["world_size"] == 2 and res["triton_interpret"] == KERNELS_ON_CPU["TRITON_INTERPRET"]  # set, not inherited
    return ranks, out


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """Both ranks' results of one torchrun of the moe modes. No TRITON_INTERPRET: as on a user's CPU
    machine, the swapped experts run the op's plain-torch twin (interpreted, 3 steps of both modes
    took 90 s here)."""
    ranks, _ = launch_worker(tmp_path_factory, "moe", ["--modes", "moe-ddp,moe-fsdp2,moe-lora-fsdp2"])
    for res in ranks:
        assert res["triton_interpret"] is None
    return ranks


def noise_bound(m: dict) -> float:
    """How far the swapped run's weights may be from stock's under FSDP (or DDP) after the worker's
    3 AdamW steps at lr 1e-2: float32 noise, never a defect's size (gradients a rank failed to
    reduce, a scale applied twice, an adapter left out put the weights ~lr = 1e-2 apart).

    The noise is the swap's own distance from stock in one process plus FSDP's own distance from one
    process, each twice, plus 1e-6. That yardstick collapses where the swap rounds as stock does in
    one process (the cross-entropy rows since they compute the softmax as eager's log_softmax: swap
    noise 4.5e-7 in the LoRA mode, from 3.4e-5) while the sharded run keeps its kernels' other
    summation order, which AdamW's first steps amplify (lr g / (|g| + eps) is about +-lr for an element
    whose gradient is rounding-sized): the LoRA mode's distance fell from 2.6e-5 to 6.9e-6 with that
    change and still failed a bound that had fallen to 3.7e-6. That distance is one parameter's: layer
    0's q_proj lora_A (the next, its lora_B, 1.3e-6; every other below 2.1e-7), where the swapped
    model's sharded run is 5.6e-6 from its own one-process run against stock's 8.7e-7. The cause is
    AdamW's eps (1e-8, the default), not the kernels: an element whose gradient is near eps moves by
    a fraction of lr set by its rounding, so which elements sit near eps decides the distance. Run
    with eps 1e-5 instead, every mode's distance falls inside the yardstick above at 0.20-0.43 of it
    (lora: 1.07e-6 against 5.3e-6); with eps 1e-6 other elements sit near it and the untied modes'
    own swap noise rises to 1.5e-3. So the bound is also at least 1e-3 of the step's largest move
    (3e-5 here), which is below the yardstick's value before (7.0e-5) and 300 times below a
    defect's size; the optimizer stays the users' default."""
    return max(2 * m["swap_noise"] + 2 * m["noise_floor"] + 1e-6, 1e-3 * m["moved"])


def close_losses(got, want):
    return all(math.isclose(g, w, rel_tol=1e-5) for g, w in zip(got, want)) and len(got) == len(want)


@pytest.mark.parametrize("mode", MODES)
def test_swapped_model_under_fsdp_trains_as_stock_fsdp_with_the_fused_loss(fsdp_runs, mode):
    ranks, _ = fsdp_runs
    for res in ranks:
        m = res[mode]
        assert m["loss_calls"] == {"fused": 3}, m["loss_calls"]  # the fused loss ran, every step
        assert close_losses(m["swapped_losses"], m["stock_losses"]), (m["swapped_losses"], m["stock_losses"])
    m0 = ranks[0][mode]
    if mode.startswith("fsdp2"):
        assert m0["head_weight_type_outside_forward"] == "DTensor"  # the head really was sharded
    assert m0["same_keys"] and m0["moved"] > 1e-3
    # Float32 noise: the swap's own distance from stock on one process (3 AdamW steps, lr 1e-2;
    # tied embeddings amplify it) plus FSDP's own distance from one process. Gradients FSDP failed
    # to reduce would put the weights ~lr apart.
    assert m0["max_weight_diff"] <= noise_bound(m0), m0
    assert m0["noise_floor"] < 1e-4, m0  # the yardstick itself: FSDP on 2 ranks = one process


def test_lora_under_fsdp2_trains_adapters_as_stock_and_a_head_adapter_stands_aside(fsdp_runs):
    ranks, _ = fsdp_runs
    for res in ranks:
        assert res["lora"]["loss_calls"] == {"fused": 3}
        head = res["lora-head"]["loss_calls"]
        assert list(head) == ["stood aside: a LoRA adapter on the LM head (stock head, so the adapter trains)"], head
        for mode in ("lora", "lora-head"):
            assert close_losses(res[mode]["swapped_losses"], res[mode]["stock_losses"])
    lora, lora_head = ranks[0]["lora"], ranks[0]["lora-head"]
    assert lora["max_weight_diff"] <= noise_bound(lora), lora
    assert lora_head["max_weight_diff"] <= noise_bound(lora_head), lora_head
    assert lora_head["lora_head_moved"] > 1e-3  # the head's adapter trained


def test_sharded_and_gathered_checkpoints_are_byte_identical_to_stock(fsdp_runs):
    _, out = fsdp_runs
    root = out / "ckpt"
    for kind, names in (("sharded", ["__0_0.distcp", "__1_0.distcp"]),
                        ("pretrained", ["model.safetensors", "config.json"])):
        stock, swapped = root / "stock" / kind, root / "swapped" / kind
        assert sorted(p.name for p in stock.iterdir()) == sorted(p.name for p in swapped.iterdir())
        for name in names:
            assert (stock / name).exists(), f"{kind}/{name} missing"
            assert filecmp.cmp(stock / name, swapped / name, shallow=False), f"{kind}/{name} differs from stock"
    # DCP's .metadata holds the checkpoint's path and a fresh save id (a UUID): two stock saves differ
    # there too. Everything it says about the tensors must be equal.
    import torch.distributed.checkpoint as dcp

    a, b = (dcp.FileSystemReader(str(root / name / "sharded")).read_metadata() for name in ("stock", "swapped"))
    assert a.state_dict_metadata == b.state_dict_metadata
    assert (a.planner_data, a.storage_data) == (b.planner_data, b.storage_data)


def test_accelerate_launch_fsdp2_on_cpu_is_one_job_with_the_fused_loss(tmp_path, out_dir, home):
    args = ["--out", str(out_dir), "--seed-per-rank"]
    proc = run(accelerate_fsdp2_cmd(args, nproc=2, port=free_port()), worker_env(home, **KERNELS_ON_CPU), tmp_path)
    # The same job with no kernels swapped (the accelerate patch still on): the stock loss under FSDP2.
    stock_dir = tmp_path / "stock"
    stock_dir.mkdir()
    stock = run(accelerate_fsdp2_cmd(["--out", str(stock_dir), "--seed-per-rank"], nproc=2, port=free_port()),
                worker_env(home, ACCEL_PATCH_KERNELS="0", **KERNELS_ON_CPU), tmp_path / "stock_run")
    require_success([proc, stock])
    results = read_ranks(out_dir, 2, [proc])
    stock_results = read_ranks(stock_dir, 2, [stock])
    assert stock_results[0]["loss_calls"] is None and stock_results[0]["distributed_type"] == "FSDP"
    assert close_losses(results[0]["losses"], stock_results[0]["losses"]), (results[0]["losses"],
                                                                           stock_results[0]["losses"])
    info = summary(results)
    for res in results:
        # Stock accelerate: state NO and num_processes 1 on every rank, each training alone.
        assert res["distributed_type"] == "FSDP" and res["fsdp_version"] == 2, info
        assert res["num_processes"] == 2 and res["pg_world_size"] == 2, info
        assert res["wrapped_class"] == "FSDPLlamaForCausalLM" and res["head_weight_type"] == "DTensor", info
        assert res["loss_calls"] and set(res["loss_calls"]) == {"fused"}, res["loss_calls"]
        assert all(math.isfinite(x) for x in res["losses"])
        assert not [s for s in res["status"] if s["state"] == "failed"]
        assert any("fsdp2" in s["reason"] for s in res["status"] if s["name"] == "accelerate-state")
    assert sorted(r["process_index"] for r in results) == [0, 1], info
    # One job: every rank logs the same (all-reduced) losses and ends with the same gathered weights.
    assert results[0]["losses"] == results[1]["losses"], info
    assert results[0]["final_digest"] == results[1]["final_digest"], info


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero3_head_stands_aside_and_trains_as_stock(tmp_path, home):
    out = tmp_path / "ds.json"
    proc = run([sys.executable, str(FSDP_WORKER), "--zero3", str(out)],
               worker_env(home, MASTER_PORT=str(free_port())), tmp_path)
    require_success([proc])
    res = json.loads(out.read_text())
    assert res["partitioned"] == [True, "NOT_AVAILABLE", 0]  # ds_id, ds_status, an empty .data
    assert list(res["loss_calls"]) == [
        "stood aside: LM head weight is a DeepSpeed ZeRO-3 partition (released outside the head's forward; "
        "stock head, which ZeRO-3 gathers)"], res["loss_calls"]
    assert close_losses(res["swapped_losses"], res["stock_losses"])  # the other kernels: float noise


@pytest.mark.parametrize("mode", ["moe-ddp", "moe-fsdp2"])
def test_a_moe_model_with_swapped_experts_trains_as_stock_under_ddp_and_fsdp2(moe_runs, mode):
    for res in moe_runs:
        m = res[mode]
        assert m["swapped"]["experts"] == 2, m["swapped"]
        # every experts call ran the op (2 layers x 3 steps), on its CPU twin: no Triton launch
        assert m["experts_calls"] == {"fused": 6}, m["experts_calls"]
        assert m["kernels_launched"] == [], m["kernels_launched"]
        assert close_losses(m["swapped_losses"], m["stock_losses"]), (m["swapped_losses"], m["stock_losses"])
    m0 = moe_runs[0][mode]
    # FSDP2 shards the experts (DTensor between calls) and unshards them to plain tensors for the
    # forward, so they run the op rather than standing aside
    assert m0["experts_weight_type_outside_forward"] == ("DTensor" if mode == "moe-fsdp2" else "Parameter")
    assert m0["same_keys"] and m0["moved"] > 1e-3
    assert m0["max_weight_diff"] <= noise_bound(m0), m0
    assert m0["noise_floor"] < 1e-4, m0
    if mode == "moe-ddp":  # the ranks end equal
        assert moe_runs[0][mode]["rank_digest"] == moe_runs[1][mode]["rank_digest"]
        assert all(r[mode]["rank_sync"].startswith("in sync") for r in moe_runs), [r[mode]["rank_sync"] for r in moe_runs]


def test_rslora_on_the_experts_is_fused_under_fsdp2_and_trains_only_the_adapters_as_stock(moe_runs):
    # PEFT's all-linear LoRA wraps the experts' 3-D weights; rsLoRA gives gate/up (twice the rank and
    # alpha) a scaling of its own: every experts call still runs the op with its split LoRA
    mode = "moe-lora-fsdp2"
    for res in moe_runs:
        m = res[mode]
        assert m["experts_calls"] == {"fused (LoRA)": 6}, m["experts_calls"]
        assert close_losses(m["swapped_losses"], m["stock_losses"]), (m["swapped_losses"], m["stock_losses"])
        assert m["trainable_experts"] and all("lora_" in n for n in m["trainable_experts"]), m["trainable_experts"]
    m0 = moe_runs[0][mode]
    assert m0["experts_weight_type_outside_forward"] == "DTensor"
    assert m0["same_keys"] and m0["moved"] > 1e-3
    assert m0["max_weight_diff"] <= noise_bound(m0), m0
