"""GLM-5-next's training-step parity, swapped against stock, with the float64 run as the judge:
is a gradient difference a different function or a different float32 summation order?

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/glm5_next_parity.py            # the table
    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/glm5_next_parity.py --json out.json

The model is benchmarks/census.py's tiny GLM-5-next (random weights, nothing downloaded; 4 layers,
hyper-connections with 4 streams). Its dense MLPs' and experts' gate/up weights are scaled up so
that pre-activations pass `swiglu_limit` (the table says what share of the gate/up values is past
it): the clamp's function is then in play. One step: a fixed batch, the loss a fixed weighting of
the last hidden states (the text model has no LM head), backward in training mode.

Runs, all from the same weights and batch:
- stock32: the stock model in float32;        swapped32: the same, every kernel swapped (Triton's
  interpreter on CPU: the kernels' own code);
- stock64: the stock model in float64 (the reference);
- stock32_flipped: stock in float32 with the batch's two rows in the other order: the same
  function (the loss sums over every token), another float32 summation order of every reduction
  over tokens, parameter gradients included;
- stock32_sequential_norms: stock in float32 with its RMSNorms' mean of squares summed left to right
  (`norms_summed_sequentially`): stock's formula, the norms' float32 summation order changed, which
  is what the swapped norms change;
and the same four with `swiglu_limit` out of reach (1e6): the clamp never acts.

Per parameter the relative error ||a - b|| / ||b|| of the gradients: swapped vs stock, stock_flipped
vs stock (what a reordering alone does), and stock vs float64 and swapped vs float64 (how far each is
from the exact value). A kernel that computed another function would be further from float64 than
stock is; a summation-order difference leaves both at the same distance.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels' own code on CPU tensors
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Gate/up weight scale: at 25x the initializer's std, about a fifth of the pre-activations pass 10.
PAST_CLAMP_SCALE = 25.0
OUT_OF_REACH = 1e6
WATCH = "layers.2.attn_hc.base"  # the gradient furthest from stock's in the census parity run


def build(limit: float):
    import torch
    import transformers

    import census

    cls = transformers.Glm5NextTextConfig
    cfg = cls(**census.tiny_kwargs(cls, {"swiglu_limit": limit}))
    torch.manual_seed(0)
    model = census.build(transformers, "Glm5NextTextConfig", cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_proj.weight", "up_proj.weight", "experts.gate_up_proj")):
                p.mul_(PAST_CLAMP_SCALE)
    return model


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 12), generator=g)


def step(model, ids):
    """{parameter: gradient} of one training step, and the share of dense-MLP gate/up values past the limit."""
    import torch

    model.train()
    model.zero_grad(set_to_none=True)
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(out.detach().abs().flatten()))
             for n, m in model.named_modules() if n.endswith(("gate_proj", "up_proj"))]
    out = model(input_ids=ids)
    for h in hooks:
        h.remove()
    h = out.last_hidden_state
    weights = torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)
    (h * weights).sum().backward()
    limit = model.config.swiglu_limit
    past = float((torch.cat(seen) > limit).double().mean()) if seen else 0.0
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}, past


def _sequential_mean_sq(x):
    """mean(x**2) over the last dim summed left to right (cumsum): the same value as torch's
    vectorized mean, another float32 summation order."""
    return x.pow(2).cumsum(-1)[..., -1:] / x.shape[-1]


@contextlib.contextmanager
def norms_summed_sequentially():
    """Stock's RMSNorm and unweighted RMSNorm (the hyper-connections' input norm) with their formula
    unchanged but for the order in which the mean of squares is summed: the part of the step the
    swapped norms compute in their own order."""
    import torch
    from transformers.models.glm5_next import modeling_glm5_next as m

    def weighted(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        hidden_states = hidden_states * torch.rsqrt(_sequential_mean_sq(hidden_states) + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def unweighted(self, x):
        return x * torch.rsqrt(_sequential_mean_sq(x.float()) + self.variance_epsilon).to(x.dtype)

    saved = m.Glm5NextTextRMSNorm.forward, m.Glm5NextTextUnweightedRMSNorm.forward
    m.Glm5NextTextRMSNorm.forward, m.Glm5NextTextUnweightedRMSNorm.forward = weighted, unweighted
    try:
        yield
    finally:
        m.Glm5NextTextRMSNorm.forward, m.Glm5NextTextUnweightedRMSNorm.forward = saved


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def compare(limit: float) -> dict:
    import torch

    import accel_patch
    from accel_kernels import _launch

    stock = build(limit)
    accel_patch.restore_kernels(stock)  # the load hook may have swapped at from_config
    swapped = copy.deepcopy(stock)
    reference = copy.deepcopy(stock).double()
    reference.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    report = accel_patch.swap_kernels(swapped)
    ids = batch()
    g_stock, past = step(stock, ids)
    with _launch.recording() as launched:
        g_swapped, _ = step(swapped, ids)
    g_flipped, _ = step(stock, ids.flip(0))
    with norms_summed_sequentially():
        g_other, _ = step(stock, ids)
    g64, _ = step(reference, ids)
    rows = {}
    for name in g_stock:
        rows[name] = dict(swapped_vs_stock=rel(g_swapped[name], g_stock[name]),
                          flipped_vs_stock=rel(g_flipped[name], g_stock[name]),
                          sequential_norms_vs_stock=rel(g_other[name], g_stock[name]),
                          stock_vs_f64=rel(g_stock[name], g64[name]),
                          swapped_vs_f64=rel(g_swapped[name], g64[name]))
    return dict(limit=limit, past_limit=past, swapped=dict(report.swapped),
                glu_kernels=sorted({k for k in launched if "glu" in k}), rows=rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the figures as JSON to this path")
    p.add_argument("--top", type=int, default=6, help="parameters shown per run, furthest from stock first")
    args = p.parse_args(argv)

    import platform
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    print(f"glm5_next_parity: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{platform.machine()}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
    results = [compare(10.0), compare(OUT_OF_REACH)]
    for res in results:
        rows = res["rows"]
        print(f"\nswiglu_limit={res['limit']:g}: {res['past_limit']:.1%} of dense gate/up values past it; "
              f"swapped {res['swapped']}; GLU kernels run: {', '.join(res['glu_kernels'])}")
        print(f"  {'parameter':30} {'swapped/stock':>14} {'flipped/stock':>14} {'seq-norms/stock':>20} "
              f"{'stock/f64':>10} {'swapped/f64':>12}")
        names = sorted(rows, key=lambda n: -rows[n]["swapped_vs_stock"])[:args.top]
        names += [WATCH] if WATCH in rows and WATCH not in names else []
        for n in names:
            r = rows[n]
            print(f"  {n:30} {r['swapped_vs_stock']:14.2e} {r['flipped_vs_stock']:14.2e} "
                  f"{r['sequential_norms_vs_stock']:20.2e} {r['stock_vs_f64']:10.2e} {r['swapped_vs_f64']:12.2e}")
        worst_ratio = max(rows[n]["swapped_vs_f64"] / max(rows[n]["stock_vs_f64"], 1e-300) for n in rows)
        print(f"  every parameter: max swapped/stock {max(r['swapped_vs_stock'] for r in rows.values()):.2e}, "
              f"max flipped/stock {max(r['flipped_vs_stock'] for r in rows.values()):.2e}, "
              f"max seq-norms/stock {max(r['sequential_norms_vs_stock'] for r in rows.values()):.2e}, "
              f"max (swapped vs f64) / (stock vs f64) {worst_ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
