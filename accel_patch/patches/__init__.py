"""Patches: one module per wrapped target, each read like an OpenTelemetry instrumentor (the
module it binds on, the versions it was verified on, a shape guard, the wrappers, the undo).

    accelerate_state.py   accelerate's `PartialState.__init__` / `_prepare_backend`
    model_loading.py      `PreTrainedModel.from_pretrained`: the rank's own device map
    kernels_at_load.py    `PreTrainedModel.from_pretrained` / `_from_config`: kernels swapped into
                          the model returned
    experts_interface.py  transformers' ExpertsInterface: `experts_implementation="accel_patch"`
    trl_fused_head.py     TRL's `add_fused_lm_head`: our fused loss in the place of TRL's LM head
                          (SFT), the reference model's kernels (DPO, KTO, GRPO)

Each module registers its patch with the core's registry when imported (`import accel_patch`
does). Patches import the core and swaps/, never integrations/ or cli/; what a patch decided is
read by others through `core.registry.last_decision`, not by importing the patch.
"""
