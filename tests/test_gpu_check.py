"""benchmarks/gpu_check.sh, the prepared run for a lent GPU, checked here without one: its dry run
runs every step on the CPU at tiny shapes through the same scripts and arguments (each step rc 0,
each writing its JSON); a step that fails, or exits 0 without its JSON, makes the script exit
non-zero; the default steps fit one 10-minute call."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from _env import child_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CALL_S = 600  # one call of the GPU machine


def run(tmp_path, *args, timeout=60, **env) -> subprocess.CompletedProcess:
    environ = child_env()
    environ.update({"OUT": str(tmp_path), "PY": sys.executable, "OMP_NUM_THREADS": "1"}, **env)
    return subprocess.run(["bash", str(SCRIPT), *args], env=environ, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def steps(tmp_path) -> tuple[dict, dict, int]:
    """({step: limit} of every step, of the default ones, BUDGET_S) from `--list`."""
    proc = run(tmp_path, "--list")
    assert proc.returncode == 0, proc.stderr
    every, default, budget = {}, {}, None
    for line in proc.stdout.splitlines():
        name, value, *kind = line.split()
        if name == "BUDGET_S":
            budget = int(value)
            continue
        every[name] = int(value)
        if kind == ["default"]:
            default[name] = int(value)
    return every, default, budget


def reported(stdout: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"^== (\S+): rc=(\d+)", stdout, re.M)}


def test_the_default_steps_fit_one_call_with_margin(tmp_path):
    every, default, budget = steps(tmp_path)
    assert list(default)[:2] == ["versions", "kernel-tests"]  # correctness first
    assert list(default).index("e2e") < list(default).index("lora")
    assert sum(default.values()) <= budget <= CALL_S - 60, (default, budget)
    assert len(default) + 1 <= 8  # one JSON per step and the log: at most 8 files come back


def test_a_failing_step_fails_the_script(tmp_path):
    proc = run(tmp_path, "--dry-run", STEPS="versions", PY="false")  # the step's command exits 1
    assert reported(proc.stdout) == {"versions": 1}, proc.stdout
    assert proc.returncode != 0


def test_a_step_that_writes_no_json_fails_the_script(tmp_path):
    proc = run(tmp_path, "--dry-run", STEPS="versions", PY="true")  # exits 0, writes nothing
    assert reported(proc.stdout) == {"versions": 3}, proc.stdout
    assert "without writing valid JSON" in proc.stdout and proc.returncode != 0


def test_bad_arguments_and_steps_are_refused_by_name(tmp_path):
    proc = run(tmp_path, "--fast")
    assert proc.returncode == 2 and "--fast" in proc.stderr and "--dry-run" in proc.stderr
    proc = run(tmp_path, STEPS="versions e2ee")
    assert proc.returncode == 2 and "'e2ee'" in proc.stderr and "e2e" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # every step's dry run (15 steps, each its own interpreter): past the suite's 300 s a test
def test_the_dry_run_runs_every_step_and_each_writes_its_json(tmp_path):
    """Every step of the table, on this CPU at tiny shapes: two dry runs side by side, each taking
    every other step (the machine's two cores), each exiting 0 with every step's JSON."""
    every, _, _ = steps(tmp_path)
    names = list(every)
    halves = {f"part{i}": names[i::2] for i in range(2)}
    procs = {}
    for part, chosen in halves.items():
        out = tmp_path / part
        out.mkdir()
        environ = child_env()
        environ.update(OUT=str(out), PY=sys.executable, OMP_NUM_THREADS="1", STEPS=" ".join(chosen))
        procs[part] = subprocess.Popen(["bash", str(SCRIPT), "--dry-run"], env=environ, cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for part, proc in procs.items():
        stdout, _ = proc.communicate(timeout=1800)
        out = tmp_path / part
        log = (out / "gpu_check.log").read_text() if (out / "gpu_check.log").exists() else ""
        assert reported(stdout) == dict.fromkeys(halves[part], 0), stdout[-6000:] + log[-6000:]
        assert proc.returncode == 0, stdout[-3000:]
        if len(halves[part]) > 7:  # more than 7 steps come back as one archive (at most 8 files)
            assert os.listdir(out) == ["gpu_check.tar.gz"], os.listdir(out)
            with tarfile.open(out / "gpu_check.tar.gz") as packed:
                packed.extractall(out, filter="data")
            os.remove(out / "gpu_check.tar.gz")
        assert sorted(os.listdir(out)) == sorted([f"{n}.json" for n in halves[part]] + ["gpu_check.log"])
        for name in halves[part]:
            data = json.loads((out / f"{name}.json").read_text())
            assert data, name
            if name in ("kernel-tests", "gpu-tests", "unit-tests"):  # a stale selection collects nothing
                assert data["collected"] > 0 and data["errors"] == 0 and data["exitstatus"] == 0, (name, data)
