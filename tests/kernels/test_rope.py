import pytest
import torch

import accel_kernels._dispatch as dispatch
import accel_kernels.ops.rope as rope_module
from _checks import assert_close, rel_err
from _quick import matrix
from accel_kernels import rope

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def eager(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb; with cos narrower than the head, Phi3's partial-rotary form."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    q_embed = torch.cat([q[..., :r] * cos + rotate_half(q[..., :r]) * sin, q[..., r:]], dim=-1)
    k_embed = torch.cat([k[..., :r] * cos + rotate_half(k[..., :r]) * sin, k[..., r:]], dim=-1)
    return q_embed, k_embed


def make_inputs(device, dtype, batch=2, seq=5, n_q=4, n_k=2, head_dim=24, rot_dim=None,
                unsqueeze_dim=1, cos_batch=1, cos_dtype=None):
    rot_dim = head_dim if rot_dim is None else rot_dim
    shape = (lambda h: (batch, h, seq, head_dim)) if unsqueeze_dim == 1 else (lambda h: (batch, seq, h, head_dim))
    q = torch.randn(shape(n_q), device=device).to(dtype)
    k = torch.randn(shape(n_k), device=device).to(dtype)
    # independent angles per dim: the kernel must not assume cos = cat(c, c) as rotary tables have
    theta = torch.rand(cos_batch, seq, rot_dim, device=device) * 6.3
    cos_dtype = dtype if cos_dtype is None else cos_dtype
    return q, k, theta.cos().to(cos_dtype), theta.sin().to(cos_dtype)


def forward_backward(fn, q, k, cos, sin, dq_out, dk_out, unsqueeze_dim=1):
    """fn(q, k, cos, sin) and the grads of sum(q_out * dq_out + k_out * dk_out) wrt q and k."""
    q = q.detach().requires_grad_(True)
    k = k.detach().requires_grad_(True)
    q_out, k_out = fn(q, k, cos, sin, unsqueeze_dim)
    torch.autograd.backward([q_out, k_out], [dq_out, dk_out])
    return q_out.detach(), k_out.detach(), q.grad, k.grad


def check_against_float64(q, k, cos, sin, unsqueeze_dim=1, dq_out=None, dk_out=None):
    """Both outputs and both grads against float64; dtypes and shapes as transformers gives them."""
    stock_q, stock_k = eager(q, k, cos, sin, unsqueeze_dim)
    dq_out = torch.randn(q.shape, device=q.device).to(stock_q.dtype) if dq_out is None else dq_out
    dk_out = torch.randn(k.shape, device=k.device).to(stock_k.dtype) if dk_out is None else dk_out
    args = (dq_out, dk_out, unsqueeze_dim)
    got = forward_backward(rope, q, k, cos, sin, *args)
    ref = forward_backward(eager, q.double(), k.double(), cos.double(), sin.double(),
                           *(a.double() for a in args[:2]), unsqueeze_dim)
    stock = forward_backward(eager, q, k, cos, sin, *args)
    for what, g, r, s in zip(("q_out", "k_out", "grad of q", "grad of k"), got, ref, stock):
        assert g.dtype == s.dtype and g.shape == s.shape, f"{what}: {g.dtype} {tuple(g.shape)}"
        assert_close(g, r, g.dtype, stock=s, what=what)
    return got


@pytest.fixture
def triton_only(monkeypatch):
    """Fail if the call falls back to the plain-torch path: these tests are about the kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("rope took the plain-torch path")

    monkeypatch.setattr(rope_module, "_forward_torch", refuse)
    monkeypatch.setattr(rope_module, "_backward_torch", refuse)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype, unsqueeze_dim, heads", matrix(DTYPES, [1, 2], [
    (4, 4, 64, 64),  # multi-head, full rotary
    (6, 3, 48, 48),  # GQA, head counts not powers of two
    (3, 1, 40, 16),  # GQA (one KV head) and partial rotary: 24 dims pass through
], quick=lambda dtype, unsqueeze_dim, heads: dtype == torch.float32 or heads == (3, 1, 40, 16)))
def test_matches_float64(device, dtype, unsqueeze_dim, heads):
    n_q, n_k, head_dim, rot_dim = heads
    inputs = make_inputs(device, dtype, n_q=n_q, n_k=n_k, head_dim=head_dim, rot_dim=rot_dim,
                         unsqueeze_dim=unsqueeze_dim)
    check_against_float64(*inputs, unsqueeze_dim=unsqueeze_dim)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_outputs_are_rounded_once(device, dtype):
    # computed in fp32 and rounded once (transformers rounds each product): equal to the fp32 math
    # rounded, but for rare 1-ulp flips from fused multiply-adds
    q, k, cos, sin = make_inputs(device, dtype, n_q=4, n_k=2, head_dim=32, rot_dim=24, unsqueeze_dim=2)
    got = rope(q, k, cos, sin, 2)
    expected = eager(q.float(), k.float(), cos.float(), sin.float(), 2)
    for g, e in zip(got, expected):
        assert (g != e.to(dtype)).float().mean().item() <= 0.01


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_cos_per_batch_or_broadcast(device, dtype, cos_batch):
    # batch 1: one table for all sequences; batch 3: per-sequence positions (e.g. packed or left-padded)
    q, k, cos, sin = make_inputs(device, dtype, batch=3, seq=4, n_q=2, n_k=2, head_dim=10, cos_batch=cos_batch)
    check_against_float64(q, k, cos, sin)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_single_token_and_smallest_head(device, unsqueeze_dim):
    inputs = make_inputs(device, torch.float32, batch=1, seq=1, n_q=1, n_k=1, head_dim=2, unsqueeze_dim=unsqueeze_dim)
    check_against_float64(*inputs, unsqueeze_dim=unsqueeze_dim)
    inputs = make_inputs(device, torch.bfloat16, batch=1, seq=1, n_q=5, n_k=1, head_dim=6, rot_dim=2,
                         unsqueeze_dim=unsqueeze_dim)
    check_against_float64(*inputs, unsqueeze_dim=unsqueeze_dim)


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("q_dtype,cos_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_mixed_dtypes_promote_like_transformers(device, q_dtype, cos_dtype):
    q, k, cos, sin = make_inputs(device, q_dtype, cos_dtype=cos_dtype, rot_dim=16)
    q_out, k_out, dq, dk = check_against_float64(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.promote_types(q_dtype, cos_dtype)
    assert dq.dtype == dk.dtype == q_dtype


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(device, dtype):
    batch, seq, n_q, n_k, head_dim = 2, 3, 4, 2, 16
    # q/k as attention builds them: views of one fused projection, transposed to (B, H, S, D)
    qkv = torch.randn(batch, seq, n_q + 2 * n_k, head_dim, device=device).to(dtype)
    q = qkv[:, :, :n_q].transpose(1, 2)
    k = qkv[:, :, n_q:n_q + n_k].transpose(1, 2)
    theta = torch.rand(1, head_dim, seq, device=device) * 6.3
    cos, sin = theta.cos().to(dtype).transpose(1, 2), theta.sin().to(dtype).transpose(1, 2)  # last dim strided
    dq_out = torch.randn(batch, n_q, head_dim, seq, device=device).to(dtype).transpose(2, 3)
    dk_out = torch.ones((), device=device, dtype=dtype).expand(batch, n_k, seq, head_dim)  # stride 0
    assert not any(t.is_contiguous() for t in (q, k, cos, dq_out, dk_out))
    check_against_float64(q, k, cos, sin, 1, dq_out, dk_out)
    # the same projection in the (B, S, H, D) layout
    check_against_float64(qkv[:, :, :n_q], qkv[:, :, n_q:n_q + n_k], cos, sin, 2)


@pytest.mark.parametrize("path", ["triton", "twin"])
def test_outputs_keep_the_projections_layout_and_gradients_transpose_back_to_it(device, monkeypatch, path):
    """q, k as attention builds them, (B, H, S, D) views of (B, S, H, D) projections: the outputs
    keep that memory order as transformers' formula does (an attention whose output follows q's
    layout then needs no copy before o_proj), and the gradients, from an upstream in either layout,
    transpose back to contiguous (B, S, H, D) ones (no copy in the projections' view backward,
    where stock's formula gives a contiguous (B, H, S, D) gradient and its view backward copies
    it). The same for a fused projection's slices; a contiguous (B, H, S, D) q keeps its layout."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    monkeypatch.setattr(dispatch, "use_triton", lambda t: path == "triton")
    batch, seq, n_q, n_k, head_dim = 2, 3, 4, 2, 16
    theta = torch.rand(1, seq, head_dim, device=device) * 6.3
    cos, sin = theta.cos(), theta.sin()
    qkv = torch.randn(batch, seq, n_q + 2 * n_k, head_dim, device=device)
    projected = (torch.randn(batch, seq, n_q, head_dim, device=device).transpose(1, 2),
                 torch.randn(batch, seq, n_k, head_dim, device=device).transpose(1, 2))
    fused = (qkv[:, :, :n_q].transpose(1, 2), qkv[:, :, n_q:n_q + n_k].transpose(1, 2))
    for q, k in (projected, fused):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        q_out, k_out = rope(q, k, cos, sin)
        stock_q, stock_k = apply_rotary_pos_emb(q, k, cos, sin)
        assert (q_out.stride(), k_out.stride()) == (stock_q.stride(), stock_k.stride())
        assert q_out.transpose(1, 2).is_contiguous() and k_out.transpose(1, 2).is_contiguous()
        for dq_out, dk_out in ((torch.randn_like(q_out), torch.randn_like(k_out)),  # the outputs' layout
                               (torch.randn(q.shape, device=device), torch.randn(k.shape, device=device))):
            dq, dk = torch.autograd.grad([q_out, k_out], [q, k], [dq_out, dk_out], retain_graph=True)
            assert dq.transpose(1, 2).is_contiguous() and dk.transpose(1, 2).is_contiguous()
            want = torch.autograd.grad([stock_q, stock_k], [q, k], [dq_out, dk_out], retain_graph=True)
            assert all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip((dq, dk), want))
    q, k, cos, sin = make_inputs(device, torch.float32)
    assert rope(q, k, cos, sin)[0].is_contiguous()


@pytest.mark.usefixtures("triton_only")
def test_inputs_are_not_written_and_only_cos_sin_are_saved(device):
    q, k, cos, sin = make_inputs(device, torch.bfloat16, n_q=4, n_k=2, head_dim=32, rot_dim=16)
    before = [t.clone() for t in (q, k, cos, sin)]
    q, k = q.requires_grad_(True), k.requires_grad_(True)
    saved = {}

    def pack(t):
        saved[t.data_ptr()] = t.nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        q_out, k_out = rope(q, k, cos, sin)
    torch.autograd.backward([q_out, k_out], [torch.randn_like(q_out), torch.randn_like(k_out)])
    assert all(torch.equal(a.detach(), b) for a, b in zip((q, k, cos, sin), before))
    # the rotation is linear in q and k: backward needs only the tables
    assert sum(saved.values()) == cos.nbytes + sin.nbytes


def test_plain_path_matches_triton_path(device, monkeypatch):
    for dtype, unsqueeze_dim in [(torch.float32, 1), (torch.bfloat16, 2), (torch.float16, 1)]:
        q, k, cos, sin = make_inputs(device, dtype, n_q=3, n_k=1, head_dim=20, rot_dim=12, unsqueeze_dim=unsqueeze_dim)
        dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: True)
        triton_result = forward_backward(rope, q, k, cos, sin, dq_out, dk_out, unsqueeze_dim)
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        plain_result = forward_backward(rope, q, k, cos, sin, dq_out, dk_out, unsqueeze_dim)
        ref = forward_backward(eager, q.double(), k.double(), cos.double(), sin.double(),
                               dq_out.double(), dk_out.double(), unsqueeze_dim)
        for what, t, p, r in zip(("q_out", "k_out", "grad of q", "grad of k"), triton_result, plain_result, ref):
            assert t.dtype == p.dtype, what
            # the plain path is the stock computation in that dtype: it sets the bound
            assert_close(t, r, dtype, stock=p, what=f"{dtype} {what}")
            assert rel_err(t, p) <= (1e-6 if dtype == torch.float32 else 1e-2), what


@pytest.mark.parametrize("path", ["triton", "twin"])
def test_only_q_or_only_k_requires_grad(device, monkeypatch, path):
    # a frozen k (or q): only the wanted gradient, and none for the other
    if path == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    q, k, cos, sin = make_inputs(device, torch.float32, rot_dim=8)
    for q_grad in (True, False):
        ql, kl = q.detach().requires_grad_(q_grad), k.detach().requires_grad_(not q_grad)
        out = rope(ql, kl, cos, sin)[0 if q_grad else 1]
        upstream = torch.randn_like(out)
        out.backward(upstream)
        ref_q, ref_k = q.double().requires_grad_(), k.double().requires_grad_()
        ref = eager(ref_q, ref_k, cos.double(), sin.double())[0 if q_grad else 1]
        ref.backward(upstream.double())
        got, expected = (ql.grad, ref_q.grad) if q_grad else (kl.grad, ref_k.grad)
        assert (kl.grad if q_grad else ql.grad) is None
        assert_close(got, expected, torch.float32, what=f"{path}: grad of {'q' if q_grad else 'k'} alone")


def test_cos_sin_requiring_grad_get_their_gradient(device):
    # the kernel gives the tables none; such calls take the plain path rather than drop it silently
    q, k, cos, sin = make_inputs(device, torch.float32, rot_dim=8)
    cos, sin = cos.requires_grad_(True), sin.requires_grad_(True)
    q_out, k_out = rope(q, k, cos, sin)
    (q_out.sum() + k_out.sum()).backward()
    cos64, sin64 = cos.detach().double().requires_grad_(True), sin.detach().double().requires_grad_(True)
    q_ref, k_ref = eager(q.double(), k.double(), cos64, sin64)
    (q_ref.sum() + k_ref.sum()).backward()
    assert_close(cos.grad, cos64.grad, torch.float32, what="grad of cos")
    assert_close(sin.grad, sin64.grad, torch.float32, what="grad of sin")


def test_float64_and_empty_inputs_take_the_plain_path(device):
    q, k, cos, sin = make_inputs(device, torch.float64, rot_dim=8)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    got = forward_backward(rope, q, k, cos, sin, dq_out, dk_out)
    for g, e in zip(got, forward_backward(eager, q, k, cos, sin, dq_out, dk_out)):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    q, k, cos, sin = make_inputs(device, torch.float32, seq=0)
    q_out, k_out = rope(q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers(device, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    x = torch.randn(2, 6, 128, device=device).to(dtype)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]], device=device)
    cos, sin = LlamaRotaryEmbedding(config).to(device)(x, position_ids)
    q = torch.randn(2, 4, 6, 32, device=device).to(dtype)
    k = torch.randn(2, 2, 6, 32, device=device).to(dtype)
    dq_out, dk_out = torch.randn_like(q), torch.randn_like(k)
    cases = [(apply_rotary_pos_emb, cos, sin), (phi3_apply_rotary_pos_emb, cos[..., :16], sin[..., :16])]
    for stock_fn, c, s in cases:
        got = forward_backward(rope, q, k, c, s, dq_out, dk_out)
        expected = forward_backward(stock_fn, q, k, c, s, dq_out, dk_out)
        for what, g, e in zip(("q_out", "k_out", "grad of q", "grad of k"), got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape, what
            if dtype == torch.float32:
                torch.testing.assert_close(g, e, msg=f"{stock_fn.__module__} {what}")
            else:  # transformers rounds each product to bf16; we round once
                assert rel_err(g, e) <= 1e-2, f"{stock_fn.__module__} {what}"


def test_bad_inputs_name_the_argument(device):
    q, k, cos, sin = make_inputs(device, torch.float32, batch=2, seq=5, n_q=4, n_k=2, head_dim=8)
    # first a good call: the checks are decided once per shape, and what can differ between calls
    # of one shape (the devices below) must still be named
    rope(q, k, cos, sin)
    with pytest.raises(ValueError, match=r"sin must have cos's shape \(1, 5, 8\), got \(1, 5, 6\)"):
        rope(q, k, cos, sin[..., :6])
    with pytest.raises(ValueError, match=r"cos must have shape \(2 or 1, 5, rotary_dim\).*got \(1, 4, 8\)"):
        rope(q, k, cos[:, :4], sin[:, :4])
    with pytest.raises(ValueError, match=r"cos must have shape \(2 or 1, 5, rotary_dim\).*got \(3, 5, 8\)"):
        rope(q, k, cos.expand(3, 5, 8), sin.expand(3, 5, 8))
    with pytest.raises(ValueError, match=r"cos must have shape .*got \(5, 8\)"):
        rope(q, k, cos[0], sin[0])
    with pytest.raises(ValueError, match="rotary dim .* must be even.*got 5"):
        rope(q, k, cos[..., :5], sin[..., :5])
    with pytest.raises(ValueError, match="rotary dim .* at most the head dim 8, got 10"):
        rope(q, k, torch.ones(1, 5, 10, device=device), torch.ones(1, 5, 10, device=device))
    with pytest.raises(ValueError, match=r"k must have q's batch.*k \(1, 2, 5, 8\)"):
        rope(q, k[:1], cos, sin)
    with pytest.raises(ValueError, match=r"k must have q's batch, sequence length.*k \(2, 2, 4, 8\)"):
        rope(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match=r"k must have q's .*head dim.*k \(2, 2, 5, 6\)"):
        rope(q, k[..., :6], cos[..., :6], sin[..., :6])
    with pytest.raises(ValueError, match=r"q must be 4-D \(B, H, S, D\) for unsqueeze_dim=1, got shape \(4, 5, 8\)"):
        rope(q[0], k, cos, sin)
    with pytest.raises(ValueError, match=r"k must be 4-D \(B, S, H, D\) for unsqueeze_dim=2"):
        rope(q.transpose(1, 2), k[0], cos, sin, unsqueeze_dim=2)
    with pytest.raises(ValueError, match="unsqueeze_dim must be 1 .* or 2 .*got 3"):
        rope(q, k, cos, sin, unsqueeze_dim=3)
    with pytest.raises(ValueError, match="q must be a floating-point tensor, got torch.int64"):
        rope(q.long(), k, cos, sin)
    with pytest.raises(ValueError, match="sin must be a floating-point tensor, got torch.int32"):
        rope(q, k, cos, sin.int())
    with pytest.raises(ValueError, match="cos is on meta but q is on"):
        rope(q, k, cos.to("meta"), sin)
    with pytest.raises(ValueError, match="k is on meta but q is on"):
        rope(q, k.to("meta"), cos, sin)


HEAD_OFFSETS_PAST_INT32 = r'''
import torch, accel_kernels
# a contiguous (B, H, S, D) q at 32 heads x 128 and 600k positions: head h starts h * 76.8M
# elements in, past 2**31 from head 28 on. Only position 0 is viewed (and touched): the
# allocation's other pages are never committed.
S, H, D = 600_000, 32, 128
q = torch.empty(H * S * D, dtype=torch.bfloat16).as_strided((1, H, 1, D), (H * S * D, S * D, D, 1))
q.copy_(torch.randn(1, H, 1, D).to(torch.bfloat16))
k = torch.randn(1, 8, 1, D).to(torch.bfloat16)
theta = torch.rand(1, 1, D) * 6.3
cos, sin = theta.cos().to(torch.bfloat16), theta.sin().to(torch.bfloat16)
with accel_kernels._launch.recording() as launched:
    q_out, _ = accel_kernels.rope(q, k, cos, sin)
assert launched == ["_rope_kernel"], launched
qf = q.float()
rotated = torch.cat((-qf[..., D // 2:], qf[..., :D // 2]), -1)
expected = (qf * cos.float().unsqueeze(1) + rotated * sin.float().unsqueeze(1)).to(torch.bfloat16)
print((q_out.float() - expected.float()).abs().max().item())
'''


@pytest.mark.slow
def test_head_offsets_past_int32(tmp_path):
    # int32 h * stride_h wrapped past 2**31 elements (about 541k tokens a sequence at 32 heads x
    # 128): wild addresses. The interpreter computes offsets in the kernel's int types too, so it
    # shows the bug (a segfault: hence a process of its own)
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", HEAD_OFFSETS_PAST_INT32], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    # computed in fp32, rounded once: at most an ulp of bf16 from the rounded fp32 formula
    assert float(proc.stdout.split()[-1]) <= 0.0625


# --- interleaved forms -------------------------------------------------------------------------


def deepseek_interleave(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek V3's apply_rotary_pos_emb_interleave (transformers 5.24), as written there."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def gptj_pairs(q, k, cos, sin, unsqueeze_dim=1):
    """ERNIE 4.5's apply_rotary_pos_emb without its float32 round trip: pairs rotated in place."""
    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin


def deepseek_interleave_before_v5(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek V3's apply_rotary_pos_emb_interleave before transformers 5: de-interleave, rotate-half."""
    def deinterleave(x):
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    return eager(deinterleave(q), deinterleave(k), cos, sin, unsqueeze_dim)


def deepseek_v4_last_dims(q, k, cos, sin, unsqueeze_dim=1):
    """DeepSeek V4's one-tensor apply_rotary_pos_emb (transformers 5.25) on each of q and k, without its
    float32 round trip: GPT-J pairs on the last dims, one angle per pair (the table's first half)."""
    def one(x, c, s):
        def rotate_pairs(v):
            return torch.stack((-v[..., 1::2], v[..., 0::2]), dim=-1).flatten(-2)

        c = c.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
        s = s.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
        r = c.shape[-1]
        nope, rot = x[..., :-r], x[..., -r:]
        return torch.cat([nope, rot * c + rotate_pairs(rot) * s], dim=-1)

    half = cos.shape[-1] // 2
    return one(q, cos[..., :half], sin[..., :half]), one(k, cos[..., :half], sin[..., :half])


def llama4_complex(q, k, cos, sin, unsqueeze_dim=1):
    """Llama 4's apply_rotary_emb (q and k as complex numbers times freqs_cis), with freqs_cis the complex
    table whose real view is cos (real parts, even columns) and sin (imaginary parts, odd columns), in
    float32 (complex float64 for the float64 reference), rounded once to the promoted dtype."""
    real = torch.float64 if cos.dtype == torch.float64 else torch.float32  # no complex bfloat16
    freqs = torch.complex(cos[..., 0::2].to(real), sin[..., 1::2].to(real)).unsqueeze(unsqueeze_dim)

    def one(x):
        xc = torch.view_as_complex(x.to(freqs.real.dtype).reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * freqs).flatten(-2).to(torch.promote_types(x.dtype, cos.dtype))

    return one(q), one(k)


FORM_REFERENCES = {"interleave": deepseek_interleave, "pairs": gptj_pairs,
                   "interleave_table": deepseek_interleave_before_v5, "pairs_last": deepseek_v4_last_dims,
                   "complex": llama4_complex}


@pytest.mark.usefixtures("triton_only")
@pytest.mark.parametrize("form, dtypes, unsqueeze_dim", matrix(
    ["interleave", "pairs", "interleave_table", "pairs_last", "complex"],
    [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)], [1, 2],
    quick=lambda form, dtypes, unsqueeze_dim: unsqueeze_dim == 2 or dtypes == (torch.bfloat16, torch.float32)))
def test_interleaved_forms_match_float64(device, form, dtypes, unsqueeze_dim):
    dtype, cos_dtype = dtypes
    reference = FORM_REFERENCES[form]
    # DeepSeek V4 rotates 64 of 512 dims per head: "pairs_last" probed with a head wider than its table
    q, k, cos, sin = make_inputs(device, dtype, n_q=3, n_k=1, head_dim=12, unsqueeze_dim=unsqueeze_dim,
                                 cos_dtype=cos_dtype, rot_dim=8 if form == "pairs_last" else None)
    stock_q, stock_k = reference(q, k, cos, sin, unsqueeze_dim)
    dq_out = torch.randn(q.shape, device=device).to(stock_q.dtype)
    dk_out = torch.randn(k.shape, device=device).to(stock_k.dtype)
    got = forward_backward(lambda *a: rope(*a, form=form), q, k, cos, sin, dq_out, dk_out, unsqueeze_dim)
    ref = forward_backward(reference, q.double(), k.double(), cos.double(), sin.double(), dq_out.double(),
                           dk_out.double(), unsqueeze_dim)
    stock = forward_backward(reference, q, k, cos, sin, dq_out, dk_out, unsqueeze_dim)
    for what, g, r, s in zip(("q_out", "k_out", "grad of q", "grad of k"), got, ref, stock):
        assert g.dtype == s.dtype and g.shape == s.shape, f"{what}: {g.dtype} {tuple(g.shape)}"
        assert_close(g, r, g.dtype, stock=s, what=what)


@pytest.mark.parametrize("form", ["half", "interleave", "pairs", "interleave_table", "pairs_last", "complex"])
def test_interleaved_forms_twin_and_partial_rotary(device, monkeypatch, form):
    # the plain-torch twin (no Triton) equals the kernel; dims past the table's width pass through
    q, k, cos, sin = make_inputs(device, torch.float32, n_q=2, n_k=2, head_dim=10, rot_dim=6)
    dq_out, dk_out = torch.randn(q.shape, device=device), torch.randn(k.shape, device=device)
    fn = lambda *a: rope(*a, form=form)  # noqa: E731
    kernel = forward_backward(fn, q, k, cos, sin, dq_out, dk_out)
    monkeypatch.setattr(dispatch, "use_triton", lambda *a: False)
    twin = forward_backward(fn, q, k, cos, sin, dq_out, dk_out)
    for g, t in zip(kernel, twin):
        assert_close(g, t, torch.float32, what=form)
    kept = slice(0, 4) if form == "pairs_last" else slice(6, None)  # "pairs_last" rotates the last dims
    for out, x in zip(kernel[:2], (q, k)):
        assert torch.equal(out[..., kept], x[..., kept])
        assert not torch.equal(out, x)


@pytest.mark.usefixtures("triton_only")
def test_one_tensor_is_rotated_alone(device):
    # k=None: q rotated as with a k beside it (Mistral Large 4 calls the interleave function so)
    q, k, cos, sin = make_inputs(device, torch.bfloat16, n_q=3, n_k=1, head_dim=8, unsqueeze_dim=2)
    q_alone, none = rope(q, None, cos, sin, 2, form="interleave")
    assert none is None
    assert torch.equal(q_alone, rope(q, k, cos, sin, 2, form="interleave")[0])
    q = q.detach().requires_grad_(True)
    rope(q, None, cos, sin, 2, form="interleave")[0].float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_interleaved_forms_give_tables_their_gradient_and_refuse_unknown_forms(device):
    q, k, cos, sin = make_inputs(device, torch.float32, n_q=2, n_k=1, head_dim=8)
    cos, sin = cos.requires_grad_(True), sin.requires_grad_(True)
    sum(o.sum() for o in rope(q, k, cos, sin, form="interleave")).backward()
    c, s = cos.detach().requires_grad_(True), sin.detach().requires_grad_(True)
    sum(o.sum() for o in deepseek_interleave(q, k, c, s)).backward()
    assert torch.allclose(cos.grad, c.grad) and torch.allclose(sin.grad, s.grad)
    with pytest.raises(ValueError, match="form must be one of"):
        rope(q, k, cos, sin, form="complex128")
