"""Fused LoRA: a gated MLP, the q/k/v projections and the output projection whose layers are PEFT
LoRA layers, each computed as one autograd function with a backward derived by hand.

    y = x W^T (+ b) + s (x A^T) B^T          every projection (W plain, or bitsandbytes 4-bit)
    out = down(act(gate(x)) * up(x))         the MLP: saves x, gate and up, nothing else

Sites (found by structure, proved by a probe, per instance and reversible like every swap):

- `lora_mlp`: a gated MLP (mlp.candidate: split gate/up/down or fused gate_up, SiLU or GELU).
  Its forward becomes `_LoraMLPFunction`: the base matmuls stay torch, each adapter's small
  matmuls are `addmm_`-ed into the base result, the activation is accel_kernels' GLU (the Triton
  kernel on GPU), and backward recomputes `act(gate) * up` for the down adapter instead of saving
  it. A 4-bit base weight is dequantized by bitsandbytes' own `dequantize_4bit` in forward and
  again in backward; nothing dequantized is kept between them.
- `lora_qkv`: the input projections of an attention block (q/k/v with any subset adapted and
  GQA widths, or one fused qkv). The attention's own forward still runs; for that call the
  projections' forwards are bound so that the first one called computes all of them from x in
  one `_LoraLinearsFunction` (x read and saved once) and the others return their share.
- `lora_o`: the attention's output projection, the same function with one projection.

Decided at every call, so the swap may come before or after `get_peft_model`, and an adapter
added, removed, disabled, merged or switched later is seen at the next call. What the fused
path cannot reproduce runs PEFT's own forward for that call and is counted (`SwapState.calls`,
`SwapReport.calls`): dropout > 0 in training, a LoRA variant (DoRA), more than one active
adapter, `lora_bias`, `fan_in_fan_out`, 8-bit or other quantized bases, mixed dtypes, autocast,
a trainable base weight, hooks on a projection, extra arguments. A call with no active adapter
runs what was there before (the `glu` kernel forward when that op was swapped too, else stock).

Which wins with `glu`: both install on the MLP; `lora_mlp` sits on top and runs its fused
function whenever an adapter is active, and the `glu` forward beneath it otherwise. Ask for
`glu`/`rope` in the same call as (or before) the LoRA ops: a module already carrying a LoRA
forward is not swapped again.
"""
from __future__ import annotations

import types
from collections import namedtuple

import torch

from . import families, mlp, probe, sites

MLP_OP, QKV_OP, O_OP = "lora_mlp", "lora_qkv", "lora_o"
OPS = (MLP_OP, QKV_OP, O_OP)
#: Instance attribute holding a site's call-time data (`Site`).
SITE_ATTR = "_accel_patch_lora_site"
#: Instance attribute holding the forward a LoRA site replaced (rope's or glu's swapped forward,
#: an accelerate wrapper), which its fall-back calls. Separate from sites.INNER_ATTR, which the
#: forward beneath may itself use.
INNER_ATTR = "_accel_patch_lora_inner"

FUSED = "fused"
NO_ADAPTER = "no active LoRA adapter: the module's forward"


class Site:
    """What a LoRA site's forward reads at call time: its ops, projection names, the GLU plan of an
    MLP, and the call counts it adds to (the model's SwapState.calls)."""

    def __init__(self, ops, names, glu_plan, calls) -> None:
        self.ops, self.names, self.glu_plan, self.calls = set(ops), names, glu_plan, calls

    def count(self, op: str, outcome: str) -> None:
        per_op = self.calls.setdefault(op, {})
        per_op[outcome] = per_op.get(outcome, 0) + 1


# --------------------------------------------------------------------------------------------
# A projection as the fused functions see it: base weight (plain or 4-bit), bias, one adapter
# --------------------------------------------------------------------------------------------


class Proj(namedtuple("Proj", "weight bias kind adapted scale peft_cast")):
    """weight: the base weight (a Params4bit for kind "4bit"); adapted: whether A and B follow in
    the function's inputs; scale: PEFT's scaling; peft_cast: how PEFT adds an adapter of another
    dtype ("promote": add in the promoted dtype, then cast back (lora.Linear); "cast": cast the
    adapter's output first (lora.bnb.Linear4bit))."""

    __slots__ = ()


def _is_lora_layer(m) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "lora_B") and callable(getattr(m, "get_base_layer", None))


def _is_4bit(m) -> bool:
    return type(m).__name__ == "Linear4bit" and type(m).__module__.startswith("bitsandbytes")


def _plain_linear(m) -> bool:
    return (isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward
            and type(m.weight) in (torch.nn.Parameter, torch.Tensor))


def base_kind(m) -> str | None:
    """"plain" or "4bit" for a base layer the fused functions compute, else None."""
    if _plain_linear(m):
        return "plain"
    if _is_4bit(m) and getattr(m.weight, "quant_state", None) is not None:
        return "4bit"
    return None


def layer_kind(m) -> str | None:
    """The base kind of a projection (looking through a PEFT LoRA layer), None when not computable."""
    return base_kind(m.get_base_layer() if _is_lora_layer(m) else m)


def _hooked(m) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or "_hf_hook" in m.__dict__)


def projection(m, x: torch.Tensor):
    """(Proj, (A, B) or ()) for this call of projection `m` on input `x`, or the reason the fused
    path cannot reproduce it (PEFT's own forward runs)."""
    if _is_lora_layer(m):
        base = m.get_base_layer()
        adapter = None
        if m.disable_adapters:
            if m.merged:
                return "adapters disabled while merged (PEFT unmerges in its forward)"
        elif not m.merged:
            active = [a for a in m.active_adapters if a in m.lora_A]
            if len(active) > 1:
                return f"more than one active adapter ({', '.join(active)})"
            if active:
                adapter = active[0]
        if adapter is not None:
            if adapter in getattr(m, "lora_variant", {}):
                return f"a LoRA variant ({type(m.lora_variant[adapter]).__name__}, e.g. DoRA)"
            if getattr(m, "use_dora", {}).get(adapter, False):
                return "DoRA"
            if getattr(m, "lora_bias", {}).get(adapter, False):
                return "lora_bias"
            if getattr(m, "fan_in_fan_out", False):
                return "fan_in_fan_out"
            dropout = m.lora_dropout[adapter]
            if isinstance(dropout, torch.nn.Dropout) and dropout.p > 0 and dropout.training:
                return "dropout > 0 in training"
            if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
                return f"dropout module {type(dropout).__name__}"
        if _hooked(m):
            return "hooks on a projection"
    else:
        base, adapter = m, None
    kind = base_kind(base)
    if kind is None:
        return f"base layer {type(base).__name__} is neither a plain nor a bitsandbytes 4-bit linear"
    if _hooked(base):
        return "hooks on a projection"
    weight, bias = base.weight, base.bias
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        return "a trainable base weight"
    compute = weight.dtype if kind == "plain" else (getattr(base, "compute_dtype", None) or x.dtype)
    if x.dtype != compute or (bias is not None and bias.dtype != compute and kind == "plain"):
        return f"mixed dtypes (input {x.dtype}, base {compute})"
    if weight.device != x.device:
        return f"input on {x.device}, weight on {weight.device}"
    if adapter is None:
        return Proj(weight, bias, kind, False, 0.0, None), ()
    A, B = m.lora_A[adapter].weight, m.lora_B[adapter].weight
    if m.lora_A[adapter].bias is not None or m.lora_B[adapter].bias is not None:
        return "lora_bias"
    if A.dtype != B.dtype or (A.dtype != x.dtype and not (A.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16))):
        return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}/{B.dtype})"
    if A.dtype != x.dtype and not getattr(m, "cast_input_dtype_enabled", True):
        return f"mixed dtypes (input {x.dtype}, adapter {A.dtype}, input casting disabled)"
    return Proj(weight, bias, kind, True, float(m.scaling[adapter]), "cast" if kind == "4bit" else "promote"), (A, B)


# --------------------------------------------------------------------------------------------
# The math, shared by both functions (2-D inputs; the adapter tensors come in as (A, B))
# --------------------------------------------------------------------------------------------


def base_weight(p: Proj, dtype: torch.dtype) -> torch.Tensor:
    """The base weight in `dtype`: a 4-bit one dequantized by bitsandbytes (a temporary, dropped
    by the caller after its matmul)."""
    if p.kind == "4bit":
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(p.weight.data, p.weight.quant_state).to(dtype)
    return p.weight


def proj_forward(x: torch.Tensor, p: Proj, A, B) -> torch.Tensor:
    """x W^T + b + s (x A^T) B^T, adding the adapter as PEFT does for its dtypes."""
    w = base_weight(p, x.dtype)
    bias = p.bias.to(x.dtype) if p.bias is not None else None
    y = torch.nn.functional.linear(x, w, bias)
    del w
    if not p.adapted:
        return y
    if A.dtype == y.dtype:
        return y.addmm_(x @ A.t(), B.t(), alpha=p.scale)
    t = x.to(A.dtype) @ A.t()
    if p.peft_cast == "promote":
        return torch.addmm(y.to(A.dtype), t, B.t(), alpha=p.scale).to(y.dtype)
    return y.add_(torch.mm(t, B.t()).mul_(p.scale).to(y.dtype))


def proj_backward(dy: torch.Tensor, x: torch.Tensor, p: Proj, A, B, dx: torch.Tensor | None):
    """(dx accumulated, dA, dB) of proj_forward for output gradient dy and input x."""
    w = base_weight(p, dy.dtype)
    dx = dy @ w if dx is None else dx.addmm_(dy, w)
    del w
    if not p.adapted:
        return dx, None, None
    dya = dy.to(A.dtype)
    xa = x.to(A.dtype)
    u = dya @ B  # (n, r)
    dB = (dya.t() @ (xa @ A.t())).mul_(p.scale)
    dA = (u.t() @ xa).mul_(p.scale)
    if A.dtype == dx.dtype:
        dx.addmm_(u, A, alpha=p.scale)
    else:
        dx.add_(torch.mm(u, A).mul_(p.scale).to(dx.dtype))
    return dx, dA, dB


def _adapter_pairs(projs, adapters):
    """Per projection, its (A, B) from the flat adapter inputs, or (None, None)."""
    it = iter(adapters)
    return [(next(it), next(it)) if p.adapted else (None, None) for p in projs]


def _adapter_grads(projs, grads):
    out = []
    for p, (dA, dB) in zip(projs, grads):
        if p.adapted:
            out += [dA, dB]
    return out


class _LoraLinearsFunction(torch.autograd.Function):
    """Projections reading the same x (q, k, v; or the output projection alone): saves x once."""

    @staticmethod
    def forward(ctx, x, projs, *adapters):
        x2 = x.reshape(-1, x.shape[-1])
        pairs = _adapter_pairs(projs, adapters)
        outs = tuple(proj_forward(x2, p, A, B).view(*x.shape[:-1], -1) for p, (A, B) in zip(projs, pairs))
        ctx.save_for_backward(x, *adapters)
        ctx.projs = projs
        return outs

    @staticmethod
    def backward(ctx, *douts):
        x, *adapters = ctx.saved_tensors
        projs = ctx.projs
        x2 = x.reshape(-1, x.shape[-1])
        dx, grads = None, []
        for p, (A, B), dout in zip(projs, _adapter_pairs(projs, adapters), douts):
            dx, dA, dB = proj_backward(dout.reshape(-1, dout.shape[-1]), x2, p, A, B, dx)
            grads.append((dA, dB))
        return (dx.view(x.shape), None, *_adapter_grads(projs, grads))


# The activation: accel_kernels' GLU forward (public entry) and its registered backward op, which
# takes the Triton kernel or its plain-torch twin as the forward does.
def glu_forward(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return mlp.glu(act, gate, up)


def glu_backward(act: str, dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(dgate, dup) of act(gate) * up: `torch.ops.accel_kernels.glu_backward`, on the Triton path
    where the forward takes it (float64 runs the twin, as the public entry does)."""
    from accel_kernels import _dispatch

    triton_path = _dispatch.use_triton(gate) and gate.dtype != torch.float64
    return torch.ops.accel_kernels.glu_backward(dh, gate, up, act, triton_path)


class _LoraMLPFunction(torch.autograd.Function):
    """down(act(gate(x)) * up(x)) with LoRA on any of the projections; saves x, gate and up.

    projs: (gate, up, down), or (gate_up, down) with `gate_first` saying the fused order."""

    @staticmethod
    def forward(ctx, x, projs, act, gate_first, *adapters):
        x2 = x.reshape(-1, x.shape[-1])
        pairs = _adapter_pairs(projs, adapters)
        if len(projs) == 3:
            gate = proj_forward(x2, projs[0], *pairs[0])
            up = proj_forward(x2, projs[1], *pairs[1])
        else:
            first, second = proj_forward(x2, projs[0], *pairs[0]).chunk(2, dim=-1)
            gate, up = (first, second) if gate_first else (second, first)
        h = glu_forward(act, gate, up)
        out = proj_forward(h, projs[-1], *pairs[-1])
        del h
        ctx.save_for_backward(x, gate, up, *adapters)
        ctx.projs, ctx.act, ctx.gate_first = projs, act, gate_first
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dout):
        x, gate, up, *adapters = ctx.saved_tensors
        projs, act = ctx.projs, ctx.act
        pairs = _adapter_pairs(projs, adapters)
        x2, d2 = x.reshape(-1, x.shape[-1]), dout.reshape(-1, dout.shape[-1])
        down, (Ad, Bd) = projs[-1], pairs[-1]
        # the down adapter needs its input: recomputed, never saved
        h = glu_forward(act, gate, up) if down.adapted else None
        dh, dAd, dBd = proj_backward(d2, h, down, Ad, Bd, None)
        del h
        dgate, dup = glu_backward(act, dh, gate, up)
        del dh
        if len(projs) == 3:
            dx, dAg, dBg = proj_backward(dgate, x2, projs[0], *pairs[0], None)
            dx, dAu, dBu = proj_backward(dup, x2, projs[1], *pairs[1], dx)
            grads = [(dAg, dBg), (dAu, dBu), (dAd, dBd)]
        else:
            dgu = torch.cat((dgate, dup) if ctx.gate_first else (dup, dgate), dim=-1)
            del dgate, dup
            dx, dA, dB = proj_backward(dgu, x2, projs[0], *pairs[0], None)
            grads = [(dA, dB), (dAd, dBd)]
        return (dx.view(x.shape), None, None, None, *_adapter_grads(projs, grads))


def fused_mlp(x, projs, adapters, act: str, gate_first: bool) -> torch.Tensor:
    return _LoraMLPFunction.apply(x, tuple(projs), act, gate_first, *adapters)


def fused_linears(x, projs, adapters) -> tuple[torch.Tensor, ...]:
    return _LoraLinearsFunction.apply(x, tuple(projs), *adapters)


# --------------------------------------------------------------------------------------------
# Candidates (by structure, at swap time)
# --------------------------------------------------------------------------------------------


def mlp_candidate(module):
    """((projection names), kernel activation) for a gated MLP whose projections the fused
    function can compute; a refusal reason; or None for anything else."""
    found = mlp.candidate(module)
    if found is None or isinstance(found, str):
        return found
    names, act = found
    for name in names:
        if layer_kind(getattr(module, name)) is None:
            proj = getattr(module, name)
            base = proj.get_base_layer() if _is_lora_layer(proj) else proj
            return f"projection {name} is {type(base).__name__}: neither a plain nor a bitsandbytes 4-bit linear"
    return names, act


def attention_candidate(module):
    """(input projection names, output projection name or None, {op: refusal reason}) of an
    attention block (an op absent from the dict can be swapped), or None for anything else."""
    children = dict(module.named_children())
    for inputs in families.LORA_ATTENTION_INPUTS:
        if all(isinstance(children.get(n), torch.nn.Module) for n in inputs):
            break
    else:
        return None
    out = next((n for n in families.LORA_ATTENTION_OUTPUTS if isinstance(children.get(n), torch.nn.Module)), None)
    reasons = {}
    if out is None:
        reasons[O_OP] = "no output projection (" + "/".join(families.LORA_ATTENTION_OUTPUTS) + ")"
    for op, names in ((QKV_OP, inputs), (O_OP, (out,) if out else ())):
        for name in names:
            if op not in reasons and layer_kind(children[name]) is None:
                proj = children[name]
                base = proj.get_base_layer() if _is_lora_layer(proj) else proj
                reasons[op] = f"projection {name} is {type(base).__name__}: neither a plain nor a bitsandbytes 4-bit linear"
    return inputs, out, reasons


def structure(module, names) -> tuple:
    """What the probe verdict depends on besides the class: the names and base kinds."""
    return tuple((n, layer_kind(getattr(module, n))) for n in names)


# --------------------------------------------------------------------------------------------
# The probe: outputs and gradients of x, A, B against PEFT's formula on the module's own layers
# --------------------------------------------------------------------------------------------

PROBE_RANK = 4


def _probe_adapters(layers, dtype, device):
    """Random (A, B, scale) per layer, B non-zero so every gradient term counts."""
    out = []
    for i, layer in enumerate(layers):
        out_f, in_f = _layer_shape(layer)
        gen = torch.Generator().manual_seed(100 + i)
        A = (torch.randn(PROBE_RANK, in_f, generator=gen) / in_f ** 0.5).to(device, dtype).requires_grad_()
        B = (torch.randn(out_f, PROBE_RANK, generator=gen) / PROBE_RANK ** 0.5).to(device, dtype).requires_grad_()
        out.append((A, B, 0.5 + i))
    return out


def _layer_shape(base) -> tuple[int, int]:
    if base_kind(base) == "4bit":
        return base.out_features, base.in_features
    return tuple(base.weight.shape)


def _ref_projection(base, A, B, s, x, dtype):
    """PEFT's lora.Linear formula around the base layer's own forward (in a float32 probe of a
    lower-precision layer: its weights upcast)."""
    if base_kind(base) == "4bit" or base.weight.dtype == dtype:
        y = base(x)
    else:
        bias = None if base.bias is None else base.bias.to(dtype)
        y = torch.nn.functional.linear(x, base.weight.to(dtype), bias)
    return y + torch.nn.functional.linear(torch.nn.functional.linear(x, A), B) * s


def _probe_projs(bases, dtype, adapters):
    projs = []
    for base in bases:
        kind = base_kind(base)
        w = base.weight if (kind == "4bit" or base.weight.dtype == dtype) else base.weight.detach().to(dtype)
        bias = None if base.bias is None else base.bias.detach().to(dtype)
        projs.append(Proj(w, bias, kind, True, 0.0, "cast" if kind == "4bit" else "promote"))
    return [p._replace(scale=s) for p, (_, _, s) in zip(projs, adapters)]


def _compare(what, got, ref, grads_got, grads_ref, dtype) -> str | None:
    """None when the output and every gradient are within the dtype's bound, else the first that is not."""
    limit = probe.bound(dtype)
    for (name, r), g in [(("output", ref), got)] + list(zip(grads_ref, grads_got)):
        err = probe.rel_err(g, r)
        if err > limit:
            return f"{what} differs from PEFT's LoRA in {dtype}: {name} relative error {err:.2e} > {limit:.1e}"
    return None


def _bases(module, names):
    return [getattr(module, n).get_base_layer() if _is_lora_layer(getattr(module, n)) else getattr(module, n)
            for n in names]


def _probe_dtypes(act_dtype, bases):
    dtypes = [act_dtype]
    if act_dtype != torch.float32 and all(base_kind(b) == "plain" for b in bases):
        dtypes.append(torch.float32)
    if all(base_kind(b) == "4bit" for b in bases):  # a 4-bit base computes in its compute dtype
        dtypes = [getattr(bases[0], "compute_dtype", None) or act_dtype]
    return dtypes


def probe_mlp(module, act_dtype, names, act):
    """The GluPlan under which `_LoraMLPFunction` reproduces PEFT's LoRA layers on this MLP
    (outputs, and gradients of x and every A and B), or a refusal reason."""
    plan = mlp.probe_verdict(module, act_dtype, names, act)
    if isinstance(plan, str):
        return plan
    bases = _bases(module, names)
    act_fn = mlp.activation(module)
    device = probe.module_device(module)
    gate_first = plan.order == "gate_up"
    for dtype in _probe_dtypes(act_dtype, bases):
        adapters = _probe_adapters(bases, dtype, device)
        with probe.probing(module):
            x = probe.randn((2, 3, _layer_shape(bases[0])[1]), dtype, device).requires_grad_()
            dy = probe.randn((2, 3, _layer_shape(bases[-1])[0]), dtype, device)
            ys = [_ref_projection(b, A, B, s, x, dtype) for b, (A, B, s) in zip(bases[:-1], adapters[:-1])]
            if len(ys) == 2:
                gate, up = ys
            else:
                first, second = ys[0].chunk(2, dim=-1)
                gate, up = (first, second) if gate_first else (second, first)
            Ad, Bd, sd = adapters[-1]
            ref = _ref_projection(bases[-1], Ad, Bd, sd, act_fn(gate) * up, dtype)
            leaves = [x] + [t for A, B, _ in adapters for t in (A, B)]
            ref_grads = torch.autograd.grad(ref, leaves, dy)
            projs = _probe_projs(bases, dtype, adapters)
            flat = [t for A, B, _ in adapters for t in (A, B)]
            got = fused_mlp(x, projs, flat, act, gate_first)
            got_grads = torch.autograd.grad(got, leaves, dy)
        labels = ["x"] + [f"{n}.{ab}" for n in names for ab in ("A", "B")]
        reason = _compare("fused LoRA MLP", got, ref, got_grads, list(zip(labels, ref_grads)), dtype)
        if reason:
            return reason
    return plan


def probe_linears(module, act_dtype, names):
    """True when `_LoraLinearsFunction` reproduces PEFT's LoRA layers on these projections of
    `module` (outputs, gradients of x and every A and B), else a refusal reason."""
    bases = _bases(module, names)
    device = probe.module_device(module)
    for dtype in _probe_dtypes(act_dtype, bases):
        adapters = _probe_adapters(bases, dtype, device)
        with probe.probing(module):
            x = probe.randn((2, 3, _layer_shape(bases[0])[1]), dtype, device).requires_grad_()
            refs = [_ref_projection(b, A, B, s, x, dtype) for b, (A, B, s) in zip(bases, adapters)]
            dys = [probe.randn(r.shape, dtype, device) for r in refs]
            leaves = [x] + [t for A, B, _ in adapters for t in (A, B)]
            ref_grads = torch.autograd.grad(refs, leaves, dys)
            flat = [t for A, B, _ in adapters for t in (A, B)]
            got = fused_linears(x, _probe_projs(bases, dtype, adapters), flat)
            got_grads = torch.autograd.grad(got, leaves, dys)
        labels = ["x"] + [f"{n}.{ab}" for n in names for ab in ("A", "B")]
        reason = _compare("fused LoRA " + "/".join(names), torch.cat([g.flatten() for g in got]),
                          torch.cat([r.flatten() for r in refs]), got_grads, list(zip(labels, ref_grads)), dtype)
        if reason:
            return reason
    return True


# --------------------------------------------------------------------------------------------
# The swapped forwards, decided at call time
# --------------------------------------------------------------------------------------------


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling()) or torch.jit.is_tracing()


def call_inner(module, *args, **kwargs):
    """The forward a LoRA site replaced (another swap's, or the class's)."""
    inner = module.__dict__.get(INNER_ATTR)
    if inner is None:
        return type(module).forward(module, *args, **kwargs)
    return inner(*args, **kwargs)


def _plan(projections, x):
    """(projs, adapters) for the modules `projections` on `x`, NO_ADAPTER, or a fall-back reason."""
    if torch.is_autocast_enabled(x.device.type):
        return "autocast is on"
    projs, adapters = [], []
    for m in projections:
        found = projection(m, x)
        if isinstance(found, str):
            return found
        projs.append(found[0])
        adapters += found[1]
    return (projs, adapters) if adapters else NO_ADAPTER


def _any_lora_layer(module, names) -> bool:
    """Whether any of the named children is a PEFT LoRA layer: the one check a site makes on a model
    that has none (two dict lookups a projection), so that the sites cost nothing measurable on
    models without adapters (`benchmarks/overhead.py`). Such calls are not counted."""
    children = module._modules
    for name in names:
        child = children.get(name)
        if child is not None and "lora_A" in child._modules:
            return True
    return False


def _outcome(reason: str) -> str:
    return reason if reason == NO_ADAPTER else f"PEFT's forward: {reason}"


def mlp_forward(self, *args, **kwargs):
    """The swapped gated MLP: one fused LoRA function when an adapter is active and reproducible."""
    site = self.__dict__.get(SITE_ATTR)
    if site is None or _compiling() or not _any_lora_layer(self, site.glu_plan[0]):
        return call_inner(self, *args, **kwargs)
    x = sites.the_input(args, kwargs)
    names, act, order = site.glu_plan
    found = _plan([getattr(self, n) for n in names], x) if isinstance(x, torch.Tensor) else "input is not a tensor"
    if isinstance(found, str):
        site.count(MLP_OP, _outcome(found))
        return call_inner(self, *args, **kwargs)
    site.count(MLP_OP, FUSED)
    projs, adapters = found
    return fused_mlp(x, projs, adapters, act, order == "gate_up")


class _Bound:
    """For one attention call: the projections' forwards bound to the fused functions."""

    def __init__(self, site, module) -> None:
        self.site, self.module = site, module
        self.stash: dict[str, torch.Tensor] = {}
        self.stash_x = None
        self.decided: dict[str, object] = {}
        self.slots: list = []

    def bind(self, name: str, group: tuple[str, ...], op: str) -> None:
        child = getattr(self.module, name)
        slot = sites.forward_slot(child)
        had = slot in child.__dict__
        previous = child.__dict__.get(slot)
        original = previous if had else types.MethodType(type(child).forward, child)
        call = self

        def forward(m, *args, **kwargs):
            return call.run(name, group, op, original, args, kwargs)

        self.slots.append((child, slot, had, previous))
        child.__dict__[slot] = types.MethodType(forward, child)

    def run(self, name, group, op, original, args, kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            self.site.count(op, _outcome("extra arguments to a projection"))
            return original(*args, **kwargs)
        x = args[0]
        if name in self.stash and self.stash_x is x:
            return self.stash.pop(name)
        found = _plan([getattr(self.module, n) for n in group], x)
        if isinstance(found, str):
            if self.decided.get(group) != found:  # count a group once per call
                self.decided[group] = found
                self.site.count(op, _outcome(found))
            return original(x)
        self.site.count(op, FUSED)
        outs = fused_linears(x, *found)
        self.stash = {n: o for n, o in zip(group, outs) if n != name}
        self.stash_x = x
        return outs[group.index(name)]

    def __enter__(self):
        inputs, out = self.site.names
        if QKV_OP in self.site.ops:
            for name in inputs:
                self.bind(name, inputs, QKV_OP)
        if O_OP in self.site.ops and out is not None:
            self.bind(out, (out,), O_OP)
        return self

    def __exit__(self, *exc):
        while self.slots:
            child, slot, had, previous = self.slots.pop()
            if had:
                child.__dict__[slot] = previous
            else:
                child.__dict__.pop(slot, None)
        self.stash.clear()
        return False


def attention_forward(self, *args, **kwargs):
    """The swapped attention: its own forward, with the LoRA projections fused for this call."""
    site = self.__dict__.get(SITE_ATTR)
    if site is None or _compiling():
        return call_inner(self, *args, **kwargs)
    inputs, out = site.names
    if not _any_lora_layer(self, (*inputs, out) if out is not None else inputs):
        return call_inner(self, *args, **kwargs)
    with _Bound(site, self):
        return call_inner(self, *args, **kwargs)


def op_of(module) -> str | None:
    """The op whose forward a module runs now (the MARK of its bound forward), None when stock."""
    bound = module.__dict__.get(sites.forward_slot(module))
    return getattr(getattr(bound, "__func__", None), sites.MARK, None)


def install(state, module, func, site: Site) -> None:
    """Bind `func` as the module's forward on top of whatever is there (kept in INNER_ATTR)."""
    slot = sites.forward_slot(module)
    if slot in module.__dict__:
        state.set(module, INNER_ATTR, module.__dict__[slot])
    state.set(module, SITE_ATTR, site)
    state.set(module, slot, types.MethodType(func, module))
