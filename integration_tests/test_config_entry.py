"""The accelerate-config entry end to end: after `accel-patch config --yes`, an unmodified Trainer
script (it never imports accel_patch) started by `accelerate launch --multi_gpu` or torchrun loads
accel-patch at start-up and trains as one DDP job; `accelerate env` still works; after
`accel-patch config --remove` no Python start loads anything of it.

The start-up hook is a real .pth file in this environment's site-packages while a test runs; the
fixture removes it whatever happens, and refuses to run where accel-patch is configured already.
"""
import subprocess
import sys

import pytest

from _launch import (WORKER, accelerate_cmd, assert_ddp_in_sync, free_port, read_ranks, require_success, run,
                     summary, torchrun_cmd, worker_env)

CLI = [sys.executable, "-m", "accel_patch.cli"]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
ARGS = ["--seed-per-rank", "--without-import"]


@pytest.fixture
def entry(tmp_path, home):
    from accel_patch.integrations import config_entry

    if config_entry.hook_path().exists():
        pytest.skip(f"{config_entry.hook_path()} exists: accel-patch is configured in this environment")
    env = worker_env(home)
    # accelerate's own config first (as `accelerate config` would leave it): ours must not disturb it
    require_success([run([*ACCELERATE, "config", "default"], env, tmp_path)])
    accelerate_config = home / "accelerate" / "default_config.yaml"
    before = accelerate_config.read_bytes()

    def cli(*argv):
        proc = subprocess.run([*CLI, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    try:
        yield cli, env, accelerate_config, before
    finally:
        cli("config", "--remove")


def launch(kind, out_dir, env, tmp_path):
    cmd = (accelerate_cmd(["--out", str(out_dir), *ARGS], nproc=2, port=free_port()) if kind == "accelerate"
           else torchrun_cmd(["--out", str(out_dir), *ARGS], nproc=2, port=free_port()))
    proc = run(cmd, env, tmp_path)
    require_success([proc])
    return read_ranks(out_dir, 2, [proc])


@pytest.mark.parametrize("kind", ["accelerate", "torchrun"])
def test_configured_entry_loads_accel_patch_in_an_unmodified_script_and_remove_undoes_it(
        tmp_path, entry, kind):
    cli, env, accelerate_config, before = entry
    written = cli("config", "--yes")
    assert "accel_patch_config.yaml" in written and "accel_patch_startup.pth" in written
    assert accelerate_config.read_bytes() == before  # accelerate's file is never written
    if kind == "accelerate":  # what follows does not depend on the launcher: checked once (5-10 s each)
        env_out = subprocess.run([*ACCELERATE, "env"], env=env, cwd=tmp_path, capture_output=True, text=True,
                                 timeout=120)
        assert env_out.returncode == 0 and "`Accelerate` version" in env_out.stdout, env_out.stderr
        assert "`Accelerate` default config:" in env_out.stdout and "distributed_type" in env_out.stdout  # its file

    results = launch(kind, tmp_path / "on", env, tmp_path)
    info = summary(results)
    for res in results:
        assert res["accel_patch_loaded"] and res["startup"].startswith("on: accel_patch loaded"), info
        assert res["swap"] == "rms_norm 5, rope 2, glu+tiled 2, fused_linear_cross_entropy 1", info
    assert_ddp_in_sync(results)

    cli("config", "--remove")
    if kind != "accelerate":
        return
    # the hook was a .pth run at every interpreter start, whatever the launcher: a Python start
    # that imports what a training script imports loads nothing of accel-patch any more
    probe = ("import sys, accelerate, transformers.trainer; "
             "print(getattr(sys, 'accel_patch_startup', None), 'accel_patch' in sys.modules)")
    said = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert said.returncode == 0 and said.stdout.split() == ["None", "False"], (said.stdout, said.stderr[-2000:])


def test_pip_uninstall_leaves_nothing_that_runs_at_start_up(tmp_path):
    """In a throwaway environment with accel-patch installed as a wheel (no dependencies: the
    config entry needs none): configure, uninstall, and no Python start runs anything of it."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip", "-q"]
    subprocess.run([*pip, "install", "--no-deps", str(repo)], check=True, timeout=300, capture_output=True)
    env = worker_env(tmp_path / "hf")
    probe = [str(python), "-c", "import sys; print(getattr(sys, 'accel_patch_startup', None))"]
    subprocess.run([str(venv / "bin" / "accel-patch"), "config", "--yes"], env=env, check=True, timeout=120,
                   capture_output=True)
    said = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120).stdout.strip()
    assert said.startswith("on: accel_patch loaded at start-up"), said
    subprocess.run([*pip, "uninstall", "-y", "accel-patch"], check=True, timeout=120, capture_output=True)
    site = next(venv.glob("lib/python*/site-packages"))
    assert not list(site.glob("accel_patch*")), list(site.glob("accel_patch*"))
    assert (tmp_path / "hf" / "accelerate" / "accel_patch_config.yaml").exists()  # the settings stay, inert
    said = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=120).stdout.strip()
    assert said == "None"
