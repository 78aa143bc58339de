"""How a swap changes a module, and how it is undone: instance forwards and an undo log on the model.

A swap never touches a class. It binds a function as the *instance's* `forward` (or, when
accelerate's hooks own `forward`, as the `_old_forward` they call), so other instances of the
same class keep the stock forward. The function is a plain `types.MethodType`, so `copy.deepcopy`
of a swapped model rebinds it to the copy. It carries the replaced forward's signature (Trainer
and `generate` inspect it). Every attribute set is recorded in the model's `SwapState`, and
`restore_kernels` puts back exactly what was there (or deletes what was not).

Pickling (`torch.save(model)`, multiprocessing): Python pickles a bound method as
`getattr(instance, name)`, which, read while the module is being loaded, gives the class's stock
forward: a reloaded model would run stock under a report listing kernels. So the bound forwards
of a swap are pickled as what they are: the function they were made from (a module-level
function, or a factory and its arguments: `made_by`), the class and op of `signed`, and the
module, bound again on load (`rebind`). This is one entry for `types.MethodType` in `copyreg`'s
table and in multiprocessing's pickler; every other method pickles exactly as before.
"""
from __future__ import annotations

import contextlib
import copyreg
import ctypes
import functools
import inspect
import types
from _thread import RLock

import torch

from .report import COMPILED

#: Attribute of the swapped model (the transformers model, under any PEFT wrapper) holding its SwapState.
STATE_ATTR = "_accel_patch_swap_state"
#: Instance attribute that keeps a forward which was already bound on the instance before the swap
#: (accelerate's autocast wrapper, a hook's `_old_forward`), for wrappers that call through it.
INNER_ATTR = "_accel_patch_inner_forward"
#: Marker set on every function the swap binds, naming its op.
MARK = "__accel_patch_op__"
#: The fused loss's op (loss.OP), under which its calls are counted in SwapState.calls.
LOSS_OP = "fused_linear_cross_entropy"
#: Set on every copy `signed` makes: (function, class, op) it was made from.
SIGNED_ATTR = "__accel_patch_signed__"
#: Set on every function a `made_by` factory makes: (factory, args, kwargs).
MADE_ATTR = "__accel_patch_made__"


class CallTable(dict):
    """A model's call table (op -> outcome -> calls; `SwapState.calls`). A deep copy starts empty:
    the calls counted so far ran on the original, not on the copy (`copy.deepcopy` of a swapped
    model: a reference model; of a swapped layer: PEFT's layer replication), and every site of one
    copy shares the one new table, whichever holder deepcopy reaches first. Pickling keeps the
    counts (a saved model is the same model)."""

    __slots__ = ()

    def __deepcopy__(self, memo) -> "CallTable":
        return CallTable()


class SwapState:
    """What was swapped into one model and how to undo it (lives on the model instance)."""

    def __init__(self) -> None:
        self.ops: set[str] = set()
        self.counts: dict[str, int] = {}
        self.refused: list = []
        self._undo: list[tuple[object, str, bool, object, object]] = []
        # callables that release shared interceptions (RoPE globals): bound methods of picklable
        # holds, so a copy or a reloaded model holds its own (layers/rope.py)
        self.releases: list = []
        self.head: str | None = None  # whose LM head a trainer's own head calls run (TRL's), when it installed one
        # ops decided per call (the fused loss, the fused LoRA sites): op -> outcome -> calls;
        # the outcomes' meaning is report.outcome_kind's
        self.calls: dict[str, dict[str, int]] = CallTable()

    def set(self, obj, attr: str, value) -> None:
        """obj.attr = value (in obj's own __dict__), remembering what was there."""
        d = obj.__dict__
        self._undo.append((obj, attr, attr in d, d.get(attr), value))
        d[attr] = value

    def undo(self) -> list[str]:
        """Put back everything set, newest first. An attribute someone replaced after the swap
        (e.g. a wrapper around a swapped forward) is left as they set it; its name is returned."""
        kept = []
        while self._undo:
            obj, attr, had, previous, value = self._undo.pop()
            if obj.__dict__.get(attr) is not value:
                kept.append(f"{type(obj).__name__}.{attr}")
                continue
            if had:
                obj.__dict__[attr] = previous
            else:
                obj.__dict__.pop(attr, None)
        while self.releases:
            self.releases.pop()()
        return kept

    def adopt_copies(self, modules) -> None:
        """Count the calls of sites copied after the swap into this table: a swapped module
        deep-copied on its own (PEFT's layer replication clones each decoder layer) holds sites
        with a table of their own, which no report reads. Each such table's calls join these once
        (it is emptied), and its sites count into these from now on."""
        for module in modules:
            for value in list(module.__dict__.values()):
                table = getattr(value, "calls", None)
                if not isinstance(table, CallTable) or table is self.calls:
                    continue
                for op, outcomes in table.items():
                    mine = self.calls.setdefault(op, {})
                    for outcome, n in outcomes.items():
                        mine[outcome] = mine.get(outcome, 0) + n
                table.clear()
                value.calls = self.calls

    def absorb(self, part: "SwapState", where: str, modules) -> None:
        """Take over the state of a part swapped on its own before (`where`: its path in this
        model; `modules`: its modules): one swap state per top-level model. Its undo log goes
        beneath this one's (undone after it), its holds, counts, refusals and calls join these,
        and the sites counting into its calls count into these."""
        self._undo[:0] = part._undo
        self.releases[:0] = part.releases
        for op, n in part.counts.items():
            self.counts[op] = self.counts.get(op, 0) + n
        self.refused.extend(r._replace(where=f"{where}.{r.where}") for r in part.refused)
        for op, outcomes in part.calls.items():
            mine = self.calls.setdefault(op, {})
            for outcome, n in outcomes.items():
                mine[outcome] = mine.get(outcome, 0) + n
        for module in modules:
            for value in list(module.__dict__.values()):
                if getattr(value, "calls", None) is part.calls:
                    value.calls = self.calls
        self.head = self.head or part.head

    def rebind(self, owned, inner_attr_of) -> int:
        """Bind again the forwards of this swap that a module no longer runs where `owned(module)`
        says the module's forward belongs to a rebinder that runs again and again (transformers'
        kernelize, at every train()/eval() switch): what it bound there (None: the class's forward)
        becomes the forward beneath ours (the bottom site's `inner_attr_of(op)`), in the module
        and in the undo log, so fall-backs call it and restore puts it back. Returns how many."""
        stacks: dict[tuple[int, str], list] = {}  # (module, slot) -> [module, top forward, bottom op]
        for obj, attr, _, _, value in self._undo:
            op = getattr(getattr(value, "__func__", None), MARK, None)
            if attr in ("forward", "_old_forward") and op is not None:
                stacks.setdefault((id(obj), attr), [obj, value, op])[1] = value
        rebound = 0
        for (_, slot), (obj, top, op) in stacks.items():
            current = obj.__dict__.get(slot)
            if _runs_through(current, top) or not owned(obj):
                continue
            first = self._entry(obj, slot)  # looked up each time: the log changes below
            self._undo[first] = (obj, slot, current is not None, current, self._undo[first][4])
            inner = inner_attr_of(op)
            kept = self._entry(obj, inner)
            if current is None:
                obj.__dict__.pop(inner, None)
                if kept is not None:
                    del self._undo[kept]
            else:
                obj.__dict__[inner] = current
                if kept is None:
                    self._undo.insert(first, (obj, inner, False, None, current))
                else:
                    _, _, had, previous, _ = self._undo[kept]
                    self._undo[kept] = (obj, inner, had, previous, current)
            obj.__dict__[slot] = top
            rebound += 1
        return rebound

    def _entry(self, obj, attr: str) -> int | None:
        """The index of the first undo entry setting `obj.attr`, None when there is none."""
        return next((i for i, e in enumerate(self._undo) if e[0] is obj and e[1] == attr), None)

    def replaced(self) -> list[tuple[object, str, str]]:
        """(module, op, by whom) of every forward this swap bound that the module no longer runs:
        rebound after the swap (another tool's per-instance kernels) by something that does not
        call through it. A wrapper that calls through ours (`__wrapped__`, accelerate's autocast
        forward, accelerate's hooks moving ours to `_old_forward`) still runs it. Sites stacked on
        one forward (LoRA or the tiled MLP on top of the GLU kernel) stand or fall with the top one."""
        stacks: dict[tuple[int, str], list] = {}
        for obj, attr, _, _, value in self._undo:
            op = getattr(getattr(value, "__func__", None), MARK, None)
            if attr in ("forward", "_old_forward") and op is not None:
                stacks.setdefault((id(obj), attr), []).append((obj, op, value))
        found = []
        for (_, attr), stack in stacks.items():
            obj, _, top = stack[-1]
            current = obj.__dict__.get(attr)
            if _runs_through(current, top) or (attr == "forward" and _runs_through(obj.__dict__.get("_old_forward"), top)):
                continue
            func = getattr(current, "__func__", current)
            by = (f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', type(func).__name__)}"
                  if current is not None else f"the class's own {type(obj).__name__}.forward")
            found.extend((obj, op, by) for obj, op, _ in stack)
        return found

    @property
    def loss_calls(self) -> dict[str, int]:
        """The fused loss's calls: outcome -> count, live (the dict `calls[LOSS_OP]`)."""
        return self.calls.setdefault(LOSS_OP, {})

    def count_call(self, outcome: str, op: str = LOSS_OP) -> None:
        """Count one call of `op` (the fused loss by default) with `outcome`."""
        per_op = self.calls.setdefault(op, {})
        per_op[outcome] = per_op.get(outcome, 0) + 1


def _runs_through(current, value) -> bool:
    """Whether the callable `current` is `value` or wraps it (follows `__func__` and `__wrapped__`)."""
    target = getattr(value, "__func__", value)
    for _ in range(16):
        if current is None:
            return False
        if current is value or current is target:
            return True
        current = getattr(current, "__func__", None) or getattr(current, "__wrapped__", None)
    return False


def forward_slot(module) -> str:
    """The attribute a call of `module` ends in: accelerate's hooks rebind `forward` and call `_old_forward`."""
    d = module.__dict__
    return "_old_forward" if "_hf_hook" in d and "_old_forward" in d else "forward"


def bind_for_call(module, forward) -> tuple:
    """Bind `forward` in `module`'s forward slot for one call (the LM head's capturing forward, in
    eager and compiled calls alike); returns what `unbind` puts back. Plain dict operations, which
    dynamo traces and replays."""
    slot = forward_slot(module)
    had = slot in module.__dict__
    previous = module.__dict__.get(slot)
    module.__dict__[slot] = forward
    return slot, had, previous


def unbind(module, bound: tuple) -> None:
    """Put back what `bind_for_call` replaced (or remove the binding where there was none; dynamo
    in torch 2.11 cannot trace that removal, so a traced caller binds over an instance forward made
    at swap time: `class_forward`)."""
    slot, had, previous = bound
    if had:
        module.__dict__[slot] = previous
    elif slot in module.__dict__:
        del module.__dict__[slot]


def class_forward(module, *args, **kwargs):
    """The class's forward of `module`, called: an instance forward that runs as stock (bound as
    `functools.partial(class_forward, module)`, picklable and copied with the module)."""
    return type(module).forward(module, *args, **kwargs)


def call_kept(attr: str, module, *args, **kwargs):
    """Call the forward a wrapper replaced: the instance forward kept in `attr` at swap time, else
    the class's."""
    inner = module.__dict__.get(attr)
    if inner is None:
        return type(module).forward(module, *args, **kwargs)
    return inner(*args, **kwargs)


def call_inner(module, *args, **kwargs):
    """call_kept for a kernel swap's forward (INNER_ATTR)."""
    return call_kept(INNER_ATTR, module, *args, **kwargs)


def install(state: SwapState, module, func, inner_attr: str = INNER_ATTR) -> None:
    """Bind `func(self, ...)` as the module's forward, keeping any instance forward it replaces in
    `inner_attr` (a site decided per call keeps its own, on top of a kernel swap's)."""
    slot = forward_slot(module)
    if slot in module.__dict__:
        state.set(module, inner_attr, module.__dict__[slot])
    state.set(module, slot, types.MethodType(func, module))


# --- decisions as values -------------------------------------------------------------------------

class Refused(str):
    """A site's (or a call's) refusal: a value that is its reason. A str, so it reads, logs and
    compares as the reason; tested with isinstance(decision, Refused). The probe cache keeps every
    reason a probe returns as one."""

    __slots__ = ()


# --- the questions every room asks, answered once -----------------------------------------------

def compiling() -> bool:
    """Whether dynamo (or the JIT tracer) is tracing this call: the per-call sites stand aside or
    count per trace there, and nothing reads a tensor's storage (it is not traceable)."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling()) or torch.jit.is_tracing()


def is_dtensor(t) -> bool:
    """Whether `t` is a torch.distributed DTensor (FSDP2, tensor or expert parallel). By class name:
    asking imports nothing of torch.distributed."""
    return type(t).__name__ == "DTensor"


def python_function(obj):
    """The Python function behind a module-level function of a modeling file: `obj` itself, or,
    where transformers decorated it with `use_kernel_forward_from_hub` and the `kernels` package
    is installed (a dependency of transformers from 5.25), the function that package's wrapper
    (an `nn.Module` instance standing in the global's place) calls when no hub kernel replaced
    it. Its signature is the function's; calling the wrapper runs it (or the hub kernel)."""
    if inspect.isfunction(obj):
        return obj
    forward = getattr(type(obj), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and "func" in code.co_freevars and isinstance(obj, torch.nn.Module):
        inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
        if inspect.isfunction(inner):
            return inner
    return obj


def storage_freed(t: torch.Tensor) -> bool:
    """Whether `t` holds fewer bytes than its view needs (a sharding engine freed or released it).
    False while compiling: a compiled graph reads the parameter dynamo guards on."""
    if compiling():
        return False
    needed = (t.storage_offset() + t.numel()) * t.element_size()
    return t.numel() == 0 or t.untyped_storage().nbytes() < needed


def in_subgraph() -> bool:
    """Whether dynamo is tracing this call inside a higher-order op's body (a non-reentrant
    checkpoint's: a decoder layer under gradient checkpointing), where it refuses any write to an
    object made outside the body. False outside a trace."""
    return compiling() and _traced_in_subgraph()


@torch.compiler.assume_constant_result
def _traced_in_subgraph() -> bool:
    """Asked at trace time and kept as a constant of the graph: whether the tracer under way is a
    higher-order op's (it has a parent)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return tx is not None and tx.output.current_tracer.parent is not None


@torch.compiler.assume_constant_result
def autocast_available(device_type: str) -> bool:
    """Whether autocast exists for `device_type`. Asked at trace time and kept as a constant of the
    graph: dynamo in torch 2.11 cannot trace `torch._C._is_autocast_available` (a graph break)."""
    return torch.amp.is_autocast_available(device_type)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for `device_type`, None when autocast is off there (or a device
    type autocast does not know)."""
    if not autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def autocast_state(device_type: str) -> tuple[str, bool, torch.dtype | None]:
    """(device type, enabled, dtype or None): the autocast state a later computation replays."""
    dtype = autocast_dtype(device_type)
    return device_type, dtype is not None, dtype


def count_into(calls: dict, op: str, outcome: str) -> None:
    """One call of `op` with `outcome` in a model's call table (SwapState.calls); nothing inside
    `uncounted` (a side run that times a choice is not a call of the model)."""
    if _uncounted:
        return
    per_op = calls.setdefault(op, {})
    per_op[outcome] = per_op.get(outcome, 0) + 1


_uncounted = 0


@contextlib.contextmanager
def uncounted():
    """No call is counted inside: the side runs that time a choice run the sites beneath them (a
    fall-back's forward, a GLU swap), and they are not calls of the model (swaps/lora/timing.py)."""
    global _uncounted
    _uncounted += 1
    try:
        yield
    finally:
        _uncounted -= 1


class CountingSite:
    """Base of a site that counts its calls with `count` below: `calls` is the model's call table
    (SwapState.calls; `SwapState.absorb` points it at another), and `calls_id` its id, kept with it
    for the count while dynamo traces."""

    @property
    def calls(self) -> dict:
        return self._calls

    @calls.setter
    def calls(self, table: dict) -> None:
        self._calls, self.calls_id = table, id(table)

    def __setstate__(self, state: dict) -> None:
        """A copy (`copy.deepcopy` of a swapped model, pickling) keeps the id of its own table, never
        the original's, which may be gone by the time the copy is traced. A site pickled before the
        id was kept holds its table as `calls`."""
        state = dict(state)
        table = state.pop("_calls", None)
        if table is None:
            table = state.pop("calls", None)
        self.__dict__.update(state)
        self.calls = table if table is not None else CallTable()


def count(site, outcome: str, *before) -> None:
    """`site.count(*before, outcome)` for one call; while dynamo traces, once per compiled graph,
    as "compiled: <outcome>": what the graph computes at every call of it (a change that would
    give another outcome fails a guard and is traced, and counted, anew). `before` is the op where
    the site counts several (a LoRA site), else the site's class names it (`site.OP`)."""
    if compiling():
        _count_traced(site.calls_id, before[0] if before else site.OP, outcome)
    else:
        site.count(*before, outcome)


@torch.compiler.assume_constant_result
def _count_traced(calls_id: int, op: str, outcome: str) -> bool:
    """Dynamo runs this at trace time and keeps only its result, so the count is one per compiled
    graph, not per call. The count goes to the model's call table, by the id the site keeps
    (`CountingSite.calls_id`, a plain int: dynamo in torch 2.11 hands such a function constants
    only, and cannot take `id()` of a dict). The table, not the site: every site of a model counts
    into the one table, so the graph guards on an int all of a model's sites share, and layers
    compiled one by one (`layer.compile()`) share one graph as stock's do; a guard on each site's
    identity would trace every layer anew and, past dynamo's recompile limit, run the rest eagerly.
    Such layers count once per graph: the layers that reuse it are not traced, so not counted."""
    traced_count_into(traced_object(calls_id), op, COMPILED + outcome)
    return True


_attempts: dict[int, tuple] = {}  # id(table) -> (weakref to the CompileContext, attempt, [(op, outcome)])


def traced_count_into(calls: dict, op: str, outcome: str) -> None:
    """count_into at trace time, for the trace under way only: when dynamo restarts a trace (a new
    attempt of the same compile: under dynamic shapes a Python float made a tensor restarts it),
    the calls the abandoned attempt counted are taken back first, so a graph counts each of its
    sites once. (An attempt is told by the CompileContext object, which lives for one compile of
    a frame and all its attempts; compile ids start again after `torch._dynamo.reset()`.)"""
    import weakref

    from torch._guards import CompileContext

    context = CompileContext.try_get()
    if context is not None:
        ref, attempt, counted = _attempts.get(id(calls), (None, 0, []))
        if ref is None or ref() is not context:
            counted = []
        elif context.attempt > attempt:
            for was in counted:
                per_op = calls.get(was[0], {})
                per_op[was[1]] = per_op.get(was[1], 0) - 1
                if per_op.get(was[1]) == 0:
                    del per_op[was[1]]
                if not per_op:
                    calls.pop(was[0], None)
            counted = []
        if not _uncounted:
            counted.append((op, outcome))
        _attempts[id(calls)] = (weakref.ref(context), context.attempt, counted)
    count_into(calls, op, outcome)


def traced_object(object_id: int):
    """The object whose `id()` is `object_id`, asked for by a function dynamo runs at trace time
    (`torch.compiler.assume_constant_result`) while the trace that took the id holds the object,
    so it is alive at that address."""
    return ctypes.cast(object_id, ctypes.py_object).value


def head_name(model, default: str | None = None) -> str:
    """The LM head's qualified name in `model` (where a row about the loss is located); else
    `default`, else the model's class name."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is not None:
        for name, module in model.named_modules():
            if module is head and name:
                return name
    return default or type(model).__name__


def is_swapped(module) -> bool:
    bound = module.__dict__.get(forward_slot(module))
    return getattr(getattr(bound, "__func__", None), MARK, None) is not None


_signed: dict[tuple, types.FunctionType] = {}
_signed_lock = RLock()


def signed(func, cls: type, op: str):
    """A copy of `func` that shows `cls.forward`'s signature and name (cached per function and class).

    `inspect.signature(module.forward)` then reads as stock: Trainer uses it to choose dataset
    columns and whether to pass `num_items_in_batch`.
    """
    key = (func, cls)
    with _signed_lock:
        if key not in _signed:
            original = cls.forward
            copy = types.FunctionType(func.__code__, func.__globals__, "forward", func.__defaults__, func.__closure__)
            copy.__kwdefaults__ = func.__kwdefaults__
            copy.__signature__ = inspect.signature(original)
            copy.__doc__ = original.__doc__
            copy.__qualname__ = f"{cls.__qualname__}.forward"
            copy.__module__ = func.__module__
            copy.__wrapped__ = original
            setattr(copy, MARK, op)
            setattr(copy, SIGNED_ATTR, (func, cls, op))
            _signed[key] = copy
        return _signed[key]


def made_by(factory):
    """Decorate a factory of swapped forwards (one function per arguments, cached by the factory):
    every function it returns remembers the call that made it, so a pickled model makes it again."""
    @functools.wraps(factory)
    def make(*args, **kwargs):
        func = factory(*args, **kwargs)
        if MADE_ATTR not in func.__dict__:
            setattr(func, MADE_ATTR, (make, args, kwargs))
        return func

    return make


def rebind(made, func, cls: type, op: str, obj):
    """The bound forward a swap installed, made again (what a pickled swapped module loads):
    `made`: (factory, args, kwargs) of `func`'s factory, or None when `func` is a module-level one."""
    if made is not None:
        factory, args, kwargs = made
        func = factory(*args, **kwargs)
    return types.MethodType(signed(func, cls, op), obj)


def single_input(cls: type) -> str | None:
    """The name of the one input of `cls.forward`, or None when it takes more (or fewer) arguments."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    required = [p for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    others = [p for p in params if p not in required and p.kind not in (p.VAR_KEYWORD,)]
    if len(required) == 1 and not others:
        return required[0].name
    return None


def the_input(args, kwargs):
    """The single input of a one-argument forward, passed by position or by keyword."""
    if args:
        return args[0]
    (value,) = kwargs.values()
    return value


def _method_reducer(other):
    """A reducer for bound methods: a swap's forwards as `rebind` (see the module docstring),
    every other method by `other` (the reducer it replaces), else as Python pickles them."""
    def reduce(method):
        signed_as = getattr(method.__func__, SIGNED_ATTR, None)
        if signed_as is None:
            return other(method) if other is not None else method.__reduce__()
        func, cls, op = signed_as
        made = getattr(func, MADE_ATTR, None)
        return rebind, (made, None if made is not None else func, cls, op, method.__self__)

    return reduce


def _register_reducers() -> None:
    copyreg.pickle(types.MethodType, _method_reducer(copyreg.dispatch_table.get(types.MethodType)))
    # multiprocessing's pickler puts its own reducer for methods over copyreg's table
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler.register(types.MethodType,
                            _method_reducer(getattr(ForkingPickler, "_extra_reducers", {}).get(types.MethodType)))


_register_reducers()
