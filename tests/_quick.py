"""The quick loop's share of a parameter matrix.

`matrix(*axes, quick=...)` gives every combination of the axes as parameters for one
`pytest.mark.parametrize` with several names; a combination for which `quick(*combination)` is
false is marked slow, so `pytest -m "not slow"` runs a share that still reaches every code path of
the test (for a kernel: every shape in float32, each half dtype at one shape) and the whole suite
runs every combination.
"""
from __future__ import annotations

import itertools

import pytest


def matrix(*axes, quick):
    return [combo if quick(*combo) else pytest.param(*combo, marks=pytest.mark.slow)
            for combo in itertools.product(*axes)]
