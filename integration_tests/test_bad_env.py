"""Launcher variables that are empty or not numbers."""

from _launch import (assert_single_process, python_cmd, read_ranks, require_success, run, tails,
                     worker_env)

FAIL_FAST_S = 60  # imports alone take ~10-15 s on a loaded 2-core box; training is never reached

def test_empty_world_size_trains_as_one_process(tmp_path, out_dir, home, tiny_checkpoint):
    # Config templates write WORLD_SIZE="": stock accelerate and from_pretrained(device_map="auto")
    # crash parsing it. It must mean "unset".
    args = ["--out", str(out_dir), "--checkpoint", str(tiny_checkpoint), "--device-map", "auto"]
    proc = run(python_cmd(args), worker_env(home, WORLD_SIZE=""), tmp_path)
    require_success([proc])
    (res,) = read_ranks(out_dir, 1, [proc])
    assert_single_process(res)

def test_invalid_world_size_fails_fast_naming_it(tmp_path, out_dir, home):
    proc = run(python_cmd(["--out", str(out_dir)]), worker_env(home, WORLD_SIZE="two"), tmp_path,
               timeout=FAIL_FAST_S * 2)
    info = tails([proc])
    assert proc.returncode != 0, f"WORLD_SIZE=two was accepted\n{info}"
    assert not (out_dir / "rank0.training").exists(), f"it reached training before failing\n{info}"
    assert proc.seconds < FAIL_FAST_S, f"took {proc.seconds:.0f} s to fail\n{info}"
    # The error line itself (not a traceback's source line) names the variable and the value.
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert lines and "WORLD_SIZE" in lines[-1] and "two" in lines[-1], info
