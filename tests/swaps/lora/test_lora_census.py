"""What one fused LoRA call costs against PEFT's layers, counted op by op (lora_census.py): at
Llama-1B widths, under bf16 autocast with PEFT's float32 adapters and dropout (the GPU benchmark's
setting) the fused calls write no float32 [tokens, width] tensor, and in every counted setting they
move no more bytes, forward plus backward, than PEFT's layers do."""
from __future__ import annotations

import pytest

import lora_census as census

# the counts run every call at Llama-1B widths on the CPU: 6-9 s for the module's fixtures
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def counted():
    out = {}
    for label, autocast, p in census.SETTINGS:
        attn, mlp = census.peft_modules(p)
        for call, make in (("q/k/v", lambda f: census.qkv_call(attn, f)), ("MLP", lambda f: census.mlp_call(mlp, f))):
            for path, fused in (("PEFT", False), ("fused", True)):
                fwd, bwd = census.run(make(fused), autocast, modules=(attn, mlp))
                out[label, call, path] = census.summary(fwd), census.summary(bwd)
    return out


AUTOCAST_DROPOUT = census.SETTINGS[0][0]


@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_under_autocast_the_fused_call_writes_no_float32_activation(counted, call):
    fwd, bwd = counted[AUTOCAST_DROPOUT, call, "fused"]
    peft_fwd, _ = counted[AUTOCAST_DROPOUT, call, "PEFT"]
    assert peft_fwd["float32 [tokens, width] outputs"] > 0  # the count sees PEFT's float32 copies
    # the dropout masks' own draw (float32, as PEFT's dropout sees it) is the only one left: one per projection
    assert fwd["float32 [tokens, width] outputs"] <= 3 * 2 and bwd["float32 [tokens, width] outputs"] == 0


@pytest.mark.parametrize("setting", [s[0] for s in census.SETTINGS])
@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_the_fused_call_moves_no_more_bytes_than_pefts_layers(counted, setting, call):
    fused = sum(s["bytes"] for s in counted[setting, call, "fused"])
    peft = sum(s["bytes"] for s in counted[setting, call, "PEFT"])
    assert fused <= peft, (fused / 1e9, peft / 1e9)


@pytest.mark.parametrize("setting", [s[0] for s in census.SETTINGS])
@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_the_fused_call_runs_no_more_matmuls_than_pefts_layers(counted, setting, call):
    # backward reuses the r-wide drop(x) A^T its forward kept, as PEFT's autograd does
    fused = [s["matmul"] for s in counted[setting, call, "fused"]]
    peft = [s["matmul"] for s in counted[setting, call, "PEFT"]]
    assert fused == peft, (fused, peft)


#: The dropout settings, and one dtype throughout (bf16 adapters on the bf16 base, as TRL's QLoRA
#: casts them), where PEFT's dropout output feeds the adapter as it is.
CUDA_DROPOUT_SETTINGS = [(*s, None) for s in census.SETTINGS if s[2] > 0] + [
    ("pure bf16, bf16 adapters, dropout 0.05", False, 0.05, "bfloat16")]


@pytest.fixture(scope="module")
def counted_cuda_dropout():
    import torch

    out = {}
    for label, autocast, p, adapters in CUDA_DROPOUT_SETTINGS:
        attn, mlp = census.peft_modules(p, adapter_dtype=adapters and getattr(torch, adapters))
        for call, make in (("q/k/v", lambda f: census.qkv_call(attn, f)), ("MLP", lambda f: census.mlp_call(mlp, f))):
            for path, fused in (("PEFT", False), ("fused", True)):
                fwd, bwd = census.run(make(fused), autocast, modules=(attn, mlp), on_cuda_dropout=True)
                out[label, call, path] = census.summary(fwd), census.summary(bwd), [r[0] for r in fwd + bwd]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("setting", [s[0] for s in CUDA_DROPOUT_SETTINGS])
@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_with_dropout_as_cuda_runs_it_the_fused_call_moves_no_more_bytes_than_pefts_layers(
        counted_cuda_dropout, setting, call):
    # CUDA's F.dropout is one native_dropout pass (the CPU's is three): the comparison that holds on the GPU
    *fused, fused_ops = counted_cuda_dropout[setting, call, "fused"]
    *peft, peft_ops = counted_cuda_dropout[setting, call, "PEFT"]
    assert "native_dropout" in peft_ops and "bernoulli_" not in peft_ops + fused_ops  # CUDA's ops counted
    assert "native_dropout" in fused_ops
    fused, peft = sum(s["bytes"] for s in fused), sum(s["bytes"] for s in peft)
    assert fused <= peft, (fused / 1e9, peft / 1e9)


def _through_the_ops(projections, mlp: bool):
    """One call through the custom ops and their registered autograd (the path torch.compile takes)."""
    import torch

    from accel_patch.swaps.lora import functions

    def call(x):
        projs, adapters = census._plan(projections, x)
        if mlp:
            x2, tensors, spec = functions.mlp_inputs(x, projs, adapters, "silu", False, functions.GLU_TORCH)
            return (torch.ops.accel_patch_lora.mlp(x2, tensors, spec)[0],)
        x2, tensors, spec = functions.linears_inputs(x, projs, adapters)
        return tuple(torch.ops.accel_patch_lora.linears(x2, tensors, spec)[:len(projections)])
    return call


@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_through_the_custom_ops_the_backward_runs_no_more_matmuls_than_pefts_layers(call):
    # the forward op hands its r-wide products to the backward op (saved by the registered autograd)
    label, autocast, p = census.SETTINGS[0]
    attn, mlp = census.peft_modules(p, census.HOST_WIDTHS)  # a count, not bytes: small widths do
    if call == "q/k/v":
        projections, peft = [attn.q_proj, attn.k_proj, attn.v_proj], census.qkv_call(attn, False)
    else:
        projections, peft = [mlp.gate_proj, mlp.up_proj, mlp.down_proj], census.mlp_call(mlp, False)
    hidden = census.HOST_WIDTHS[0]
    _, ops_bwd = census.run(_through_the_ops(projections, call == "MLP"), autocast, hidden=hidden, modules=(attn, mlp))
    _, peft_bwd = census.run(peft, autocast, hidden=hidden, modules=(attn, mlp))
    assert census.summary(ops_bwd)["matmul"] == census.summary(peft_bwd)["matmul"] == 15


@pytest.mark.slow
@pytest.mark.parametrize("call", ["q/k/v", "MLP"])
def test_on_cuda_each_dropped_input_and_dx_term_is_masked_and_scaled_in_one_pass(counted_cuda_dropout, call):
    # dropout's own backward op (grad * mask * scale, rounded once, one CUDA kernel), not a mask
    # multiply then a scale: each dx term and each recomputed dropped input
    fwd, bwd, _ = counted_cuda_dropout[AUTOCAST_DROPOUT, call, "fused"]
    assert bwd["dropout"] >= 6, bwd  # q, k, v twice (gate, up, down twice; and down's input remade)
