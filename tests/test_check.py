"""`accel-patch check`: passes on this machine (Triton under the interpreter), and fails, saying
which and why, when a kernel is broken."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from accel_patch.cli import check

CPU = [torch.device("cpu")]


def rows_by(rows):
    return {(r.name, r.where): r for r in rows}


@pytest.fixture
def broken_kernel_probes():
    """For a test that breaks a kernel on purpose and swaps models meanwhile: it probes afresh, and
    the verdicts cached then (a refused fused LoRA MLP, say) do not outlive it in the process-wide
    cache the suite's later files share on one worker; the verdicts from before are put back, so
    those files need not probe again."""
    from accel_patch.swaps import probe

    before = dict(probe.cache._verdicts)
    probe.cache.clear()
    yield
    probe.cache.clear()
    probe.cache._verdicts.update(before)


@pytest.mark.slow  # over 2 s: every kernel row of the check, interpreted
def test_a_broken_kernel_fails_its_row_with_the_figure(monkeypatch, broken_kernel_probes):
    from accel_kernels.bench import catalogue
    from accel_kernels.ops import rms_norm

    # the broken op's rows alone: every row passing is test_accel_patch_check_passes_here's
    monkeypatch.setattr(catalogue, "OPS", {"rms_norm": catalogue.OPS["rms_norm"]})
    real = rms_norm._forward_triton
    monkeypatch.setattr(rms_norm, "_forward_triton", lambda *a, **k: tuple(
        t * 1.001 if i == 0 else t for i, t in enumerate(real(*a, **k))))
    rows = rows_by(check.check_kernels(CPU))
    broken = rows[("rms_norm", "cpu triton (interpreter)")]
    assert not broken.ok and "exceeds 1e-05 against float64" in broken.detail and broken.figure.startswith("rel err")
    assert rows[("rms_norm", "cpu torch twin")].ok  # the twin is right: the row says which path is wrong
    assert check.main(parts=("kernels",)) == 1


@pytest.mark.slow  # interpreted Triton
def test_the_gpt_oss_experts_row_fails_when_the_clamp_or_the_lora_is_wrong(monkeypatch, broken_kernel_probes):
    import accel_kernels
    from accel_kernels.bench import catalogue

    monkeypatch.setattr(catalogue, "OPS", {"moe_experts_gpt_oss": catalogue.OPS["moe_experts_gpt_oss"]})
    real = accel_kernels.moe_experts
    for broken in (dict(limit=30.0), dict(lora=None)):  # a clamp past the probe's values; LoRA dropped
        monkeypatch.setattr(accel_kernels, "moe_experts", lambda *a, **k: real(*a, **{**k, **broken}))
        rows = check.check_kernels(CPU)
        assert rows and not any(r.ok for r in rows), (broken, rows)


@pytest.mark.slow  # over 2 s: the model rows of the check
def test_a_kernel_with_a_wrong_gradient_fails_the_model_rows(monkeypatch, broken_kernel_probes):
    from accel_kernels.ops import _glu

    real = _glu._backward_triton
    monkeypatch.setattr(_glu, "_backward_triton", lambda *a, **k: tuple(2 * g for g in real(*a, **k)))
    rows = check.check_models(CPU[0], families=["llama", "gpt_neox"])
    llama, neox = rows
    assert not llama.ok and "grads" in llama.detail  # the probe compares outputs; training finds the gradient
    assert neox.ok  # no gated MLP in GPT-NeoX: nothing of the broken kernel runs


def test_launch_rows_name_the_decision():
    rows = check.check_launch()
    assert [r.name for r in rows] == ["topology", "accelerate state", "device map"]
    assert all(r.ok for r in rows) and rows[1].figure == "single-device"


def test_fsdp1_on_a_machine_without_accelerators_fails_the_launch_row_and_engines_are_named(monkeypatch, fake_accelerators):
    for name, value in dict(WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", ACCELERATE_USE_FSDP="true",
                            FSDP_VERSION="1").items():
        monkeypatch.setenv(name, value)
    topology_row, state, device_map = check.check_launch()
    assert not state.ok and state.figure == "fsdp1-without-accelerator" and "--fsdp_version 2" in state.detail
    assert device_map.ok and "FSDP" in device_map.detail and "from_pretrained untouched" in device_map.detail
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert check.check_launch()[1].ok and check.check_launch()[1].figure == "cpu-fsdp"


def test_a_bad_launcher_variable_fails_the_launch_row(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    (row,) = check.check_launch()
    assert not row.ok and "WORLD_SIZE='two'" in row.detail


@pytest.mark.slow
@pytest.mark.audit  # 30-40 s: every family trained and every kernel interpreted, end to end; .ci/run's audit job
def test_accel_patch_check_passes_here():
    from _env import child_env

    proc = subprocess.run([sys.executable, "-m", "accel_patch.cli", "check", "--json"], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    failed = [r for r in report["rows"] if not r["ok"]]
    assert proc.returncode == 0 and report["passed"] and not failed, failed
    kernels = {(r["name"], r["where"]) for r in report["rows"] if r["part"] == "kernels"}
    for op in ("rms_norm", "swiglu", "geglu", "rope", "cross_entropy", "fused_linear_cross_entropy", "moe_experts",
               "moe_experts_gpt_oss"):
        # no GPU here: the check turns the interpreter on itself, so the Triton code was checked, and the twin
        assert {(op, "cpu triton (interpreter)"), (op, "cpu torch twin")} <= kernels, (op, kernels)
    assert {r["name"] for r in report["rows"] if r["part"] == "models"} == set(check.FAMILIES)
