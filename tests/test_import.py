"""`import accel_patch` in a fresh interpreter: cheap, switchable off, never failing.

The interpreters run concurrently, started when this module is collected, from a temporary
directory so that the repository root is not on sys.path.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

import accel_patch
from _env import LAUNCHER_NAMES, LAUNCHER_PREFIXES

PACKAGE_DIR = Path(accel_patch.__file__).resolve().parent

REPORT = """
import json, sys
{body}
print(json.dumps({{
    "heavy": sorted(m for m in ("torch", "transformers", "accelerate") if m in sys.modules),
    "status": {{s.name: [s.state, s.reason] for s in accel_patch.status()}},
    "file": accel_patch.__file__,
    **extra,
}}))
"""

SCRIPTS = {
    "plain": ({}, "import accel_patch\nextra = {}"),
    "disabled": (
        {"ACCEL_PATCH_DISABLE": "1"},
        "import accel_patch\n"
        "import wrapt\n"
        "from accelerate.state import PartialState\n"
        "extra = {'wrapped': [isinstance(PartialState.__dict__[a], wrapt.FunctionWrapper)\n"
        "                     for a in ('__init__', '_prepare_backend')]}",
    ),
    "bad-world-size": (
        {"WORLD_SIZE": "two", "LOCAL_RANK": "-3", "RANK": "1.5"},
        "import accel_patch\nextra = {}",
    ),
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_NAMES and not k.startswith(LAUNCHER_PREFIXES) and k != "PYTHONPATH"}
    env.update(extra)
    return env


def start() -> tuple[str, dict[str, subprocess.Popen]]:
    cwd = tempfile.mkdtemp(prefix="accel-patch-import-")
    return cwd, {
        name: subprocess.Popen(
            [sys.executable, "-c", REPORT.format(body=body)], cwd=cwd, env=clean_env(**env),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for name, (env, body) in SCRIPTS.items()
    }


# Started at collection, so that they run beside the in-process tests (CI boxes have 2 cores).
_STARTED = start()


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    cwd, started = _STARTED
    done = {}
    for name, proc in started.items():
        out, err = proc.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    shutil.rmtree(cwd, ignore_errors=True)
    return done


def report(runs, name: str) -> dict:
    run = runs[name]
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_pulls_in_neither_torch_transformers_nor_accelerate(runs):
    result = report(runs, "plain")
    assert result["heavy"] == []
    assert Path(result["file"]).resolve().parent == PACKAGE_DIR  # the package under test
    assert {name: state for name, (state, _) in result["status"].items()} == {
        "accelerate-state": "pending", "device-map": "pending",
    }


def test_accel_patch_disable_leaves_accelerate_unpatched_and_says_so(runs):
    result = report(runs, "disabled")
    assert result["wrapped"] == [False, False]
    for state, reason in result["status"].values():
        assert state == "disabled" and "ACCEL_PATCH_DISABLE=1" in reason


def test_bad_launcher_values_do_not_fail_the_import(runs):
    result = report(runs, "bad-world-size")  # exit code 0: the import succeeded
    assert result["heavy"] == []
    assert result["status"]["accelerate-state"][0] == "pending"


def test_no_module_of_the_package_is_shadowed():
    # `accel_patch.x` must be the module accel_patch/x.py wherever both exist, so that
    # mock.patch("accel_patch.x.name") patches that module and never a function's attribute.
    for info in pkgutil.iter_modules(accel_patch.__path__):
        module = importlib.import_module(f"accel_patch.{info.name}")
        attribute = getattr(accel_patch, info.name)
        assert attribute is module, (
            f"accel_patch.{info.name} is {attribute!r}, which hides the module accel_patch/{info.name}")
    assert isinstance(accel_patch.topology, types.FunctionType)  # the public function
    assert accel_patch.topology is accel_patch.topology_resolver.topology
