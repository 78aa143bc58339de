"""moe_experts against transformers' experts math in float64: every layout (F.linear and
transposed, halves and interleaved, biases), every activation (gpt-oss's clamped GLU included),
imbalanced routing (all tokens to one expert, empty experts, top-k 1 and 8, "no expert" ids,
token counts off the block, T = 1), split LoRA on strided PEFT-like views, autocast's dtype,
the saved bytes, and the Triton path really running (its launches counted).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_kernels._launch as launch
import accel_kernels.ops.moe_experts as moe_module
from _checks import assert_close, rel_err
from accel_kernels import moe_experts
from accel_kernels.bench.memory import LiveBytes


# --------------------------------------------------------------------------------------------
# The reference: transformers' eager experts loop (integrations/moe.py, GptOssExperts)
# --------------------------------------------------------------------------------------------


def act_eager(gate, up, activation, alpha=1.702, limit=None):
    if activation != "gpt_oss" and limit is not None and limit != float("inf"):
        # DeepSeek V4's and GLM-5-next's _apply_gate: the clamped SwiGLU
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
    if activation == "gpt_oss":
        limit = 7.0 if limit is None else limit
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up


def experts_eager(hidden, index, weights, gate_up, down, gate_up_bias=None, down_bias=None, *, transposed=False,
                  interleaved=False, activation="silu", lora=None, alpha=1.702, limit=None):
    """The per-expert loop of transformers' eager experts; LoRA merged into the weight (PEFT's
    ParamWrapper: W + scaling * B @ A)."""
    E = gate_up.shape[0]
    gu_w, d_w = gate_up, down
    if lora is not None:
        s = lora["scaling"]
        scaling = s if isinstance(s, dict) else {"gate_up": s, "down": s}
        if lora.get("gate_up") is not None:
            a, b = lora["gate_up"]
            delta = scaling["gate_up"] * (b @ a)  # [E, out, in]
            gu_w = gu_w + (delta.transpose(1, 2) if transposed else delta)
        if lora.get("down") is not None:
            a, b = lora["down"]
            delta = scaling["down"] * (b @ a)
            d_w = d_w + (delta.transpose(1, 2) if transposed else delta)
    out = torch.zeros_like(hidden)
    mask = F.one_hot(index.clamp(min=0, max=E).masked_fill(index < 0, E), num_classes=E + 1).permute(2, 1, 0)
    for e in range(E):
        top_k_pos, token_idx = torch.where(mask[e])
        if token_idx.numel() == 0:
            continue
        x = hidden[token_idx]
        gu = x @ gu_w[e] if transposed else F.linear(x, gu_w[e])
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e]
        gate, up = (gu[..., ::2], gu[..., 1::2]) if interleaved else gu.chunk(2, dim=-1)
        h = act_eager(gate, up, activation, alpha, limit)
        y = h @ d_w[e] if transposed else F.linear(h, d_w[e])
        if down_bias is not None:
            y = y + down_bias[e]
        y = y * weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


def make(T=13, H=32, I=16, E=4, K=2, *, dtype=torch.float32, transposed=False, bias=False, device="cpu",
         routing="random", scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(1)  # one seeded stream: every device gets the same inputs

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device="cpu") * s).to(device=device, dtype=dtype)  # g's stream

    hidden = rnd(T, H)
    logits = torch.randn(T, E, generator=g, device="cpu")  # g's stream; the routing is moved to `device` below
    if routing == "one":  # every token to expert 1 (and K - 1 others)
        logits[:, 1] += 100.0
    if routing == "empty":  # expert 0 and the last never chosen
        logits[:, 0] -= 100.0
        logits[:, E - 1] -= 100.0
    if routing == "middle":  # expert 1 never chosen, experts before and after it are
        logits[:, 1] -= 100.0
    top = torch.topk(logits.softmax(-1), K, dim=-1)
    index = top.indices.to(device)
    weights = (top.values / top.values.sum(-1, keepdim=True)).to(device=device, dtype=dtype)
    gu_shape, d_shape = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
    gate_up = rnd(*gu_shape, s=scale / H ** 0.5)
    down = rnd(*d_shape, s=1.0 / I ** 0.5)
    biases = (rnd(E, 2 * I, s=0.3), rnd(E, H, s=0.3)) if bias else (None, None)
    return hidden, index, weights, gate_up, down, *biases


def peft_lora(E, H, I, r=4, *, dtype=torch.float32, device="cpu", scaling=2.0, which=("gate_up", "down")):
    """A and B as PEFT's ParamWrapper holds them (lora_A.weight [r*E, in], lora_B.weight [out, r*E]),
    viewed as the op takes them: A [E, r, in] contiguous, B [E, out, r] a permuted, strided view."""
    g = torch.Generator(device="cpu").manual_seed(2)  # one seeded stream: the same LoRA on every device
    leaves, lora = [], {"scaling": scaling}
    for name, fan_in, fan_out in (("gate_up", H, 2 * I), ("down", I, H)):
        if name not in which:
            lora[name] = None
            continue
        a_w = (torch.randn(r * E, fan_in, generator=g, device="cpu") / fan_in ** 0.5).to(device=device, dtype=dtype)  # g's stream
        b_w = (torch.randn(fan_out, r * E, generator=g, device="cpu") * 0.3).to(device=device, dtype=dtype)  # g's stream
        leaves += [a_w, b_w]
        lora[name] = (a_w, b_w)
    return leaves, lora


def lora_views(lora, E):
    out = {"scaling": lora["scaling"]}
    for name in ("gate_up", "down"):
        if lora.get(name) is None:
            out[name] = None
            continue
        a_w, b_w = lora[name]
        a = a_w.view(E, -1, a_w.shape[1])
        b = b_w.view(b_w.shape[0], -1, E).permute(2, 0, 1)  # [E, out, r], not contiguous
        out[name] = (a, b)
    return out


def run(fn, hidden, index, weights, gate_up, down, gub=None, db=None, *, dout, lora_leaves=None, lora=None,
        train=("hidden", "weights", "gate_up", "down", "gub", "db"), **options):
    """fn's output and the grads of (out * dout).sum() wrt every trained input (and LoRA leaves)."""
    named = {"hidden": hidden, "weights": weights, "gate_up": gate_up, "down": down, "gub": gub, "db": db}
    leaves = {k: (v.detach().clone().requires_grad_(k in train) if v is not None else None)
              for k, v in named.items()}
    extra = {}
    if lora is not None:
        ll = [t.detach().clone().requires_grad_() for t in lora_leaves]
        it = iter(ll)
        raw = {"scaling": lora["scaling"]}
        for name in ("gate_up", "down"):
            raw[name] = (next(it), next(it)) if lora.get(name) is not None else None
        extra["lora"] = lora_views(raw, gate_up.shape[0])
    else:
        ll = []
    out = fn(leaves["hidden"], index, leaves["weights"], leaves["gate_up"], leaves["down"], leaves["gub"],
             leaves["db"], **options, **extra)
    out.backward(dout)
    grads = {k: v.grad for k, v in leaves.items() if v is not None and v.requires_grad}
    grads.update({f"lora{i}": t.grad for i, t in enumerate(ll)})
    return out.detach(), grads


def check(hidden, index, weights, gate_up, down, gub=None, db=None, *, lora_leaves=None, lora=None,
          train=("hidden", "weights", "gate_up", "down", "gub", "db"), expect_triton=None, **options):
    """moe_experts against experts_eager in float64, output and every gradient, with the dtype's bound."""
    dtype = hidden.dtype
    dout = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3)).to(hidden.device, dtype)
    to64 = (lambda t: t.double() if t is not None else None)
    with launch.recording() as launched:
        got, got_g = run(moe_experts, hidden, index, weights, gate_up, down, gub, db, dout=dout,
                         lora_leaves=lora_leaves, lora=lora, train=train, **options)
    ref, ref_g = run(experts_eager, *map(to64, (hidden,)), index, *map(to64, (weights, gate_up, down, gub, db)),
                     dout=dout.double(), lora_leaves=[t.double() for t in lora_leaves] if lora_leaves else None,
                     lora=lora, train=train, **options)
    stock, stock_g = (None, {}) if dtype == torch.float32 else run(
        experts_eager, hidden, index, weights, gate_up, down, gub, db, dout=dout, lora_leaves=lora_leaves,
        lora=lora, train=train, **options)
    assert got.dtype == dtype and got.shape == hidden.shape
    assert_close(got, ref, dtype, stock=stock, what="output")
    assert set(got_g) == set(ref_g), (set(got_g), set(ref_g))
    for name, g in got_g.items():
        r = ref_g[name]
        assert g is not None, f"no gradient for {name}"
        assert g.shape == r.shape, name
        assert_close(g, r, dtype, stock=stock_g.get(name), what=f"grad of {name}")
    triton = moe_module._dispatch.use_triton(hidden) if expect_triton is None else expect_triton
    if triton:
        assert any(name.startswith("_moe_") for name in launched), launched
    else:
        assert launched == [], launched
    return got, got_g


# --------------------------------------------------------------------------------------------
# Layouts, activations, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # interpreted Triton: over 2 s
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_mixtral_layout_matches_float64(device, activation):
    check(*make(device=device), activation=activation)


def test_quick_mixtral_layout_with_an_empty_expert(device):
    # the quick loop's pass: top-2 of 4 experts, two of them never chosen, T off the block
    hidden, index, *rest = make(T=7, E=4, K=2, routing="empty", device=device)
    check(hidden, index, *rest)


def test_gpt_oss_layout_matches_float64(device):
    # transposed, interleaved, biased, and inputs large enough that the clamps clamp
    inputs = make(T=6, H=32, I=16, E=4, K=2, transposed=True, bias=True, device=device, scale=30.0)
    gate_up_out = inputs[0] @ inputs[3][0]
    assert (gate_up_out[:, ::2] > 7.0).any() and (gate_up_out[:, 1::2].abs() > 7.0).any()
    check(*inputs, transposed=True, interleaved=True, activation="gpt_oss", alpha=1.702, limit=7.0)


def past_the_limit(inputs, limit, *, transposed=False, interleaved=False):
    """The fraction of gate and up pre-activations past the clamped SwiGLU's bound."""
    hidden, index, _, gate_up = inputs[:4]
    gu = torch.stack([hidden @ gate_up[e] if transposed else hidden @ gate_up[e].t() for e in range(gate_up.shape[0])])
    rows = torch.nn.functional.one_hot(index, gate_up.shape[0]).sum(1).t().bool()  # [E, T]: routed pairs
    gu = gu[rows]
    gate, up = (gu[:, ::2], gu[:, 1::2]) if interleaved else gu.chunk(2, dim=-1)
    return float(((gate > limit).sum() + (up.abs() > limit).sum()) / gu.numel())


@pytest.mark.parametrize("path", ["triton", "twin"])
def test_the_clamped_swiglu_matches_float64_past_its_limit(device, monkeypatch, path):
    # DeepSeek V4 / GLM-5-next: silu(gate.clamp(max=10)) * up.clamp(-10, 10), about 1% past 10;
    # without the clamp in the epilogue and its zero gradient where it clamps, the gradients differ
    if path == "twin":
        monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    inputs = make(T=24, H=32, I=16, E=4, K=2, device=device, scale=3.9)
    assert 0.003 <= past_the_limit(inputs, 10.0) <= 0.03
    check(*inputs, activation="silu", limit=10.0, expect_triton=path == "triton")


def test_the_clamped_swiglu_with_gelu_and_interleaved(device):
    inputs = make(T=24, H=32, I=16, E=4, K=2, transposed=True, device=device, scale=3.9)
    assert 0.003 <= past_the_limit(inputs, 10.0, transposed=True, interleaved=True) <= 0.05
    check(*inputs, transposed=True, interleaved=True, activation="gelu", limit=10.0)


def test_without_a_limit_nothing_is_clamped(device):
    inputs = make(T=6, H=32, I=16, E=4, K=2, device=device, scale=30.0)
    assert past_the_limit(inputs, 7.0) > 0.1  # gpt-oss's default bound, which silu must not take
    check(*inputs, activation="silu")


@pytest.mark.slow  # interpreted Triton: over 2 s
@pytest.mark.parametrize("transposed,interleaved", [(True, False), (False, True)])
def test_other_layouts(device, transposed, interleaved):
    check(*make(transposed=transposed, bias=True, device=device), transposed=transposed, interleaved=interleaved)


@pytest.mark.slow  # interpreted Triton: over 2 s
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_stock_error(device, dtype):
    check(*make(T=17, dtype=dtype, bias=True, device=device))


def recorded_tiles(monkeypatch) -> list:
    """The tile sizes each Triton call of moe_experts chose, in order (forward, then backward)."""
    chosen = []
    real = moe_module._tiles
    monkeypatch.setattr(moe_module, "_tiles", lambda *a: chosen.append(real(*a)) or chosen[-1])
    return chosen


def test_quick_large_tiles_match_float64(device, monkeypatch):
    # a training step's shape in small: 2 experts of 72 rows in bf16 take the large tiles (128
    # rows, 256 columns of the down GEMM, 64 + 64 of gate/up, 128 x 128 weight-gradient blocks),
    # every dim off those blocks: H 288 (a second, partial column tile of the down GEMM and of
    # dx's product), I 80 and 2I 160 (partial gate/up and weight-gradient blocks), 72 rows of a
    # 128-row tile
    chosen = recorded_tiles(monkeypatch)
    check(*make(T=72, H=288, I=80, E=2, K=2, dtype=torch.bfloat16, bias=True, device=device))
    assert chosen and all(moe_module.large(t) for t in chosen), chosen  # at the device's stages


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_large_tiles_over_several_tiles_an_expert_with_lora(device, monkeypatch):
    # two experts of 136 rows (top-2 of 2), each over two 128-row tiles, the second partial; LoRA
    # on both projections (the low-rank dot in the down GEMM's 128-column tiles)
    T, H, I, E, K = 136, 320, 96, 2, 2
    chosen = recorded_tiles(monkeypatch)
    inputs = make(T=T, H=H, I=I, E=E, K=K, dtype=torch.bfloat16, device=device)
    counts = torch.bincount(inputs[1].flatten(), minlength=E)
    assert (counts == 136).all(), counts
    leaves, lora = peft_lora(E, H, I, dtype=torch.bfloat16, device=device)
    check(*inputs, lora_leaves=leaves, lora=lora, train=("hidden", "weights"))
    assert chosen and all(moe_module.large(t) for t in chosen), chosen  # at the device's stages


def test_the_tiles_follow_rows_per_expert_dtype_operands_and_shared_memory(monkeypatch):
    bf16, fp32, cuda = torch.bfloat16, torch.float32, torch.device("cuda", 0)
    tiles, large, small = moe_module._tiles, moe_module.LARGE_TILES, moe_module.SMALL_TILES
    rows = 64 * moe_module.LARGE_TILES_MIN_ROWS  # 64 experts at the threshold
    cpu = torch.device("cpu")
    assert tiles(rows, 64, bf16, 2, cpu) == large
    assert tiles(rows, 64, torch.float16, 2, cpu) == large
    assert tiles(rows - 1, 64, bf16, 2, cpu) == small  # below: the mean (63) to its power of two, at most 64
    assert tiles(8, 128, bf16, 2, cpu) == small._replace(block_m=16)  # a decode step
    assert tiles(rows, 64, bf16, 4, cpu) == small  # fp32 weights or activations under autocast
    assert tiles(rows, 64, fp32, 4, cpu) == small._replace(num_warps=moe_module.FP32_WARPS)
    # on CUDA the stages the device's shared memory a block holds: sm_90, sm_80, a 99 KiB device
    for shared, expected in ((227 << 10, large), (163 << 10, large._replace(num_stages=3)), (99 << 10, small)):
        monkeypatch.setattr(moe_module, "_cuda_shared_memory", lambda index: shared)
        assert tiles(rows, 64, bf16, 2, cuda) == expected, shared


@pytest.mark.parametrize("master", [torch.bfloat16, torch.float32])
def test_quick_the_call_s_widest_operand_picks_the_tiles(device, monkeypatch, master):
    # 64 rows an expert under bf16 autocast: bf16 weights and hidden stream 2-byte tiles (large);
    # fp32 ones (a full fine-tune of fp32 weights) stream 4-byte tiles, which at the large sizes
    # would need 320 KiB of shared memory a block (small)
    chosen = recorded_tiles(monkeypatch)
    hidden, index, weights, gate_up, down, _, _ = make(T=64, H=16, I=16, E=2, K=2, device=device)
    x, gu, d = (t.to(master).requires_grad_() for t in (hidden, gate_up, down))
    moe_experts(x, index, weights, gu, d, autocast_dtype=torch.bfloat16).float().sum().backward()
    assert len(chosen) >= 2, chosen  # the forward's and the backward's (and on CUDA auto's, first)
    assert all(moe_module.large(t) == (master == torch.bfloat16) for t in chosen), chosen
    assert x.grad is not None and gu.grad.dtype == master


def test_float64_runs_the_twin(device):
    inputs = [t.double() if t is not None and t.is_floating_point() else t for t in make(device=device)]
    check(*inputs, expect_triton=False)


@pytest.mark.parametrize("path", ["grouped_mm", "loop"])
def test_quick_twin_with_an_empty_expert_between_others(device, monkeypatch, path):
    # the twin's two ways to compute (torch._grouped_mm, a loop over the experts), with an empty
    # expert that has experts on both sides: none may stop at it, skip the next, or leave its
    # weight gradient unwritten
    if device.type != "cpu":
        pytest.skip("the twin runs on CPU tensors")
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    calls = []
    if path == "loop":
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    elif not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm")
    else:
        real = torch._grouped_mm

        def grouped_mm(a, b, offs=None, **kwargs):
            # as the twin assumes of grouped_mm (CPU's zeroes it): an empty group's block of a
            # weight gradient is left as found, here NaN
            out = real(a, b, offs=offs, **kwargs)
            calls.append(out.dim())
            if out.dim() == 3:
                out[offs.diff(prepend=offs.new_zeros(1)) == 0] = float("nan")
            return out

        monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
    hidden, index, *rest = make(T=7, E=4, K=2, routing="middle", device=device)
    counts = torch.bincount(index.flatten(), minlength=4)
    assert counts[1] == 0 and counts[0] > 0 and counts[2] > 0 and counts[3] > 0
    check(hidden, index, *rest, expect_triton=False)
    assert (3 in calls and 2 in calls) if path == "grouped_mm" else not calls


# --------------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_every_token_to_one_expert(device):
    # (empty experts: the quick Mixtral-layout case; token counts off the block: every case's T)
    hidden, index, *rest = make(T=21, E=4, K=2, routing="one", device=device)
    assert torch.bincount(index.flatten(), minlength=4)[1] == 21
    check(hidden, index, *rest)


@pytest.mark.slow  # interpreted Triton: over 2 s
@pytest.mark.parametrize("k,E", [(1, 4), (8, 8)])
def test_top_k_1_and_8(device, k, E):
    check(*make(T=9, E=E, K=k, device=device))


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_a_decode_step_of_one_token(device):
    check(*make(T=1, E=4, K=2, device=device))


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_no_expert_ids_are_skipped(device):
    # transformers' masks use E (expert parallelism: experts of another rank); < 0 too
    hidden, index, weights, gate_up, down, _, _ = make(T=10, E=4, K=2, device=device)
    index = index.clone()
    index[0, 1] = 4
    index[3, 0] = -1
    index[5] = 4  # a token with no expert at all
    got, grads = check(hidden, index, weights, gate_up, down)
    assert (got[5] == 0).all()
    assert grads["weights"][0, 1] == 0 and grads["weights"][3, 0] == 0 and (grads["weights"][5] == 0).all()


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


@pytest.mark.slow  # interpreted Triton: over 2 s
@pytest.mark.parametrize("transposed", [False, True])
def test_split_lora_on_peft_views_matches_merged_weights(device, transposed):
    T, H, I, E = 12, 32, 16, 4
    inputs = make(T=T, H=H, I=I, E=E, transposed=transposed, bias=transposed, device=device)
    leaves, lora = peft_lora(E, H, I, device=device)
    b_view = lora_views(lora, E)["gate_up"][1]
    assert not b_view.is_contiguous()
    _, grads = check(*inputs, lora_leaves=leaves, lora=lora, train=("hidden", "weights"), transposed=transposed,
                     interleaved=transposed, activation="gpt_oss" if transposed else "silu")
    assert set(grads) == {"hidden", "weights", "lora0", "lora1", "lora2", "lora3"}  # base weights frozen


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_each_projection_s_adapters_take_their_own_scaling(device):
    # PEFT's rsLoRA doubles a fused gate/up's rank: alpha / sqrt(2r) there, alpha / sqrt(r) on down
    T, H, I, E = 12, 32, 16, 4
    leaves, lora = peft_lora(E, H, I, device=device, scaling={"gate_up": 0.5, "down": 3.0})
    check(*make(T=T, H=H, I=I, E=E, device=device), lora_leaves=leaves, lora=lora, train=("hidden", "weights"))


def test_quick_each_projection_s_scaling_on_the_twin(device, monkeypatch):
    # the plain-torch twin's own LoRA terms (gate/up rows, the down GEMM, dx, dh, every factor's
    # gradient) read their projection's scaling
    T, H, I, E = 9, 32, 16, 4
    leaves, lora = peft_lora(E, H, I, device=device, scaling={"gate_up": 3.0, "down": 0.25})
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    check(*make(T=T, H=H, I=I, E=E, device=device), lora_leaves=leaves, lora=lora, train=("hidden", "weights"),
          expect_triton=False)


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_lora_on_one_projection(device):
    T, H, I, E = 9, 32, 16, 4
    leaves, lora = peft_lora(E, H, I, device=device, which=("down",))
    check(*make(T=T, H=H, I=I, E=E, device=device), lora_leaves=leaves, lora=lora, train=("hidden",))


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_autocast_dtype_with_float32_adapters(device):
    # bf16 compute from float32 parameters and PEFT's float32 adapters: what autocast gives stock
    T, H, I, E = 10, 32, 16, 4
    hidden, index, weights, gate_up, down, _, _ = make(T=T, H=H, I=I, E=E, device=device)
    leaves, lora = peft_lora(E, H, I, device=device)
    views = lora_views(lora, E)
    out = moe_experts(hidden, index, weights, gate_up, down, lora=views, autocast_dtype=torch.bfloat16)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        stock = experts_eager(hidden, index, weights, gate_up, down, lora=views)
    ref = experts_eager(*(t.double() for t in (hidden,)), index, weights.double(), gate_up.double(), down.double(),
                        lora={"scaling": 2.0, **{k: tuple(t.double() for t in v) for k, v in views.items()
                                                 if k != "scaling"}})
    assert out.dtype == torch.float32
    assert_close(out, ref, torch.bfloat16, stock=stock, what="output under autocast")
    assert rel_err(out, ref) > 1e-5  # it did compute in bf16


# --------------------------------------------------------------------------------------------
# Memory: x, the routing weights and the sort
# --------------------------------------------------------------------------------------------


def saved_activation_bytes(fn, params, *args, **kwargs) -> int:
    """Bytes of distinct storages autograd keeps while building fn(...), parameters left out."""
    storages = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    out.sum().backward()
    return sum(storages.values())


@pytest.mark.usefixtures("unguarded_outputs")
def test_saves_only_x_routing_and_the_sort(device):
    T, H, I, E, K = 8, 32, 16, 4, 2
    hidden, index, weights, gate_up, down, gub, db = make(T=T, H=H, I=I, E=E, K=K, bias=True, device=device)
    hidden.requires_grad_()
    weights.requires_grad_()
    params = [p.requires_grad_() for p in (gate_up, down, gub, db)]
    ours = saved_activation_bytes(moe_experts, params, hidden, index, weights, gate_up, down, gub, db)
    assert ours == hidden.nbytes + weights.nbytes + T * K * 4 + (E + 1) * 4
    stock = saved_activation_bytes(experts_eager, params, hidden, index, weights, gate_up, down, gub, db)
    assert stock > 3 * ours


def lora_backward_call(T=256, H=96, I=32, E=8, K=4, r=8):
    """(backward args, inputs) of one twin backward with LoRA on both projections, the base frozen
    (PEFT's case): args = (dout, hidden, weights, order, offsets, params, needs)."""
    hidden, index, weights, gate_up, down, _, _ = make(T=T, H=H, I=I, E=E, K=K)
    _, lora = peft_lora(E, H, I, r=r)
    (gu_a, gu_b), (d_a, d_b) = (lora_views(lora, E)[n] for n in ("gate_up", "down"))
    order, offsets = moe_module._route(index, E)
    params = moe_module._Params(gate_up, down, None, None, gu_a, gu_b, d_a, d_b, 2.0, 2.0, False, False,
                                moe_module.SILU, 1.702, float("inf"), torch.float32)
    needs = (True, True, False, False, False, False, True, True, True, True)
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    return (dout, hidden, weights, order, offsets, params, needs), \
        [hidden, weights, gate_up, down, gu_a, gu_b, d_a, d_b, dout, order, offsets]


def test_the_twin_backward_holds_h_dgu_and_two_row_products_at_once():
    # LoRA on both projections, the base frozen (PEFT's case): what the backward holds at once is
    # h [rows, I] and dgu [rows, 2I], a [rows, H] product with its LoRA term, and the [T, H]
    # combine; x and g are gathered where a product reads them and dropped after it
    T, H, I, K = 256, 96, 32, 4
    args, inputs = lora_backward_call(T, H, I, K=K)
    held = LiveBytes(inputs)
    with held:
        grads = moe_module._backward(*args, moe_module._TorchOps)
    needs = args[-1]
    assert all(g is not None for g, need in zip(grads, needs) if need)
    rows = T * K
    design = 4 * (rows * I + rows * 2 * I + 2 * rows * H + T * H)  # fp32
    assert held.peak <= 1.1 * design, (held.peak, design)  # 10%: the LoRA intermediates, the sort's int64 copies
    assert held.peak >= 4 * rows * 2 * I, held.peak  # dgu at least: the count sees the backward's tensors


# --------------------------------------------------------------------------------------------
# Paths and checks
# --------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_argument(device):
    hidden, index, weights, gate_up, down, _, _ = make(device=device)
    with pytest.raises(ValueError, match=r"gate_up has shape \(4, 31, 32\).*transposed=False"):
        moe_experts(hidden, index, weights, gate_up[:, :31], down)
    with pytest.raises(ValueError, match=r"down has shape \(4, 16, 32\).*needs \(4, 32, 16\)"):
        moe_experts(hidden, index, weights, gate_up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="top_k_index must be an integer tensor"):
        moe_experts(hidden, index.float(), weights, gate_up, down)
    with pytest.raises(ValueError, match="top_k_weights has shape"):
        moe_experts(hidden, index, weights[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_experts(hidden, index, weights, gate_up, down, activation="relu")
    with pytest.raises(ValueError, match="down has dtype torch.float16"):
        moe_experts(hidden, index, weights, gate_up, down.half())
    with pytest.raises(ValueError, match="alpha must be a float, got nan"):
        moe_experts(hidden, index, weights, gate_up, down, alpha=float("nan"))
    with pytest.raises(ValueError, match="limit must be finite for activation 'gpt_oss', got inf"):
        moe_experts(hidden, index, weights, gate_up, down, activation="gpt_oss", limit=float("inf"))
    with pytest.raises(ValueError, match=r"lora\['down'\] B has shape"):
        a = torch.randn(4, 2, 16, device=device)
        moe_experts(hidden, index, weights, gate_up, down, lora={"gate_up": None, "down": (a, torch.randn(4, 2, 32, device=device)),
                                                               "scaling": 1.0})
    with pytest.raises(ValueError, match="lora must be None or a dict"):
        moe_experts(hidden, index, weights, gate_up, down, lora={"scaling": 1.0, "up": None})
    a, b = torch.randn(4, 2, 16, device=device), torch.randn(4, 32, 2, device=device)
    with pytest.raises(ValueError, match=r"lora\['scaling'\]\['down'\] must be a float, got None"):
        moe_experts(hidden, index, weights, gate_up, down, lora={"down": (a, b), "scaling": {"gate_up": 1.0}})
    with pytest.raises(ValueError, match=r"lora\['scaling'\] as a dict takes the keys 'gate_up' and 'down'"):
        moe_experts(hidden, index, weights, gate_up, down, lora={"down": (a, b), "scaling": {"up": 1.0}})
    with pytest.raises(ValueError, match=r"lora\['scaling'\] must be a float, got '2'"):
        moe_experts(hidden, index, weights, gate_up, down, lora={"down": (a, b), "scaling": "2"})


def test_a_grouped_mm_that_refuses_a_kind_of_operands_is_tried_once_not_per_call(monkeypatch):
    # an unsupported set-up pays one raised error; every later call of that kind goes to the loop
    calls = []

    def refusing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("grouped_mm: not supported here")

    monkeypatch.setattr(torch, "_grouped_mm", refusing, raising=False)
    monkeypatch.setattr(moe_module, "_GROUPED_MM", {})
    counts = [3, 0, 5]
    ends = torch.tensor([3, 3, 8], dtype=torch.int32)
    x, w = torch.randn(8, 16), torch.randn(3, 16, 32)
    want = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    for _ in range(3):
        assert torch.allclose(moe_module._grouped(x, w, counts, ends), want)
        grad = moe_module._grouped_weight_grad(x, x[:, :4], counts, ends)
        assert torch.allclose(grad[2], x[3:].t() @ x[3:, :4]) and not grad[1].any()
    assert len(calls) == 2  # once for the product, once for the weight gradient


def test_saving_gate_up_gives_the_recompute_s_gradients_with_one_grouped_gemm_less(monkeypatch):
    # the twin's save mode: what a checkpointed layer asks for (its forward already ran twice)
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    grouped = []
    real = moe_module._grouped
    monkeypatch.setattr(moe_module, "_grouped", lambda *a: grouped.append(1) or real(*a))
    inputs = make(T=9, E=4, K=2, bias=True, transposed=True)
    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3))
    results = {}
    for save in (False, True):
        grouped.clear()
        out, grads = run(lambda *a, **k: moe_experts(*a, **k, save_gate_up=save), *inputs, dout=dout,
                         transposed=True, interleaved=True, activation="gpt_oss")
        results[save] = (out, grads, len(grouped))
    (out0, grads0, gemms0), (out1, grads1, gemms1) = results[False], results[True]
    assert torch.equal(out0, out1) and all(torch.equal(grads0[k], grads1[k]) for k in grads0)
    assert gemms1 == gemms0 - 1, (gemms0, gemms1)


def _windowed_and_whole(monkeypatch, save):
    """Every layout option, biases, LoRA on both projections, an empty expert and "no expert" slots,
    through the twin in one window for all experts and in one window per expert: ({budget: (output,
    gradients)}, the call's inputs, its options)."""
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    T, H, I, E, K = 40, 32, 16, 6, 2
    hidden, index, weights, gate_up, down, gub, db = make(T=T, H=H, I=I, E=E, K=K, bias=True, transposed=True,
                                                          routing="middle")
    index = index.clone()
    index[3, 1], index[5, 0] = E, -1
    leaves, lora = peft_lora(E, H, I, r=4)
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    inputs = dict(hidden=hidden, index=index, weights=weights, gate_up=gate_up, down=down, gub=gub, db=db,
                  dout=dout, leaves=leaves, lora=lora)
    options = dict(transposed=True, interleaved=True, activation="gpt_oss")
    counted, real = [], moe_module._windows
    monkeypatch.setattr(moe_module, "_windows", lambda *a: counted.append(len(real(*a))) or real(*a))
    results = {}
    for budget in (moe_module.TWIN_WINDOW_BYTES, 1):  # 1 byte: a window per expert
        monkeypatch.setattr(moe_module, "TWIN_WINDOW_BYTES", budget)
        counted.clear()
        results[budget] = run(lambda *a, **k: moe_experts(*a, **k, save_gate_up=save), hidden, index, weights,
                              gate_up, down, gub, db, dout=dout, lora_leaves=leaves, lora=lora, **options)
        assert counted == ([1, 1] if budget > 1 else [E, E]), (budget, counted)
    return results, inputs, options


@pytest.mark.parametrize("save", [False, True])
def test_the_twin_in_windows_of_experts_stays_within_the_float32_bound(monkeypatch, save):
    # one window per expert and one for all are each within float32's bound of the float64 result,
    # so they differ by at most the two errors; not bit for bit on every host: torch's CPU kernels
    # round some elements by where they fall in a tensor (a vectorized body and its scalar tail,
    # each thread's share), and a window changes the tensors' lengths (docs/moe.md)
    results, x, options = _windowed_and_whole(monkeypatch, save)
    to64 = (lambda t: t.double() if t is not None else None)
    ref, ref_g = run(experts_eager, to64(x["hidden"]), x["index"],
                     *map(to64, (x["weights"], x["gate_up"], x["down"], x["gub"], x["db"])), dout=x["dout"].double(),
                     lora_leaves=[t.double() for t in x["leaves"]], lora=x["lora"], **options)
    for budget, (out, grads) in results.items():
        assert_close(out, ref, torch.float32, what=f"output, budget {budget}")
        assert set(grads) == set(ref_g) and len(grads) == 10
        for name, g in grads.items():
            assert_close(g, ref_g[name], torch.float32, what=f"grad of {name}, budget {budget}")


def test_a_window_of_experts_bounds_what_the_twin_backward_holds():
    # the same call as above, in four windows of two experts: the per-row temporaries are a window's
    T, H, I, E = 256, 96, 32, 8
    args, inputs = lora_backward_call(T, H, I, E)
    _, hidden, _, _, offsets, params, _ = args
    peaks = {}
    for windowed in (False, True):
        largest = max(offsets[e + 2] - offsets[e] for e in range(0, E, 2))  # two experts' rows
        budget = int(largest) * H * 4 if windowed else 1 << 40
        with pytest.MonkeyPatch.context() as m:
            m.setattr(moe_module, "TWIN_WINDOW_BYTES", budget)
            assert len(moe_module._windows(offsets, params, hidden)) == (4 if windowed else 1)
            held = LiveBytes(inputs)
            with held:
                moe_module._twin_backward(*args)
        peaks[windowed] = held.peak
    rows = int(largest)
    design = 4 * (rows * I + rows * 2 * I + 2 * rows * H + 2 * T * H)  # a window's rows, dx's accumulator
    assert peaks[True] <= 1.1 * design < peaks[False], (peaks, design)


def test_the_declared_argument_names_are_the_op_schemas():
    # the fakes and the autograd formula read the ops' arguments by these names
    for op, names in ((torch.ops.accel_kernels.moe_experts, moe_module._FORWARD_ARGS),
                      (torch.ops.accel_kernels.moe_experts_backward, moe_module._BACKWARD_ARGS)):
        assert tuple(a.name for a in op.default._schema.arguments) == names, op


# --------------------------------------------------------------------------------------------
# The grouped_mm backward: the Triton forward with the backward's GEMMs through torch._grouped_mm
# --------------------------------------------------------------------------------------------


def run_counting_grouped_mm(monkeypatch, fn):
    """(fn()'s result, the names of the kernels launched, the number of torch._grouped_mm calls).
    A weight gradient's block of an expert without rows comes back as NaN (the CPU's grouped_mm
    zeroes it, another backend may not: the op must write its zeros itself), and so do a
    product's rows past the last group (no expert's: grouped_mm leaves them unwritten)."""
    real, grouped = torch._grouped_mm, []

    def counting(*args, **kwargs):
        grouped.append(1)
        out = real(*args, **kwargs)
        ends = kwargs["offs"]
        if args[0].dim() == 2 and args[1].dim() == 2:
            out[ends.diff(prepend=ends.new_zeros(1)) == 0] = float("nan")
        else:
            out[int(ends[-1]):] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    with launch.recording() as launched:
        result = fn()
    return result, list(launched), len(grouped)


def mixed_against_triton(monkeypatch, inputs, *, lora_leaves=None, lora=None, train=("hidden", "weights", "gate_up",
                         "down", "gub", "db"), **options):
    """The mixed path (Triton forward, grouped_mm backward) and the all-Triton one, each against
    float64 within the op tests' bound (with the all-Triton result as the low-precision stock).
    Products as narrow as a LoRA rank stay Triton launches on the mixed path: at these small
    shapes the threshold is 8 (rank 4 under it, every other dim over it), as 64 is at a model's.
    Returns (the mixed path's launches, its grouped_mm calls, the gradients of both paths)."""
    monkeypatch.setattr(moe_module, "GROUPED_MIN_WIDTH", 8)
    dtype = inputs[0].dtype
    dout = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3)).to(inputs[0].device, dtype)
    to64 = (lambda t: t.double() if t is not None else None)
    results = {}
    for backward in ("triton", "grouped_mm"):
        fn = lambda h, *a, **k: moe_experts(h, *a, backward=backward, **k)  # noqa: E731
        results[backward] = run_counting_grouped_mm(monkeypatch, lambda: run(
            fn, *inputs, dout=dout, lora_leaves=lora_leaves, lora=lora, train=train, **options))
    ref, ref_g = run(experts_eager, to64(inputs[0]), inputs[1], *map(to64, inputs[2:]), dout=dout.double(),
                     lora_leaves=[t.double() for t in lora_leaves] if lora_leaves else None, lora=lora,
                     train=train, **options)
    (tri, tri_g), tri_launched, tri_grouped = results["triton"]
    (got, got_g), got_launched, got_grouped = results["grouped_mm"]
    assert_close(got, ref, dtype, stock=tri, what="output")
    assert set(got_g) == set(ref_g) == set(tri_g)
    for name, g in got_g.items():
        assert g is not None and g.shape == ref_g[name].shape and g.dtype == tri_g[name].dtype, name
        assert_close(g, ref_g[name], dtype, stock=tri_g[name], what=f"grad of {name} (grouped_mm backward)")
        assert_close(tri_g[name], ref_g[name], dtype, stock=g, what=f"grad of {name} (Triton backward)")
    assert tri_grouped == 0, tri_grouped
    # the recompute with the GLU backward stays the fused kernel
    assert got_launched.count("_moe_gate_up_kernel") == 2, got_launched  # forward, and the recompute
    return got_launched, got_grouped, tri_g, got_g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quick_grouped_mm_backward_equals_the_triton_backward(device, monkeypatch, dtype):
    # an expert without tokens between others (its weight gradient zero), biases, off-block T
    inputs = make(T=11, H=32, I=16, E=4, K=2, routing="middle", bias=True, dtype=dtype, device=device)
    launched, grouped, _, _ = mixed_against_triton(monkeypatch, inputs)
    # dh, dx and both weight gradients are grouped_mm calls; the Triton launches are the forward's
    # two GEMMs, the recompute and the two combines
    assert grouped == 4 and "_moe_weight_grad_kernel" not in launched, (grouped, launched)
    assert launched.count("_moe_gemm_kernel") == 1 and launched.count("_moe_combine_kernel") == 2, launched


def test_quick_grouped_mm_backward_skips_no_expert_slots(device, monkeypatch):
    # the sorted rows past the last expert's ("no expert" ids: E and -1) are no group's
    hidden, index, weights, gate_up, down, _, _ = make(T=10, E=4, K=2, routing="middle", device=device)
    index = index.clone()
    index[0, 1] = 4
    index[3, 0] = -1
    index[5] = 4  # a token with no expert at all
    _, grouped, _, got_g = mixed_against_triton(monkeypatch, (hidden, index, weights, gate_up, down, None, None))
    assert grouped == 4 and (got_g["hidden"][5] == 0).all()
    assert got_g["weights"][0, 1] == 0 and got_g["weights"][3, 0] == 0 and (got_g["weights"][5] == 0).all()


def test_quick_grouped_mm_backward_with_split_lora_is_the_triton_backward(device, monkeypatch):
    # PEFT's LoRA (frozen base, adapters on both projections): every product of the backward
    # carries or is a low-rank term, all Triton launches, so the results are the Triton
    # backward's bit for bit (and its memory: nothing gathered outside the kernels); auto says so
    T, H, I, E = 12, 32, 16, 4
    inputs = make(T=T, H=H, I=I, E=E, routing="middle", device=device)
    leaves, lora = peft_lora(E, H, I, device=device)
    _, grouped, tri_g, got_g = mixed_against_triton(monkeypatch, inputs, lora_leaves=leaves, lora=lora,
                                                    train=("hidden", "weights"))
    assert grouped == 0
    assert all(torch.equal(got_g[name], tri_g[name]) for name in tri_g), tri_g.keys()


def test_quick_grouped_mm_backward_with_lora_on_down_and_gate_up_trained(device, monkeypatch):
    # dx carries no LoRA term and gate_up has a gradient: those two are grouped_mm calls, while dh
    # (LoRA on down) and the down factors' gradients stay Triton launches
    T, H, I, E = 12, 32, 16, 4
    inputs = make(T=T, H=H, I=I, E=E, routing="middle", device=device)
    leaves, lora = peft_lora(E, H, I, device=device, which=("down",))
    launched, grouped, _, _ = mixed_against_triton(monkeypatch, inputs, lora_leaves=leaves, lora=lora,
                                                   train=("hidden", "weights", "gate_up"))
    assert grouped == 2 and launched.count("_moe_weight_grad_kernel") == 2, (grouped, launched)


@pytest.mark.slow  # interpreted Triton: over 2 s
def test_grouped_mm_backward_on_gpt_oss_s_transposed_layout(device, monkeypatch):
    # transposed weights: the weight gradients taken the other way round, no transposed copy
    inputs = make(T=6, H=32, I=16, E=4, K=2, transposed=True, bias=True, device=device, scale=30.0)
    mixed_against_triton(monkeypatch, inputs, transposed=True, interleaved=True, activation="gpt_oss")


def test_the_backward_path_follows_the_choice_and_the_device(device, monkeypatch):
    hidden = torch.randn(4, 8, device=device)
    assert moe_module.backward_path(hidden, "grouped_mm") == "grouped_mm"  # forced on the Triton path
    assert moe_module.backward_path(hidden, "triton") == "triton"
    if hidden.device.type != "cuda":
        assert moe_module.backward_path(hidden, "auto") == "triton"
    assert moe_module.backward_path(hidden.double(), "grouped_mm") == "twin"
    # auto on a CUDA tensor (a stand-in here): grouped_mm where it takes the compute dtype (bf16:
    # the only dtype with torch's CUTLASS kernel) and the call has no LoRA, else triton
    on_cuda = lambda dtype: type("Stand", (), {"device": torch.device("cuda"), "dtype": dtype})()  # noqa: E731
    takes = {}
    monkeypatch.setattr(moe_module, "_grouped_mm_takes", lambda device, ct: takes.get(ct, True))
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: True)
    assert moe_module.backward_path(on_cuda(torch.bfloat16)) == "grouped_mm"
    assert moe_module.backward_path(on_cuda(torch.float32), autocast_dtype=torch.bfloat16) == "grouped_mm"
    assert moe_module.backward_path(on_cuda(torch.bfloat16), lora=True) == "triton"
    assert moe_module.backward_path(on_cuda(torch.float32)) == "triton"
    # the large tiles' Triton backward is the faster by the bytes model (docs/moe.md, "Tile sizes")
    large, small = moe_module.LARGE_TILES, moe_module.SMALL_TILES
    assert moe_module.backward_path(on_cuda(torch.bfloat16), tiles=large) == "triton"
    assert moe_module.backward_path(on_cuda(torch.bfloat16), tiles=large._replace(num_stages=3)) == "triton"
    assert moe_module.backward_path(on_cuda(torch.bfloat16), tiles=small) == "grouped_mm"
    assert moe_module.backward_path(on_cuda(torch.bfloat16), "grouped_mm", tiles=large) == "grouped_mm"
    # float16: a grouped_mm that takes it runs torch's per-group fallback loop (offsets copied to
    # the host): auto keeps Triton's; forcing it still works
    assert moe_module.backward_path(on_cuda(torch.float16)) == "triton"
    assert moe_module.backward_path(on_cuda(torch.float32), autocast_dtype=torch.float16) == "triton"
    assert moe_module.backward_path(on_cuda(torch.float16), "grouped_mm") == "grouped_mm"
    takes[torch.bfloat16] = False
    assert moe_module.backward_path(on_cuda(torch.bfloat16)) == "triton"
    monkeypatch.setattr(moe_module._dispatch, "use_triton", lambda t: False)
    assert moe_module.backward_path(hidden, "grouped_mm") == "twin"
    with pytest.raises(ValueError, match="backward must be one of auto, triton, grouped_mm, got 'cutlass'"):
        moe_experts(*make(device=device), backward="cutlass")


# --------------------------------------------------------------------------------------------
# auto's backward, timed on the device
# --------------------------------------------------------------------------------------------


@pytest.fixture
def timed_here(monkeypatch):
    """auto times its two backwards on this test's device too (the CPU runs both under the
    interpreter), from an empty table; products as narrow as these shapes' go to grouped_mm."""
    monkeypatch.setattr(moe_module, "TIMED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(moe_module, "_timed", {})
    monkeypatch.setattr(moe_module, "GROUPED_MIN_WIDTH", 8)


def slower(monkeypatch, slow: str, real: bool) -> list:
    """`_backward_seconds` with the `slow` backward a second slower (real: each run as well, else
    none runs); returns the backwards it was asked to time, in order."""
    asked, inner = [], moe_module._backward_seconds

    def seconds(path, *args, **kwargs):
        asked.append(path)
        return (inner(path, *args, **kwargs) if real else 1e-3) + (1.0 if path == slow else 0.0)

    monkeypatch.setattr(moe_module, "_backward_seconds", seconds)
    return asked


def trained(T, device):
    hidden, index, weights, gate_up, down, _, _ = make(T=T, H=16, I=8, dtype=torch.bfloat16, device=device)
    return hidden.requires_grad_(), index, weights.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_()


def test_quick_auto_times_both_backwards_once_per_call_shape_and_runs_the_faster(device, monkeypatch, timed_here):
    rounds = moe_module.TIMED_ROUNDS + 1  # one untimed run each (Triton's compile), then the rounds
    for slow, T in (("triton", 8), ("grouped_mm", 20)):  # 16 and 40 sorted rows: two call shapes
        asked = slower(monkeypatch, slow, real=False)
        fast = "grouped_mm" if slow == "triton" else "triton"
        with launch.recording() as launched:
            moe_experts(*trained(T, device)).float().sum().backward()
        assert asked == ["triton", "grouped_mm"] * rounds, asked
        timing = moe_module.timed_backwards()[max(moe_module.timed_backwards(), key=lambda k: k[2])]
        assert timing.path == fast and set(timing.ms) == {"triton", "grouped_mm"} and not timing.errors, timing
        assert timing.ms[slow] > timing.ms[fast] + 999, timing  # milliseconds, the best of the rounds
        assert ("_moe_weight_grad_kernel" in launched) == (fast == "triton"), launched
        # other values of the same call shape (10 and 34 sorted rows: the same power of two): the answer kept
        asked.clear()
        with launch.recording() as launched:
            moe_experts(*trained(T - 3, device)).float().sum().backward()
        assert asked == [] and ("_moe_weight_grad_kernel" in launched) == (fast == "triton"), (asked, launched)
    assert len(moe_module.timed_backwards()) == 2


def test_quick_a_backward_that_raises_while_timed_is_left_out_and_said(monkeypatch):
    runs = []

    def seconds(path, *args, **kwargs):
        runs.append(path)
        if path in failing and runs.count(path) > failing[path]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")
        return 1e-3 if path == "triton" else 1e-4

    monkeypatch.setattr(moe_module, "_backward_seconds", seconds)
    inputs = [torch.zeros(1)] * 7
    failing = {"grouped_mm": 2}  # the faster, until it raises in the last round: left out all the same
    timing = moe_module._time_backwards("grouped_mm", *inputs)
    assert timing.path == "triton" and set(timing.ms) == {"triton"}, timing
    assert timing.note(moe_module.TIMED_NOTE) == (
        "backward timed: triton 1 ms, grouped_mm raised OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "2.00 GiB"), timing.note(moe_module.TIMED_NOTE)
    runs.clear()
    failing = {"triton": 0, "grouped_mm": 0}  # both raise: the rule stands (and the call raises as it would have)
    assert moe_module._time_backwards("grouped_mm", *inputs) == ("grouped_mm", {}, {
        "triton": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "grouped_mm": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"})


def test_quick_auto_times_only_where_a_side_run_is_safe_and_invisible(monkeypatch, timed_here):
    """Where a call may not run the op's backwards on the side, auto's rule answers (Triton's on
    the CPU) and nothing is timed: no grad, nothing to differentiate, a backward running (a
    reentrant checkpoint's recompute), a TorchDispatchMode (a flop counter would count the side
    runs), saved-tensor hooks disabled, LoRA or a forced backward (one candidate), torch.compile
    or torch.jit tracing, the caller's may_time=False and a full table; a shape timed before keeps
    its answer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    timed = []
    monkeypatch.setattr(moe_module, "_time_backwards", lambda rule, *a, **k: timed.append(1) or moe_module.Timing(
        "grouped_mm", {"triton": 2.0, "grouped_mm": 1.0}, {}))
    hidden, index, weights, gate_up, down = trained(8, "cpu")

    def choose(x=hidden, **kwargs):
        return moe_module.choose_backward(x, index, weights, gate_up, down, **kwargs)[0]

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            with torch.enable_grad():  # as a reentrant checkpoint's recompute runs
                seen.append(choose())
            return g

    seen = []
    with torch.no_grad():
        assert choose() == "triton"
    assert choose(hidden.detach(), lora=True) == "triton"
    frozen = [t.detach() for t in (hidden, index, weights, gate_up, down)]
    assert moe_module.choose_backward(*frozen)[0] == "triton"  # nothing to differentiate
    InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == ["triton"]
    with Passing():
        assert choose() == "triton"
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        assert choose() == "triton"
    assert choose(backward="triton") == "triton" and choose(backward="grouped_mm") == "grouped_mm"
    assert choose(may_time=False) == "triton"
    with monkeypatch.context() as tracing:
        tracing.setattr(torch.compiler, "is_compiling", lambda: True)
        assert choose() == "triton"
    with monkeypatch.context() as tracing:
        tracing.setattr(torch.jit, "is_tracing", lambda: True)
        assert choose() == "triton"
    assert timed == []
    assert choose() == "grouped_mm" and timed == [1]  # timed: the faster
    assert choose(may_time=False) == "grouped_mm" and timed == [1]  # the shape's answer kept, not timed again
    monkeypatch.setattr(moe_module, "TIMED_SHAPES", 1)  # the table full: a new shape takes the rule
    assert choose(torch.randn(64, 32, requires_grad=True)) == "triton" and timed == [1]


@pytest.mark.slow  # interpreted Triton: the call and six side runs, 2-3 s
def test_auto_s_side_runs_leave_the_call_its_gradients_saves_and_random_state(device, monkeypatch, timed_here):
    """The timed call's output and gradients are the chosen backward's bit for bit (the side runs
    accumulate nothing), both backwards really ran on the side (Triton's weight-gradient kernel
    and grouped_mm calls), the caller's saved-tensor hooks see the call's saves and no side run's,
    and the global random state is as before."""
    asked = slower(monkeypatch, "triton", real=True)  # grouped_mm the faster
    inputs = make(T=16, H=32, I=16, E=4, K=2, dtype=torch.bfloat16, device=device)
    g = torch.Generator(device="cpu").manual_seed(3)  # one seeded stream: every device gets the same dout
    dout = torch.randn(inputs[0].shape, generator=g, device="cpu").to(device, torch.bfloat16)  # g's stream

    def hooked(backward):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
            fn = lambda h, *a, **k: moe_experts(h, *a, backward=backward, **k)  # noqa: E731
            result = run_counting_grouped_mm(monkeypatch, lambda: run(fn, *inputs, dout=dout))
        return result, packed

    state = torch.get_rng_state()
    ((got, got_g), launched, grouped), packed = hooked("auto")
    assert torch.equal(torch.get_rng_state(), state)
    assert asked == ["triton", "grouped_mm"] * (moe_module.TIMED_ROUNDS + 1)
    # the side's Triton backwards, two weight gradients (gate_up, down) each
    assert launched.count("_moe_weight_grad_kernel") == 2 * (moe_module.TIMED_ROUNDS + 1), launched
    ((want, want_g), _, want_grouped), want_packed = hooked("grouped_mm")
    assert grouped == want_grouped * (moe_module.TIMED_ROUNDS + 2)  # the side runs' and the call's own
    assert packed == want_packed
    assert torch.equal(got, want) and got_g.keys() == want_g.keys()
    assert all(torch.equal(got_g[k], want_g[k]) for k in want_g), [k for k in want_g if not torch.equal(got_g[k], want_g[k])]
