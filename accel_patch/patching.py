"""The patch registry: bind each patch when its target module is imported, record what happened,
undo exactly.

A patch reads like an OpenTelemetry instrumentor: the module it targets, the versions it was
verified on, a shape guard, the wrappers, and the undo. Nothing here imports torch,
transformers or accelerate; patches bind through wrapt post-import hooks (at once when the target
is already imported). A patch that raises while binding is recorded as failed, logged once, and
leaves its target untouched: it never breaks the user's import.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable, ClassVar

import wrapt

logger = logging.getLogger("accel_patch")

ACTIVE, PENDING, SKIPPED, FAILED, TOO_LATE, DISABLED = (
    "active", "pending", "skipped", "failed", "too-late", "disabled",
)


@dataclass(frozen=True)
class PatchStatus:
    """One patch as the user sees it in `accel_patch.status()`."""

    name: str
    state: str  # active, pending, skipped, failed, too-late, disabled
    reason: str
    target: str
    verified: str  # versions the patch was verified on

    def __str__(self) -> str:
        return f"{self.name:<14} {self.state:<9} {self.reason}"


class Patch:
    """Base of every patch: subclasses set the class attributes and implement `check` and `install`.

    `install` wraps attributes with `self.wrap(owner, name, wrapper)`; `uninstall` (shared) puts
    back the exact objects from the owners' `__dict__`, or deletes what the patch added.
    """

    name: ClassVar[str]
    module: ClassVar[str]  # the module whose import binds the patch
    target: ClassVar[str]  # what it patches, for humans
    verified: ClassVar[str]  # versions it was verified on
    switch: ClassVar[str]  # env variable that turns this patch off with "0"

    def __init__(self) -> None:
        self._saved: list[tuple[type, str, object, bool]] = []

    def check(self, module) -> str | None:
        """Shape guard: a reason to skip when the target moved, else None."""
        raise NotImplementedError

    def too_late(self, module) -> str | None:
        """A reason when what the patch governs already happened before it bound, else None."""
        return None

    def install(self, module) -> None:
        raise NotImplementedError

    def wrap(self, owner: type, attr: str, wrapper: Callable) -> None:
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


_lock = threading.RLock()
_patches: dict[str, Patch] = {}
_states: dict[str, tuple[str, str]] = {}
_hooked: set[str] = set()
_enabled = False
_logged: set[str] = set()


def register(patch: Patch) -> None:
    """Add a patch to the registry (pending until enabled and its module is imported)."""
    with _lock:
        _patches[patch.name] = patch
        _states.setdefault(patch.name, (PENDING, f"waiting for `import {patch.module}`"))


def _set(name: str, state: str, reason: str) -> None:
    _states[name] = (state, reason)
    if state == FAILED and name not in _logged:
        _logged.add(name)
        logger.warning("accel_patch: patch %s failed and was skipped: %s", name, reason)


def _bind(patch: Patch, module) -> None:
    """Install one patch on its freshly imported module; never raises."""
    with _lock:
        if not _enabled or _states[patch.name][0] == ACTIVE:
            return
        if os.environ.get(patch.switch, "").strip() == "0":
            _set(patch.name, SKIPPED, f"turned off by {patch.switch}=0")
            return
        try:
            reason = patch.check(module)
            if reason:
                _set(patch.name, SKIPPED, reason)
                return
            reason = patch.too_late(module)
            if reason:
                _set(patch.name, TOO_LATE, reason)
                return
            patch.install(module)
            _set(patch.name, ACTIVE, f"patched {patch.target}")
        except Exception as exc:  # a hook that raises would break the user's import
            try:
                patch.uninstall()
            except Exception:
                pass
            _set(patch.name, FAILED, f"{type(exc).__name__}: {exc}")


def _on_import(module) -> None:
    for patch in list(_patches.values()):
        if patch.module == module.__name__:
            _bind(patch, module)


def enable() -> None:
    """Bind every registered patch: now if its module is imported, else when it is. Idempotent."""
    global _enabled
    with _lock:
        _enabled = True
        for patch in _patches.values():
            if _states[patch.name][0] in (DISABLED, SKIPPED, FAILED, TOO_LATE):
                _states[patch.name] = (PENDING, f"waiting for `import {patch.module}`")
            if patch.module in sys.modules:
                _bind(patch, sys.modules[patch.module])
            elif patch.module not in _hooked:
                # wrapt keeps hooks forever; _bind checks _enabled, so one registration suffices.
                _hooked.add(patch.module)
                wrapt.register_post_import_hook(_on_import, patch.module)


def disable() -> None:
    """Undo every active patch, restoring the exact original objects. Idempotent."""
    global _enabled
    with _lock:
        _enabled = False
        for patch in _patches.values():
            state = _states[patch.name][0]
            if state == ACTIVE:
                patch.uninstall()
            _set(patch.name, DISABLED, "accel_patch.disable() was called")


def status() -> list[PatchStatus]:
    """One record per registered patch: name, state, reason, target, verified versions."""
    with _lock:
        return [
            PatchStatus(p.name, *_states[p.name], target=p.target, verified=p.verified)
            for p in _patches.values()
        ]
