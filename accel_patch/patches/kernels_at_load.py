"""The kernels-at-load patch: models returned by `from_pretrained` or `from_config` are swapped.

Target `transformers.PreTrainedModel.from_pretrained` and `._from_config` (which the Auto classes'
`from_config` call), verified on transformers 5.17 and 5.24. The model the load returns gets
`swap_kernels(model, ops)` before the caller sees it, with ops from ACCEL_PATCH_KERNELS (unset:
all; `0`/`none`: off; `rms_norm,rope`: those). A model built by calling its class is swapped only
by `swap_kernels` (or the Trainer callback), and so are its parts: a model that `from_config`
builds inside another model's constructor (a VLM's language and vision models) is a part of that
model, swapped with it as one, so the load hook leaves it alone. A swap that fails is recorded in `status()` and
logged once; the load itself always returns.

Also `PreTrainedModel.set_use_kernels` and `.reset_kernels` (where this transformers has them,
5.25): a model loaded with transformers' hub kernels on (its default when the `kernels` package
is installed) is kernelized again at every train()/eval() switch, which puts the hub kernel or
the class's own forward back on every `use_kernel_forward_from_hub` layer (the RMSNorms): without
this, the first `model.train()` of a Trainer silently dropped the norm kernels the load swapped
in (the report said "replaced after the swap"). After each such call the swap is put back on top
of what kernelize bound, which becomes its fall-back (swaps/apply.py: rebind_after_kernelize).
A model swapped by hand under ACCEL_PATCH_KERNELS=0 (this patch off) is not bound again.

Also `PreTrainedModel.set_experts_implementation`: a user who names the experts implementation
after the swap gets it. The swapped experts modules of that model then run their own forward,
which transformers dispatches to what the config now names, counted as the user's choice
(swaps/experts/site.py: hand_back); "accel_patch" keeps the op. Transformers' own switch during
`generate` (grouped_mm to batched_mm for decoding and back, `_optimize_model_for_decode`) is not
the user's: it changes nothing here.
Undo: the registry puts back every method wrapped.
"""
from __future__ import annotations

import os
import sys

from ..core import registry
from ..swaps.ops import OFF, SWITCH, ops_from_env


class KernelSwapPatch(registry.Patch):
    name = "kernels"
    module = "transformers.modeling_utils"
    target = ("transformers.PreTrainedModel.from_pretrained and ._from_config: swap kernels into the model returned; "
              ".set_use_kernels and .reset_kernels: the swap bound again after transformers kernelizes; "
              ".set_experts_implementation: the experts run the user's choice")
    verified = "transformers 5.17, 5.24 (set_use_kernels, reset_kernels: 5.25)"
    switch = SWITCH
    boolean_switch = False  # a list of ops, read by ops_from_env

    def check(self, module) -> str | None:
        cls = getattr(module, "PreTrainedModel", None)
        if cls is None:
            return "transformers.modeling_utils has no PreTrainedModel"
        for attr in ("from_pretrained", "_from_config"):
            if not isinstance(cls.__dict__.get(attr), classmethod):
                return f"PreTrainedModel.{attr} is not a classmethod (verified on {self.verified})"
        value = os.environ.get(SWITCH, "").strip()
        if value.lower() in OFF:  # the registry itself only knows "0"
            return f"turned off by {SWITCH}={value}"
        return None  # a list of ops is read, and checked, at each load

    def install(self, module) -> None:
        def load_wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
            _swap_loaded(model)
            return result

        def kernelize_wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            _rebind(instance)
            return result

        self.wrap(module.PreTrainedModel, "from_pretrained", load_wrapper)
        self.wrap(module.PreTrainedModel, "_from_config", load_wrapper)
        for attr in ("set_use_kernels", "reset_kernels"):  # transformers' re-kernelization (5.25)
            if callable(getattr(module.PreTrainedModel, attr, None)):
                self.wrap(module.PreTrainedModel, attr, kernelize_wrapper)

        def experts_wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            if not _in_decode_switch():
                _hand_back(instance)
            return result

        if callable(getattr(module.PreTrainedModel, "set_experts_implementation", None)):
            self.wrap(module.PreTrainedModel, "set_experts_implementation", experts_wrapper)

    def detail(self) -> str | None:
        apply = sys.modules.get("accel_patch.swaps.apply")
        return apply.history_summary() if apply is not None else None


def _inside_a_model_constructor(model) -> bool:
    """Whether `model` is being built by another PreTrainedModel's `__init__` (a part of it)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and _is_pretrained_model(owner):
                return True
        frame = frame.f_back
    return False


def _is_pretrained_model(obj) -> bool:
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(obj, modeling.PreTrainedModel)


def _rebind(model) -> None:
    """After transformers kernelized `model` again: its swap back on top; never raises."""
    apply = sys.modules.get("accel_patch.swaps.apply")
    if apply is None:
        return  # nothing was ever swapped in this process
    try:
        apply.rebind_after_kernelize(model)
    except Exception as exc:  # the user's train()/eval() must succeed whatever happens here
        registry.set_state(patch.name, registry.FAILED, f"binding the kernels of {type(model).__name__} again "
                           f"after transformers' kernelize failed: {type(exc).__name__}: {exc}")


#: transformers' switch of the experts implementation around decoding (generation/utils.py), whose
#: calls of set_experts_implementation are its own, not the user's
DECODE_SWITCH = "_optimize_model_for_decode"


def _in_decode_switch() -> bool:
    frame = sys._getframe(2)
    for _ in range(8):  # the switch calls set_experts_implementation itself: a few frames up at most
        if frame is None:
            return False
        if frame.f_code.co_name == DECODE_SWITCH:
            return True
        frame = frame.f_back
    return False


def _hand_back(model) -> None:
    """After the user named `model`'s experts implementation: its swapped experts run it; never raises."""
    site = sys.modules.get("accel_patch.swaps.experts.site")
    if site is None:
        return  # no experts site was ever made in this process
    try:
        site.hand_back(model)
    except Exception as exc:  # the user's call must succeed whatever happens here
        registry.set_state(patch.name, registry.FAILED, f"handing {type(model).__name__}'s experts to the "
                           f"implementation set after the swap failed: {type(exc).__name__}: {exc}")


def _swap_loaded(model) -> None:
    """Swap a freshly loaded model; never raises into the load."""
    try:
        if _inside_a_model_constructor(model):
            return  # a part: swapped with the model it belongs to
        ops = ops_from_env()
        if ops == ():
            return
        from ..swaps import swap_kernels

        swap_kernels(model, ops)
        from ..swaps.ops import bad_names

        problem = bad_names()
        if problem:  # the bad names were skipped, the rest swapped: status says which
            registry.set_state(patch.name, registry.ACTIVE, f"patched {patch.target}; {problem}")
        elif registry.state_of(patch.name) == registry.FAILED or "unknown kernel op" in registry.reason_of(patch.name):
            registry.set_state(patch.name, registry.ACTIVE, f"patched {patch.target}")
    except Exception as exc:  # the user's load must succeed whatever happens here
        registry.set_state(patch.name, registry.FAILED, f"swapping kernels into {type(model).__name__} failed: "
                           f"{type(exc).__name__}: {exc}")


patch = KernelSwapPatch()
registry.register(patch)
