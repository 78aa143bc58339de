"""The suite's selections as README gives them: the quick loop (`-m "not slow"`) leaves out every
audit test (minutes each), though its `-m` replaces addopts' `-m 'not audit'`."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _collected(files, *marks: str) -> list[list[str]]:
    """The test ids collected over `files` with each of `marks`, the collections run side by side."""
    procs = [subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "-m", m, *files], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for m in marks]
    found = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode in (0, 5), out + err  # 5: nothing collected
        found.append([line for line in out.splitlines() if "::" in line])
    return found


@pytest.mark.slow
def test_the_quick_loop_leaves_out_every_audit_test():
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.audit" in p.read_text() and p.name != Path(__file__).name)
    audit, quick_audit = _collected(files, "audit", "not slow and audit")
    assert audit, files  # the audit tests are there to leave out
    assert quick_audit == []
