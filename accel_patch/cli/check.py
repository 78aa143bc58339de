"""`accel-patch check`: the self-test for a new machine or after an upgrade.

Three parts, one table, exit code 0 only if every row passes:

- kernels: every accel_kernels op, forward and gradients, against its eager formula run in float64,
  at a small shape (the experts twice: Qwen3-MoE's layout, and gpt-oss's transposed, interleaved,
  biased layout past its clamp with PEFT's split LoRA on both projections), on each local device and on each path an op takes there (Triton on a GPU;
  on the CPU the plain-torch twin, and the Triton kernels themselves when they run under Triton's
  interpreter, which `accel-patch check` turns on when the machine has no GPU);
- models: for each family it knows, a tiny random model is swapped (the probe decides) and one
  padded training step must equal stock's (loss within 1e-5, every gradient within 1e-4);
- mixers: what runs in the linear-attention and SSM mixers of the families this transformers has
  (no accel-patch op: the package transformers found, or its torch reference, and how to get the
  kernel), one row per package; information, never a failure;
- launch: the topology, accelerate decision and device map this process would get;
- codegen (only when asked: `--parts codegen`, about 2 minutes on 2 cores): every Triton launch the
  kernels make at real model shapes, compiled ahead of time for sm_80 and sm_90a (no GPU needed),
  one row a configuration with its registers, spills, shared memory and blocks per SM
  (`accel_kernels.codegen`).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections import namedtuple

PARTS = ("kernels", "models", "mixers", "launch")  # the default
ALL_PARTS = PARTS + ("codegen",)

KERNEL_BOUND = 1e-5  # float32 against float64: as the kernel tests
LOSS_BOUND, GRAD_BOUND = 1e-5, 1e-4  # as the swap parity tests

Row = namedtuple("Row", "part name where ok figure detail")

# Tiny configs of the families the swap knows (transformers config class, model class, overrides).
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                         "output_router_logits": True}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    # the experts' other path: transposed, interleaved gate/up, biases, the clamped GLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                                       "sliding_window": 8,
                                                       "layer_types": ["sliding_attention", "full_attention"]}),
}


def build_family(name: str, dtype=None, **overrides):
    """A tiny random model of family `name` (None when this transformers lacks the family)."""
    import torch
    import transformers

    config_name, model_name, extra = FAMILIES[name]
    config_cls, model_cls = getattr(transformers, config_name, None), getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        return None
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides}))
    return model.to(dtype) if dtype is not None else model


def padded_batch(device=None):
    """Left padding and ignored labels, as an SFT batch looks."""
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    for row in range(3):
        ids[row, : 2 * row % 5] = 0
        mask[row, : 2 * row % 5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :4] = -100
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _outputs_and_grads(fn, inputs):
    import torch

    outs = fn(*inputs)
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if o is not None]
    g = torch.Generator().manual_seed(2)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g).to(o) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


@contextlib.contextmanager
def _path(twin: bool):
    """Run the ops' plain-torch twins (twin=True) or their own choice (the Triton path where it runs)."""
    from accel_kernels import _dispatch

    if not twin:
        yield
        return
    real = _dispatch.use_triton
    _dispatch.use_triton = lambda t: False
    try:
        yield
    finally:
        _dispatch.use_triton = real


def _paths(device) -> list[tuple[str, bool]]:
    from accel_kernels import _dispatch

    import torch

    probe = torch.empty(0, device=device)
    if not _dispatch.use_triton(probe):
        return [("torch twin", True)]
    label = "triton (interpreter)" if device.type == "cpu" else "triton"
    return [(label, False)] + ([("torch twin", True)] if device.type == "cpu" else [])


def check_kernels(devices) -> list[Row]:
    import torch

    from accel_kernels.bench.catalogue import OPS

    rows = []
    for device in devices:
        for label, twin in _paths(device):
            for name, op in OPS.items():
                where = f"{device} {label}"
                try:
                    torch.manual_seed(0)
                    inputs = op.make(device, torch.float32, **op.shapes["check"])
                    fresh = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
                    ref_in = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point()
                              else t.clone() for t in inputs]
                    with _path(twin):
                        got = _outputs_and_grads(op.ours, fresh)
                    ref = _outputs_and_grads(op.eager, ref_in)
                    err = max(_rel(a, b) for a, b in zip(got, ref))
                    rows.append(Row("kernels", name, where, err <= KERNEL_BOUND, f"rel err {err:.1e}",
                                    "" if err <= KERNEL_BOUND else f"exceeds {KERNEL_BOUND:.0e} against float64"))
                except Exception as exc:
                    rows.append(Row("kernels", name, where, False, "-", f"{type(exc).__name__}: {exc}"))
    return rows


def check_models(device, families=None) -> list[Row]:
    import copy


    from ..swaps import OPS, restore_kernels, swap_kernels

    rows = []
    batch = padded_batch(device)
    for name in families or FAMILIES:
        where = str(device)
        try:
            stock = build_family(name)
            if stock is None:
                rows.append(Row("models", name, where, True, "skipped", "this transformers has no such family"))
                continue
            stock.to(device)
            twin = copy.deepcopy(stock)
            report = swap_kernels(twin)
            losses, grads = [], []
            for model in (stock, twin):
                model.train()
                out = model(**batch)
                out.loss.backward()
                losses.append(out.loss.detach())
                grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
            loss_err = _rel(losses[1], losses[0])
            grad_err = max(_rel(grads[1][n], g) for n, g in grads[0].items())
            ok = bool(report.swapped) and loss_err <= LOSS_BOUND and grad_err <= GRAD_BOUND
            swapped = ", ".join(f"{op} {report.swapped[op]}" for op in OPS if op in report.swapped) or "nothing swapped"
            refused = sorted({r.op for r in report.refused})
            detail = swapped + (f"; refused {', '.join(refused)}" if refused else "")
            if not ok:
                detail = f"loss rel err {loss_err:.1e} (<= {LOSS_BOUND:.0e}), grads {grad_err:.1e} (<= {GRAD_BOUND:.0e}); " + detail
            rows.append(Row("models", name, where, ok, f"loss {loss_err:.1e} grads {grad_err:.1e}", detail))
            restore_kernels(twin)
        except Exception as exc:
            rows.append(Row("models", name, where, False, "-", f"{type(exc).__name__}: {exc}"))
    return rows


def check_mixers() -> list[Row]:
    """One row per package transformers falls back from in its mixers: which families, what runs."""
    from ..swaps.layers import mixers

    try:
        found = mixers.kinds()
    except Exception as exc:  # information only: a layout we cannot read is said, never a failure
        return [Row("mixers", "mixers", "-", True, "not read", f"{type(exc).__name__}: {exc}")]
    rows = []
    for package, (families, what) in found.items():
        dist = mixers.DISTRIBUTIONS.get(package, package)
        figure = "torch reference" if what.startswith("torch reference") else what.split(":")[0]
        shown = ", ".join(families[:6]) + (f" and {len(families) - 6} more" if len(families) > 6 else "")
        rows.append(Row("mixers", dist, "-", True, figure, f"{what}; {len(families)} families: {shown}"))
    return rows or [Row("mixers", "mixers", "-", True, "none", "this transformers has no mixer families")]


def check_launch() -> list[Row]:
    """The decisions this process would get: what `accel-patch env` reports."""
    from ..core.accelerate_decision import FSDP1_WITHOUT_ACCELERATOR
    from ..core.topology_resolver import TopologyError
    from .report import env_report

    try:
        report = env_report()
    except TopologyError as exc:
        return [Row("launch", "topology", "-", False, "-", str(exc))]
    topo, state = report["topology"], report["accelerate_state"]
    where = f"{topo['device_count']} x {topo['device_type']}" if topo["device_count"] else "cpu"
    described = " ".join(f"{k}={topo[k]}" for k in ("world_size", "rank", "local_rank", "local_world_size",
                                                     "num_nodes")) + f" devices={where}"
    return [Row("launch", "topology", "-", True, topo["launcher"], described),
            # fsdp1-without-accelerator is a run that will stop: fail here first
            Row("launch", "accelerate state", "-", state["action"] != FSDP1_WITHOUT_ACCELERATOR, state["action"],
                state["reason"]),
            Row("launch", "device map", "-", True, str(report["device_map"]),
                report["load"]["reason"] if report["load"]["engine"] else "")]


def check_codegen() -> list[Row]:
    """One row a compiled configuration of `accel_kernels.codegen` (the whole matrix)."""
    try:
        from accel_kernels import codegen

        records = codegen.run(quick=False)
    except Exception as exc:  # triton missing, or a broken install: one failing row says so
        return [Row("codegen", "compile", "-", False, "-", f"{type(exc).__name__}: {exc}")]
    rows = []
    for r in records:
        if "error" in r:
            figure = "-"
        else:
            figure = (f"{r['registers']} regs, spill {r['spill_stores']}/{r['spill_loads']} B, "
                      f"smem {r['shared']} B, {r['blocks_per_sm']}/SM, {r['num_warps']} warps")
        models = sorted({m.split("/")[0] for m in r["models"]})
        detail = f"{r['shape']} ({', '.join(models)})" + ("" if r["ok"] else "; " + "; ".join(r["problems"]))
        rows.append(Row("codegen", r["kernel"], f"{r['target']} {r['dtype']}", r["ok"], figure, detail))
    return rows


def local_devices():
    import torch

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def collect(parts=PARTS) -> list[Row]:
    """Every row of the self-test."""
    from ..swaps.ops import bad_names

    devices = local_devices()
    rows = []
    problem = bad_names()  # what every training run would swap: a bad name fails the self-test
    if problem:
        rows.append(Row("settings", "ACCEL_PATCH_KERNELS", "-", False, "-", problem))
    if "kernels" in parts:
        rows += check_kernels(devices)
    if "models" in parts:
        rows += check_models(devices[-1])  # the accelerator when there is one
    if "mixers" in parts:
        rows += check_mixers()
    if "launch" in parts:
        rows += check_launch()
    if "codegen" in parts:
        rows += check_codegen()
    return rows


def table(rows: list[Row], seconds: float) -> str:
    header = ("part", "check", "where", "result", "figure", "detail")
    cells = [header] + [(r.part, r.name, r.where, "PASS" if r.ok else "FAIL", r.figure, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(5)]
    lines = ["  ".join(f"{c[i]:<{widths[i]}}" for i in range(5)) + f"  {c[5]}" for c in cells]
    failed = sum(not r.ok for r in rows)
    lines.append(f"\n{len(rows) - failed} passed, {failed} failed in {seconds:.1f} s")
    return "\n".join(line.rstrip() for line in lines)


def main(as_json: bool = False, parts=PARTS) -> int:
    import json

    start = time.perf_counter()
    found = collect(parts)
    seconds = time.perf_counter() - start
    if as_json:
        print(json.dumps({"passed": all(r.ok for r in found), "seconds": seconds,
                          "rows": [r._asdict() for r in found]}))
    else:
        print(table(found, seconds))
    return 0 if all(r.ok for r in found) else 1


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in ALL_PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"choose among {','.join(ALL_PARTS)}, got {text!r}")
    return parts


def add_parser(commands):
    parser = commands.add_parser("check", help="self-test: kernels, swapped models and this launch; exit 0 if all pass")
    parser.add_argument("--json", action="store_true", help="one JSON object, for machines")
    parser.add_argument("--parts", type=_parts, default=PARTS, help=f"comma list among {','.join(ALL_PARTS)} (default: {','.join(PARTS)}; "
                        "codegen compiles every kernel configuration for sm_80 and sm_90a, about 2 min)")
    return parser


def run(args) -> int:
    import torch

    import warnings

    # numpy's note on exp overflowing to inf in the interpreter (a sigmoid of a large gate: exact)
    warnings.filterwarnings("ignore", message="overflow encountered in exp", category=RuntimeWarning)
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # No GPU: check the Triton kernels themselves, on the CPU, under Triton's interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
        if not args.json:
            print("no GPU: the Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1)\n")
    return main(as_json=args.json, parts=args.parts)
