"""RoPE sites return what the family's own function returns: values, dtype and shape, with q/k in
half precision and cos/sin in float32 (Olmo and Olmo2 cast back to q's dtype, Llama does not);
the probe refuses a function whose output dtype the kernel cannot give."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from accel_kernels import _launch

from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import probe
from accel_patch.swaps.layers import rope

from _models import build, padded_batch, rel

HALF = [torch.float16, torch.bfloat16]


def call_swapped(key, *args):
    """The module global of `key` called as a swapped attention forward calls it (gate open)."""
    module_name, name = key
    counter = rope.gate(key).counter()
    counter.depth += 1
    try:
        return sys.modules[module_name].__dict__[name](*args)
    finally:
        counter.depth -= 1


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_the_swapped_rope_returns_the_familys_dtypes_with_float32_tables(family, dtype):
    model = build(family, dtype)
    report = swap_kernels(model, ops="rope")
    assert report.swapped.get("rope") == 2, report
    key = (type(model.model.layers[0].self_attn).__module__, "apply_rotary_pos_emb")
    original = rope.interceptions.original(key)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16).to(dtype), torch.randn(2, 2, 5, 16).to(dtype)
    for table_dtype in (dtype, torch.float32):
        cos, sin = torch.randn(2, 5, 16).to(table_dtype), torch.randn(2, 5, 16).to(table_dtype)
        want = original(q, k, cos, sin)
        with _launch.recording() as launched:
            got = call_swapped(key, q, k, cos, sin)
        assert launched == ["_rope_kernel"]  # the kernel ran, not the original
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape, (table_dtype, g.dtype, w.dtype)
            assert rel(g, w) <= probe.bound(w.dtype)
    restore_kernels(model)


@pytest.mark.slow  # over 2 s: two interpreted forwards of a model
@pytest.mark.parametrize("dtype", HALF)
def test_a_swapped_olmo2_in_half_precision_runs_sdpa_as_stock(dtype):
    """Olmo2's rotary tables are float32 whatever the model's dtype: a RoPE returning the promoted
    dtype made SDPA raise "expected scalar type Float but found Half"."""
    stock = build("olmo2", dtype)
    twin = build("olmo2", dtype)
    swap_kernels(twin)
    batch = padded_batch()
    for m in (stock, twin):
        m.eval()
    with torch.no_grad(), _launch.recording() as launched:
        got = twin(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    want = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert "_rope_kernel" in launched
    assert got.dtype == want.dtype
    assert rel(got, want) <= 2e-2  # both round every layer to half precision
    restore_kernels(twin)


def test_the_probe_refuses_a_rope_whose_output_dtype_the_kernel_cannot_give():
    """A rotate-half function that always returns float16: the values would pass, the dtype not."""
    from transformers.models.llama import modeling_llama

    fake = types.ModuleType("accel_patch_test_fake_modeling")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        q_out, k_out = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return q_out.to(torch.float16), k_out.to(torch.float16)

    fake.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[fake.__name__] = fake
    try:
        model = build("llama")
        attn = model.model.layers[0].self_attn
        verdict = rope.probe_verdict((fake.__name__, "apply_rotary_pos_emb"), attn, model.config, torch.float32)
        assert isinstance(verdict, str) and "comes back in torch.float16" in verdict, verdict
        good = rope.probe_verdict(rope.rope_function(attn), attn, model.config, torch.float32)
        assert isinstance(good, rope.RopePlan) and not good.cast_back
    finally:
        del sys.modules[fake.__name__]


@pytest.mark.parametrize("family, cast_back", [("llama", False), ("olmo2", True)])
def test_the_probe_finds_which_families_cast_back(family, cast_back):
    model = build(family, torch.bfloat16)
    attn = model.model.layers[0].self_attn
    verdict = rope.probe_verdict(rope.rope_function(attn), attn, model.config, torch.bfloat16)
    assert isinstance(verdict, rope.RopePlan) and verdict.cast_back is cast_back


@pytest.mark.parametrize("dtype", HALF)
def test_a_float32_model_swapped_first_does_not_decide_the_dtype_for_a_half_one(dtype):
    # One dispatcher serves every model of the family: the first model swapped (here float32,
    # still alive) must not fix it to return the promoted dtype for a half-precision model after it.
    first = build("olmo2", torch.float32)
    swap_kernels(first, ops="rope")
    model = build("olmo2", dtype)
    swap_kernels(model, ops="rope")
    key = (type(model.model.layers[0].self_attn).__module__, "apply_rotary_pos_emb")
    q, k = torch.randn(2, 4, 5, 16).to(dtype), torch.randn(2, 2, 5, 16).to(dtype)
    cos, sin = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    want = rope.interceptions.original(key)(q, k, cos, sin)
    got = call_swapped(key, q, k, cos, sin)
    assert [g.dtype for g in got] == [w.dtype for w in want] == [dtype, dtype]
    restore_kernels(model)
    restore_kernels(first)


def gpt_oss_attention():
    """An attention of gpt-oss, whose RoPE takes cos/sin of half the head dim."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
    config._attn_implementation = "eager"  # what a model class sets (an unset one logs, a graph break)
    return gpt_oss.GptOssAttention(config, layer_idx=0), config


def test_the_probe_accepts_gpt_oss_half_width_tables_and_the_dispatcher_widens_them():
    attn, config = gpt_oss_attention()
    key = rope.rope_function(attn)
    verdict = rope.probe_verdict(key, attn, config, torch.float32)
    assert isinstance(verdict, rope.RopePlan) and verdict.half_tables and not verdict.cast_back, verdict
    hold = rope.Hold(verdict)
    try:
        torch.manual_seed(0)
        q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16)
        cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)  # half of head dim 16
        want = rope.interceptions.original(key)(q, k, cos, sin)
        with _launch.recording() as launched:
            got = call_swapped(key, q, k, cos, sin)
        assert launched == ["_rope_kernel"]
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel(g, w) <= 1e-6, rel(g, w)
    finally:
        hold.release()


def test_full_width_families_keep_full_tables_and_a_function_taking_neither_is_refused():
    model = build("llama")
    attn = model.model.layers[0].self_attn
    plan = rope.probe_verdict(rope.rope_function(attn), attn, model.config, torch.float32)
    assert isinstance(plan, rope.RopePlan) and not plan.half_tables
    fake = types.ModuleType("accel_patch_test_fake_quarter_tables")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if cos.shape[-1] * 4 != q.shape[-1]:
            raise RuntimeError("takes quarter-width tables only")
        return q * cos.repeat(1, 1, 4).unsqueeze(1), k

    fake.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[fake.__name__] = fake
    try:
        verdict = rope.probe_verdict((fake.__name__, "apply_rotary_pos_emb"), attn, model.config, torch.float32)
        assert isinstance(verdict, str) and "could not be called with rotate-half shapes" in verdict, verdict
    finally:
        del sys.modules[fake.__name__]


@pytest.mark.slow
def test_a_gpt_oss_attention_compiles_fullgraph_with_its_tables_widened_for_the_kernel():
    from accel_patch.swaps import sites

    attn, config = gpt_oss_attention()
    holder = torch.nn.ModuleDict({"self_attn": attn})
    holder.config = config
    report = swap_kernels(holder, ops="rope")
    assert report.swapped.get("rope") == 1 and sites.is_swapped(attn), report
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 64)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(attn)(hidden, (cos, sin), None)
    assert explained.graph_break_count == 0, explained.break_reasons
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "accel_kernels.rope" in targets, targets
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    got = compiled(hidden, (cos, sin), None)[0]
    restore_kernels(holder)
    want = attn(hidden, (cos, sin), None)[0]
    assert rel(got, want) <= 1e-6
    torch._dynamo.reset()
