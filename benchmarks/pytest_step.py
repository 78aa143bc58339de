"""Run pytest as one step of benchmarks/gpu_check.sh: pytest's own output, plus a JSON summary.

    python3 benchmarks/pytest_step.py --json out/kernel-tests.json --per-test 60 -- -q -m "not slow" tests/kernels

Everything after `--` goes to pytest unchanged. `--per-test S` stops a test after S seconds: through
pytest-timeout where it is installed (`--timeout S`), else by SIGALRM here (a test's call, setup and
teardown each), so one hanging test cannot take the step's whole limit on an image without it. The JSON (collected, passed, failed, skipped,
errors, the ids of failed tests with the first line of their error, pytest's exit status,
seconds) is written after collection and again after every test, so a step stopped by its time
limit keeps the results it had. The exit status is pytest's: a step that collected nothing
(pytest's 5) fails, as an empty selection means the step is stale.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import time

import pytest


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

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        """Under pytest-xdist (-n N) the workers collect, each the whole selection."""
        self.data["collected"] = max(self.data["collected"], len(ids))
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


class _Alarm:
    """A per-test time limit by SIGALRM (setup, call and teardown each), where pytest-timeout is not
    installed: the test fails with a TimeoutError and the run goes on."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def _expired(self, signum, frame):
        raise TimeoutError(f"over the per-test limit of {self.seconds} s (benchmarks/pytest_step.py)")

    def _limited(self):
        signal.signal(signal.SIGALRM, self._expired)
        signal.alarm(self.seconds)
        try:
            yield
        finally:
            signal.alarm(0)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._limited()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._limited()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._limited()


def _first_line(report) -> str:
    text = str(report.longrepr or "")
    lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines() or [""]
    return lines[0][:300]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", required=True, help="where the summary goes")
    p.add_argument("--per-test", type=int, metavar="S", help="seconds a test may take")
    args = p.parse_args(ours)
    summary = Summary(args.json, theirs)
    plugins = [summary]
    if args.per_test:
        if importlib.util.find_spec("pytest_timeout"):
            theirs = [*theirs, "--timeout", str(args.per_test)]
            summary.data["per_test_limit"] = f"{args.per_test} s (pytest-timeout)"
        else:
            plugins.append(_Alarm(args.per_test))
            summary.data["per_test_limit"] = f"{args.per_test} s (SIGALRM: pytest-timeout is not installed)"
    summary.write()
    status = pytest.main(theirs, plugins=plugins)
    summary.data["exitstatus"] = int(status)
    summary.write()
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
