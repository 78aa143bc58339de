"""Cost of accel-patch's start-up hook (`accel-patch config`) at every interpreter start.

    python benchmarks/startup_cost.py [--runs 15]

Installs the hook in this environment for the duration of the run (it refuses if one is already
installed, so a user's own entry is never touched), with HF_HOME in a temporary folder, and
measures in fresh interpreters started from a temporary directory:

- not configured: the hook's own work (its .pth line run 200 times in one process, median), and
  `python -c pass` with the hook against without it (medians of --runs fresh interpreters each);
- configured: `python -c pass` with the configuration written against without the hook: the hook
  plus `import accel_patch`; and whether torch, transformers or accelerate got imported.

Targets: under 1 ms not configured, under 30 ms configured, torch never imported at start-up.
Exit code 0 on PASS, 1 on MISS.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_OFF_MS, TARGET_ON_MS = 1.0, 30.0
HEAVY = ("torch", "transformers", "accelerate")
GATE_TIMING = """
import statistics, sys, time
line = open(sys.argv[1]).read()
times = []
for _ in range(200):
    sys.accel_patch_startup = None
    t0 = time.perf_counter()
    exec(line)
    times.append((time.perf_counter() - t0) * 1000)
print(statistics.median(times), sys.accel_patch_startup)
"""
PROBE = f"import json, sys; print(json.dumps([[m for m in {HEAVY!r} if m in sys.modules], " \
        "getattr(sys, 'accel_patch_startup', None)]))"


def wall_ms(env, cwd) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], cwd=cwd, env=env, check=True)
    return (time.perf_counter() - start) * 1000


def medians(envs: dict, cwd: str, runs: int) -> dict:
    """Median wall ms of `python -c pass` per environment, the kinds interleaved run by run."""
    for env in envs.values():
        wall_ms(env, cwd)  # warm the file cache and bytecode
    samples = {name: [] for name in envs}
    for _ in range(runs):
        for name, env in envs.items():
            samples[name].append(wall_ms(env, cwd))
    return {name: statistics.median(s) for name, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters of each kind (default 15)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    from accel_patch.integrations import config_entry

    hook = config_entry.hook_path()
    if hook.exists():
        print(f"{hook} exists (accel-patch is configured here): remove it with `accel-patch config --remove` "
              f"before measuring", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as cwd:
        off_home, on_home = os.path.join(cwd, "off"), os.path.join(cwd, "on")
        base = {k: v for k, v in os.environ.items() if k not in ("ACCEL_PATCH_DISABLE", "ACCEL_PATCH_CONFIG_FILE")}
        envs = {name: dict(base, HF_HOME=home) for name, home in (("off", off_home), ("on", on_home))}
        no_hook = medians({"none": envs["off"]}, cwd, args.runs)["none"]
        old = os.environ.get("HF_HOME")
        os.environ["HF_HOME"] = on_home
        try:
            config_entry.write(dict(config_entry.DEFAULTS))
        finally:
            os.environ.pop("HF_HOME") if old is None else os.environ.__setitem__("HF_HOME", old)
        try:
            gate = subprocess.run([sys.executable, "-c", GATE_TIMING, str(hook)], cwd=cwd, env=envs["off"],
                                  check=True, capture_output=True, text=True).stdout.split(maxsplit=1)
            walls = medians(envs, cwd, args.runs)
            heavy, said = json.loads(subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=envs["on"],
                                                    check=True, capture_output=True, text=True).stdout)
        finally:
            os.environ["HF_HOME"] = on_home
            try:
                config_entry.remove()
            finally:
                os.environ.pop("HF_HOME") if old is None else os.environ.__setitem__("HF_HOME", old)
    gate_ms = float(gate[0])
    off_ms, on_ms = walls["off"] - no_hook, walls["on"] - no_hook
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}, python {platform.python_version()}, {platform.machine()}, "
          f"{args.runs} runs each")
    print(f"no hook                        python -c pass median {no_hook:7.1f} ms")
    print(f"hook, not configured           python -c pass median {walls['off']:7.1f} ms  (+{off_ms:.1f} ms)")
    print(f"  the hook's own work          {gate_ms * 1000:7.0f} us per start (median of 200; it said: {gate[1].strip()})")
    print(f"hook, configured               python -c pass median {walls['on']:7.1f} ms  (+{on_ms:.1f} ms)")
    print(f"  at start-up it said: {said}; heavy modules imported: {', '.join(heavy) if heavy else 'none'}")
    ok_off, ok_on = gate_ms < TARGET_OFF_MS, on_ms < TARGET_ON_MS and "torch" not in heavy
    print(f"not configured: {gate_ms:.3f} ms (target < {TARGET_OFF_MS:.0f} ms): {'PASS' if ok_off else 'MISS'}")
    print(f"configured: +{on_ms:.1f} ms, torch {'imported' if 'torch' in heavy else 'not imported'} "
          f"(target < {TARGET_ON_MS:.0f} ms, no torch): {'PASS' if ok_on else 'MISS'}")
    return 0 if ok_off and ok_on else 1


if __name__ == "__main__":
    sys.exit(main())
