"""Shared helpers for the integration tests: launch real processes, bound them in time, read
what each rank wrote, and check the results a user cares about.

Every launch runs with a deadline; on expiry the whole process group is sent SIGABRT (each
Python process prints its stacks: faulthandler is on), then killed, and the test fails with the
tail of every process's stdout and stderr. Processes run in a temporary directory, never
the repository root, so that they import the installed package as a user's script would, not
whatever the checkout puts on sys.path.
"""

import json
import math
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from _env import child_env  # tests/_env.py: the one list of variables a child must not inherit

WORKER = Path(__file__).with_name("train_worker.py")
LAUNCH_TIMEOUT_S = 240  # one launch; a 2-process Trainer run takes ~15-35 s on a 2-core box

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(home, **overrides):
    """A clean environment for a launch (`child_env`: no inherited launcher variables, no
    TRITON_INTERPRET), one thread per process, offline, accelerators hidden (these tests exercise
    the CPU/gloo path), HF_HOME private so no user accelerate config is read; faulthandler on, so
    a launch killed at its deadline leaves every process's Python stacks in its stderr."""
    return child_env(**{**dict(
        PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(home),
        CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"), **overrides})


def torchrun_cmd(worker_args, nproc, port, nnodes=1, node_rank=0, target=(str(WORKER),)):
    """torchrun of `target` (the worker script by default; ("-m", "pkg.mod") for a module)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc_per_node={nproc}", f"--node_rank={node_rank}", "--rdzv-backend=static",
            "--master_addr=127.0.0.1", f"--master_port={port}", *target, *worker_args]


def accelerate_cmd(worker_args, nproc, port):
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
            "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(port), str(WORKER), *worker_args]


def accelerate_fsdp2_cmd(worker_args, nproc, port, target=str(WORKER)):
    """`accelerate launch --use_fsdp --fsdp_version 2`, as a user tries an FSDP config on CPU
    (accelerate's defaults otherwise: RAM-efficient loading, sync_module_states)."""
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--use_fsdp",
            "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
            "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--num_processes", str(nproc),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), target, *worker_args]


def python_cmd(worker_args):
    return [sys.executable, str(WORKER), *worker_args]


@dataclass
class Proc:
    cmd: list
    returncode: int
    seconds: float
    stdout: str
    stderr: str

    def tail(self, n=40):
        def last(text):
            return "\n".join(text.rstrip().splitlines()[-n:])
        return (f"$ {' '.join(self.cmd)}\n  exit {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout (tail) ---\n{last(self.stdout)}\n--- stderr (tail) ---\n{last(self.stderr)}")


def tails(procs, n=40):
    return "\n\n".join(p.tail(n) for p in procs)


def run_concurrently(cmds, env, workdir, timeout=LAUNCH_TIMEOUT_S):
    """Start every command at once, wait for all under one deadline, return their Procs.

    Output goes to files (not pipes) so a chatty process never blocks on a full pipe. On the
    deadline every process group still alive is killed and the test fails with the tails."""
    import subprocess

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = []
    t0 = time.monotonic()
    for i, cmd in enumerate(cmds):
        out, err = workdir / f"launch{i}.out", workdir / f"launch{i}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            p = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=fo, stderr=fe,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        started.append((cmd, p, out, err))

    timed_out = False
    codes = []
    for cmd, p, _, _ in started:
        try:
            codes.append(p.wait(timeout=max(0.1, t0 + timeout - time.monotonic())))
        except subprocess.TimeoutExpired:
            timed_out = True
            codes.append(None)
    elapsed = time.monotonic() - t0
    if timed_out:
        alive = [p for _, p, _, _ in started if p.poll() is None]
        for p in alive:  # every Python process of the group prints its stacks (PYTHONFAULTHANDLER)
            _signal_group(p, signal.SIGABRT)
        time.sleep(3)
        for p in alive:
            _signal_group(p, signal.SIGKILL)  # the group we created: launcher + its workers
            p.wait()
    procs = [Proc(cmd, p.returncode, elapsed, out.read_text(errors="replace"),
                  err.read_text(errors="replace")) for (cmd, p, out, err) in started]
    if timed_out:
        pytest.fail(f"launch did not finish within {timeout} s (killed; the stacks are in stderr)\n\n{tails(procs, 200)}")
    return procs


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def run(cmd, env, workdir, timeout=LAUNCH_TIMEOUT_S):
    return run_concurrently([cmd], env, workdir, timeout)[0]


def require_success(procs):
    bad = [p for p in procs if p.returncode != 0]
    if bad:
        pytest.fail(f"{len(bad)} launch(es) failed\n\n{tails(procs)}")


def read_ranks(out_dir, world_size, procs):
    """The JSON each rank wrote, ordered by rank; fails with the launch tails if one is missing."""
    import torch

    results = []
    for r in range(world_size):
        path = Path(out_dir) / f"rank{r}.json"
        if not path.exists():
            pytest.fail(f"rank {r} wrote no result ({path})\n\n{tails(procs)}")
        res = json.loads(path.read_text())
        res["weights"] = torch.load(Path(out_dir) / f"rank{r}.pt")
        results.append(res)
    return results


def summary(results):
    keys = ("distributed_type", "num_processes", "process_index", "pg_initialized_after_trainer",
            "ddp_wrapped", "wrapped_class", "initial_digest", "final_digest", "losses", "status")
    return "\n".join(f"rank {r['env_rank']}: " + json.dumps({k: r.get(k) for k in keys}, default=str)
                     for r in results)


def assert_trained(res):
    """Training ran to the end, as a user's run would (not under the Triton interpreter that the
    unit tests use): finite losses and weights that moved."""
    assert res["triton_interpret"] is None, (
        f"rank {res['env_rank']} ran with TRITON_INTERPRET={res['triton_interpret']!r} from the test runner")
    assert res["losses"] and all(math.isfinite(x) for x in res["losses"]), res["losses"]
    w = res["weights"]
    moved = float((w["final"] - w["initial"]).abs().max())
    assert moved > 1e-4, f"rank {res['env_rank']}: trainable weights did not change ({moved})"


def assert_no_failed_patch(res):
    failed = [s for s in res["status"] if s["state"] == "failed"]
    assert not failed, f"rank {res['env_rank']}: accel_patch reports failed patches: {failed}"


def assert_single_process(res):
    """State NO, no process group, no DDP wrap: a single-device run."""
    info = summary([res])
    assert res["distributed_type"] == "NO", info
    assert res["num_processes"] == 1 and res["process_index"] == 0, info
    assert not res["pg_initialized_after_trainer"], f"a process group was created\n{info}"
    assert not res["pg_initialized_after_train"], f"a process group was created\n{info}"
    assert not res["ddp_wrapped"], f"model wrapped in DDP on a single device\n{info}"
    assert_trained(res)
    assert_no_failed_patch(res)


def assert_ddp_in_sync(results):
    """Every rank ran accelerate's distributed CPU path with DDP, and the ranks, seeded differently
    before the model was built, end with identical trainable weights."""
    info = summary(results)
    n = len(results)
    for res in results:
        assert res["distributed_type"] == "MULTI_CPU", f"expected DDP on CPU (MULTI_CPU)\n{info}"
        assert res["num_processes"] == n, info
        assert res["pg_initialized_after_trainer"] and res["pg_world_size"] == n, info
        assert res["ddp_wrapped"], f"model not wrapped in DistributedDataParallel\n{info}"
        assert_trained(res)
        assert_no_failed_patch(res)
    assert sorted(r["process_index"] for r in results) == list(range(n)), info
    # The per-rank seeds took effect, so equal final weights cannot come from equal starts.
    assert len({r["initial_digest"] for r in results}) == n, f"ranks started from equal weights\n{info}"
    ref = results[0]["weights"]["final"]
    for res in results[1:]:
        gap = float((res["weights"]["final"] - ref).abs().max())
        assert gap <= 1e-6, (f"weights drifted apart: rank {res['env_rank']} is {gap:.3g} from rank 0 "
                             f"(ranks trained alone?)\n{info}")
