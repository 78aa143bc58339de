"""The one table that ends benchmarks/gpu_check.sh's output: every measured thing of the run, read
from the steps' JSON files in $OUT, one row each, with its ratio against what a user would pick
instead and PASS or MISS against the targets below (a MISS is a figure; a wrong loss is WRONG).

    python3 benchmarks/summary.py --out out --steps "versions:0:6 kernel-tests:0:35 e2e:124:150"

--steps: each step's name, exit status and seconds as gpu_check.sh ran it (rc 124: its time limit,
125: not started, BUDGET_S). Plain Python (no torch): it runs in a second.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# the targets, as the run plan states them (docs/benchmarks.md)
FULL_VS_STOCK = 1.35      # accel-patch full fine-tune tokens/s over stock's; also >= Liger's, peak <= Liger's
LORA_VS_STOCK = 1.35      # accel-patch LoRA over stock PEFT; also >= Liger + PEFT
LORA_PEAK = 0.3           # accel-patch LoRA peak growth over stock PEFT's
COMPILED_VS_STOCK = 1.1   # accel-patch + torch.compile over stock + torch.compile
FUSED_VS_WITHOUT = 1.0    # fused LoRA (autocast, dropout) over the same step without the LoRA ops
COPY_PCT = 70             # memory-bound op, device time: % of the copy bandwidth
MOE_OP = 0.8              # moe_experts fwd+bwd time over grouped_mm's (eager)
MOE_OP_BACKWARD = 1.0     # moe_experts backward time over grouped_mm's
MOE_STEP = {"full": 1.3, "lora": 1.5}  # MoE model step tokens/s over grouped_mm's
MOE_CHECKPOINTED = 1.1

ROWS: list[tuple] = []
EAGER_STOCK: dict = {}  # e2e's eager stock variant, for e2e-compile's compiled stock


def add(step, variant, figure="", against="", ratio="", peak="", verdict=""):
    ROWS.append((step, variant, figure, against, ratio, peak, verdict))


def load(out: str, name: str):
    try:
        with open(os.path.join(out, f"{name}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def pf(ok: bool | None) -> str:
    return "-" if ok is None else "PASS" if ok else "MISS"


def x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def failed(r: dict) -> str | None:
    if "error" in r:
        return "FAILED: " + str(r["error"])[:110]
    if "skipped" in r:
        return "skipped: " + str(r["skipped"])[:80]
    return None


def kernel_tests(out):
    d = load(out, "kernel-tests")
    if d:
        ok = d.get("failed", 0) == 0 and d.get("errors", 0) == 0 and d.get("exitstatus") == 0
        add("kernel-tests", "CUDA, -n 8", f"{d.get('passed', 0)}/{d.get('collected', 0)} passed",
            "", "", "", f"{'PASS' if ok else 'FAIL'} failed {d.get('failed', 0)} errors {d.get('errors', 0)} "
                        f"skipped {d.get('skipped', 0)} {'' if d.get('finished') else '(cut short)'}")
        for line in d.get("failures", [])[:3]:
            add("", "  " + line[:100])


NAMES = {"swapped": "accel-patch", "liger": "Liger"}


def shown(variant: str) -> str:
    base, *rest = variant.split("+")
    return "+".join([NAMES.get(base, base)] + rest)


def e2e(out, name):
    d = load(out, name)
    if not d:
        return
    variants = {}
    for row in d.get("rows", []):
        for k, v in row.items():
            if isinstance(v, dict) and "variant" in v:
                variants[k] = v
    if name == "e2e":
        EAGER_STOCK.update({k: r for k, r in variants.items() if k == "stock" and not failed(r)})
    for v, r in variants.items():
        step = f"{name} {'LoRA' if '+lora' in v else 'full'}" if name == "e2e" else name
        bad = failed(r)
        if bad:
            add(step, shown(v), verdict=bad)
            continue
        base = "stock+lora" if "+lora" in v else "stock+compile" if "+compile" in v else "stock"
        liger = v.replace("swapped", "liger")
        b, lg = variants.get(base), variants.get(liger)
        fig = f"{r['tokens_per_s']:.0f} tok/s"
        peak = f"{r['peak_growth_mib']:.0f}"
        if v == base:
            eager = EAGER_STOCK.get("stock") if v == "stock+compile" else None
            note = "baseline"
            if eager:  # compiled stock against eager stock (e2e's): the same weights and tokens
                ld = abs(r["loss"] - eager["loss"]) / max(abs(eager["loss"]), 1e-30)
                gd = abs(r["grad_norm"] - eager["grad_norm"]) / max(abs(eager["grad_norm"]), 1e-30)
                ok = ld <= d.get("loss_bound", 2e-2) and gd <= d.get("grad_bound", 5e-2)
                note += f"; vs eager stock: loss {'OK' if ok else 'WRONG'}, tokens/s {x(r['tokens_per_s'] / eager['tokens_per_s'])}"
            add(step, shown(v), fig, "", "", peak, note)
            continue
        usable = (lambda o: o is not None and not failed(o))
        speed = r["tokens_per_s"] / b["tokens_per_s"] if usable(b) else None
        mem = r["peak_growth_mib"] / b["peak_growth_mib"] if usable(b) and b["peak_growth_mib"] > 0 else None
        correct = None
        if usable(b):
            bound_l, bound_g = d.get("loss_bound", 2e-2), d.get("grad_bound", 5e-2)
            ld = abs(r["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30)
            gd = abs(r["grad_norm"] - b["grad_norm"]) / max(abs(b["grad_norm"]), 1e-30)
            correct = ld <= bound_l and gd <= bound_g
        verdict = "" if correct is None else ("loss OK " if correct else "loss WRONG ")
        if v.startswith("swapped"):
            vs_liger = r["tokens_per_s"] / lg["tokens_per_s"] if usable(lg) else None
            peak_liger = r["peak_growth_mib"] / lg["peak_growth_mib"] if usable(lg) and lg["peak_growth_mib"] > 0 else None
            if "+compile" in v:
                verdict += f"{pf(speed and speed >= COMPILED_VS_STOCK)} >= {COMPILED_VS_STOCK}x"
            elif "+lora" in v:
                verdict += (f"{pf(speed and speed >= LORA_VS_STOCK)} >= {LORA_VS_STOCK}x; "
                            f"{pf(None if vs_liger is None else vs_liger >= 1)} vs Liger {x(vs_liger)}; "
                            f"peak {pf(None if mem is None else mem <= LORA_PEAK)} <= {LORA_PEAK}x")
            else:
                verdict += (f"{pf(speed and speed >= FULL_VS_STOCK)} >= {FULL_VS_STOCK}x; "
                            f"{pf(None if vs_liger is None else vs_liger >= 1)} vs Liger {x(vs_liger)}; "
                            f"peak/Liger {x(peak_liger)} {pf(None if peak_liger is None else peak_liger <= 1)}")
        add(step, shown(v), fig, shown(base), x(speed), f"{peak} ({x(mem)})", verdict)


LORA_NAMES = {"stock": "stock PEFT", "liger": "Liger+PEFT", "swapped today": "a-p w/o LoRA ops",
              "fused LoRA": "a-p fused LoRA", "fused LoRA untimed": "a-p fused, untimed",
              "fused LoRA + tiled MLP": "a-p fused+tiled"}


def lora(out, name):
    d = load(out, name)
    if not d:
        return
    rows = {r.get("variant"): r for r in d.get("rows", [])}
    stock, today = rows.get("stock"), rows.get("swapped today")
    for v, r in rows.items():
        bad = failed(r)
        if bad or "tokens_per_s" not in r:
            add(name, LORA_NAMES.get(v, v), verdict=bad or "not timed")
            continue
        fig = f"{r['tokens_per_s']:.0f} tok/s"
        peak = f"{r['peak_growth_mib']:.0f}"
        if v == "stock":
            add(name, "stock PEFT", fig, "", "", peak, "baseline")
            continue
        ok_loss = r.get("correct")
        verdict = "" if ok_loss is None else ("loss OK " if ok_loss else "loss WRONG ")
        usable = (lambda o: o is not None and "tokens_per_s" in o)
        speed = r["tokens_per_s"] / stock["tokens_per_s"] if usable(stock) else None
        mem = r["peak_growth_mib"] / stock["peak_growth_mib"] if usable(stock) and stock["peak_growth_mib"] > 0 else None
        if v == "fused LoRA" and usable(today):
            t = r["tokens_per_s"] / today["tokens_per_s"]
            lg = rows.get("liger")
            vs_liger = r["tokens_per_s"] / lg["tokens_per_s"] if usable(lg) else None
            verdict += (f"{pf(t >= FUSED_VS_WITHOUT)} vs without LoRA ops {t:.2f}x (>= {FUSED_VS_WITHOUT}x); "
                        f"vs Liger {x(vs_liger)}")
        add(name, LORA_NAMES.get(v, v), fig, "stock PEFT", x(speed), f"{peak} ({x(mem)})", verdict)


def bench(out):
    d = load(out, "bench")
    if not d:
        return
    by_op = {}
    for r in d.get("rows", []):
        by_op.setdefault(r["op"], {})[r["impl"]] = r
    for op, impls in by_op.items():
        ours = impls.get("accel_kernels", {})
        if ours.get("status") != "ok":
            add("bench", op, verdict=f"accel_kernels {ours.get('status')}: {str(ours.get('note', ''))[:80]}")
            continue
        liger = impls.get("liger", {})
        liger_note = (f"Liger {liger.get('status')}" if liger.get("status") not in (None, "ok")
                      else f"t/Liger {x(ours.get('time_vs_liger'))}")
        fig = f"f+b {ours['fb_ms']:.3f} ms, dev {ours['dev_fb_ms']:.3f}" if ours.get("dev_fb_ms") else f"f+b {ours['fb_ms']:.3f} ms"
        verdict = liger_note
        if ours.get("dev_pct_copy") is not None:
            verdict = (f"dev {ours['dev_pct_copy']:.0f}% copy {pf(ours['dev_pct_copy'] >= COPY_PCT)} (>= {COPY_PCT}%), "
                       f"host-incl {ours.get('pct_copy') or 0:.0f}%; " + liger_note)
        elif op == "moe_experts":  # its eager is transformers' grouped_mm path (gpt-oss's is a loop)
            eager = impls.get("eager", {})
            dev = (ours["dev_fb_ms"] / eager["dev_fb_ms"]) if ours.get("dev_fb_ms") and eager.get("dev_fb_ms") else None
            t = ours.get("time_vs_eager")
            verdict = f"{pf(None if t is None else t <= MOE_OP)} <= {MOE_OP}x grouped_mm (dev {x(dev)}); " + liger_note
        add("bench", op, fig, "eager", x(ours.get("time_vs_eager")), f"{ours.get('fb_mib', 0):.0f}", verdict)


def moe(out, name):
    d = load(out, name)
    if not d:
        return
    rows = d.get("rows", [])
    for mode in ("full", "lora"):
        mine = {r["variant"]: r for r in rows if r.get("mode") == mode}
        base = mine.get("grouped_mm")
        for v, r in mine.items():
            bad = failed(r)
            if bad or "tokens_per_s" not in r:
                add(f"{name} {mode}", v, verdict=bad or "not timed")
                continue
            fig = f"{r['tokens_per_s']:.0f} tok/s"
            peak = f"{r.get('peak_growth_mib', 0):.0f}"
            if v == "grouped_mm":
                add(f"{name} {mode}", v, fig, "", "", peak, "baseline")
                continue
            ok_base = base is not None and "tokens_per_s" in base
            speed = r["tokens_per_s"] / base["tokens_per_s"] if ok_base else None
            mem = r["peak_growth_mib"] / base["peak_growth_mib"] if ok_base and base.get("peak_growth_mib") else None
            target = MOE_CHECKPOINTED if "checkpointed" in name else MOE_STEP[mode]
            verdict = f"{pf(None if speed is None else speed >= target)} >= {target}x" if v == "accel_patch" else ""
            add(f"{name} {mode}", v, fig, "grouped_mm", x(speed), f"{peak} ({x(mem)})", verdict)


def moe_op(out, name):
    """benchmarks/moe_backward.py: each of the op's variants against transformers' grouped_mm path
    (time: lower is better), the targets judged on auto's row (what a user runs)."""
    d = load(out, name)
    if not d:
        return
    rows = d.get("rows", [])
    base = next((r for r in rows if r["variant"].startswith("grouped_mm")), None)
    for r in rows:
        fig = f"fwd {r['forward_ms']:.2f} bwd {r['backward_ms']:.2f} ms"
        if r is base:
            add(name, "transformers", fig, "", "", "", "baseline (its grouped_mm path)")
            continue
        both = r["total_ms"] / base["total_ms"] if base and base["total_ms"] else None
        back = r["backward_ms"] / base["backward_ms"] if base and base["backward_ms"] > 0 else None
        verdict = f"bwd {x(back)}" + (f" {pf(None if back is None else back <= MOE_OP_BACKWARD)} <= {MOE_OP_BACKWARD}x; "
                                      f"both {pf(None if both is None else both <= MOE_OP)} <= {MOE_OP}x"
                                      if r["variant"] == "ours auto" else "")
        # the op's backward forced ("triton bwd", "grouped_mm bwd"; ", small": its small tiles forced) or auto's
        v = r["variant"].removeprefix("ours ")
        shown_as = v.replace(", small tiles", ", small") if v.endswith("small tiles") else v if v == "auto" else v + " bwd"
        add(name, shown_as, fig, "transformers", x(both), "", verdict)
    if "tiles" in d:
        add(name, "tiles", f"block_m {d['tiles'].get('block_m')}", "", "", "",
            f"auto: {d.get('auto')}" + (", timed" if d.get("timed") else ", its rule"))


def profile(out):
    d = load(out, "profile")
    if not d:
        return
    for v, p in d.get("profiles", {}).items():
        if "error" in p:
            add("profile", shown(v), verdict="FAILED: " + p["error"][:80])
            continue
        top = p["kernels"][0] if p.get("kernels") else {}
        add("profile", shown(v), f"dev {p['device_total_us'] / 1e3:.1f} ms", "", "",
            "", f"host ops {p['cpu_self_total_us'] / 1e3:.1f} ms; top kernel {top.get('name', '-')[:40]} "
                f"{top.get('device_self_us', 0) / 1e3:.1f} ms")


def other(out, name):
    d = load(out, name)
    if d and "skipped" in d:
        add(name, "", verdict="skipped: " + str(d["skipped"]))
    elif d:
        add(name, "", verdict=f"ran: its figures are in gpu_check.log and {name}.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="the folder of the steps' JSON files")
    p.add_argument("--steps", default="", help="name:rc:seconds of each step, space-separated")
    args = p.parse_args(argv)
    steps = [s.split(":") for s in args.steps.split() if s.count(":") == 2]
    v = load(args.out, "versions") or {}
    for name, rc, secs in steps:
        if load(args.out, name) is None:
            add(name, "", verdict=f"no figures (rc {rc}{': not started' if rc == '125' else ''})")
        elif name == "kernel-tests":
            kernel_tests(args.out)
        elif name in ("e2e", "e2e-compile", "compile"):
            e2e(args.out, name)
            if name == "e2e":
                profile(args.out)
        elif name in ("lora", "lora-small", "qlora", "lora-compile"):
            lora(args.out, name)
        elif name == "bench":
            bench(args.out)
        elif name == "moe-op":
            moe_op(args.out, name)
        elif name.startswith("moe"):
            moe(args.out, name)
        elif name != "versions":
            other(args.out, name)
    print(f"\n===== SUMMARY: {v.get('gpu') or v.get('machine', '?')}, torch {v.get('torch', '?')}, "
          f"triton {v.get('triton', '?')}, transformers {v.get('transformers', '?')}, "
          f"liger-kernel {v.get('liger-kernel', '?')} =====")
    print("steps: " + ", ".join(f"{n} rc={rc} {s}s" for n, rc, s in steps)
          + "  (rc 124: its limit, 125: not started by BUDGET_S)")
    widths = [22, 20, 26, 14, 7, 16]
    print("".join(h.ljust(w) for h, w in zip(("step", "variant", "figure", "vs", "ratio", "peak MiB (x)"), widths))
          + "verdict")
    for row in ROWS:
        cells = [str(c) for c in row]
        print(("".join(c[:w - 1].ljust(w) for c, w in zip(cells, widths)) + cells[-1]).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
