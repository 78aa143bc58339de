"""Cost of `import accel_patch`: wall milliseconds over a bare interpreter, and what it imported.

    python benchmarks/import_cost.py [--runs 15]

Runs `python -c pass` and `python -c "import accel_patch"` alternately in fresh interpreters from a
temporary directory (so the repository root is not on sys.path), takes the median of each, and
prints the difference, whether torch, transformers or accelerate were imported, the slowest
imports under accel_patch (from `-X importtime`), and PASS or MISS against the target: under
30 ms, torch not imported. Exit code 0 on PASS, 1 on MISS.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_MS = 30.0
HEAVY = ("torch", "transformers", "accelerate")
PROBE = (
    "import json, sys; import accel_patch; "
    f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
)


def wall_ms(code: str, cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True, stdout=subprocess.DEVNULL)
    return (time.perf_counter() - start) * 1000


def slowest_imports(cwd: str, top: int = 5) -> list[tuple[float, str]]:
    """(cumulative ms, module) of the slowest imports that `import accel_patch` triggered."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import accel_patch"], cwd=cwd,
                         check=True, capture_output=True, text=True).stderr
    # Lines are "import time: self | cumulative | <indent>name", children before their parent;
    # a top-level import has an indent of one space.
    children: list[tuple[float, str]] = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) != 3 or not parts[1].strip().isdigit():
            continue
        ms, name = int(parts[1]) / 1000, parts[2].rstrip()
        if not name.startswith("  "):  # top level
            if name.strip() == "accel_patch":
                return sorted(children, reverse=True)[:top]
            children = []
        else:
            children.append((ms, name.strip()))
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="fresh interpreters of each kind (default 15)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as cwd:
        wall_ms("import accel_patch", cwd)  # warm the file cache and bytecode
        bare, patched = [], []
        for _ in range(args.runs):
            bare.append(wall_ms("pass", cwd))
            patched.append(wall_ms("import accel_patch", cwd))
        heavy = json.loads(subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, check=True,
                                          capture_output=True, text=True).stdout)
        slowest = slowest_imports(cwd)

    cost = statistics.median(patched) - statistics.median(bare)
    print(f"date {time.strftime('%Y-%m-%d %H:%M')}, python {platform.python_version()}, "
          f"{platform.machine()}, {args.runs} runs each")
    print(f"bare interpreter     median {statistics.median(bare):7.1f} ms")
    print(f"import accel_patch   median {statistics.median(patched):7.1f} ms")
    print(f"import cost                 {cost:7.1f} ms   (target < {TARGET_MS:.0f} ms)")
    print(f"heavy modules imported: {', '.join(heavy) if heavy else 'none'}")
    print("slowest imports under it (cumulative, one run):")
    for ms, module in slowest:
        print(f"  {ms:7.1f} ms  {module.strip()}")
    ok = cost < TARGET_MS and "torch" not in heavy
    print("PASS" if ok else "MISS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
