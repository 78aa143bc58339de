"""The probe: a fused function's outputs and gradients (of x and every A and B) against PEFT's
formula on the module's own base layers, in each dtype the model will see."""
from __future__ import annotations

import contextlib

import torch

from .. import probe
from ..layers import mlp
from .functions import fused_linears, fused_mlp
from ..sites import autocast_available
from .plans import HALF_ADAPTERS_4BIT, Proj, _compute_4bit, _is_lora_layer, base_kind

PROBE_RANK = 4


PROBE_DROPOUT = 0.25


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


def _base_tensors(base, dtype):
    """(weight, bias) as the probe computes a plain base in `dtype` (a float32 probe of a
    lower-precision layer upcasts its weights); a 4-bit base's own."""
    if base_kind(base) == "4bit" or base.weight.dtype == dtype:
        return base.weight, base.bias
    return base.weight.detach().to(dtype), None if base.bias is None else base.bias.detach().to(dtype)


def _ref_projection(base, A, B, s, x, dtype, p):
    """PEFT's forward (lora.Linear, or lora.bnb.Linear4bit) around the base layer, in PEFT's order:
    base(x), the input cast to the adapter's dtype, dropout, A, B, scaling, the add and its casts."""
    drop = torch.nn.Dropout(p)
    if base_kind(base) == "4bit":
        result = base(x)
        if torch.is_autocast_enabled():  # lora.bnb: no casts under CUDA autocast
            return result + torch.nn.functional.linear(torch.nn.functional.linear(drop(x), A), B) * s
        out = torch.nn.functional.linear(torch.nn.functional.linear(drop(x.to(A.dtype)), A), B) * s
        return result + out.to(result.dtype)
    w, bias = _base_tensors(base, dtype)
    result = torch.nn.functional.linear(x, w, bias)
    out = torch.nn.functional.linear(torch.nn.functional.linear(drop(x.to(A.dtype)), A), B) * s
    return (result + out).to(result.dtype)


def _probe_projs(bases, dtype, adapters, x, autocast, p):
    projs = []
    for base, (_, _, s) in zip(bases, adapters):
        kind = base_kind(base)
        w, bias = _base_tensors(base, dtype)
        compute = w.dtype if kind == "plain" else _compute_4bit(base, x)
        converts = kind != "4bit" or not torch.is_autocast_enabled()
        peft_cast = "promote" if kind == "plain" else ("cast" if converts else "none")
        projs.append(Proj(w, bias, kind, compute, True, s, p, autocast, converts, peft_cast))
    return projs


def _computed_in(dtype, adapter_dtype, autocast) -> torch.dtype:
    """The least precise dtype of a probe's computation: autocast's where on, else the input's or the
    adapters' (bf16 adapters on a float32 input round the adapter's terms to bf16, as PEFT does)."""
    if autocast is not None:
        return autocast
    return max(dtype, adapter_dtype, key=lambda d: torch.finfo(d).eps)


def _compare(what, got, ref, grads_got, grads_ref, dtype, autocast, p, adapter_dtype=None) -> str | None:
    """None when the output (its dtype too) and every gradient are within the bound of the dtype
    computed in, else the first that is not."""
    if got.dtype != ref.dtype:
        return f"{what} returns {got.dtype}, PEFT {ref.dtype} in {_what(dtype, autocast, p)}"
    limit = probe.bound(_computed_in(dtype, adapter_dtype or dtype, autocast))
    for (name, r), g in [(("output", ref), got)] + list(zip(grads_ref, grads_got)):
        err = probe.rel_err(g, r)
        if err > limit:
            return (f"{what} differs from PEFT's LoRA in {_what(dtype, autocast, p, adapter_dtype)}: {name} relative error "
                    f"{err:.2e} > {limit:.1e}")
    return None


def _bases(module, names):
    return [getattr(module, n).get_base_layer() if _is_lora_layer(getattr(module, n)) else getattr(module, n)
            for n in names]


def _probe_configs(act_dtype, bases, device):
    """(input dtype, adapter dtype, autocast dtype or None, dropout p) to probe: each dtype the model
    computes in; PEFT's float32 adapters on a half-precision model; dropout (the same masks under
    the same seed); on 4-bit bases, bf16 adapters on a float32 input (what TRL trains a QLoRA model
    in without bf16 autocast: `plans.HALF_ADAPTERS_4BIT`); PEFT's float32 adapters under bfloat16
    autocast, with dropout."""
    dtypes = [act_dtype]
    if act_dtype != torch.float32 and all(base_kind(b) == "plain" for b in bases):
        dtypes.append(torch.float32)
    if all(base_kind(b) == "4bit" for b in bases):  # a 4-bit base computes in its compute dtype
        dtypes = [getattr(bases[0], "compute_dtype", None) or act_dtype]
    configs = [(d, d, None, 0.0) for d in dtypes]
    if act_dtype in (torch.bfloat16, torch.float16):  # PEFT's default float32 adapters on a half base
        configs.append((act_dtype, torch.float32, None, 0.0))
    configs.append((dtypes[-1], dtypes[-1], None, PROBE_DROPOUT))
    if all(base_kind(b) == "4bit" for b in bases):  # TRL's QLoRA: bf16 adapters, float32 hidden states
        configs.append((torch.float32, HALF_ADAPTERS_4BIT, None, PROBE_DROPOUT))
    if device is not None and autocast_available(device.type) and act_dtype != torch.float64:
        configs.append((act_dtype, torch.float32, torch.bfloat16, PROBE_DROPOUT))
    return configs


def _autocast(device, dtype):
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _probing_input(module, bases, adapters, dtype, device):
    """`probe.probing(module)` with the probe's input x (requiring grad) made inside it, and the
    leaves whose gradients are compared: x, then every adapter's A and B."""
    with probe.probing(module):
        x = probe.randn((2, 3, _layer_shape(bases[0])[1]), dtype, device).requires_grad_()
        yield x, [x] + [t for A, B, _ in adapters for t in (A, B)]


def _what(dtype, autocast, p, adapter_dtype=None):
    adapters = f" with {adapter_dtype} adapters" if adapter_dtype not in (None, dtype) else ""
    return f"{dtype}{adapters}" + (f" under {autocast} autocast" if autocast else "") + (f" with dropout {p}" if p else "")


def probe_mlp(module, act_dtype, names, act):
    """The GluPlan under which the fused MLP reproduces PEFT's LoRA layers on this MLP (outputs,
    their dtype, and gradients of x and every A and B), or a refusal reason."""
    plan = mlp.probe_verdict(module, act_dtype, names, act)
    if isinstance(plan, str):
        return plan
    if plan.limit is not None:
        return (f"the module clamps gate/up at {plan.limit:g} (the glu kernel does too): the fused LoRA MLP "
                f"does not clamp")
    bases = _bases(module, names)
    act_fn = mlp.activation(module)
    device = probe.module_device(module)
    gate_first = plan.order == "gate_up"
    for dtype, adapter_dtype, autocast, p in _probe_configs(act_dtype, bases, device):
        adapters = _probe_adapters(bases, adapter_dtype, device)
        with _probing_input(module, bases, adapters, dtype, device) as (x, leaves):
            with _autocast(device, autocast):
                probe.seeded()
                ys = [_ref_projection(b, A, B, s, x, dtype, p) for b, (A, B, s) in zip(bases[:-1], adapters[:-1])]
                if len(ys) == 2:
                    gate, up = ys
                else:
                    first, second = ys[0].chunk(2, dim=-1)
                    gate, up = (first, second) if gate_first else (second, first)
                Ad, Bd, sd = adapters[-1]
                ref = _ref_projection(bases[-1], Ad, Bd, sd, act_fn(gate) * up, dtype, p)
                projs = _probe_projs(bases, dtype, adapters, x, autocast, p)
                flat = [t for A, B, _ in adapters for t in (A, B)]
                probe.seeded()
                got = fused_mlp(x, projs, flat, act, gate_first)
            dy = probe.randn(ref.shape, ref.dtype, device)
            ref_grads = torch.autograd.grad(ref, leaves, dy)
            got_grads = torch.autograd.grad(got, leaves, dy)
        labels = ["x"] + [f"{n}.{ab}" for n in names for ab in ("A", "B")]
        reason = _compare("fused LoRA MLP", got, ref, got_grads, list(zip(labels, ref_grads)), dtype, autocast, p,
                          adapter_dtype)
        if reason:
            return reason
    return plan


def probe_linears(module, act_dtype, names):
    """True when the fused projections reproduce PEFT's LoRA layers on these projections of
    `module` (outputs, their dtypes, gradients of x and every A and B), else a refusal reason."""
    bases = _bases(module, names)
    device = probe.module_device(module)
    for dtype, adapter_dtype, autocast, p in _probe_configs(act_dtype, bases, device):
        adapters = _probe_adapters(bases, adapter_dtype, device)
        with _probing_input(module, bases, adapters, dtype, device) as (x, leaves):
            with _autocast(device, autocast):
                probe.seeded()
                refs = [_ref_projection(b, A, B, s, x, dtype, p) for b, (A, B, s) in zip(bases, adapters)]
                flat = [t for A, B, _ in adapters for t in (A, B)]
                probe.seeded()
                got = fused_linears(x, _probe_projs(bases, dtype, adapters, x, autocast, p), flat)
            dys = [probe.randn(r.shape, r.dtype, device) for r in refs]
            ref_grads = torch.autograd.grad(refs, leaves, dys)
            got_grads = torch.autograd.grad(got, leaves, dys)
        labels = ["x"] + [f"{n}.{ab}" for n in names for ab in ("A", "B")]
        if [g.dtype for g in got] != [r.dtype for r in refs]:
            return f"fused LoRA {'/'.join(names)} returns {[g.dtype for g in got]}, PEFT {[r.dtype for r in refs]} in {_what(dtype, autocast, p)}"
        reason = _compare("fused LoRA " + "/".join(names), torch.cat([g.flatten() for g in got]),
                          torch.cat([r.flatten() for r in refs]), got_grads, list(zip(labels, ref_grads)), dtype, autocast, p,
                          adapter_dtype)
        if reason:
            return reason
    return True
