"""Swap kernels into one model instance and restore it: the walk over the model, site by site.

For each module: is it a candidate (by structure: layers/norms.py, layers/mlp.py, layers/rope.py,
experts/site.py), does the probe
accept it (cached per class, dtype and device), then bind the kernel forward on that instance and
record the change in the model's SwapState. The LM head and loss (loss/site.py) are one site, the
model itself. Everything refused is recorded with its reason; nothing is swapped on a guess.
"""
from __future__ import annotations

import logging
import sys
from typing import NamedTuple

import torch

from ..core import switches
from . import experts, lora, probe, sites
from .experts import interface as experts_interface
from .layers import mixers, mlp, norms, rope, tiled_mlp
from .loss import compiled_loss
from .loss import site as loss
from .ops import resolve_ops
from .report import Refusal, SwapReport

log = logging.getLogger("accel_patch")


def unwrap(model) -> torch.nn.Module:
    """The transformers model inside PEFT, DDP or torch.compile wrappers."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model, a PEFT PeftModel or a "
                        f"bitsandbytes-quantized model), got {type(model).__name__}")
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        elif callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
            model = model.get_base_model()
        elif _peft_mixed(model):  # get_peft_model(..., mixed=True): no get_base_model
            model = model.base_model.model
    return model


def _peft_mixed(model) -> bool:
    """Whether `model` is PEFT's PeftMixedModel (asked only where peft is imported already)."""
    peft = sys.modules.get("peft")
    mixed = getattr(peft, "PeftMixedModel", None)
    return isinstance(mixed, type) and isinstance(model, mixed)


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype hidden states will have: the input embedding's, else the first floating parameter's."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)
    try:
        emb = embeddings()
    except (NotImplementedError, AttributeError):
        emb = None
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _text_config(model):
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _verdict(key, run):
    """The cached probe verdict, a failing probe turned into a refusal reason."""
    def guarded():
        try:
            with sites.uncounted():  # a probe's calls are not calls of the model (the sites beneath count)
                return run()
        except Exception as exc:
            return f"probe failed: {type(exc).__name__}: {exc}"
    return probe.cache.get_or_probe(key, guarded)


class SiteKind(NamedTuple):
    """One kind of site the walk swaps into modules: a room (layers/, experts/, lora/) and this
    registration. `step` names the `_Walk` method that tests one module as a candidate, probes it and
    installs the forward; `on_top` kinds go on top of whatever forward the module runs (another
    kind's included); restore deletes `site_attr` (the site's call-time data) with the forward and
    puts back the one kept in `inner_attr`."""

    ops: tuple[str, ...]
    step: str
    on_top: bool
    site_attr: str | None
    inner_attr: str


#: The kinds, in the order the walk tries them on each module (a LoRA site goes on top of glu or
#: rope, installed just before it: swaps/lora/ says which wins; the tiled MLP on top of glu and
#: lora_mlp: it tiles whatever runs beneath). The LM head and loss is one site, the model itself
#: (`_Walk.loss`), swapped after the walk.
KINDS = (
    SiteKind((experts.OP,), "experts", False, experts.SITE_ATTR, sites.INNER_ATTR),
    SiteKind((norms.OP,), "norm", False, norms.CALLS_ATTR, sites.INNER_ATTR),
    SiteKind((norms.LAYER_NORM_OP,), "layer_norm", False, norms.CALLS_ATTR, sites.INNER_ATTR),
    SiteKind((mlp.OP,), "glu", False, mlp.COUNTER_ATTR, sites.INNER_ATTR),
    SiteKind((rope.OP,), "rope", False, rope.SITE_ATTR, sites.INNER_ATTR),
    SiteKind(lora.OPS, "lora", True, lora.SITE_ATTR, lora.INNER_ATTR),
    SiteKind((tiled_mlp.OP,), "tiled", True, tiled_mlp.SITE_ATTR, tiled_mlp.INNER_ATTR),
)
#: op -> its kind (what restore undoes for a forward marked with that op).
KIND_OF = {op: kind for kind in KINDS for op in kind.ops}
#: A site with no weights to probe on.
META = "no materialized weights (meta device): nothing to probe"


class _Walk:
    """One swap call over one model."""

    def __init__(self, model, state: sites.SwapState, todo: tuple[str, ...], top_level: bool,
                 tiled_requested: bool = False) -> None:
        self.model, self.state, self.todo, self.top_level = model, state, todo, top_level
        self.tiled_requested = tiled_requested  # named by the caller: tile without checkpointing too
        self.dtype = activation_dtype(model)
        self.config = _text_config(model)
        self.rope_held: set = set()
        self.new = 0

    def refuse(self, where: str, op: str, reason: str) -> None:
        refusal = Refusal(where or type(self.model).__name__, op, reason)
        if refusal not in self.state.refused:  # a site walked again (a part swapped on its own before) says it once
            self.state.refused.append(refusal)

    def counted(self, ops, new: bool = True) -> None:
        """A site installed (new) or extended for `ops`: each op counts it once."""
        for op in ops:
            self.state.counts[op] = self.state.counts.get(op, 0) + 1
        self.new += new

    def materialized(self, where: str, ops, module, device=None):
        """The device of `module`'s weights (or `device`); None (each op refused) when it has none
        to probe on."""
        device = device or probe.module_device(module)
        if device is None or device.type == "meta":
            for op in ops:
                self.refuse(where, op, META)
            return None
        return device

    def swapped(self, op: str, module, func) -> None:
        sites.install(self.state, module, sites.signed(func, type(module), op))
        self.counted((op,))

    def probe_and_swap(self, where: str, op: str, module, structure: tuple, run, forward, install=None,
                       device=None) -> None:
        """Swap `forward(verdict)` into `module` if the probe `run` (cached per op, class,
        activation dtype, device type and `structure`) gives a verdict; else refuse with its reason.
        A site with call-time data installs itself: `install(verdict)` instead. device: where the
        probe runs (default: the module's)."""
        device = self.materialized(where, (op,), module, device)
        if device is None:
            return
        verdict = _verdict((op, type(module), self.dtype, device.type, structure), run)
        if isinstance(verdict, str):
            self.refuse(where, op, verdict)
        elif install is not None:
            install(verdict)
            self.counted((op,))
        else:
            self.swapped(op, module, forward(verdict))

    def run(self) -> None:
        kinds = [(kind, [op for op in kind.ops if op in self.todo]) for kind in KINDS]
        kinds = [(kind, ops) for kind, ops in kinds if ops]
        for where, module in list(self.model.named_modules()):
            if module is self.model:
                continue
            swapped_before = sites.is_swapped(module)  # a kernel swap of an earlier call: only on-top kinds
            for kind, ops in kinds:
                if kind.on_top or not swapped_before:
                    self.guarded(where, ops, getattr(self, kind.step), module)
        if loss.OP in self.todo:
            self.loss()

    def guarded(self, where, ops, step, module) -> None:
        """Run one site's step; a read that raises (a per-layer configuration attribute, a module
        property) refuses that site with the error, never the swap."""
        try:
            step(where, module, ops)
        except Exception as exc:
            for op in ops:
                self.refuse(where, op, f"reading this site raised {type(exc).__name__}: {exc}")

    def lora(self, where, module, ops) -> None:
        there = lora.op_of(module)
        if there == tiled_mlp.OP:
            if lora.MLP_OP in ops and lora.SITE_ATTR not in module.__dict__:  # a LoRA site beneath it serves
                self.refuse(where, lora.MLP_OP, "the tiled MLP is installed already: ask for lora_mlp "
                                                "in the same call as (or before) tiled_mlp")
            return
        if there in lora.OPS:  # a LoRA site from an earlier call: it reads its ops at call time
            site = module.__dict__[lora.SITE_ATTR]
            for op in ops:
                if op not in site.ops and (op == lora.MLP_OP) == (there == lora.MLP_OP):
                    if op != lora.O_OP or site.names[1] is not None:
                        site.ops.add(op)
                        self.counted((op,), new=False)
            return
        if lora.MLP_OP in ops:
            found = lora.mlp_candidate(module)
            if isinstance(found, str):
                self.refuse(where, lora.MLP_OP, found)
            elif found is not None:
                names, act = found
                act_fn = mlp.activation(module)
                structure = (lora.structure(module, names), type(act_fn), getattr(act_fn, "approximate", None))
                self.probe_and_install(where, (lora.MLP_OP,), module, structure,
                                       lambda: lora.probe_mlp(module, self.dtype, names, act),
                                       lambda plan: (lora.mlp_forward, lora.Site((lora.MLP_OP,), names, plan, self.state.calls,
                                                                            act_fn)))
                return
        attention_ops = [op for op in ops if op in (lora.QKV_OP, lora.O_OP)]
        if attention_ops:
            found = lora.attention_candidate(module)
            if found is None:
                return
            inputs, out, reasons = found
            for op in [op for op in attention_ops if op in reasons]:
                self.refuse(where, op, reasons[op])
                attention_ops.remove(op)
            if not attention_ops:
                return
            groups = [inputs] * (lora.QKV_OP in attention_ops) + [(out,)] * (lora.O_OP in attention_ops)
            names = tuple(n for g in groups for n in g)

            def run():
                verdict = True
                for group in groups:
                    if verdict is True:
                        verdict = lora.probe_linears(module, self.dtype, group)
                return verdict

            self.probe_and_install(where, tuple(attention_ops), module, lora.structure(module, names), run,
                                   lambda _: (lora.attention_forward,
                                              lora.Site(attention_ops, (inputs, out), None, self.state.calls)))

    def probe_and_install(self, where, ops, module, structure, run, forward) -> None:
        """probe_and_swap for a LoRA site: `forward(verdict)` gives (function, Site); the site
        goes on top of what the module runs now and counts once per op it serves."""
        device = self.materialized(where, ops, module)
        if device is None:
            return
        verdict = _verdict((ops[0], type(module), self.dtype, device.type, structure), run)
        if isinstance(verdict, str):
            for op in ops:
                self.refuse(where, op, verdict)
            return
        try:
            func, site = forward(verdict)
        except switches.BadSwitch as exc:  # ACCEL_PATCH_LORA_PATH, read as the site is made
            for op in ops:
                self.refuse(where, op, f"BadSwitch: {exc}")
            return
        lora.install(self.state, module, sites.signed(func, type(module), ops[0]), site)
        self.counted(ops)

    def tiled(self, where, module, ops=(tiled_mlp.OP,)) -> None:
        if tiled_mlp.op_of(module) == tiled_mlp.OP:
            return
        found = tiled_mlp.candidate(module)
        if isinstance(found, str):
            self.refuse(where, tiled_mlp.OP, found)
        if found is None or isinstance(found, str):
            return
        names = tiled_mlp.projections(module)
        device = self.materialized(where, ops, module)
        if device is None:
            return
        beneath = tiled_mlp.op_of(module)  # the forward it tiles: stock, glu's or a LoRA site's
        key = (tiled_mlp.OP, type(module), self.dtype, device.type, (names, beneath, lora.structure(module, names)))
        verdict = _verdict(key, lambda: tiled_mlp.probe_verdict(module, self.dtype, names))
        if isinstance(verdict, str):
            self.refuse(where, tiled_mlp.OP, verdict)
            return
        tiled_mlp.install(self.state, module, tiled_mlp.Site(*found, self.state.calls, self.tiled_requested,
                                                             tiled_mlp.checkpoint_holders(self.model, where)))
        self.counted(ops)

    def candidate(self, where, op, found):
        """A candidate test's answer: what it found, else None (a reason is recorded as a refusal)."""
        if isinstance(found, str):
            self.refuse(where, op, found)
            return None
        return found

    def experts(self, where, module, ops=(experts.OP,)) -> None:
        found = self.candidate(where, experts.OP, experts.candidate(module))
        if found is None:
            return
        config = getattr(module, "config", None)
        act_fn = mlp.activation(module)
        structure = (found.names, found.biases, found.style, type(act_fn), getattr(act_fn, "approximate", None),
                     getattr(module, "alpha", None), tuple(probe.limits(module)),  # the probe's own reading
                     getattr(config, "_experts_implementation", None))
        def install(plan):  # a site with call-time data: its plan, the model's call counts
            experts.install(self.state, module, sites.signed(experts.forward, type(module), experts.OP),
                            experts.Site(plan, found.arg_names, self.state.calls, self.tiled_requested,
                                         tiled_mlp.checkpoint_holders(self.model, where)))

        self.probe_and_swap(where, experts.OP, module, structure,
                            lambda: experts.probe_verdict(module, self.dtype, found), None, install)

    def norm(self, where, module, ops=(norms.OP,)) -> None:
        form = norms.candidate(module)
        if form is None:
            reason = norms.refusal(module)
            if reason:
                self.refuse(where, norms.OP, reason)
            return
        device = norms.device(module, self.model)  # a weightless norm probes on the model's device
        swaps = self.new
        self.probe_and_swap(where, norms.OP, module, norms.structure(module, form),
                            lambda: norms.probe_verdict(module, self.dtype, form, device), norms.forward_for,
                            device=device)
        if self.new > swaps:  # where its calls without Triton are counted (restore deletes it)
            self.state.set(module, norms.CALLS_ATTR, norms.NormCalls(self.state.calls))

    def layer_norm(self, where, module, ops=(norms.LAYER_NORM_OP,)) -> None:
        if sites.is_swapped(module):  # an RMSNorm named LayerNorm (T5's), swapped by the step before
            return
        form = self.candidate(where, norms.LAYER_NORM_OP, norms.layer_norm_candidate(module))
        if form is None:
            return
        device = norms.device(module, self.model)  # torch.nn.LayerNorm(elementwise_affine=False): no parameter
        swaps = self.new
        self.probe_and_swap(where, norms.LAYER_NORM_OP, module, (form,),
                            lambda: norms.layer_norm_verdict(module, self.dtype, form, device),
                            norms.layer_norm_forward_for, device=device)
        if self.new > swaps:  # where its calls without Triton are counted (restore deletes it)
            self.state.set(module, norms.CALLS_ATTR, norms.NormCalls(self.state.calls))

    def glu(self, where, module, ops=(mlp.OP,)) -> None:
        found = self.candidate(where, mlp.OP, mlp.site_candidate(module))
        if found is None:
            return
        names, act = found
        act_fn = mlp.activation(module)
        # the limits it names change the function within a class: part of the verdict's key
        structure = (names, type(act_fn), getattr(act_fn, "approximate", None), tuple(sorted(set(probe.limits(module)))))
        swaps = self.new
        self.probe_and_swap(where, mlp.OP, module, structure,
                            lambda: mlp.probe_verdict(module, self.dtype, names, act), mlp.forward_for)
        if self.new > swaps:  # where the forward counts its norm recomputes (restore deletes it)
            self.state.set(module, mlp.COUNTER_ATTR, norms.RecomputeCounter(self.state.calls))

    def rope(self, where, module, ops=(rope.OP,)) -> None:
        never = rope.never_rotates(module, self.builds_no_positions(where))
        if never:
            self.refuse(where, rope.OP, never)
            return
        reason = rope.complex_refusal(module)
        if reason:
            self.refuse(where, rope.OP, reason)
            return
        fn = rope.rope_function(module, self.config)
        if fn is None:
            return
        shape = rope.head_shape(module, self.config)
        swaps = self.new
        self.probe_and_swap(where, rope.OP, module, (fn, shape),
                            lambda: rope.probe_verdict(fn, module, self.config, self.dtype), self.rope_forward)
        if self.new > swaps:
            self.rope_site(module, fn)

    def builds_no_positions(self, where: str) -> bool:
        """Whether the model around `where` builds no cos/sin tables: an enclosing module's
        `rotary_emb` is None (Granite 4 hybrid without `position_embedding_type="rope"`)."""
        parts = where.split(".")
        for i in range(len(parts) - 1, -1, -1):
            owner = self.model.get_submodule(".".join(parts[:i])) if i else self.model
            if "rotary_emb" in owner.__dict__ or "rotary_emb" in owner._modules:
                return getattr(owner, "rotary_emb") is None
        return False

    def rope_forward(self, plan: rope.RopePlan):
        """Hold the module global of `plan` for this model (once), then the attention forward for it."""
        fn = plan.key
        if fn not in self.rope_held:
            # the model's own hold: copied and pickled with its state, counted down when it is collected
            self.state.releases.append(rope.Hold(plan).release)
            self.rope_held.add(fn)
        return rope.forward_for(fn)

    def rope_site(self, module, fn) -> None:
        """Where the swapped attention counts its calls (restore deletes it with the forward)."""
        self.state.set(module, rope.SITE_ATTR, rope.Site(self.state.calls, fn[1]))

    def loss(self) -> None:
        model = self.model
        if not callable(getattr(model, "get_output_embeddings", None)) or model.get_output_embeddings() is None:
            return  # no LM head: nothing to fuse
        reason = loss.candidate(model)
        if reason is None and not self.top_level:
            reason = ("the model is already prepared (wrapped for training): the fused loss needs its "
                      "top-level forward; swap before accelerator.prepare / Trainer.train")
        if reason is None:
            leaf = loss.head_leaf(model.get_output_embeddings())
            device = leaf.weight.device
            if device.type == "meta":
                reason = META
            else:
                key = (loss.OP, type(leaf), leaf.weight.dtype, device.type, leaf.bias is not None)
                verdict = _verdict(key, lambda: loss.probe_verdict(model))
                reason = None if verdict is True else verdict
        if reason:
            self.refuse(sites.head_name(self.model), loss.OP, reason)
        else:
            self.swapped(loss.OP, model, loss.forward)
            compiled_loss.prepare(self.state, leaf)  # the head's forward while torch.compile traces


def swap(model, ops=None, *, top_level: bool = True) -> SwapReport:
    """See `accel_patch.swap_kernels`. `top_level=False` leaves the model's own forward alone
    (after the model was prepared), so the fused loss is refused."""
    todo_all = resolve_ops(ops)
    tiled_requested = ops is not None and tiled_mlp.OP in todo_all  # named, not the default (tiled_mlp.py)
    target = unwrap(model)
    rope.interceptions.sweep()  # RoPE globals whose models were collected go back now
    state = target.__dict__.get(sites.STATE_ATTR)
    if state is None:
        state = sites.SwapState()
    if _absorb_parts(target, state):
        target.__dict__[sites.STATE_ATTR] = state
    # A site refused for weights on the meta device is decided again once they are there (a model
    # built under init_empty_weights or on "meta", then loaded): its op is walked again.
    waiting = {r.op for r in state.refused if r.reason == META}
    if waiting:
        state.refused[:] = [r for r in state.refused if r.reason != META]
    todo = tuple(op for op in todo_all if op not in state.ops or op in waiting)
    if todo:
        walk = _Walk(target, state, todo, top_level, tiled_requested)
        target.__dict__[sites.STATE_ATTR] = state
        try:
            walk.run()
        except BaseException:
            _restore(target)  # never leave a half-swapped model behind
            raise
        state.ops.update(todo)
        new = walk.new
    else:
        new = 0
    if tiled_requested:  # sites installed by an earlier default call tile every long call from now on
        tiled_mlp.request(target)
    report = SwapReport(type(target).__name__, state.counts, state.refused, new=new, head=state.head,
                        calls=state.calls, waiting=waiting_for_adapters(target), mixers=mixers.census(target))
    if todo:
        _history.record(target, report)
        if report.swapped or report.refused or report.mixers:
            log.info("accel_patch: %s", report.summary())
    return report


def _absorb_parts(target, state: sites.SwapState) -> bool:
    """One swap state per top-level model, whoever swapped its parts first: a part swapped on its
    own before (a VLM's language model, by `swap_kernels` or an older load hook) hands its state to
    `target`'s, so `report(model)` holds every site and call and restore undoes them all."""
    absorbed = False
    for where, module in target.named_modules():
        part = module.__dict__.get(sites.STATE_ATTR) if module is not target else None
        if part is not None:
            del module.__dict__[sites.STATE_ATTR]
            state.absorb(part, where, list(module.modules()))
            _history.forget(module)
            absorbed = True
    return absorbed


def waiting_for_adapters(target) -> dict[str, int]:
    """LoRA op -> sites of `target` with no PEFT LoRA layer under them (yet): not swapped in effect."""
    waiting: dict[str, int] = {}
    for module in target.modules():
        for op in lora.waiting_ops(module):
            waiting[op] = waiting.get(op, 0) + 1
    return waiting


def report_of(model) -> SwapReport | None:
    """See `accel_patch.report`: the swap report of `model` as it stands now (adapters added since
    the swap, whose head a trainer runs), with its live call counts; None when it has no kernels."""
    target = unwrap(model)
    state = target.__dict__.get(sites.STATE_ATTR)
    through_interface = experts_interface.calls(target)  # experts_implementation="accel_patch"
    if state is None:
        if not through_interface:
            return None
        return SwapReport(type(target).__name__, {}, [], calls={experts.OP: through_interface})
    state.adopt_copies(target.modules())
    calls = state.calls
    if through_interface:
        calls = {op: dict(outcomes) for op, outcomes in state.calls.items()}
        for outcome, n in through_interface.items():
            calls.setdefault(experts.OP, {})[outcome] = calls.get(experts.OP, {}).get(outcome, 0) + n
    return SwapReport(type(target).__name__, state.counts, state.refused, head=state.head, calls=calls,
                      waiting=waiting_for_adapters(target), mixers=mixers.census(target),
                      replaced=replaced_sites(target, state))


def replaced_sites(target, state: sites.SwapState) -> list[tuple[str, str, str]]:
    """(where, op, by whom) of the sites of `target` whose forward was rebound after the swap. The
    loss site's forward is TRL's business when TRL installed its head (the report's `head` says so)."""
    found = state.replaced()
    if not found:
        return []
    names = {id(m): n for n, m in target.named_modules()}
    return [(names.get(id(obj)) or type(target).__name__, op, by) for obj, op, by in found
            if not (op == loss.OP and state.head is not None)]


def _restore(target) -> list[str]:
    state = target.__dict__.pop(sites.STATE_ATTR, None)
    kept = state.undo() if state is not None else []
    # Copies of swapped modules made after the swap (PEFT's modules_to_save, deepcopy of a layer)
    # carry the swapped forward without an undo entry: put their stock forward back too.
    for module in target.modules():
        for slot in ("forward", "_old_forward"):
            while True:  # a LoRA site may sit on top of another swap's forward
                bound = module.__dict__.get(slot)
                op = getattr(getattr(bound, "__func__", None), sites.MARK, None)
                if op is None:
                    break
                kind = KIND_OF.get(op)  # the loss site (the model's forward) keeps sites.INNER_ATTR
                if kind is not None and kind.site_attr is not None:
                    module.__dict__.pop(kind.site_attr, None)
                inner = module.__dict__.pop(kind.inner_attr if kind is not None else sites.INNER_ATTR, None)
                if inner is not None:
                    module.__dict__[slot] = inner
                else:
                    del module.__dict__[slot]
    return kept


def restore(model) -> bool:
    """See `accel_patch.restore_kernels`."""
    target = unwrap(model)
    swapped = sites.STATE_ATTR in target.__dict__
    kept = _restore(target)
    rope.interceptions.sweep()
    _history.forget(target)
    if kept:
        log.warning("accel_patch: restore_kernels(%s): %s were wrapped again after the swap and were left "
                    "as they are (they call the stock computation now)", type(target).__name__, ", ".join(kept))
    return swapped


def rebind_after_kernelize(model) -> int:
    """Put the swap back on top of the hub-kernel layers of `model` (a transformers model) after
    transformers kernelized it again: a model loaded with its hub kernels on (transformers' default
    when the `kernels` package is installed) is kernelized at every train()/eval() switch, which
    binds the hub kernel or the class's forward on each `use_kernel_forward_from_hub` layer (the
    RMSNorms) and would drop the swapped forward there for the rest of the run. What kernelize
    bound becomes the forward beneath the swap (its fall-back, and what restore puts back): the
    stock computation of that mode. Returns how many forwards were bound again."""
    state = model.__dict__.get(sites.STATE_ATTR)
    if state is None:
        return 0

    def hub_layer(module) -> bool:
        return getattr(type(module), "kernel_layer_name", None) is not None

    def inner_attr(op: str) -> str:
        kind = KIND_OF.get(op)
        return kind.inner_attr if kind is not None else sites.INNER_ATTR

    return state.rebind(hub_layer, inner_attr)


class _History:
    """The swaps of this process, for `accel_patch.status()`."""

    def __init__(self) -> None:
        import weakref

        self._live = weakref.WeakKeyDictionary()
        self.last: SwapReport | None = None

    def record(self, model, report: SwapReport) -> None:
        self._live[model] = report
        self.last = report

    def forget(self, model) -> None:
        self._live.pop(model, None)

    def summary(self) -> str | None:
        if not self._live:
            return None
        n = len(self._live)
        return f"kernels swapped into {n} live model(s); last: {self.last.summary()}"


_history = _History()


def history_summary() -> str | None:
    return _history.summary()
