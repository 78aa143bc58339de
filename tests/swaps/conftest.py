import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels themselves run, on CPU

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_probes():
    """Each test probes afresh (a verdict cached by another test must not decide this one)."""
    from accel_patch.swaps import probe

    probe.cache.clear()
    yield
    probe.cache.clear()
