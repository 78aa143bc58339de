"""Run pytest as one step of benchmarks/gpu_check.sh: pytest's own output, plus a JSON summary.

    python3 benchmarks/pytest_step.py --json out/kernel-tests.json -- -q -m "not slow" tests/kernels

Everything after `--` goes to pytest unchanged. The JSON (collected, passed, failed, skipped,
errors, the ids of failed tests with the first line of their error, pytest's exit status,
seconds) is written after collection and again after every test, so a step stopped by its time
limit keeps the results it had. The exit status is pytest's: a step that collected nothing
(pytest's 5) fails, as an empty selection means the step is stale.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


class Summary:
    """A pytest plugin that keeps the counts and writes them to `path` as they change."""

    def __init__(self, path: str, args: list[str]) -> None:
        self.path, self.start = path, time.monotonic()
        self.data = dict(args=args, collected=0, passed=0, failed=0, skipped=0, errors=0, failures=[],
                         exitstatus=None, seconds=0.0, finished=False)

    def write(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self.start, 1)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)

    def pytest_collectreport(self, report):
        if report.failed:
            self.data["errors"] += 1
            self.data["failures"].append(f"{report.nodeid or '(collection)'}: {_first_line(report)}")

    def pytest_collection_finish(self, session):
        self.data["collected"] = len(session.items)
        self.write()

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed) or (
                report.when == "teardown" and report.failed):
            if report.passed:
                self.data["passed"] += 1
            elif report.skipped:
                self.data["skipped"] += 1
            else:
                self.data["failed" if report.when == "call" else "errors"] += 1
                self.data["failures"].append(f"{report.nodeid} ({report.when}): {_first_line(report)}")
            self.write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.data["exitstatus"] = int(exitstatus)
        self.data["finished"] = True
        self.write()


def _first_line(report) -> str:
    text = str(report.longrepr or "")
    lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines() or [""]
    return lines[0][:300]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", required=True, help="where the summary goes")
    args = p.parse_args(ours)
    import pytest

    summary = Summary(args.json, theirs)
    summary.write()
    status = pytest.main(theirs, plugins=[summary])
    summary.data["exitstatus"] = int(status)
    summary.write()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
