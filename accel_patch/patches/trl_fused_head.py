"""The TRL patch: accel-patch's fused loss in the place of the LM head TRL's trainers install.

Target `trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)`,
verified on trl 1.16. TRL's trainers (SFT, DPO, KTO, GRPO, ...) call it at the end of their
`__init__`, after `Trainer.__init__` (so after the callback's swap): it rebinds `model.forward`, and
calls with `fused_lm_head=True` run the backbone and TRL's own chunked head instead of the model's
forward, so the loss swapped into the model's head would never run. After TRL's call this patch:

1. Swaps the kernels into a model TRL gives a head that has none yet: the reference model, which
   the Trainer callback never sees (DPO, KTO and GRPO keep it in `trainer.ref_model`). It gets the
   ops of its own trainer's policy (the trainer whose set-up installs both heads), else
   ACCEL_PATCH_KERNELS'. Stock
   policy and reference then compute the same function again (DPO's step-1 rewards are 0).
2. Where TRL asks for fields our head gives (KNOWN_OUTPUTS: log_probs always; entropy,
   log_sum_sq_probs, mean_logits, is_top1 as asked: SFT, DPO, KTO, GRPO, RLOO and the reference
   models' log_probs only), puts accel-patch's head in front of TRL's. A call with
   `fused_lm_head=True` then runs the backbone as TRL does and `swaps.loss.token_logprobs` on the
   labelled positions (fused kernel, no full logits; the other fields in one chunked pass, the
   entropy with a gradient that runs only when the loss uses it, as GRPO's entropy bonus),
   returning TRL's `FusedCausalLMOutput`. TRL's temperature divides the logits as in TRL's head.
   Under no_grad (reference passes) nothing is kept; evaluation mode runs ours too, so policy and
   reference always run the same head. Everything else goes to TRL's head: a model without the
   swapped fused loss (or restored), a LoRA adapter on the head, FSDP2 (DTensor) or ZeRO-3
   (partitioned) head weights, a temperature together with soft-capping; each call counted in the
   swap state. MoE router logits run ours: the backbone returns them and our head adds the
   load-balancing loss TRL's adds, as `aux_loss`.
3. A field our head does not give keeps TRL's head: the swap report lists fused_linear_cross_entropy
   as refused (located at the LM head) with that reason, and says which head runs ("LM head:
   TRL's"), so the report and the first training log never claim a loss that does not run.

A TRL without `add_fused_lm_head` (or with another signature) leaves the patch skipped: its
trainers then call the model's own forward, where the swapped loss runs. A failure while taking
TRL's place is recorded in `status()` and leaves TRL's head as TRL installed it. Undo: the
registry puts back `add_fused_lm_head` (also in the trainer modules that imported it by name);
a model already given our head sends every call to TRL's once its kernels are restored.
"""
from __future__ import annotations

import sys

from ..core import registry



def _log():
    import logging  # not at import: `import accel_patch` stays cheap (logging and inspect cost ~9 ms)

    return logging.getLogger("accel_patch")


SWITCH = "ACCEL_PATCH_TRL"
PARAMETERS = ("model", "temperature", "cast_lm_head_to_fp32", "outputs")
FIELDS = ("loss", "log_probs", "entropy", "is_top1", "label_mask")
#: The per-token `outputs` our head computes (trl 1.16's names): log_probs always, the rest when asked
#: (SFT: entropy, is_top1; DPO: + mean_logits, log_sum_sq_probs with WPO weighting; KTO: entropy,
#: mean_logits; GRPO: entropy, with a gradient where its entropy bonus trains on it; references: log_probs).
KNOWN_OUTPUTS = frozenset({"log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"})
OURS = "accel-patch's fused loss in TRL's place"
#: The outcomes our head counts: a training call, and a call under no_grad (a reference model's, the
#: old policy's log-probs of GRPO, evaluation), which keeps nothing for backward.
FUSED_CALL = "fused (in TRL's head)"
FUSED_NO_GRAD = "fused (in TRL's head, no grad)"
#: `_why_not`'s answer for a call without fused_lm_head: neither head's business (not counted).
PLAIN = object()
TRLS = "TRL's"


class TrlFusedHeadPatch(registry.Patch):
    name = "trl-fused-head"
    module = "trl.trainer.utils"
    target = "trl.trainer.utils.add_fused_lm_head: accel-patch's fused loss in TRL's LM head, kernels in the reference model"
    verified = "trl 1.16"
    switch = SWITCH
    pending = "binds when `trl.trainer.utils` is imported: TRL's trainers import it (the demo does not use TRL)"

    def __init__(self) -> None:
        super().__init__()
        self.output_class = None
        self.wrapped = None  # the FunctionWrapper now in trl.trainer.utils
        # (the trainer that installed it, its policy's ops): that trainer's reference model gets the same
        self.last_ops = None

    def check(self, module) -> str | None:
        import inspect

        fn = getattr(module, "add_fused_lm_head", None)
        if fn is None:
            return "trl.trainer.utils has no add_fused_lm_head: TRL's trainers call the model's own forward"
        try:
            params = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            return "add_fused_lm_head has no readable signature"
        if params != PARAMETERS:
            return f"add_fused_lm_head takes {params}, not {PARAMETERS} (verified on {self.verified})"
        out = getattr(module, "FusedCausalLMOutput", None)
        missing = [f for f in FIELDS if f not in getattr(out, "__dataclass_fields__", {})]
        if out is None or missing:
            return f"trl.trainer.utils.FusedCausalLMOutput lacks {missing or 'itself'} (verified on {self.verified})"
        return None

    def install(self, module) -> None:
        import inspect

        original = module.__dict__["add_fused_lm_head"]
        self.output_class = module.FusedCausalLMOutput
        signature = inspect.signature(original)

        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            if not self.installed:  # a trainer module kept the wrapper by name after disable()
                return result
            try:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                _after_trl(self, **bound.arguments)
            except Exception as exc:  # TRL's head stays as TRL installed it
                registry.set_state(self.name, registry.FAILED, f"taking TRL's LM head's place failed, TRL's head runs: "
                                   f"{type(exc).__name__}: {exc}")
                _log().warning("accel_patch: taking TRL's LM head's place failed, TRL's head runs: %s: %s",
                            type(exc).__name__, exc)
            return result

        self.wrap(module, "add_fused_lm_head", wrapper)
        self.wrapped = module.__dict__["add_fused_lm_head"]
        # Trainer modules imported before the patch bound hold the original by name.
        for mod in _trl_modules(module):
            if mod.__dict__.get("add_fused_lm_head") is original:
                self.wrap(mod, "add_fused_lm_head", wrapper)

    def uninstall(self) -> None:
        # Trainer modules imported after the patch bound took the wrapper by name (`from .utils
        # import add_fused_lm_head`): they get the original back too.
        if self._saved and self.wrapped is not None:
            original = self.wrapped.__wrapped__
            for mod in _trl_modules(None):
                if mod.__dict__.get("add_fused_lm_head") is self.wrapped:
                    mod.__dict__["add_fused_lm_head"] = original
        self.wrapped = None
        super().uninstall()


def _trl_modules(besides):
    return [m for name, m in list(sys.modules.items())
            if (name == "trl" or name.startswith("trl.")) and m is not besides and isinstance(m, type(sys))]


def _after_trl(patch: TrlFusedHeadPatch, model, temperature, cast_lm_head_to_fp32, outputs) -> None:
    import types

    from ..swaps import sites, swap_kernels
    from ..swaps.loss.site import OP
    from ..swaps.ops import ops_from_env

    state = model.__dict__.get(sites.STATE_ATTR)
    trainer = _calling_trainer()
    if state is None:  # the reference model: the callback never sees it
        ops = ops_from_env()
        if patch.last_ops is not None and trainer is not None and patch.last_ops[0]() is trainer:
            ops = patch.last_ops[1]  # its own trainer's policy's ops, never another trainer's
        patch.last_ops = None
        if ops == ():
            return
        swap_kernels(model, ops)
        state = model.__dict__.get(sites.STATE_ATTR)
        if state is None:
            return
    else:
        patch.last_ops = (_weak(trainer), tuple(sorted(state.ops)))
    trl_forward = model.__dict__.get("forward")
    if trl_forward is None:
        return
    if OP not in state.counts:  # no fused loss swapped (refused, or not asked for): TRL's head, said so
        state.head = TRLS
        return
    outputs = tuple(outputs)
    unknown = [o for o in outputs if o not in KNOWN_OUTPUTS]
    if unknown:
        state.counts.pop(OP)
        state.refused.append(_refusal(model, f"TRL's fused LM head runs (add_fused_lm_head outputs={outputs}: "
                                             f"accel-patch's head gives {sorted(KNOWN_OUTPUTS)}, not {unknown})"))
        state.head = TRLS
        _log().info("accel_patch: %s: TRL's fused LM head runs (outputs %s), not accel-patch's fused loss",
                 type(model).__name__, outputs)
        return
    model.__dict__["forward"] = types.MethodType(_our_head(patch, model, trl_forward, temperature,
                                                           cast_lm_head_to_fp32, outputs), model)
    state.head = OURS
    _log().info("accel_patch: %s: %s (TRL's add_fused_lm_head, outputs %s)", type(model).__name__, OURS, outputs)


def _calling_trainer():
    """The object whose method called `add_fused_lm_head` (TRL's trainer: it installs the policy's
    head, then its reference model's), or None: the first frame outside accel-patch and wrapt."""
    import os

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(package + os.sep) and f"{os.sep}wrapt{os.sep}" not in filename:
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _weak(obj):
    """A weak reference to `obj` (a function returning None when there is none)."""
    import weakref

    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: None


def _refusal(model, reason: str):
    from ..swaps import sites
    from ..swaps.loss.site import OP
    from ..swaps.report import Refusal

    return Refusal(sites.head_name(model, "lm_head"), OP, reason)


def _our_head(patch, model, trl_forward, temperature, fp32, outputs):
    """The forward in front of TRL's: fused calls through accel-patch's loss when it can run."""
    import functools

    config = model.config.get_text_config()
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = _logit_scale(config)

    @functools.wraps(type(model).forward)  # the signature Trainer and generate read, as TRL's
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        why = _why_not(self, fused_lm_head, labels, shift_labels, kwargs, softcap, temperature)
        if why is not None:
            if why is not PLAIN:
                state = self.__dict__.get(_state_attr())
                if state is not None:
                    state.count_call(f"TRL's head: {why}")
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        return _fused_call(patch, self, args, kwargs, labels, shift_labels, num_items_in_batch, scale / temperature,
                           softcap, fp32, outputs)

    return forward


def _state_attr():
    from ..swaps.sites import STATE_ATTR

    return STATE_ATTR


def _logit_scale(config) -> float:
    """The factor TRL's head applies to the logits before soft-capping (trl 1.16's rule)."""
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    return 1.0 if scale is None else float(scale)


def _why_not(model, fused_lm_head, labels, shift_labels, kwargs, softcap, temperature):
    """Whose head runs this call: None for accel-patch's; PLAIN for a call without fused_lm_head
    (TRL passes it to the model's forward, uncounted); else a `Refused` with why TRL's does."""
    from ..swaps import sites
    from ..swaps.loss.head import head_plan
    from ..swaps.loss.site import OP

    if not fused_lm_head:
        return PLAIN
    if not patch.installed:
        return sites.Refused("accel-patch's TRL patch is disabled")
    state = model.__dict__.get(_state_attr())
    if state is None or OP not in state.ops or OP not in state.counts:
        return sites.Refused("no fused loss swapped into the model")
    if (labels if shift_labels is None else shift_labels) is None:
        return sites.Refused("no labels")
    if _router_loss(model, kwargs) and "aux_loss" not in getattr(patch.output_class, "__dataclass_fields__", {}):
        return sites.Refused("MoE router logits (this TRL's output has no aux_loss field)")
    if softcap is not None and temperature != 1.0:
        return sites.Refused("a temperature together with logit soft-capping")
    leaf, why = head_plan(model.get_output_embeddings())
    if leaf is None:
        return sites.Refused(why)
    for p in (leaf.weight, leaf.bias):
        if p is not None and (hasattr(p, "ds_id") or sites.is_dtensor(p)):
            return sites.Refused("a sharded or partitioned head weight (FSDP2 DTensor, DeepSpeed ZeRO-3): TRL gathers it")
    return None


def _fused_call(patch, model, args, kwargs, labels, shift_labels, num_items_in_batch, scale, softcap, fp32, outputs):
    """What TRL's head returns for a fused call, through accel-patch's fused loss."""
    import torch

    from ..swaps.loss.head import head_plan
    from ..swaps.loss.token_logprobs import token_logprobs

    kwargs["use_cache"] = False
    router = _router_loss(model, kwargs)
    if router:  # as TRL's head and the model's own forward: the router logits the config asks for
        kwargs.setdefault("output_router_logits", True)
    backbone = model.base_model(*args, **kwargs)
    hidden = backbone.last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    leaf, _ = head_plan(model.get_output_embeddings())
    hidden, labels = hidden.to(leaf.weight.device), labels.to(leaf.weight.device)
    fields = token_logprobs(hidden, leaf.weight, leaf.bias, labels, scale=scale, softcap=softcap, fp32=fp32,
                            outputs=outputs)
    mask = labels != -100
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -fields["log_probs"].sum() / torch.as_tensor(count, device=mask.device)
    extra = {}
    if router:
        config = model.config.get_text_config()
        aux_loss = _load_balancing_loss(model, config, backbone.router_logits, kwargs.get("attention_mask"))
        loss = loss + getattr(config, "router_aux_loss_coef", 0.0) * aux_loss.to(loss.device)
        extra["aux_loss"] = aux_loss
    model.__dict__[_state_attr()].count_call(FUSED_CALL if torch.is_grad_enabled() else FUSED_NO_GRAD)
    return patch.output_class(loss=loss, label_mask=mask, **fields, **extra)


def _router_loss(model, kwargs) -> bool:
    """Whether this call adds an MoE router's load-balancing loss (asked for, or the config's default)."""
    asked = kwargs.get("output_router_logits")
    if asked is not None:
        return bool(asked)
    return bool(getattr(model.config.get_text_config(), "output_router_logits", False))


def _load_balancing_loss(model, config, router_logits, attention_mask):
    """The auxiliary loss TRL's head adds (trl 1.16: Mixtral's load_balancing_loss_func, the one every
    MoE family of transformers uses), on the router logits the backbone returned."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = next((v for v in (getattr(config, "num_experts", None), getattr(config, "num_local_experts", None),
                                getattr(model, "num_experts", None)) if v), None)
    return load_balancing_loss_func(router_logits, experts, config.num_experts_per_tok, attention_mask)


patch = TrlFusedHeadPatch()
registry.register(patch)
