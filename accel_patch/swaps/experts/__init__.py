"""MoE experts: a module holding every expert of a mixture-of-experts layer as 3-D parameters
(transformers' `use_experts_implementation` classes, Llama4's experts), run as one
`accel_kernels.moe_experts` call: grouped GEMMs over the tokens sorted by expert, the GLU and the
routing weight fused, a backward that recomputes instead of saving.

    site.py       the candidate test (by structure), the probe verdict (by numbers, against the
                  module's own forward), the swapped forward decided per call and counted
    adapters.py   PEFT's LoRA on the experts' parameters (ParamWrapper) read as the op's split-LoRA
                  factors: W + B A is never formed

The router, its auxiliary loss and shared experts are not touched here (shared experts are gated
MLPs: the layers/ and lora/ sites). These modules import the shared machinery of swaps/ (sites,
probe, report, families), layers/mlp.py (the activation a module declares) and
layers/tiled_mlp.py (the rule that tiles a long call over tokens), and accel_kernels; never
another room's modules.
"""
from .site import OP, SITE_ATTR, ExpertsPlan, Site, candidate, forward, install, probe_verdict
