"""`accel-patch demo` (python -m accel_patch.demo), the README's first command, under a launcher."""

import sys

from _launch import free_port, require_success, run, tails, torchrun_cmd, worker_env


def test_demo_under_torchrun_two_processes(tmp_path, home):
    cmd = torchrun_cmd(["--steps", "6"], nproc=2, port=free_port(), target=("-m", "accel_patch.demo"))
    proc = run(cmd, worker_env(home), tmp_path)
    require_success([proc])
    info = tails([proc])
    out = proc.stdout
    assert "launcher   : torchrun" in out and "distributed data-parallel" in out, info
    assert "MULTI_CPU, 2 process(es)" in out, info
    assert "accelerate-state" in out, f"no patch status table\n{info}"
    # Only the main process prints the report.
    summary = [l for l in out.splitlines() if l.startswith("Held-out loss:")]
    assert len(summary) == 1, info
    # "Held-out loss: 4.830 before -> 3.907 after 6 steps (...)"
    words = summary[0].split()
    before, after = float(words[2]), float(words[5])
    assert after < before, info


def test_demo_rejects_invalid_world_size_at_once(tmp_path, home):
    proc = run([sys.executable, "-m", "accel_patch.demo"], worker_env(home, WORLD_SIZE="two"),
               tmp_path, timeout=60)
    info = tails([proc])
    assert proc.returncode == 2, info
    assert "WORLD_SIZE" in proc.stderr and "two" in proc.stderr, info
    assert "Traceback" not in proc.stderr, f"a user-facing error, not a traceback\n{info}"
