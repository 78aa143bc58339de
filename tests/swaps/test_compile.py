"""Swapped models under torch.compile: no graph break, the kernels in the graph as
`torch.ops.accel_kernels.*` nodes (the fused loss included, so the head's logits are never built),
stock's loss and gradients from a fullgraph-compiled training step, stock's tokens from a
compiled static-cache generate, and no more recompiles than stock.

A swap that stood aside under compile (ran the stock forward) would pass the equality tests but
fail the graph-content ones; a RoPE dispatch dynamo cannot trace (a ContextVar) fails the graph
break counts. Everything compiles with backend="aot_eager" (no C++ build); the tests
compile (a few seconds each here), so they are all slow.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import accel_kernels.ops.rms_norm as rms_norm_kernel
import accel_patch
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps.layers import norms

from _models import FAMILIES, LORA, pair, padded_batch, rel, training_step

VOCAB = 151  # unlike every other width of the tiny models, so a (tokens, vocab) node is the logits
KERNEL_NODES = {"rms_norm": "accel_kernels.rms_norm", "rope": "accel_kernels.rope", "glu": "accel_kernels.glu",
                "fused_linear_cross_entropy": "accel_kernels.fused_linear_cross_entropy",
                "experts": "accel_kernels.moe_experts"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graph_facts(graphs, tokens: int):
    """(accel_kernels op names in the graphs, nodes whose output is a (tokens, VOCAB) logits tensor)."""
    ops, logits = set(), []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = str(node.target)
            if name.startswith("accel_kernels."):
                ops.add(name.split(".")[1])
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and value.shape[-1:] == (VOCAB,) and value.numel() >= tokens * VOCAB:
                logits.append(f"{name} -> {tuple(value.shape)}")
    return ops, logits


@pytest.mark.slow
def test_a_swapped_attention_compiles_fullgraph_with_the_rope_kernel_in_it():
    """The RoPE dispatch is traceable: one attention forward, fullgraph, the rope op in the graph."""
    _, twin = pair("llama")
    swap_kernels(twin, ops="rope")
    attn = twin.model.layers[0].self_attn
    hidden = torch.randn(2, 5, 64)
    position_embeddings = twin.model.rotary_emb(hidden, torch.arange(5)[None].expand(2, 5))
    explained = torch._dynamo.explain(attn)(hidden, position_embeddings, None)
    assert explained.graph_break_count == 0, explained.break_reasons
    ops, _ = graph_facts(explained.graphs, 0)
    assert ops == {"rope"}
    compiled = torch.compile(attn, fullgraph=True, backend="eager")
    got, want = compiled(hidden, position_embeddings, None)[0], attn(hidden, position_embeddings, None)[0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    restore_kernels(twin)


# MoE under compile: tests/swaps/experts (Qwen3-MoE fullgraph, every kernel swapped; Mixtral's own
# routing breaks stock's graph once, and its interpreted experts made two cases here 50 s)
COMPILE_FAMILIES = ["llama", "gemma2", "granite", "cohere"]


@pytest.mark.slow
@pytest.mark.parametrize("family", COMPILE_FAMILIES)
def test_a_swapped_training_forward_has_no_graph_break_and_holds_every_kernel(family, monkeypatch):
    # the norms' recompute scope at any size, as eager would open it (it stands aside while compiling)
    monkeypatch.setattr(rms_norm_kernel, "RECOMPUTE_MIN_BYTES", 0)
    stock, twin = pair(family, vocab_size=VOCAB)
    report = swap_kernels(twin)
    for m in (stock, twin):
        m.train()
    batch = padded_batch()
    tokens = batch["input_ids"].numel()
    explained_stock = torch._dynamo.explain(stock)(**batch)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(twin)(**batch)
    assert explained_stock.graph_break_count == explained.graph_break_count == 0, explained.break_reasons
    ops, logits = graph_facts(explained.graphs, tokens)
    # the LoRA sites fuse nothing without an adapter (and stand aside while compiling), nor does the
    # tiled MLP (it stands aside while compiling): no node of their own
    module_ops = set(report.swapped) - LORA - {"tiled_mlp"}
    assert module_ops == set(FAMILIES[family][0]) - LORA - {"tiled_mlp"}
    assert ops == {KERNEL_NODES[op].split(".")[1] for op in module_ops}  # an op's node may have another name
    assert logits == []  # the head's (tokens, vocab) logits are never built
    _, stock_logits = graph_facts(explained_stock.graphs, tokens)
    assert stock_logits  # (the check above can see them)


def compiled_step(model, batch, fullgraph=True, **kwargs):
    """One compiled training step; a second one must reuse the graph (no recompile)."""
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    loss, grads, out = training_step(compiled, batch, **kwargs)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again, _, _ = training_step(compiled, batch, **kwargs)
    assert torch.equal(again, loss)
    return loss, {n.replace("_orig_mod.", ""): g for n, g in grads.items()}, out


@pytest.mark.slow
@pytest.mark.parametrize("family", COMPILE_FAMILIES)
def test_a_fullgraph_compiled_training_step_gives_stock_loss_and_gradients(family, monkeypatch):
    monkeypatch.setattr(rms_norm_kernel, "RECOMPUTE_MIN_BYTES", 0)  # as in the test above
    stock, twin = pair(family, vocab_size=VOCAB)
    swap_kernels(twin)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = compiled_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    assert grads1.keys() == grads0.keys()
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, worst
    assert out.logits is None  # nothing computed the logits
    assert norms.RECOMPUTED not in accel_patch.report(twin).calls.get(norms.OP, {})  # the compiler decides what is saved


@pytest.mark.slow
def test_compiled_loss_keeps_num_items_shift_labels_ignore_index_and_tied_weights():
    stock, twin = pair("llama", vocab_size=VOCAB, tie_word_embeddings=True)
    swap_kernels(twin)
    batch = padded_batch()
    batch = dict(batch, labels=batch["labels"].masked_fill(batch["labels"] == -100, -7))
    shift = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-7)
    extra = dict(num_items_in_batch=torch.tensor(37), ignore_index=-7, shift_labels=shift)
    loss0, grads0, _ = training_step(stock, batch, **extra)
    loss1, grads1, out = compiled_step(twin, batch, **extra)
    assert out.logits is None
    assert rel(loss1, loss0) <= 1e-5
    assert rel(grads1["model.embed_tokens.weight"], grads0["model.embed_tokens.weight"]) <= 1e-4
    assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4


@pytest.mark.slow
def test_under_compile_a_loss_that_needs_the_logits_gets_the_real_ones():
    stock, twin = pair("llama", vocab_size=VOCAB)
    swap_kernels(twin)

    def log_softmax_loss(logits, labels, vocab_size, **kwargs):
        logp = torch.log_softmax(logits.float(), -1)[:, :-1]
        target = labels[:, 1:]
        keep = target != -100
        return -(logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep).sum() / keep.sum()

    for m in (stock, twin):
        m.loss_function = log_softmax_loss
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, out = compiled_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    assert isinstance(out.logits, torch.Tensor) and out.logits.shape == (3, 10, VOCAB)


def static_generate(model, ids):
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles generate on CPU only when told
    return model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, cache_implementation="static",
                          compile_config=config, pad_token_id=0)


@pytest.mark.slow
def test_a_fullgraph_compiled_static_cache_generate_gives_stock_tokens_and_recompiles_no_more():
    from torch._dynamo.utils import counters

    stock, twin = pair("llama")
    swap_kernels(twin)
    ids = padded_batch()["input_ids"][:1, 2:]
    graphs = {}
    tokens = {}
    for name, model in (("stock", stock), ("twin", twin)):
        torch._dynamo.reset()
        counters.clear()
        model.eval()
        first = static_generate(model, ids)
        graphs[name] = [counters["stats"]["unique_graphs"]]
        assert counters["stats"]["calls_captured"] > 0  # generate compiled the forward
        # a shorter prompt: where stock compiles nothing more, the swapped model must not either
        no_recompile = name == "twin" and graphs["stock"][0] == graphs["stock"][1]
        with torch._dynamo.config.patch(error_on_recompile=no_recompile):
            tokens[name] = [first, static_generate(model, ids[:, 3:])]
        graphs[name].append(counters["stats"]["unique_graphs"])
    assert all(torch.equal(a, b) for a, b in zip(tokens["twin"], tokens["stock"]))
    assert graphs["twin"][0] <= graphs["stock"][0] and graphs["twin"][1] <= graphs["stock"][1], graphs


@pytest.mark.slow
def test_a_bystander_of_the_family_compiles_stock_beside_a_swapped_model():
    """The RoPE global is a dispatcher while a model is swapped; a stock model compiled then
    has no graph break and no accel_kernels op in its graph."""
    bystander, twin = pair("llama", vocab_size=VOCAB)
    swap_kernels(twin)
    bystander.train()
    explained = torch._dynamo.explain(bystander)(**padded_batch())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert graph_facts(explained.graphs, 30)[0] == set()
    restore_kernels(twin)


@pytest.mark.slow
@pytest.mark.parametrize("family, fullgraph", [("llama", True), ("gemma2", True)])
def test_dynamic_shapes_and_bf16_autocast_keep_the_fused_loss_under_compile(family, fullgraph):
    """Trainer batches padded to their longest row change the length: with dynamic shapes the
    stand-in's shape arithmetic is symbolic, and autocast casts the head's input as stock's would.
    Gemma 2 scales the logits by a config float (its softcap), which dynamic=True makes a SymFloat:
    red when the stand-in compares it with itself by identity (dynamo raised from the trace), and
    when the fused op checks it with `math.isfinite` (dynamo cannot hand a SymFloat to `math`: a
    graph break)."""
    stock, twin = pair(family, vocab_size=VOCAB)
    swap_kernels(twin)
    compiled = torch.compile(twin, fullgraph=fullgraph, backend="aot_eager", dynamic=True)
    batch = padded_batch()
    for n in (10, 7, 5):
        short = {k: v[:, :n] for k, v in batch.items()}
        loss0, grads0, _ = training_step(stock, short)
        loss1, grads1, out = training_step(compiled, short)
        grads1 = {k.replace("_orig_mod.", ""): g for k, g in grads1.items()}
        assert out.logits is None and rel(loss1, loss0) <= 1e-5, n
        assert max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4, n
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss0, _, _ = training_step(stock, batch)
        loss1, _, out = training_step(torch.compile(twin, fullgraph=fullgraph, backend="aot_eager"), batch)
    assert out.logits is None and rel(loss1, loss0) <= 1e-3  # bf16 head matmul, as stock's


@pytest.mark.slow
def test_a_swapped_model_under_gradient_checkpointing_compiles_fullgraph_with_the_rope_kernel(monkeypatch):
    """Under non-reentrant gradient checkpointing each decoder layer is traced inside a
    higher-order op, where dynamo refuses any write to a Python object: the RoPE gate's depth is
    kept at trace time (`rope._traced_step`), so the swapped model compiles fullgraph wherever
    stock does, with the rope op in the graph, stock's loss and gradients, and RoPE's calls counted
    as fused. Red when the swapped forward writes the gate's depth in the trace ("HOP: Unsafe side
    effect")."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward
    if hasattr(forward, "__wrapped__"):  # the hub-kernel router of newer transformers writes a
        monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward.__wrapped__)  # context var: stock fails
    stock, twin = pair("llama", vocab_size=VOCAB)
    for m in (stock, twin):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.config.use_cache = False  # (else transformers logs that checkpointing turns it off: a graph break)
        m.train()
    swap_kernels(twin)
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    try:
        torch.compile(stock, fullgraph=True, backend="aot_eager")(**batch)
    except Exception as e:  # noqa: BLE001 - e.g. transformers' hub-kernel wrappers on newer releases
        pytest.skip(f"stock does not compile under checkpointing here: {type(e).__name__}: {str(e).splitlines()[0]}")
    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(twin, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)
    loss1, grads1, _ = training_step(compiled, batch)
    grads1 = {n.replace("_orig_mod.", ""): g for n, g in grads1.items()}
    names = {str(n.target) for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
             for n in m.graph.nodes if n.op == "call_function"}
    assert "accel_kernels.rope" in names, sorted(x for x in names if "accel" in x)
    assert rel(loss1, loss0) <= 1e-5 and grads1.keys() == grads0.keys()
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    assert accel_patch.report(twin).calls["rope"] == {"compiled: fused": 2}
