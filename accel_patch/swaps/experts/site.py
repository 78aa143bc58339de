"""The experts site: a module holding every expert of a MoE layer as 3-D parameters, run as one
`accel_kernels.moe_experts` call (grouped GEMMs over the tokens sorted by expert, the GLU and the
routing weight fused, a backward that recomputes instead of saving).

Candidate, by structure (`candidate`): 3-D `gate_up_proj` and `down_proj` parameters
(families.EXPERTS_NAMES), optional 2-D biases, and a forward called either as transformers'
`use_experts_implementation` classes are, `(hidden [T, H], top_k_index [T, K], top_k_weights
[T, K])`, or as Llama4's experts are, `(hidden [E * T, H])` with every expert applied to its own
block of rows (the router's scores already multiplied in). A gate_up holding more experts than
down has identity ("zero") experts past down's (LongCat-Flash): the op runs the experts with
weights and the site adds each zero slot's token times its weight (`run`). Separate 3-D gate/up
parameters, experts without a gate (Nemotron-H's non-gated ReLU² experts, named with their form),
one with a norm after each expert, experts sharded already (DTensor parameters at swap time: FSDP2
before the swap) are refused with the reason.

Proved by numbers (`probe_verdict`): the module's own forward, whatever
`config._experts_implementation` it runs (grouped_mm, eager, batched_mm), against the op on
random tokens routed so that one expert gets none, for every reading the shapes allow: the
layout (`[E, 2I, H]` with F.linear, or `[E, H, 2I]` with `x @ W`), gate/up as halves or
interleaved (gpt-oss), the activation the module names (SiLU, GELU, tanh-GELU; each of them when
it names none, as GLM-5-next's forward calls F.silu), clamped or not at the bound it holds
(`limit` or `swiglu_limit`: DeepSeek V4, GLM-5-next), or gpt-oss's clamped GLU with its `alpha`
and `limit`. Each reading runs twice: at unit scale and with the tokens scaled so that the gate/up
pre-activations reach the dense probe's distance (`probe.reach_past`: families.PAST_LIMIT times
the bound, at least families.UNNAMED_REACH), so a clamp the plan misses, declared or not, is a
difference the probe sees. The reading within the dtype's bound
at both is the plan; none within it is a refusal that says how far the closest one was.

Decided at every call and counted in `calls["experts"]` (`forward`): "fused", "fused (LoRA)"
(PEFT's LoRA on the experts' parameters as split LoRA, adapters.py), with ", tiled" when the call
ran over chunks of tokens (`_tiling`: the tiled MLP named, or on the Triton path a checkpointed
call whose temporaries exceed ACCEL_PATCH_EXPERTS_TILE_BUDGET) and "grouped_mm backward" when its backward's
GEMMs run through torch._grouped_mm (ACCEL_PATCH_EXPERTS_BACKWARD); else which forward ran and why. Under
torch.compile a call is counted once per trace, as "compiled: <outcome>" (the LoRA sites' rule).
"""
from __future__ import annotations

import inspect
import math
from collections import namedtuple

import torch

from .. import families, probe, sites
from ..layers import mlp, tiled_mlp
from . import adapters

OP = "experts"
#: Instance attribute holding the site's call-time data (`Site`).
SITE_ATTR = "_accel_patch_experts_site"

FUSED = "fused"
#: The option that decides whether the op keeps gate/up for backward: "auto" (recompute, measured
#: cheaper in memory at about the same time), "save" or "recompute" (forced). See `save_gate_up`.
GATE_UP_SWITCH = "ACCEL_PATCH_EXPERTS_GATE_UP"
GATE_UP_MODES = ("auto", "save", "recompute")
#: The note of a call whose op kept gate/up for its backward.
SAVED = "saved gate/up"
#: The option that decides the op's backward on the Triton path, read once per site when the site
#: is made (at the swap: a bad value raises BadSwitch there and the walk refuses the site with it;
#: through the experts interface, at the module's first call, which refuses the module likewise):
#: "auto" (grouped_mm's GEMMs on an sm_90+ CUDA device where torch._grouped_mm takes the compute
#: dtype, for calls without LoRA whose experts hold few rows, where the Triton kernels take their
#: small tiles; else Triton's), "triton" or "grouped_mm" (forced). docs/moe.md ("Which backward",
#: "Tile sizes") says why.
BACKWARD_SWITCH = "ACCEL_PATCH_EXPERTS_BACKWARD"
#: The note of a call with grad whose backward runs its GEMMs through torch._grouped_mm (a call
#: without it, on the Triton path, runs the all-Triton backward; on the twin, the twin's).
GROUPED_BACKWARD = "grouped_mm backward"
#: The outcome's start for a call after the user chose the model's experts implementation
#: (`set_experts_implementation`) once the swap was made: transformers' dispatch runs what they
#: chose, by design (swaps/report.py BY_DESIGN). "accel_patch", the op through the interface,
#: keeps the swap's forward.
USERS_CHOICE = "the user's choice"
#: The op's name in transformers' experts interface (interface.py).
INTERFACE_NAME = "accel_patch"
#: The option that bounds what one call may hold untiled on the Triton path where the tiled MLP's
#: rule would tile it (a checkpointed layer): a size ("512MiB", "2GiB"; "0" tiles every such call,
#: "inf" none), read once per site when the site is made, as BACKWARD_SWITCH (a bad value raises
#: BadSwitch there). Unset: TILE_BUDGET_FRACTION of a CUDA device's memory, TILE_BUDGET_BYTES
#: elsewhere. docs/moe.md ("Tiled, untiled or windowed") gives the model it rests on.
TILE_BUDGET_SWITCH = "ACCEL_PATCH_EXPERTS_TILE_BUDGET"
#: A checkpointed call on a CUDA device runs untiled while its temporaries (`held_bytes`) stay
#: within this fraction of the device's memory: 1/16, about 8.7 GiB of an H200 (139 GiB), 4.9 GiB
#: of an H100 (79 GiB) (Qwen3-30B-A3B's experts hold 448 MiB at 4096 tokens, so untiled to about
#: 80k and 45k tokens a call). The temporaries are freed before the next layer's backward, so they add to the step's
#: peak once, as stock grouped_mm's recomputed layer (S (4H + 8I + 26) bytes, about as much) does.
TILE_BUDGET_FRACTION = 1 / 16
#: The budget on other devices (the Triton path on CPU tensors under the interpreter): 256 MiB.
TILE_BUDGET_BYTES = 256 << 20
ROUTED, DENSE = "routed", "dense"  # the call styles: (hidden, top_k_index, top_k_weights) / (hidden) per expert


class ExpertsPlan(namedtuple("ExpertsPlan", "style names biases transposed interleaved activation alpha limit routed",
                             defaults=(None,))):
    """style: ROUTED or DENSE; names: (gate_up, down); biases: (gate_up bias, down bias) names or
    None; transposed: weights used as `x @ W` ([E, H, 2I]); interleaved: gate = [..., ::2];
    activation: "silu" | "gelu" | "gelu_tanh" | "gpt_oss" (with alpha and limit); routed: None,
    or the number of experts with weights when gate_up holds more (LongCat-Flash's identity "zero"
    experts: ids from `routed` up to gate_up's count return their token, times its weight)."""

    __slots__ = ()


class Candidate(namedtuple("Candidate", "names biases style arg_names")):
    """An experts module the op can take, by structure: its (gate_up, down) parameter names, their
    bias names (None without biases), the call style (ROUTED or DENSE) and its forward's argument names."""

    __slots__ = ()


class Site(sites.CountingSite):
    """What the experts forward reads at call time: its plan, the forward's argument names, the
    model's call counts, what the tiled MLP's rule reads (`requested`: the caller named
    tiled_mlp; `holders`: the modules whose gradient_checkpointing flag covers this layer), and
    the switches read once at the swap (`gate_up`, `backward`, `tile_budget`: bytes or None)."""

    OP = OP  # what it counts under (sites.count while dynamo traces)

    def __init__(self, plan: ExpertsPlan, arg_names: tuple[str, ...], calls, requested: bool = False,
                 holders=()) -> None:
        self.plan, self.arg_names, self.calls = plan, arg_names, calls
        self.requested, self.holders = requested, tuple(holders)
        self.gate_up = gate_up_mode()
        self.backward = backward_mode()
        self.tile_budget = tile_budget_switch()
        self.chosen = None  # the experts implementation the user chose after the swap (`hand_back`)

    def count(self, outcome: str) -> None:
        sites.count_into(self.calls, OP, outcome)


# --- candidate ---------------------------------------------------------------------------------

def _own_3d(module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module._parameters.items() if p is not None and p.dim() == 3}


def _arg_names(cls) -> tuple[str, ...] | None:
    """The names of the forward's tensor arguments, (hidden, index, weights) or (hidden,)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != len(params) or len(positional) not in (1, 3):
        return None
    return tuple(p.name for p in positional)


def candidate(module):
    """A `Candidate`; a `sites.Refused` for a module with 3-D expert parameters that cannot be
    swapped; None for anything else."""
    own = _own_3d(module)
    if not own:
        return None
    names = next((n for n in families.EXPERTS_NAMES if all(k in own for k in n)), None)
    if names is None:
        split = next((n for n in families.EXPERTS_SPLIT_NAMES if all(k in own for k in n)), None)
        if split is not None:
            return sites.Refused("MoE experts with separate 3-D gate and up parameters: the op takes one gate_up")
        if any(n in own for group in families.EXPERTS_NAMES for n in group):
            act = mlp.activation(module)
            act_name = mlp.declared_activation(act)[0] if act is not None else "act"
            up = next((n for n in own if n != "down_proj"), "up")
            return sites.Refused(f"non-gated MoE experts, down_proj({act_name}({up}(x))) with 3-D {'/'.join(own)} "
                                 f"(Nemotron-H's ReLU² experts): the op computes a GLU, act(gate) * up")
        return None
    if any(sites.is_dtensor(own[n]) for n in names):  # the probe needs the whole weights
        return sites.Refused(f"MoE experts' {names[0]} is a {type(own[names[0]]).__name__} (sharded already): "
                             "swap before sharding")
    if getattr(module, "has_gate", True) is False:
        return sites.Refused("MoE experts without a gate (has_gate=False): the op computes a GLU")
    if getattr(module, "has_post_expert_norm", False):
        return sites.Refused("MoE experts with a norm after each expert (has_post_expert_norm): not in the op")
    biases = tuple(n + families.EXPERTS_BIAS_SUFFIX for n in names)
    present = [isinstance(module._parameters.get(b), torch.Tensor) for b in biases]
    if any(present) and not all(present):
        return sites.Refused("MoE experts with a bias on one projection only: not in the op")
    arg_names = _arg_names(type(module))
    if arg_names is None:
        return sites.Refused("MoE experts whose forward takes neither (hidden, top_k_index, top_k_weights) "
                             "nor (hidden)")
    return Candidate(names, biases if all(present) else None, ROUTED if len(arg_names) == 3 else DENSE, arg_names)


# --- probe -------------------------------------------------------------------------------------

def _layouts(gate_up: torch.Tensor, down: torch.Tensor) -> list[tuple[bool, int, int]]:
    """(transposed, hidden, intermediate) readings the two shapes allow."""
    found = []
    _, a, b = gate_up.shape
    _, c, d = down.shape
    if a % 2 == 0 and a == 2 * d and b == c:  # [E, 2I, H], [E, H, I]
        found.append((False, b, d))
    if b % 2 == 0 and b == 2 * c and a == d:  # [E, H, 2I], [E, I, H]
        found.append((True, a, c))
    return found


#: The activations tried when the module holds none (its forward calls one, as GLM-5-next's F.silu).
KERNEL_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        return None
    return float(value)


def limit_of(module) -> float | None:
    """The clamp bound the module (or its configuration) names, the dense probe's reading
    (`probe.limits`): its first, or None."""
    return next(iter(probe.limits(module)), None)


def _activations(module) -> tuple[list[tuple[str, float, float]], str | None]:
    """(activation, alpha, limit) readings to try (limit inf: no clamp), and the declared
    activation's own name. A held clamp bound adds the clamped reading of each activation (the
    probe, past the bound, tells which one the forward computes)."""
    tried, own_name = [], None
    act = mlp.activation(module)
    if act is not None:
        own_name, kernel_act = mlp.declared_activation(act)
        kernels = (kernel_act,) if kernel_act is not None else ()
    else:
        kernels = KERNEL_ACTIVATIONS
    limit = limit_of(module)
    for kernel_act in kernels:
        tried.append((kernel_act, 1.702, math.inf))
        if limit is not None:
            tried.append((kernel_act, 1.702, limit))
    alpha = _number(getattr(module, "alpha", None))
    if alpha is not None and limit is not None:
        tried.append(("gpt_oss", alpha, limit))
    return tried, own_name


def _reach_scale(module, names, biases, transposed, hidden, index, reach: float, routed: int | None = None) -> float:
    """The factor on `hidden` that makes the largest |gate/up| pre-activation of the routed rows
    about `reach` (one GEMM per routed expert with weights, on the probe's few rows)."""
    gate_up = module._parameters[names[0]].detach().float()
    bias = module._parameters[biases[0]].detach().float() if biases else None
    x = hidden.detach().float()
    top = 0.0
    for e in torch.unique(index).tolist():
        if not 0 <= e < (routed or gate_up.shape[0]):  # a zero expert's rows of gate_up are never read
            continue
        rows = x[(index == e).any(dim=-1)]
        pre = rows @ gate_up[e] if transposed else rows @ gate_up[e].t()
        top = max(top, float(pre.abs().max()))
    if bias is not None:
        top += float(bias.abs().max())
    return reach / top if top > 0 and math.isfinite(top) else 1.0


def routes(tokens: int, top_k: int, experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random routing of `tokens` over experts 1..E-1 (expert 0 gets no token when E > top_k + 1),
    distinct experts per token, and positive weights."""
    g = torch.Generator().manual_seed(7)
    low = 1 if experts > top_k + 1 else 0
    scores = torch.rand(tokens, experts - low, generator=g)
    index = scores.topk(top_k, dim=-1).indices + low
    weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return index.to(device), weights.to(device)


def run(module, plan: ExpertsPlan, hidden, index, weights, lora=None, autocast_dtype=None, save=False,
        backward="auto"):
    """The op on one call of `module` (its stored tensors, never a parametrized value)."""
    from accel_kernels import moe_experts

    gate_up, down, gu_bias, d_bias = _tensors(module, plan)
    routed = plan.routed
    if routed is not None and lora is not None and lora.get("gate_up") is not None:
        lora = dict(lora, gate_up=tuple(t[:routed] for t in lora["gate_up"]))
    out = moe_experts(hidden, index, weights, gate_up, down, gu_bias, d_bias, lora=lora, autocast_dtype=autocast_dtype,
                      save_gate_up=save, backward=backward, **_options(plan))
    if routed is None:
        return out
    # identity ("zero") experts: each returns its token, times the slot's routing weight (plain
    # torch: autograd gives hidden's and the weights' gradients for those slots)
    zero = (index >= routed) & (index < adapters.base(module, plan.names[0]).shape[0])
    return out + (hidden * (weights * zero).sum(-1, keepdim=True)).to(out.dtype)


def _tensors(module, plan: ExpertsPlan) -> tuple:
    """(gate_up, down, gate_up_bias, down_bias) as the op takes them: the module's stored tensors
    (biases None without), gate_up and its bias cut to the experts with weights where identity
    ("zero") experts follow them (the op takes ids >= routed as "no expert")."""
    gate_up, down = (adapters.base(module, n) for n in plan.names)
    gu_bias, d_bias = (adapters.base(module, n) for n in plan.biases) if plan.biases else (None, None)
    if plan.routed is not None:
        gate_up = gate_up[:plan.routed]
        gu_bias = gu_bias[:plan.routed] if gu_bias is not None else None
    return gate_up, down, gu_bias, d_bias


def _options(plan: ExpertsPlan) -> dict:
    return dict(transposed=plan.transposed, interleaved=plan.interleaved, activation=plan.activation,
                alpha=plan.alpha, limit=plan.limit)


def dense_routes(hidden: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama4's call as a routed one: row block e of `hidden` [E * T, H] goes to expert e, weight 1."""
    rows = hidden.shape[0] // experts
    index = torch.arange(experts, device=hidden.device).repeat_interleave(rows).unsqueeze(1)
    return index, torch.ones(index.shape, device=hidden.device, dtype=hidden.dtype)


def probe_verdict(module, act_dtype: torch.dtype, found):
    """The ExpertsPlan that reproduces this module's forward, or a refusal reason."""
    names, biases, style = found.names, found.biases, found.style
    gate_up, down = (module._parameters[n] for n in names)
    layouts = _layouts(gate_up, down)
    if not layouts:
        return (f"MoE experts' shapes {tuple(gate_up.shape)} / {tuple(down.shape)} are neither [E, 2I, H] / "
                f"[E, H, I] nor [E, H, 2I] / [E, I, H]")
    acts, own_name = _activations(module)
    if not acts:
        return (f"MoE experts' activation {own_name} has no kernel (SiLU, GELU, tanh-GELU, each optionally "
                f"clamped, gpt-oss's clamped GLU)")
    device = probe.module_device(module)
    experts = gate_up.shape[0]
    # gate_up holding more experts than down: identity ("zero") experts past down's (LongCat-Flash)
    routed = down.shape[0] if down.shape[0] < experts else None
    if down.shape[0] > experts or (routed is not None and style != ROUTED):
        return (f"MoE experts' {names[0]} holds {experts} experts and {names[1]} {down.shape[0]}: only a routed "
                f"forward with identity (zero) experts past {names[1]}'s is in the op")
    hints_t, hints_i = getattr(module, "is_transposed", None), getattr(module, "is_concatenated", None)
    errors = {}
    with probe.probing(module):
        for transposed, hidden_size, _ in layouts:
            if style == ROUTED:
                top_k = min(2, experts)
                unit = probe.randn((7, hidden_size), act_dtype, device)
                index, weights = routes(7, top_k, experts, device)
                if routed is not None and not bool((index >= routed).any()):  # a zero expert is probed too
                    index[0, 0] = routed
                weights = weights.to(act_dtype)
            else:
                unit = probe.randn((experts * 3, hidden_size), act_dtype, device)
                index, weights = dense_routes(unit, experts)
            # once at unit scale, once with pre-activations past every clamp bound (or far out)
            bound_at = max((lim for _, _, lim in acts if math.isfinite(lim)), default=None)
            reach = probe.reach_past([bound_at] if bound_at is not None else [])
            scale = _reach_scale(module, names, biases, transposed, unit, index, reach, routed)
            for hidden in (unit, (unit.float() * scale).to(act_dtype)):
                hidden = hidden.requires_grad_()
                args = (hidden, index, weights) if style == ROUTED else (hidden,)
                try:
                    ref = sites.call_inner(module, *args)
                except Exception as exc:
                    return f"module's own forward failed on a {act_dtype} probe: {type(exc).__name__}: {exc}"
                if not isinstance(ref, torch.Tensor):
                    return f"module returns {type(ref).__name__}, not a tensor"
                # the layout and order the class declares first: a tie (a symmetric probe) keeps them
                orders = sorted((False, True), key=lambda i: i == bool(hints_i) if hints_i is not None else i)
                for interleaved in orders:
                    for act, alpha, limit in acts:
                        plan = ExpertsPlan(style, names, biases, transposed, interleaved, act, alpha, limit, routed)
                        # the forward is the same whichever backward follows: one named, auto
                        # times nothing for the probe
                        out = run(module, plan, hidden, index, weights, backward="triton")
                        err = float("inf") if out.dtype != ref.dtype else probe.rel_err(out, ref)
                        errors[plan] = max(errors.get(plan, 0.0), err)
    # a tie keeps the declared layout, then the unclamped reading
    best = min(errors, key=lambda p: (errors[p], p.transposed != bool(hints_t), math.isfinite(p.limit)))
    limit = probe.bound(act_dtype)
    if errors[best] > limit:
        readings = "/".join(dict.fromkeys(a + (f" clamped at {lim:g}" if math.isfinite(lim) and a != "gpt_oss" else "")
                                          for a, _, lim in acts))
        return (f"output differs from every reading of the MoE experts (layout, gate/up order, {readings}; probed "
                f"at unit scale and with pre-activations reaching {reach:g}) in {act_dtype}: closest relative "
                f"error {errors[best]:.2e} > {limit:.1e}")
    return best


# --- the swapped forward -----------------------------------------------------------------------

def _inputs(site: Site, args, kwargs):
    names = site.arg_names
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    values = list(args) + [kwargs.get(n) for n in names[len(args):]]
    return values if all(isinstance(v, torch.Tensor) for v in values) else None


def decide_lora(module, plan: ExpertsPlan):
    """The op's `lora` argument for this call (None without an active adapter), or a
    `sites.Refused` saying why PEFT's forward runs instead."""
    if not adapters.parametrized(module):
        return None
    parts = {}
    for key, name in zip(("gate_up", "down"), plan.names):
        found = adapters.factors(module, name, plan.transposed)
        if isinstance(found, sites.Refused):
            return found
        parts[key] = found
    if plan.biases and any(adapters.factors(module, b, False) is not None for b in plan.biases):
        return sites.Refused("LoRA on an expert bias")
    others = set(module._modules[adapters.PARAMETRIZATIONS]._modules) - set(plan.names)
    if others:
        return sites.Refused(f"parametrized {', '.join(sorted(others))}")
    if all(f is None for f in parts.values()):
        return None
    # the op's own argument: (A, B) and the scaling per projection (they differ under rsLoRA, where
    # PEFT gives a fused gate/up twice the rank and alpha, and under rank or alpha patterns)
    return {**{key: f and f[:2] for key, f in parts.items()},
            "scaling": {key: f.scaling for key, f in parts.items() if f is not None}}


_warned_modes: set = set()


def gate_up_mode() -> str:
    """ACCEL_PATCH_EXPERTS_GATE_UP read once per site (at the swap): auto, save or recompute; any
    other value warns once with the valid ones and is auto."""
    import os

    value = os.environ.get(GATE_UP_SWITCH, "auto").strip().lower() or "auto"
    if value in GATE_UP_MODES:
        return value
    if value not in _warned_modes:
        _warned_modes.add(value)
        import logging

        logging.getLogger("accel_patch").warning("accel_patch: %s=%r is not one of %s: auto", GATE_UP_SWITCH, value,
                                                 ", ".join(GATE_UP_MODES))
    return "auto"


def backward_mode(environ=None) -> str:
    """ACCEL_PATCH_EXPERTS_BACKWARD: auto (unset or blank), triton or grouped_mm; any other value
    raises core.switches.BadSwitch naming the variable, its value and the valid ones."""
    from accel_kernels.ops.moe_experts import BACKWARDS

    from ...core import switches

    return switches.choice(BACKWARD_SWITCH, BACKWARDS, environ) or "auto"


def tile_budget_switch(environ=None) -> float | None:
    """ACCEL_PATCH_EXPERTS_TILE_BUDGET in bytes (None: unset, the device's default, `tile_budget`);
    core.switches.BadSwitch naming the variable, its value and the valid forms otherwise."""
    from ...core import switches

    return switches.size(TILE_BUDGET_SWITCH, environ)


_device_memory: dict = {}


def tile_budget(site: Site, device: torch.device) -> float:
    """The bytes a call may hold untiled (`held_bytes`) on `device`: the switch's value, else
    TILE_BUDGET_FRACTION of a CUDA device's memory (read once per device), else TILE_BUDGET_BYTES."""
    if site.tile_budget is not None:
        return site.tile_budget
    if device.type != "cuda":
        return TILE_BUDGET_BYTES
    key = str(device)
    if key not in _device_memory:
        _device_memory[key] = torch.cuda.get_device_properties(device).total_memory
    return TILE_BUDGET_FRACTION * _device_memory[key]


def held_bytes(tokens: int, top_k: int, hidden: int, inter: int, element: int, grouped: bool) -> int:
    """What one untiled call of the op holds at once on the Triton path beyond its inputs, outputs
    and saved tensors, for S = tokens x top_k sorted rows: the backward's h [S, I], dgu [S, 2I]
    and one [S, H] product in the compute dtype (the forward holds less: h and the down output),
    plus, with the grouped_mm backward, one gathered [S, H] operand and w h [S, I]."""
    rows = tokens * top_k
    return rows * (3 * inter + hidden + (inter + hidden if grouped else 0)) * element


def save_gate_up(site: Site, hidden: torch.Tensor) -> bool:
    """Whether this call's op keeps gate/up for backward instead of recomputing them there: where
    ACCEL_PATCH_EXPERTS_GATE_UP=save says so, on the plain-torch twin (the Triton path always
    recomputes), with grad. Auto recomputes, also inside a checkpointed layer, where a saved
    gate/up would spare the backward its third gate/up GEMM: non-reentrant checkpointing demands
    that the layer's first forward save what its recompute saves, so the first forward allocates
    them too (for the checkpoint to drop), and the recompute's stay until the layer's backward.
    Measured on the CPU (two checkpointed Qwen3-MoE layers, docs/moe.md): saving took 0.53x
    (full) and 0.40x (LoRA) of stock's peak growth for 0.84x and 0.86x of its time, recomputing
    0.43x and 0.29x for 0.88x and 0.92x."""
    from accel_kernels import _dispatch

    return site.gate_up == "save" and torch.is_grad_enabled() and not _dispatch.use_triton(hidden)


def _tiling(module, site: Site, hidden: torch.Tensor, top_k: int, element: int, grouped: bool) -> int | None:
    """Tokens per chunk when this call is tiled, else None. Where the tiled MLP is named, by its
    rule (long enough, on the K expert rows a token has, with grad, training). Otherwise only on the
    Triton path, in a checkpointed layer (the rule's other case), and only when the call's
    temporaries (`held_bytes`, in the compute dtype's `element` bytes) exceed the budget
    (`tile_budget`): checkpointing alone does not tile, since each chunk re-reads every expert's
    weights and shrinks each grouped GEMM (docs/moe.md, "Tiled, untiled or windowed"). The
    plain-torch twin tiles only where the tiled MLP is named: it runs in windows of whole experts,
    which bound its temporaries as tiles do without shrinking its per-expert GEMMs (tiles made the
    CPU step 1.3-1.6x slower, docs/moe.md)."""
    from accel_kernels import _dispatch

    if not site.requested and not _dispatch.use_triton(hidden):
        return None
    plan = site.plan
    gate_up = adapters.base(module, plan.names[0])
    inter = (gate_up.shape[2] if plan.transposed else gate_up.shape[1]) // 2
    rule = tiled_mlp.Site(hidden.shape[-1], inter * top_k, {}, site.requested, site.holders)
    if tiled_mlp.decide(rule, module, hidden) is not None:
        return None
    if not site.requested and held_bytes(hidden.shape[0], top_k, hidden.shape[-1], inter, element,
                                         grouped) <= tile_budget(site, hidden.device):
        return None
    return tiled_mlp.chunk_tokens(rule.hidden, rule.intermediate)


def _backward_path(module, plan, hidden, index, weights, backward: str, autocast_dtype, lora, may_time=True):
    """(path, timing): the op's own answer for the whole call (accel_kernels' `choose_backward`: by
    the tiles the call takes, or the faster of the two backwards where auto times them; under
    torch.compile auto's rule without the tiles, nothing of either traced) and the Timing when this
    call timed them (None otherwise). The count says what the op runs, and the call's chunks, if
    it is tiled, are each given this answer, not "auto", so a chunk's fewer rows cannot choose
    another backward. may_time False: a shape not timed yet takes the rule (a call that tiles is
    not timed whole: it is tiled to hold less than that)."""
    from accel_kernels.ops.moe_experts import backward_path, choose_backward

    has_lora = lora is not None and any(lora.get(name) is not None for name in ("gate_up", "down"))
    if sites.compiling():  # auto's rule without the tiles: nothing of them or of a timing is traced
        return backward_path(hidden, backward, autocast_dtype, has_lora), None
    return choose_backward(hidden, index, weights, *_tensors(module, plan), lora=has_lora,
                           autocast_dtype=autocast_dtype, backward=backward, may_time=may_time, **_options(plan))


def forward(self, *args, **kwargs):
    """The swapped experts module: one moe_experts call (LoRA fused when PEFT's is active)."""
    site = self.__dict__.get(SITE_ATTR)
    if site is None:
        return sites.call_inner(self, *args, **kwargs)
    if site.chosen is not None:
        sites.count(site, f"{USERS_CHOICE}: experts_implementation {site.chosen!r} set after the swap")
        return sites.call_inner(self, *args, **kwargs)
    values = _inputs(site, args, kwargs)
    if values is None:
        sites.count(site, "the module's forward: arguments other than its tensors")
        return sites.call_inner(self, *args, **kwargs)
    plan = site.plan
    hidden = values[0]
    if hidden.dim() != 2:
        sites.count(site, f"the module's forward: hidden of {hidden.dim()} dimensions")
        return sites.call_inner(self, *args, **kwargs)
    if sites.is_dtensor(hidden) or any(sites.is_dtensor(adapters.base(self, n)) for n in plan.names):
        sites.count(site, "stood aside: DTensor experts (FSDP2, tensor or expert parallel): the module's forward")
        return sites.call_inner(self, *args, **kwargs)
    if getattr(self, "_is_expert_parallel", False):
        sites.count(site, "stood aside: expert parallel: the module's forward")
        return sites.call_inner(self, *args, **kwargs)
    lora = decide_lora(self, plan)
    if isinstance(lora, str):
        sites.count(site, f"PEFT's forward: {lora}")
        return sites.call_inner(self, *args, **kwargs)
    experts = adapters.base(self, plan.names[0]).shape[0]
    if plan.style == ROUTED:
        index, weights = values[1], values[2]
    else:
        index, weights = dense_routes(hidden, experts)
    autocast_dtype = sites.autocast_dtype(hidden.device.type)
    save = save_gate_up(site, hidden)
    backward = site.backward
    element = (autocast_dtype or hidden.dtype).itemsize
    compiling = sites.compiling()
    # whole whichever backward runs (the grouped_mm one holds more): auto may time it whole
    whole = not compiling and _tiling(self, site, hidden, index.shape[-1], element, True) is None
    path, timing = _backward_path(self, plan, hidden, index, weights, backward, autocast_dtype, lora, whole)
    if path != "twin":
        backward = path
    grouped = torch.is_grad_enabled() and path == "grouped_mm"
    chunk = None if compiling or whole else _tiling(self, site, hidden, index.shape[-1], element, grouped)
    notes = [note for note, on in (("LoRA", lora is not None), ("tiled", chunk is not None), (SAVED, save),
                                   (GROUPED_BACKWARD, grouped)) if on]
    if timing is not None:
        from accel_kernels.ops.moe_experts import TIMED_NOTE

        notes.append(timing.note(TIMED_NOTE))
    sites.count(site, FUSED + (f" ({', '.join(notes)})" if notes else ""))
    if chunk is None or chunk >= hidden.shape[0]:
        return run(self, plan, hidden, index, weights, lora, autocast_dtype, save, backward)
    outs = [run(self, plan, hidden[i:i + chunk], index[i:i + chunk], weights[i:i + chunk], lora, autocast_dtype,
                save, backward) for i in range(0, hidden.shape[0], chunk)]
    return torch.cat(outs)


def hand_back(model) -> int:
    """After `model.set_experts_implementation(...)`: every experts module of `model` the swap
    made a site on runs its own forward from now on, which transformers dispatches to the
    implementation its config now names (the user's choice over the swap's), counted as
    USERS_CHOICE; one whose config names "accel_patch" (the op through the interface) keeps the
    swap's forward. A later call decides again. Returns how many modules run the user's choice."""
    chosen = 0
    for module in model.modules():
        site = module.__dict__.get(SITE_ATTR)
        if site is None or getattr(site, "interface", False):
            continue  # no site, or the interface's own (experts_implementation="accel_patch")
        name = getattr(getattr(module, "config", None), "_experts_implementation", None)
        site.chosen = None if name in (None, INTERFACE_NAME) else name
        chosen += site.chosen is not None
    return chosen


def install(state, module, func, site: Site) -> None:
    state.set(module, SITE_ATTR, site)
    sites.install(state, module, func)
