"""The start-up hook's line, run as site runs it, in fresh interpreters: silent and free unless
configured, accel_patch (and no torch) when configured, never an error, once per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel_patch.integrations import config_entry

REPORT = ("import json, sys; print(json.dumps([getattr(sys, 'accel_patch_startup', None), "
          "[m for m in ('accel_patch', 'torch', 'transformers') if m in sys.modules], "
          "{k: v for k, v in __import__('os').environ.items() if k.startswith('ACCEL_PATCH_')}]))")


def run_hook(tmp_path, env_extra=None, extra_files=(), between=None, pythonpath=None, line=None):
    """Run the hook line (this version's, unless `line` is given) in a fresh interpreter as site
    does (twice, with `between` run in between, when given), then report."""
    line = config_entry._hook_line(list(extra_files)) if line is None else line
    code = line + (between + "\n" + line if between else "") + REPORT
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_PATCH_", "HF_HOME", "XDG_CACHE"))}
    env.update(HF_HOME=str(tmp_path / "hf"), **(env_extra or {}))
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return json.loads(proc.stdout)


def configure(tmp_path, **settings):
    path = tmp_path / "hf" / "accelerate" / config_entry.CONFIG_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k}: {v}\n" for k, v in {**config_entry.DEFAULTS, **settings}.items()))
    return path


def test_not_configured_the_hook_imports_nothing(tmp_path):
    said, modules, env = run_hook(tmp_path)
    assert said == "off: not configured" and modules == [] and env == {}


def test_configured_the_hook_loads_accel_patch_without_torch(tmp_path):
    path = configure(tmp_path)
    said, modules, env = run_hook(tmp_path)
    assert said == f"on: accel_patch loaded at start-up ({path})"
    assert modules == ["accel_patch"]


def test_a_hook_line_written_by_an_earlier_release_still_loads_accel_patch(tmp_path):
    # The .pth `accel-patch config` wrote with 0.1.0 (before the package moved into rooms) stays in
    # site-packages across an upgrade: it must go on working unchanged.
    old = (Path(__file__).parent / "data" / "startup_hook_0.1.0.pth").read_text(encoding="utf-8")
    path = configure(tmp_path)
    said, modules, _ = run_hook(tmp_path, line=old)
    assert said == f"on: accel_patch loaded at start-up ({path})" and modules == ["accel_patch"]
    assert run_hook(tmp_path, line=old, env_extra={"ACCEL_PATCH_DISABLE": "1"})[0] == "off: ACCEL_PATCH_DISABLE is set"


def test_settings_reach_accel_patch_as_its_switches(tmp_path):
    configure(tmp_path, kernels="rms_norm,rope", callback="false")
    _, _, env = run_hook(tmp_path)
    assert env == {"ACCEL_PATCH_KERNELS": "rms_norm,rope", "ACCEL_PATCH_CALLBACK": "0"}
    # a variable the user set wins over the file
    _, _, env = run_hook(tmp_path, {"ACCEL_PATCH_KERNELS": "none"})
    assert env["ACCEL_PATCH_KERNELS"] == "none"


def test_disable_beats_the_configuration(tmp_path):
    configure(tmp_path)
    said, modules, _ = run_hook(tmp_path, {"ACCEL_PATCH_DISABLE": "1"})
    assert said == "off: ACCEL_PATCH_DISABLE is set" and modules == []


def test_enabled_false_loads_nothing(tmp_path):
    path = configure(tmp_path, enabled="false")
    said, modules, _ = run_hook(tmp_path)
    assert said == f"off: {path} says enabled: false" and modules == []


def test_the_hook_runs_once_when_site_processes_it_twice(tmp_path):
    configure(tmp_path, kernels="glu")
    # had the second run decided again, it would have seen ACCEL_PATCH_DISABLE
    said, modules, env = run_hook(tmp_path, between="import os; os.environ['ACCEL_PATCH_DISABLE'] = '1'")
    assert said.startswith("on:") and modules == ["accel_patch"]
    assert env == {"ACCEL_PATCH_KERNELS": "glu", "ACCEL_PATCH_DISABLE": "1"}


def test_a_config_file_named_with_config_file_is_found(tmp_path):
    elsewhere = tmp_path / "project" / config_entry.CONFIG_NAME
    elsewhere.parent.mkdir()
    elsewhere.write_text("enabled: true\n")
    said, modules, _ = run_hook(tmp_path, extra_files=[str(elsewhere)])
    assert said == f"on: accel_patch loaded at start-up ({elsewhere})" and modules == ["accel_patch"]


def test_a_broken_accel_patch_never_breaks_the_interpreter_start(tmp_path):
    configure(tmp_path)
    broken = tmp_path / "broken" / "accel_patch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('half-uninstalled')\n")
    said, modules, _ = run_hook(tmp_path, pythonpath=str(broken.parent))
    assert said.startswith("failed: ") and "accel_patch" not in modules  # and exit code 0, nothing on stderr


@pytest.mark.parametrize("settings, kernels_env", [({"kernels": "all"}, None), ({"kernels": "none"}, "none")])
def test_kernels_setting(tmp_path, settings, kernels_env):
    configure(tmp_path, **settings)
    _, _, env = run_hook(tmp_path)
    assert env.get("ACCEL_PATCH_KERNELS") == kernels_env
