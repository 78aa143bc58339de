"""The RoPE forms of the 2026 families run the kernel where the probe proves it computes the
family's own function: DeepSeek V3's interleave function (and its heirs), the V3.2 indexer's
(B, S, H, D) calls, GPT-J pairs (ERNIE 4.5), the one-tensor form (Gemma 4), DeepSeek V4's
one-tensor pairs on the last dims of each head, and the complex RoPE (Llama 4's and DeepSeek
V2's `apply_rotary_emb`: q and k as complex numbers times freqs_cis). Each tiny model (its own
config class; skipped where transformers lacks it) trains one step swapped (ops=["rope"]) and
stock: every RoPE call is counted fused, loss and gradients agree. A function the kernel does
not compute (each form broken on purpose here) is refused with the form named."""
from __future__ import annotations

import copy

import pytest
import torch

import accel_patch
from accel_patch.swaps import probe
from accel_patch.swaps.layers import rope

from _models import keeping_graphs

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
MLA = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8,
           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
           topk_group=1, index_n_heads=2, index_head_dim=16, index_topk=4)

LLAMA4 = dict(num_local_experts=4, intermediate_size_mlp=48, head_dim=16)

# family: (config class, overrides, the attention classes that must run the kernel)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", {**MLA, "rope_interleave": True}, {"DeepseekV3Attention"}),
    "deepseek_v32": ("DeepseekV32Config", MLA, {"DeepseekV32Attention", "DeepseekV32Indexer"}),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", MLA, {"Glm4MoeLiteAttention"}),
    "mistral4": ("Mistral4Config", {**MLA, "head_dim": 16}, {"Mistral4Attention"}),
    "longcat_flash": ("LongcatFlashConfig", {**MLA, "num_layers": 1, "ffn_hidden_size": 48,
                                             "expert_ffn_hidden_size": 16}, {"LongcatFlashMLA"}),
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 16}, {"Ernie4_5Attention"}),
    # the sliding layer and the CSA one: its compressor and indexer call the same function
    "deepseek_v4": ("DeepseekV4Config", {**MLA, "head_dim": 16,
                                         "layer_types": ["sliding_attention", "compressed_sparse_attention"]},
                    {"DeepseekV4Attention", "DeepseekV4CSACompressor", "DeepseekV4Indexer"}),
    "llama4": ("Llama4TextConfig", LLAMA4, {"Llama4TextAttention"}),
    "deepseek_v2": ("DeepseekV2Config", MLA, {"DeepseekV2Attention"}),
    "gemma4": ("Gemma4TextConfig", {"head_dim": 16, "global_head_dim": 16, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"],
                                    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 64},
               {"Gemma4TextAttention"}),
}
QUICK = {"deepseek_v32", "llama4"}  # the interleave function and the indexer's (B, S, H, D) calls; complex


def _model(family: str, **extra):
    cls_name, overrides, _ = FAMILIES[family] if family in FAMILIES else (family, {}, None)
    config_class = getattr(transformers, cls_name, None)
    if config_class is None:
        pytest.skip(f"transformers has no {cls_name}")
    config = config_class(**{**TINY, **overrides, **extra})
    torch.manual_seed(0)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    # the class itself, not from_config: the load hook would swap (and probe) every op first
    own = {"Mistral4Config": "Mistral4ForCausalLM"}.get(cls_name)  # not in the Auto mapping
    cls = getattr(transformers, own) if own else MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model = cls(config).float()
    probe.cache.clear()
    return model


def _step(model):
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (2, 6))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fused_classes(model):
    """Attention classes of the model whose RoPE calls are counted (swapped sites), with their counts."""
    per_class = {}
    for module in model.modules():
        site = module.__dict__.get(rope.SITE_ATTR)
        if site is not None:
            outcomes = per_class.setdefault(type(module).__name__, {})

            def count(outcome, outcomes=outcomes, real=site.count):
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                real(outcome)

            site.count = count
    return per_class


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in QUICK else pytest.mark.slow) for f in FAMILIES])
def test_the_family_rope_runs_the_kernel_and_trains_like_stock(family):
    stock = _model(family)
    swapped = copy.deepcopy(stock)
    report = accel_patch.swap_kernels(swapped, ops=["rope"])
    assert not [r for r in report.refused if r.op == "rope"], report.refused
    per_class = _fused_classes(swapped)
    want_loss, want_grads = _step(stock)
    loss, grads = _step(swapped)
    calls = accel_patch.report(swapped).calls["rope"]
    assert calls.get(rope.FUSED, 0) > 0 and set(calls) == {rope.FUSED}, calls
    assert set(per_class) == FAMILIES[family][2], per_class
    assert all(outcomes == {rope.FUSED: outcomes.get(rope.FUSED)} and outcomes[rope.FUSED] > 0
               for outcomes in per_class.values()), per_class
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _attention_plan(model, name):
    attention = next(m for m in model.modules() if type(m).__name__ == name)
    return rope.probe_verdict(rope.rope_function(attention, model.config), attention, model.config, torch.bfloat16)


@pytest.mark.parametrize("family, layout", [("llama4", 2), pytest.param("deepseek_v2", 1, marks=pytest.mark.slow)])
def test_the_probe_finds_where_a_complex_rope_broadcasts_its_table(family, layout):
    # Llama 4 takes q, k as (B, S, H, D), DeepSeek V2 as (B, H, S, D); both cast back to q's dtype
    model = _model(family)
    plan = _attention_plan(model, next(iter(FAMILIES[family][2])))
    assert isinstance(plan, rope.RopePlan), plan
    assert (plan.form, plan.complex_dim, plan.cast_back, plan.partial, plan.q_alone) == (
        "complex", layout, True, False, False), plan


def test_a_complex_rope_broken_on_purpose_is_refused_with_its_form_named(monkeypatch):
    # the conjugate table (a rotation the other way): no form of the kernel computes it
    model = _model("llama4")
    module = __import__(type(model).__module__, fromlist=["_"])
    stock = module.apply_rotary_emb
    monkeypatch.setattr(module, "apply_rotary_emb", lambda xq, xk, freqs_cis: stock(xq, xk, freqs_cis.conj()))
    report = accel_patch.swap_kernels(model, ops=["rope"])
    reasons = {r.reason for r in report.refused if r.op == "rope"}
    assert reasons and all("apply_rotary_emb (complex RoPE" in r and "(B, S, H, D): " in r and "relative error" in r
                           for r in reasons), reasons
    assert "rope" not in report.swapped


@pytest.mark.slow
def test_deepseek_v4_rope_broken_on_purpose_is_refused_with_its_form_named(monkeypatch):
    # rotate-half on the last dims (V4's layout, the halves instead of the pairs): no form the kernel takes
    model = _model("deepseek_v4")
    module = __import__(type(model).__module__, fromlist=["_"])

    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim=1):
        cos = torch.cat((cos, cos), dim=-1).unsqueeze(unsqueeze_dim)
        sin = torch.cat((sin, sin), dim=-1).unsqueeze(unsqueeze_dim)
        r = cos.shape[-1]
        nope, rot = x[..., :-r], x[..., -r:]
        halves = torch.cat((-rot[..., r // 2:], rot[..., : r // 2]), dim=-1)
        return torch.cat([nope, rot * cos + halves * sin], dim=-1)

    monkeypatch.setattr(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    report = accel_patch.swap_kernels(model, ops=["rope"])
    reasons = {r.reason for r in report.refused if r.op == "rope"}
    assert reasons and all("one-tensor form" in r and "(x, cos, sin)" in r for r in reasons), reasons
    assert "rope" not in report.swapped


@pytest.mark.slow
def test_deepseek_v4_gets_the_last_dims_form_on_its_half_width_tables():
    plan = _attention_plan(_model("deepseek_v4"), "DeepseekV4Attention")
    assert isinstance(plan, rope.RopePlan), plan
    # one angle per pair (widened for the kernel), 8 rotary dims of 16, cast back to x's dtype, (B, S, H, D) proved
    assert (plan.form, plan.half_tables, plan.one_tensor, plan.partial, plan.cast_back, plan.bshd) == (
        "pairs_last", True, True, True, True, True), plan


def _call_swapped(key, *args, **kwargs):
    """The module global of `key` called as a swapped attention forward calls it (gate open)."""
    import sys

    counter = rope.gate(key).counter()
    counter.depth += 1
    try:
        return sys.modules[key[0]].__dict__[key[1]](*args, **kwargs)
    finally:
        counter.depth -= 1


def test_the_interleave_dispatcher_sends_only_the_calls_the_probe_proved():
    from accel_kernels import _launch

    model = _model("deepseek_v3")
    attention = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention")
    key = rope.rope_function(attention, model.config)
    plan = rope.probe_verdict(key, attention, model.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and plan.form == "interleave", plan
    # DeepSeek's function takes (B, S, H, D) calls, not k=None nor heads wider than the tables
    assert plan.bshd and not plan.q_alone and not plan.partial and not plan.cast_back, plan
    hold = rope.Hold(plan)
    try:
        original = rope.interceptions.original(key)
        q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 1, 8)
        cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        with _launch.recording() as launched:
            got = _call_swapped(key, q, k, cos, sin, unsqueeze_dim=2)
        assert launched == ["_rope_kernel"]
        for g, w in zip(got, original(q, k, cos, sin, unsqueeze_dim=2)):
            torch.testing.assert_close(g, w)
        # a partial-rotary call the function rejects: it runs (and raises) as stock, no kernel
        with _launch.recording() as launched, pytest.raises(RuntimeError):
            _call_swapped(key, torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), cos[..., :4], sin[..., :4])
        assert launched == []
    finally:
        hold.release()


@pytest.mark.slow
def test_deepseek_interleave_function_of_transformers_4_gets_its_own_form(monkeypatch):
    # before transformers 5 the function de-interleaved q and k (view/transpose) and applied
    # rotate-half on the whole table: a different function on tables other than cat(freqs, freqs)
    model = _model("deepseek_v3")
    module = __import__(type(model).__module__, fromlist=["_"])

    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    def apply_rotary_pos_emb_interleave(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        b, h, s, d = q.shape
        q = q.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        b, h, s, d = k.shape
        k = k.view(b, h, s, d // 2, 2).transpose(4, 3).reshape(b, h, s, d)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    monkeypatch.setattr(module, "apply_rotary_pos_emb_interleave", apply_rotary_pos_emb_interleave)
    attention = next(m for m in model.modules() if type(m).__name__ == "DeepseekV3Attention")
    plan = rope.probe_verdict(rope.rope_function(attention, model.config), attention, model.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and plan.form == "interleave_table", plan
    stock = copy.deepcopy(model)
    accel_patch.swap_kernels(model, ops=["rope"])
    want_loss, want_grads = _step(stock)
    loss, grads = _step(model)
    assert accel_patch.report(model).calls["rope"] == {rope.FUSED: len(model.model.layers)}
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_complex_dispatcher_hands_the_kernel_a_view_of_freqs_cis_and_only_proved_calls():
    from accel_kernels import _launch

    model = _model("llama4")
    attention = next(m for m in model.modules() if type(m).__name__ == "Llama4TextAttention")
    key = rope.rope_function(attention, model.config)
    plan = rope.probe_verdict(key, attention, model.config, torch.float32)
    hold = rope.Hold(plan)
    try:
        original = rope.interceptions.original(key)
        q, k = torch.randn(2, 5, 3, 8, dtype=torch.bfloat16), torch.randn(2, 5, 1, 8, dtype=torch.bfloat16)
        freqs = torch.polar(torch.rand(2, 5, 4) + 0.5, torch.rand(2, 5, 4) * 6.3)
        for table in (freqs, freqs.conj()):  # a lazily conjugated table too
            with _launch.recording() as launched:
                got = _call_swapped(key, q, k, table)
            assert launched == ["_rope_kernel"]
            for g, w in zip(got, original(q, k, table)):
                assert g.dtype == w.dtype == torch.bfloat16
                torch.testing.assert_close(g, w)
        # a table of one angle broadcast over every pair: the function takes it, the kernel was not
        # proved on it: the function runs
        with _launch.recording() as launched:
            got = _call_swapped(key, q, k, freqs[..., :1])
        assert launched == []
        for g, w in zip(got, original(q, k, freqs[..., :1])):
            torch.testing.assert_close(g, w)
    finally:
        hold.release()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama4", "deepseek_v2", "deepseek_v4"])
def test_the_new_forms_compile_fullgraph_with_the_rope_kernel_in_the_graph(family):
    import torch._dynamo

    model = _model(family)
    ids = torch.randint(3, 64, (2, 6))
    stock_model = copy.deepcopy(model)
    accel_patch.swap_kernels(model, ops=["rope"])
    swapped = [type(m).__name__ for m in model.modules() if rope.SITE_ATTR in m.__dict__]
    graphs = []
    torch._dynamo.reset()
    try:
        # a fullgraph-compiled training step (fullgraph: no graph break, in stock or swapped): stock's
        # (compiled alike) loss and gradients
        skip = None
        try:
            want = torch.compile(stock_model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids).loss
            want.backward()
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # torch 2.11: transformers' MoE fallback backward
            skip = (f"stock {family} does not compile its training step on torch {torch.__version__}: "
                    f"{str(exc).splitlines()[1][:160]}")
        torch._dynamo.reset()
        # without stock's step to compare with, the swapped forward is still traced whole (its graph run eagerly)
        backend = keeping_graphs(graphs, "aot_eager" if skip is None else (lambda gm, _: gm.forward))
        loss = torch.compile(model, fullgraph=True, backend=backend)(input_ids=ids, labels=ids).loss
        ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        assert "accel_kernels.rope" in ops, sorted(o for o in ops if "accel" in o)
        # every swapped site's graph runs the kernel (nested ones too: V4's compressor and indexer),
        # each traced site counted once into the model's table
        assert set(swapped) == FAMILIES[family][2], swapped
        assert accel_patch.report(model).calls[rope.OP] == {"compiled: " + rope.FUSED: len(swapped)}
        if skip:
            pytest.skip(skip)
        loss.backward()
        torch.testing.assert_close(loss.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        for (name, p), (_, p_stock) in zip(model.named_parameters(), stock_model.named_parameters()):
            if p_stock.grad is not None:
                torch.testing.assert_close(p.grad, p_stock.grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        torch._dynamo.reset()
