"""benchmarks/gpu_check.sh, the prepared run for a lent GPU, checked here without one: its dry run
runs each step on the CPU at tiny shapes through the same scripts and arguments (each step rc 0,
each writing its JSON: every step, in .ci/run's audit job); a step that fails, or exits 0 without
its JSON, makes the script exit non-zero; the default steps fit one 10-minute call."""
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
@pytest.mark.audit  # every step's dry run (the default steps' among them): ~3 min of CPU, .ci/run's audit job
@pytest.mark.timeout(900)
def test_the_dry_run_runs_every_step_and_each_writes_its_json(tmp_path):
    """Every step of the table, on this CPU at tiny shapes: two dry runs side by side, each taking
    every other step (the machine's two cores), each exiting 0 with every step's JSON."""
    every, _, _ = steps(tmp_path)
    names = list(every)
    _dry_runs(tmp_path, {f"part{i}": names[i::2] for i in range(2)})


def _dry_runs(tmp_path, halves: dict[str, list[str]]) -> None:
    """One `--dry-run` per entry of `halves` (name -> its steps), side by side; each must exit 0
    with every step's JSON (and an archive where more than 7 come back)."""
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


def children():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _children
    finally:
        sys.path.pop(0)
    return _children


CHILD = """import json, os, sys
print("noise")
print(json.dumps({"argv": sys.argv[1:], "seen": os.environ.get("SEEN"), "parent": os.environ.get("PARENT_ONLY")}))
if sys.argv[1] == "raise":
    raise RuntimeError("child failed")
sys.exit(int(sys.argv[1]))
"""


def test_a_dry_run_forks_each_variant_with_its_own_command_line_environment_and_exit_code(tmp_path, monkeypatch):
    """benchmarks/_children.py: what a forked child gives back is what a fresh process would."""
    _children = children()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    monkeypatch.setattr(_children, "PRELOAD", ())  # the mechanics, not the imports it saves
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PARENT_ONLY", "1")
    cmd = [sys.executable, str(script), "3", "--flag"]
    assert _children.forks(cmd, dry=True)
    pid = os.getpid()
    proc = _children.run(cmd, {"SEEN": "yes"}, dry=True)
    assert os.getpid() == pid and os.environ["PARENT_ONLY"] == "1"  # the parent goes on, untouched
    assert proc.returncode == 3, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"argv": ["3", "--flag"], "seen": "yes", "parent": None}
    raised = _children.run([sys.executable, str(script), "raise"], {}, dry=True)
    assert raised.returncode == 1 and "RuntimeError: child failed" in raised.stderr
    # a measured run, more than one thread, or `python -m`: a fresh interpreter
    assert not _children.forks(cmd, dry=False)
    assert not _children.forks([sys.executable, "-m", "json.tool"], dry=True)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert not _children.forks(cmd, dry=True)
    fresh = _children.run(cmd, {"SEEN": "fresh", "PATH": os.environ["PATH"]}, dry=True)
    assert fresh.returncode == 3 and json.loads(fresh.stdout.splitlines()[-1])["seen"] == "fresh"


def test_the_conftest_xdist_hooks_are_optional_where_the_gpu_image_lacks_pytest_xdist(request):
    """gpu_check's pytest steps run on an image without pytest-xdist: a hook of it that is not
    optional stops every collection there ("unknown hook")."""
    path = ROOT / "tests" / "conftest.py"
    conftest = next(p for p in request.config.pluginmanager.get_plugins()
                    if getattr(p, "__file__", None) and Path(p.__file__).resolve() == path)
    hooks = [name for name in dir(conftest) if name.startswith("pytest_xdist_")]
    assert hooks
    for name in hooks:
        assert getattr(getattr(conftest, name), "pytest_impl", {}).get("optionalhook"), name
