"""transformers' experts interface: `experts_implementation="accel_patch"` runs the experts op.

transformers 5.x dispatches the forward of its `use_experts_implementation` classes through
`config._experts_implementation` (eager, batched_mm, grouped_mm, ...; `from_pretrained(...,
experts_implementation=...)`, `model.set_experts_implementation(...)`). accel-patch registers
`accel_patch` there (patches/experts_interface.py), so a user who wants the experts kernel
without the swap asks for it as transformers documents. It is the swap's experts site, made on
each module's first call: the same candidate test and probe (cached per class, dtype and
device), the same forward (`site.forward`: the op, PEFT's LoRA as split LoRA, the tiled MLP's
rule, counted), and the same refusals. What the op does not run, and a module the probe refuses,
runs transformers' grouped_mm where it dispatches (else eager): the forward the user would have
had. A module the swap already swapped never reaches the interface (its instance forward runs).

Counted in the module's own call table, which `accel_patch.report(model)` reads with the swap's
(`calls()`): "fused", "fused (LoRA)", or what ran and why. In eager mode only: while torch.compile
traces, a module the swap did not swap runs the stock forward, counted once per traced module
as such, into a table all of the model's experts share (their config's: `_count_traced`), so that
layers compiled one by one share one graph (the swap's sites are the way to the op under compile).
"""
from __future__ import annotations

import threading
import weakref

import torch

from .. import probe, sites
from . import site as experts_site

NAME = experts_site.INTERFACE_NAME
#: Instance attribute of a module the interface refused: the reason (probed once per module).
REFUSED_ATTR = "_accel_patch_experts_refused"
REFUSED = "the module's forward (grouped_mm, else eager): the experts probe refused it"
COMPILING = "the module's forward (grouped_mm, else eager): traced by torch.compile (swap the model for the op)"
#: Instance attribute: the interface's own outcomes of a module (refused, compiled).
CALLS_ATTR = "_accel_patch_experts_calls"


class _Inside(threading.local):
    depth = 0  # > 0 while our forward or the probe runs the module's own forward


_inside = _Inside()


def _stock(module, hidden, index, weights):
    """What the module runs without us: transformers' grouped_mm where it takes the module, else eager."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
    except ImportError:
        grouped_mm_experts_forward = None
    if grouped_mm_experts_forward is not None and hasattr(torch, "_grouped_mm") and hidden.dtype != torch.float64:
        try:
            return grouped_mm_experts_forward(module, hidden, index, weights)
        except (RuntimeError, NotImplementedError, TypeError):
            pass
    eager = getattr(type(module).forward, "__wrapped__", None)  # use_experts_implementation keeps the original
    return eager(module, hidden, index, weights)


def _prepared(module, dtype: torch.dtype):
    """The module's experts site, made on its first call (None, with the reason kept, if refused)."""
    site = module.__dict__.get(experts_site.SITE_ATTR)
    if site is not None or REFUSED_ATTR in module.__dict__:
        return site
    found = experts_site.candidate(module)
    reason = found if isinstance(found, str) else None if found is not None else "not an experts module"
    if reason is None:
        device = probe.module_device(module)
        key = (experts_site.OP, type(module), dtype, device.type, (found.names, found.biases, found.style), NAME)
        verdict = probe.cache.get_or_probe(key, lambda: _probe(module, dtype, found))
        if isinstance(verdict, str):
            reason = verdict
        else:
            from ...core import switches

            try:  # the site reads the experts' switches: a bad value refuses it, as at the swap
                site = experts_site.Site(verdict, found.arg_names, {})
            except switches.BadSwitch as exc:
                reason = f"BadSwitch: {exc}"
            else:
                site.interface = True  # its calls are the module's own, not a swapped model's
                module.__dict__[experts_site.SITE_ATTR] = site
                return site
    module.__dict__[REFUSED_ATTR] = reason
    return None


def _probe(module, dtype, found):
    try:
        return experts_site.probe_verdict(module, dtype, found)
    except Exception as exc:
        return f"probe failed: {type(exc).__name__}: {exc}"


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The `accel_patch` experts implementation (see the module docstring)."""
    if sites.compiling():
        _count_own(self, COMPILING)
        return _stock(self, hidden_states, top_k_index, top_k_weights)
    if _inside.depth:  # the module's own forward, asked for by the op's fall-back or by the probe
        return _stock(self, hidden_states, top_k_index, top_k_weights)
    _inside.depth += 1
    try:
        site = _prepared(self, hidden_states.dtype)
        if site is None:
            _count_own(self, REFUSED)
            return _stock(self, hidden_states, top_k_index, top_k_weights)
        return experts_site.forward(self, hidden_states, top_k_index, top_k_weights)
    finally:
        _inside.depth -= 1


def _count_eager(module, outcome: str) -> None:
    sites.count_into(module.__dict__, CALLS_ATTR, outcome)  # the module's own table, CALLS_ATTR


#: The calls counted while dynamo traces, per model config (by id; dropped with the config): one
#: table every experts module of a model shares, as transformers gives each the model's config.
_traced_tables: dict[int, dict] = {}


@torch.compiler.assume_constant_result
def _count_traced(config_id: int, outcome: str) -> bool:
    """Once per compiled graph (dynamo keeps the result, not the call): sites.count's rule. The
    table is the modules' config's, by id, not each module's: a guard on each module's identity
    would trace every layer compiled on its own (`layer.compile()`) anew, and past dynamo's
    recompile limit fail them (fullgraph) or run them eagerly, where stock's layers share one graph."""
    table = _traced_tables.get(config_id)
    if table is None:
        table = _traced_tables[config_id] = {}
        weakref.finalize(sites.traced_object(config_id), _traced_tables.pop, config_id, None)
    sites.traced_count_into(table, CALLS_ATTR, "compiled: " + outcome)
    return True


def _count_own(module, outcome: str) -> None:
    if sites.compiling():
        _count_traced(id(module.config), outcome)  # use_experts_implementation sets `config` on each
    else:
        _count_eager(module, outcome)


def calls(model) -> dict[str, int]:
    """The interface's calls in `model`'s experts modules, outcome -> calls (the swap's own sites,
    whose tables are the model's, are not counted twice)."""
    total: dict[str, int] = {}
    configs = set()
    for module in model.modules():
        tables = [module.__dict__.get(CALLS_ATTR)]
        config = module.__dict__.get("config")
        if config is not None and id(config) not in configs and id(config) in _traced_tables:
            configs.add(id(config))
            tables.append(_traced_tables[id(config)].get(CALLS_ATTR))
        site = module.__dict__.get(experts_site.SITE_ATTR)
        if site is not None and module.__dict__.get(REFUSED_ATTR) is None and getattr(site, "interface", False):
            tables.append(site.calls.get(experts_site.OP))
        for table in tables:
            for outcome, n in (table or {}).items():
                total[outcome] = total.get(outcome, 0) + n
    return total
