"""`import accel_patch` in a fresh interpreter: cheap, switchable off, never failing; and the
package's names, where a dotted path means one thing.

The interpreters start from a temporary directory (so the repository root is not on sys.path)
when the first test that needs them runs, those of a fixture together.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import types
from pathlib import Path

import pytest

import accel_patch
from _env import run_together

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


def python(body: str) -> list[str]:
    return [sys.executable, "-c", REPORT.format(body=body)]


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Plain imports, which load no heavy module: well under a second."""
    return run_together({
        "plain": (python("import accel_patch\nextra = {}"), {}),
        "bad-world-size": (python("import accel_patch\nextra = {}"),
                           {"WORLD_SIZE": "two", "LOCAL_RANK": "-3", "RANK": "1.5"}),
    }, cwd=tmp_path_factory.mktemp("import"), timeout=120)


@pytest.fixture(scope="module")
def disabled_then_accelerate(tmp_path_factory):
    """ACCEL_PATCH_DISABLE=1, then accelerate imported (seconds: it imports torch)."""
    body = ("import accel_patch\n"
            "import wrapt\n"
            "from accelerate.state import PartialState\n"
            "extra = {'wrapped': [isinstance(PartialState.__dict__[a], wrapt.FunctionWrapper)\n"
            "                     for a in ('__init__', '_prepare_backend')]}")
    return run_together({"disabled": (python(body), {"ACCEL_PATCH_DISABLE": "1"})},
                        cwd=tmp_path_factory.mktemp("import"), timeout=120)["disabled"]


def report(run) -> dict:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_import_pulls_in_neither_torch_transformers_nor_accelerate(imports):
    result = report(imports["plain"])
    assert result["heavy"] == []
    assert Path(result["file"]).resolve().parent == PACKAGE_DIR  # the package under test
    assert {name: state for name, (state, _) in result["status"].items()} == {
        "accelerate-state": "pending", "device-map": "pending", "kernels": "pending", "trl-fused-head": "pending",
        "experts-interface": "pending",
        "trainer-callback": "pending",
    }


def test_pending_patches_say_when_they_bind(imports):
    reasons = {name: reason for name, (_, reason) in report(imports["plain"])["status"].items()}
    assert reasons["device-map"] == (
        "binds when `transformers.modeling_utils` is imported; the demo and any training script import it")
    assert reasons["accelerate-state"].startswith("binds when `accelerate.state` is imported")
    # TRL's patch binds with TRL's trainers, which the demo does not use: its reason says so.
    assert reasons["trl-fused-head"] == (
        "binds when `trl.trainer.utils` is imported: TRL's trainers import it (the demo does not use TRL)")


@pytest.mark.slow
def test_accel_patch_disable_leaves_accelerate_unpatched_and_says_so(disabled_then_accelerate):
    result = report(disabled_then_accelerate)
    assert result["wrapped"] == [False, False]
    for state, reason in result["status"].values():
        assert state == "disabled" and "ACCEL_PATCH_DISABLE=1" in reason


def test_bad_launcher_values_do_not_fail_the_import(imports):
    result = report(imports["bad-world-size"])  # exit code 0: the import succeeded
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
    assert accel_patch.topology is accel_patch.core.topology_resolver.topology
