"""benchmarks/gpu_check.sh, the prepared run for a lent GPU, checked here without one: its dry run
runs each step on the CPU at tiny shapes through the same scripts and arguments (each step rc 0,
each writing its JSON: every step, in .ci/run's audit job); a step that fails, or exits 0 without
its JSON, makes the script exit non-zero; the default steps run in order of value inside one
10-minute call, BUDGET_S cutting or skipping the steps that would pass it, and the output ends with
the summary table (benchmarks/summary.py)."""
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
    environ.update({"OUT": str(tmp_path), "PY": sys.executable, "OMP_NUM_THREADS": "1",
                    "WHEELS": str(tmp_path / "no-wheels")}, **env)
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


def test_the_default_steps_run_in_order_of_value_inside_one_call(tmp_path):
    every, default, budget = steps(tmp_path)
    order = list(default)
    # correctness first (the CUDA tests), then the e2e steps; the short single-op figures before the
    # long compile, whose cold Inductor cache may take its whole limit
    assert order[:5] == ["versions", "kernel-tests", "gpu-tests", "e2e", "lora"]
    assert order.index("flce") < order.index("e2e-compile") and order.index("moe-op") < order.index("e2e-compile")
    assert order.index("e2e-compile") < order.index("bench") < order.index("moe") < order.index("qlora")
    assert budget <= CALL_S - 60, budget  # the wheels' install and the summary fit beside it
    # the most valuable steps are never cut by BUDGET_S; every step's limit fits the budget alone
    assert sum(default[s] for s in order[:5]) <= budget, (default, budget)
    assert all(limit <= budget for limit in every.values()), every


@pytest.mark.slow  # 3.4 s
def test_a_step_that_would_pass_the_budget_is_cut_to_what_is_left_or_not_started(tmp_path):
    slow = tmp_path / "slow_python"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    proc = run(tmp_path, STEPS="versions", PY=str(slow), BUDGET_S="3", MIN_STEP_S="1")
    assert reported(proc.stdout) == {"versions": 124}, proc.stdout  # cut to 3 s, not its 20
    assert "cut to" in proc.stdout and "by BUDGET_S" in proc.stdout and proc.returncode != 0
    proc = run(tmp_path, STEPS="versions kernel-tests", PY=str(slow), BUDGET_S="3", MIN_STEP_S="5")
    assert reported(proc.stdout) == {"versions": 125, "kernel-tests": 125}, proc.stdout
    assert "not started" in proc.stdout and proc.returncode != 0


@pytest.mark.slow  # 2.2 s
def test_the_output_ends_with_the_summary_table(tmp_path):
    proc = run(tmp_path, "--dry-run", STEPS="versions", timeout=120)
    assert reported(proc.stdout) == {"versions": 0}, proc.stdout + proc.stderr
    tail = proc.stdout[proc.stdout.index("===== SUMMARY"):]
    assert "steps: versions rc=0" in tail and tail.splitlines()[-1].startswith("step ")
    assert "===== SUMMARY" in (tmp_path / "gpu_check.log").read_text()


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
        expected = [f"{n}.json" for n in halves[part]] + ["gpu_check.log"] + (
            ["profile.json"] if "e2e" in halves[part] else [])  # e2e's profiles
        if len(expected) > 8:  # more than 8 files come back as one archive (at most 8 files)
            assert os.listdir(out) == ["gpu_check.tar.gz"], os.listdir(out)
            with tarfile.open(out / "gpu_check.tar.gz") as packed:
                packed.extractall(out, filter="data")
            os.remove(out / "gpu_check.tar.gz")
        assert sorted(os.listdir(out)) == sorted(expected)
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


def summary():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import summary as module
    finally:
        sys.path.pop(0)
    module.ROWS.clear()
    return module


def _e2e_variant(name, tokens_per_s, peak, loss=2.0, grad_norm=1.0):
    return {"variant": name, "tokens_per_s": tokens_per_s, "peak_growth_mib": peak, "loss": loss, "grad_norm": grad_norm}


def test_the_summary_judges_each_variant_against_the_user_s_alternative(tmp_path, capsys):
    """benchmarks/summary.py: accel-patch against stock and Liger, a wrong loss said, a Liger that
    raised shown with its error, a memory-bound op by its device time's share of the copy bandwidth."""
    e2e = {"loss_bound": 2e-2, "grad_bound": 5e-2, "rows": [
        {"run": "full", "stock": _e2e_variant("stock", 1000, 100), "swapped": _e2e_variant("swapped", 1400, 50),
         "liger": _e2e_variant("liger", 1300, 60)},
        {"run": "LoRA r=16", "stock+lora": _e2e_variant("stock+lora", 1000, 100),
         "swapped+lora": _e2e_variant("swapped+lora", 1500, 50, loss=2.5),
         "liger+lora": {"variant": "liger+lora", "error": "RuntimeError: in-place view"}}]}
    bench = {"rows": [
        {"op": "rms_norm", "impl": "accel_kernels", "status": "ok", "fb_ms": 0.2, "dev_fb_ms": 0.05, "fb_mib": 1.0,
         "pct_copy": 20.0, "dev_pct_copy": 80.0, "time_vs_eager": 0.5, "time_vs_liger": 0.9},
        {"op": "swiglu", "impl": "accel_kernels", "status": "ok", "fb_ms": 0.2, "dev_fb_ms": 0.1, "fb_mib": 1.0,
         "pct_copy": 20.0, "dev_pct_copy": 40.0, "time_vs_eager": 0.5, "time_vs_liger": 1.1}]}
    moe_op = {"auto": "triton", "tiles": {"block_m": 128}, "rows": [
        {"variant": "grouped_mm (transformers)", "forward_ms": 1.8, "backward_ms": 2.4, "total_ms": 4.2},
        {"variant": "ours auto", "forward_ms": 0.6, "backward_ms": 2.6, "total_ms": 3.2},
        {"variant": "ours triton, small tiles", "forward_ms": 1.4, "backward_ms": 3.8, "total_ms": 5.2}]}
    for name, data in (("e2e", e2e), ("bench", bench), ("moe-op", moe_op)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    module = summary()
    module.main(["--out", str(tmp_path), "--steps", "e2e:0:80 bench:0:60 moe-op:0:30 moe:125:0"])
    rows = {(r[0], r[1]): r for r in module.ROWS}
    full = rows[("e2e full", "accel-patch")]
    assert full[4] == "1.40x" and "loss OK PASS >= 1.35x" in full[6] and "PASS vs Liger 1.08x" in full[6]
    assert "peak/Liger 0.83x PASS" in full[6]
    lora = rows[("e2e LoRA", "accel-patch+lora")]
    assert "loss WRONG" in lora[6] and "peak MISS <= 0.3x" in lora[6]  # 0.5x peak: the 0.3x target missed
    assert "FAILED: RuntimeError: in-place view" in rows[("e2e LoRA", "Liger+lora")][6]
    assert "dev 80% copy PASS" in rows[("bench", "rms_norm")][6]
    assert "dev 40% copy MISS" in rows[("bench", "swiglu")][6]
    auto = rows[("moe-op", "auto")]
    assert auto[4] == "0.76x" and "bwd 1.08x MISS <= 1.0x" in auto[6] and "both PASS <= 0.8x" in auto[6]
    assert rows[("moe-op", "triton, small")][4] == "1.24x" and rows[("moe-op", "transformers")][6].startswith("baseline")
    assert "not started" in rows[("moe", "")][6]
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("moe") and "===== SUMMARY" in out


GROUP_CHILD = """import json, os, sys
for v in sys.argv[1].split(","):
    if v == "dies":
        sys.stderr.write("RuntimeError: CUDA error: an illegal memory access was encountered\\n")
        sys.stderr.flush()
        os._exit(7)
    print(json.dumps({"variant": v, "pid": os.getpid()}), flush=True)
"""


def test_variants_run_together_and_a_process_that_dies_loses_only_its_variant(tmp_path):
    """benchmarks/_children.py run_each: one process for the group; the variant a process died in
    is an error row with the cause's line, the ones after it run in a fresh process."""
    _children = children()
    script = tmp_path / "group.py"
    script.write_text(GROUP_CHILD)
    results = list(_children.run_each(["a", "b", "dies", "c"], lambda group: [sys.executable, str(script), ",".join(group)],
                                      {"PATH": os.environ["PATH"]}, together=True))
    assert [r["variant"] for r in results] == ["a", "b", "dies", "c"]
    assert results[0]["pid"] == results[1]["pid"] != results[3]["pid"]
    assert results[2]["error"].startswith("process exit 7: RuntimeError: CUDA error: an illegal memory access")
    alone = list(_children.run_each(["a", "b"], lambda group: [sys.executable, str(script), ",".join(group)],
                                    {"PATH": os.environ["PATH"]}, together=False))
    assert alone[0]["pid"] != alone[1]["pid"]
