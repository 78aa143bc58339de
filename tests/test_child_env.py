"""What the processes that tests start inherit (tests/_env.py, `child_env`): never the runner's
launcher variables, and never the Triton interpreter that tests/conftest.py chose for this process.
The integration workers record TRITON_INTERPRET too, and integration_tests/_launch.py checks it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from _env import child_env

# What torchrun, Open MPI, Intel MPI, MVAPICH, SLURM, DeepSpeed and accel-patch's switches set.
LAUNCHED = {
    "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none", "NODE_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "2", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MV2_COMM_WORLD_SIZE": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": "2",
    "ACCELERATE_MIXED_PRECISION": "no", "ACCEL_PATCH_DISABLE": "1",
}


def seen_by_child(env: dict[str, str], *names: str) -> dict:
    code = f"import json, os; print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def test_this_process_runs_triton_under_the_interpreter():
    # tests/conftest.py chose it before triton was imported (kernel tests run on CPU tensors).
    assert os.environ.get("TRITON_INTERPRET") is not None


def test_a_child_does_not_inherit_the_triton_interpreter():
    assert seen_by_child(child_env(), "TRITON_INTERPRET") == {"TRITON_INTERPRET": None}


def test_a_child_gets_the_triton_interpreter_when_the_test_asks():
    assert seen_by_child(child_env(TRITON_INTERPRET="1"), "TRITON_INTERPRET") == {"TRITON_INTERPRET": "1"}


def test_a_child_inherits_no_launcher_variable(monkeypatch):
    for name, value in LAUNCHED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an ordinary variable: inherited
    seen = seen_by_child(child_env(), *LAUNCHED, "OMP_NUM_THREADS")
    assert seen == {**{name: None for name in LAUNCHED}, "OMP_NUM_THREADS": "3"}
