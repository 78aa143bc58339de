import gc

import pytest


@pytest.fixture
def released():
    """Swapped models of earlier tests are collected, so the RoPE interceptions they held are
    released (their finalizers run) before this test looks at the module globals. (A full
    collection costs ~0.3 s here: only the tests that count holders ask for it.)"""
    gc.collect()
    yield
