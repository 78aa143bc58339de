"""Partial rotary on the kernel, and attentions that never rotate.

Qwen3.5 (dense and MoE) and Qwen3-Next rotate the first `partial_rotary_factor` of each head inside
`apply_rotary_pos_emb` and pass the rest through; transformers 5 keeps that factor in
`config.rope_parameters`. The probe proves the function at that rotary width, and every call runs
the kernel, which writes the pass-through part itself (no slice and concatenation on the host).

An attention whose RoPE call sits under a condition that is false for it (EXAONE 4's global
layers, a `use_rope` False), or in a model that builds no cos/sin tables (Granite 4 hybrid without
`position_embedding_type="rope"`), is no RoPE site: refused at the swap with that reason, never
listed as swapped.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accel_patch
from accel_patch.swaps import probe
from accel_patch.swaps.layers import rope

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=64, pad_token_id=0)
#: Qwen3.5's and Qwen3-Next's layouts, full attention only (the linear-attention mixers are no RoPE site)
QWEN = dict(num_hidden_layers=1, layer_types=["full_attention"], linear_key_head_dim=8, linear_value_head_dim=8,
            linear_num_key_heads=2, linear_num_value_heads=2)
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "Qwen3_5TextConfig": ("Qwen3_5ForCausalLM", QWEN),
    "Qwen3_5MoeTextConfig": ("Qwen3_5MoeForCausalLM", {**QWEN, **MOE}),
    "Qwen3NextConfig": ("Qwen3NextForCausalLM", {**QWEN, **MOE, "decoder_sparse_step": 1}),
}


def _model(cls_name: str, model_name: str | None = None, **overrides):
    config_class = getattr(transformers, cls_name, None)
    if config_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    config = config_class(**{**TINY, **overrides})
    torch.manual_seed(0)
    if model_name is not None and hasattr(transformers, model_name):
        model = getattr(transformers, model_name)(config)  # the class itself: no load hook
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    accel_patch.restore_kernels(model)
    probe.cache.clear()
    return model.float()


def _step(model):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (2, 7))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # a training step of each, stock and swapped, under the interpreter: 2-6 s
@pytest.mark.parametrize("cls_name", list(FAMILIES))
def test_partial_rotary_runs_the_kernel_and_trains_like_stock(cls_name):
    stock = _model(cls_name, *[FAMILIES[cls_name][0]], **FAMILIES[cls_name][1])
    factor = stock.config.rope_parameters["partial_rotary_factor"]
    # transformers 5.25 keeps the factor in rope_parameters only (5.17 also as an attribute)
    assert 0 < factor < 1, stock.config.rope_parameters
    attention = next(m for m in stock.modules() if type(m).__name__.endswith("Attention"))
    heads, kv_heads, head_dim, rotary = rope.head_shape(attention, stock.config)
    assert rotary == (head_dim, int(head_dim * factor)), rotary  # the partial width is probed
    plan = rope.probe_verdict(rope.rope_function(attention, stock.config), attention, stock.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and plan.partial and plan.form == "half", plan
    probe.cache.clear()
    swapped = copy.deepcopy(stock)
    report = accel_patch.swap_kernels(swapped, ops=["rope"])
    assert report.swapped == {"rope": 1} and not report.refused, report
    want_loss, want_grads = _step(stock)
    loss, grads = _step(swapped)
    after = accel_patch.report(swapped)
    assert after.calls["rope"] == {rope.FUSED: 1}, after.calls  # not "a shape the kernel does not take"
    assert after.swapped == {"rope": 1} and not after.not_run
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


class _TopLevelOps(TorchDispatchMode):
    """The aten and custom ops called at the top level (not those inside a custom op)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func))
        return func(*args, **(kwargs or {}))


def test_the_partial_rotary_call_is_one_kernel_launch_with_no_copy_of_the_pass_through_on_the_host():
    from accel_kernels import _launch

    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    # the plan the probe gives Qwen3.5 (the training test above proves it): rotate-half, partial
    key = (modeling.__name__, "apply_rotary_pos_emb")
    hold = rope.Hold(rope.RopePlan(key, False, False, "half", partial=True))
    counter = rope.gate(key).counter()
    try:
        import sys

        original = rope.interceptions.original(key)
        # q, k as the attention hands them over: (B, S, H, D) projections transposed to (B, H, S, D)
        q = torch.randn(2, 5, 2, 16).transpose(1, 2)
        k = torch.randn(2, 5, 1, 16).transpose(1, 2)
        cos, sin = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
        counter.depth += 1
        with _launch.recording() as launched, _TopLevelOps() as seen:
            got = sys.modules[key[0]].__dict__[key[1]](q, k, cos, sin)
        assert launched == ["_rope_kernel"]
        assert [op for op in seen.ops if op in ("cat", "slice", "split", "copy_", "clone", "contiguous",
                                                 "_to_copy", "narrow")] == [], seen.ops
        for g, w in zip(got, original(q, k, cos, sin)):
            torch.testing.assert_close(g, w)
            torch.testing.assert_close(g[..., 4:], w[..., 4:], rtol=0, atol=0)  # passed through exactly
    finally:
        counter.depth -= 1
        hold.release()


@pytest.mark.slow  # probes and a training step: ~2.5 s
def test_exaone4_global_layers_are_no_rope_site_and_the_rest_run_the_kernel():
    model = _model("Exaone4Config", num_hidden_layers=2, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"])
    stock = copy.deepcopy(model)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    assert report.swapped == {"rope": 1}, report
    (refusal,) = report.refused
    assert refusal.where == "model.layers.1.self_attn" and refusal.reason.startswith(rope.NEVER_ROTATES)
    assert "self.sliding_window is None or self.is_sliding" in refusal.reason
    want_loss, _ = _step(stock)
    loss, _ = _step(model)
    assert accel_patch.report(model).calls["rope"] == {rope.FUSED: 1}  # no "did not call" from the global layer
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("position_embedding_type", [None, "rope"])
def test_granite4_hybrid_without_rope_tables_is_no_rope_site(position_embedding_type):
    model = _model("GraniteMoeHybridConfig", num_hidden_layers=1, layer_types=["attention"],
                   position_embedding_type=position_embedding_type, num_local_experts=2, num_experts_per_tok=1,
                   shared_intermediate_size=16, mamba_n_heads=8, mamba_d_head=8)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    _step(model)
    after = accel_patch.report(model)
    if position_embedding_type == "rope":
        assert report.swapped == {"rope": 1} and after.calls["rope"] == {rope.FUSED: 1}, after.calls
        return
    assert "rope" not in after.swapped and not after.calls.get("rope"), after
    (refusal,) = report.refused
    assert refusal.reason.startswith(rope.NEVER_ROTATES) and "position_embeddings is not None" in refusal.reason
    assert "builds no cos/sin tables" in refusal.reason


@pytest.mark.slow  # Mistral Large 4's MLA with experts and its indexer: ~5 s
def test_mistral_large4_no_rope_layers_are_no_rope_site():
    model = _model("MistralLarge4TextConfig", "MistralLarge4TextModel", num_hidden_layers=2, num_key_value_heads=2,
                   no_rope_layers=[1, 0], q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=8, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                   n_group=1, topk_group=1, index_n_heads=2, index_head_dim=16, index_topk=4, moe_intermediate_size=16)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    never = sorted(r.where for r in report.refused if r.reason.startswith(rope.NEVER_ROTATES))
    assert never and all(w.startswith("layers.1.") for w in never), report.refused
    assert all("self.use_rope" in r.reason for r in report.refused), report.refused
    model.train()
    model(input_ids=torch.randint(3, 64, (2, 7))).last_hidden_state.pow(2).mean().backward()
    calls = accel_patch.report(model).calls["rope"]
    assert set(calls) == {rope.FUSED}, calls


class _Attention(torch.nn.Module):
    """An attention whose RoPE call depends on the mode it runs in (`self.training`) and on an argument."""

    def __init__(self, use_rope):
        super().__init__()
        self.use_rope = use_rope

    def forward(self, q, k, position_embeddings=None):
        if self.training or self.use_rope:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)  # noqa: F821
        if position_embeddings is not None and self.use_rope is None:
            q, k = apply_rotary_pos_emb(q, k, *position_embeddings)  # noqa: F821
        return q, k


def test_a_condition_read_at_the_swap_never_depends_on_train_mode_or_an_argument():
    # `self.training` changes after the swap: the first call is not decided by it; the second
    # depends on an argument of the call
    assert rope.never_rotates(_Attention(True)) is None
    assert rope.never_rotates(_Attention(None)) is None
    # use_rope False makes the first call unreachable only in eval mode, which the swap cannot know
    assert rope.never_rotates(_Attention(False)) is None
    assert rope.never_rotates(_Attention(False).eval()) is None


class _Gated(torch.nn.Module):
    def __init__(self, use_rope):
        super().__init__()
        self.use_rope = use_rope

    def forward(self, q, k, position_embeddings=None):
        if self.use_rope:
            if position_embeddings is not None:
                q, k = apply_rotary_pos_emb(q, k, *position_embeddings)  # noqa: F821
        return q, k


def test_a_condition_false_for_the_module_or_no_tables_makes_it_no_rope_site():
    assert rope.never_rotates(_Gated(True)) is None  # the argument decides: counted at call time
    assert "`self.use_rope`" in rope.never_rotates(_Gated(False))
    assert "`position_embeddings is not None`" in rope.never_rotates(_Gated(True), no_positions=True)


@pytest.mark.parametrize("first", [1.0, 0.5], ids=["full rotary first", "partial rotary first"])
def test_two_models_of_a_family_with_other_rotary_widths_both_run_the_kernel(first):
    # RoPE's swap replaces the family's module-level function once for every model of it; the second
    # model's probe proved partial-rotary calls the first one's did not (a Phi-4-mini beside a
    # Phi-3): its calls ran the function ("a shape the kernel does not take") until the global
    # took the wider plan.
    from accel_kernels import _launch
    from transformers.models.phi3 import modeling_phi3

    # Another test's swapped Phi-3 may still hold the global (a model in a reference cycle counts its
    # hold down when the collector runs, and the next swap or restore puts the original back):
    # collected and swept first; what holds it then is what must hold it after
    gc.collect()
    rope.interceptions.sweep()
    key = "transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb"
    function, holders = modeling_phi3.apply_rotary_pos_emb, rope.interceptions.held().get(key, 0)
    models = {}
    for factor in (first, 1.5 - first):
        stock = _model("Phi3Config", "Phi3ForCausalLM", num_hidden_layers=1, partial_rotary_factor=factor)
        models[factor] = (stock, copy.deepcopy(stock))
        assert accel_patch.swap_kernels(models[factor][1], ops=["rope"]).swapped == {"rope": 1}
    try:
        for factor, (stock, swapped) in models.items():
            want_loss, _ = _step(stock)
            with _launch.recording() as launched:
                loss, _ = _step(swapped)
            assert accel_patch.report(swapped).calls["rope"] == {rope.FUSED: 1}, (factor, accel_patch.report(swapped))
            assert "_rope_kernel" in launched, launched
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    finally:
        for _, swapped in models.values():
            accel_patch.restore_kernels(swapped)
    # our two models' holds released: the global is what it was (the family's own function, unless
    # a live model of another test holds it)
    assert rope.interceptions.held().get(key, 0) == holders
    if not holders:
        assert modeling_phi3.apply_rotary_pos_emb is function
