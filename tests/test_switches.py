"""One reading for every on/off switch, and a kernel list whose bad names are said and skipped."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from accel_patch.core import registry, switches
from accel_patch.swaps import ops


@pytest.mark.parametrize("raw, value", [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                                        ("0", False), ("false", False), ("No", False), ("OFF", False),
                                        ("", None), ("  ", None)])
def test_the_usual_spellings_read_as_on_off_or_unset(raw, value):
    assert switches.read("ACCEL_PATCH_X", {"ACCEL_PATCH_X": raw}) is value
    assert switches.read("ACCEL_PATCH_X", {}) is None


def test_any_other_value_is_an_error_naming_the_variable_its_value_and_the_valid_ones():
    with pytest.raises(switches.BadSwitch) as raised:
        switches.read("ACCEL_PATCH_TRL", {"ACCEL_PATCH_TRL": "maybe"})
    assert "ACCEL_PATCH_TRL='maybe'" in str(raised.value) and "1/true/yes/on" in str(raised.value)


def _statuses(value: str) -> tuple[set[str], str]:
    env = {**os.environ, "ACCEL_PATCH_DISABLE": value}
    out = subprocess.run([sys.executable, "-c", "import accel_patch; print({r.state for r in accel_patch.status()})"],
                         env=env, capture_output=True, text=True, check=True)
    return eval(out.stdout), out.stderr


@pytest.mark.parametrize("value", ["on", "True", "yes"])
def test_accel_patch_disable_takes_every_true_spelling(value):
    assert _statuses(value)[0] == {"disabled"}


def test_a_bad_accel_patch_disable_keeps_accel_patch_off_and_says_so():
    states, err = _statuses("maybe")
    assert states == {"disabled"} and "ACCEL_PATCH_DISABLE='maybe' is not a switch value" in err
    assert _statuses("off")[0] != {"disabled"}


class _Probe(registry.Patch):
    name, module, target, verified, switch = "switch-probe", "json", "nothing", "-", "ACCEL_PATCH_SWITCH_PROBE"

    def check(self, module):
        return None

    def install(self, module):
        self.wrap(_Holder, "f", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))


class _Holder:
    def f(self):
        return 1


@pytest.fixture
def probe_patch(monkeypatch):
    patch = _Probe()
    monkeypatch.setattr(registry, "_enabled", True)
    yield patch
    patch.uninstall()
    registry._states.pop(patch.name, None)


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_every_false_spelling_turns_a_patch_off(probe_patch, monkeypatch, value):
    import json

    monkeypatch.setenv("ACCEL_PATCH_SWITCH_PROBE", value)
    registry._bind(probe_patch, json)
    assert not probe_patch.installed and registry._states[probe_patch.name][0] == registry.SKIPPED


def test_a_bad_value_of_an_ordinary_switch_warns_and_keeps_the_patch_on(probe_patch, monkeypatch, caplog):
    import json

    monkeypatch.setenv("ACCEL_PATCH_SWITCH_PROBE", "maybe")
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        registry._bind(probe_patch, json)
    assert probe_patch.installed and "ACCEL_PATCH_SWITCH_PROBE='maybe'" in caplog.text


def test_a_bad_value_of_a_safety_switch_stops_at_its_decision_point(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.state import PartialState

    from accel_patch.patches.accelerate_state import AccelerateStatePatch

    monkeypatch.setenv("ACCEL_PATCH_ACCELERATE", "maybe")
    PartialState._reset_state()
    try:
        with pytest.raises(switches.BadSwitch, match="ACCEL_PATCH_ACCELERATE='maybe'"):
            PartialState()
        with pytest.raises(switches.BadSwitch):
            registry.require_switch(AccelerateStatePatch)
    finally:
        PartialState._reset_state()


def test_a_kernel_list_with_a_bad_name_warns_once_and_the_rest_run(caplog):
    ops._warned.clear()
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        assert ops.ops_from_env({"ACCEL_PATCH_KERNELS": "rms_norm,bogus"}) == ("rms_norm",)
        assert ops.ops_from_env({"ACCEL_PATCH_KERNELS": "rms_norm,bogus"}) == ("rms_norm",)
    assert caplog.text.count("unknown kernel op(s) 'bogus'") == 1
    assert ops.ops_from_env({"ACCEL_PATCH_KERNELS": "bogus"}) == ()
    assert ops.bad_names({"ACCEL_PATCH_KERNELS": "rms_norm,moe"}) is None  # an alias is an op


def test_env_and_check_name_a_bad_kernel_list(monkeypatch):
    from accel_patch.cli import check
    from accel_patch.cli.report import env_report

    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "bogus")
    assert "unknown kernel op(s) 'bogus'" in env_report()["kernel_list_problem"]
    (row,) = check.collect(parts=())
    assert not row.ok and row.name == "ACCEL_PATCH_KERNELS" and "'bogus'" in row.detail
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "rms_norm")
    assert check.collect(parts=()) == [] and env_report()["kernel_list_problem"] is None
