"""The topology resolver: every launcher's variables, blank and bad values, sources, read at call time.

The local accelerator count is faked in-process (`fake_accelerators`: `local_accelerators` is what
the resolver asks), so these tests run the same on a CPU box and a GPU box. tests/conftest.py
removes the host's launcher variables around every test.
"""
from __future__ import annotations

import re

import pytest
import torch.distributed as dist

from accel_patch import Topology, TopologyError, topology
from accel_patch.core import topology_resolver


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
    # Frameworks set other ACCELERATE_ variables under torchrun (Axolotl: ACCELERATE_LOG_LEVEL).
    "torchrun-with-accelerate-log-level": (
        dict(TORCHRUN, ACCELERATE_LOG_LEVEL="info", ACCELERATE_CONFIG_FILE="x.yaml",
             RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", GROUP_WORLD_SIZE="1"),
        (2, 1, 1, 2, 1, "torchrun"),
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
    # a step whose tasks do not divide evenly over its nodes (7 on 2): each node its own count
    "slurm-uneven-node0": (
        {"SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "2", "SLURM_LOCALID": "2", "SLURM_NODEID": "0",
         "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3"},
        (7, 2, 2, 4, 2, "slurm"),
    ),
    "slurm-uneven-node1": (
        {"SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
         "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3"},
        (7, 6, 2, 3, 2, "slurm"),
    ),
    # SLURM's run-length form, 2 tasks on each of 3 nodes then 1; the node count from it alone
    "slurm-repeated-last-node": (
        {"SLURM_STEP_NUM_TASKS": "7", "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
         "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"},
        (7, 6, 0, 1, 4, "slurm"),
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
        "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
        "num_nodes": "derived",  # 4 processes, 2 per node
        "device_type": "torch",
        "device_count": "torch",
        "launcher": "OMPI_COMM_WORLD_SIZE",
    }
    set_env(monkeypatch, LAUNCHES["torchrun-2nodes-1proc-node1"][0])
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    assert topology().sources == {
        "world_size": "WORLD_SIZE", "rank": "RANK", "local_rank": "LOCAL_RANK",
        "local_world_size": "LOCAL_WORLD_SIZE", "num_nodes": "GROUP_WORLD_SIZE",
        "device_type": "torch", "device_count": "torch", "launcher": "TORCHELASTIC_RUN_ID",
    }


def test_plain_python_sources_are_defaults(fake_accelerators):
    fake_accelerators(1)
    assert topology().sources == {
        "world_size": "default", "rank": "default", "local_rank": "default", "local_world_size": "default",
        "num_nodes": "default", "device_type": "torch", "device_count": "torch", "launcher": "default",
    }


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_every_field_has_a_source(monkeypatch, fake_accelerators, launch):
    set_env(monkeypatch, LAUNCHES[launch][0])
    sources = topology().sources
    assert list(sources) == [f for f in Topology._fields if f != "sources"]
    variables = {*topology_resolver.LAUNCHER_VARIABLES, topology_resolver.SLURM_TASKS_PER_NODE}
    kinds = {"default", "derived", "torch.distributed", "torch"} | variables
    for field, source in sources.items():
        # A variable's name must be one that is set; "TORCHELASTIC_RUN_ID" and the like name a launcher.
        assert source in kinds or (field == "launcher" and source in LAUNCHES[launch][0]), (field, source)
        if source in variables:
            assert source in LAUNCHES[launch][0], f"{field} names {source}, which is not set"


def test_sources_never_name_a_variable_that_is_not_set(monkeypatch, fake_accelerators):
    # torchrun-like: only LOCAL_RANK set; world size and rank are defaults, not from WORLD_SIZE/RANK.
    monkeypatch.setenv("LOCAL_RANK", "0")
    topo = topology()
    assert (topo.world_size, topo.rank, topo.local_rank, topo.launcher) == (1, 0, 0, "env")
    assert topo.sources == {
        "world_size": "default", "rank": "default", "local_rank": "LOCAL_RANK",
        "local_world_size": "default", "num_nodes": "default",
        "device_type": "torch", "device_count": "torch", "launcher": "LOCAL_RANK",
    }


def test_derived_values_are_marked_derived(monkeypatch, fake_accelerators):
    # The node count and processes per node each follow from the other and the world size.
    set_env(monkeypatch, LAUNCHES["torchrun-vars-without-local-world-size"][0])
    sources = topology().sources
    assert (sources["num_nodes"], sources["local_world_size"]) == ("GROUP_WORLD_SIZE", "derived")
    # One process that knows only its rank: its local rank is that rank.
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.delenv("GROUP_WORLD_SIZE")
    assert topology().sources["local_rank"] == "derived"


@pytest.mark.parametrize("blank", ["", " "])
def test_sources_name_a_variable_set_but_blank(monkeypatch, fake_accelerators, blank):
    monkeypatch.setenv("WORLD_SIZE", blank)
    monkeypatch.setenv("LOCAL_RANK", blank)
    set_env(monkeypatch, LAUNCHES["openmpi-rank3"][0])
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", blank)
    sources = topology().sources
    assert sources["world_size"] == "OMPI_COMM_WORLD_SIZE (WORLD_SIZE set but blank: read as unset)"
    assert sources["local_rank"] == "OMPI_COMM_WORLD_LOCAL_RANK (LOCAL_RANK set but blank: read as unset)"
    assert sources["local_world_size"] == "derived (OMPI_COMM_WORLD_LOCAL_SIZE set but blank: read as unset)"
    assert sources["rank"] == "OMPI_COMM_WORLD_RANK"


def test_visible_devices_are_named_beside_the_device_count(monkeypatch, fake_accelerators):
    fake_accelerators(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    sources = topology().sources
    assert sources["device_count"] == sources["device_type"] == "torch (CUDA_VISIBLE_DEVICES='3')"


def test_an_initialized_process_group_is_the_source_of_world_size_and_rank(monkeypatch, fake_accelerators, tmp_path):
    set_env(monkeypatch, {"WORLD_SIZE": "4", "RANK": "3"})  # the group wins over the variables
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        topo = topology()
    finally:
        dist.destroy_process_group()
    assert (topo.world_size, topo.rank) == (1, 0)
    assert topo.sources["world_size"] == topo.sources["rank"] == "torch.distributed"
    assert topology().sources["world_size"] == "WORLD_SIZE"  # the group is gone


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
    with_blank = topology()
    assert with_blank._replace(sources={}) == without._replace(sources={})
    # The same sources, with the blank variable named beside the fields it could have given.
    note = re.compile(r" \([A-Z0-9_, ]+ set but blank: read as unset\)$")
    assert {field: note.sub("", source) for field, source in with_blank.sources.items()} == without.sources
    assert any(f"{variable} set but blank" in source for source in with_blank.sources.values())


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


@pytest.mark.parametrize("value", ["4,x", "2(x3", "2(3),1", "4;3", "-1,8", "2(x),1", "４,3"])
def test_a_slurm_tasks_per_node_list_not_of_slurm_s_form_raises_naming_it(monkeypatch, fake_accelerators, value):
    set_env(monkeypatch, LAUNCHES["slurm-uneven-node0"][0])
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", value)
    with pytest.raises(TopologyError) as info:
        topology()
    assert f"SLURM_STEP_TASKS_PER_NODE={value!r}" in str(info.value) and "'2(x3),1'" in str(info.value)


def test_a_slurm_tasks_per_node_list_of_another_run_is_not_read(monkeypatch, fake_accelerators):
    # WORLD_SIZE exported by hand for another count than the step's, or a list that does not add up
    # to the step's tasks: the list describes something else; the even split stands
    for extra in (dict(WORLD_SIZE="8", SLURM_STEP_TASKS_PER_NODE="4,3"), dict(SLURM_STEP_TASKS_PER_NODE="4,4")):
        set_env(monkeypatch, dict(LAUNCHES["slurm-uneven-node0"][0], **extra))
        topo = topology()
        assert topo.local_world_size == topo.world_size // 2 and topo.sources["local_world_size"] == "derived"


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



def test_counting_cuda_devices_never_asks_the_cuda_runtime(monkeypatch):
    # torch.cuda.is_available() asks the CUDA runtime (cudaGetDeviceCount), after which no forked
    # process can use CUDA: notebook_launcher's workers would fail if a model was loaded first.
    # The count comes from torch.cuda.device_count() (NVML), as accelerate's check does.
    import torch

    def runtime_query():
        raise AssertionError("torch.cuda.is_available() called: it poisons fork")

    monkeypatch.setattr(torch.cuda, "is_available", runtime_query)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert topology_resolver.local_accelerators() == ("cuda", 4)


SLURM_STEP_8 = {"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "2"}


@pytest.mark.parametrize("env, expected", [
    # a batch script exports WORLD_SIZE (and MASTER_*) before `srun python`: SLURM's rank and local rank
    (dict(SLURM_STEP_8, WORLD_SIZE="8"), (8, 5, 1, "SLURM_PROCID", "SLURM_LOCALID")),
    # `srun --mpi=pmi2`: PMI's size and rank, no MPI_LOCALRANKID: SLURM's local rank
    (dict(SLURM_STEP_8, PMI_SIZE="8", PMI_RANK="5"), (8, 5, 1, "PMI_RANK", "SLURM_LOCALID")),
    # Cray PALS beside PMI: its lone local rank
    ({"PMI_SIZE": "8", "PMI_RANK": "5", "PALS_LOCAL_RANKID": "1"}, (8, 5, 1, "PMI_RANK", "PALS_LOCAL_RANKID")),
    # another run's variables (a step of 2 tasks, torchrun's 8 processes inside): not mixed in
    (dict(SLURM_STEP_8, SLURM_STEP_NUM_TASKS="2", WORLD_SIZE="8"), (8, 0, 0, "default", "default")),
], ids=["world-size-exported-before-srun", "srun-pmi2", "pals", "another-run-s-variables"])
def test_a_field_the_launcher_leaves_unset_comes_from_another_launcher_of_the_same_run(monkeypatch, env, expected):
    # without this every process read rank 0 and local rank 0: one rank 0 per process (the group
    # never forms) and every local process on cuda:0
    set_env(monkeypatch, env)
    topo = topology()
    world, rank, local_rank, rank_source, local_source = expected
    assert (topo.world_size, topo.rank, topo.local_rank) == (world, rank, local_rank)
    assert topo.sources["rank"] == rank_source and topo.sources["local_rank"] == local_source


def test_a_cuda_count_that_raises_reads_as_no_cuda_device(monkeypatch):
    import torch

    def broken():
        raise RuntimeError("NVML: driver/library version mismatch")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert topology_resolver.local_accelerators()[0] != "cuda"
