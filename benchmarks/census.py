"""Which decoder-layer module classes accel-patch leaves stock, over tiny random-weight models of
the 2026 model families (and Llama, Qwen3, Qwen3-MoE, Mixtral as controls).

    python benchmarks/census.py                     # the table, the stock totals per kind, the mixers
    python benchmarks/census.py --json census.json  # the same data as JSON
    python benchmarks/census.py --families llama,qwen3_moe   # some families only (their keys: --list)

Each family is built from its configuration class (nothing downloaded) with small sizes: hidden 64,
a few heads, vocab 128, a few experts, and the fewest layers that still hold every layer type the
family's defaults name (hybrid patterns, dense and sparse MLP layers, RoPE and no-RoPE layers; at
most 8). Only sizes are shrunk: structural defaults (rope_interleave, gating, swiglu_limit,
n_groups, ...) stay as the family ships them. A family whose configuration cannot be built tiny is
listed as "not built: <error>"; one absent from this transformers as "absent".

`accel_patch.swap_kernels(model)` (all ops) then runs on CPU, and the swapped model trains one step
against a stock copy (float32, the same batch; kernels under Triton's interpreter where there is no
GPU): the loss's and every gradient's relative difference to stock are recorded (`step`), and the
report after the step (`after`: what ran, ops whose every call fell back under `not_run`).
`--no-step` skips it (the swap alone). Every module inside the decoder layers is classified by kind:
- norm: class name contains "Norm";
- experts: class name ends with "Experts";
- mlp: class name ends with "MLP" or contains "FeedForward" / "FFN" (not experts);
- rope: class name contains "Attention" and its forward names a RoPE function (a name with
  "rotary" or "rope" in it among the forward's code names, sizes such as qk_rope_head_dim aside).
Each (family, kind, class) is "swapped" (a swapped forward on some instance, whose op is named),
"refused: <reason>" (the report's refusal for that module path and the kind's op), or "silent"
(neither: no site was found there). After the step, a RoPE class whose swapped instances counted
calls and none of them ran the kernel is "not run" (stock in effect); an attention refused because
it never rotates (its RoPE call sits under a condition false for it) is "no rope": no RoPE site,
nothing left stock. The totals count, per kind, the distinct (family, class)
pairs left stock (refused or silent). The report's `mixers` (linear-attention and SSM mixers, which
no op covers) are printed per family. A family whose swap raises is "swap raised: <error>"; one whose step raises, "step raised: <error>".
Runs in about a minute or two on one CPU core.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the working tree's accel_patch

#: key -> (label, config class name, extra keyword arguments: per-family settings, applied last).
#: Extras set only what the tiny build needs (the shipped hybrid patterns where the default config
#: has a single layer type, experts where it has none).
FAMILIES = (
    ("gemma4", "Gemma 4", "Gemma4TextConfig", dict(global_head_dim=32)),
    ("gemma4_k_eq_v", "Gemma 4 (k=v, 1 global kv head)", "Gemma4TextConfig",
     dict(global_head_dim=32, attention_k_eq_v=True, num_global_key_value_heads=1)),
    ("qwen3_5", "Qwen3.5", "Qwen3_5TextConfig", {}),
    ("qwen3_5_moe", "Qwen3.5 MoE", "Qwen3_5MoeTextConfig", {}),
    ("qwen3_next", "Qwen3-Next", "Qwen3NextConfig", {}),
    ("deepseek_v3", "DeepSeek V3", "DeepseekV3Config", {}),
    ("deepseek_v32", "DeepSeek V3.2", "DeepseekV32Config", {}),
    ("deepseek_v4", "DeepSeek V4", "DeepseekV4Config", {}),
    ("glm5_next", "GLM-5-next", "Glm5NextTextConfig", {}),
    ("glm_moe_dsa", "GLM-MoE-DSA", "GlmMoeDsaConfig", {}),
    ("glm4_moe_lite", "GLM-4.7-flash", "Glm4MoeLiteConfig", {}),
    ("mistral4", "Mistral 4", "Mistral4Config", {}),
    ("mistral_large4", "Mistral Large 4", "MistralLarge4TextConfig", {}),
    ("kimi_linear", "Kimi Linear", "KimiLinearConfig", {}),
    ("minimax_m2", "MiniMax-M2", "MiniMaxM2Config", {}),
    ("olmo_hybrid", "Olmo hybrid", "OlmoHybridConfig", {}),
    ("flex_olmo", "FlexOlmo", "FlexOlmoConfig", {}),
    ("lfm2", "LFM2", "Lfm2Config", dict(layer_types=["conv", "full_attention"])),
    ("lfm2_moe", "LFM2-MoE", "Lfm2MoeConfig", dict(layer_types=["conv", "full_attention"], num_dense_layers=1)),
    ("lfm3", "LFM3", "Lfm3Config", {}),
    ("nemotron_h", "Nemotron-H", "NemotronHConfig", {}),
    ("granite_hybrid", "Granite 4 hybrid", "GraniteMoeHybridConfig",
     dict(layer_types=["linear_attention", "full_attention"])),
    ("falcon_h1", "Falcon-H1", "FalconH1Config", {}),
    ("longcat_flash", "LongCat-Flash", "LongcatFlashConfig", {}),
    ("exaone4_5", "EXAONE 4.5 text", "Exaone4Config", {}),
    ("apertus", "Apertus", "ApertusConfig", {}),
    ("ernie4_5_moe", "ERNIE 4.5 MoE", "Ernie4_5_MoeConfig", {}),
    ("hunyuan_moe", "Hunyuan MoE", "HunYuanMoEV1Config", {}),
    ("dots1", "dots1", "Dots1Config",  # the default has no experts: dots.llm1's layout, shrunk
     dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1)),
    ("ministral3", "Ministral 3", "Ministral3Config", {}),
    ("llama4", "Llama 4 (text)", "Llama4TextConfig", {}),
    ("gpt_oss", "gpt-oss", "GptOssConfig", {}),
    ("llama", "Llama (control)", "LlamaConfig", {}),
    ("qwen3", "Qwen3 (control)", "Qwen3Config", {}),
    ("qwen3_moe", "Qwen3-MoE (control)", "Qwen3MoeConfig", {}),
    ("mixtral", "Mixtral (control)", "MixtralConfig", {}),
)
KINDS = ("norm", "mlp", "experts", "rope")
#: The ops whose swap or refusal decides a kind's state (OWN_OPS, the first by default: a norm is
#: either op's site), and others that may sit on the same site.
KIND_OPS = {"norm": ("rms_norm", "layer_norm"), "mlp": ("glu", "tiled_mlp"), "experts": ("experts",), "rope": ("rope",)}
OWN_OPS = {"norm": ("rms_norm", "layer_norm")}
MAX_LAYERS = 8
HIDDEN, HEAD_DIM, VOCAB = 64, 16, 128
#: Sizes set wherever the family's configuration has the attribute.
SIZES = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, intermediate_size_mlp=128, ffn_hidden_size=128,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, moe_shared_expert_intermediate_size=32,
    shared_intermediate_size=32, expert_ffn_hidden_size=32, max_position_embeddings=256,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
    kv_lora_rank=32, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
    linear_key_head_dim=16, linear_head_dim=16, linear_num_heads=4,
    ssm_state_size=16, mamba_d_state=16,
)
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "top_k_experts", "moe_topk")
INDEX_LISTS = ("moe_layers", "full_attn_idxs", "kv_source_layers")  # values are layer indices


def _layers_key(d: dict) -> str | None:
    """The attribute that counts the layers; None where a pattern does (Nemotron-H's layers_block_type)."""
    return next((k for k in ("num_hidden_layers", "num_layers") if k in d), None)


def tiny_kwargs(cls, extra: dict) -> dict:
    """The keyword arguments of a tiny `cls`: its defaults' sizes shrunk, its layer patterns kept."""
    d = cls().to_dict()
    kw: dict = {k: v for k, v in SIZES.items() if k in d}
    heads = d.get("num_attention_heads") or 4
    kw["num_attention_heads"] = max(4, d.get("o_groups") or 0)  # o_groups must divide the heads
    if "num_key_value_heads" in d:
        kv = d["num_key_value_heads"]
        kw["num_key_value_heads"] = kw["num_attention_heads"] if kv in (None, heads) else 1 if kv == 1 else 2
    if "head_dim" in d and d["head_dim"] is None:  # derived from hidden / heads where it is None
        kw["head_dim"] = HEAD_DIM
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # token ids inside the tiny vocabulary
        if isinstance(d.get(k), int) and d[k] >= VOCAB:
            kw[k] = VOCAB - 1 - ("bos_token_id", "eos_token_id", "pad_token_id").index(k)
    if d.get("q_lora_rank") is not None:
        kw["q_lora_rank"] = 32
    rope_dim = nope_dim = None
    if d.get("qk_rope_head_dim"):
        kw["qk_rope_head_dim"] = rope_dim = 8
    if d.get("qk_nope_head_dim"):
        kw["qk_nope_head_dim"] = nope_dim = 16
    if d.get("v_head_dim"):
        kw["v_head_dim"] = 16
    if "qk_head_dim" in d and (rope_dim or nope_dim):
        kw["qk_head_dim"] = (rope_dim or 0) + (nope_dim or 0)
    if d.get("head_dim"):  # MLA families tie head_dim to the rope share or to the whole q/k head
        hd = d["head_dim"]
        kw["head_dim"] = (rope_dim if rope_dim and hd == d.get("qk_rope_head_dim") else
                          kw.get("qk_head_dim") if "qk_head_dim" in kw and hd == d.get("qk_head_dim") else HEAD_DIM)
    if d.get("linear_num_key_heads"):  # keep the value/key head ratios
        kw["linear_num_key_heads"] = 2
        kw["linear_num_value_heads"] = 2 * d["linear_num_value_heads"] // d["linear_num_key_heads"]
        kw["linear_value_head_dim"] = 16 * d["linear_value_head_dim"] // d["linear_key_head_dim"]
    if "mamba_num_heads" in d:  # Nemotron-H: heads * head_dim = 2 * hidden, n_groups kept (divides heads)
        kw["mamba_num_heads"] = max(8, d.get("n_groups") or 1)
        kw["mamba_head_dim"] = 2 * HIDDEN // kw["mamba_num_heads"]
    if "mamba_n_heads" in d:  # Granite / Falcon-H1: the same product, their head sizes
        if "mamba_d_ssm" in d:
            kw.update(mamba_d_ssm=2 * HIDDEN, mamba_n_heads=16, mamba_d_head=8)
        else:
            kw.update(mamba_n_heads=8, mamba_d_head=2 * HIDDEN // 8)
    experts = None
    for k in EXPERT_COUNTS:
        if d.get(k):
            n = d[k]
            group = d.get("n_group") or d.get("num_expert_group") or 1
            experts = n if n <= 8 else max(8, 2 * group)
            kw[k] = experts
            for t in TOP_K:
                if d.get(t) and experts != n:
                    kw[t] = min(d[t], 2)
            if d.get("zero_expert_num"):
                kw["zero_expert_num"] = max(1, d["zero_expert_num"] * experts // n)
    # layers: the shortest prefix of the per-layer lists that holds each of their values
    if _layers_key(d) is None:  # the pattern is the layer count: kept as it is
        kw.update(extra)
        return kw
    n_layers = d[_layers_key(d)]
    lists = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n_layers and k not in INDEX_LISTS}
    lists.update({k: v for k, v in extra.items() if isinstance(v, list) and k not in INDEX_LISTS})
    length = 2
    for v in lists.values():
        seen = set()
        for i, x in enumerate(v):
            if repr(x) not in seen:
                seen.add(repr(x))
                length = max(length, i + 1)
    length = min(length, MAX_LAYERS)
    kw[_layers_key(d)] = length
    for k, v in lists.items():
        kw[k] = list(v[:length])
    for k in INDEX_LISTS:
        if isinstance(d.get(k), list):
            kw[k] = [i for i in d[k] if i < length] if k != "kv_source_layers" else list(d[k][:length])
    if isinstance(d.get("first_k_dense_replace"), int) and d["first_k_dense_replace"] >= length:
        kw["first_k_dense_replace"] = 1
    if isinstance(d.get("moe_layer_end_index"), int) and d["moe_layer_end_index"] >= length:
        kw["moe_layer_end_index"] = length - 1
    if isinstance(d.get("num_dense_layers"), int) and d["num_dense_layers"] >= length:
        kw["num_dense_layers"] = 1
    if isinstance(d.get("max_window_layers"), int) and d["max_window_layers"] > length:
        kw["max_window_layers"] = length
    kw.update(extra)
    return kw


def kind_of(module) -> str | None:
    name = type(module).__name__
    if name.endswith("Experts"):
        return "experts"
    if "Norm" in name:
        return "norm"
    if name.endswith("MLP") or "FeedForward" in name or "FFN" in name:
        return "mlp"
    if "Attention" in name:
        code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
        # a size attribute (qk_rope_head_dim) is no RoPE function: NoPE attentions read it too
        if code is not None and any(("rotary" in n.lower() or "rope" in n.lower()) and not n.endswith("_dim")
                                    for n in code.co_names):
            return "rope"
    return None


def installed_ops(module) -> set[str]:
    """The ops of every swapped forward bound on `module` (the outer one and those kept beneath it:
    a LoRA site or the tiled MLP sits on top of a kernel swap)."""
    from accel_patch.swaps import sites

    ops = set()
    for value in module.__dict__.values():
        op = getattr(getattr(value, "__func__", None), sites.MARK, None)
        if op is not None:
            ops.add(str(op))
    return ops


def layers_prefix(model) -> str | None:
    """The path of the decoder layers' ModuleList (model.layers, else the first `layers` list)."""
    import torch

    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return "model.layers"
    for where, module in model.named_modules():
        if where.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return where
    return None


def build(transformers, cls_name: str, cfg):
    """The causal LM of `cfg`; where the Auto mapping has none for a text configuration, the
    family's own ForCausalLM class, else its text model (no LM head: the layers are what is counted)."""
    try:
        return transformers.AutoModelForCausalLM.from_config(cfg)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
    stem = cls_name[:-len("Config")]
    for name in (stem + "ForCausalLM", stem.removesuffix("Text") + "ForCausalLM", stem + "Model"):
        if hasattr(transformers, name):
            return getattr(transformers, name)(cfg)
    return transformers.AutoModel.from_config(cfg)


def census(key: str, label: str, cls_name: str, extra: dict, step: bool = True) -> dict:
    import copy

    import torch
    import transformers

    import accel_patch
    from accel_patch.swaps import probe, sites
    from accel_patch.swaps.layers import rope
    from accel_patch.swaps.report import outcome_kind

    out = dict(key=key, family=label, config=cls_name, status="ok", rows=[], mixers={}, swapped={}, other=[])
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        out["status"] = f"absent: transformers {transformers.__version__} has no {cls_name}"
        return out
    try:
        kw = tiny_kwargs(cls, extra)
        cfg = cls(**kw)
        torch.manual_seed(0)
        model = build(transformers, cls_name, cfg)
    except Exception as exc:
        out["status"] = f"not built: {type(exc).__name__}: {exc}".replace("\n", " ")
        return out
    out["model"] = type(model).__name__
    out["layers"] = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None)
    accel_patch.restore_kernels(model)  # the load hook may have swapped at from_config
    probe.cache.clear()
    model = model.float()
    stock = copy.deepcopy(model) if step else None
    model.eval()
    try:
        report = accel_patch.swap_kernels(model)
    except Exception as exc:
        out["status"] = f"swap raised: {type(exc).__name__}: {exc}".replace("\n", " ")
        out["traceback"] = traceback.format_exc()
        return out
    out["swapped"] = dict(report.swapped)
    rope_calls = rope_calls_per_class(model)
    if step:
        try:
            out["step"] = training_step_against(stock, model)
        except Exception as exc:
            out["status"] = f"step raised: {type(exc).__name__}: {exc}".replace("\n", " ")
            out["traceback"] = traceback.format_exc()
            return out
        after = accel_patch.report(model)
        out["after"] = dict(swapped=dict(after.swapped), not_run=dict(after.not_run),
                            calls={op: dict(c) for op, c in after.calls.items()})
    out["mixers"] = {c: dict(modules=n, runs=what) for c, (n, what) in report.mixers.items()}
    refusals: dict[tuple[str, str], str] = {}
    for r in report.refused:
        refusals.setdefault((r.where, r.op), r.reason)
    prefix = layers_prefix(model)
    if prefix is None:
        out["status"] = "no decoder layers found"
        return out
    per_class: dict[tuple[str, str], dict] = {}
    seen_paths = set()
    for where, module in model.named_modules():
        if not where.startswith(prefix + "."):
            continue
        kind = kind_of(module)
        if kind is None:
            continue
        seen_paths.add(where)
        row = per_class.setdefault((kind, type(module).__name__),
                                   dict(instances=0, swapped=0, ops=set(), refused={}))
        row["instances"] += 1
        ops = KIND_OPS[kind]
        own = OWN_OPS.get(kind, ops[:1])
        marks = installed_ops(module)
        row["ops"].update(marks)
        if sites.is_swapped(module) and any(op in marks for op in own):  # the kind's own op, beneath any on top
            row["swapped"] += 1
            continue
        reason = next((refusals[(where, op)] for op in own if (where, op) in refusals), None)
        if kind == "rope" and reason is not None and reason.startswith(rope.NEVER_ROTATES):
            row["no_rope"] = row.get("no_rope", 0) + 1
            row.setdefault("why_no_rope", reason)
            continue
        if reason is None:  # another op of the kind (the tiled MLP) refused there
            reason = next((f"{op}: {refusals[(where, op)]}" for op in ops if op not in own and (where, op) in refusals
                           and op not in marks), None)
        if reason is not None:
            row["refused"][reason] = row["refused"].get(reason, 0) + 1
    for (kind, cls_), row in sorted(per_class.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1])):
        ops = "+".join(sorted(row["ops"]))
        ran = rope_calls.get(cls_) if kind == "rope" else None
        if row["swapped"] and step and kind == "rope" and ran is not None and ran and not any(
                outcome_kind(o) == "success" for o in ran):
            state, note = "not run", "every call ran another function: " + max(ran, key=ran.get)
        elif row["swapped"]:
            state, note = "swapped", ops
            if row["swapped"] + row.get("no_rope", 0) < row["instances"]:
                note += f", {row['swapped']}/{row['instances']} instances"
            elif row.get("no_rope"):
                note += f", {row['no_rope']}/{row['instances']} instances never rotate"
        elif row.get("no_rope") and not row["refused"]:
            state, note = "no rope", row["why_no_rope"]
        elif row["refused"]:
            state = "refused"
            note = max(row["refused"], key=row["refused"].get)
        else:
            state, note = "silent", ""
        out["rows"].append(dict(kind=kind, cls=cls_, state=state, note=note, instances=row["instances"],
                                installed=ops, refusals=row["refused"], rope_calls=ran))
    # refusals inside the layers on modules of no kind above (what else the swap looked at)
    for (where, op), reason in refusals.items():
        if where.startswith(prefix + ".") and where not in seen_paths:
            out["other"].append(dict(where=where, cls=type(model.get_submodule(where)).__name__, op=op,
                                     reason=reason))
    return out


def rope_calls_per_class(model) -> dict[str, dict[str, int]]:
    """attention class -> RoPE outcome -> calls, filled as the model runs: each swapped attention's
    count is seen on its way to the model's report."""
    from accel_patch.swaps.layers import rope

    per_class: dict[str, dict[str, int]] = {}
    for module in model.modules():
        site = module.__dict__.get(rope.SITE_ATTR)
        if site is None:
            continue
        outcomes = per_class.setdefault(type(module).__name__, {})

        def count(outcome, outcomes=outcomes, real=site.count):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            real(outcome)

        site.count = count
    return per_class


def _loss(model, ids):
    takes_labels = "labels" in inspect.signature(model.forward).parameters
    out = model(input_ids=ids, labels=ids) if takes_labels else model(input_ids=ids)
    loss = getattr(out, "loss", None)
    if loss is None:  # a text model without a head: a loss over its hidden states
        loss = out.last_hidden_state.float().pow(2).mean()
    return loss




def training_step_against(stock, swapped) -> dict:
    """One training step (forward, backward) of both models on the same batch: the loss's relative
    difference, and per parameter the largest difference of its gradient relative to that
    gradient's largest element, or to the step's gradient RMS where that is larger (`grad_err`, the
    worst parameter named). Relative to the gradient alone, gradients of about 1e-6 that are sums
    of cancelling terms (the gated delta rule's A_log in Qwen3-Next, DeepSeek V4's hash-routed
    gate) fail: they move by 1e-10 when any op rounds a last bit differently. Elementwise, Gemma 4's
    tied, scaled embedding gradients fail where large terms cancel. Both are recorded for
    information (`grad_err_of_largest`, `grad_err_elementwise`: relative to |stock| + the RMS), with
    the difference in norm (`grad_err_in_norm`)."""
    import torch

    results = []
    for model in (stock, swapped):
        model.train()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        ids = torch.randint(3, VOCAB - 4, (2, 12))
        loss = _loss(model, ids)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (want, want_grads), (got, grads) = results
    loss_err = (got - want).abs().item() / max(want.abs().item(), 1e-6)
    worst, grad_err, largest, in_norm, elementwise = "", 0.0, 0.0, 0.0, 0.0
    # the step's gradient scale: the root mean square of every stock gradient element
    scale = (sum(g.double().pow(2).sum().item() for g in want_grads.values())
             / max(1, sum(g.numel() for g in want_grads.values()))) ** 0.5
    for name in sorted(set(want_grads) | set(grads)):
        if name not in grads or name not in want_grads:
            return dict(loss=want.item(), loss_err=loss_err, grad_err=float("inf"), worst=f"{name}: grad on one side only")
        diff = (grads[name] - want_grads[name]).abs()
        # relative to the gradient's largest element, or to the step's RMS where that is larger
        err = diff.max().item() / max(want_grads[name].abs().max().item(), scale, 1e-30)
        in_norm = max(in_norm, (diff.norm() / want_grads[name].norm().clamp_min(1e-30)).item())
        largest = max(largest, diff.max().item() / max(want_grads[name].abs().max().item(), 1e-30))
        elementwise = max(elementwise, (diff / (want_grads[name].abs() + scale)).max().item())
        if err > grad_err or err != err:
            worst, grad_err = name, err
    return dict(loss=want.item(), loss_err=loss_err, grad_err=grad_err, worst=worst, grads=len(grads),
                grad_scale=scale, grad_err_in_norm=in_norm, grad_err_of_largest=largest,
                grad_err_elementwise=elementwise)


def state_text(row: dict) -> str:
    if row["state"] == "swapped":
        return f"swapped ({row['note']})"
    beneath = f" [installed: {row['installed']}]" if row["installed"] else ""
    if row["state"] == "refused":
        return "refused: " + row["note"][:90] + beneath
    if row["state"] in ("not run", "no rope"):
        return f"{row['state']}: " + row["note"][:90]
    return "silent" + beneath


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the data as JSON to this path")
    p.add_argument("--families", help="comma-separated family keys (default: all)")
    p.add_argument("--list", action="store_true", help="print the family keys and exit")
    p.add_argument("--no-step", action="store_true", help="swap only: no training step against stock")
    args = p.parse_args(argv)
    if args.list:
        for key, label, cls_name, _ in FAMILIES:
            print(f"{key:16} {label} ({cls_name})")
        return 0
    wanted = set(args.families.split(",")) if args.families else None
    if wanted and wanted - {f[0] for f in FAMILIES}:
        p.error(f"unknown families: {', '.join(sorted(wanted - {f[0] for f in FAMILIES}))}")

    import warnings

    import torch

    if not args.no_step and not torch.cuda.is_available():
        # the step's kernels run under Triton's interpreter (set before triton loads); the swap
        # alone leaves it as the caller set it (interpreted probes take ~5x as long)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import transformers

    import accel_patch

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"census: accel_patch {getattr(accel_patch, '__version__', '?')} ({Path(accel_patch.__file__).parent}), "
          f"transformers {transformers.__version__}, torch {torch.__version__}, {platform.machine()}")
    started = time.perf_counter()
    results = []
    for key, label, cls_name, extra in FAMILIES:
        if wanted and key not in wanted:
            continue
        t0 = time.perf_counter()
        res = census(key, label, cls_name, extra, step=not args.no_step)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(res)

    print(f"\n{'family':34} {'kind':8} {'class':40} state")
    print("-" * 130)
    for res in results:
        if res["status"] != "ok":
            flag = "!! " if res["status"].startswith(("swap raised", "step raised")) else ""
            print(f"{res['family']:34} {'-':8} {'-':40} {flag}{res['status'][:160]}")
            continue
        if not res["rows"]:
            print(f"{res['family']:34} {'-':8} {'-':40} (no module of a known kind)")
        for row in res["rows"]:
            print(f"{res['family']:34} {row['kind']:8} {row['cls']:40} {state_text(row)}")
        for o in res["other"]:
            print(f"{res['family']:34} {'(other)':8} {o['cls']:40} refused {o['op']}: {o['reason'][:90]}")
        if "step" in res:
            st, after = res["step"], res["after"]
            not_run = ", ".join(f"{op} x{n}" for op, n in after["not_run"].items()) or "none"
            print(f"{res['family']:34} {'(step)':8} {'against stock':40} loss {st['loss_err']:.1e}, "
                  f"grads {st['grad_err']:.1e} ({st['worst']}; of the largest {st['grad_err_of_largest']:.1e}); "
                  f"not run: {not_run}")

    raised = [r for r in results if r["status"].startswith(("swap raised", "step raised"))]
    if raised:
        print("\nSWAP RAISED (accel_patch.swap_kernels threw):")
        for r in raised:
            print(f"  {r['family']} ({r['config']}): {r['status']}")
            print("    " + r["traceback"].strip().splitlines()[-3].strip())

    print("\nmixers (report.mixers: class -> modules, what runs):")
    any_mixer = False
    for res in results:
        for c, m in sorted(res["mixers"].items()):
            any_mixer = True
            print(f"  {res['family']:34} {c:36} x{m['modules']}: {m['runs']}")
    if not any_mixer:
        print("  (none)")

    totals = {}
    print("\nstock (refused or silent), distinct (family, class) pairs per kind:")
    for kind in KINDS:
        pairs = [(r["family"], row["cls"], row["state"]) for r in results if r["status"] == "ok"
                 for row in r["rows"] if row["kind"] == kind and row["state"] not in ("swapped", "no rope")]
        every = sum(1 for r in results if r["status"] == "ok" for row in r["rows"] if row["kind"] == kind)
        totals[kind] = dict(stock=len(pairs), of=every, pairs=[dict(family=f, cls=c, state=s) for f, c, s in pairs])
        print(f"  {kind}: {len(pairs)} of {every}" + (f" ({len(none)} never rotate: no RoPE site)" if (none := [
            1 for r in results if r["status"] == "ok" for row in r["rows"]
            if row["kind"] == kind and row["state"] == "no rope"]) else ""))
        for f, c, s in pairs:
            print(f"      {f} / {c} ({s})")
    built = sum(r["status"] == "ok" for r in results)
    print(f"\nfamilies: {len(results)} listed, {built} built and swapped, "
          f"{sum(r['status'].startswith('not built') for r in results)} not built, "
          f"{sum(r['status'].startswith('absent') for r in results)} absent, {len(raised)} swap raised; "
          f"{time.perf_counter() - started:.0f} s")

    if args.json:
        for r in results:
            r.pop("traceback", None) if not r["status"].startswith(("swap raised", "step raised")) else None
        data = dict(when=datetime.datetime.now().isoformat(timespec="seconds"), transformers=transformers.__version__,
                    torch=torch.__version__, families=results, totals=totals)
        Path(args.json).write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
