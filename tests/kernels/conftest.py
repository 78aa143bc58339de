import os

# The interpreter must be chosen before triton is imported: every kernel test runs the real
# Triton code on CPU tensors. On a GPU machine run with TRITON_INTERPRET=0 ACCEL_TEST_DEVICE=cuda.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests run on: cpu (Triton interpreter) unless ACCEL_TEST_DEVICE says otherwise."""
    return torch.device(os.environ.get("ACCEL_TEST_DEVICE", "cpu"))


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Every kernel output starts as NaN, so an element a kernel fails to write fails the test."""
    import accel_kernels._dispatch as dispatch

    monkeypatch.setattr(dispatch, "poison_outputs", True)
    yield


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)
    yield
