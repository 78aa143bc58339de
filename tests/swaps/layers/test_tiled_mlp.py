"""The tiled MLP (accel_patch/swaps/layers/tiled_mlp.py): a training step equals the untiled swap's over
families, padding, batches and tokens not divisible by the chunk, with LoRA (PEFT) and a 4-bit base;
it runs where it should (counted) and not at short sequences; by default only under gradient
checkpointing (one MLP forward per layer without it), everywhere when asked for by name; with
gradient checkpointing the MLP runs twice per step, not three times; autocast and dropout masks are
replayed in backward; it stands aside under torch.compile; checkpoint offloading gives the stock
losses; restore undoes it. Tests of the tiled machinery itself ask for the op by name (`OPS`)."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_patch import restore_kernels, swap_kernels
from accel_kernels import _dispatch, _triton
from accel_patch.swaps import OPS, apply, sites
from accel_patch.swaps.layers import tiled_mlp

from _models import build, padded_batch, rel, training_step
from test_cpu_path import OpsSeen

UNTILED = [op for op in OPS if op != "tiled_mlp"]
CHUNK = 4  # padded_batch has 3 x 10 = 30 tokens: chunks of 4, ..., 4 and 2


@pytest.fixture
def forced(monkeypatch):
    """Tile every call of the tiny models, 4 tokens a chunk (the documented knobs: MIN_ELEMENTS and
    chunk_tokens, read at every call)."""
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "chunk_tokens", lambda hidden, intermediate: CHUNK)


@pytest.fixture
def no_triton(monkeypatch):
    """The plain-torch path beneath (the stock MLP, the LoRA function's twin): the tiled machinery is
    the same, and the tests run without the Triton interpreter's cost (one test keeps the kernel)."""
    monkeypatch.setattr(_triton, "INTERPRETING", False)
    assert not _dispatch.use_triton(torch.zeros(1))


def calls(model) -> dict:
    return apply.unwrap(model).__dict__[sites.STATE_ATTR].calls


def twins(base, prepare=lambda m: m):
    """(untiled, tiled): the same model swapped without and with the tiled MLP (asked for by name:
    it tiles without checkpointing too)."""
    untiled, tiled = prepare(copy.deepcopy(base)), prepare(copy.deepcopy(base))
    swap_kernels(untiled, UNTILED)
    report = swap_kernels(tiled, OPS)
    return untiled, tiled, report


def assert_same_step(untiled, tiled, batch=None, loss_bound=1e-5, grad_bound=1e-4):
    batch = batch or padded_batch()
    loss0, grads0, _ = training_step(untiled, batch)
    loss1, grads1, _ = training_step(tiled, batch)
    assert grads0 and grads1.keys() == grads0.keys()
    assert rel(loss1, loss0) <= loss_bound, (loss1, loss0)
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= grad_bound, (worst, rel(grads1[worst], grads0[worst]))


@pytest.mark.parametrize("family, kernels", [pytest.param("llama", "triton interpreter", marks=pytest.mark.slow),
                                             ("phi3", "plain torch"),
                                             pytest.param("gemma", "plain torch", marks=pytest.mark.slow),
                                             pytest.param("qwen3", "plain torch", marks=pytest.mark.slow)])
def test_a_tiled_step_equals_the_untiled_swap(forced, request, family, kernels):
    """SiLU split (llama, with the GLU kernel under Triton's interpreter in each chunk), fused gate_up
    (phi3), tanh-GELU (gemma); padding, batch 3, 30 tokens (not a multiple of the chunk)."""
    if kernels == "plain torch":
        request.getfixturevalue("no_triton")
    # one layer under the interpreter: each chunk launches the kernels three times
    untiled, tiled, report = twins(build(family, **({"num_hidden_layers": 1} if kernels != "plain torch" else {})))
    layers = untiled.config.num_hidden_layers
    assert report.swapped["tiled_mlp"] == layers
    with OpsSeen() as ops:
        assert_same_step(untiled, tiled)
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.TILED: layers}
    assert "tiled_mlp" not in calls(untiled)
    if kernels != "plain torch":  # the GLU kernel ran in every chunk, forward and recompute (and once untiled)
        chunks = -(-padded_batch()["input_ids"].numel() // CHUNK)
        assert ops.seen.count("glu") == (2 * chunks + 1) * layers, ops.seen


def test_short_sequences_run_the_forward_beneath_and_are_counted(monkeypatch, no_triton):
    model = build("llama")
    swap_kernels(model, OPS)
    training_step(model, padded_batch())
    layers = model.config.num_hidden_layers
    assert calls(model)["tiled_mlp"] == {tiled_mlp.SHORT: layers}  # the default threshold: 30 tokens are short
    # the threshold is tokens x intermediate, with at least two chunks
    tokens, inter = 30, model.config.intermediate_size
    monkeypatch.setattr(tiled_mlp, "chunk_tokens", lambda hidden, intermediate: 15)
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", tokens * inter + 1)
    training_step(model, padded_batch())
    assert calls(model)["tiled_mlp"] == {tiled_mlp.SHORT: 2 * layers}
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", tokens * inter)
    training_step(model, padded_batch())
    assert calls(model)["tiled_mlp"] == {tiled_mlp.SHORT: 2 * layers, tiled_mlp.TILED: layers}
    with torch.no_grad():
        model(**padded_batch())
    assert calls(model)["tiled_mlp"][tiled_mlp.NO_GRAD] == layers
    model.eval()  # with grad: bitsandbytes' 4-bit layers would repack their weights in a no-grad chunk
    model(**padded_batch()).logits.sum().backward()
    assert calls(model)["tiled_mlp"][tiled_mlp.EVAL] == layers


def mlp_rows(model) -> list:
    """Rows (tokens) each MLP's down projection computes, summed over the calls: MLP passes x tokens."""
    seen = [0]
    for layer in apply.unwrap(model).model.layers:
        layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, args: seen.__setitem__(0, seen[0] + args[0].numel() // args[0].shape[-1]))
    return seen


@pytest.mark.parametrize("checkpointing", [pytest.param(None, marks=pytest.mark.slow), "non-reentrant"])
def test_with_checkpointing_the_mlp_runs_twice_per_step_as_untiled(forced, no_triton, checkpointing):
    """Non-reentrant checkpointing (transformers' default) recomputes the layer up to the last tensor it
    saved: the tiled function's input, saved before its chunks run, so the MLP runs in the forward and
    once in backward (chunk by chunk), as the untiled swap's does. Without checkpointing the tiled MLP
    runs twice where the untiled one runs once (the price of keeping nothing)."""
    untiled, tiled, _ = twins(build("llama"))
    if checkpointing:
        for m in (untiled, tiled):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows0, rows1 = mlp_rows(untiled), mlp_rows(tiled)
    assert_same_step(untiled, tiled)
    tokens = padded_batch()["input_ids"].numel() * untiled.config.num_hidden_layers
    assert rows0[0] == (2 if checkpointing else 1) * tokens
    assert rows1[0] == 2 * tokens
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.TILED: untiled.config.num_hidden_layers}


def test_by_default_it_tiles_only_under_checkpointing(forced, no_triton):
    """The default swap (no ops named): without gradient checkpointing the MLP runs once per layer
    (counted "not checkpointed"); with transformers' checkpointing it tiles (two passes, as
    untiled); asked for by name it tiles without checkpointing too (two passes)."""
    model = build("llama")
    report = swap_kernels(model)
    layers = model.config.num_hidden_layers
    assert report.swapped["tiled_mlp"] == layers  # installed: it decides per call
    rows = mlp_rows(model)
    tokens = padded_batch()["input_ids"].numel() * layers
    training_step(model, padded_batch())
    assert rows[0] == tokens and calls(model)["tiled_mlp"] == {tiled_mlp.NO_CHECKPOINTING: layers}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    training_step(model, padded_batch())
    assert rows[0] == 3 * tokens and calls(model)["tiled_mlp"][tiled_mlp.TILED] == layers
    model.gradient_checkpointing_disable()
    swap_kernels(model, "tiled_mlp")  # named after the default swap: the sites it installed tile from now on
    training_step(model, padded_batch())
    assert rows[0] == 5 * tokens and calls(model)["tiled_mlp"][tiled_mlp.TILED] == 2 * layers


def test_by_default_it_follows_each_layers_own_checkpointing(forced, no_triton):
    """`every_n_layers=2` checkpoints layer 0 of 2 (the base model's flag is on for both): only the
    checkpointed layer tiles, the other runs its MLP once."""
    model = build("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no every_n_layers")
    swap_kernels(model)
    enable({"use_reentrant": False}, every_n_layers=2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False]
    training_step(model, padded_batch())
    assert calls(model)["tiled_mlp"] == {tiled_mlp.TILED: 1, tiled_mlp.NO_CHECKPOINTING: 1}


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_mlp_forwards_per_layer_at_4096_tokens_by_default(no_triton, checkpointing):
    """The default thresholds at 4096 tokens x intermediate 2816 (past MIN_ELEMENTS, several chunks):
    a training step runs one MLP forward per layer without checkpointing, at most two with
    non-reentrant checkpointing (forwards counted by the rows the down projections see)."""
    model = build("llama", intermediate_size=2816, max_position_embeddings=4096)
    swap_kernels(model)
    layers, inter = model.config.num_hidden_layers, model.config.intermediate_size
    tokens = 4096
    assert tokens * inter >= tiled_mlp.MIN_ELEMENTS and tokens >= 2 * tiled_mlp.chunk_tokens(model.config.hidden_size, inter)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = mlp_rows(model)
    ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(0))
    training_step(model, {"input_ids": ids, "labels": ids})
    forwards = rows[0] / (tokens * layers)
    if checkpointing:
        assert forwards <= 2 and calls(model)["tiled_mlp"] == {tiled_mlp.TILED: layers}
    else:
        assert forwards == 1 and calls(model)["tiled_mlp"] == {tiled_mlp.NO_CHECKPOINTING: layers}


@pytest.mark.slow
def test_reentrant_checkpointing_tiles_the_recompute(forced, no_triton):
    """Reentrant checkpointing runs the forward without grad (the forward beneath, counted) and tiles
    the recompute: three MLP passes (documented), the same gradients."""
    untiled, tiled, _ = twins(build("llama"))
    for m in (untiled, tiled):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    rows1 = mlp_rows(tiled)
    assert_same_step(untiled, tiled)
    layers = untiled.config.num_hidden_layers
    assert rows1[0] == 3 * padded_batch()["input_ids"].numel() * layers
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.NO_GRAD: layers, tiled_mlp.TILED: layers}


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules="all-linear")


def with_lora(model, **config):
    torch.manual_seed(3)
    return get_peft_model(model, LoraConfig(**{**LORA, **config}))


@pytest.mark.slow  # over 2 s
def test_a_lora_mlp_tiles_over_the_fused_lora_function(forced, no_triton, monkeypatch):
    """The tiled site sits on top of the fused LoRA MLP: adapter gradients accumulate over chunks."""
    # The test's chunks (4 tokens, run without grad in the forward) look like decode steps to the
    # LoRA sites' decode rule; real chunks are at least `hidden` tokens, far above DECODE_ROWS.
    from accel_patch.swaps.lora import sites as lora_sites

    monkeypatch.setattr(lora_sites, "DECODE_ROWS", 0)
    untiled, tiled, _ = twins(build("llama"), with_lora)
    assert_same_step(untiled, tiled)
    layers = untiled.config.num_hidden_layers
    chunks = -(-padded_batch()["input_ids"].numel() // CHUNK)
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.TILED: layers}
    # the fused LoRA function ran on every chunk, in the forward and in the backward's recompute
    assert calls(tiled)["lora_mlp"] == {"fused": 2 * chunks * layers}
    assert calls(untiled)["lora_mlp"] == {"fused": layers}


def test_lora_dropout_masks_are_replayed_chunk_by_chunk(forced, no_triton):
    """With dropout the recompute must draw the forward's masks: the tiled gradients equal those of
    the same chunks computed one after another with grad (the same RNG stream)."""
    model = with_lora(build("llama"), lora_dropout=0.5)
    swap_kernels(model, OPS)
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 9, model.config.hidden_size, requires_grad=True)
    params = [p for p in mlp.parameters() if p.requires_grad]
    dy = torch.randn(2, 9, model.config.hidden_size)
    torch.manual_seed(7)
    rows = x.reshape(-1, x.shape[-1])
    ref = torch.cat([tiled_mlp.call_inner(mlp, rows[s:s + CHUNK]) for s in range(0, 18, CHUNK)]).view_as(dy)
    ref_grads = torch.autograd.grad(ref, [x, *params], dy)
    torch.manual_seed(7)
    got = mlp(x)
    got_grads = torch.autograd.grad(got, [x, *params], dy)
    assert calls(model)["tiled_mlp"] == {tiled_mlp.TILED: 1}
    assert torch.equal(got, ref)  # the same masks in the forward
    for g, r in zip(got_grads, ref_grads):
        assert rel(g, r) <= 1e-6
    assert torch.get_rng_state().equal(torch.get_rng_state())  # (the backward leaves the RNG where it was)


def test_the_recompute_runs_under_the_forwards_autocast(forced, no_triton):
    """Backward runs without autocast: the recompute must re-enter the forward's (bf16 on CPU)."""
    model = build("llama")
    swap_kernels(model, OPS)
    dtypes = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**padded_batch()).loss
    loss.backward()
    assert calls(model)["tiled_mlp"] == {tiled_mlp.TILED: model.config.num_hidden_layers}
    assert len(dtypes) == 2 * -(-30 // CHUNK) and set(dtypes) == {torch.bfloat16}, dtypes


@pytest.mark.slow
def test_a_qlora_4bit_base_tiles_as_it_trains_untiled(forced, no_triton, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    build("llama").save_pretrained(tmp_path / "llama")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "0")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "llama", quantization_config=quant)
    untiled, tiled = with_lora(copy.deepcopy(base)), with_lora(copy.deepcopy(base))
    swap_kernels(untiled, UNTILED)
    swap_kernels(tiled, OPS)
    assert type(tiled.base_model.model.model.layers[0].mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    assert_same_step(untiled, tiled)
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.TILED: 2}


def test_restore_puts_back_every_forward_and_the_stock_output(forced, no_triton):
    stock = build("llama")
    model = copy.deepcopy(stock)
    swap_kernels(model)
    assert restore_kernels(model)
    for m in model.modules():
        assert not {"forward", tiled_mlp.SITE_ATTR, tiled_mlp.INNER_ATTR} & set(m.__dict__), type(m).__name__
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(model, batch)
    assert torch.equal(loss0, loss1) and all(torch.equal(grads1[n], g) for n, g in grads0.items())


@pytest.mark.slow
def test_under_torch_compile_the_tiled_site_stands_aside(forced, no_triton):
    """Dynamo cannot trace an autograd function calling autograd.grad in its backward, and a count
    written per call would be a guard that fails at every call: the forward beneath runs, uncounted."""
    model = build("llama")
    swap_kernels(model, OPS)
    model.train()
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 10, model.config.hidden_size, requires_grad=True)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), type(mlp).forward(mlp, x))
    assert "tiled_mlp" not in calls(model)
    mlp(x)  # eager: tiled, counted
    assert calls(model)["tiled_mlp"] == {tiled_mlp.TILED: 1}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("reentrant", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_checkpoint_offloading_gives_the_stock_losses(forced, no_triton, monkeypatch, reentrant, device):
    """TrainingArguments' `gradient_checkpointing_kwargs={"offload": True}`, which Trainer turns into
    `activation_checkpointing_enable(offload=True)`: `save_on_cpu` around every checkpointed layer (on
    a machine without an accelerator, copies on the host). A swapped model, tiled MLP included, trains
    as stock, with the reentrant checkpoint too (whose saved inputs go through save_on_cpu). On a
    machine without an accelerator transformers 5.24 still asks for pinned memory, which raises
    (stock too): there the test has save_on_cpu copy to plain host memory."""
    if device == "cpu":
        import transformers.modeling_utils as modeling_utils

        plain = torch.autograd.graph.save_on_cpu
        monkeypatch.setattr(modeling_utils, "save_on_cpu", lambda pin_memory, device_type: plain(False, device_type))
    stock = build("llama").to(device)
    swapped = copy.deepcopy(stock)
    swap_kernels(swapped)
    for m in (stock, swapped):  # transformers 5.17 has only the older name, with the same offload
        enable = getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable
        enable({"use_reentrant": reentrant}, offload=True)
    assert_same_step(stock, swapped, {k: v.to(device) for k, v in padded_batch().items()})
    assert calls(swapped)["tiled_mlp"][tiled_mlp.TILED] == stock.config.num_hidden_layers


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_trl_activation_offloading_gives_the_stock_losses(forced, no_triton, monkeypatch, device):
    """TRL's `activation_offloading=True` (its OffloadActivations saved-tensor hooks) copies every
    tensor autograd saves to the host and back. It needs an accelerator (on a CPU-only machine
    `torch.accelerator.current_accelerator()` is None): on CPU the test names the CPU as the
    accelerator, so every saved tensor (the kernels', the tiled MLP's, the fused loss's) still goes
    through TRL's own copy out and back, without streams or pinned memory."""
    pytest.importorskip("trl", reason="TRL's activation offloading needs trl (not on the GPU image)")
    from trl.models import activation_offloading

    if device == "cpu":
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
        monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)  # called once bitsandbytes is imported
    stock = build("llama").to(device)
    swapped = copy.deepcopy(stock)
    swap_kernels(swapped, OPS)  # no checkpointing here: asked for by name
    batch = {k: v.to(device) for k, v in padded_batch().items()}
    results = []
    for model in (stock, swapped):
        offload = activation_offloading.get_act_offloading_ctx_manager(
            model, use_pin_memory=device == "cuda", use_streams=device == "cuda", min_offload_size=0)
        model.train()
        with offload:
            loss = model(**batch).loss
        loss.backward()
        assert offload.tensor_id > 0  # tensors went through TRL's hooks
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss0, grads0), (loss1, grads1) = results
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    assert calls(swapped)["tiled_mlp"] == {tiled_mlp.TILED: stock.config.num_hidden_layers}


@pytest.mark.slow
def test_fsdp2_layers_tile_with_the_untiled_gradients(forced, no_triton, gloo_group):
    """fully_shard per layer (one process, gloo): inside a unit's forward and backward the parameters
    are FSDP2's unsharded tensors; the chunks' gradients reach them as in the untiled step, and FSDP2
    reduce-scatters them."""
    from torch.distributed.fsdp import fully_shard

    untiled, tiled, _ = twins(build("llama"))
    for model in (untiled, tiled):
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    batch = padded_batch()
    losses, grads = [], []
    for model in (untiled, tiled):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    assert rel(losses[1], losses[0]) <= 1e-5
    assert max(rel(grads[1][n], g) for n, g in grads[0].items()) <= 1e-4
    assert calls(tiled)["tiled_mlp"] == {tiled_mlp.TILED: untiled.config.num_hidden_layers}
