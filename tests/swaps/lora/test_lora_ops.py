"""The fused LoRA functions as custom ops (accel_patch_lora::linears, ::mlp and their backward
ops): torch.library.opcheck passes (schema, fake implementations, registered autograd, AOT
dispatch), and each function compiles with fullgraph=True, equals eager bit for bit under the same
seed (dropout and autocast included, and a bitsandbytes 4-bit base) and does not recompile on its
second call."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_patch.swaps.lora import functions, plans

from _models import build
from test_lora import ALL_LINEAR
from test_lora_autocast import checkpoints, qlora  # noqa: F401  (checkpoints: a fixture)


def layer(family="qwen2", dropout=0.1):
    torch.manual_seed(3)
    model = get_peft_model(build(family), LoraConfig(**{**ALL_LINEAR, "lora_dropout": dropout}))
    model.train()
    return model.base_model.model.model.layers[0]


def planned(projections, x):
    found = [plans.projection(m, x) for m in projections]
    assert not [f for f in found if isinstance(f, str)], found
    return [f[0] for f in found], [t for f in found for t in f[1]]


def qkv_call(attn):
    def call(x):
        return functions.fused_linears(x, *planned([attn.q_proj, attn.k_proj, attn.v_proj], x))
    return call


def mlp_call(mlp):
    def call(x):
        return (functions.fused_mlp(x, *planned([mlp.gate_proj, mlp.up_proj, mlp.down_proj], x), "silu", True),)
    return call


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [torch.bfloat16])  # dtypes cast at every step: the widest spec
def test_the_ops_pass_opcheck(autocast):
    block = layer()
    x = torch.randn(2, 3, block.self_attn.q_proj.in_features, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        attn, mlp = block.self_attn, block.mlp
        linears_args = functions.linears_inputs(x, *planned([attn.q_proj, attn.k_proj, attn.v_proj], x))
        mlp_args = functions.mlp_inputs(x, *planned([mlp.gate_proj, mlp.up_proj, mlp.down_proj], x), "silu", True)
    assert any(t.dtype == torch.bool for t in linears_args[1])  # the dropout masks go in
    torch.library.opcheck(torch.ops.accel_patch_lora.linears.default, linears_args)
    torch.library.opcheck(torch.ops.accel_patch_lora.mlp.default, mlp_args)
    # the backward ops (no autograd of their own: first-order gradients, inputs detached)
    detached = torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, (linears_args, mlp_args))
    (x, tensors, spec), (_, mlp_tensors, mlp_spec) = detached
    outs = torch.ops.accel_patch_lora.linears(x, tensors, spec)
    outs, products = outs[:3], outs[3:]
    # then each projection's r-wide x A^T, which the backward op takes (or remakes, given none)
    assert [p.shape[0] for p in products] == [x.shape[0] * x.shape[1]] * 3
    for kept in (products, []):
        torch.library.opcheck(torch.ops.accel_patch_lora.linears_backward.default,
                              ([torch.randn_like(o) for o in outs], x, tensors, kept, spec, True))
    out, gate, up, *mlp_products = torch.ops.accel_patch_lora.mlp(x, mlp_tensors, mlp_spec)
    assert len(mlp_products) == 3
    for kept in (mlp_products, []):
        torch.library.opcheck(torch.ops.accel_patch_lora.mlp_backward.default,
                              (torch.randn_like(out), x, gate, up, mlp_tensors, kept, mlp_spec, False))


def assert_compiled_equals_eager(call, params, x, autocast=None):
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (call, compiled, compiled):  # the second compiled call must not recompile
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            torch.manual_seed(0)
            outs = fn(x * 1)
        grads = torch.autograd.grad(outs, [x] + params, [torch.ones_like(o).cumsum_(-1) for o in outs])
        results.append((outs, grads))
    for outs, grads in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs, results[0][0]))
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


@pytest.mark.slow
@pytest.mark.parametrize("op, autocast", [("qkv", torch.bfloat16), ("mlp", torch.bfloat16)])
def test_each_function_compiles_with_fullgraph_and_equals_eager_with_dropout(op, autocast):
    torch._dynamo.reset()
    block = layer()
    call = qkv_call(block.self_attn) if op == "qkv" else mlp_call(block.mlp)
    params = [p for n, p in block.named_parameters() if p.requires_grad and ("mlp" in n) == (op == "mlp")
              and "o_proj" not in n]
    x = torch.randn(2, 3, block.self_attn.q_proj.in_features, requires_grad=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert_compiled_equals_eager(call, params, x, autocast)


@pytest.mark.slow
def test_a_4bit_base_compiles_and_passes_opcheck(checkpoints):
    pytest.importorskip("bitsandbytes")
    torch._dynamo.reset()
    model = qlora(checkpoints, "qwen2", torch.bfloat16)
    model.train()
    block = model.base_model.model.model.layers[0]
    assert block.mlp.up_proj.base_layer.weight.quant_state.nested
    x = torch.randn(2, 3, block.self_attn.q_proj.in_features, requires_grad=True)
    attn, mlp = block.self_attn, block.mlp
    with torch.autocast("cpu", dtype=torch.bfloat16):
        args = functions.mlp_inputs(x, *planned([mlp.gate_proj, mlp.up_proj, mlp.down_proj], x), "silu", True)
    torch.library.opcheck(torch.ops.accel_patch_lora.mlp.default, args)
    for call, names in ((qkv_call(attn), ("q_proj", "k_proj", "v_proj")), (mlp_call(mlp), ("gate_proj", "up_proj", "down_proj"))):
        params = [p for n, p in block.named_parameters() if p.requires_grad and any(k in n for k in names)]
        with torch._dynamo.config.patch(error_on_recompile=True):
            assert_compiled_equals_eager(call, params, x, torch.bfloat16)


def _op_call(kind, projections, act_first=True):
    """The same function through the custom ops' registered autograd, whose backward recomputes
    what the eager path keeps (the adapters' casts, the r-wide drop(x) A^T)."""
    def call(x):
        if kind == "qkv":
            x_, tensors, spec = functions.linears_inputs(x, *planned(projections, x))
            outs = torch.ops.accel_patch_lora.linears(x_, tensors, spec)[:len(projections)]
            return tuple(o.view(*x.shape[:-1], -1) for o in outs)
        x_, tensors, spec = functions.mlp_inputs(x, *planned(projections, x), "silu", act_first)
        return (torch.ops.accel_patch_lora.mlp(x_, tensors, spec)[0].view(*x.shape[:-1], -1),)
    return call


@pytest.mark.parametrize("autocast, alpha", [
    (None, 16),             # float32 throughout: x A^T kept unscaled, the adapters are the parameters
    (torch.bfloat16, 16),   # PEFT's float32 adapters under autocast, scale 2: s x A^T kept, bf16 A and B kept
    (torch.bfloat16, 12),   # scale 1.5 (not a power of two): x A^T kept unscaled, scaled again in backward
])
@pytest.mark.parametrize("op", ["qkv", "mlp"])
def test_what_the_eager_path_keeps_gives_the_gradients_of_recomputing_it_bit_for_bit(op, autocast, alpha):
    torch.manual_seed(3)
    config = {**ALL_LINEAR, "lora_dropout": 0.1, "lora_alpha": alpha}
    block = get_peft_model(build("qwen2"), LoraConfig(**config)).train().base_model.model.model.layers[0]
    for n, p in block.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
    if op == "qkv":
        names = ("q_proj", "k_proj", "v_proj")
        projections = [getattr(block.self_attn, n) for n in names]
        eager, ops = qkv_call(block.self_attn), _op_call("qkv", projections)
    else:
        names = ("gate_proj", "up_proj", "down_proj")
        projections = [getattr(block.mlp, n) for n in names]
        eager, ops = mlp_call(block.mlp), _op_call("mlp", projections)
    params = [p for n, p in block.named_parameters() if p.requires_grad and any(k in n for k in names)]
    x = torch.randn(2, 5, block.self_attn.q_proj.in_features, requires_grad=True)
    results, kept = [], []
    # eager (keeps the products and the cast adapters), the ops (keep the products), the ops
    # remaking everything (their backward op given no products)
    for call, remade in ((eager, False), (ops, False), (ops, True)):
        with pytest.MonkeyPatch.context() as mp:
            if remade:
                mp.setattr(functions, "_kept_dicts", lambda metas, products: None)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                torch.manual_seed(0)
                outs = call(x * 1)
            if call is eager:
                kept = outs[0].grad_fn.next_functions[0][0].kept_at  # the fused node beneath the output's view
            grads = torch.autograd.grad(outs, [x] + params, [torch.randn_like(o, generator=torch.Generator().manual_seed(1))
                                                             for o in outs])
        results.append((outs, grads))
    (outs0, grads0), *others = results
    for outs1, grads1 in others:
        assert [torch.equal(a, b) for a, b in zip(outs0, outs1)] == [True] * len(outs0)
        assert [torch.equal(a, b) for a, b in zip(grads0, grads1)] == [True] * len(grads0)
    folded = autocast is not None and alpha == 16
    expect = {"xa_s"} if folded else {"xa"}
    if autocast is not None:
        expect |= {"A", "B"}
    assert {name for _, name in kept} == expect and len(kept) == len(names) * len(expect)


def test_the_eager_functions_run_their_math_with_autocast_off_and_give_it_back(monkeypatch):
    # every dtype of the math comes from the spec (as inside a custom op), so the Functions switch
    # the caller's autocast off around it, forward and backward, and on again after
    seen = []
    forward, backward = functions.proj_forward, functions.proj_backward
    monkeypatch.setattr(functions, "proj_forward",
                        lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or forward(*a, **k))
    monkeypatch.setattr(functions, "proj_backward",
                        lambda *a, **k: seen.append(torch.is_autocast_enabled("cpu")) or backward(*a, **k))
    attn = layer().self_attn
    x = torch.randn(2, 5, attn.q_proj.in_features, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = qkv_call(attn)(x)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        loss = sum(o.float().sum() for o in outs)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = qkv_call(attn)(x)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])  # backward inside autocast too
        assert torch.is_autocast_enabled("cpu")
    assert seen == [False] * 12  # three projections, forward and backward, twice
