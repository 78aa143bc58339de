"""The benchmark: its correctness guard (a wrong implementation gets no time, only FAILED) and its
report (every figure computed once into the records; tables and JSON read the same records)."""
import json

import torch

from accel_kernels.bench import catalogue, cli, harness, report

TINY = dict(n=64)


def _op(ours):
    return catalogue.Op(
        shapes={"cpu": TINY, "check": TINY},
        make=lambda device, dtype, n: [torch.randn(n, device=device).to(dtype).requires_grad_()],
        eager=lambda x: x.sin(), ours=ours, liger=None, bytes_moved=None,
    )


def test_wrong_output_or_wrong_grad_is_failed_and_not_timed(monkeypatch):
    monkeypatch.setitem(catalogue.OPS, "wrong_output", _op(lambda x: x.sin() * 1.01))
    monkeypatch.setitem(catalogue.OPS, "wrong_grad", _op(lambda x: x.sin().detach() + 0 * x))
    for name in ("wrong_output", "wrong_grad"):
        row = harness.run_one(name, "accel_kernels", "cpu", quick=True)
        assert row["status"] == "FAILED" and "disagrees with eager" in row["note"], row
        assert "fb_ms" not in row


def test_right_implementation_is_timed_and_missing_liger_is_skipped(monkeypatch):
    monkeypatch.setitem(catalogue.OPS, "right", _op(lambda x: torch.sin(x)))
    row = harness.run_one("right", "accel_kernels", "cpu", quick=True)
    assert row["status"] == "ok" and row["fb_ms"] > 0 and row["check_err"] <= harness.CHECK_TOL
    assert harness.run_one("right", "liger", "cpu", quick=True)["status"] == "skipped"


def _row(op, impl, **figures):
    return dict(op=op, impl=impl, status="ok", **figures)


def test_cpu_report_ratios_are_ours_over_eager_in_table_and_json(capsys, tmp_path):
    results = dict(device="cpu", copy_gbs=None, rows=[
        _row("fused_linear_cross_entropy", "accel_kernels", fb_ms=900.0, fwd_mib=50.0, fb_mib=100.0, reps=1),
        _row("fused_linear_cross_entropy", "eager", fb_ms=1000.0, fwd_mib=600.0, fb_mib=800.0, reps=1)])
    report.compute(results)
    ours = results["rows"][0]
    assert ours["time_vs_eager"] == 0.9 and ours["mem_vs_eager"] == 0.125  # lower is better
    assert results["rows"][1]["time_vs_eager"] == 1.0
    assert "fb_gbs" not in ours and "time_vs_liger" not in ours  # GPU-only figures
    assert results["cpu_flce"]["memory_ratio"] == 0.125 and results["cpu_flce"]["memory_verdict"] == "PASS"
    assert results["cpu_flce"]["time_ratio"] == 0.9 and results["cpu_flce"]["time_verdict"] == "PASS"

    report.print_table(results, "fused_linear_cross_entropy")
    report.print_cpu_flce(results)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("impl"))
    assert header.split() == ["impl", "f+b", "ms", "fwd", "MiB", "f+b", "MiB", "t/eager", "mem/eager"]
    assert " 0.90x" in out and " 0.12x" in out and "mem/eager 0.125x" in out and "t/eager 0.90x" in out
    report.write_json(tmp_path / "bench.json", results)
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["time_vs_eager"] == 0.9


def test_gpu_report_bandwidth_and_liger_ratio(capsys):
    op = catalogue.OPS["swiglu"]
    moved = op.bytes_moved(2, **op.shapes["gpu"])
    results = dict(device="cuda", copy_gbs=4000.0, rows=[
        _row("swiglu", "accel_kernels", fwd_ms=1.0, bwd_ms=2.0, fb_ms=3.0, fwd_mib=1.0, bwd_mib=2.0, fb_mib=3.0,
             dev_fwd_ms=0.5, dev_bwd_ms=1.0, dev_fb_ms=1.5),
        _row("swiglu", "eager", fwd_ms=2.0, bwd_ms=4.0, fb_ms=6.0, fwd_mib=2.0, bwd_mib=4.0, fb_mib=6.0),
        dict(op="swiglu", impl="liger", status="skipped", note="not installed")])
    report.compute(results)
    ours = results["rows"][0]
    assert ours["time_vs_eager"] == 0.5 and ours["mem_vs_eager"] == 0.5 and ours["time_vs_liger"] is None
    assert ours["fb_gbs"] == moved / 3e-3 / 1e9 and ours["pct_copy"] == 100 * ours["fb_gbs"] / 4000.0
    # the device time's bandwidth beside the host-inclusive one; none where no device time was measured
    assert ours["dev_fb_gbs"] == moved / 1.5e-3 / 1e9 and ours["dev_pct_copy"] == 2 * ours["pct_copy"]
    assert results["rows"][1]["dev_pct_copy"] is None
    report.print_table(results, "swiglu")
    out = capsys.readouterr().out
    assert "GB/s" in out and "t/liger" in out and "dev %copy" in out and "liger         skipped: not installed" in out


def test_each_timed_call_gets_fresh_inputs_an_implementation_may_write_into():
    """Liger's SwiGLU, GeGLU and RoPE write into their inputs or saved tensors: each call gets new
    leaves with the same values, handed over as non-leaf tensors (a model's projection output)."""
    x = torch.randn(4, 8, requires_grad=True)
    before = x.detach().clone()
    labels = torch.arange(4)
    fresh_x, fresh_labels = harness._fresh([x, labels])
    assert fresh_labels is labels
    assert fresh_x.grad_fn is not None and torch.equal(fresh_x, x)
    fresh_x.transpose(0, 1).mul_(2)  # in place on a view: an error on a leaf that requires grad
    fresh_x.sum().backward()
    assert x.grad is None and torch.equal(x, before)  # the original is untouched
    assert torch.equal(harness._fresh([x])[0], x)


def test_help_states_the_quick_duration(capsys):
    try:
        cli.main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    duration = out[out.index("expected duration of --quick"):]
    assert "on one H200: " in duration and "on CPU: " in duration


def test_the_guard_hands_inputs_over_as_a_model_does_so_in_place_writers_are_checked():
    """An implementation that writes into a view of its input (Liger's RoPE) raises on a leaf that
    requires grad; the guard hands it non-leaf tensors, as a model's projection does."""
    def writes_into_its_input(x):
        x.view_as(x).mul_(1.0)
        return x.sin()

    assert harness.check(_op(writes_into_its_input), writes_into_its_input, "cpu") <= harness.CHECK_TOL
