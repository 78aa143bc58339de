import os

# The interpreter must be chosen before accel_kernels is imported (its kernels are defined then,
# and keep that mode: accel_kernels._dispatch.interpreting()): every kernel test runs the real
# Triton code on CPU tensors. The top-level tests/conftest.py sets it first for the whole suite;
# this line is for `pytest tests/kernels` run alone. On a GPU machine run with TRITON_INTERPRET=0
# ACCEL_TEST_DEVICE=cuda.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: cpu (Triton interpreter) unless ACCEL_TEST_DEVICE says otherwise."""
    return torch.device(os.environ.get("ACCEL_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def guarded_outputs(monkeypatch):
    """Every kernel output starts as NaN (an element a kernel fails to write fails the test) and
    sits between sentinel guards as long as itself (a write past its extent fails the test
    instead of landing in someone else's memory)."""
    import accel_kernels._dispatch as dispatch

    buffers = []

    def empty(shape, *, dtype, device):
        n = torch.Size(shape).numel()
        guard = max(n, 64)
        buf = torch.full((2 * guard + n,), 7, dtype=dtype, device=device)
        buffers.append((buf, guard))
        out = buf[guard:guard + n].view(shape)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(dispatch, "empty", empty)
    monkeypatch.setattr(dispatch, "empty_like",
                        lambda t, dtype=None: empty(t.shape, dtype=dtype or t.dtype, device=t.device))
    yield
    for buf, guard in buffers:
        assert (buf[:guard] == 7).all() and (buf[-guard:] == 7).all(), "a kernel wrote outside its output"


@pytest.fixture
def unguarded_outputs(monkeypatch):
    """Plain allocations, for tests that measure the size of what an op allocates (the guards
    above triple every buffer)."""
    import accel_kernels._dispatch as dispatch

    monkeypatch.setattr(dispatch, "empty", lambda shape, *, dtype, device: torch.empty(shape, dtype=dtype, device=device))
    monkeypatch.setattr(dispatch, "empty_like", lambda t, dtype=None: torch.empty_like(t, dtype=dtype))


@pytest.fixture(autouse=True)
def untimed_experts_backward(monkeypatch):
    """moe_experts' auto runs its rule, untimed: on a GPU (ACCEL_TEST_DEVICE=cuda) each bf16 test
    would otherwise time both backwards at its own shape (six side runs, and the second backward's
    compile, per test and worker), which tests the policy, not the kernels. The timing's own tests
    turn it on (`timed_here` in test_moe_experts.py)."""
    import accel_kernels.ops.moe_experts as moe

    monkeypatch.setattr(moe, "TIMED_DEVICE_TYPES", ())


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield
