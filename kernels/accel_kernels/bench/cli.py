"""The command line: python -m accel_kernels.bench [--quick] [--ops rms_norm,rope,...] [--json PATH]."""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform

import torch
import torch._functorch.config  # torch 2.11 has no torch._functorch.config attribute until it is imported

from .. import _triton
from . import harness, report
from .catalogue import OPS

DESCRIPTION = """\
Benchmark accel_kernels against eager torch, torch.compile and Liger Kernel.

On a CUDA GPU: one table per op at llama-3-8B scale in bf16 (8192 tokens): forward, backward and
forward+backward median times, host-inclusive (CUDA events around each call) and on the device
alone (the calls' kernel durations, torch.profiler), peak memory of each step, bandwidth of
memory-bound ops against a device-to-device copy (from either time), and time and memory ratios to
eager and Liger. On CPU: the plain-torch
twins at small float32 shapes, each measurement in a fresh process, then fused linear
cross-entropy against eager in memory and time, with its targets. Every implementation is first
checked against eager in float32; one that disagrees is marked FAILED and not timed."""

EPILOG = """\
ratios: this row / eager (or / Liger), forward+backward; below 1.00x is better.

expected duration of --quick:
  on one H200: about 70 s, an estimate (not yet measured on a GPU: 10 host-timed and 3 profiled
      calls per figure); benchmarks/gpu_check.sh stops it at 120 s, and --json keeps the ops done by then
  on CPU: 1 min 50 s, measured 2026-11-30 on this project's 2-core machine under load 2-4
without --quick: torch.compile rows on a GPU (minutes of compiling) and 6x the reps; three
timed runs instead of one on CPU (see BENCHMARKS.md)"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m accel_kernels.bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer reps, no torch.compile: about 70 s on one H200 (estimate), 2 minutes on "
                             "the 2-core CPU machine")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from: {','.join(OPS)}")
    parser.add_argument("--json", metavar="PATH",
                        help="also write every record and figure as JSON (rewritten after each op)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # op:impl, one CPU measurement in this process
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        name, impl = args.child.split(":")
        print(json.dumps(harness.run_one(name, impl, "cpu", args.quick)))
        return 0

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {','.join(OPS)}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    machine = (torch.cuda.get_device_name() if device == "cuda"
               else f"CPU, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    results = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="minutes"), machine=machine,
                   device=device, torch=torch.__version__,
                   triton=_triton.triton.__version__ if _triton.AVAILABLE else "not importable",
                   quick=args.quick, copy_gbs=None, rows=[])
    if device == "cuda":
        # compiled graphs keep their saved buffers (the peak-memory runs hold a forward's outputs);
        # torch 2.11: torch._functorch.config is not an attribute until imported
        importlib.import_module("torch._functorch.config").donated_buffer = False
        results["copy_gbs"] = harness.copy_bandwidth_gbs()
        impls = [i for i in harness.IMPLS if not (args.quick and i == "torch.compile")]
    else:
        results["cpu_reps"] = harness.CPU_REPS[args.quick]
        impls = ["accel_kernels", "eager"]
    report.print_preamble(results)
    for name in ops:
        results["rows"] += [harness.run_one(name, impl, device, args.quick) if device == "cuda"
                            else harness.run_one_in_subprocess(name, impl, args.quick) for impl in impls]
        report.compute(results)
        report.print_table(results, name)
        if args.json:  # a run cut short by a time limit keeps what it measured
            report.write_json(args.json, results)
    if device == "cpu" and "fused_linear_cross_entropy" in ops:
        report.print_cpu_flce(results)
    return 0
