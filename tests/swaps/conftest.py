import gc
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernels themselves run, on CPU

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def released():
    """Swapped models of earlier tests are collected, so the RoPE interceptions they held are
    released (their finalizers run) before this test looks at the module globals."""
    gc.collect()
    yield
