"""Bad settings, one rule (docs/cli.md): the source (the settings file or the variable), the
value and the valid values are named, and what happens instead is said. The start-up hook never
raises and never stays silent about a bad file: one line on stderr naming it; `accel-patch env`
and `config --show` describe a bad file instead of crashing on it."""
from __future__ import annotations

import json
import sys

import pytest

from accel_patch import cli
from accel_patch.integrations import config_entry, startup_gate
from accel_patch.swaps import ops

from test_config_cli import site  # noqa: F401  (the fixture: a fake site-packages, HF_HOME in tmp)


def settings_file(accelerate_dir, data: bytes):
    path = accelerate_dir / config_entry.CONFIG_NAME
    path.write_bytes(data)
    return path


def hook(path, capsys):
    """(what the start-up hook says it did, the lines it wrote on stderr)."""
    said = startup_gate.start({"ACCEL_PATCH_CONFIG_FILE": str(path)}, [])
    return said, capsys.readouterr().err.splitlines()


def test_a_settings_file_that_is_not_utf8_is_named_by_the_hook_env_and_show(site, capsys):  # noqa: F811
    path = settings_file(site[2], b"enabled: true\nkernels: rms_norm\xff\n")
    said, err = hook(path, capsys)
    assert said.startswith("off: ") and len(err) == 1, (said, err)
    assert str(path) in err[0] and "not UTF-8" in err[0] and "0xff" in err[0] and "not loaded" in err[0]
    assert cli.main(["config", "--show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"] is None and "not UTF-8" in shown["settings_problem"]
    assert cli.main(["env"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("settings "))
    assert str(path) in line and "unreadable" in line and "(absent)" not in line


@pytest.mark.parametrize("text, said_off, complaint", [
    ("enabled: maybe\n", True, "enabled: 'maybe' is not valid (true or false): accel-patch is not loaded"),
    ("enabled: true\ncallback: maybe\n", False, "callback: 'maybe' is not valid (true or false): the callback stays on"),
    ("enabled: true\nkernel: rms_norm\n", False, "unknown key 'kernel' (valid keys: enabled, kernels, callback): ignored"),
])
def test_a_bad_value_in_the_file_is_one_line_on_stderr_naming_the_file(site, capsys, monkeypatch,  # noqa: F811
                                                                        text, said_off, complaint):
    monkeypatch.setitem(sys.modules, "accel_patch", sys.modules["accel_patch"])  # the hook's import: a no-op
    path = settings_file(site[2], text.encode())
    said, err = hook(path, capsys)
    assert said.startswith("off: ") == said_off, said
    assert len(err) == 1 and err[0].startswith(f"accel-patch: {path}: {complaint}"), err


def test_an_existing_empty_file_is_not_absent_in_env(site, capsys):  # noqa: F811
    path = settings_file(site[2], b"# nothing set\n")
    assert cli.main(["env"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("settings "))
    assert line.endswith(f"{path} (empty: the defaults)"), line


def test_a_bad_kernel_list_from_the_file_is_named_by_the_file_not_the_variable(site, capsys, monkeypatch):  # noqa: F811
    monkeypatch.setitem(sys.modules, "accel_patch", sys.modules["accel_patch"])
    path = settings_file(site[2], b"enabled: true\nkernels: rms_norm,flash\n")
    environ = {"ACCEL_PATCH_CONFIG_FILE": str(path)}
    try:
        assert startup_gate.start(environ, []).startswith("on: ")
        assert ops.ops_from_env(environ) == ("rms_norm",)  # the bad name is skipped, the rest run
        assert ops.bad_names(environ).startswith(
            f"settings file {path} (kernels: rms_norm,flash): unknown kernel op(s) 'flash', skipped; swapping rms_norm")
        environ["ACCEL_PATCH_KERNELS"] = "rms_norm,flesh"  # set by the user: the variable is named
        assert ops.bad_names(environ).startswith("ACCEL_PATCH_KERNELS='rms_norm,flesh': unknown kernel op(s) 'flesh'")
    finally:
        sys.__dict__.pop("accel_patch_settings", None)
