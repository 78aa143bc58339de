"""Fused LoRA with dropout > 0 (accel_patch/swaps/lora/): under the same seed a swapped step equals
stock PEFT's (the masks drawn as PEFT's nn.Dropout draws them, on each adapted projection's input,
in PEFT's order), another seed gives another step, eval mode drops nothing, and backward keeps the
masks as one byte per element."""
from __future__ import annotations

import pytest
import torch

from _models import build, padded_batch, rel, training_step
from test_lora import ALL_LINEAR, calls, peft_model
from test_lora_autocast import assert_qkv_equals_peft, expected_calls

DROPOUT = 0.1


def seeded_step(model, seed):
    torch.manual_seed(seed)
    return training_step(model, padded_batch())


@pytest.mark.parametrize("family, order", [
    ("llama", "swap-then-peft"),
    pytest.param("phi3", "peft-then-swap", marks=pytest.mark.slow),  # one fused gate_up: one mask
    pytest.param("qwen2", "peft-then-swap", marks=pytest.mark.slow),
    pytest.param("gpt_neox", "swap-then-peft", marks=pytest.mark.slow),  # one fused query_key_value
])
def test_with_dropout_a_swapped_step_equals_stock_under_the_same_seed(family, order):
    base = build(family)
    stock = peft_model(base, "stock", lora_dropout=DROPOUT)
    twin = peft_model(base, order, lora_dropout=DROPOUT)
    loss0, grads0, _ = seeded_step(stock, 5)
    loss1, grads1, _ = seeded_step(twin, 5)
    assert grads0 and grads1.keys() == grads0.keys()
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, worst
    assert calls(twin) == expected_calls(base, family)
    # the dropout acted: another seed gives another step
    loss2, grads2, _ = seeded_step(twin, 6)
    assert rel(loss2, loss0) > 1e-4
    assert min(rel(grads2[n], g) for n, g in grads0.items() if "lora_A" in n) > 1e-3


@pytest.mark.slow
def test_with_dropout_under_bf16_autocast_the_qkv_function_equals_pefts_layers_bit_for_bit():
    assert_qkv_equals_peft(torch.float32, torch.bfloat16, dropout=DROPOUT)
    assert_qkv_equals_peft(torch.bfloat16, None, dropout=DROPOUT)


def test_with_dropout_a_bf16_model_under_bf16_autocast_equals_pefts_layers_bit_for_bit():
    # the GPU benchmark's setting: bf16 base, PEFT's float32 adapters, bf16 autocast, dropout
    assert_qkv_equals_peft(torch.bfloat16, torch.bfloat16, dropout=DROPOUT)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh)")


@needs_cuda
@pytest.mark.parametrize("model_dtype, autocast, bound", [
    (torch.float32, None, 1e-5),  # CUDA's fused dropout kernel: its mask and its float32 scale
    (torch.float32, torch.bfloat16, 1e-2),
    (torch.bfloat16, None, 1e-2),  # PEFT's float32 adapters: the mask drawn in float32
])
def test_on_cuda_the_qkv_function_with_dropout_equals_pefts_layers(model_dtype, autocast, bound):
    assert_qkv_equals_peft(model_dtype, autocast, dropout=DROPOUT, device="cuda", bound=bound)


@needs_cuda
def test_on_cuda_with_dropout_a_swapped_step_equals_stock_under_the_same_seed():
    base = build("llama")
    stock = peft_model(base, "stock", lora_dropout=DROPOUT).cuda()
    twin = peft_model(base, "peft-then-swap", lora_dropout=DROPOUT).cuda()
    batch = {k: v.cuda() for k, v in padded_batch().items()}
    losses, grads = [], []
    for model in (stock, twin):
        torch.manual_seed(5)
        loss, g, _ = training_step(model, batch)
        losses.append(loss), grads.append(g)
    assert rel(losses[1], losses[0]) <= 1e-5
    assert max(rel(grads[1][n], g) for n, g in grads[0].items()) <= 1e-4
    assert calls(twin) == expected_calls(base, "llama")


@pytest.mark.slow
def test_in_eval_mode_nothing_is_dropped_and_the_call_is_fused():
    base = build("llama")
    stock = peft_model(base, "stock", lora_dropout=DROPOUT)
    twin = peft_model(base, "swap-then-peft", lora_dropout=DROPOUT)
    stock.eval(), twin.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        ref = stock(**padded_batch()).logits
        torch.manual_seed(2)  # another seed: nothing random runs
        assert rel(twin(**padded_batch()).logits, ref) <= 1e-5
    assert calls(twin)["lora_mlp"] == {"fused": 2}


def test_with_dropout_the_fused_mlp_saves_x_gate_up_and_a_byte_per_mask_element():
    base = build("llama")
    model = peft_model(base, "peft-then-swap", lora_dropout=DROPOUT)
    model.train()
    mlp_ = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 5, base.config.hidden_size, requires_grad=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append((t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp_(x)
    hidden, inter = base.config.hidden_size, base.config.intermediate_size
    floats = sum(n for dtype, n in saved if dtype != torch.bool)
    masks = sorted(n for dtype, n in saved if dtype == torch.bool)
    r = ALL_LINEAR["r"]
    assert floats == 10 * (hidden + 2 * inter + 3 * r) * 4  # x, gate, up, the r-wide products: as with dropout 0
    assert masks == sorted([10 * hidden, 10 * hidden, 10 * inter])  # gate's, up's, down's: 1 byte each
    assert calls(model) == {"lora_mlp": {"fused": 1}}


def test_where_dropout_runs_its_fused_kernel_the_mask_is_drawn_in_one_rng_call_without_a_fill(monkeypatch):
    # CUDA's path, run on CPU's native_dropout: the kernel's mask is its RNG draw alone, so the
    # noise tensor is never written first (no [tokens, width] pass before the draw); the mask is the
    # one native_dropout draws on a filled input under the same seed
    from torch.utils._python_dispatch import TorchDispatchMode

    from accel_patch.swaps.lora import functions, plans

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    layer = peft_model(build("llama"), "stock", lora_dropout=DROPOUT).base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, layer.in_features)
    proj, (A, _) = plans.projection(layer.train(), x)
    monkeypatch.setattr(functions, "_FUSED_DROPOUT", ("cpu",))
    torch.manual_seed(3)
    with Ops() as ops:
        mask = functions.dropout_mask(None, x, proj, x.dtype, A, x.device)
    passes = [n for n in ops.names if n not in ("promote_types", "view")]  # no data touched by these
    assert passes == ["empty_like", "native_dropout"], ops.names
    torch.manual_seed(3)
    expected = torch.native_dropout(torch.ones_like(x), DROPOUT, True)[1]
    assert mask.dtype == torch.bool and torch.equal(mask, expected.reshape(-1, x.shape[-1]))
    assert 0 < (~mask).sum() < mask.numel()


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16 base, float32 adapters", "under bf16 autocast"])
def test_where_dropout_runs_its_fused_kernel_the_forward_draws_each_mask_in_pefts_order_bit_for_bit(autocast):
    # CUDA's dropout run on CPU tensors (lora_census.cuda_dropout: PEFT's F.dropout as the one
    # native_dropout kernel, the fused functions on their CUDA branch): each eager call draws its masks
    # in its forward, on PEFT's dropout input itself where no cast follows (the kernel's output is the
    # adapter's input: no mask multiply), else on an unwritten tensor. Everything equals the masks
    # drawn before the call bit for bit; q/k/v equals PEFT's layers, and so do the MLP's output and
    # down's gradients (the GLU's backward rounds once where autograd's rounds each step)
    import lora_census as census
    from accel_kernels import _triton

    from accel_patch.swaps.lora import functions

    attn, mlp = census.peft_modules(DROPOUT, census.HOST_WIDTHS)
    x = torch.randn(2, 6, census.HOST_WIDTHS[0], dtype=torch.bfloat16)
    drawn, kernel_outputs = [], []
    real_draw, real_dropout = functions._draw, torch.native_dropout

    def dropout(*args):
        out = real_dropout(*args)
        kernel_outputs.append(out[0])  # held: no later tensor can take its memory
        return out

    def spy(v, m, casts):
        out = real_draw(v, m, casts)
        drawn.append(out[0] is kernel_outputs[-1])  # the adapter reads the kernel's own output
        return out

    def step(module, call):
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            outs = call(xi)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return [*outs, xi.grad, *(p.grad for p in params)]

    results = {}
    with census.cuda_dropout(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_triton, "INTERPRETING", False)  # the GLU's backward in plain torch
        mp.setattr(functions, "_draw", spy)
        for path in ("PEFT", "drawn before", "drawn inside"):
            if path == "drawn before":
                mp.setattr(functions, "_draws_inside", lambda x: False)
            if path == "drawn inside":
                mp.undo()
                mp.setattr(_triton, "INTERPRETING", False)
                mp.setattr(functions, "_draw", spy)
                mp.setattr(torch, "native_dropout", dropout)
            for name, module in (("q/k/v", attn), ("MLP", mlp)):
                make = census.qkv_call if name == "q/k/v" else census.mlp_call
                results[name, path] = step(module, make(module, path != "PEFT"))
    # q, k, v, gate, up, down: the kernel's output is the adapter's input in float32 (no cast follows);
    # under autocast the adapter runs in bf16, so the mask alone is drawn
    assert drawn == [not autocast] * 6
    for name in ("q/k/v", "MLP"):
        for got, want in zip(results[name, "drawn inside"], results[name, "drawn before"], strict=True):
            assert torch.equal(got, want), name
    for got, want in zip(results["q/k/v", "drawn inside"], results["q/k/v", "PEFT"], strict=True):
        assert torch.equal(got, want)
    mlp_out, *_, down_a, down_b = results["MLP", "drawn inside"]
    peft_out, *_, peft_a, peft_b = results["MLP", "PEFT"]
    assert torch.equal(mlp_out, peft_out) and torch.equal(down_a, peft_a) and torch.equal(down_b, peft_b)
    # the masks dropped something: without dropout the adapters' gradients differ
    plain, _ = census.peft_modules(0.0, census.HOST_WIDTHS)
    assert not torch.equal(step(plain, census.qkv_call(plain, False))[4], results["q/k/v", "PEFT"][4])


def test_the_dropout_scale_follows_the_kernel_the_device_runs_after_cuda_was_simulated_on_cpu():
    # CUDA's dropout simulated on CPU tensors must leave CPU's scale (its noise rounded in the
    # input's dtype) to the calls after it: a cached CUDA value there broke bit equality with PEFT
    import lora_census as census

    from accel_patch.swaps.lora import functions

    cpu = functions.dropout_scale(DROPOUT, torch.bfloat16, "cpu")
    with census.cuda_dropout():
        cuda = functions.dropout_scale(DROPOUT, torch.bfloat16, "cpu")
    assert cuda != cpu  # bf16's rounded 1/(1-p) against float32's
    assert functions.dropout_scale(DROPOUT, torch.bfloat16, "cpu") == cpu
    assert cpu == float(torch.ones((), dtype=torch.bfloat16).div_(1 - DROPOUT))
