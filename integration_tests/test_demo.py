"""`accel-patch demo` (python -m accel_patch.demo), the README's first command, plain and under a
launcher: the loss falls, and the output is the demo's own (no other library's warnings, every
progress bar labelled, the report printed once)."""

import re
import sys
from pathlib import Path

from _launch import free_port, require_success, run, tails, torchrun_cmd, worker_env

CONSOLE_SCRIPT = str(Path(sys.executable).with_name("accel-patch"))
WARNING_LINE = re.compile(r"\b\w*Warning\b|gemm_4bit_forward")
# tqdm without a description starts with the percentage. Its first frame (0%) is drawn before the
# label can be set and is overwritten at once on a terminal; every later frame must be labelled.
UNLABELLED_BAR = re.compile(r"^\s*(?!0%)\d+%\|")
LABELS = ("eval before training:", "train:", "eval after training:")


def held_out_losses(out, steps, info):
    """(before, after) from the one "Held-out loss: 4.830 before -> 3.907 after 6 steps (...)" line."""
    summary = [line for line in out.splitlines() if line.startswith("Held-out loss:")]
    assert len(summary) == 1, info
    words = summary[0].split()
    assert words[7:9] == [str(steps), "steps"], info
    return float(words[2]), float(words[5])


def assert_only_the_demos_output(proc, info):
    both = proc.stdout + proc.stderr
    noise = [line for line in both.splitlines() if WARNING_LINE.search(line)]
    assert not noise, f"other libraries' warnings in the demo's output: {noise}\n{info}"
    segments = re.split(r"[\r\n]", proc.stderr)  # tqdm redraws with carriage returns
    assert not [s for s in segments if UNLABELLED_BAR.match(s)], f"a progress bar without a label\n{info}"
    for label in LABELS:
        assert label in proc.stderr, f"no progress bar labelled {label!r}\n{info}"
    assert both.count("Topology (accel_patch.topology()):") == 1, f"the report is not printed once\n{info}"


def test_demo_plain_python_as_the_readme_runs_it(tmp_path, home):
    proc = run([CONSOLE_SCRIPT, "demo", "--steps", "6"], worker_env(home), tmp_path)
    require_success([proc])
    info = tails([proc])
    assert "launcher   : no launcher (plain python)" in proc.stdout, info
    assert "NO, 1 process(es)" in proc.stdout, info
    before, after = held_out_losses(proc.stdout, 6, info)
    assert after < before, info
    assert_only_the_demos_output(proc, info)


def test_demo_under_torchrun_two_processes(tmp_path, home):
    cmd = torchrun_cmd(["--steps", "6"], nproc=2, port=free_port(), target=("-m", "accel_patch.demo"))
    proc = run(cmd, worker_env(home), tmp_path)
    require_success([proc])
    info = tails([proc])
    out = proc.stdout
    assert "launcher   : torchrun" in out and "distributed data-parallel" in out, info
    assert "MULTI_CPU, 2 process(es)" in out, info
    assert "accelerate-state" in out, f"no patch status table\n{info}"
    before, after = held_out_losses(out, 6, info)  # only the main process prints the report
    assert after < before, info
    assert_only_the_demos_output(proc, info)


def test_demo_rejects_invalid_world_size_at_once(tmp_path, home):
    proc = run([sys.executable, "-m", "accel_patch.demo"], worker_env(home, WORLD_SIZE="two"),
               tmp_path, timeout=60)
    info = tails([proc])
    assert proc.returncode == 2, info
    assert "WORLD_SIZE" in proc.stderr and "two" in proc.stderr, info
    assert "Traceback" not in proc.stderr, f"a user-facing error, not a traceback\n{info}"
