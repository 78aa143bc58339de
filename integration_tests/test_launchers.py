"""Full fine-tuning of a tiny Llama with Trainer under each launcher, after `import accel_patch`."""

from _launch import (accelerate_cmd, assert_ddp_in_sync, assert_single_process, free_port,
                     read_ranks, require_success, run, run_concurrently, torchrun_cmd, worker_env)


def test_torchrun_one_process_is_single_device(tmp_path, out_dir, home):
    # torchrun sets LOCAL_RANK/WORLD_SIZE=1: stock accelerate creates a process group here.
    proc = run(torchrun_cmd(["--out", str(out_dir)], nproc=1, port=free_port()),
               worker_env(home), tmp_path)
    require_success([proc])
    (res,) = read_ranks(out_dir, 1, [proc])
    assert_single_process(res)


def test_torchrun_two_processes_train_in_sync(tmp_path, out_dir, home):
    args = ["--out", str(out_dir), "--seed-per-rank"]
    proc = run(torchrun_cmd(args, nproc=2, port=free_port()), worker_env(home), tmp_path)
    require_success([proc])
    results = read_ranks(out_dir, 2, [proc])
    # the Trainer's callback swapped the kernels into the model on each rank; the ranks stay identical
    for res in results:
        assert res["swap"] == "rms_norm 5, rope 2, glu+tiled 2, fused_linear_cross_entropy 1", res["swap"]
    assert_ddp_in_sync(results)


def test_ranks_beside_an_existing_process_group_train_in_sync_with_a_second_trainer_too(tmp_path, out_dir, home):
    """The script makes its own gloo group before the Trainer, then trains a second model with a
    second Trainer (whose TrainingArguments rebuilds accelerate's state beside the live group):
    stock accelerate gives state NO both times on CPU, every rank alone, exit 0."""
    args = ["--out", str(out_dir), "--seed-per-rank", "--own-group", "--second-trainer"]
    proc = run(torchrun_cmd(args, nproc=2, port=free_port()), worker_env(home), tmp_path)
    require_success([proc])
    results = read_ranks(out_dir, 2, [proc])
    assert_ddp_in_sync(results)  # the first Trainer, over the script's own group
    seconds = [r["second"] for r in results]
    info = "\n".join(str(s) for s in seconds)
    for second in seconds:
        assert second["distributed_type"] == "MULTI_CPU" and second["num_processes"] == 2, info
        assert second["ddp_wrapped"], info
    assert sorted(s["process_index"] for s in seconds) == [0, 1], info
    assert seconds[0]["initial_digest"] != seconds[1]["initial_digest"], info  # seeded per rank
    gap = float((results[0]["weights"]["second_final"] - results[1]["weights"]["second_final"]).abs().max())
    assert gap <= 1e-6, f"the second Trainer's ranks drifted apart by {gap:.3g}\n{info}"


def test_two_nodes_one_process_each_train_in_sync(tmp_path, out_dir, home):
    # One device per node: WORLD_SIZE=2 but LOCAL_RANK=0 and LOCAL_WORLD_SIZE=1 on both nodes.
    args = ["--out", str(out_dir), "--seed-per-rank"]
    port = free_port()
    procs = run_concurrently(
        [torchrun_cmd(args, nproc=1, port=port, nnodes=2, node_rank=n) for n in (0, 1)],
        worker_env(home), tmp_path)
    require_success(procs)
    assert_ddp_in_sync(read_ranks(out_dir, 2, procs))


def test_accelerate_launch_multi_gpu_two_processes_train_in_sync(tmp_path, out_dir, home):
    args = ["--out", str(out_dir), "--seed-per-rank"]
    proc = run(accelerate_cmd(args, nproc=2, port=free_port()), worker_env(home), tmp_path)
    require_success([proc])
    assert_ddp_in_sync(read_ranks(out_dir, 2, [proc]))
