"""The probe: a fused function's outputs and gradients (of x and every A and B) against PEFT's
formula on the module's own base layers, in each dtype the model will see."""
from __future__ import annotations

import torch

from .. import mlp, probe
from .functions import fused_linears, fused_mlp
from .plans import Proj, _is_lora_layer, base_kind

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
