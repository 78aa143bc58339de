"""benchmarks/lora.py's summary where a step added no resident memory: said, never a division by 0."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import lora  # noqa: E402


def test_a_ratio_to_a_step_that_added_no_memory_is_not_a_figure():
    assert lora.ratio(3.0, 2.0) == 1.5
    assert lora.ratio(3.0, 0.0) is None and lora.ratio(0.0, 0.0) is None
    assert "n/a" in lora.shown(None) and lora.shown(1.5) == "1.50x"
    assert lora.verdict(None, 0.6) == "n/a" and lora.verdict(0.5, 0.6) == "PASS" and lora.verdict(0.7, 0.6) == "MISS"
