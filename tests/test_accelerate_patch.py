"""The distributed-aware patch of accelerate's PartialState, and the patch registry under it.

The decision table of DESIGN.md through `decide()` (device counts faked in-process), then the
real `PartialState()` built in this process wherever that cannot hang on a CPU box: one process,
a 1-rank gloo group, or a group request that is recorded and refused (mpirun/srun with GPUs).
Multi-process runs are in integration_tests/. tests/conftest.py removes the host's launcher
variables around every test and restores os.environ after it.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import socket
import sys
import types
import uuid

import pytest
import torch
import torch.distributed as dist
import wrapt
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import DistributedType

import accel_patch
from accel_patch import TopologyError, topology
from accel_patch.core import registry
from accel_patch.core.accelerate_decision import (
    ACCELERATE, CPU_DISTRIBUTED, CPU_FSDP, EXPORT_LAUNCHER_ENV, FSDP1_WITHOUT_ACCELERATOR, SINGLE_DEVICE, UNTOUCHED,
    decide,
)
from accel_patch.patches import accelerate_state

PATCHES = set(p.name for p in accel_patch.status())  # the package's own, before tests add fakes


def reset_accelerate() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    AcceleratorState._reset_state(True)  # also PartialState's
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def isolated():
    """No accelerate state, no process group, a freshly bound patch; and all of it (plus the
    registry and torch's thread count) as it was afterwards."""
    saved_threads = torch.get_num_threads()
    reset_accelerate()
    accel_patch.disable()
    accel_patch.enable()
    yield
    reset_accelerate()
    for name in set(registry._patches) - PATCHES:  # fakes registered by a test
        registry._patches.pop(name)
        registry._states.pop(name, None)
        registry._logged.discard(name)
    accel_patch.disable()
    accel_patch.enable()
    torch.set_num_threads(saved_threads)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun_env(monkeypatch, nproc: int = 1, rank: int = 0, **extra: str) -> None:
    """What `torchrun --nproc_per_node=<nproc>` gives its worker `rank` on one node."""
    env = dict(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", GROUP_WORLD_SIZE="1", TORCHELASTIC_RUN_ID="none",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(),
    )
    env.update(extra)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def record(name: str = "accelerate-state") -> registry.PatchStatus:
    return next(s for s in accel_patch.status() if s.name == name)


def wrappers_on(owner: type, attr: str) -> int:
    """How many wrapt wrappers sit on the attribute in the owner's own __dict__."""
    obj, depth = owner.__dict__[attr], 0
    while isinstance(obj, wrapt.FunctionWrapper):
        obj, depth = obj.__wrapped__, depth + 1
    return depth


# --- the decision table, through decide() -------------------------------------------------------

TORCHRUN_VARS = {"TORCHELASTIC_RUN_ID": "none", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def torchrun_vars(world: int, rank: int, local_rank: int, local_world: int, nodes: int = 1) -> dict:
    return dict(TORCHRUN_VARS, WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(local_world), GROUP_WORLD_SIZE=str(nodes))


OMPI_4 = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
          "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
PMI_4 = {"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
MV2_2 = {"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "1",
         "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1"}
SLURM_STEP_4 = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "1",
                "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2"}
SBATCH_ONLY = {"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "1"}
DEEPSPEED_4 = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2",
               "LOCAL_SIZE": "2"}
ACCELERATE_MULTI_GPU = dict(torchrun_vars(2, 1, 1, 2), ACCELERATE_MIXED_PRECISION="no")

# id: (environment, local device count, cpu argument, expected action)
DECISIONS = {
    "plain-python-cpu": ({}, 0, False, SINGLE_DEVICE),
    "plain-python-one-gpu": ({}, 1, False, SINGLE_DEVICE),
    "plain-python-cpu-flag": ({}, 1, True, SINGLE_DEVICE),
    "plain-python-8-gpus": ({}, 8, False, ACCELERATE),
    "empty-world-size": ({"WORLD_SIZE": "", "LOCAL_RANK": " "}, 1, False, SINGLE_DEVICE),
    "torchrun-nproc1-cpu": (torchrun_vars(1, 0, 0, 1), 0, False, SINGLE_DEVICE),
    "torchrun-nproc1-one-gpu": (torchrun_vars(1, 0, 0, 1), 1, False, SINGLE_DEVICE),
    "torchrun-nproc1-cpu-flag": (torchrun_vars(1, 0, 0, 1), 1, True, SINGLE_DEVICE),
    "torchrun-nproc1-sees-2-gpus": (torchrun_vars(1, 0, 0, 1), 2, False, ACCELERATE),
    "torchrun-nproc2-2-gpus": (torchrun_vars(2, 1, 1, 2), 2, False, ACCELERATE),
    "torchrun-nproc8-8-gpus": (torchrun_vars(8, 5, 5, 8), 8, False, ACCELERATE),
    # Two nodes, one GPU each: one device per process, but NOT a single-device run.
    "torchrun-2nodes-1gpu-each": (torchrun_vars(2, 1, 0, 1, nodes=2), 1, False, ACCELERATE),
    # Per-process CUDA_VISIBLE_DEVICES: every worker sees exactly one device.
    "torchrun-nproc2-visible-1": (dict(torchrun_vars(2, 1, 1, 2), CUDA_VISIBLE_DEVICES="1"), 1, False, ACCELERATE),
    "torchrun-nproc2-no-gpu": (torchrun_vars(2, 1, 1, 2), 0, False, CPU_DISTRIBUTED),
    "torchrun-nproc2-no-gpu-cpu-flag": (torchrun_vars(2, 1, 1, 2), 0, True, ACCELERATE),
    "torchrun-nproc2-gpus-cpu-flag": (torchrun_vars(2, 1, 1, 2), 2, True, ACCELERATE),
    "accelerate-multi-gpu": (ACCELERATE_MULTI_GPU, 2, False, ACCELERATE),
    "accelerate-multi-gpu-on-cpu": (ACCELERATE_MULTI_GPU, 0, False, CPU_DISTRIBUTED),
    "deepspeed-launcher-gpus": (DEEPSPEED_4, 2, False, ACCELERATE),
    "openmpi-gpus": (OMPI_4, 2, False, EXPORT_LAUNCHER_ENV),
    "openmpi-gpus-blank-local-rank": (dict(OMPI_4, LOCAL_RANK=" "), 2, False, EXPORT_LAUNCHER_ENV),
    "openmpi-cpu": (OMPI_4, 0, False, CPU_DISTRIBUTED),
    "openmpi-cpu-flag": (OMPI_4, 0, True, ACCELERATE),
    "intel-mpi-gpus": (PMI_4, 8, False, EXPORT_LAUNCHER_ENV),
    "intel-mpi-cpu": (PMI_4, 0, False, CPU_DISTRIBUTED),
    "mvapich-1gpu-per-node": (MV2_2, 1, False, EXPORT_LAUNCHER_ENV),
    "mvapich-cpu": (MV2_2, 0, False, CPU_DISTRIBUTED),
    "slurm-step-gpus": (SLURM_STEP_4, 2, False, EXPORT_LAUNCHER_ENV),
    "slurm-step-cpu": (SLURM_STEP_4, 0, False, CPU_DISTRIBUTED),
    "sbatch-script-one-gpu": (SBATCH_ONLY, 1, False, SINGLE_DEVICE),
    "sbatch-script-cpu": (SBATCH_ONLY, 0, False, SINGLE_DEVICE),
}


@pytest.mark.parametrize("case", list(DECISIONS))
def test_decision_table(fake_accelerators, case):
    env, count, cpu, expected = DECISIONS[case]
    fake_accelerators(count)
    decision = decide(topology(env), cpu=cpu, environ=env)
    assert decision.action == expected, decision.reason
    assert decision.reason


@pytest.mark.parametrize("flag, word", [("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"), ("ACCELERATE_USE_FSDP", "FSDP")])
@pytest.mark.parametrize("case", ["plain-python-cpu", "torchrun-nproc1-one-gpu", "torchrun-nproc2-no-gpu",
                                  "openmpi-gpus"])
def test_deepspeed_or_fsdp_requested_is_left_to_accelerate_whatever_the_topology(fake_accelerators, case, flag, word):
    env, count, cpu, _ = DECISIONS[case]
    fake_accelerators(count)
    env = dict(env, **{flag: "true"})
    decision = decide(topology(env), cpu=cpu, environ=env)
    # FSDP by several processes without an accelerator: one FSDP2 job on gloo (the tests below).
    # MPI on GPUs: the launcher's variables exported first, since accelerate's DeepSpeed and FSDP
    # paths start only where LOCAL_RANK is set (without, every rank would train alone).
    expected = {("ACCELERATE_USE_FSDP", "torchrun-nproc2-no-gpu"): CPU_FSDP}.get(
        (flag, case), EXPORT_LAUNCHER_ENV if case == "openmpi-gpus" else UNTOUCHED)
    assert decision.action == expected and word in decision.reason


# FSDP asked for by several processes on a machine without accelerators. id: (launcher's
# variables, FSDP_VERSION, cpu argument, local accelerators, expected action)
FSDP_DECISIONS = {
    "torchrun-nproc2-fsdp2": (torchrun_vars(2, 1, 1, 2), "2", False, 0, CPU_FSDP),
    "accelerate-fsdp2-on-cpu": (ACCELERATE_MULTI_GPU, "2", False, 0, CPU_FSDP),
    "use-cpu-fsdp2": (torchrun_vars(2, 1, 1, 2), "2", True, 0, CPU_FSDP),  # stock: DDP, FSDP dropped
    "version-from-the-plugin": (torchrun_vars(2, 1, 1, 2), "", False, 0, CPU_FSDP),
    "openmpi-cpu-fsdp2": (OMPI_4, "2", False, 0, CPU_FSDP),
    "fsdp1": (torchrun_vars(2, 1, 1, 2), "1", False, 0, FSDP1_WITHOUT_ACCELERATOR),
    "fsdp1-use-cpu": (torchrun_vars(2, 1, 1, 2), "1", True, 0, FSDP1_WITHOUT_ACCELERATOR),
    # Accelerators, or one process: accelerate's own FSDP set-up, as before.
    "fsdp2-with-gpus": (torchrun_vars(2, 1, 1, 2), "2", False, 2, UNTOUCHED),
    "fsdp1-with-gpus": (torchrun_vars(2, 1, 1, 2), "1", False, 2, UNTOUCHED),
    "fsdp-one-process-cpu": ({}, "2", False, 0, UNTOUCHED),
}


@pytest.mark.parametrize("case", list(FSDP_DECISIONS))
def test_fsdp_without_accelerator_is_one_job_or_a_clear_stop(fake_accelerators, case):
    env, version, cpu, count, expected = FSDP_DECISIONS[case]
    fake_accelerators(count)
    env = dict(env, ACCELERATE_USE_FSDP="true", FSDP_VERSION=version)
    decision = decide(topology(env), cpu=cpu, environ=env)
    assert decision.action == expected, decision.reason
    if expected == FSDP1_WITHOUT_ACCELERATOR:
        assert decision.reason.startswith("FSDP1 cannot run on this machine: world size ")
        assert "no accelerator" in decision.reason and "--fsdp_version 2" in decision.reason
        assert "\n" not in decision.reason


@pytest.fixture
def one_rank_group(monkeypatch, tmp_path):
    """accelerate's `init_process_group` forms a real gloo group of this one process, whatever world
    size the launcher's variables claim: the state a rank of a CPU job gets, built in-process."""
    real = dist.init_process_group
    asked = []

    def init_process_group(*args, **kwargs):
        asked.append(dict(kwargs))
        kwargs.update(rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return asked


def fsdp_run_env(monkeypatch, version: str) -> None:
    """What `accelerate launch --use_fsdp --fsdp_version <version> --num_processes 2` gives rank 0."""
    torchrun_env(monkeypatch, nproc=2, rank=0, ACCELERATE_USE_FSDP="true", FSDP_VERSION=version,
                 FSDP_CPU_RAM_EFFICIENT_LOADING="false", FSDP_SYNC_MODULE_STATES="false")


def test_fsdp2_without_accelerator_runs_accelerates_fsdp2_on_gloo(monkeypatch, fake_accelerators, one_rank_group):
    from accelerate import Accelerator
    from torch.distributed.tensor import DTensor

    fsdp_run_env(monkeypatch, "2")
    accelerator = Accelerator()

    # Stock accelerate: state NO here, every rank alone. Now: gloo, and FSDP on it.
    assert one_rank_group[0]["backend"] == "gloo"
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2
    assert PartialState().distributed_type == DistributedType.FSDP  # as accelerate leaves it on GPUs
    assert "fsdp2" in record().reason
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # fully_shard ran
    loss = model(torch.randn(3, 4)).sum()
    accelerator.backward(loss)
    optimizer.step()


def test_fsdp2_plugin_given_in_code_turns_ddp_on_cpu_into_fsdp2(monkeypatch, fake_accelerators, one_rank_group):
    # TrainingArguments builds the PartialState before the Trainer passes its plugin: no FSDP
    # variable is set then, so the state is the CPU distributed path; stock accelerate keeps it
    # (DDP) and drops the plugin without a word.
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    torchrun_env(monkeypatch, nproc=2, rank=0)
    assert PartialState().distributed_type == DistributedType.MULTI_CPU
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    accelerator = Accelerator(fsdp_plugin=plugin)
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin is plugin


def test_fsdp1_without_accelerator_stops_in_one_line_naming_the_fix(monkeypatch, fake_accelerators, one_rank_group):
    fsdp_run_env(monkeypatch, "1")
    with pytest.raises(ValueError) as info:
        PartialState()
    message = str(info.value)
    assert message.startswith("FSDP1 cannot run on this machine: world size 2 with no accelerator")
    assert "--fsdp_version 2" in message and "\n" not in message
    assert one_rank_group == [] and PartialState._shared_state == {}  # stopped before any group


def test_fsdp1_plugin_given_in_code_without_accelerator_stops(monkeypatch, fake_accelerators, one_rank_group):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    torchrun_env(monkeypatch, nproc=2, rank=0)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, cpu_ram_efficient_loading=False, sync_module_states=False)
    with pytest.raises(ValueError, match="FSDP1 cannot run on this machine"):
        Accelerator(fsdp_plugin=plugin)
    assert AcceleratorState._shared_state == {}


def test_deepspeed_flag_false_is_not_a_request(fake_accelerators):
    fake_accelerators(0)
    env = dict(torchrun_vars(2, 1, 1, 2), ACCELERATE_USE_DEEPSPEED="false", ACCELERATE_USE_FSDP="")
    assert decide(topology(env), environ=env).action == CPU_DISTRIBUTED


# --- mpirun / srun with accelerators: the launcher's variables exported for accelerate -----------

class GroupRequested(Exception):
    """Raised by the fake `init_process_group`: accelerate asked torch for a process group."""


EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def group_requests(monkeypatch):
    """Every `torch.distributed.init_process_group` call accelerate makes, with the variables it
    could see then, recorded and refused: an NCCL group of several ranks cannot form here."""
    seen = []

    def init_process_group(*args, **kwargs):
        seen.append({name: os.environ.get(name) for name in EXPORTED})
        raise GroupRequested(kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return seen


MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}

# id: (launcher's variables, local accelerators, what accelerate must see when it asks for its group)
WITHOUT_LOCAL_RANK = {
    "openmpi": (OMPI_4, 2, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    "intel-mpi": (PMI_4, 8, {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}),
    "mvapich-1gpu-per-node": (MV2_2, 1, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}),
    "slurm-step": (SLURM_STEP_4, 2, {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}),
    # 7 tasks on 2 nodes, 4 and 3: the second node's own count, not 7 // 2
    "slurm-step-uneven": ({"SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                           "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3"}, 4,
                          {"RANK": "5", "WORLD_SIZE": "7", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}),
}


@pytest.mark.parametrize("launch", list(WITHOUT_LOCAL_RANK))
def test_mpirun_or_srun_with_accelerators_reaches_accelerates_distributed_path(
        monkeypatch, fake_accelerators, group_requests, launch):
    # Stock accelerate never sees such a run (it reads LOCAL_RANK): state NO, every rank alone.
    env, count, expected = WITHOUT_LOCAL_RANK[launch]
    for name, value in {**env, **MASTER}.items():
        monkeypatch.setenv(name, value)
    fake_accelerators(count)

    with pytest.raises(GroupRequested):
        PartialState()

    assert group_requests == [{**expected, **MASTER}]
    assert record().state == "active" and "export-launcher-env" in record().reason


def test_a_world_size_exported_before_srun_takes_slurm_s_ranks(monkeypatch, fake_accelerators, group_requests):
    # a batch script that exports WORLD_SIZE (and MASTER_*) before `srun python`: the rank and local
    # rank are SLURM's, not 0 in every process
    for name, value in {**SLURM_STEP_4, **MASTER, "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    fake_accelerators(2)
    with pytest.raises(GroupRequested):
        PartialState()
    assert group_requests == [{"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", **MASTER}]


def test_a_world_size_with_no_rank_anywhere_stops_instead_of_exporting_rank_0_everywhere(
        monkeypatch, fake_accelerators, group_requests):
    for name, value in {**MASTER, "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(name, value)
    fake_accelerators(2)
    with pytest.raises(TopologyError, match="no variable gives this process's rank or local rank: set RANK and "
                                            "LOCAL_RANK in each process"):
        PartialState()
    assert group_requests == [] and "RANK" not in os.environ and "LOCAL_RANK" not in os.environ
    assert PartialState._shared_state == {}


def test_exported_variables_never_overwrite_what_the_launcher_set(monkeypatch, fake_accelerators, group_requests):
    for name, value in {**OMPI_4, **MASTER, "LOCAL_WORLD_SIZE": "7"}.items():
        monkeypatch.setenv(name, value)
    fake_accelerators(2)
    with pytest.raises(GroupRequested):
        PartialState()
    assert group_requests[0]["LOCAL_WORLD_SIZE"] == "7" and group_requests[0]["RANK"] == "3"


@pytest.mark.parametrize("missing", [("MASTER_ADDR", "MASTER_PORT"), ("MASTER_ADDR",), ("MASTER_PORT",)],
                         ids="-".join)
@pytest.mark.parametrize("launch", ["openmpi", "slurm-step"])
def test_mpirun_or_srun_without_master_address_stops_naming_what_to_export(
        monkeypatch, fake_accelerators, group_requests, launch, missing):
    env, count, _ = WITHOUT_LOCAL_RANK[launch]
    for name, value in {**env, **MASTER}.items():
        monkeypatch.setenv(name, value)
    for name in missing:
        monkeypatch.setenv(name, " ")  # blank is as good as missing
    fake_accelerators(count)

    with pytest.raises(TopologyError) as info:
        PartialState()

    message = str(info.value)
    assert message.startswith(f"{launch.split('-')[0]} started 4 processes but {' and '.join(missing)} ")
    assert "MASTER_ADDR=node0 MASTER_PORT=29500" in message  # what to export
    assert group_requests == []
    assert PartialState._shared_state == {}  # no half-built state left behind
    assert "LOCAL_RANK" not in os.environ  # nothing exported for a run that cannot start


def test_two_ranks_without_accelerator_ask_accelerate_for_a_gloo_group(monkeypatch, fake_accelerators, group_requests):
    # torchrun --nproc_per_node=2 on a CPU box, rank 1. Stock accelerate asks for a group with no
    # backend and sets state NO beside it: each rank trains alone (integration_tests show the drift).
    torchrun_env(monkeypatch, nproc=2, rank=1, OMP_NUM_THREADS="1")

    with pytest.raises(GroupRequested) as info:
        PartialState()

    assert info.value.args[0] == {"backend": "gloo", "rank": 1, "world_size": 2}
    assert PartialState._shared_state["distributed_type"] == DistributedType.MULTI_CPU
    assert "cpu-distributed" in record().reason


SLURM_STEP_2_ONE_NODE = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
                         "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"}


@pytest.mark.parametrize("launch", ["slurm", "openmpi"])
def test_srun_or_mpirun_on_one_cpu_node_forms_one_gloo_group(monkeypatch, fake_accelerators, group_requests, launch):
    """accelerate's CPU path reads neither SLURM's variables nor a default MASTER_ADDR: the ranks
    are exported, and the address is this node's when every process is on it. Red when nothing is
    exported (every SLURM rank trained alone, under a status saying cpu-distributed) or when the
    group's rendezvous finds no address."""
    env = SLURM_STEP_2_ONE_NODE if launch == "slurm" else {
        "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    for name, value in {**env, "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    fake_accelerators(0)

    with pytest.raises(GroupRequested) as info:
        PartialState()

    assert info.value.args[0] == {"backend": "gloo", "rank": 1, "world_size": 2}
    assert group_requests[0]["MASTER_ADDR"] == "127.0.0.1" and group_requests[0]["LOCAL_RANK"] == "1"
    assert PartialState._shared_state["distributed_type"] == DistributedType.MULTI_CPU


def test_a_cpu_run_across_nodes_without_master_address_stops_naming_it(monkeypatch, fake_accelerators, group_requests):
    for name, value in SLURM_STEP_4.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    fake_accelerators(0)

    with pytest.raises(TopologyError, match="MASTER_ADDR is not set: export the address of rank 0's node"):
        PartialState()
    assert group_requests == [] and PartialState._shared_state == {}  # no half-built state


def test_a_group_made_without_naming_a_backend_is_read_by_its_backend_config(monkeypatch, fake_accelerators):
    """`init_process_group()` with no backend: get_backend() says "undefined", the config says
    "cpu:gloo". Red when the group is left untouched (state NO beside it: every rank alone)."""
    from accel_patch.core import accelerate_decision

    fake_accelerators(0)
    topo = topology(torchrun_vars(2, 1, 1, 2))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "undefined")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo")
    group = accelerate_decision.existing_group()
    assert group == (2, "cpu:gloo")
    assert accelerate_decision._over_existing_group(topo, group, cpu=False).action == CPU_DISTRIBUTED


def test_local_rank_minus_one_is_unset_as_accelerate_reads_it(monkeypatch, fake_accelerators):
    monkeypatch.setenv("LOCAL_RANK", "-1")
    fake_accelerators(0)
    assert topology().local_rank == 0 and topology().defaulted("local_rank")
    assert decide(topology()).action == SINGLE_DEVICE


# --- the real PartialState ----------------------------------------------------------------------

@pytest.mark.parametrize("cpu", [False, True])
def test_torchrun_nproc1_gives_state_no_and_no_process_group(monkeypatch, fake_accelerators, cpu):
    torchrun_env(monkeypatch, nproc=1)  # LOCAL_RANK=0 WORLD_SIZE=1, as torchrun sets them
    fake_accelerators(1)  # one GPU (or, on a CPU box, what accelerate treats as none)

    state = PartialState(cpu=cpu)

    assert state.distributed_type == DistributedType.NO
    assert not dist.is_initialized()
    assert (state.num_processes, state.process_index) == (1, 0)
    assert state.device.type == ("cuda" if torch.cuda.is_available() and not cpu else "cpu")
    assert os.environ["LOCAL_RANK"] == "0"  # hidden from accelerate only while it decided
    assert "single-device" in record().reason


def test_torchrun_nproc1_model_is_not_wrapped_in_ddp(monkeypatch, fake_accelerators):
    from accelerate import Accelerator

    torchrun_env(monkeypatch, nproc=1)
    fake_accelerators(1)
    model = Accelerator().prepare(torch.nn.Linear(2, 2))
    assert type(model) is torch.nn.Linear
    assert not dist.is_initialized()


@pytest.mark.parametrize("cpu", [False, True])
@pytest.mark.parametrize("blank", [{"WORLD_SIZE": ""}, {"LOCAL_RANK": " "}, {"WORLD_SIZE": "", "RANK": "", "LOCAL_RANK": ""}])
def test_blank_launcher_values_give_one_plain_process(monkeypatch, blank, cpu):
    # A config template wrote WORLD_SIZE="": stock accelerate crashes in int("") here.
    for name, value in blank.items():
        monkeypatch.setenv(name, value)

    state = PartialState(cpu=cpu)

    assert state.distributed_type == DistributedType.NO
    assert state.num_processes == 1
    assert not dist.is_initialized()
    # Gone for whoever parses them next (transformers does int(os.environ["WORLD_SIZE"])).
    assert not any(name in os.environ for name in blank)


def test_prepare_backend_called_on_its_own_follows_the_same_decision(monkeypatch, fake_accelerators):
    # accelerate calls it only from __init__; a subclass or a later release may call it directly.
    torchrun_env(monkeypatch, nproc=1)
    fake_accelerators(1)
    instance = object.__new__(PartialState)
    assert PartialState._prepare_backend(instance, cpu=True) == (None, DistributedType.NO)
    assert not dist.is_initialized()


def test_invalid_world_size_fails_when_the_state_is_created_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")  # set after `import accel_patch`: importing never failed
    with pytest.raises(TopologyError, match=r"WORLD_SIZE='two'.*whole number"):
        PartialState()
    assert PartialState._shared_state == {}  # no half-built state left behind
    assert not dist.is_initialized()

    monkeypatch.setenv("WORLD_SIZE", "1")
    assert PartialState().distributed_type == DistributedType.NO


def test_binding_reads_no_launcher_variable(monkeypatch):
    # `import accelerate` (which binds the patch) must not fail on a bad value either.
    monkeypatch.setenv("WORLD_SIZE", "two")
    accel_patch.disable()
    accel_patch.enable()
    assert record().state == "active"


def test_fsdp_requested_is_left_to_accelerate_and_status_says_why(monkeypatch):
    torchrun_env(monkeypatch, nproc=1, ACCELERATE_USE_FSDP="true")

    PartialState()

    # accelerate's own set-up ran: with LOCAL_RANK set it creates its process group.
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert record().state == "active" and "FSDP" in record().reason


def test_deepspeed_requested_is_left_to_accelerate_and_status_says_why(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert PartialState().distributed_type == DistributedType.NO  # one plain process
    assert "DeepSpeed" in record().reason

    if importlib.util.find_spec("deepspeed") is None:
        # Untouched means accelerate's own DeepSpeed start-up runs, and says what is missing.
        reset_accelerate()
        torchrun_env(monkeypatch, nproc=1)
        with pytest.raises(ImportError, match="DeepSpeed"):
            PartialState()


def test_process_group_created_by_the_user_is_left_as_it_is(monkeypatch, tmp_path):
    torchrun_env(monkeypatch, nproc=1)
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    group = dist.group.WORLD

    state = PartialState(cpu=True)

    # accelerate's own CPU path over the user's group (the single-device path would give NO).
    assert state.distributed_type == DistributedType.MULTI_CPU
    assert dist.group.WORLD is group
    assert "process group already exists" in record().reason


# (local accelerators, the existing group's size and backend, cpu=) -> decision
BESIDE_A_GROUP = {
    "cpu-gloo": ((0, 2, "gloo", False), CPU_DISTRIBUTED),
    "cpu-mpi": ((0, 2, "mpi", False), CPU_DISTRIBUTED),
    "gpus-nccl": ((2, 2, "nccl", False), UNTOUCHED),  # accelerate's own GPU path uses the group
    "cpu-one-process": ((0, 1, "gloo", False), UNTOUCHED),
    "cpu-requested": ((0, 2, "gloo", True), UNTOUCHED),  # accelerate's own CPU path already
    "cpu-backend-needs-a-gpu": ((0, 2, "nccl", False), UNTOUCHED),
}


@pytest.mark.parametrize("case", list(BESIDE_A_GROUP))
def test_beside_an_existing_group_without_accelerators_the_cpu_distributed_path_runs(
        monkeypatch, fake_accelerators, case):
    """The script's own group, or the one a second Trainer's rebuilt state finds: stock accelerate
    gives state NO beside it on CPU, every rank alone (integration_tests/test_launchers.py runs it)."""
    (count, size, backend, cpu), expected = BESIDE_A_GROUP[case]
    fake_accelerators(count)
    from accel_patch.core import accelerate_decision

    monkeypatch.setattr(accelerate_decision, "existing_group", lambda: (size, backend))
    env = torchrun_vars(size, size - 1, size - 1, size)
    decision = decide(topology(env), cpu=cpu, environ=env)
    assert decision.action == expected, decision
    assert "process group already exists" in decision.reason


def test_state_built_before_the_patch_bound_is_left_as_is_and_later_states_are_patched():
    accel_patch.disable()
    original_init = PartialState.__dict__["__init__"]
    state = PartialState()

    before = dict(state.__dict__)
    accel_patch.enable()

    assert record().state == "too-late"
    assert "already existed" in record().reason
    # The existing state is reused as it is: no new decision, nothing rebuilt.
    assert PartialState().__dict__ is state.__dict__
    assert dict(PartialState().__dict__) == before
    assert PartialState.__dict__["__init__"] is not original_init

    # TrainingArguments resets and rebuilds the state: the rebuilt one is patched (here torchrun
    # --nproc_per_node=1's variables: state NO and no process group).
    reset_accelerate()
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    rebuilt = PartialState()
    assert rebuilt.distributed_type == DistributedType.NO
    assert not torch.distributed.is_initialized()
    assert record().state == "active"


def test_enable_twice_wraps_nothing_twice():
    accel_patch.enable()
    accel_patch.enable()
    assert wrappers_on(PartialState, "__init__") == 1
    assert wrappers_on(PartialState, "_prepare_backend") == 1

    accel_patch.disable()
    accel_patch.enable()
    accel_patch.enable()
    assert wrappers_on(PartialState, "__init__") == 1
    assert wrappers_on(PartialState, "_prepare_backend") == 1
    assert record().state == "active"


def test_disable_restores_the_exact_original_objects():
    accel_patch.disable()
    init, prepare_backend = PartialState.__dict__["__init__"], PartialState.__dict__["_prepare_backend"]
    assert init.__module__ == prepare_backend.__module__ == "accelerate.state"

    accel_patch.enable()
    assert PartialState.__dict__["_prepare_backend"] is not prepare_backend
    assert PartialState.__dict__["_prepare_backend"].__wrapped__ is prepare_backend

    accel_patch.disable()
    assert PartialState.__dict__["_prepare_backend"] is prepare_backend
    assert PartialState.__dict__["__init__"] is init
    assert record().state == "disabled"
    accel_patch.disable()  # idempotent
    assert PartialState.__dict__["__init__"] is init


def test_disable_restores_from_pretrained_classmethod_object():
    from transformers import PreTrainedModel

    accel_patch.disable()
    original = PreTrainedModel.__dict__["from_pretrained"]
    assert isinstance(original, classmethod)

    accel_patch.enable()
    assert record("device-map").state == "active" and record("kernels").state == "active"
    assert wrappers_on(PreTrainedModel, "from_pretrained") == 2  # the device map's and the kernel swap's

    accel_patch.disable()
    assert PreTrainedModel.__dict__["from_pretrained"] is original


def test_switch_turns_off_the_accelerate_patch_only(monkeypatch):
    monkeypatch.setenv("ACCEL_PATCH_ACCELERATE", "0")
    accel_patch.disable()
    accel_patch.enable()
    assert record().state == "skipped" and "ACCEL_PATCH_ACCELERATE=0" in record().reason
    assert wrappers_on(PartialState, "__init__") == 0

    torchrun_env(monkeypatch, nproc=1)
    PartialState()
    assert dist.is_initialized()  # stock accelerate: a group even for one process


# --- targets that moved, patches that fail ------------------------------------------------------

def fake_accelerate_state(name: str, state_init=None, **members) -> types.ModuleType:
    """A module shaped like accelerate.state with PartialState's members replaced by `members`
    (None deletes one), and AcceleratorState's __init__ by `state_init`."""

    class PartialState:
        _shared_state: dict = {}

        def __init__(self, cpu: bool = False, **kwargs):
            pass

        def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
            return None, DistributedType.NO

    for attr, value in members.items():
        if value is None:
            delattr(PartialState, attr)
        else:
            setattr(PartialState, attr, value)
    class AcceleratorState:
        _shared_state: dict = {}

        def __init__(self, mixed_precision=None, cpu: bool = False, fsdp_plugin=None, **kwargs):
            pass

    if state_init is not None:
        AcceleratorState.__init__ = state_init
    module = types.ModuleType(name)
    module.PartialState = PartialState
    module.AcceleratorState = AcceleratorState
    module.DistributedType = DistributedType
    return module


def _init_without_cpu(self, **kwargs):
    pass


def _backend_other_signature(self, use_cpu=False, sagemaker=False):
    return None, DistributedType.NO


@pytest.mark.parametrize(
    "members, why",
    [
        ({"_prepare_backend": None}, "_prepare_backend is gone"),
        ({"_prepare_backend": _backend_other_signature}, "_prepare_backend"),
        ({"__init__": _init_without_cpu}, "cpu"),
    ],
    ids=["no-prepare-backend", "prepare-backend-signature", "init-without-cpu"],
)
def test_moved_target_is_skipped_with_a_reason_and_left_untouched(monkeypatch, members, why):
    module_name = f"accel_patch_test_fake_state_{uuid.uuid4().hex}"

    class PatchOnFake(accelerate_state.AccelerateStatePatch):
        name = "test-moved-target"
        module = module_name

    fake = fake_accelerate_state(module_name, **members)
    before = dict(fake.PartialState.__dict__)
    monkeypatch.setitem(sys.modules, module_name, fake)
    registry.register(PatchOnFake())

    accel_patch.enable()

    moved = record("test-moved-target")
    assert moved.state == "skipped"
    assert why in moved.reason and "accelerate 1.15" in moved.reason  # names the verified version
    assert dict(fake.PartialState.__dict__) == before
    assert record().state == "active"  # the real patch is unaffected


def _state_init_without_fsdp_plugin(self, mixed_precision=None, cpu=False, **kwargs):
    pass


def test_accelerator_state_that_moved_skips_the_whole_patch(monkeypatch):
    module_name = f"accel_patch_test_fake_state_{uuid.uuid4().hex}"

    class PatchOnFake(accelerate_state.AccelerateStatePatch):
        name = "test-moved-target"
        module = module_name

    fake = fake_accelerate_state(module_name, state_init=_state_init_without_fsdp_plugin)
    before = dict(fake.PartialState.__dict__)
    monkeypatch.setitem(sys.modules, module_name, fake)
    registry.register(PatchOnFake())
    accel_patch.enable()
    moved = record("test-moved-target")
    assert moved.state == "skipped" and "fsdp_plugin" in moved.reason, moved
    assert dict(fake.PartialState.__dict__) == before  # nothing patched halfway


def test_fake_shaped_like_accelerate_is_patched(monkeypatch):
    # Control for the test above: the same fake with nothing moved does bind.
    module_name = f"accel_patch_test_fake_state_{uuid.uuid4().hex}"

    class PatchOnFake(accelerate_state.AccelerateStatePatch):
        name = "test-moved-target"
        module = module_name

    fake = fake_accelerate_state(module_name)
    monkeypatch.setitem(sys.modules, module_name, fake)
    patch = PatchOnFake()
    registry.register(patch)
    accel_patch.enable()
    assert record("test-moved-target").state == "active"
    assert wrappers_on(fake.PartialState, "_prepare_backend") == 1
    patch.uninstall()


def test_moved_target_in_real_accelerate_is_skipped_and_accelerate_still_works(monkeypatch):
    accel_patch.disable()
    stock = PartialState.__dict__["_prepare_backend"]

    def _prepare_backend(self, use_cpu=False, sagemaker=False, backend_name=None):  # a "newer" release
        return stock(self, use_cpu, sagemaker, backend_name)

    with monkeypatch.context() as m:
        m.setattr(PartialState, "_prepare_backend", _prepare_backend)
        init = PartialState.__dict__["__init__"]

        accel_patch.enable()

        assert record().state == "skipped" and "_prepare_backend" in record().reason
        assert PartialState.__dict__["__init__"] is init  # nothing patched halfway
        assert PartialState.__dict__["_prepare_backend"] is _prepare_backend
        assert PartialState().distributed_type == DistributedType.NO
        reset_accelerate()
        accel_patch.disable()


class Target:
    def method(self):
        return "original"


class ExplodingPatch(registry.Patch):
    name = "test-exploding"
    target = "Target.method"
    verified = "nothing"
    switch = "ACCEL_PATCH_TEST_EXPLODING"

    def check(self, module):
        return None

    def install(self, module):
        self.wrap(module.Target, "method", lambda wrapped, instance, args, kwargs: "patched")
        raise RuntimeError("boom while installing")


def test_patch_whose_install_raises_is_failed_logged_once_and_leaves_target_untouched(monkeypatch, caplog):
    module_name = f"accel_patch_test_exploding_{uuid.uuid4().hex}"
    fake = types.ModuleType(module_name)
    fake.Target = Target
    original = Target.__dict__["method"]
    monkeypatch.setitem(sys.modules, module_name, fake)
    registry.register(type("Exploding", (ExplodingPatch,), {"module": module_name})())

    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        accel_patch.enable()
        accel_patch.enable()

    failed = record("test-exploding")
    assert failed.state == "failed" and "RuntimeError: boom while installing" in failed.reason
    assert Target.__dict__["method"] is original and Target().method() == "original"
    assert len([r for r in caplog.records if "test-exploding" in r.getMessage()]) == 1
    assert record().state == "active"


def test_failing_hook_does_not_break_the_users_import(monkeypatch, tmp_path):
    module_name = f"accel_patch_test_hooked_{uuid.uuid4().hex}"
    (tmp_path / f"{module_name}.py").write_text(
        "class Target:\n    def method(self):\n        return 'original'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register(type("Exploding", (ExplodingPatch,), {"module": module_name})())
    accel_patch.enable()
    assert record("test-exploding").state == "pending"

    try:
        module = importlib.import_module(module_name)  # the post-import hook runs and fails here
    finally:
        sys.modules.pop(module_name, None)

    assert module.Target().method() == "original"
    assert record("test-exploding").state == "failed"
