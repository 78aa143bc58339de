"""The benchmark's correctness guard: a wrong implementation gets no time, only FAILED."""
import torch

from accel_kernels import bench

TINY = dict(n=64)


def _op(ours):
    return bench.Op(
        shapes={"cpu": TINY, "check": TINY},
        make=lambda device, dtype, n: [torch.randn(n, device=device).to(dtype).requires_grad_()],
        eager=lambda x: x.sin(), ours=ours, liger=None, bytes_moved=None,
    )


def test_wrong_output_or_wrong_grad_is_failed_and_not_timed(monkeypatch):
    monkeypatch.setitem(bench.OPS, "wrong_output", _op(lambda x: x.sin() * 1.01))
    monkeypatch.setitem(bench.OPS, "wrong_grad", _op(lambda x: x.sin().detach() + 0 * x))
    for name in ("wrong_output", "wrong_grad"):
        row = bench.run_one(name, "accel_kernels", "cpu", quick=True)
        assert row["status"] == "FAILED" and "disagrees with eager" in row["note"], row
        assert "fb_ms" not in row


def test_right_implementation_is_timed_and_missing_liger_is_skipped(monkeypatch):
    monkeypatch.setitem(bench.OPS, "right", _op(lambda x: torch.sin(x)))
    row = bench.run_one("right", "accel_kernels", "cpu", quick=True)
    assert row["status"] == "ok" and row["fb_ms"] > 0 and row["check_err"] <= bench.CHECK_TOL
    assert bench.run_one("right", "liger", "cpu", quick=True)["status"] == "skipped"
