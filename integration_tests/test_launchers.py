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
