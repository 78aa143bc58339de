"""`accel-patch config`: what it writes, where, what it never touches, and how --remove undoes it.
The hook file and accel-patch's RECORD are redirected to a temporary folder here (the real
site-packages is written only by integration_tests/test_config_entry.py)."""
from __future__ import annotations

import io
import json

import pytest

from accel_patch import cli
from accel_patch.integrations import config_entry


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fake site-packages with accel-patch's RECORD; HF_HOME in the temporary folder."""
    site = tmp_path / "site-packages"
    record = site / "accel_patch-0.1.0.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    record.write_text("accel_patch/__init__.py,sha256=x,1\naccel_patch-0.1.0.dist-info/RECORD,,\n")
    monkeypatch.setattr(config_entry, "hook_path", lambda: site / config_entry.HOOK_NAME)
    monkeypatch.setattr(config_entry, "_record_file", lambda: record)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    accelerate = tmp_path / "hf" / "accelerate"
    accelerate.mkdir(parents=True)
    (accelerate / "default_config.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\n")
    return site, record, accelerate


def test_yes_writes_the_defaults_beside_accelerates_config_and_the_hook_in_site_packages(site, capsys):
    root, record, accelerate = site
    before = (accelerate / "default_config.yaml").read_bytes()
    assert cli.main(["config", "--yes"]) == 0
    out = capsys.readouterr().out
    settings = accelerate / config_entry.CONFIG_NAME
    assert str(settings) in out and "accel-patch config --remove" in out
    assert config_entry.read() == {"enabled": "true", "kernels": "all", "callback": "true"}
    assert (accelerate / "default_config.yaml").read_bytes() == before
    hook = root / config_entry.HOOK_NAME
    assert hook.read_text().startswith("import sys; exec(") and hook.read_text().count("\n") == 1
    assert "accel_patch_startup.pth,," in record.read_text().splitlines()  # pip uninstall removes it


def test_remove_deletes_both_files_and_the_record_line(site, capsys):
    root, record, accelerate = site
    cli.main(["config", "--yes"])
    assert cli.main(["config", "--remove"]) == 0
    assert "removed" in capsys.readouterr().out
    assert not (accelerate / config_entry.CONFIG_NAME).exists() and not (root / config_entry.HOOK_NAME).exists()
    assert "accel_patch_startup.pth" not in record.read_text()
    assert (accelerate / "default_config.yaml").exists()
    assert cli.main(["config", "--remove"]) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_config_file_puts_the_settings_beside_that_file_and_the_hook_knows_it(site, tmp_path):
    root, _, _ = site
    project = tmp_path / "project"
    project.mkdir()
    assert cli.main(["config", "--yes", "--config_file", str(project / "my_accelerate.yaml")]) == 0
    assert (project / config_entry.CONFIG_NAME).is_file()
    assert config_entry._extra_files((root / config_entry.HOOK_NAME).read_text()) == [
        str(project / config_entry.CONFIG_NAME)]


def test_questions_are_asked_and_bad_answers_asked_again(site, monkeypatch, capsys):
    answers = iter(["", "rms_norm, flash", "rms_norm,swiglu", "no"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    assert cli.main(["config"]) == 0
    assert "please answer all, none, or names among" in capsys.readouterr().out
    assert config_entry.read() == {"enabled": "true", "kernels": "rms_norm,glu", "callback": "false"}


def test_no_answer_writes_nothing(site, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert cli.main(["config"]) == 2
    assert "nothing written" in capsys.readouterr().err
    assert config_entry.read() is None and not (site[0] / config_entry.HOOK_NAME).exists()


def test_show_and_env_describe_the_entry(site, capsys):
    cli.main(["config", "--yes"])
    capsys.readouterr()
    assert cli.main(["config", "--show"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["configured"] and shown["hook_installed"] and shown["settings"]["kernels"] == "all"
    assert cli.main(["env", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["config_entry"]
    assert entry["config_file"] == shown["config_file"] and entry["hook_installed"]
    assert entry["this_process"] == "no start-up hook ran in this process"
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "config entry (accel-patch config): configured" in text and config_entry.HOOK_NAME in text


def test_only_one_of_yes_show_remove(site):
    with pytest.raises(SystemExit) as info:
        cli.main(["config", "--yes", "--remove"])
    assert info.value.code == 2


def test_settings_left_without_this_environments_hook_are_reported_plainly(site, capsys):
    # pip uninstall (or a second environment) removes the hook but not the user-wide settings.
    root, _, accelerate = site
    cli.main(["config", "--yes"])
    (root / config_entry.HOOK_NAME).unlink()
    capsys.readouterr()
    assert cli.main(["env"]) == 0
    text = capsys.readouterr().out
    assert "config entry (accel-patch config): configured" not in text
    assert "settings found, but this environment has no start-up hook" in text
    assert "accel-patch config --yes" in text and "accel-patch config --remove" in text
    shown = config_entry.describe()
    assert not shown["configured"] and shown["settings"] and not shown["hook_installed"]


def test_environments_sharing_the_settings_are_named_by_config_env_and_remove(site, tmp_path, monkeypatch, capsys):
    """The settings live per accelerate folder, a hook per environment: a second environment's
    config adds its hook to the list; --remove in it names the first environment's hook it left."""
    first, _, _ = site
    assert cli.main(["config", "--yes"]) == 0
    second = tmp_path / "other-env" / "site-packages"
    second.mkdir(parents=True)
    monkeypatch.setattr(config_entry, "hook_path", lambda: second / config_entry.HOOK_NAME)
    monkeypatch.setattr(config_entry, "_record_file", lambda: None)
    assert cli.main(["config", "--yes"]) == 0
    out = capsys.readouterr().out
    first_hook = str(first / config_entry.HOOK_NAME)
    assert "shared with the other environments" in out and first_hook in out
    assert config_entry.describe()["other_environments"] == [first_hook]
    assert cli.main(["env"]) == 0
    assert f"also read by the start-up hook {first_hook}" in capsys.readouterr().out
    assert cli.main(["config", "--remove"]) == 0
    out = capsys.readouterr().out
    assert "still installed" in out and first_hook in out and str(second / config_entry.HOOK_NAME) in out
    assert (first / config_entry.HOOK_NAME).exists()  # another environment's files are never deleted
    assert not config_entry.environments_path().exists()
