"""The versions and the machine a GPU check ran on: printed, and as JSON for benchmarks/gpu_check.sh.

    python3 benchmarks/versions.py --json out/versions.json

Python, torch, triton, transformers, accelerate, peft, wrapt, numpy; whether bitsandbytes and trl
are there; the GPU (torch.cuda, and nvidia-smi's name, memory, driver and clocks where it is).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys


def versions() -> dict:
    found = {"python": sys.version.split()[0], "machine": platform.node(),
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    for name in ("torch", "triton", "transformers", "accelerate", "peft", "wrapt", "numpy", "bitsandbytes", "trl",
                 "liger-kernel", "datasets"):
        try:  # the installed distribution's version, without importing it (trl's import takes seconds)
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # bitsandbytes, trl, Liger on the GPU image: said so
            found[name] = "absent"
    import torch

    found["cuda"] = torch.version.cuda
    found["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if shutil.which("nvidia-smi"):
        query = "name,memory.total,driver_version,clocks.sm,clocks.mem"
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True)
        found["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="also write them as JSON")
    args = p.parse_args(argv)
    found = versions()
    for key, value in found.items():
        print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
