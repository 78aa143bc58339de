"""The LoRA sites' forwards, decided at every call: the fused function when an adapter is active
and the call reproducible, else the forward beneath (PEFT's), counted either way.

Under torch.compile the same code is traced (no stand-aside): dynamo guards on what the plan reads
(the adapters, their flags, dtypes, hooks), so the graph holds the fused functions where eager would
run them, and a change that eager would see at the next call fails a guard and recompiles. For one
call of the attention, its projections' entries in its `_modules` are `_Served` objects (stores
into a plain dict, put back before the call returns; dynamo replays the final state, which is the
state before the call); the projections themselves are not touched: no instance attribute is set
or removed in the trace, which torch 2.11's dynamo cannot replay. A compiled call is counted when dynamo traces it, not when the graph runs
(per-call counting inside a graph is a guard that fails at every call): `calls` then holds
"compiled: <outcome>" once per traced site (docs/compile.md), what the graph computes at every call
of it (a change that would give another outcome fails a guard and is traced, and counted, anew)."""
from __future__ import annotations

import torch

from .. import report, sites
from ..layers import mlp, norms
from . import timing
from .functions import GLU_KERNEL, GLU_TORCH, TORCH_ACTS, fused_linears, fused_mlp
from .plans import MLP_OP, O_OP, QKV_OP, projection

#: Instance attribute holding a site's call-time data (`Site`).
SITE_ATTR = "_accel_patch_lora_site"
#: Instance attribute holding the forward a LoRA site replaced (rope's or glu's swapped forward,
#: an accelerate wrapper), which its fall-back calls. Separate from sites.INNER_ATTR, which the
#: forward beneath may itself use.
INNER_ATTR = "_accel_patch_lora_inner"

FUSED = "fused"
NO_ADAPTER = "no active LoRA adapter: the module's forward"
#: Decode steps (generation: a few tokens, no grad): the fused function saves nothing there (no
#: activations are kept without grad) and its host-side work (the plan, the spec, one custom op)
#: costs more than it saves at a few rows: PEFT's forward runs, counted (by design, not a fall-back).
#: Not while dynamo traces: a compiled graph has no per-op host work to save, and the row count
#: would be a guard on the tokens (a batch on the other side of it recompiles, which stock does not).
DECODE_ROWS = 16
DECODE = f"decode shape: PEFT's forward (at most {DECODE_ROWS} tokens, no grad)"


def _decode_shape(x: torch.Tensor) -> bool:
    return not torch.is_grad_enabled() and not sites.compiling() and x.numel() <= DECODE_ROWS * x.shape[-1]

#: Prefix of the outcomes counted while torch.compile traces a site (once per compiled graph).
COMPILED = report.COMPILED


class Site(sites.CountingSite):
    """What a LoRA site's forward reads at call time: its ops, projection names, the GLU plan of an
    MLP, and the call counts it adds to (the model's SwapState.calls). For an MLP, `torch_glu`
    says whether the module's own activation is `functions.TORCH_ACTS[act]` bit for bit (checked
    once, at swap time), so the fused function may compute act(gate) * up as the module does.
    `timed`: whether its calls may be timed against PEFT's forward (timing.py), read from
    ACCEL_PATCH_LORA_PATH when the site is made (a bad value raises BadSwitch there, and the swap
    refuses the site with it)."""

    def __init__(self, ops, names, glu_plan, calls, act_fn=None) -> None:
        self.ops, self.names, self.glu_plan, self.calls = set(ops), names, glu_plan, calls
        self.torch_glu = glu_plan is not None and act_fn is not None and torch_act_matches(act_fn, glu_plan.act)
        self.timed = timing.path_mode() == "auto"

    def count(self, op: str, outcome: str) -> None:
        sites.count_into(self.calls, op, outcome)

    def norm_recomputed(self) -> None:
        """One recompute of the input norm's output in backward (norms.recompute_scope)."""
        sites.count_into(self.calls, norms.OP, norms.RECOMPUTED)


def torch_act_matches(act_fn, act: str) -> bool:
    """Whether `act_fn` computes TORCH_ACTS[act] bit for bit, in every floating dtype a model runs in."""
    formula = TORCH_ACTS.get(act)
    if formula is None:
        return False
    t = torch.linspace(-12.0, 12.0, 2001)
    try:
        with torch.no_grad():
            return all(torch.equal(act_fn(t.to(d)), formula(t.to(d)))
                       for d in (torch.float32, torch.bfloat16, torch.float16))
    except Exception:
        return False


#: The outcome of a call whose adapters-off forward computes the activation in a way the fused
#: function cannot reproduce bit for bit (PEFT's forward runs, so that both passes agree).
OWN_ACTIVATION = "PEFT's forward: the module's activation is not F.silu/F.gelu bit for bit (as its adapters-off forward)"


def _glu_path(module, site: Site, x: torch.Tensor) -> str | None:
    """How the fused MLP computes act(gate) * up this call: as the forward beneath does with the
    adapters off (the `glu` kernel where that swap is beneath and runs it, else the module's own
    formula), or None when the module's own formula is not one the fused function has."""
    from accel_kernels import _dispatch

    inner = module.__dict__.get(INNER_ATTR)
    if getattr(getattr(inner, "__func__", None), sites.MARK, None) == mlp.OP and _dispatch.use_triton(x):
        return GLU_KERNEL
    return GLU_TORCH if site.torch_glu else None


def _count(site: Site, op: str, outcome: str) -> None:
    sites.count(site, outcome, op)  # once per compiled graph while dynamo traces


def call_inner(module, *args, **kwargs):
    """The forward a LoRA site replaced (another swap's, or the class's)."""
    return sites.call_kept(INNER_ATTR, module, *args, **kwargs)


def _plan(projections, x):
    """(projs, adapters) for the modules `projections` on `x`, NO_ADAPTER, or a fall-back reason."""
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
    if site is None or not _any_lora_layer(self, site.glu_plan[0]):
        return call_inner(self, *args, **kwargs)
    x = sites.the_input(args, kwargs)
    if isinstance(x, torch.Tensor) and x.dim() > 0 and _decode_shape(x):
        _count(site, MLP_OP, DECODE)
        return call_inner(self, *args, **kwargs)
    names, act, order, _ = site.glu_plan  # a clamped plan never reaches here (lora.probe refuses it)
    found = _plan([getattr(self, n) for n in names], x) if isinstance(x, torch.Tensor) else "input is not a tensor"
    if isinstance(found, str):
        _count(site, MLP_OP, _outcome(found))
        return call_inner(self, *args, **kwargs)
    path = _glu_path(self, site, x)
    if path is None:
        _count(site, MLP_OP, OWN_ACTIVATION)
        return call_inner(self, *args, **kwargs)
    projs, adapters = found
    gate_first = order == "gate_up"
    chosen, timed = timing.choose(
        site.timed, MLP_OP, x, projs, adapters,
        lambda v: (fused_mlp(v, projs, adapters, act, gate_first, path),),
        lambda v: (call_inner(self, *_replaced(args, x, v), **_replaced(kwargs, x, v)),), (act, gate_first, path))
    _count(site, MLP_OP, timing.outcome(chosen, timed))
    if chosen != FUSED:
        return call_inner(self, *args, **kwargs)
    # the function saves x, under autocast too: the norm's call instead
    with norms.recompute_scope(x, site.norm_recomputed, saved_as_is=True):
        return fused_mlp(x, projs, adapters, act, gate_first, path)


def _replaced(values, old, new):
    """args (a tuple) or kwargs (a dict) with the tensor `old` replaced by `new`."""
    if isinstance(values, dict):
        return {k: new if v is old else v for k, v in values.items()}
    return tuple(new if v is old else v for v in values)


class _Served:
    """Stands in the attention's `_modules` for one projection during one call: `self.q_proj(x)` in
    the attention's forward calls it (`_Bound.run`). Any other attribute is the projection's own
    (`self.q_proj.weight`, `modules()`), so code reading the projection sees the real one."""

    def __init__(self, bound, name, group, op, child) -> None:
        # underscored, so that none shadows a public attribute of the projection
        self._bound, self._name, self._group, self._op, self._child = bound, name, group, op, child

    def __call__(self, *args, **kwargs):
        return self._bound.run(self._name, self._group, self._op, self._child, *args, **kwargs)

    def __getattr__(self, attr):
        return getattr(self._child, attr)


class _Bound:
    """For one attention call: its projections served by the fused functions. Each projection's
    entry in the attention's `_modules` is replaced by a `_Served` for the call and put back when it
    returns or raises: dict stores only, which dynamo traces and replays in torch 2.11 as in 2.13
    (removing an instance attribute inside a trace, as binding a projection's own `forward` for the
    call needed, is not traceable in 2.11). The projections themselves are never touched."""

    def __init__(self, site, module, cross: str | None = None) -> None:
        self.site, self.module, self.cross = site, module, cross
        self.children: dict[str, torch.nn.Module] = {}
        self.stash: dict[str, torch.Tensor] = {}
        self.stash_x = None
        self.decided: dict[str, object] = {}

    def serve(self, name: str, group: tuple[str, ...], op: str) -> None:
        modules = self.module._modules
        child = modules[name]
        self.children[name] = child
        modules[name] = _Served(self, name, group, op, child)

    def run(self, name, group, op, child, *args, **kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            _count(self.site, op, _outcome("extra arguments to a projection"))
            return child(*args, **kwargs)
        x = args[0]
        if name in self.stash and self.stash_x is x:
            return self.stash.pop(name)
        if self.decided.get(group) == ANOTHER_INPUT or (self.stash_x is not None and name in self.stash):
            # the group was computed from another tensor this call (an attention of unknown form
            # reading keys and values from a second input): this projection is PEFT's, never the
            # group again (its other projections and their dropout masks already were)
            if self.decided.get(group) != ANOTHER_INPUT:
                self.decided[group] = ANOTHER_INPUT
                _count(self.site, op, ANOTHER_INPUT)
            return child(x)
        if self.decided.get(group) == timing.FASTER_UNFUSED:  # the group's first projection timed it
            return child(x)
        if x.dim() > 0 and _decode_shape(x):
            if self.decided.get(group) != DECODE:  # count a group once per call
                self.decided[group] = DECODE
                _count(self.site, op, DECODE)
            return child(x)
        children = [self.children[n] for n in group]
        found = _plan(children, x)
        if isinstance(found, str):
            if self.decided.get(group) != found:  # count a group once per call
                self.decided[group] = found
                _count(self.site, op, _outcome(found))
            return child(x)
        chosen, timed = timing.choose(self.site.timed, op, x, *found, lambda v: fused_linears(v, *found),
                                      lambda v: tuple(c(v) for c in children))
        if chosen != FUSED:  # counted once per call: the group's other projections return above
            self.decided[group] = timing.FASTER_UNFUSED
            _count(self.site, op, timing.outcome(chosen, timed))
            return child(x)
        _count(self.site, op, timing.outcome(chosen, timed))
        outs = fused_linears(x, *found)
        self.stash = {n: o for n, o in zip(group, outs) if n != name}
        self.stash_x = x
        return outs[group.index(name)]

    def __enter__(self):
        inputs, out = self.site.names
        if QKV_OP in self.site.ops and self.cross is not None:
            # a cross-attention call: queries from one input, keys and values from another, each
            # projection PEFT's (one dropout mask each, in PEFT's order, as stock draws them)
            if _any_lora_layer(self.module, inputs):
                _count(self.site, QKV_OP, _outcome(f"cross-attention ({self.cross})"))
        elif QKV_OP in self.site.ops:
            for name in inputs:
                self.serve(name, inputs, QKV_OP)
        if O_OP in self.site.ops and out is not None:
            self.serve(out, (out,), O_OP)
        return self

    def __exit__(self, *exc):
        modules = self.module._modules
        for name, child in self.children.items():
            modules[name] = child
        self.stash.clear()
        return False


#: An attention forward's keyword arguments that carry a second input, for keys and values
#: (encoder-decoder models' cross-attention, Mllama's cross-attention layers).
CROSS_INPUTS = ("key_value_states", "encoder_hidden_states", "cross_attention_states")
#: An attention traced inside a higher-order op's body (a decoder layer under non-reentrant
#: gradient checkpointing, compiled): dynamo refuses there the call's stores into the attention's
#: `_modules` that serve its projections (a write to an object made outside the body), so they run
#: as PEFT's, in the graph. The MLP site stores nothing and stays fused there.
IN_SUBGRAPH = "PEFT's forward: an attention traced inside a checkpointed layer's body (torch.compile)"
#: A group's projection called on another tensor than the one the group was computed from.
ANOTHER_INPUT = "PEFT's forward: a projection of the group called on another input"


def attention_forward(self, *args, **kwargs):
    """The swapped attention: its own forward, with the LoRA projections fused for this call."""
    site = self.__dict__.get(SITE_ATTR)
    if site is None:
        return call_inner(self, *args, **kwargs)
    inputs, out = site.names
    if not _any_lora_layer(self, (*inputs, out) if out is not None else inputs):
        return call_inner(self, *args, **kwargs)
    # the fused groups save their input as it is, under autocast too: the input norm's call instead
    # (the swapped attention forward beneath, whose scope would stand aside under autocast, then
    # finds this one open and opens none)
    if sites.in_subgraph():
        for op, group in ((QKV_OP, inputs), (O_OP, (out,) if out is not None else ())):
            if op in site.ops and _any_lora_layer(self, group):
                _count(site, op, IN_SUBGRAPH)
        return call_inner(self, *args, **kwargs)
    cross = next((name for name in CROSS_INPUTS if kwargs.get(name) is not None), None)
    with _Bound(site, self, cross), norms.recompute_scope(args[0] if args else kwargs.get("hidden_states"),
                                                   site.norm_recomputed, saved_as_is=True):
        return call_inner(self, *args, **kwargs)


def op_of(module) -> str | None:
    """The op whose forward a module runs now (the MARK of its bound forward), None when stock."""
    bound = module.__dict__.get(sites.forward_slot(module))
    return getattr(getattr(bound, "__func__", None), sites.MARK, None)


def install(state, module, func, site: Site) -> None:
    """Bind `func` as the module's forward on top of whatever is there (kept in INNER_ATTR)."""
    state.set(module, SITE_ATTR, site)
    sites.install(state, module, func, INNER_ATTR)


def waiting_ops(module) -> list[str]:
    """The ops of the LoRA site on `module` that have no PEFT LoRA layer under them yet (a full
    fine-tune, or a swap before `get_peft_model`): reported as waiting, not as swapped."""
    site = module.__dict__.get(SITE_ATTR)
    if site is None:
        return []
    if MLP_OP in site.ops:
        groups = {MLP_OP: site.glu_plan[0]}
    else:
        inputs, out = site.names
        groups = {QKV_OP: inputs, O_OP: (out,) if out is not None else ()}
    return [op for op in sorted(site.ops) if not _any_lora_layer(module, groups.get(op, ()))]
