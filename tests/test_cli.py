"""`accel-patch env`, `--version`, `--help`, and `accel-patch demo`'s arguments.

The installed console script runs in fresh processes for a full report and for the error path,
started by the fixture that needs them; the other settings call `main()` in-process, which is
the same code.
"""
from __future__ import annotations

import json
import subprocess
import os
import sys
from pathlib import Path

import pytest

import accel_patch
from accel_patch import cli
from accel_patch.cli import demo, report
from _env import child_env, run_together

SCRIPT = Path(sys.executable).with_name("accel-patch")


def console_script(*argv: str) -> list[str]:
    assert SCRIPT.exists(), f"console script not installed next to {sys.executable}"
    return [str(SCRIPT), *argv]


@pytest.fixture(scope="module")
def torchrun_rank1_report(tmp_path_factory):
    """`accel-patch env --json` as rank 1 of 2 under torchrun (seconds: it imports torch)."""
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "none"}
    return run_together({"env": (console_script("env", "--json"), env)},
                        cwd=tmp_path_factory.mktemp("cli"), timeout=180)["env"]


@pytest.fixture(scope="module")
def quick_runs(tmp_path_factory):
    """Console-script runs that stop before torch is imported."""
    return run_together({
        "bad-world-size": (console_script("env", "--json"), {"WORLD_SIZE": "two"}),
        "version": (console_script("--version"), {}),
    }, cwd=tmp_path_factory.mktemp("cli"), timeout=60)


def json_report(run) -> dict:
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)  # exactly one JSON object, nothing else on stdout


@pytest.mark.slow
def test_env_json_under_torchrun(torchrun_rank1_report):
    report = json_report(torchrun_rank1_report)
    topo = report["topology"]
    assert (topo["world_size"], topo["rank"], topo["local_rank"], topo["launcher"]) == (2, 1, 1, "torchrun")
    assert topo["sources"]["world_size"] == "WORLD_SIZE" and topo["sources"]["local_rank"] == "LOCAL_RANK"
    assert report["is_distributed"] is True
    assert report["versions"]["accel-patch"] == cli.__version__
    assert {s["name"]: s["state"] for s in report["status"]} == {
        "accelerate-state": "active", "device-map": "pending", "kernels": "pending", "trl-fused-head": "pending",
        "trainer-callback": "pending", "experts-interface": "pending"}
    # env imports accelerate but not transformers' models: say why the device map is pending.
    (device_map,) = [s for s in report["status"] if s["name"] == "device-map"]
    assert "binds when `transformers.modeling_utils` is imported" in device_map["reason"]
    if topo["device_count"] == 0:
        assert report["accelerate_state"]["action"] == "cpu-distributed"
        assert report["device_map"] == {"": "cpu"}
    else:
        assert report["accelerate_state"]["action"] == "accelerate"
        assert report["device_map"] == {"": f"{topo['device_type']}:{1 if topo['device_count'] > 1 else 0}"}


def test_env_bad_world_size_is_a_one_line_error_with_exit_code_2(quick_runs):
    run = quick_runs["bad-world-size"]
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr
    assert "WORLD_SIZE='two'" in lines[0] and "whole number" in lines[0]


def test_version_prints_the_package_version(quick_runs):
    run = quick_runs["version"]
    assert (run.returncode, run.stdout, run.stderr) == (0, f"accel-patch {accel_patch.__version__}\n", "")
    assert accel_patch.__version__ == report.versions()["accel-patch"]  # the installed metadata agrees


# --- in-process ---------------------------------------------------------------------------------

@pytest.fixture
def env(monkeypatch, fake_accelerators):
    """A CPU-only box with no launcher: the tests set what they need on top."""
    return monkeypatch


def run_json(capsys, *argv: str) -> dict:
    assert cli.main(["env", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def run_table(capsys) -> str:
    assert cli.main(["env"]) == 0
    return capsys.readouterr().out


def test_env_json_one_plain_process(env, capsys):
    report = run_json(capsys)
    topo = report["topology"]
    assert (topo["world_size"], topo["rank"], topo["launcher"], topo["single_device"]) == (1, 0, "none", True)
    assert report["accelerate_state"]["action"] == "single-device" and report["accelerate_state"]["reason"]
    assert (report["device_map"], report["is_distributed"]) == ({"": "cpu"}, False)
    assert set(report["versions"]) == {"python", "torch", "transformers", "accelerate", "peft",
                                       "bitsandbytes", "triton", "trl", "accel-patch"}
    assert report["versions"]["accel-patch"] == cli.__version__
    assert {s["name"] for s in report["status"]} == {
        "accelerate-state", "device-map", "kernels", "trl-fused-head", "trainer-callback", "experts-interface"}


ENVIRONMENTS = {
    "plain-python": {},
    "blank-values": {"WORLD_SIZE": "", "LOCAL_RANK": " "},
    "openmpi": {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "torchrun-2-nodes": {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1",
                         "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"},
}


@pytest.mark.parametrize("case", list(ENVIRONMENTS))
def test_env_prints_exactly_the_topologys_sources(env, capsys, case):
    for name, value in ENVIRONMENTS[case].items():
        env.setenv(name, value)
    sources = dict(accel_patch.topology().sources)
    assert set(sources) == set(accel_patch.Topology._fields) - {"sources"}  # every field has one

    assert run_json(capsys)["topology"]["sources"] == sources

    lines = run_table(capsys).splitlines()
    for field in report.FIELDS:
        (line,) = [line for line in lines if line.split()[:1] == [field]]
        assert line.endswith(f" from {sources[field]}"), line
    assert any(line.startswith("topology (launcher: ") and line.endswith(f"from {sources['launcher']})")
               for line in lines)


def test_env_table_says_which_variables_were_set_but_blank(env, capsys):
    env.setenv("WORLD_SIZE", "")
    env.setenv("LOCAL_RANK", " ")
    out = run_table(capsys)
    for heading in ("versions", "topology (launcher: none, from default)", "accelerate state: single-device",
                    'device map: {"": "cpu"} (one process)', "patches"):
        assert heading in out
    lines = {line.split()[0]: " ".join(line.split()) for line in out.splitlines() if line.startswith("  ")}
    assert lines["world_size"] == "world_size 1 from default (WORLD_SIZE set but blank: read as unset)"
    assert lines["local_rank"] == "local_rank 0 from default (LOCAL_RANK set but blank: read as unset)"
    assert lines["rank"] == "rank 0 from default"


def test_env_names_the_launcher_and_the_variables(env, capsys):
    for name, value in ENVIRONMENTS["openmpi"].items():
        env.setenv(name, value)
    topo = run_json(capsys)["topology"]
    assert topo["launcher"] == "openmpi"
    sources = dict(topo["sources"])
    assert sources.pop("device_type").startswith("torch") and sources.pop("device_count").startswith("torch")
    assert sources == {
        "world_size": "OMPI_COMM_WORLD_SIZE", "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK", "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "num_nodes": "derived", "launcher": "OMPI_COMM_WORLD_SIZE",
    }
    assert (topo["world_size"], topo["num_nodes"]) == (4, 2)


def test_env_does_not_change_the_environment(env, capsys):
    env.setenv("WORLD_SIZE", "")
    report = run_json(capsys)
    assert report["topology"]["world_size"] == 1
    assert os.environ["WORLD_SIZE"] == ""  # scrubbed in a copy only


def test_env_reports_deepspeed_as_untouched(env, capsys):
    env.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    state = run_json(capsys)["accelerate_state"]
    assert state["action"] == "untouched" and "DeepSpeed" in state["reason"]


def test_env_local_rank_without_device_is_exit_2(env, fake_accelerators, capsys):
    fake_accelerators(2)
    for name, value in {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "3"}.items():
        env.setenv(name, value)
    assert cli.main(["env"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LOCAL_RANK=3" in err and "CUDA_VISIBLE_DEVICES" in err


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "`" not in out
    assert " ".join(cli.DESCRIPTION.split()) in " ".join(out.split())


def test_missing_package_is_shown_as_not_installed(monkeypatch):
    stock = report.metadata.version

    def version(name):
        if name == "bitsandbytes":
            raise report.metadata.PackageNotFoundError(name)
        return stock(name)

    monkeypatch.setattr(report.metadata, "version", version)
    found = report.versions()
    assert found["bitsandbytes"] == "not installed"
    assert found["torch"] != "not installed"


def test_demo_gets_the_remaining_arguments(monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv) or 3)

    assert cli.main(["demo", "--steps", "2", "--help", "extra"]) == 3
    assert seen == [["--steps", "2", "--help", "extra"]]

    monkeypatch.setattr(demo, "main", lambda argv: None)
    assert cli.main(["demo"]) == 0


def test_unknown_command_or_argument_is_a_usage_error(capsys):
    for argv in (["nonsense"], ["env", "--bogus"], []):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2


# --- demo arguments -----------------------------------------------------------------------------

@pytest.fixture
def demo_never_runs(monkeypatch):
    """The demo's arguments are checked before anything is imported or trained."""
    monkeypatch.setattr(demo, "fine_tune", lambda args: pytest.fail(f"the demo ran with {args}"))


@pytest.mark.parametrize("argv, error", [
    (["--steps", "0"], "argument --steps: must be a whole number >= 1 (for example 20), got '0'"),
    (["--steps", "-3"], "argument --steps: must be a whole number >= 1 (for example 20), got '-3'"),
    (["--steps", "two"], "argument --steps: must be a whole number >= 1 (for example 20), got 'two'"),
    (["--steps", "1.5"], "argument --steps: must be a whole number >= 1 (for example 20), got '1.5'"),
    (["--output-dir", ""], "argument --output-dir: must be a directory path, got ''"),
    (["--output-dir", " "], "argument --output-dir: must be a directory path, got ' '"),
], ids=["steps-0", "steps-negative", "steps-word", "steps-fraction", "output-dir-empty", "output-dir-blank"])
def test_demo_bad_argument_is_one_error_line_naming_it(capsys, demo_never_runs, argv, error):
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", *argv])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    usage, message = captured.err.strip().splitlines()  # argparse: the usage, then one error line
    assert usage.startswith("usage: accel-patch demo")
    assert message == f"accel-patch demo: error: {error}"


def test_demo_output_dir_that_is_a_file_is_refused(capsys, demo_never_runs, tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    with pytest.raises(SystemExit):
        demo.main(["--output-dir", str(path)])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"accel-patch demo: error: argument --output-dir: {str(path)!r} exists and is not a directory")


def test_demo_valid_arguments(tmp_path):
    assert demo.parse_args([]).steps == 80
    args = demo.parse_args(["--steps", "1", "--output-dir", str(tmp_path / "new")])
    assert (args.steps, args.output_dir) == (1, str(tmp_path / "new"))


@pytest.mark.slow  # over 2 s: a fresh interpreter
def test_output_into_a_closed_pipe_ends_quietly():
    # `accel-patch env | head -1`: the reader is gone before the report is written.
    proc = subprocess.Popen([sys.executable, "-m", "accel_patch.cli", "env"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=child_env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    code = proc.wait(timeout=60)
    assert err == "", err
    assert code == 141  # stopped by the closed pipe, as `yes | head -1` reports for yes


@pytest.mark.slow
def test_demo_runs_without_peft_as_a_full_fine_tune(tmp_path):
    # The core install has no peft: the main job must still run, and say what it did.
    script = "import sys; sys.modules['peft'] = None\nfrom accel_patch.cli import demo\nsys.exit(demo.main(['--steps', '3']))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(),
                          cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full fine-tuning" in proc.stdout and "pip install 'accel-patch[lora]'" in proc.stdout
    assert "full fine-tune:" in proc.stdout and "Held-out loss" in proc.stdout

