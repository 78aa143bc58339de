"""What a test inherits from the host, and what the processes it starts inherit: the one list.

tests/conftest.py removes these variables around every in-process test; `child_env()` builds the
environment of every process a test starts (tests/test_import.py, tests/test_cli.py,
integration_tests/_launch.py). pyproject puts tests/ on sys.path, so integration tests import
this module too.
"""
from __future__ import annotations

import os
import subprocess

from accel_patch.core.topology_resolver import LAUNCHER_VARIABLES

# Set by launchers (torchrun, accelerate, MPI, SLURM, DeepSpeed) or read by accelerate and
# accel-patch: an inherited copy would give a test the runner's own topology or switches.
LAUNCHER_PREFIXES = (
    "TORCHELASTIC_", "ACCELERATE_", "OMPI_", "PMI_", "MV2_", "MPI_LOCAL", "SLURM_", "ROLE_", "GROUP_",
    "FSDP_", "ACCEL_PATCH_",
)
LAUNCHER_NAMES = frozenset(LAUNCHER_VARIABLES) | {
    "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}

# tests/conftest.py sets TRITON_INTERPRET=1 for the in-process kernel tests; a child process runs
# Triton as a user's would, unless the test passes TRITON_INTERPRET itself.
NOT_FOR_CHILDREN = frozenset({"TRITON_INTERPRET"})


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_NAMES or name.startswith(LAUNCHER_PREFIXES)


def child_env(**overrides: str) -> dict[str, str]:
    """The environment for a process a test starts: this one's, without launcher variables and
    without TRITON_INTERPRET, then `overrides` (which may set any of them on purpose)."""
    env = {k: v for k, v in os.environ.items() if not is_launcher_variable(k) and k not in NOT_FOR_CHILDREN}
    env.update(overrides)
    return env


def run_together(commands: dict[str, tuple[list[str], dict[str, str]]], cwd, timeout: float):
    """Start every `name: (argv, env overrides)` at once (in child_env), wait for all, and return
    `name: CompletedProcess`. Call it from a fixture, so that deselected tests start nothing."""
    started = {
        name: subprocess.Popen(argv, cwd=cwd, env=child_env(**env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        for name, (argv, env) in commands.items()
    }
    done = {}
    for name, proc in started.items():
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\n[killed after {timeout} s]"
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done
