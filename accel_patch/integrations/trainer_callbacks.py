"""Every `transformers.Trainer` gets one `AccelPatchCallback`, first in its callback list.

The callback's automatic registration lives here, beside the callback, rather than among the
patches: it is how the callback gets in (a way in), and it needs the callback's class, while
patches/ and integrations/ never import each other.

Binds when `transformers.trainer` is imported (every Trainer, TRL's too, comes from there) and
wraps `transformers.trainer_callback.CallbackHandler.__init__` and `.add_callback` (Trainer and
TRL's trainers build their callbacks through them). After `__init__`, the handler holds exactly one
AccelPatchCallback, first but for transformers' DefaultFlowCallback (which reads no logs, and which
transformers' code and tests expect at the head): the one the user passed, else an automatic
one. `add_callback` of an AccelPatchCallback replaces the automatic one and never adds a second.
First, because Trainer sends `logs` to report_to integrations (callbacks themselves) in list
order: keys written before them reach TensorBoard, W&B and the rest. ACCEL_PATCH_CALLBACK=0 turns
the automatic one off.

The automatic one (`callback.AutomaticCallback`) is also put last in
`transformers.trainer.DEFAULT_CALLBACKS` (after DefaultFlowCallback), where transformers keeps
the callbacks every Trainer gets: code that lists a Trainer's callbacks as
`DEFAULT_CALLBACKS + [...]` (transformers' own tests do) finds it there. Undo: taken out again.
"""
from __future__ import annotations

from ..core import registry


def _arrange(handler, explicit=None) -> None:
    """One AccelPatchCallback in handler.callbacks, `explicit`, a user's, or an automatic one, first
    but for transformers' DefaultFlowCallbacks leading the list (they read no logs; transformers'
    own code and tests take the list's head for its DefaultFlowCallback)."""
    from transformers.trainer_callback import DefaultFlowCallback

    from .callback import AccelPatchCallback, AutomaticCallback

    ours = [cb for cb in handler.callbacks if isinstance(cb, AccelPatchCallback)]
    users = [cb for cb in ours if not cb.automatic]
    keep = explicit or (users[0] if users else (ours[0] if ours else None))
    if keep is None:
        keep = AutomaticCallback()
    rest = [cb for cb in handler.callbacks if not isinstance(cb, AccelPatchCallback)]
    lead = 0
    while lead < len(rest) and isinstance(rest[lead], DefaultFlowCallback):
        lead += 1
    handler.callbacks[:] = rest[:lead] + [keep] + rest[lead:]


class TrainerCallbackPatch(registry.Patch):
    name = "trainer-callback"
    # bound once transformers.trainer has run whole: its DEFAULT_CALLBACKS exists, and the
    # CallbackHandler it imported from transformers.trainer_callback is the class wrapped
    module = "transformers.trainer"
    target = ("transformers.trainer_callback.CallbackHandler.__init__ and .add_callback; "
              "transformers.trainer.DEFAULT_CALLBACKS")
    verified = "transformers 5.17, 5.24, 5.25; trl 1.16"
    switch = "ACCEL_PATCH_CALLBACK"

    def __init__(self) -> None:
        super().__init__()
        self._defaults = None  # transformers.trainer.DEFAULT_CALLBACKS, with the automatic callback in it

    def check(self, module) -> str | None:
        cls = getattr(module, "CallbackHandler", None)
        if cls is None:
            return "transformers.trainer has no CallbackHandler"
        for attr in ("__init__", "add_callback"):
            if attr not in cls.__dict__:
                return f"CallbackHandler.{attr} is gone (verified on {self.verified})"
        if not isinstance(getattr(module, "DEFAULT_CALLBACKS", None), list):
            return f"transformers.trainer has no DEFAULT_CALLBACKS list (verified on {self.verified})"
        return None

    def install(self, module) -> None:
        from .callback import AccelPatchCallback, AutomaticCallback

        def init_wrapper(wrapped, instance, args, kwargs):
            wrapped(*args, **kwargs)
            _arrange(instance)

        def add_wrapper(wrapped, instance, args, kwargs):
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
        if AutomaticCallback not in module.DEFAULT_CALLBACKS:
            module.DEFAULT_CALLBACKS.append(AutomaticCallback)
        self._defaults = module.DEFAULT_CALLBACKS

    def uninstall(self) -> None:
        if self._defaults is not None:
            from .callback import AutomaticCallback

            while AutomaticCallback in self._defaults:
                self._defaults.remove(AutomaticCallback)
            self._defaults = None
        super().uninstall()


patch = TrainerCallbackPatch()
registry.register(patch)
