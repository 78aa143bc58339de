"""benchmarks/census.py over the 2026 families (tiny configurations, every op swapped): no swap
raises, and the classes left stock per kind stay within what is known and refused by form
(no norm: the DSA indexers' LayerNorms run layer_norm; Apertus's xIELU MLP and gpt-oss's router wrapper, which is no MLP;
Nemotron-H's non-gated experts; one RoPE class: Granite 4 hybrid's attention, which calls no RoPE
function under its default no-positions configuration). DeepSeek V4's last-dims RoPE and Llama 4's
complex RoPE run the kernel: neither is stock."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _env import child_env

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "census.py"
#: kind -> the most (family, class) pairs left stock
AT_MOST = {"norm": 0, "mlp": 2, "experts": 1, "rope": 1}


@pytest.mark.slow  # about 36 tiny models built and swapped in a child process: ~15 s
def test_the_census_swaps_every_family_without_a_raise_and_leaves_few_classes_stock(tmp_path):
    out = tmp_path / "census.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], env=child_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    raised = [f["family"] for f in data["families"] if f["status"].startswith("swap raised")]
    assert not raised, raised
    built = [f for f in data["families"] if f["status"] == "ok"]
    assert len(built) >= 30, [f["status"] for f in data["families"] if f["status"] != "ok"]
    for kind, most in AT_MOST.items():
        total = data["totals"][kind]
        assert total["stock"] <= most, (kind, total["pairs"])
    stock_rope = {p["cls"] for p in data["totals"]["rope"]["pairs"]}
    assert not stock_rope & {"DeepseekV4Attention", "Llama4TextAttention"}, stock_rope
    # every stock class is refused with a reason, except gpt-oss's MLP (its router and experts
    # wrapper: the experts inside are swapped)
    silent = [p for t in data["totals"].values() for p in t["pairs"] if p["state"] == "silent"]
    assert [p["cls"] for p in silent] in ([], ["GptOssMLP"]), silent
    # the hybrid families' reports name what runs in each mixer
    hybrids = [f for f in built if f["mixers"]]
    assert len(hybrids) >= 12, [f["family"] for f in hybrids]
    assert all(m["runs"] for f in hybrids for m in f["mixers"].values()), hybrids
