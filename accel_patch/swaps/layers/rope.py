"""RoPE sites: attention modules whose forward calls a module-level RoPE function.

Attention forwards call `apply_rotary_pos_emb` (MLA attentions `apply_rotary_pos_emb_interleave`,
`families.INTERLEAVED_ROPE_FUNCTIONS`) through their modeling module's globals, so the
kernel can only get in by intercepting that global. The interception is shared by every model of
the family and transparent for those not swapped: the global becomes a dispatcher that runs the
kernel only inside the forward of an attention module that was swapped, and the original function
everywhere else, with the very same arguments.

Every swapped model holds what its kernel needs: its SwapState owns one `Hold` per global it
swapped, and `interceptions` counts the holds. A hold is copied with the model (`copy.deepcopy`)
and pickled with it (`torch.save`, multiprocessing): the copy, or the model loaded in another
process, acquires its own, so it runs the kernel whatever becomes of the original. When the last
hold is released by `restore_kernels`, the original object goes back at once. A hold whose model
was collected without a restore only counts down: the global goes back at the next swap or
restore (`Interceptions.sweep`). A collection can happen at any allocation, also while dynamo
compiles a frame of another model that called the dispatcher as a pass-through, and changing the
global between that trace and its guards crashes the compile (the guards read the dispatcher's
closure).

How the dispatcher knows it is inside a swapped attention forward: a depth counter per global
(`Gate`), raised by the swapped forward around the stock one. In eager mode the counter is
thread-local (another thread running a bystander of the family at the same moment sees its own
depth, 0); while dynamo traces, a count per trace is raised, lowered and read at trace time, by
functions whose results are constants of the graph (`_traced_step`, `_traced_depth`): dynamo
cannot trace a ContextVar or a `threading.local`, and refuses a write to a Python object inside a
higher-order op's body (a swapped layer under non-reentrant gradient checkpointing). The graph
holds the kernel's op and nothing of the count, and guards on nothing of it; a trace dynamo
abandons (a graph break, a restart) leaves its count under its own trace id.

The probe calls the original function and `accel_kernels.rope` on random q, k, cos, sin with the
attention's head counts and head dim (full and partial rotary, where the function accepts them),
with cos/sin in q's dtype and in float32 (what rotary embeddings that compute in float32 hand
over): values, dtypes and shapes must all match. Some families (Olmo, Olmo2) compute in the
promoted dtype and cast back to q's and k's dtypes; the probe sees that and the site casts back
too (`RopePlan.cast_back`). The kernel rotates six layouts (`accel_kernels.ops.rope.FORMS`):
rotate-half, DeepSeek's interleave (pairs in, halves out: `apply_rotary_pos_emb_interleave`),
GPT-J pairs (ERNIE 4.5, GLM), DeepSeek's interleave as transformers 4 wrote it (on the whole
table), GPT-J pairs on the last dims of each head (DeepSeek V4) and the complex form (below);
the probe tries the real ones in that order and keeps the first that matches
everywhere (`RopePlan.form`); a function that matches none (Cohere's full-width interleaved table)
is refused with that reason. An MLA forward names both
functions: `rope_interleave` (False) picks the rotate-half one, else the interleave one is
intercepted. A function that takes `unsqueeze_dim` is probed on (B, S, H, D) tensors too
(`RopePlan.bshd`: the indexers of DeepSeek V3.2 and its heirs call it so), and with k=None
(`q_alone`: Mistral Large 4's query-only call); a function of three tensors, `f(x, cos, sin)`
(Gemma 4), is the one-tensor form (`one_tensor`): the kernel rotates x alone.
Some families (gpt-oss) hand over half-width tables, `cos[..., :r/2]`, and rotate each half by
them (`x1 * cos - x2 * sin`, `x2 * cos + x1 * sin`): that is rotate-half RoPE on the table
repeated twice, `cat(cos, cos)`. When the function takes no full-width table the probe tries
half-width ones against the kernel on the widened tables, and the dispatcher widens them for the
kernel (`RopePlan.half_tables`); a table repeated twice costs a copy of `[batch, seq, r]`, not of
q or k.

On CPU without Triton (`accel_kernels._dispatch.use_triton` false) the dispatcher calls the
original function: the kernel's plain-torch twin computes the same thing more slowly there.

Every eager call of a swapped attention is counted in the model's `calls["rope"]`, and each compiled
graph of one once, as "compiled: <outcome>" (what that graph runs at every call), as the other
sites count: "fused" when
the kernel ran, else what ran instead and why (the function itself for a (B, S, H, D) or k=None
call the probe did not prove, a call it cannot bind, no Triton; "another function" when the
forward never reached the dispatcher).

A complex RoPE function (Llama 4's and DeepSeek V2's `apply_rotary_emb(xq, xk, freqs_cis)`,
`families.COMPLEX_ROPE_FUNCTIONS`) multiplies q and k, viewed as complex numbers, by the table:
GPT-J pairs with cos and sin the table's real and imaginary parts. The dispatcher hands the
kernel's "complex" form `view_as_real(freqs_cis).flatten(-2)`, a view of the table the model
built once per forward, as both cos and sin: no copy, nothing derived per layer. The probe finds
where the function broadcasts the table over the heads (`RopePlan.complex_dim`: (B, S, H, D) for
Llama 4, (B, H, S, D) for DeepSeek V2) by trying both layouts (`_probe_complex`).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import weakref
from _thread import RLock
from collections import namedtuple

import torch

from .. import families, probe, sites
from . import norms

OP = "rope"
#: A call's outcomes (the model's calls["rope"]; report.outcome_kind reads them).
FUSED = "fused"
NO_TRITON = "stood aside: no Triton for these tensors (the function itself)"
UNSQUEEZE_2 = "(B, S, H, D) call (unsqueeze_dim=2) the probe did not prove: the function itself"
K_NONE = "a call with k=None (q alone) the probe did not prove: the function itself"
NOT_PLAIN = "not a plain (q, k, cos, sin) call: the function itself"
SHAPE = "a shape the kernel does not take: the function itself"
#: Instance attribute of a swapped attention: its `Site` (where its calls are counted).
SITE_ATTR = "_accel_patch_rope_site"


class Site(sites.CountingSite):
    """What a swapped attention's forward counts into: the model's call table."""

    OP = OP  # what it counts under (sites.count while dynamo traces)

    def __init__(self, calls, name: str) -> None:
        self.calls, self.name = calls, name

    def norm_recomputed(self) -> None:
        """One recompute of the input norm's output in backward (norms.recompute_scope)."""
        sites.count_into(self.calls, norms.OP, norms.RECOMPUTED)

    def count(self, outcome: str) -> None:
        sites.count_into(self.calls, OP, outcome)




class RopePlan(namedtuple("RopePlan", "key cast_back half_tables form bshd q_alone one_tensor partial complex_dim",
                          defaults=(False, "half", False, False, False, True, 0))):
    """key: (modeling module, function name) of the global; cast_back: the function returns q's and
    k's own dtypes (it casts the promoted result back), so the site casts the kernel's back too;
    half_tables: the function takes cos/sin of half the rotary width, which the kernel gets
    repeated twice (see the module docstring); form: the layout the kernel rotates
    (`accel_kernels.ops.rope.FORMS`); bshd: (B, S, H, D) calls (unsqueeze_dim=2) were proved too;
    q_alone: calls with k=None were proved too; one_tensor: the function rotates one tensor per
    call, `f(x, cos, sin)`; partial: it takes heads wider than the tables (partial rotary), else
    such a call runs the function (which raises, as stock does) and not the kernel; complex_dim:
    for a complex function `f(q, k, freqs_cis)` (form "complex"), the dim of q and k where it
    broadcasts the table over the heads (1: (B, H, S, D), DeepSeek V2; 2: (B, S, H, D), Llama 4),
    else 0."""

    __slots__ = ()


class _Depth:
    """A gate's depth while dynamo traces: read and written at trace time only (`_traced_step`),
    per trace (`trace`: the id of the trace it counts)."""

    def __init__(self) -> None:
        self.depth = 0
        self.trace = ""


class _LocalDepth(threading.local):
    depth = 0
    ran = 0  # dispatches that ran the kernel (eager only: counted per call of a swapped forward)
    fell = 0  # dispatches that ran the original function, the last one's reason in `why`
    why = ""


class Gate:
    """How many swapped attention forwards of one RoPE global are running: a thread-local count in
    eager mode, a count per trace while dynamo traces (see the module docstring)."""

    def __init__(self, key: tuple[str, str]) -> None:
        self.key = key
        self.local = _LocalDepth()
        self.traced = _Depth()

    def counter(self):
        return self.traced if sites.compiling() else self.local

    def is_open(self) -> bool:
        if sites.compiling():
            return _traced_depth(self.key) > 0
        return self.local.depth > 0


def _trace() -> str:
    """The trace dynamo is making now (its compile id and attempt), "" outside one."""
    from torch._guards import CompileContext

    current = CompileContext.current_trace_id()
    return "" if current is None else str(current)


@torch.compiler.assume_constant_result
def _traced_depth(key: tuple[str, str]) -> int:
    """The depth of `key`'s gate in the trace under way, read at trace time (a constant of the graph)."""
    depth = gate(key).traced
    return depth.depth if depth.trace == _trace() else 0


@torch.compiler.assume_constant_result
def _traced_step(key: tuple[str, str], by: int) -> bool:
    """Raise (1) or lower (-1) the depth of `key`'s gate in the trace under way, at trace time: the graph
    carries nothing of it, and dynamo sees no write to a Python object, which it refuses inside a
    higher-order op's body (a non-reentrant checkpoint's, a swapped layer under gradient
    checkpointing). A trace that dynamo abandons (a graph break, a restart) leaves its count
    behind under its own id: the next trace starts from 0."""
    depth = gate(key).traced
    now = _trace()
    if depth.trace != now:
        depth.trace, depth.depth = now, 0
    depth.depth += by
    return True


_gates: dict[tuple[str, str], Gate] = {}
_gates_lock = RLock()


def gate(key: tuple[str, str]) -> Gate:
    """The one gate of a RoPE global (kept for the process, shared by every dispatcher of it)."""
    with _gates_lock:
        if key not in _gates:
            _gates[key] = Gate(key)
        return _gates[key]


def _forward_names(module) -> tuple:
    try:
        return inspect.unwrap(type(module).forward).__code__.co_names
    except (AttributeError, ValueError):
        return ()


def complex_refusal(module) -> str | None:
    """Why an attention whose forward calls a complex-number RoPE function (Llama 4's
    `apply_rotary_emb(xq, xk, freqs_cis)`) is refused before any probe, else None: the function
    is not a global of the forward's modeling module, so it cannot be intercepted. (One that is
    goes to the probe, which proves it against the kernel's "complex" form or refuses it.)"""
    names = _forward_names(module)
    named = [n for n in families.COMPLEX_ROPE_FUNCTIONS if n in names]
    if not named or any(n in names for n in families.ROPE_FUNCTIONS + families.INTERLEAVED_ROPE_FUNCTIONS):
        return None
    owner = sys.modules.get(inspect.unwrap(type(module).forward).__module__)
    if owner is not None and callable(owner.__dict__.get(named[0])):
        return None
    return (f"calls {named[0]} (complex RoPE: q and k viewed as complex numbers times freqs_cis), which is not "
            f"a function of its modeling module: it cannot be intercepted")


#: Refusal of an attention whose forward never rotates (`never_rotates`): not a RoPE site.
NEVER_ROTATES = "never rotates: not a RoPE site"
_UNKNOWN = object()
#: The forward's argument that carries the (cos, sin) tables (None when the model builds none).
_POSITIONS_ARGUMENT = "position_embeddings"
_call_guards: dict[type, list] = {}


def _guards_of(cls) -> list:
    """Per call of a RoPE function in `cls.forward`: the `if` tests around it, each (test, branch
    taken: True for the body, False for the else), from the forward's source; [] without source."""
    if cls in _call_guards:
        return _call_guards[cls]
    import ast
    import textwrap

    names = set(families.ROPE_FUNCTIONS + families.INTERLEAVED_ROPE_FUNCTIONS + families.COMPLEX_ROPE_FUNCTIONS)
    found: list = []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError, AttributeError):
        tree = None

    def visit(node, guards):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            found.append(list(guards))
        if isinstance(node, ast.If):
            visit(node.test, guards)
            for child in node.body:
                visit(child, guards + [(node.test, True)])
            for child in node.orelse:
                visit(child, guards + [(node.test, False)])
            return
        for child in ast.iter_child_nodes(node):
            visit(child, guards)

    if tree is not None:
        visit(tree, [])
    _call_guards[cls] = found
    return found


def _value(node, module, no_positions: bool):
    """The value of a guard's expression for this module: attributes of `self`, constants,
    comparisons, and/or/not; `_UNKNOWN` for anything else (an argument, a call, a subscript)."""
    import ast

    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id == "self":
            return module
        return None if node.id == _POSITIONS_ARGUMENT and no_positions else _UNKNOWN
    if isinstance(node, ast.Attribute):
        owner = _value(node.value, module, no_positions)
        if owner is _UNKNOWN or node.attr == "training":  # train/eval changes after the swap
            return _UNKNOWN
        try:
            value = getattr(owner, node.attr)
        except Exception:
            return _UNKNOWN
        return value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        value = _truth(_value(node.operand, module, no_positions))
        return _UNKNOWN if value is _UNKNOWN else not value
    if isinstance(node, ast.BoolOp):
        values = [_truth(_value(v, module, no_positions)) for v in node.values]
        stop = isinstance(node.op, ast.Or)  # or: any True decides; and: any False decides
        if stop in values:
            return stop
        return _UNKNOWN if _UNKNOWN in values else not stop
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = _value(node.left, module, no_positions), _value(node.comparators[0], module, no_positions)
        if a is _UNKNOWN or b is _UNKNOWN:
            return _UNKNOWN
        if isinstance(node.ops[0], (ast.Is, ast.IsNot)):  # `self.rotary_emb is not None`: any object
            return (a is b) == isinstance(node.ops[0], ast.Is)
        if not all(isinstance(v, (bool, int, float, str, type(None))) for v in (a, b)):
            return _UNKNOWN
        compare = {ast.Is: lambda: a is b, ast.IsNot: lambda: a is not b, ast.Eq: lambda: a == b,
                   ast.NotEq: lambda: a != b}.get(type(node.ops[0]))
        return compare() if compare else _UNKNOWN
    return _UNKNOWN


def _truth(value):
    return bool(value) if isinstance(value, (bool, int, float, str, type(None))) else _UNKNOWN


def never_rotates(module, no_positions: bool = False) -> str | None:
    """Why an attention never rotates, else None: every call of a RoPE function in its forward sits
    under an `if` that is False for this module, read from its attributes (EXAONE 4's global layers,
    `self.sliding_window is None or self.is_sliding`; a `use_rope` False: Mistral Large 4's and
    Llama 4's no-RoPE layers), or under `if position_embeddings is not None` in a model that builds
    no tables (`no_positions`: Granite 4 hybrid with `position_embedding_type` unset). A condition
    it cannot evaluate (an argument, a call) leaves the module a candidate: its calls are counted."""
    import ast

    names = _forward_names(module)
    if not any(n in names for n in families.ROPE_FUNCTIONS + families.INTERLEAVED_ROPE_FUNCTIONS
               + families.COMPLEX_ROPE_FUNCTIONS):
        return None  # no RoPE function named: no source to read (every other module of the walk)
    calls = _guards_of(type(module))
    if not calls:
        return None
    why = []
    for guards in calls:
        false = next((test for test, branch in guards
                      if _truth(_value(test, module, no_positions)) is (not branch)), None)
        if false is None:
            return None
        why.append(ast.unparse(false))
    said = "; ".join(dict.fromkeys(why))
    return f"{NEVER_ROTATES}: its forward rotates only when `{said}`, which is false for this layer" + (
        " (the model builds no cos/sin tables)" if no_positions and _POSITIONS_ARGUMENT in said else "")


def _rope_interleave(module, config):
    """The attention's `rope_interleave` (MLA attentions pick their RoPE function by it), else None."""
    for owner in (probe.layer_config(config, module) if config is not None else None, getattr(module, "config", None)):
        try:
            value = getattr(owner, "rope_interleave", None) if owner is not None else None
        except Exception:
            value = None
        if value is not None:
            return value
    return None


def rope_function(module, config=None) -> tuple[str, str] | None:
    """(modeling module name, function name) of the RoPE global the module's forward calls, else
    None. An MLA attention names both the rotate-half and the interleave function and calls the
    latter unless its `rope_interleave` is False."""
    names = _forward_names(module)
    if not names:
        return None
    owner = sys.modules.get(inspect.unwrap(type(module).forward).__module__)
    if owner is None:
        return None
    found = [n for n in families.ROPE_FUNCTIONS + families.INTERLEAVED_ROPE_FUNCTIONS + families.COMPLEX_ROPE_FUNCTIONS
             if n in names and callable(owner.__dict__.get(n))]
    interleaved = [n for n in found if n in families.INTERLEAVED_ROPE_FUNCTIONS]
    plain = [n for n in found if n in families.ROPE_FUNCTIONS]
    if interleaved and not (plain and _rope_interleave(module, config) is False):
        return owner.__name__, interleaved[0]
    if plain:
        return owner.__name__, plain[0]
    return (owner.__name__, found[0]) if found else None  # a complex function, named alone


class Interceptions:
    """The module globals replaced by dispatchers, with how many holds (swapped models) each has."""

    def __init__(self) -> None:
        self._lock = RLock()
        self._held: dict[tuple[str, str], list] = {}  # key -> [original, dispatcher, count, plan]

    def original(self, key: tuple[str, str]):
        """The function the global held before any swap (the global itself when not intercepted)."""
        with self._lock:
            if key in self._held:
                return self._held[key][0]
            module_name, name = key
            return sys.modules[module_name].__dict__[name]

    def acquire(self, plan: RopePlan) -> None:
        """Put the dispatcher in place (first holder) and count one more holder (see `Hold`).
        `plan`: the probe's findings for this function (its key among them).

        A later holder whose probe proved calls the held plan did not (`_widened`: partial rotary,
        (B, S, H, D) calls, k=None) puts a dispatcher of the wider plan in the global's place: the
        function is one for every model of the family, so a second model (a Phi-4-mini beside a
        Phi-3, partial rotary beside full) runs the kernel as it would alone."""
        key = plan.key
        with self._lock:
            self._sweep(keep=key)
            module_name, name = key
            owner = sys.modules.get(module_name) or importlib.import_module(module_name)  # a model loaded first
            if key not in self._held:
                original = owner.__dict__[name]
                dispatcher = _dispatcher(plan, original)
                owner.__dict__[name] = dispatcher
                self._held[key] = [original, dispatcher, 0, plan]
            entry = self._held[key]
            wider = _widened(entry[3], plan)
            # (someone else replaced the global after us: theirs stays, calling the held dispatcher)
            if wider != entry[3] and owner.__dict__.get(name) is entry[1]:
                entry[1] = owner.__dict__[name] = _dispatcher(wider, entry[0])
                entry[3] = wider
            entry[2] += 1

    def release(self, key: tuple[str, str]) -> None:
        """One holder fewer (restore_kernels); the last one puts the original object back."""
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry[2] -= 1
            self._sweep()

    def dropped(self, key: tuple[str, str]) -> None:
        """One holder fewer because its model was collected: counted, the global left for the
        next swap or restore (a collection may run while dynamo compiles; see the module docstring)."""
        with self._lock:
            entry = self._held.get(key)
            if entry is not None:
                entry[2] -= 1

    def sweep(self) -> None:
        """Put back the original of every global no model holds any more (apply.py: at every swap
        and restore, where no compile is running)."""
        with self._lock:
            self._sweep()

    def _sweep(self, keep=None) -> None:
        for key in [k for k, entry in self._held.items() if entry[2] <= 0 and k != keep]:
            original, dispatcher, _, _ = self._held.pop(key)
            owner = sys.modules[key[0]]
            # Someone else replaced the global after us: leave theirs (it may call our dispatcher,
            # which without a holder is a plain pass-through to the original).
            if owner.__dict__.get(key[1]) is dispatcher:
                owner.__dict__[key[1]] = original

    def held(self) -> dict[str, int]:
        """"module.function" -> holders, for the globals some model holds."""
        with self._lock:
            return {f"{m}.{n}": entry[2] for (m, n), entry in self._held.items() if entry[2] > 0}


interceptions = Interceptions()

#: RopePlan fields that say which calls a probe proved beyond the plain ones.
_PROVED_CALLS = ("partial", "bshd", "q_alone")


def _widened(held: RopePlan, new: RopePlan) -> RopePlan:
    """`held` with the calls `new` proved too, where the two agree on everything else (how the
    function computes: its tables, layout, casts); else `held` as it is."""
    plain = {field: False for field in _PROVED_CALLS}
    if held._replace(**plain) != new._replace(**plain):
        return held
    return held._replace(**{field: getattr(held, field) or getattr(new, field) for field in _PROVED_CALLS})


class Hold:
    """One swapped model's hold on the interception of one RoPE global, owned by its SwapState:
    acquired when made, released by `release()` (restore_kernels) or counted down when the model
    is collected. A copy of the model (deepcopy) and a pickled model loaded again make their own
    (`__reduce__`), so each runs the kernel its report lists."""

    def __init__(self, plan: RopePlan) -> None:
        plan = RopePlan(*plan)
        self.plan = plan._replace(key=tuple(plan.key))
        self.key = self.plan.key
        interceptions.acquire(self.plan)
        self._collected = weakref.finalize(self, interceptions.dropped, self.key)

    def release(self) -> None:
        if self._collected.detach() is not None:  # once: the first release, and no count-down after it
            interceptions.release(self.key)

    def __reduce__(self):
        return Hold, (self.plan,)


def _dispatcher(plan: RopePlan, original):
    from accel_kernels import _dispatch

    key, cast_back = plan.key, plan.cast_back
    signature = inspect.signature(sites.python_function(original))
    the_gate = gate(key)
    params = list(signature.parameters.values())
    # The first four parameters are q, k, cos, sin whatever their names (three, x, cos, sin, for
    # the one-tensor form); `unsqueeze_dim` may be
    # given; any other argument (old `position_ids`, ...) must be left at its default. Bound by
    # hand, not with Signature.bind: dynamo cannot read a signature's mapping proxy once the
    # trace has mutated a dict, and bind costs microseconds per call in eager.
    plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    names = tuple(p.name for p in params)
    n = 3 if plan.one_tensor or plan.complex_dim else 4
    tensors = names[:n]
    others = {p.name: p.default for p in params[n:] if p.name != "unsqueeze_dim"}

    def bound(args, kwargs):
        """{name: value} of a call, or None when it is not a plain call of the function."""
        if not plain or len(args) > len(names):
            return None
        given = dict(zip(names, args))
        for name, value in kwargs.items():
            if name not in names or name in given:
                return None
            given[name] = value
        return given

    def kernel_or_why(args, kwargs):
        """The kernel's (q, k) for this call, else the reason the original runs."""
        given = bound(args, kwargs)
        if not (given is not None and len(tensors) == n and all(t in given for t in tensors)
                and all(given[t] is d for t, d in others.items() if t in given)):
            return NOT_PLAIN
        unsqueeze_dim = given.get("unsqueeze_dim", 1)
        if unsqueeze_dim != 1 and not (unsqueeze_dim == 2 and plan.bshd):
            return UNSQUEEZE_2
        if plan.one_tensor:
            (q, cos, sin), k = (given[t] for t in tensors), None
        elif plan.complex_dim:  # (q, k, freqs_cis)
            (q, k, cos), sin = (given[t] for t in tensors), None
            if k is None:
                return K_NONE
            if not (isinstance(cos, torch.Tensor) and cos.is_complex()):
                return SHAPE
        else:
            q, k, cos, sin = (given[t] for t in tensors)
            if k is None and not plan.q_alone:
                return K_NONE
        if not (isinstance(q, torch.Tensor) and _dispatch.use_triton(q)):  # the original is faster there
            return NO_TRITON
        if not plan.partial and isinstance(cos, torch.Tensor) and q.shape[-1] != cos.shape[-1] * (
                2 if plan.half_tables or plan.complex_dim else 1):
            return SHAPE  # partial rotary the function does not take: it raises, as stock does
        try:
            q_out, k_out = _kernel(q, k, cos, sin, plan, unsqueeze_dim)
        except (ValueError, TypeError, AttributeError):
            return SHAPE
        if cast_back:
            q_out, k_out = q_out.to(q.dtype), (k_out if k is None else k_out.to(k.dtype))
        return q_out if plan.one_tensor else (q_out, k_out)

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if the_gate.is_open():
            counter = the_gate.counter()
            out = kernel_or_why(args, kwargs)
            eager = counter is the_gate.local
            if not isinstance(out, str):
                if eager:
                    counter.ran += 1
                else:
                    _traced_note(key, FUSED)
                return out
            if eager:
                counter.fell += 1
                counter.why = out
            else:
                _traced_note(key, out)
        return original(*args, **kwargs)

    dispatch.__accel_patch_original__ = original
    if sites.python_function(original) is not original:
        # The `kernels` package's wrapper (an nn.Module instance in the global's place): the
        # dispatcher is one more instance of its class, calling `dispatch`, because that
        # package unpickles a model's private copy of the wrapper as `type(global)()`.
        wrapper = type(original)()
        wrapper.forward = dispatch
        return wrapper
    return dispatch


def _kernel(q, k, cos, sin, plan: RopePlan, unsqueeze_dim: int = 1):
    """The kernel's (q_out, k_out) for a call of `plan`'s function (k may be None: k_out is None).
    A complex plan's `cos` is the complex table (`sin` unused)."""
    from accel_kernels import rope

    if plan.complex_dim:
        # the complex table's real view, (cos, sin) of each angle side by side: a view, no copy
        # (resolve_conj: a no-op unless the caller conjugated the table lazily)
        table = torch.view_as_real(cos.resolve_conj()).flatten(-2)
        return rope(q, k, table, table, unsqueeze_dim=plan.complex_dim, form="complex")
    if plan.half_tables:  # the same rotation on the full-width tables (see the module docstring)
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    return rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, form=plan.form)


def head_shape(module, config) -> tuple[int, int, int, tuple[int, ...]]:
    """(query heads, key/value heads, head dim, rotary dims to probe) of an attention module, read
    from its layer's configuration (probe.layer_config). May raise: a configuration that cannot be
    read refuses the site (apply.py)."""
    config = probe.layer_config(config, module)
    heads = getattr(config, "num_attention_heads", None) or getattr(module, "num_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and heads:
        head_dim = config.hidden_size // heads
    rotary = [head_dim]
    for attr in ("rotary_ndims", "rotary_dim"):
        value = getattr(module, attr, None)
        if isinstance(value, int):
            rotary.append(value)
    for value in _partial_factors(config, module):
        if isinstance(value, (int, float)) and 0 < value < 1:
            rotary.append(int(head_dim * value))
    return heads, kv_heads, head_dim, tuple(sorted({r - r % 2 for r in rotary if r and r >= 2}, reverse=True))


def _partial_factors(config, module) -> list:
    """The rotary shares of a head the configuration names: its own attribute (transformers 4), else
    `rope_parameters["partial_rotary_factor"]` (transformers 5 moved it there: Qwen3.5, Qwen3-Next,
    GLM, StableLM, GPT-NeoX), per layer type where the parameters are (Gemma 4): the module's type
    when it says, else every type's."""
    found = [getattr(config, attr, None) for attr in families.PARTIAL_ROTARY_ATTRIBUTES]
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return found
    if not any(isinstance(v, dict) for v in params.values()):
        return found + [params.get(attr) for attr in families.PARTIAL_ROTARY_ATTRIBUTES]
    layer_type = getattr(module, "layer_type", None)
    types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_type is None and isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types):
        layer_type = types[index]
    chosen = [params[layer_type]] if isinstance(params.get(layer_type), dict) else [
        v for v in params.values() if isinstance(v, dict)]
    return found + [p.get(attr) for p in chosen for attr in families.PARTIAL_ROTARY_ATTRIBUTES]


def _dtypes_returned(out, ref, n: int = 2) -> str | None:
    """Why the kernel's outputs differ from the original's in dtype or shape, else None."""
    if not (isinstance(ref, tuple) and len(ref) == n and all(isinstance(r, torch.Tensor) for r in ref)):
        what = "a tensor" if n == 1 else "a (q, k) pair of tensors"
        return f"returns {type(ref).__name__}, not {what}"
    for name, o, r in zip("qk", out, ref):
        if o.shape != r.shape:
            return f"{name} comes back with shape {tuple(r.shape)}, the kernel's with {tuple(o.shape)}"
        if o.dtype != r.dtype:
            return f"{name} comes back in {r.dtype}, the kernel's in {o.dtype}"
    return None


def _one_tensor(function) -> bool:
    """Whether a RoPE function rotates one tensor per call (Gemma 4's and DeepSeek V4's
    `apply_rotary_pos_emb(x, cos, sin)`): three required parameters."""
    try:
        params = list(inspect.signature(sites.python_function(function)).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(required) == 3


def _takes(function, name: str) -> bool:
    try:
        return name in inspect.signature(sites.python_function(function)).parameters
    except (TypeError, ValueError):
        return False


class _Mismatch(str):
    """A probe case whose values differ (another form may still match); a plain str is final."""


def _probe_form(key, original, plan, shapes, combos, device):
    """Run `original` and the kernel under `plan` on every (dtype, shape) case the function takes:
    (cases run, cast_back or None, partial rotary ran) when all match, else (cases run, reason,
    None): a `_Mismatch` reason when only the values differ."""
    heads, kv_heads, dims = shapes
    ran, cast_back, partial = 0, None, False
    # q and k as the function takes them: (B, H, S, D), or (B, S, H, D) for a complex one that says so
    shape = (lambda h, dim: (2, 5, h, dim)) if plan.complex_dim == 2 else (lambda h, dim: (2, h, 5, dim))
    for dtype, table_dtype in combos:
        for dim, r in dims:
            width = r // 2 if plan.half_tables or plan.complex_dim else r
            q = probe.randn(shape(heads, dim), dtype, device)
            k = probe.randn(shape(kv_heads, dim), dtype, device)
            cos = probe.randn((2, 5, width), table_dtype, device)
            sin = probe.randn((2, 5, width), table_dtype, device)
            if plan.complex_dim:  # freqs_cis: any complex numbers (the function is linear in them)
                cos, sin = torch.complex(cos.float(), sin.float()), None
            try:
                if plan.complex_dim:
                    ref = original(q, k, cos)
                else:
                    ref = original(q, cos, sin) if plan.one_tensor else original(q, k, cos, sin)
            except Exception:
                continue  # this function does not take this shape; the dispatcher never sends it
            ran += 1
            partial = partial or dim != r
            ref = (ref,) if plan.one_tensor and isinstance(ref, torch.Tensor) else ref
            inputs = (q,) if plan.one_tensor else (q, k)
            try:
                out = _kernel(q, None if plan.one_tensor else k, cos, sin, plan)[:len(inputs)]
            except ValueError as exc:
                return ran, f"kernel refused the shapes the function takes: {exc}", None
            if dtype != table_dtype and isinstance(ref, tuple) and len(ref) == len(inputs):
                # mixed dtypes: the kernel returns the promoted dtype; the function may cast back
                back = all(isinstance(r_, torch.Tensor) and r_.dtype == t.dtype for r_, t in zip(ref, inputs))
                if cast_back is not None and back != cast_back:
                    return ran, f"{key[0]}.{key[1]} returns different dtypes for different shapes", None
                cast_back = back
                if back:
                    out = tuple(o.to(t.dtype) for o, t in zip(out, inputs))
            why = _dtypes_returned(out, ref, len(inputs))
            if why:
                return ran, f"{key[0]}.{key[1]} with q/k in {dtype} and cos/sin in {table_dtype}: {why}", None
            err = max(probe.rel_err(o, s_) for o, s_ in zip(out, ref))
            limit = probe.bound(dtype)
            if err > limit:
                tables = ("a complex table" if plan.complex_dim else "half-width tables" if plan.half_tables
                          else "full-width tables")
                return ran, _Mismatch(f"{key[0]}.{key[1]} differs from every RoPE form the kernel rotates "
                                      f"(rotate-half; interleaved: DeepSeek's; GPT-J pairs, on the first or the "
                                      f"last dims) in {dtype} on {tables} ({plan.form}: relative error {err:.2e} > "
                                      f"{limit:.1e})"), None
    return ran, cast_back, partial


def _proves(original, plan, heads, kv_heads, dim, r, dtype, device, unsqueeze_dim, q_alone) -> bool:
    """One more case the dispatcher may send: (B, S, H, D) tensors (unsqueeze_dim=2) or k=None.
    True when the function takes it and the kernel matches it (values, dtypes, shapes)."""
    shape = (lambda h: (2, h, 5, dim)) if unsqueeze_dim == 1 else (lambda h: (2, 5, h, dim))
    q, k = probe.randn(shape(heads), dtype, device), probe.randn(shape(kv_heads), dtype, device)
    width = r // 2 if plan.half_tables else r
    cos, sin = probe.randn((2, 5, width), dtype, device), probe.randn((2, 5, width), dtype, device)
    k = None if q_alone or plan.one_tensor else k
    try:
        args = (q, cos, sin) if plan.one_tensor else (q, k, cos, sin)
        ref = original(*args, unsqueeze_dim=unsqueeze_dim) if unsqueeze_dim != 1 else original(*args)
        out = _kernel(q, k, cos, sin, plan, unsqueeze_dim)
    except Exception:
        return False
    ref = ref if isinstance(ref, tuple) else (ref,)
    pairs = [(o, r_) for o, r_ in zip(out, ref) if o is not None or r_ is not None]
    return bool(pairs) and all(
        isinstance(o, torch.Tensor) and isinstance(r_, torch.Tensor) and o.shape == r_.shape
        and o.dtype == r_.dtype and probe.rel_err(o, r_) <= probe.bound(dtype) for o, r_ in pairs)


def probe_verdict(key, module, config, act_dtype: torch.dtype):
    """A `RopePlan` for `key` (the function to intercept) when the kernel reproduces it, in one of
    the forms it rotates, at this attention's shapes and every dtype combination it will see
    (values, dtypes and shapes of what it returns), else a refusal reason."""
    from accel_kernels.ops.rope import FORMS

    heads, kv_heads, head_dim, rotary_dims = head_shape(module, config)
    if not (heads and kv_heads and head_dim):
        return "cannot tell the attention's head counts and head dim"
    original = interceptions.original(key)
    one_tensor = _one_tensor(original)
    device = probe.module_device(module)
    # (q/k dtype, cos/sin dtype): the activation dtype with tables in it and in float32, and float32
    # and always one half-precision mix: whether the function casts back is a property of the
    # function, and the dispatcher (one per global, shared by every model of the family) must
    # know it even when the first model swapped runs in float32
    combos = list(dict.fromkeys([(act_dtype, act_dtype), (act_dtype, torch.float32), (torch.float32, torch.float32),
                                 (torch.bfloat16, torch.float32)]))
    # q/k of the full head dim with rotary dim r (partial rotary inside the function), and q/k of
    # dim r (the caller slices the rotary part off first, as Phi and StableLM do)
    dims = sorted({(head_dim, r) for r in rotary_dims} | {(r, r) for r in rotary_dims}, reverse=True)
    shapes = (heads, kv_heads, dims)
    if one_tensor and key[1] in families.COMPLEX_ROPE_FUNCTIONS:  # f(q, k, freqs_cis)
        with probe.probing(module):
            return _probe_complex(key, original, shapes, combos, device)
    ran_any, mismatch = False, None
    with probe.probing(module):
        # rotate-half first (the interleaved forms cannot pass where it does: they read other
        # elements); full-width tables first, then half-width ones, for a function that takes no
        # full-width one or whose values differ on them: DeepSeek V4's takes a table of any width
        # as one angle per pair (its last-dims form matches on half-width tables only); "complex"
        # only for the complex functions (its tables are a complex one's view)
        for form in (f for f in FORMS if f != "complex"):
            differed = False
            for half_tables in (False, True):
                plan = RopePlan(key, False, half_tables, form, one_tensor=one_tensor)
                ran, found, partial = _probe_form(key, original, plan, shapes, combos, device)
                if not ran:
                    continue
                ran_any = True
                # after values that differed on full-width tables, any reason on half-width ones
                # only means this form does not match either
                if isinstance(found, _Mismatch) or (differed and isinstance(found, str)):
                    mismatch = mismatch or found
                    differed = True
                    continue
                if isinstance(found, str):
                    return found
                plan = plan._replace(cast_back=bool(found), partial=partial)
                dim, r = dims[0]
                if _takes(original, "unsqueeze_dim"):
                    plan = plan._replace(bshd=_proves(original, plan, heads, kv_heads, dim, r, act_dtype, device,
                                                      2, False))
                if not one_tensor:
                    plan = plan._replace(q_alone=_proves(original, plan, heads, kv_heads, dim, r, act_dtype,
                                                         device, 1, True))
                return plan
    if not ran_any:
        return f"{key[1]} could not be called with rotate-half shapes (full- or half-width cos/sin)"
    if one_tensor:
        names = ", ".join(list(inspect.signature(sites.python_function(original)).parameters)[:3])
        return f"{mismatch}; it rotates one tensor per call ({names}): the one-tensor form"
    return str(mismatch)


def _probe_complex(key, original, shapes, combos, device):
    """A complex RoPE function `f(q, k, freqs_cis)` (Llama 4's, DeepSeek V2's) against the kernel's
    "complex" form, with q and k in each layout the function may broadcast the table at ((B, S, H, D)
    first: Llama 4's): a `RopePlan` for the first layout where every case matches, else the reason.
    The table is complex64 whatever q's dtype: each dtype of q is probed against a float32 view."""
    combos = list(dict.fromkeys((dtype, torch.float32) for dtype, _ in combos))
    why = []
    for complex_dim, layout in ((2, "(B, S, H, D)"), (1, "(B, H, S, D)")):
        plan = RopePlan(key, False, False, "complex", complex_dim=complex_dim)
        ran, found, partial = _probe_form(key, original, plan, shapes, combos, device)
        if ran and not isinstance(found, str):
            return plan._replace(cast_back=bool(found), partial=partial)
        why.append(f"q, k {layout}: {found if ran else 'the function does not take them'}")
    return (f"{key[1]} (complex RoPE: q and k viewed as complex numbers times freqs_cis) differs from the "
            f"kernel's complex form (GPT-J pairs, angles from the table's real and imaginary parts): " + "; ".join(why))


_forwards: dict[tuple, object] = {}
#: RoPE global -> what its dispatcher ran in the trace under way (see `_traced_note`).
_traced: dict[tuple[str, str], str] = {}


@torch.compiler.assume_constant_result
def _traced_note(key: tuple[str, str], outcome: str) -> bool:
    """While dynamo traces a swapped attention forward, the dispatcher notes what the graph runs for
    `key` (the kernel, or the function and why). Dynamo runs this at trace time and keeps only its
    result, so the note is made once per trace and the compiled graph carries nothing of it."""
    _traced[key] = outcome
    return True


@torch.compiler.assume_constant_result
def _traced_take(key: tuple[str, str]) -> str:
    """The outcome noted for `key` since the last take ("" when the dispatcher was not reached),
    at trace time (a constant of the graph)."""
    return _traced.pop(key, "")


@sites.made_by  # a pickled model makes its forward again
def forward_for(key: tuple[str, str]):
    """The swapped attention forward: the module's own forward, with the kernel allowed for `key`
    (the gate's depth raised around it)."""
    if key not in _forwards:
        the_gate = gate(key)
        another = f"another function: the forward did not call {key[1]} (another RoPE form, or no positions)"

        def forward(self, *args, **kwargs):
            counter = the_gate.counter()
            site = self.__dict__.get(SITE_ATTR)
            eager = counter is the_gate.local
            ran, fell = (counter.ran, counter.fell) if eager else (0, 0)
            # a trace of this forward starts with no outcome noted; an enclosing swapped forward's
            # note so far is kept (nested sites: DeepSeek V4's compressor and indexer in its attention)
            outer = "" if eager else _traced_take(key)
            if eager:
                counter.depth += 1
            else:
                _traced_step(key, 1)
            try:
                # the projections keep the input norm's call instead of its output (norms.recompute_scope)
                with norms.recompute_scope(args[0] if args else kwargs.get("hidden_states"),
                                           None if site is None else site.norm_recomputed):
                    out = sites.call_inner(self, *args, **kwargs)
            finally:
                if eager:
                    counter.depth -= 1
                else:
                    _traced_step(key, -1)
            if site is None:
                return out
            if eager:  # what this call's RoPE ran
                if counter.ran > ran and counter.fell == fell:
                    site.count(FUSED)
                elif counter.fell > fell:
                    site.count(counter.why)
                else:
                    site.count(another)
            else:  # what the graph's RoPE runs, once per compiled graph ("compiled: fused", ...)
                inner = _traced_take(key)
                sites.count(site, inner or another)
                if _traced_depth(key) > 0:  # the enclosing forward counts this one's calls too, as in eager
                    merged = inner if inner and inner != FUSED else outer or inner
                    if merged:
                        _traced_note(key, merged)
            return out

        _forwards[key] = forward
    return _forwards[key]
