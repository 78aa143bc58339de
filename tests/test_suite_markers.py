"""The suite's selections as README gives them: the quick loop (`-m "not slow"`) leaves out every
audit test (minutes each), though its `-m` replaces addopts' `-m 'not audit'`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collected(files, marks: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", marks, *files], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr  # 5: nothing collected
    return [line for line in proc.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_quick_loop_leaves_out_every_audit_test():
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.audit" in p.read_text() and p.name != Path(__file__).name)
    assert _collected(files, "audit"), files  # the audit tests are there to leave out
    assert _collected(files, "not slow and audit") == []
