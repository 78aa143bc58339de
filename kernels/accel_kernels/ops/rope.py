"""Rotary position embedding, as transformers' `apply_rotary_pos_emb` and its interleaved kin.

    out[..., :r]  = x[..., :r] * cos + rotate_half(x[..., :r]) * sin,  rotate_half(v) = cat(-v2, v1)
    out[..., r:]  = x[..., r:]                                          (partial rotary: r < head_dim)

with r = cos.shape[-1] (form "half"). Two interleaved forms rotate the pairs (x[2i], x[2i+1]) by
the angle of cos[..., i], sin[..., i] (the first half of the table; the second half is not read):

- "interleave", DeepSeek V3's `apply_rotary_pos_emb_interleave`: the rotated evens come out first,
  then the rotated odds, `cat(x0 * c - x1 * s, x1 * c + x0 * s)` with x0 = x[..., 0:r:2],
  x1 = x[..., 1:r:2] (the rotate-half layout the rest of the MLA attention expects);
- "pairs", GPT-J style (ERNIE 4.5's `apply_rotary_pos_emb`): each pair stays where it was,
  out[2i] = x0 * c - x1 * s, out[2i + 1] = x1 * c + x0 * s.

"interleave_table" is "interleave" on the whole table (the first half rotates into the first
half of the output, the second half into the second), what DeepSeek V3's interleave function was
before transformers 5 (a view/transpose of q and k, then rotate-half): equal to "interleave"
on tables that are `cat(freqs, freqs)`, different on any other.

Two more pair forms differ from "pairs" only in where they read:

- "pairs_last", DeepSeek V4's one-tensor `apply_rotary_pos_emb`: GPT-J pairs on the LAST r dims
  of each head (V4 lays a head out as [nope | rope]); the first D - r dims pass through;
- "complex", Llama 4's and DeepSeek V2's `apply_rotary_emb` (q and k viewed as complex numbers
  times `freqs_cis`): a complex product is a rotation of the pair (real, imaginary), so this is
  GPT-J pairs whose angle i has cos = cos[..., 2i] and sin = sin[..., 2i + 1]: the layout of
  `view_as_real(freqs_cis).flatten(-2)`, which the caller passes as both cos and sin (a view of
  the complex table, no copy); r = the table's width, as in every form.

A program takes a block of (batch, position) tokens and applies each
token's cos/sin row to all its query and key heads, so cos/sin are read once per token. The
outputs are new tensors: q and k are never written. The backward applies the transposed rotation
to the output gradients; the kernel gives cos and sin no gradient (they are position tables, built
without grad); cos/sin that require grad are sent to the plain-torch twin.

The twin is transformers' formula (`_reference`); its backward is written out: the transposed
rotation of the output gradients for q and k, and for cos and sin (when they require grad) sums
over heads of dout * x and dout * rotate_half(x); q and k are kept for it only when cos or sin
want a gradient, since the rotation is linear in q and k. float64 inputs skip the op and run the
formula itself, so that second derivatives through them are exact.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

_DTYPES = _dispatch.KERNEL_DTYPES
_TILE = 4096
#: The layouts the kernel rotates (the FORM constexpr is the index).
FORMS = ("half", "interleave", "pairs", "interleave_table", "pairs_last", "complex")


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _rotate_heads(
    X, O, x_tok, o_tok, x_stride_h, o_stride_h, n_heads, tok_ok, c1, c2, s1, s2, half, n_pass,
    BACKWARD: tl.constexpr, FORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """Rotate every head of a block of tokens. Tiles are (token, head, dim); x_tok/o_tok are the
    (token, 1, 1) offsets of head 0, c1/c2/s1/s2 the (token, 1, dim) cos/sin halves (FORMs 0, 3) or
    c1 = c2, s1 = s2 the pair angles (the others). FORMs 1 and 3 read pairs and write halves
    (their backward reads halves and writes pairs); FORMs 2, 4, 5 keep pairs both ways; FORM 4
    rotates the last 2 * half dims, the first n_pass passing through."""
    # int64: h * stride_h overflows int32 past 2**31 elements (a (B, H, S, D) layout with 32 heads
    # of 128 reaches it at about 541k tokens a sequence)
    h = tl.arange(0, BLOCK_H).to(tl.int64)[None, :, None]
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    x = X + x_tok + h * x_stride_h
    o = O + o_tok + h * o_stride_h
    mask = tok_ok & (h < n_heads) & (d < half)
    if FORM == 4:  # the rotary dims are the last ones: the pass-through ones come first
        x_rot = x + n_pass
        o_rot = o + n_pass
        first_pass = 0
    else:
        x_rot = x
        o_rot = o
        first_pass = 2 * half
    # where the two elements rotated together sit: halves (d, half + d) or pairs (2d, 2d + 1)
    if FORM == 2 or FORM >= 4 or ((FORM == 1 or FORM == 3) and not BACKWARD):
        x1 = tl.load(x_rot + 2 * d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rot + 2 * d + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(x_rot + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_rot + half + d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # transpose of [[c1, -s1], [s2, c2]]
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    if FORM == 2 or FORM >= 4 or ((FORM == 1 or FORM == 3) and BACKWARD):
        tl.store(o_rot + 2 * d, cast_rounded(o1, O.dtype.element_ty), mask=mask)
        tl.store(o_rot + 2 * d + 1, cast_rounded(o2, O.dtype.element_ty), mask=mask)
    else:
        tl.store(o_rot + d, cast_rounded(o1, O.dtype.element_ty), mask=mask)
        tl.store(o_rot + half + d, cast_rounded(o2, O.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        # partial rotary: the dims past the rotary ones (before them, FORM 4) pass through, their
        # gradient too
        p = first_pass + tl.arange(0, BLOCK_PASS)[None, None, :]
        pass_mask = tok_ok & (h < n_heads) & (p < first_pass + n_pass)
        xp = tl.load(x + p, mask=pass_mask, other=0.0).to(tl.float32)
        tl.store(o + p, cast_rounded(xp, O.dtype.element_ty), mask=pass_mask)


@jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN, n_tokens, seq_len,
    q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, qo_sb, qo_ss, qo_sh, ko_sb, ko_ss, ko_sh,
    cos_sb, cos_ss, sin_sb, sin_ss,
    n_q_heads, n_k_heads, half, n_pass,
    BACKWARD: tl.constexpr, FORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # a block of BLOCK_S (batch, position) tokens; each token's cos/sin row is read once for all heads
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    tok_ok = (tokens < n_tokens)[:, None, None]
    b = (tokens // seq_len)[:, None, None]
    s = (tokens % seq_len)[:, None, None]
    d = tl.arange(0, BLOCK_HALF)[None, None, :]
    cs_mask = tok_ok & (d < half)
    # cos/sin batch stride is 0 when they are shared by the whole batch
    cos = COS + b * cos_sb + s * cos_ss
    sin = SIN + b * sin_sb + s * sin_ss
    if FORM == 5:  # a complex table's real view: (cos, sin) of angle i at columns 2i, 2i + 1
        c1 = tl.load(cos + 2 * d, mask=cs_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin + 2 * d + 1, mask=cs_mask, other=0.0).to(tl.float32)
    else:
        c1 = tl.load(cos + d, mask=cs_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin + d, mask=cs_mask, other=0.0).to(tl.float32)
    if FORM == 0 or FORM == 3:  # the whole table: each half of the output has its own angles
        c2 = tl.load(cos + half + d, mask=cs_mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin + half + d, mask=cs_mask, other=0.0).to(tl.float32)
    else:  # interleaved forms: one angle per pair, the table's first half
        c2 = c1
        s2 = s1
    _rotate_heads(Q, QO, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, q_sh, qo_sh, n_q_heads, tok_ok,
                  c1, c2, s1, s2, half, n_pass, BACKWARD, FORM, BLOCK_QH, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K, KO, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, k_sh, ko_sh, n_k_heads, tok_ok,
                  c1, c2, s1, s2, half, n_pass, BACKWARD, FORM, BLOCK_KH, BLOCK_HALF, BLOCK_PASS)


# --------------------------------------------------------------------------------------------
# Host launch
# --------------------------------------------------------------------------------------------


def _bsh_strides(t: torch.Tensor, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, H, S, D) tensor (unsqueeze_dim=1) or (B, S, H, D) one (2)."""
    b, s1, s2, _ = t.stride()
    return (b, s2, s1) if unsqueeze_dim == 1 else (b, s1, s2)


def _rope_launch(q, k, q_out, k_out, cos, sin, unsqueeze_dim, backward, form=0):
    """Rotate q, k into q_out, k_out (backward=True: apply the transposed rotation, for gradients);
    form: an index into FORMS."""
    # strides of the other dims are passed to the kernel; only the head dim must be dense
    q, k, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, cos, sin))
    n_q_heads, n_k_heads = q.shape[unsqueeze_dim], k.shape[unsqueeze_dim]
    grid, n_tokens, seq_len, sizes, meta = _launch_config(q.shape[0], cos.shape[1], q.shape[-1], cos.shape[-1],
                                                          n_q_heads, n_k_heads, _TILE)
    # cos/sin of batch 1 serve every batch element: batch stride 0
    cos_sb, cos_ss, _ = cos.stride()
    sin_sb, sin_ss, _ = sin.stride()
    if cos.shape[0] == 1:
        cos_sb = sin_sb = 0
    _launch.launch(
        _rope_kernel, grid,
        q, k, q_out, k_out, cos, sin, n_tokens, seq_len,
        *_bsh_strides(q, unsqueeze_dim), *_bsh_strides(k, unsqueeze_dim),
        *_bsh_strides(q_out, unsqueeze_dim), *_bsh_strides(k_out, unsqueeze_dim),
        cos_sb, cos_ss, sin_sb, sin_ss, *sizes,
        BACKWARD=backward, FORM=form, **meta,
    )


@functools.lru_cache(maxsize=256)
def _launch_config(batch, seq_len, head_dim, rot_dim, n_q_heads, n_k_heads, tile):
    """(grid, tokens, seq_len, (q heads, k heads, half, pass-through dims), block constexprs and
    num_warps) of the kernel for these sizes and a program tile of about `tile` elements
    (`_TILE`, in the key so that a changed value is seen), computed once per shape."""
    n_pass = head_dim - rot_dim
    block_qh, block_kh = _launch.next_power_of_2(n_q_heads), _launch.next_power_of_2(n_k_heads)
    block_half = _launch.next_power_of_2(rot_dim // 2)
    block_pass = _launch.next_power_of_2(n_pass) if n_pass else 0
    # tokens per program: a tile of about `tile` elements (one token when its heads fill that)
    per_token = (block_qh + block_kh) * (2 * block_half + block_pass)
    n_tokens = batch * seq_len
    block_s = 1
    while 2 * block_s * per_token <= tile and block_s < n_tokens:
        block_s *= 2
    elements = block_s * per_token
    num_warps = 4 if elements <= 4096 else 8 if elements <= 16384 else 16
    meta = dict(BLOCK_S=block_s, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half,
                BLOCK_PASS=block_pass, num_warps=num_warps)
    return ((_launch.cdiv(n_tokens, block_s),), n_tokens, seq_len, (n_q_heads, n_k_heads, rot_dim // 2, n_pass),
            meta)


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    # x * cos + rotate_half(x) * sin promotes like torch does
    if x.dtype == cos.dtype == sin.dtype:
        return x.dtype
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _new(t: torch.Tensor, dtype: torch.dtype, swapped: bool, fake: bool = False) -> torch.Tensor:
    """An output of t's shape: contiguous, or (swapped) laid out with dims 1 and 2 swapped in
    memory, a transposed view of a contiguous tensor (`rope`'s `swapped`). fake: for the fake
    implementations (not the allocator the tests replace)."""
    like = t.transpose(1, 2) if swapped else t
    out = like.new_empty(like.shape, dtype=dtype) if fake else _dispatch.empty_like(like, dtype=dtype)
    return out.transpose(1, 2) if swapped else out


def _laid_out(r: torch.Tensor, swapped: bool) -> torch.Tensor:
    """The twin's result `r` in `_new`'s layout (the op's strides are its fake's): itself where it
    has it, else a copy."""
    if (r.transpose(1, 2) if swapped else r).is_contiguous():
        return r
    return _new(r, r.dtype, swapped).copy_(r)


def _forward_triton(q, k, cos, sin, unsqueeze_dim, form=0, swapped=False):
    """(q_out, k_out), new tensors in the dtypes torch promotion gives, laid out as `_new` says."""
    q_out = _new(q, _out_dtype(q, cos, sin), swapped)
    k_out = _new(k, _out_dtype(k, cos, sin), swapped)
    _rope_launch(q, k, q_out, k_out, cos, sin, unsqueeze_dim, backward=False, form=form)
    return q_out, k_out


def _backward_triton(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, needs,
                     forward_autocast, form=0, swapped=False):
    """(dq, dk, None, None): the transposed rotation of the output gradients. Only taken when cos
    and sin want no gradient; q and k (None here) do not enter the gradients of q and k.
    (forward_autocast is for the twin, which recomputes the forward; the kernel does not.)"""
    dq = _new(dq_out, q_dtype, swapped)
    dk = _new(dk_out, k_dtype, swapped)
    _rope_launch(dq_out, dk_out, dq, dk, cos, sin, unsqueeze_dim, backward=True, form=form)
    return dq, dk, None, None


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


@_library.custom_op("rope")
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
             triton_path: bool, form: int = 0, swapped: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out), contiguous or (swapped) laid out with dims 1 and 2 swapped in memory."""
    if triton_path:
        return _forward_triton(q, k, cos, sin, unsqueeze_dim, form, swapped)
    q_out, k_out = _forward_torch(q, k, cos, sin, unsqueeze_dim, form)
    return _laid_out(q_out, swapped), _laid_out(k_out, swapped)


@_rope_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim, triton_path, form=0, swapped=False):
    return _new(q, _out_dtype(q, cos, sin), swapped, True), _new(k, _out_dtype(k, cos, sin), swapped, True)


@_library.custom_op("rope_backward")
def _rope_backward_op(dq_out: torch.Tensor, dk_out: torch.Tensor, q: Optional[torch.Tensor],
                      k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int,
                      q_dtype: torch.dtype, k_dtype: torch.dtype, need_cos: bool, need_sin: bool,
                      triton_path: bool, form: int = 0, swapped: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dcos, dsin); dcos, dsin are (0,) unless asked for (then q and k are given); dq and
    dk laid out as the forward's outputs (`swapped`)."""
    needs = (True, True, need_cos, need_sin)
    if triton_path:
        dq, dk, dcos, dsin = _backward_triton(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype,
                                              needs, None, form, swapped)
    else:
        dq, dk, dcos, dsin = _backward_torch(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype,
                                             needs, None, form)
        dq, dk = _laid_out(dq, swapped), _laid_out(dk, swapped)
    return (dq, dk,
            dcos.contiguous() if need_cos else _library.nothing(cos),
            dsin.contiguous() if need_sin else _library.nothing(sin))


@_rope_backward_op.register_fake
def _(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, need_cos, need_sin, triton_path, form=0,
      swapped=False):
    return (_new(dq_out, q_dtype, swapped, True), _new(dk_out, k_dtype, swapped, True),
            cos.new_empty(cos.shape) if need_cos else _library.nothing(cos),
            sin.new_empty(sin.shape) if need_sin else _library.nothing(sin))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim, triton_path, form, swapped = inputs
    # the rotation is linear in q and k: they are needed only for the gradients of cos and sin
    keep_qk = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    ctx.save_for_backward(cos, sin, *((q, k) if keep_qk else (None, None)))
    ctx.options = (unsqueeze_dim, triton_path, q.dtype, k.dtype, form, swapped)


def _backward(ctx, dq_out, dk_out):
    _dispatch.check_first_order("rope")  # the op's backward is opaque to autograd
    cos, sin, q, k = ctx.saved_tensors
    unsqueeze_dim, triton_path, q_dtype, k_dtype, form, swapped = ctx.options
    needs = ctx.needs_input_grad[:4]
    if triton_path and _library.direct(ctx):
        # the kernel straight from the formula: what the backward op's implementation does on its
        # Triton path (cos and sin take no gradient there), less its schema's (0,) stand-ins for them
        # (no dispatch guard: a backward runs with grad mode off, so nothing here is recorded)
        grads = _backward_triton(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, needs, None,
                                 form, swapped)
        return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None)
    grads = _rope_backward_op.backward_call(ctx, dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype,
                                                  k_dtype, needs[2], needs[3], triton_path, form, swapped)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None)


_rope_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin
# --------------------------------------------------------------------------------------------


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotated(x, cos, sin, form):
    """One tensor's rotation in `FORMS[form]` (cos, sin unsqueezed to x), the dims past cos's width
    passing through."""
    r = cos.shape[-1]
    if form == 4:  # DeepSeek V4's: the last r dims rotate, in pairs
        x_pass, x_rot = x[..., : x.shape[-1] - r], x[..., x.shape[-1] - r:]
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
        return torch.cat([x_pass, out], dim=-1)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if form == 0:
        out = x_rot * cos + _rotate_half(x_rot) * sin
    elif form == 3:  # DeepSeek's function before transformers 5: de-interleave, then rotate-half
        x_h = torch.cat([x_rot[..., 0::2], x_rot[..., 1::2]], dim=-1)
        out = x_h * cos + _rotate_half(x_h) * sin
    else:  # DeepSeek's interleave function, term for term; "pairs" puts each pair back in place
        # ("complex": the angles' cos and sin at the even and odd columns of the complex table's view)
        c, s = (cos[..., 0::2], sin[..., 1::2]) if form == 5 else (cos[..., : r // 2], sin[..., : r // 2])
        x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
        a, b = x0 * c - x1 * s, x1 * c + x0 * s
        out = torch.cat([a, b], dim=-1) if form == 1 else torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat([out, x_pass], dim=-1)


def _reference(q, k, cos, sin, unsqueeze_dim, form=0):
    """transformers' apply_rotary_pos_emb (form 0; its interleaved kin: see FORMS), with the dims
    past cos's width passing through."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotated(q, cos, sin, form), _rotated(k, cos, sin, form)


def _forward_torch(q, k, cos, sin, unsqueeze_dim, form=0):
    """`_forward_triton` in plain torch: transformers' formula."""
    return _reference(q, k, cos, sin, unsqueeze_dim, form)


def _backward_torch(dq_out, dk_out, q, k, cos, sin, unsqueeze_dim, q_dtype, k_dtype, needs,
                    forward_autocast, form=0):
    """(dq, dk, dcos, dsin), each None unless needed: the gradients of the formula, written out
    (the transposed rotation for q and k; for cos and sin, sums over heads, and over the batch
    where one table served it). Computed in the promoted dtype, rounded once to the input's.
    (forward_autocast is unused: nothing is recomputed.)"""
    cos_u, sin_u = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]

    def through(g, dtype):
        if form == 4:  # the last r dims rotated, in pairs; the first ones passed through
            c, s, lead = cos_u[..., : r // 2], sin_u[..., : r // 2], g.shape[-1] - r
            g0, g1 = g[..., lead::2], g[..., lead + 1::2]
            d_rot = torch.stack((g0 * c + g1 * s, g1 * c - g0 * s), dim=-1).flatten(-2)
            return torch.cat((g[..., :lead].to(dtype), d_rot.to(dtype)), dim=-1)
        g_rot = g[..., :r]
        if form in (0, 3):
            gs = g_rot * sin_u
            d_rot = g_rot * cos_u + torch.cat((gs[..., r // 2:], -gs[..., : r // 2]), dim=-1)
            if form == 3:  # back to pairs
                d_rot = torch.stack((d_rot[..., : r // 2], d_rot[..., r // 2:]), dim=-1).flatten(-2)
        else:  # the pair rotation transposed, the gradient put back in pairs
            c, s = (cos_u[..., 0::2], sin_u[..., 1::2]) if form == 5 else (cos_u[..., : r // 2], sin_u[..., : r // 2])
            g0, g1 = (g_rot[..., : r // 2], g_rot[..., r // 2:]) if form == 1 else (g_rot[..., 0::2], g_rot[..., 1::2])
            d_rot = torch.stack((g0 * c + g1 * s, g1 * c - g0 * s), dim=-1).flatten(-2)
        return torch.cat((d_rot.to(dtype), g[..., r:].to(dtype)), dim=-1)

    dq = through(dq_out, q_dtype) if needs[0] else None
    dk = through(dk_out, k_dtype) if needs[1] else None
    dcos = dsin = None
    if needs[2] or needs[3]:
        # rope() sends interleaved forms with tables that want a gradient to the formula itself
        assert form == 0, "table gradients are written out for the rotate-half form only"
        head_dim = 1 if unsqueeze_dim == 1 else 2

        def table_grad(factor, dtype):  # sum over heads (and batch, for a shared table) of dout * factor(x)
            total = sum((g[..., :r] * factor(x[..., :r])).sum(head_dim) for g, x in ((dq_out, q), (dk_out, k)))
            if cos.shape[0] == 1 and total.shape[0] != 1:
                total = total.sum(0, keepdim=True)
            return total.to(dtype)

        dcos = table_grad(lambda x: x, cos.dtype) if needs[2] else None
        dsin = table_grad(_rotate_half, sin.dtype) if needs[3] else None
    return dq, dk, dcos, dsin


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(q, k, cos, sin, unsqueeze_dim):
    for name, t, shape in (("q", q, "(B, H, S, D) or (B, S, H, D)"), ("k", k, "(B, H, S, D) or (B, S, H, D)"),
                           ("cos", cos, "(B or 1, S, rotary_dim)"), ("sin", sin, "(B or 1, S, rotary_dim)")):
        _dispatch.check_tensor(name, t, f"of shape {shape}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _dispatch.check_floating(name, t)
    if unsqueeze_dim not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim must be 1 (q, k of shape (B, H, S, D)) or 2 ((B, S, H, D)), got {unsqueeze_dim!r}"
        )
    layout = "(B, H, S, D)" if unsqueeze_dim == 1 else "(B, S, H, D)"
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D {layout} for unsqueeze_dim={unsqueeze_dim}, got shape {tuple(t.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[seq_dim] != q.shape[seq_dim] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"k must have q's batch, sequence length and head dim {layout}: q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    batch, seq_len, head_dim = q.shape[0], q.shape[seq_dim], q.shape[-1]
    if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
        raise ValueError(
            f"cos must have shape ({batch} or 1, {seq_len}, rotary_dim) (batch, seq, rotary dim), got {tuple(cos.shape)}"
        )
    if sin.shape != cos.shape:
        raise ValueError(f"sin must have cos's shape {tuple(cos.shape)}, got {tuple(sin.shape)}")
    rot_dim = cos.shape[-1]
    if rot_dim % 2 or rot_dim == 0 or rot_dim > head_dim:
        raise ValueError(
            f"cos/sin rotary dim (last dim) must be even, positive and at most the head dim {head_dim}, got {rot_dim}"
        )
    _dispatch.check_same_device(q=q, k=k, cos=cos, sin=sin)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# (shapes, dtypes, unsqueeze_dim) that passed _check_inputs: the checks depend on nothing else but
# the devices, which are compared on every call
_CHECKED: set = set()


def _checked(q, k, cos, sin, unsqueeze_dim) -> None:
    """_check_inputs, decided once per shape (its dozens of steps cost more host time than the
    launch); ValueError naming a bad argument as _check_inputs gives it."""
    if torch.compiler.is_compiling():  # traced once a compile, free in the graph: no set to keep
        return _check_inputs(q, k, cos, sin, unsqueeze_dim)
    if type(q) in _PLAIN and type(k) in _PLAIN and type(cos) in _PLAIN and type(sin) in _PLAIN:
        key = (q.shape, k.shape, cos.shape, sin.shape, q.dtype, k.dtype, cos.dtype, sin.dtype, unsqueeze_dim)
        if key in _CHECKED and q.device == k.device == cos.device == sin.device:
            return
        _check_inputs(q, k, cos, sin, unsqueeze_dim)
        if len(_CHECKED) > 4096:  # shapes of many sequence lengths: keep the set bounded
            _CHECKED.clear()
        _CHECKED.add(key)
        return
    _check_inputs(q, k, cos, sin, unsqueeze_dim)


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def rope(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1,
         form: str = "half"):
    """Rotary embedding of q and k, equal to transformers' apply_rotary_pos_emb (form "half") or
    to its interleaved kin (form "interleave": DeepSeek V3's `apply_rotary_pos_emb_interleave`;
    "pairs": GPT-J style, ERNIE 4.5's; "interleave_table": DeepSeek's before transformers 5;
    "pairs_last": GPT-J pairs on the last R dims, DeepSeek V4's; "complex": GPT-J pairs times a
    complex table, Llama 4's, with cos = sin = `view_as_real(freqs_cis).flatten(-2)`; see the
    module docstring); returns (q_out, k_out).

    unsqueeze_dim=1: q (B, Hq, S, D), k (B, Hk, S, D); unsqueeze_dim=2: q (B, S, Hq, D),
    k (B, S, Hk, D). Hq and Hk may differ (GQA). k may be None (one tensor rotated: k_out is
    None). cos, sin: (B or 1, S, R) with R even, R <= D: the first R dims of each head rotate, the
    last D - R pass through (partial rotary; "pairs_last": the last R rotate, the first D - R pass
    through); "interleave", "pairs" and "pairs_last" read the first R/2 columns (one angle per
    pair), "complex" cos's even columns and sin's odd ones. Any strides. Outputs are new tensors of q's/k's shape in the dtype torch
    promotion gives q (k) with cos and sin; where q and k are views with dims 1 and 2 swapped in
    memory (attention's transposed projections), in that memory order, as transformers' formula
    gives them, else contiguous. Differentiable in q and k. The kernel gives cos and
    sin no gradient: when either requires grad, the plain-torch twin runs instead so that they get
    one. Raises ValueError naming a bad argument. float32/bfloat16/float16 run the Triton kernel
    (on GPU, or on CPU when the kernels run under Triton's interpreter); float64 and everything
    else run the plain-torch twin.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    alone = k is None
    if alone:  # no key heads: the kernel's key loop is masked off entirely
        k = q.narrow(unsqueeze_dim if unsqueeze_dim in (1, 2) else 1, 0, 0) if isinstance(q, torch.Tensor) else q
    _checked(q, k, cos, sin, unsqueeze_dim)
    index = FORMS.index(form)
    # float64 (and empty) inputs take the twin: the kernel computes in float32; so do cos/sin that
    # require grad (transformers builds them under no_grad), which the kernel would not give one
    grad_tables = torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad)
    if torch.float64 in (q.dtype, k.dtype, cos.dtype, sin.dtype) or (index and grad_tables):
        # the formula in differentiable torch, outside the op: second derivatives stay exact (and
        # the interleaved forms' table gradients come from autograd)
        q_out, k_out = _reference(q, k, cos, sin, unsqueeze_dim, index)
    else:
        triton_path = (_dispatch.use_triton(q) and q.numel() > 0
                       and all(t.dtype in _DTYPES for t in (q, k, cos, sin)) and not grad_tables)
        # q, k as attention builds them, (B, H, S, D) views of (B, S, H, D) projections: the outputs
        # keep the projections' memory order, as transformers' formula does (an attention whose
        # output follows q's layout then needs no copy before o_proj), and so do the gradients
        # (they reach the projections' view backward contiguous: no copy there)
        swapped = _heads_transposed(q) and (alone or _heads_transposed(k))
        q_out, k_out = _rope_op(q, k, cos, sin, unsqueeze_dim, triton_path, index, swapped)
    return (q_out, None) if alone else (q_out, k_out)


def _heads_transposed(t: torch.Tensor) -> bool:
    """Whether t is a transposed view of a dims-1-and-2-swapped tensor (a (B, H, S, D) view of a
    (B, S, H, D) projection, or a slice of a fused one): its strides decrease with dims 1 and 2
    swapped, and not as they are."""
    b, s1, s2, d = t.stride()
    return b >= s2 > s1 >= d
