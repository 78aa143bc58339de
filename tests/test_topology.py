"""The topology resolver: every launcher's variables, blank and bad values, read at call time.

The local accelerator count is faked in-process (`fake_accelerators`: `local_accelerators` is what
the resolver asks), so these tests run the same on a CPU box and a GPU box. tests/conftest.py
removes the host's launcher variables around every test.
"""
from __future__ import annotations

import pytest

from accel_patch import Topology, TopologyError, topology, topology_resolver


def set_env(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

# id: (environment, expected (world_size, rank, local_rank, local_world_size, num_nodes, launcher))
LAUNCHES = {
    "plain-python": ({}, (1, 0, 0, 1, 1, "none")),
    "torchrun-nproc1": (
        dict(TORCHRUN, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
             GROUP_RANK="0", GROUP_WORLD_SIZE="1"),
        (1, 0, 0, 1, 1, "torchrun"),
    ),
    "torchrun-nproc2-rank1": (
        dict(TORCHRUN, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
             GROUP_RANK="0", GROUP_WORLD_SIZE="1"),
        (2, 1, 1, 2, 1, "torchrun"),
    ),
    # Two nodes, one process each: the case a naive "one device => single device" patch breaks.
    "torchrun-2nodes-1proc-node1": (
        dict(TORCHRUN, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
             GROUP_RANK="1", GROUP_WORLD_SIZE="2"),
        (2, 1, 0, 1, 2, "torchrun"),
    ),
    "torchrun-4nodes-2proc-rank5": (
        dict(TORCHRUN, RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="2",
             GROUP_RANK="2", GROUP_WORLD_SIZE="4"),
        (8, 5, 1, 2, 4, "torchrun"),
    ),
    # A launcher that gives the node count but not LOCAL_WORLD_SIZE: processes per node follow from it.
    "torchrun-vars-without-local-world-size": (
        dict(TORCHRUN, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", GROUP_RANK="1", GROUP_WORLD_SIZE="2"),
        (4, 3, 1, 2, 2, "torchrun"),
    ),
    # `accelerate launch --multi_gpu --num_processes 2` runs torchrun's launcher with its own variables.
    "accelerate-multi-gpu-rank1": (
        dict(TORCHRUN, ACCELERATE_MIXED_PRECISION="no", ACCELERATE_DYNAMO_BACKEND="NO",
             RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
             GROUP_RANK="0", GROUP_WORLD_SIZE="1"),
        (2, 1, 1, 2, 1, "accelerate"),
    ),
    # Without --multi_gpu it starts one plain process and sets no topology variable.
    "accelerate-single-process": (
        {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"},
        (1, 0, 0, 1, 1, "none"),
    ),
    "deepspeed-rank3": (
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2",
         "LOCAL_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"},
        (4, 3, 1, 2, 2, "deepspeed"),
    ),
    "openmpi-rank3": (
        {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
         "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        (4, 3, 1, 2, 2, "openmpi"),
    ),
    "intel-mpi-rank2": (
        {"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
        (4, 2, 0, 2, 2, "intel-mpi"),
    ),
    "mvapich-2nodes-1proc": (
        {"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "1",
         "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1"},
        (2, 1, 0, 1, 2, "mvapich"),
    ),
    "slurm-step-rank3": (
        {"SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "2"},
        (4, 3, 1, 2, 2, "slurm"),
    ),
    # sbatch exports SLURM_NTASKS to its batch script, which is ONE process: it must not count.
    "sbatch-script-only": (
        {"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
         "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "123"},
        (1, 0, 0, 1, 1, "none"),
    ),
    # `srun torchrun ...` (one torchrun per node): torchrun's variables describe the workers.
    "torchrun-under-srun": (
        dict(TORCHRUN, RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2",
             GROUP_RANK="1", GROUP_WORLD_SIZE="2",
             SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_PROCID="1", SLURM_LOCALID="0"),
        (4, 3, 1, 2, 2, "torchrun"),
    ),
}


@pytest.mark.parametrize("count", [0, 1, 2, 8])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_each_launcher_resolves_world_ranks_nodes_and_devices(monkeypatch, fake_accelerators, launch, count):
    env, (world, rank, local_rank, local_world, nodes, launcher) = LAUNCHES[launch]
    set_env(monkeypatch, env)
    fake_accelerators(count)

    topo = topology()

    assert (topo.world_size, topo.rank, topo.local_rank, topo.local_world_size, topo.num_nodes,
            topo.launcher) == (world, rank, local_rank, local_world, nodes, launcher)
    assert (topo.device_type, topo.device_count) == (("cuda", count) if count else ("cpu", 0))
    assert topo.single_device == (world <= 1 and count <= 1)
    assert topo.is_distributed == (world > 1)


def test_sources_name_the_variables_that_gave_each_value(monkeypatch, fake_accelerators):
    set_env(monkeypatch, LAUNCHES["openmpi-rank3"][0])
    assert topology().sources == {
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",  # num_nodes is derived: not named
    }
    set_env(monkeypatch, LAUNCHES["torchrun-2nodes-1proc-node1"][0])
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    assert topology().sources == {
        "world_size": "WORLD_SIZE", "rank": "RANK", "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE", "num_nodes": "GROUP_WORLD_SIZE",
    }


def test_sources_never_name_a_variable_that_is_not_set(monkeypatch, fake_accelerators):
    # torchrun-like: only LOCAL_RANK set; world size and rank are defaults, not from WORLD_SIZE/RANK.
    monkeypatch.setenv("LOCAL_RANK", "0")
    topo = topology()
    assert (topo.world_size, topo.rank, topo.local_rank) == (1, 0, 0)
    assert topo.sources == {"local_rank": "LOCAL_RANK"}


@pytest.mark.parametrize("count, single", [(0, True), (1, True), (2, False), (8, False)])
def test_single_device_means_one_process_and_at_most_one_accelerator(fake_accelerators, count, single):
    fake_accelerators(count)
    assert topology().single_device is single


def test_single_device_property_on_a_hand_built_record():
    def record(world, count):
        return Topology(world, 0, 0, world, 1, "cuda" if count else "cpu", count, "none")

    assert record(1, 0).single_device and record(1, 1).single_device
    assert not record(1, 2).single_device  # one process, several GPUs
    assert not record(2, 1).single_device  # one GPU per node, two nodes
    assert not record(2, 0).single_device  # CPU distributed


BLANK_CASES = [
    # (launch, variable made blank): the result must equal the launch without that variable.
    ("plain-python", "WORLD_SIZE"),
    ("plain-python", "LOCAL_RANK"),
    ("plain-python", "RANK"),
    ("torchrun-nproc2-rank1", "LOCAL_WORLD_SIZE"),
    ("torchrun-2nodes-1proc-node1", "GROUP_WORLD_SIZE"),
    ("openmpi-rank3", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("openmpi-rank3", "OMPI_COMM_WORLD_SIZE"),
    ("intel-mpi-rank2", "PMI_SIZE"),
    ("mvapich-2nodes-1proc", "MV2_COMM_WORLD_RANK"),
    ("slurm-step-rank3", "SLURM_STEP_NUM_TASKS"),
    ("deepspeed-rank3", "CROSS_SIZE"),
]


@pytest.mark.parametrize("blank", ["", " ", "\t \n"])
@pytest.mark.parametrize("launch, variable", BLANK_CASES)
def test_blank_value_behaves_as_unset(monkeypatch, fake_accelerators, launch, variable, blank):
    env = {k: v for k, v in LAUNCHES[launch][0].items() if k != variable}
    set_env(monkeypatch, env)
    fake_accelerators(2)
    without = topology()

    monkeypatch.setenv(variable, blank)
    assert topology() == without


def test_empty_world_size_from_a_config_template_is_one_plain_process(monkeypatch, fake_accelerators):
    monkeypatch.setenv("WORLD_SIZE", "")
    monkeypatch.setenv("RANK", " ")
    monkeypatch.setenv("LOCAL_RANK", "")
    topo = topology()
    assert (topo.world_size, topo.rank, topo.local_rank, topo.launcher) == (1, 0, 0, "none")
    assert topo.single_device


BAD_VALUES = ["two", "1.5", "-3", " 2x", "0x2", "²"]


@pytest.mark.parametrize("value", BAD_VALUES)
@pytest.mark.parametrize(
    "variable",
    ["WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_RANK",
     "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID"],
)
def test_invalid_value_raises_topology_error_naming_variable_and_value(monkeypatch, fake_accelerators, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(TopologyError) as info:
        topology()
    message = str(info.value)
    assert f"{variable}=" in message and value in message
    assert "whole number" in message  # says what a valid value looks like
    assert isinstance(info.value, ValueError)


def test_invalid_value_is_reported_even_when_another_launcher_wins(monkeypatch, fake_accelerators):
    # Silently ignoring a bad value would hide a broken launch script.
    set_env(monkeypatch, LAUNCHES["torchrun-nproc2-rank1"][0])
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "two")
    with pytest.raises(TopologyError, match="OMPI_COMM_WORLD_SIZE='two'"):
        topology()


def test_topology_reads_the_environment_at_call_time(monkeypatch, fake_accelerators):
    # accel_patch is imported at the top of this file; the launcher sets variables afterwards
    # (notebook_launcher does exactly this).
    fake_accelerators(2)
    assert topology().world_size == 1

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    topo = topology()
    assert (topo.world_size, topo.rank, topo.local_rank) == (2, 1, 1)

    monkeypatch.setenv("WORLD_SIZE", "4")
    assert topology().world_size == 4

    fake_accelerators(1)
    assert topology().device_count == 1


def test_explicit_environ_mapping_is_read_instead_of_os_environ(monkeypatch, fake_accelerators):
    monkeypatch.setenv("WORLD_SIZE", "two")  # would raise if os.environ were read
    topo = topology({"WORLD_SIZE": "3", "RANK": "2", "LOCAL_RANK": "0"})
    assert (topo.world_size, topo.rank) == (3, 2)


def test_scrub_blank_env_removes_only_blank_launcher_variables():
    env = {"WORLD_SIZE": "", "LOCAL_RANK": "  ", "RANK": "0", "HOME": "", "PMI_SIZE": "\t"}
    removed = topology_resolver.scrub_blank_env(env)
    assert sorted(removed) == ["LOCAL_RANK", "PMI_SIZE", "WORLD_SIZE"]
    assert env == {"RANK": "0", "HOME": ""}

