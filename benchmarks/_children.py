"""How the benchmarks run each variant in a process of its own.

A measured run starts a fresh interpreter per variant: its peak memory, allocator settings
(`MALLOC_MMAP_THRESHOLD_`) and import-time environment are its own. A dry run (tiny shapes on the
CPU, no figures: it proves the script runs, as `gpu_check.sh --dry-run` does before a GPU lease)
forks this interpreter instead, with torch, transformers and peft imported once, and runs the same
command line in the fork: the same argument parsing, the same child code and the same JSON line
on stdout, without about 7 s of imports for every variant.

The fork is taken only on one thread (`OMP_NUM_THREADS=1`, which `gpu_check.sh --dry-run` sets): a
fork of a process whose OpenMP team has started can hang in its first parallel region. Anything
else (no fork on this platform, a `python -m` command) starts a fresh interpreter as a measured
run does.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

PRELOAD = ("torch", "transformers", "peft")


def forks(cmd: list[str], dry: bool) -> bool:
    """Whether `run` forks for this command (see the module docstring)."""
    return (dry and hasattr(os, "fork") and os.environ.get("OMP_NUM_THREADS") == "1"
            and len(cmd) >= 2 and cmd[1] != "-m" and os.path.isfile(cmd[1]))


def run(cmd: list[str], env: dict[str, str], dry: bool = False) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, capture_output=True, text=True)`, or in a dry run the same
    command line in a fork of this interpreter (see the module docstring)."""
    if not forks(cmd, dry):
        return subprocess.run(cmd, env=env, capture_output=True, text=True)
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass  # the child's own import says what is missing
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                # what the child prints goes to the new descriptors even where this process's
                # sys.stdout was something else (a capture)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = list(cmd[1:])
                runpy.run_path(cmd[1], run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:  # noqa: BLE001 - the child reports it as a fresh process would
                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), out.read(), err.read())


def _lines(cmd: list[str], env: dict[str, str], dry: bool):
    """Yield the command's stdout lines as they come (a measured run: a step stopped by its time
    limit keeps the variants that finished), then (returncode, stderr) last."""
    if forks(cmd, dry):
        proc = run(cmd, env, dry=dry)
        yield from proc.stdout.splitlines()
        yield proc.returncode, proc.stderr
        return
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        yield from proc.stdout
        proc.wait()
        err.seek(0)
        yield proc.returncode, err.read()


def run_each(variants: list[str], command, env: dict[str, str], together: bool, dry: bool = False):
    """Yield each variant's result (a dict with "variant") as its process reports it, one JSON line
    per variant on stdout, as soon as it is printed. `command(group)` is the command line that runs
    a group of variants in turn; `together`: all of them in one process (a fresh one after a process
    that died: the variant it was in gets an error with the first line of the cause, its stderr's
    tail goes to this process's stderr, the ones after it run anew), else one process each."""
    remaining = list(variants)
    while remaining:
        group = remaining if together else remaining[:1]
        done = 0
        for line in _lines(command(group), env, dry):
            if isinstance(line, tuple):
                returncode, stderr = line
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and done < len(group) and r.get("variant") == group[done]:
                done += 1
                yield r
        if done < len(group):  # the process died in group[done]
            tail = [line.strip() for line in stderr.splitlines() if line.strip()]
            cause = next((line for line in reversed(tail) if "Error" in line or "error" in line), tail[-1] if tail else "")
            sys.stderr.write("\n".join(tail[-30:]) + "\n")
            yield dict(variant=group[done], error=f"process exit {returncode}: {cause[:300]}")
            remaining = group[done + 1:] + remaining[len(group):]
        else:
            remaining = remaining[len(group):]


def first_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for a result's "error"."""
    text = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"
