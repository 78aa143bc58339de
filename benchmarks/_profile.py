"""One training step under torch.profiler, kept compact: where the device time goes (top kernels
by their own device time) and where the host time goes (top ops by their own CPU time, and every
op of a kernel library: accel_kernels' custom ops, Liger's autograd functions), as a dict for the
step's JSON, and a short top-N for the log."""
from __future__ import annotations

TOP = 25
LIBRARY_MARKS = ("accel_kernels", "Liger", "liger")


def profile_step(step, device: str) -> dict:
    """Run `step()` once under the profiler; {"kernels", "ops", "library_ops", totals} in microseconds."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()

    def device_self(e) -> float:
        return float(getattr(e, "self_device_time_total", 0.0) or 0.0)

    def row(e) -> dict:
        return dict(name=e.key[:160], count=e.count, cpu_self_us=round(e.self_cpu_time_total, 1),
                    cpu_total_us=round(e.cpu_time_total, 1), device_self_us=round(device_self(e), 1))

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]  # a CPU op's device time is its kernels' again
    ops = [e for e in events if e.self_cpu_time_total > 0]
    return dict(
        device_total_us=round(sum(device_self(e) for e in kernels), 1),
        cpu_self_total_us=round(sum(e.self_cpu_time_total for e in ops), 1),
        kernels=[row(e) for e in sorted(kernels, key=device_self, reverse=True)[:TOP]],
        ops=[row(e) for e in sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP]],
        library_ops=[row(e) for e in sorted(events, key=lambda e: e.cpu_time_total, reverse=True)
                     if any(m in e.key for m in LIBRARY_MARKS) and e.self_cpu_time_total > 0][:TOP])


def top_lines(name: str, prof: dict, n: int = 8) -> list[str]:
    """A few log lines: the step's totals, the top kernels by device time and ops by host time."""
    lines = [f"profile {name}: device {prof['device_total_us'] / 1e3:.1f} ms in kernels, "
             f"host {prof['cpu_self_total_us'] / 1e3:.1f} ms in ops (one step)"]
    total = max(prof["device_total_us"], 1e-9)
    for r in prof["kernels"][:n]:
        lines.append(f"  kernel {r['device_self_us'] / 1e3:8.2f} ms {100 * r['device_self_us'] / total:5.1f}% "
                     f"x{r['count']:<5} {r['name'][:90]}")
    for r in prof["ops"][:n]:
        lines.append(f"  host   {r['cpu_self_us'] / 1e3:8.2f} ms        x{r['count']:<5} {r['name'][:90]}")
    for r in prof["library_ops"][:n]:
        lines.append(f"  lib    {r['cpu_total_us'] / 1e3:8.2f} ms host (incl. children) x{r['count']:<5} {r['name'][:80]}")
    return lines
