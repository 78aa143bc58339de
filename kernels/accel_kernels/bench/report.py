"""The report: every derived figure is computed in one place (`compute`), into the measured records
themselves; the tables, the CPU summary and the JSON file are then read from those same records.

One convention for every ratio, in the tables, the summary and the JSON: this row's figure over
the reference's, lower is better. `time_vs_eager` ("t/eager") is the forward+backward time over
eager's, `mem_vs_eager` ("mem/eager") the forward+backward peak memory over eager's,
`time_vs_liger` ("t/liger") the time over Liger Kernel's. 0.50x: half the time (or memory).
"""
from __future__ import annotations

import json

from .catalogue import OPS

# fused linear CE vs eager on CPU, forward+backward: at most these ratios (ours / eager)
CPU_FLCE_TARGET = {"memory": 0.25, "time": 1.5}

# (header, record key, format); ratios get an "x"
_GPU_COLUMNS = [("fwd ms", "fwd_ms", ".3f"), ("bwd ms", "bwd_ms", ".3f"), ("f+b ms", "fb_ms", ".3f"),
                ("dev fwd", "dev_fwd_ms", ".3f"), ("dev bwd", "dev_bwd_ms", ".3f"), ("dev f+b", "dev_fb_ms", ".3f"),
                ("f+b MiB", "fb_mib", ".1f"), ("f+b GB/s", "fb_gbs", ".0f"), ("%copy", "pct_copy", ".0f"),
                ("dev %copy", "dev_pct_copy", ".0f"),
                ("t/eager", "time_vs_eager", ".2fx"), ("mem/eager", "mem_vs_eager", ".2fx"),
                ("t/liger", "time_vs_liger", ".2fx")]
# on CPU only forward+backward is timed, nothing is memory-bound against a copy, and Liger is skipped
_CPU_COLUMNS = [("f+b ms", "fb_ms", ".1f"), ("fwd MiB", "fwd_mib", ".1f"), ("f+b MiB", "fb_mib", ".1f"),
                ("t/eager", "time_vs_eager", ".2fx"), ("mem/eager", "mem_vs_eager", ".2fx")]
_IMPL_WIDTH, _CELL_WIDTH = 14, 10


def _ratio(value, reference) -> float | None:
    return value / reference if reference else None  # no reference row, or a reference of 0


def compute(results: dict) -> None:
    """Compute every derived figure into `results` (idempotent: call it again as rows arrive).

    Per "ok" row: time_vs_eager, mem_vs_eager; on CUDA also time_vs_liger, and for memory-bound
    ops fb_gbs (bytes fwd+bwd must move / f+b time) and pct_copy (that over the copy bandwidth),
    dev_fb_gbs and dev_pct_copy the same from the device time (dev_fb_ms) where it was measured.
    On CPU with fused linear CE measured: results["cpu_flce"], its ratios and verdicts.
    """
    device, copy_gbs = results["device"], results.get("copy_gbs")
    for name in dict.fromkeys(r["op"] for r in results["rows"]):
        op = OPS[name]
        ok = {r["impl"]: r for r in results["rows"] if r["op"] == name and r["status"] == "ok"}
        eager, liger = ok.get("eager", {}), ok.get("liger", {})
        shape = op.shapes["gpu" if device == "cuda" else "cpu"]
        moved = op.bytes_moved(2, **shape) if device == "cuda" and op.bytes_moved and copy_gbs else None
        for r in ok.values():
            r["time_vs_eager"] = _ratio(r["fb_ms"], eager.get("fb_ms"))
            r["mem_vs_eager"] = _ratio(r["fb_mib"], eager.get("fb_mib"))
            if device == "cuda":
                r["time_vs_liger"] = _ratio(r["fb_ms"], liger.get("fb_ms"))
                r["fb_gbs"] = moved / (r["fb_ms"] * 1e-3) / 1e9 if moved else None
                r["pct_copy"] = 100 * r["fb_gbs"] / copy_gbs if moved else None
                dev = r.get("dev_fb_ms")
                r["dev_fb_gbs"] = moved / (dev * 1e-3) / 1e9 if moved and dev else None
                r["dev_pct_copy"] = 100 * r["dev_fb_gbs"] / copy_gbs if r["dev_fb_gbs"] else None
        if device == "cpu" and name == "fused_linear_cross_entropy":
            results["cpu_flce"] = _cpu_flce(ok.get("accel_kernels"), ok.get("eager"))


def _cpu_flce(ours: dict | None, eager: dict | None) -> dict | None:
    if ours is None or eager is None:
        return None
    ratios = {"memory": ours["mem_vs_eager"], "time": ours["time_vs_eager"]}
    verdicts = {k: "PASS" if v is not None and v <= CPU_FLCE_TARGET[k] else "MISS" for k, v in ratios.items()}
    return dict(memory_ratio=ratios["memory"], time_ratio=ratios["time"], memory_verdict=verdicts["memory"],
                time_verdict=verdicts["time"], target=CPU_FLCE_TARGET, ours_fb_mib=ours["fb_mib"],
                eager_fb_mib=eager["fb_mib"], ours_fb_ms=ours["fb_ms"], eager_fb_ms=eager["fb_ms"], reps=ours["reps"])


def _cell(value, spec: str) -> str:
    if value is None:
        return format("-", f">{_CELL_WIDTH}")
    suffix = "x" if spec.endswith("x") else ""
    return format(format(value, spec.rstrip("x")) + suffix, f">{_CELL_WIDTH}")


def print_preamble(results: dict) -> None:
    quick = results["quick"]
    print(f"accel_kernels bench, {results['date']}, {results['machine']}, torch {results['torch']}, "
          f"triton {results['triton']}{', --quick' if quick else ''}")
    if results["device"] == "cuda":
        print(f"copy bandwidth (2 GiB device-to-device, read+write): {results['copy_gbs']:.0f} GB/s")
        print("time: median ms of each call between CUDA events (host included), L2 flushed before each, fresh "
              "inputs made before the timed region; dev: the call's kernel durations (torch.profiler), device only; "
              "memory: peak MiB of the step above what was allocated before it (inputs; for bwd also the forward's "
              "saved tensors), produced grads included; GB/s, %copy: bytes fwd+bwd must move / f+b time (host "
              "included), dev %copy: the same from the device time")
        if quick:
            print("--quick: torch.compile skipped (compiling every op would not fit the time)")
    else:
        print("no GPU: plain-torch twins at CPU shapes, float32, each measurement in a fresh process; memory: rise "
              "of ru_maxrss (peak RSS) over its value after the inputs were built; time: median wall ms of "
              f"{results['cpu_reps']} forward+backward run(s) after one warm-up; torch.compile and Liger skipped "
              "on CPU")
    print("ratios: this row's forward+backward figure over eager's (t/eager: time, mem/eager: peak memory) "
          "or Liger's (t/liger); below 1.00x is better")


def print_table(results: dict, name: str) -> None:
    """The table of one op, from its records (after `compute`)."""
    device = results["device"]
    shape = OPS[name].shapes["gpu" if device == "cuda" else "cpu"]
    dtype = "bfloat16" if device == "cuda" else "float32"
    print(f"\n== {name}: {' '.join(f'{k}={v}' for k, v in shape.items())}, {dtype}, {device} ==")
    columns = _GPU_COLUMNS if device == "cuda" else _CPU_COLUMNS
    print(format("impl", f"<{_IMPL_WIDTH}") + "".join(format(title, f">{_CELL_WIDTH}") for title, _, _ in columns))
    for r in (r for r in results["rows"] if r["op"] == name):
        if r["status"] != "ok":
            print(f"{r['impl']:<{_IMPL_WIDTH}}{r['status']}: {r.get('note', '')}")
            continue
        print(format(r["impl"], f"<{_IMPL_WIDTH}") + "".join(_cell(r.get(key), spec) for _, key, spec in columns))


def print_cpu_flce(results: dict) -> None:
    """The one CPU figure that matters: fused linear CE against eager, from results["cpu_flce"]."""
    shape = OPS["fused_linear_cross_entropy"].shapes["cpu"]
    print(f"\n== fused linear cross-entropy vs eager F.cross_entropy(hidden @ weight.T, labels), CPU, float32, "
          f"{shape['tokens']} tokens, hidden {shape['hidden']}, vocab {shape['vocab']}, forward+backward ==")
    s = results.get("cpu_flce")
    if s is None:
        status = {r["impl"]: r["status"] for r in results["rows"] if r["op"] == "fused_linear_cross_entropy"}
        print(f"not measured: accel_kernels {status.get('accel_kernels')}, eager {status.get('eager')}")
        return
    print(f"peak memory (ru_maxrss rise over the inputs, fresh process each): {s['ours_fb_mib']:.0f} MiB vs "
          f"{s['eager_fb_mib']:.0f} MiB: mem/eager {_cell(s['memory_ratio'], '.3fx').strip()} "
          f"(target <= {s['target']['memory']}x): {s['memory_verdict']}")
    print(f"time (median of {s['reps']} after a warm-up): {s['ours_fb_ms'] / 1e3:.2f} s vs "
          f"{s['eager_fb_ms'] / 1e3:.2f} s: "
          f"t/eager {_cell(s['time_ratio'], '.2fx').strip()} (target <= {s['target']['time']}x): {s['time_verdict']}")


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
