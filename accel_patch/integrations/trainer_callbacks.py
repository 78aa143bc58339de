"""Every `transformers.Trainer` gets one `AccelPatchCallback`, at the head of its callback list.

The callback's automatic registration lives here, beside the callback, rather than among the
patches: it is how the callback gets in (a way in), and it needs the callback's class, while
patches/ and integrations/ never import each other.

Wraps `transformers.trainer_callback.CallbackHandler.__init__` and `.add_callback` (Trainer and
TRL's trainers build their callbacks through them). After `__init__`, the handler holds exactly one
AccelPatchCallback, first: the one the user passed, else an automatic one. `add_callback` of an
AccelPatchCallback replaces the automatic one and never adds a second. First, because Trainer
sends `logs` to report_to integrations (callbacks themselves) in list order: keys written before
them reach TensorBoard, W&B and the rest. ACCEL_PATCH_CALLBACK=0 turns the automatic one off.
"""
from __future__ import annotations

from ..core import registry


def _arrange(handler, explicit=None) -> None:
    """One AccelPatchCallback at the head of handler.callbacks: `explicit`, a user's, or an automatic one."""
    from .callback import AccelPatchCallback

    ours = [cb for cb in handler.callbacks if isinstance(cb, AccelPatchCallback)]
    users = [cb for cb in ours if not cb.automatic]
    keep = explicit or (users[0] if users else (ours[0] if ours else None))
    if keep is None:
        keep = AccelPatchCallback()
        keep.automatic = True
    handler.callbacks[:] = [keep] + [cb for cb in handler.callbacks if not isinstance(cb, AccelPatchCallback)]


class TrainerCallbackPatch(registry.Patch):
    name = "trainer-callback"
    module = "transformers.trainer_callback"
    target = "transformers.trainer_callback.CallbackHandler.__init__ and .add_callback"
    verified = "transformers 5.17, 5.24; trl 1.16"
    switch = "ACCEL_PATCH_CALLBACK"

    def check(self, module) -> str | None:
        cls = getattr(module, "CallbackHandler", None)
        if cls is None:
            return "transformers.trainer_callback has no CallbackHandler"
        for attr in ("__init__", "add_callback"):
            if attr not in cls.__dict__:
                return f"CallbackHandler.{attr} is gone (verified on {self.verified})"
        if not hasattr(module, "TrainerCallback"):
            return "transformers.trainer_callback has no TrainerCallback"
        return None

    def install(self, module) -> None:
        def init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            _arrange(instance)

        def add_wrapper(wrapped, instance, args, kwargs):
            from .callback import AccelPatchCallback

            callback = args[0] if args else kwargs.get("callback")
            if isinstance(callback, type) and issubclass(callback, AccelPatchCallback):
                callback = callback()
            if isinstance(callback, AccelPatchCallback):
                existing = [cb for cb in instance.callbacks if isinstance(cb, AccelPatchCallback)]
                if any(not cb.automatic for cb in existing):
                    return None  # already one the user asked for: never two
                _arrange(instance, explicit=callback)
                return None
            return wrapped(*args, **kwargs)

        self.wrap(module.CallbackHandler, "__init__", init_wrapper)
        self.wrap(module.CallbackHandler, "add_callback", add_wrapper)


patch = TrainerCallbackPatch()
registry.register(patch)
