"""Tiny random models of several families, a padded batch, and one training step, for swap tests.

The models are the ones `accel-patch check` builds (accel_patch.cli.check.FAMILIES: a config of each
family, random weights, nothing downloaded). `FAMILIES` here says which op kinds the swap must put
in, and which it must refuse, for each: a test fails both when a swap is missing and when one
appears where the family computes something else.
"""
from __future__ import annotations

import copy

import torch

from accel_patch.cli import check

LORA = {"lora_mlp", "lora_qkv", "lora_o"}  # installed on every gated MLP and attention: decided per call
ALL = {"rms_norm", "rope", "glu", "fused_linear_cross_entropy", "tiled_mlp"} | LORA

# name: (ops swapped, ops refused, config overrides on top of accel_patch.cli.check's)
FAMILIES = {
    "llama": (ALL, set(), {}),
    "mistral": (ALL, set(), {}),
    "qwen2": (ALL, set(), {}),
    "qwen3": (ALL, set(), {}),  # per-head q/k norms
    "gemma": (ALL, set(), {}),  # (1 + w) norms, tanh-GELU
    "gemma2": (ALL, set(), {}),  # sandwich norms, final-logit soft-capping
    "phi3": (ALL, set(), {}),  # fused gate_up, partial rotary
    "olmo2": (ALL, set(), {}),  # full-width q/k norms, fp32 affine
    "granite": (ALL, set(), {"residual_multiplier": 0.5, "embedding_multiplier": 2.0}),  # logits / scaling
    "cohere": ({"glu", "fused_linear_cross_entropy", "tiled_mlp"} | LORA, {"rms_norm", "rope"}, {}),  # LayerNorm, interleaved RoPE
    "mixtral": ({"rms_norm", "rope", "fused_linear_cross_entropy", "lora_qkv", "lora_o", "experts"}, set(),  # 3-D experts, aux loss
                {"router_aux_loss_coef": 0.1}),
    "gpt_neox": ({"layer_norm", "rope", "fused_linear_cross_entropy", "lora_qkv", "lora_o"}, set(), {}),  # LayerNorm, partial rotary
}


def build(family: str, dtype=torch.float32, **overrides):
    return check.build_family(family, dtype, **{**FAMILIES[family][2], **overrides})


def pair(family: str, dtype=torch.float32, **overrides):
    """(stock, twin): two models with the same weights; swap the twin."""
    stock = build(family, dtype, **overrides)
    return stock, copy.deepcopy(stock)


def padded_batch():
    """Left padding (rows start with 0, 2, 4 pad tokens), labels ignored on the padding and on the
    first tokens of the first row (a prompt), as an SFT batch looks."""
    return check.padded_batch()


def training_step(model, batch, **kwargs):
    """(loss, {parameter name: gradient}, output) of one forward + backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def keeping_graphs(graphs: list, backend="aot_eager"):
    """A torch.compile backend that appends each graph dynamo hands it to `graphs`, then compiles
    it with `backend` (a name or a backend function): one trace gives both the compiled step and
    its graphs (a `torch._dynamo.explain` before the compile would trace the model again)."""
    import torch._dynamo

    compile_with = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    return lambda gm, example_inputs: graphs.append(gm) or compile_with(gm, example_inputs)
