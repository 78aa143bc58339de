"""The patch registry: bind each patch when its target module is imported, record what happened
(its state, and the last decision it made), undo exactly.

A patch reads like an OpenTelemetry instrumentor: the module it targets, the versions it was
verified on, a shape guard, the wrappers, and the undo. Nothing here imports torch,
transformers or accelerate, and `import accel_patch` must stay cheap: the post-import hook is a
small meta-path finder of our own (wrapt's package import alone costs ~100 ms), and wrapt is
imported only when a patch installs, which happens while its heavy target is being imported
anyway. A patch that raises while binding is recorded as failed, logged once, and leaves its
target untouched: it never breaks the user's import.
"""
from __future__ import annotations

import os
import sys
from _thread import RLock
from collections import namedtuple

ACTIVE, PENDING, SKIPPED, FAILED, TOO_LATE, DISABLED = (
    "active", "pending", "skipped", "failed", "too-late", "disabled",
)


class PatchStatus(namedtuple("PatchStatus", "name state reason target verified")):
    """One patch as the user sees it in `accel_patch.status()`: state is one of active, pending,
    skipped, failed, too-late, disabled; `verified` names the versions it was verified on."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self.name:<16} {self.state:<9} {self.reason}"


class Patch:
    """Base of every patch: subclasses set the class attributes and implement `check` and `install`.

    `install` wraps attributes with `self.wrap(owner, name, wrapper)`; `uninstall` (shared) puts
    back the exact objects from the owners' `__dict__`, or deletes what the patch added.
    """

    # Class attributes of every patch (typing.ClassVar is not imported: import must stay cheap).
    name: str
    module: str  # the module whose import binds the patch
    target: str  # what it patches, for humans
    verified: str  # versions it was verified on
    switch: str  # env variable that turns this patch off with "0" (any false spelling: core/switches.py)
    #: A bad value of a safety switch stops at the patch's decision point (`require_switch`); the
    #: others warn and keep the patch on. False for a switch that is not on/off (ACCEL_PATCH_KERNELS).
    safety = False
    boolean_switch = True

    def __init__(self) -> None:
        self._saved: list[tuple[type, str, object, bool]] = []

    @property
    def installed(self) -> bool:
        return bool(self._saved)

    def check(self, module) -> str | None:
        """Shape guard: a reason to skip when the target moved, else None."""
        raise NotImplementedError

    def too_late(self, module) -> str | None:
        """A reason when what the patch governs already happened before it bound, else None."""
        return None

    def install(self, module) -> None:
        raise NotImplementedError

    def detail(self) -> str | None:
        """What the patch has done since it bound, appended to its status reason (None: nothing)."""
        return None

    def wrap(self, owner: type, attr: str, wrapper) -> None:
        import wrapt

        had = attr in owner.__dict__
        original = owner.__dict__[attr] if had else getattr(owner, attr)
        self._saved.append((owner, attr, original, had))
        setattr(owner, attr, wrapt.FunctionWrapper(original, wrapper))

    def uninstall(self) -> None:
        while self._saved:
            owner, attr, original, had = self._saved.pop()
            if had:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)


_lock = RLock()
_patches: dict[str, Patch] = {}
_states: dict[str, tuple[str, str]] = {}
_enabled = False
_watching: frozenset[str] = frozenset()  # the patches' target modules, while enabled
_logged: set[str] = set()
_decisions: dict[str, object] = {}  # the last decision each patch made, for the ways in and the face


class _HookedLoader:
    """Runs the real loader, then binds the patches waiting for that module."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Put the real loader back first, so the module looks exactly as if never watched.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _on_import(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder:
    """A meta-path finder that only watches the patches' target modules."""

    def __init__(self) -> None:
        self._resolving: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        # Asked for every import in the process: answer the unwatched ones with one set lookup.
        if fullname not in _watching or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._resolving.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader)
        return spec


_finder = _PostImportFinder()


def _pending_reason(patch: Patch) -> str:
    # `accel-patch env` imports little, so a user sees "pending" there and "active" in training.
    return getattr(patch, "pending", None) or (
        f"binds when `{patch.module}` is imported; the demo and any training script import it")


def register(patch: Patch) -> None:
    """Add a patch to the registry (pending until enabled and its module is imported)."""
    global _watching
    with _lock:
        _patches[patch.name] = patch
        _states.setdefault(patch.name, (PENDING, _pending_reason(patch)))
        if _enabled:
            _watching = _watching | {patch.module}


def require_switch(patch: Patch) -> None:
    """At a safety patch's decision point: raise the BadSwitch of a bad value of its switch (read
    now, as every setting is read at decision time)."""
    from .switches import read

    read(patch.switch)


def set_state(name: str, state: str, reason: str) -> None:
    """Record a patch's state and why (a failure is logged once per patch)."""
    _states[name] = (state, reason)
    if state == FAILED and name not in _logged:
        import logging

        _logged.add(name)
        logging.getLogger("accel_patch").warning("accel_patch: patch %s failed and was skipped: %s", name, reason)


def _bind(patch: Patch, module) -> None:
    """Install one patch on its freshly imported module; never raises."""
    with _lock:
        if not _enabled or patch.installed:
            return
        if patch.boolean_switch:
            from .switches import BadSwitch, turned_off

            try:
                if turned_off(patch.switch):
                    set_state(patch.name, SKIPPED, f"turned off by {patch.switch}={os.environ[patch.switch]}")
                    return
            except BadSwitch as exc:
                if not patch.safety:
                    import logging

                    logging.getLogger("accel_patch").warning("accel_patch: %s; %s stays on", exc, patch.name)
                # a safety switch: installed, and its decision point raises while the value is bad
        try:
            reason = patch.check(module)
            if reason:
                set_state(patch.name, SKIPPED, reason)
                return
            late = patch.too_late(module)
            patch.install(module)
            # too-late: what already exists is left as it is; what is created from now on is patched.
            set_state(patch.name, TOO_LATE, late) if late else set_state(patch.name, ACTIVE, f"patched {patch.target}")
        except Exception as exc:  # a hook that raises would break the user's import
            try:
                patch.uninstall()
            except Exception:
                pass
            set_state(patch.name, FAILED, f"{type(exc).__name__}: {exc}")


def _on_import(module) -> None:
    for patch in list(_patches.values()):
        if patch.module == module.__name__:
            _bind(patch, module)


def enable() -> None:
    """Bind every registered patch: now if its module is imported, else when it is. Idempotent."""
    global _enabled, _watching
    with _lock:
        _enabled = True
        _watching = frozenset(p.module for p in _patches.values())
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        for patch in _patches.values():
            if patch.installed:
                continue
            _states[patch.name] = (PENDING, _pending_reason(patch))
            if patch.module in sys.modules:
                _bind(patch, sys.modules[patch.module])


def disable() -> None:
    """Undo every patch, restoring the exact original objects. Idempotent."""
    global _enabled, _watching
    with _lock:
        _enabled = False
        _watching = frozenset()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        # Newest first: two patches may wrap the same attribute, and each restores what it found.
        for patch in reversed(list(_patches.values())):
            patch.uninstall()
            set_state(patch.name, DISABLED, "accel_patch.disable() was called")


def record_decision(name: str, decision) -> None:
    """Keep the last decision patch `name` made (what the accelerate patch chose, what a load used)."""
    with _lock:
        _decisions[name] = decision


def last_decision(name: str):
    """The last decision patch `name` recorded, or None: how the Trainer callback and `accel-patch
    env` learn what a patch did without importing it."""
    with _lock:
        return _decisions.get(name)


def reason_of(name: str) -> str:
    """The reason recorded with a patch's state ("" when none)."""
    return _states.get(name, ("", ""))[1]


def state_of(name: str) -> str:
    """The state of one registered patch (active, pending, ...)."""
    with _lock:
        return _states[name][0]


def status() -> list[PatchStatus]:
    """One record per registered patch: name, state, reason, target, verified versions."""
    with _lock:
        records = []
        for p in _patches.values():
            state, reason = _states[p.name]
            detail = p.detail()
            records.append(PatchStatus(p.name, state, f"{reason}; {detail}" if detail else reason,
                                       target=p.target, verified=p.verified))
        return records
