"""Fused linear + cross-entropy: the loss of hidden @ weight.T (+ bias) without the (N, V) logits.

Tokens are processed in chunks. For each chunk: logits = h_chunk @ W.T (+ b) into one reused
chunk buffer (torch matmul), the cross-entropy rows of cross_entropy.py (Triton kernel, or its
plain-torch twin off-GPU) turn that buffer in place into the gradient of the loss w.r.t. those
logits, and the chunk's share of the gradients follows at once: grad_h_chunk = g @ W, and (below
the fp32 budget, see next) grad_W += g.T @ h_chunk, grad_b += g.sum(0). Neither the full logits
nor their gradient ever exist; the per-chunk temporary is one chunk of logits (CHUNK_BYTES).

The weight's gradient, by what it holds. Summed over token chunks it needs an fp32 (V, H) buffer:
in bf16 the sum of chunk contributions measurably loses to eager torch's single matmul (relative
error 4.9e-3 vs 2.0e-3 with 16 chunks, 256 tokens, CPU; Liger's bf16 sum over 32 chunks of 256
tokens at vocabulary 128256 would round 32 times). At 8192 tokens x 4096 hidden x 128256 vocab
in bf16 that buffer is 2004 MiB, and the backward, scaling it by grad_output into a new tensor,
held 2004 + 2004 + 1002 + 2 x 64 (grad_h and its copy) = 5138 MiB, the H200's measured peak.
So when the fp32 (V, H) sum would exceed WEIGHT_FP32_BYTES (256 MiB; TORCH_WEIGHT_FP32_BYTES,
1 GiB, on the plain-torch path, whose CPU time rule was measured with the sum), the forward
computes only loss, lse and grad_h, and the backward computes the weight's (and bias's)
gradient in a pass of its own, one block of vocabulary rows at a time over all tokens: the
block's logits recomputed into one (N, block) tile of TILE_BYTES (32 MiB: 2048 rows at 8192
tokens in bf16), turned into their gradient by the backward rows from the saved lse, and
grad_W[block] = g.T @ h written in the weight's dtype, summed in the matmul's fp32 accumulator
over all tokens and rounded once, as eager does. The forward's grad_h is scaled by grad_output
in place and handed over. At the shape above that holds grad_W 1002 + grad_h 64 + tile 32 =
1098 MiB at the peak (Liger: 1002 + 64 + a 62.6 MiB chunk = 1129), and between forward and
backward only grad_h and lse (Liger: grad_W and grad_h, 1066 MiB). The price is one more logits
matmul: 4 x 2NHV = 34.4 TFLOP against 3 (+10.9 ms at 790 TFLOP/s), less the fp32 sum's traffic
(up to 31.5 GB, 7.4 ms at 4249 GB/s) and the backward's scaling (7.3 GB, 1.7 ms) it replaces.
docs/fused-loss.md has the model.

For "mean" and "sum" below the budget the gradients are computed during the forward (when some
input requires grad) and only scaled by grad_output in the backward, as Liger does: that saves
recomputing the logits matmul. For "none" each token's loss has its own grad_output, unknown
during the forward, so the forward keeps only the per-token log-sum-exp and the backward
recomputes each chunk's logits (one extra matmul; above the budget, one more for the weight's
pass). Below the budget the backward returns the scaled gradients as new tensors rather than
scaling the saved ones in place: in place, AccumulateGrad could adopt a saved tensor as .grad and
a second backward through a retained graph would see it modified. Above it, grad_h is scaled in
place through `.data` (so no version bump reaches the saved tensor), and a second backward
through a retained graph recomputes grad_h rather than read it.

This op has no kernels of its own: its host function `_chunked_pass` runs torch matmuls and
cross_entropy.py's row functions on each chunk, the Triton launches or their plain-torch twins as
`triton_path` says, so its plain-torch twin is the same pass over the twin rows.

Memory and time against eager F.cross_entropy(hidden @ weight.T, labels):
`python -m accel_kernels.bench --ops fused_linear_cross_entropy`.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import _dispatch, _library
from .cross_entropy import (_check_label_range_by_lse, _check_labels, _check_options, _flat_labels, _row_functions,
                            _torch_capped)

# Budget for one chunk of logits. The Triton path holds one chunk in the logits dtype (at vocab
# 128256 in bf16: 1024 tokens, matmuls of M=1024 are already efficient on an H100/H200). The
# plain-torch path also makes fp32 temporaries of bounded size (cross_entropy.TORCH_ROWS_ELEMENTS)
# and CPU matmuls want larger chunks.
CHUNK_BYTES = 256 << 20
TORCH_CHUNK_BYTES = 64 << 20
# The weight's gradient is summed over the token chunks in one fp32 (V, H) buffer only while that
# buffer fits this budget; above it, it is computed one block of vocabulary rows at a time over
# all tokens (the block's logits recomputed from the saved lse: one more logits matmul), straight
# into the weight's dtype, through one (N, block) tile of TILE_BYTES (see the module docstring).
# The plain-torch path (CPU) keeps the fp32 sum up to 1 GiB: its time rule was measured that way.
WEIGHT_FP32_BYTES = 256 << 20
TORCH_WEIGHT_FP32_BYTES = 1 << 30
TILE_BYTES = 32 << 20
# Above the fp32 budget, a third way to the weight's gradient: summed over the forward's token
# chunks in the weight's own dtype (bf16/fp16), where there are at most this many chunks. Three
# logits-sized matmuls, as the fp32 sum, instead of the vocabulary pass's four; each chunk's
# product is rounded into the sum once (cuBLAS accumulates it in fp32), so 8 chunks round 8 times
# (benchmarks/flce_rounding.py: 3.70e-3 relative error against 2.03e-3 for one rounding, within the
# kernel tests' 1.5x eager's + 1e-3), and the forward holds its chunk of logits beside the (V, H)
# gradient (at 8192 tokens x 128256 in bf16: a 250 MiB chunk, 218 MiB more at the peak than the
# vocabulary pass with its 32 MiB tile). 0, the default: never. `benchmarks/flce_weight.py` times it against the vocabulary
# pass and Liger's on a GPU; that measurement decides the default (docs/fused-loss.md).
WEIGHT_DTYPE_SUM_CHUNKS = 0


# --------------------------------------------------------------------------------------------
# Triton kernels: none of its own (the chunks go through cross_entropy's row kernels)
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Host launch: the chunked pass (launches only through cross_entropy's row functions)
# --------------------------------------------------------------------------------------------


def chunk_rows(n_rows: int, vocab: int, itemsize: int, budget: int) -> int:
    """Tokens per chunk so a chunk of logits fits `budget` bytes: a multiple of 64 when that fits."""
    rows = max(1, budget // max(1, vocab * itemsize))
    if rows >= 64:
        rows -= rows % 64  # whole tiles for the matmuls
    return max(1, min(rows, n_rows))


def fp32_gradient_matmuls(h: torch.Tensor) -> bool:
    """Whether the gradient matmuls take the chunk's rounded gradient (and the weight) in fp32.

    On CPU a bf16/fp16 matmul runs far slower than an fp32 one (measured at 320 tokens, vocab
    32000, hidden 256, one thread: g @ W 28 s in bf16, 0.14 s in fp32 with the casts; g.T @ h
    1.8 s vs 0.14 s), so there they do (as TRL's chunked head does off CUDA); a GPU keeps the
    inputs' dtype. The logits matmul keeps the inputs' dtype everywhere."""
    return h.device.type == "cpu" and h.dtype != torch.float32


def weight_grad_by_blocks(vocab: int, hidden: int, triton_path: bool) -> bool:
    """Whether the weight's gradient does not fit an fp32 (V, H) sum over token chunks
    (WEIGHT_FP32_BYTES, TORCH_WEIGHT_FP32_BYTES): then it is summed in the weight's dtype in the
    forward (`weight_sum_in_dtype`) or computed per vocabulary block in a pass of its own."""
    return vocab * hidden * 4 > (WEIGHT_FP32_BYTES if triton_path else TORCH_WEIGHT_FP32_BYTES)


def weight_sum_in_dtype(n_rows: int, rows: int, vocab: int, hidden: int, dtype: torch.dtype,
                        triton_path: bool) -> bool:
    """Whether the weight's gradient is summed over the token chunks in its own dtype during the
    forward (WEIGHT_DTYPE_SUM_CHUNKS): on the Triton path, for a bf16/fp16 weight whose fp32 sum
    does not fit, over at most WEIGHT_DTYPE_SUM_CHUNKS chunks of `rows` tokens."""
    return (WEIGHT_DTYPE_SUM_CHUNKS > 0 and triton_path and dtype in (torch.bfloat16, torch.float16)
            and weight_grad_by_blocks(vocab, hidden, triton_path) and n_rows <= WEIGHT_DTYPE_SUM_CHUNKS * rows)


def _weight_grad_in_forward(n_rows: int, rows: int, weight: torch.Tensor, hidden: int, reduction: str,
                            need_w: bool, triton_path: bool) -> tuple[bool, bool]:
    """(in_dtype, in_pass) of one call, as the forward op, its fake and the autograd formula all
    need them: whether the forward sums the weight's gradient in the weight's dtype
    (`weight_sum_in_dtype`), and whether it computes the weight's and bias's gradients at all
    ("mean" and "sum" below the fp32 budget, or in_dtype; else the backward's pass does)."""
    now = reduction != "none"
    vocab = weight.shape[0]
    in_dtype = now and need_w and weight_sum_in_dtype(n_rows, rows, vocab, hidden, weight.dtype, triton_path)
    return in_dtype, now and (in_dtype or not weight_grad_by_blocks(vocab, hidden, triton_path))


# Whether torch.addmm(..., out_dtype=torch.float32) works on a device type (cuBLAS, torch >= 2.8):
# it accumulates a bf16 product straight into an fp32 buffer without a (V, H) temporary.
_ADDMM_OUT_FP32: dict[str, bool] = {}


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when first: acc's contents, even NaN, are ignored), acc fp32 and
    a, b maybe of a lower precision (then rounded to fp32 once per call, never to a's dtype); or
    acc in a's dtype (the sum in the weight's dtype): a @ b + acc accumulated in fp32 and rounded
    into acc once per call, as cuBLAS's addmm does (a, b in fp32 on CPU: `_chunked_pass`'s wide
    gradient)."""
    beta = 0.0 if first else 1.0
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
        return
    if acc.dtype != torch.float32:  # the half-precision sum from fp32 operands: one rounding a call
        acc.copy_(torch.addmm(acc.float(), a, b, beta=beta))
        return
    kind = acc.device.type
    if _ADDMM_OUT_FP32.get(kind, kind == "cuda"):
        try:
            torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
            _ADDMM_OUT_FP32[kind] = True
            return
        except (RuntimeError, NotImplementedError, TypeError):
            _ADDMM_OUT_FP32[kind] = False
    if first:
        acc.copy_(torch.mm(a, b))
    else:
        acc.add_(torch.mm(a, b))


def _chunked_pass(h, w, b, y, ignore_index, softcap, triton_path, rows, *, scale, need_h, need_w, need_b,
                  loss=None, lse=None, saved_lse=None, w_sum_dtype=torch.float32):
    """One walk over the token chunks, with cross_entropy's Triton rows or (triton_path False)
    their plain-torch twins.

    Forward mode (saved_lse is None): writes per-token loss and lse; if any gradient is needed,
    also the gradients scaled per token by `scale`. Backward mode: recomputes each chunk's logits
    and writes the gradients from `saved_lse`. Returns (grad_h, grad_w in w_sum_dtype (fp32, or the
    weight's dtype: `weight_sum_in_dtype`), grad_b fp32), None for those not needed.
    """
    forward_rows, backward_rows = _row_functions(triton_path)
    n, hidden = h.shape
    vocab = w.shape[0]
    want_grad = need_h or need_w or need_b
    grad_h = _dispatch.empty((n, hidden), dtype=h.dtype, device=h.device) if need_h else None
    grad_w = _dispatch.empty((vocab, hidden), dtype=w_sum_dtype, device=h.device) if need_w else None
    grad_b = torch.zeros((vocab,), dtype=torch.float32, device=h.device) if need_b else None
    if n == 0:
        return grad_h, grad_w.zero_() if need_w else None, grad_b
    buf = _dispatch.empty((min(rows, n), vocab), dtype=h.dtype, device=h.device)
    wide = want_grad and fp32_gradient_matmuls(h)
    w_mm = w.float() if wide and need_h else w
    w_t = w.t()

    def part(t):  # a chunk's rows; one chunk (a small batch) takes the tensors whole: no views
        return t if whole or t is None else t[s:e]

    whole = n <= rows
    for s in range(0, n, rows):
        e = min(n, s + rows)
        h_c, logits = part(h), buf if whole else buf[: e - s]
        if b is None:
            torch.matmul(h_c, w_t, out=logits)
        else:
            torch.addmm(b, h_c, w_t, out=logits)
        sc = scale if scale is None or scale.numel() == 1 else part(scale)
        if saved_lse is None:
            forward_rows(logits, part(y), ignore_index, softcap, part(loss), part(lse),
                         grad=logits if want_grad else None, scale=sc)
        else:
            backward_rows(logits, part(y), ignore_index, softcap, part(saved_lse), sc, logits)
        if not want_grad:
            continue
        g = logits.float() if wide else logits  # now d loss / d logits of this chunk, scaled
        if need_h:
            if wide:
                grad_h[s:e] = g @ w_mm
            else:
                torch.matmul(g, w, out=part(grad_h))
        if need_w:
            _add_matmul_(grad_w, g.t(), h_c.float() if wide else h_c, first=s == 0)
        if need_b:
            grad_b += g.sum(0, dtype=torch.float32)
    return grad_h, grad_w, grad_b


def _block_grad_torch(logits, y_block, lse, scale, softcap):
    """scale * d loss / d logits (fp32) of a (rows, block) tile of logits from the full-vocabulary
    lse (each row's max and log of its sum, cross_entropy's rows): y_block is the label's column in the block, -1 for an ignored row, the block's width for
    a label outside it. NaN lse (an out-of-range label) gives a NaN row, as the rows do."""
    z, t = _torch_capped(logits, softcap)
    valid = y_block >= 0
    shift = torch.where(valid, lse[:, 0], float("inf"))  # ignored rows: 0
    g = z.sub_(shift.unsqueeze(1)).sub_(lse[:, 1].unsqueeze(1)).exp_()
    g.mul_(scale.unsqueeze(1))
    hit = torch.nonzero(valid & (y_block < logits.shape[1])).squeeze(1)
    g[hit, y_block[hit].long()] -= scale[hit]
    if t is not None:
        g.mul_(t.square_().neg_().add_(1.0))  # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
    return g


def _weight_pass(h, w, b, y, ignore_index, softcap, triton_path, lse, scale, need_w, need_b):
    """The weight's (and bias's) gradient from the saved lse, one block of vocabulary rows at a
    time: the block's logits over the tokens are recomputed into one tile (TILE_BYTES, in fp32 on
    the plain-torch path), turned into their gradient, and grad_w[block] = g.T @ h is written in
    the weight's dtype: summed in the matmul's fp32 accumulator over all tokens and rounded once,
    as eager torch does. Only when 64 vocabulary rows of every token's logits exceed the tile are
    token chunks summed per block in an fp32 (block, H) buffer. scale: fp32, one element or one
    per token. Returns (grad_w, grad_b) in the weight's and bias's dtypes, None for those not needed."""
    n, hidden = h.shape
    vocab = w.shape[0]
    grad_w = _dispatch.empty((vocab, hidden), dtype=w.dtype, device=h.device) if need_w else None
    grad_b = torch.zeros((vocab,), dtype=torch.float32, device=h.device) if need_b else None
    if n == 0 or not (need_w or need_b):
        return grad_w.zero_() if need_w else None, grad_b.to(b.dtype) if need_b else None
    fp32_tile = not triton_path  # the plain-torch gradient is fp32
    itemsize = 4 if fp32_tile else h.element_size()
    budget = TORCH_CHUNK_BYTES if fp32_tile else TILE_BYTES
    cols = max(chunk_rows(vocab, n, itemsize, budget), min(vocab, 64))
    rows = chunk_rows(n, cols, itemsize, budget)
    tile = _dispatch.empty((rows * cols,), dtype=h.dtype, device=h.device)
    acc = _dispatch.empty((cols, hidden), dtype=torch.float32, device=h.device) if need_w and rows < n else None
    scale = scale.reshape(-1).float().expand(n)
    y = y.long()
    backward_rows = _row_functions(True)[1] if triton_path else None
    wide = fp32_gradient_matmuls(h)

    def part(t):  # a token chunk's rows; one chunk of every token takes the tensors whole: no views
        return t if rows >= n else t[s:e]

    for v0 in range(0, vocab, cols):
        v1 = min(vocab, v0 + cols)
        if not triton_path:
            # labels as columns of this block: -1 ignored, v1 - v0 (no column) outside the block (the
            # kernel takes the labels as they are, and the block's first column)
            y_block = torch.where(y == ignore_index, -1, torch.where((y >= v0) & (y < v1), y - v0, v1 - v0))
        for s in range(0, n, rows):
            e = min(n, s + rows)
            h_c, logits = part(h), tile[: (e - s) * (v1 - v0)].view(e - s, v1 - v0)
            if b is None:
                torch.matmul(h_c, w[v0:v1].t(), out=logits)
            else:
                torch.addmm(b[v0:v1], h_c, w[v0:v1].t(), out=logits)
            if triton_path:
                backward_rows(logits, part(y), ignore_index, softcap, part(lse), part(scale), logits, v0)
                g = logits
            else:
                g = _block_grad_torch(logits, part(y_block), part(lse), part(scale), softcap)
            if need_w:
                g_mm, h_mm = (g.float(), h_c.float()) if wide or g.dtype != h_c.dtype else (g, h_c)
                if acc is None:
                    if g_mm.dtype == grad_w.dtype:
                        torch.matmul(g_mm.t(), h_mm, out=grad_w[v0:v1])
                    else:
                        grad_w[v0:v1] = g_mm.t() @ h_mm
                else:
                    _add_matmul_(acc[: v1 - v0], g_mm.t(), h_mm, first=s == 0)
            if need_b:
                grad_b[v0:v1] += g.sum(0, dtype=torch.float32)
        if acc is not None:
            grad_w[v0:v1] = acc[: v1 - v0]
    return grad_w, grad_b.to(b.dtype) if need_b else None


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


def _grads_or_nothing(grads, h, weight, bias):
    grad_h, grad_w, grad_b = grads
    return (grad_h if grad_h is not None else _library.nothing(h),
            grad_w if grad_w is not None else _library.nothing(weight, torch.float32),
            grad_b if grad_b is not None else _library.nothing(weight, torch.float32))


@_library.custom_op("fused_linear_cross_entropy", used=1)
def _fused_linear_cross_entropy_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
    ignore_index: int, softcap: Optional[float], reduction: str, rows: int,
    need_h: bool, need_w: bool, need_b: bool, check_label_range: bool, triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse (N, 2) float32 (each row's max and log of its sum: cross_entropy's rows), grad_h, grad_w float32 (the weight's dtype where
    `weight_sum_in_dtype`), grad_b float32). For "mean" and "sum" the gradients asked for by need_*
    are computed here, unscaled by grad_output, except the weight's and bias's when
    weight_grad_by_blocks and not weight_sum_in_dtype (the backward's pass computes those); every
    gradient not computed is (0,). rows: tokens per chunk."""
    h = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])
    y = _flat_labels(labels)
    n = y.shape[0]
    grads_now = reduction != "none"
    if reduction == "mean":  # ("sum" and "none" count nothing: two launches a call fewer)
        # a device tensor (no host sync), counted in float32: exact below 2**24 tokens, and what
        # `total / kept` divides by either way
        kept = (y != ignore_index).sum(dtype=torch.float32).clamp_(min=1)
        scale = torch.reciprocal(kept)  # the bits of 1.0 / kept
    else:  # "none" computes no gradient here: nothing to scale
        scale = torch.ones(1, dtype=torch.float32, device=h.device) if grads_now else None
    loss = _dispatch.empty((n,), dtype=torch.float32, device=h.device)
    lse = _dispatch.empty((n, 2), dtype=torch.float32, device=h.device)
    # Above the fp32 budget the weight's and bias's gradients wait for the backward (_weight_pass),
    # unless the weight's is summed here in its own dtype.
    in_dtype, in_pass = _weight_grad_in_forward(n, rows, weight, h.shape[1], reduction, need_w, triton_path)
    grads = _chunked_pass(h, weight, bias, y, ignore_index, softcap, triton_path, rows, scale=scale,
                          need_h=need_h and grads_now, need_w=need_w and in_pass,
                          need_b=need_b and bias is not None and in_pass, loss=loss, lse=lse,
                          w_sum_dtype=weight.dtype if in_dtype else torch.float32)
    if check_label_range:  # after the pass: a bad label's row has a NaN lse
        _check_label_range_by_lse(labels, lse, weight.shape[0], ignore_index)
    grads = _grads_or_nothing(grads, h, weight, bias)
    if reduction == "none":
        return (loss.view(labels.shape), lse, *grads)
    total = loss.sum()
    # All tokens ignored: 0 / 1 = 0 (and zero gradients), not 0 / 0 = NaN.
    return (total / kept if reduction == "mean" else total), lse, *grads


@_fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, labels, ignore_index, softcap, reduction, rows, need_h, need_w, need_b,
      check_label_range, triton_path):
    now = reduction != "none"
    n, vocab, size = labels.numel(), weight.shape[0], hidden.shape[-1]
    in_dtype, in_pass = _weight_grad_in_forward(n, rows, weight, size, reduction, need_w, triton_path)
    return (hidden.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32),
            hidden.new_empty((n, 2), dtype=torch.float32),
            hidden.new_empty((n, size) if now and need_h else (0,)),
            hidden.new_empty((vocab, size) if in_pass and need_w else (0,),
                             dtype=weight.dtype if in_dtype else torch.float32),
            hidden.new_empty((vocab,) if in_pass and need_b and bias is not None else (0,), dtype=torch.float32))


@_library.custom_op("fused_linear_cross_entropy_backward")
def _fused_linear_cross_entropy_backward_op(
    grad_output: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    labels: torch.Tensor, lse: torch.Tensor, ignore_index: int, softcap: Optional[float], rows: int,
    need_h: bool, need_w: bool, need_b: bool, triton_path: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_h of hidden's shape, grad_w, grad_b) in the inputs' dtypes, each (0,) unless asked for,
    from the forward's lse; grad_output: the gradient scale, one per token or one for all (for
    "mean" already divided by the kept tokens). The logits of each chunk are recomputed; above the
    fp32 budget the weight's gradient comes from its own pass over vocabulary blocks."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = _flat_labels(labels)
    need_b = need_b and bias is not None
    scale = grad_output.reshape(-1).float()
    by_blocks = weight_grad_by_blocks(weight.shape[0], h.shape[1], triton_path)
    grad_h = grad_w = grad_b = None
    if need_h or ((need_w or need_b) and not by_blocks):
        grad_h, grad_w, grad_b = _chunked_pass(h, weight, bias, y, ignore_index, softcap, triton_path, rows,
                                               scale=scale, need_h=need_h, need_w=need_w and not by_blocks,
                                               need_b=need_b and not by_blocks, saved_lse=lse)
    if by_blocks and (need_w or need_b):
        grad_w, grad_b = _weight_pass(h, weight, bias, y, ignore_index, softcap, triton_path, lse, scale,
                                      need_w, need_b)
    return (grad_h.view(hidden.shape) if need_h else _library.nothing(hidden),
            grad_w.to(weight.dtype) if need_w else _library.nothing(weight),
            grad_b.to(bias.dtype) if need_b else _library.nothing(weight))


@_fused_linear_cross_entropy_backward_op.register_fake
def _(grad_output, hidden, weight, bias, labels, lse, ignore_index, softcap, rows, need_h, need_w, need_b,
      triton_path):
    return (hidden.new_empty(hidden.shape) if need_h else _library.nothing(hidden),
            weight.new_empty(weight.shape) if need_w else _library.nothing(weight),
            bias.new_empty(bias.shape) if need_b and bias is not None else _library.nothing(weight))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, ignore_index, softcap, reduction, rows, need_h, need_w, need_b, _, \
        triton_path = inputs
    _, lse, grad_h, grad_w, grad_b = output
    ctx.options = (ignore_index, softcap, reduction, rows, triton_path, hidden.shape)
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
    # "mean"/"sum" with the weight's gradient left to the backward (weight_grad_by_blocks) keep the
    # inputs for its pass, as "none" does, and the forward's unscaled grad_h
    # the weight's gradient summed in its own dtype in the forward: handed over scaled in place, as
    # grad_h above the budget, so the inputs are kept for a second backward's recomputation
    ctx.in_dtype, in_pass = _weight_grad_in_forward(labels.numel(), rows, weight, hidden.shape[-1], reduction,
                                                    need_w, triton_path)
    ctx.recompute = reduction == "none" or (not in_pass and (need_w or (need_b and bias is not None)))
    ctx.grad_h_given = False
    keep_inputs = ctx.recompute or ctx.in_dtype
    ctx.save_for_backward(grad_h, grad_w, grad_b, *((hidden, weight, bias, labels, lse) if keep_inputs else ()))
    ctx.set_materialize_grads(False)  # lse and the gradients get no gradient: allocate none for them


def _scaled(grad: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad * factor in `dtype`, computed in fp32 (a bf16 product would round grad_output first),
    as a new tensor: the saved grad stays intact, so a second backward through a retained graph
    still sees it unscaled. (Always a new tensor, even for grad_output == 1: handing the saved
    gradient over lets AccumulateGrad adopt it as .grad, and in-place work on .grad would then
    corrupt a second backward.)

    One op into the output for the kernels' dtypes: a float32 factor of shape (1,) makes float32
    the product's dtype (a 0-dim GPU tensor would be cast to the gradient's dtype first), so a
    half-precision grad is read as float32, multiplied, and rounded once into the output: the bits
    of `.float()`, multiply, `.to(dtype)` without their two temporaries (a float32 (V, H) one for
    the weight's gradient) and their two extra passes."""
    if grad.dtype == dtype == torch.float32:
        return torch.mul(grad, factor.float())
    if grad.dtype in _dispatch.KERNEL_DTYPES and dtype in _dispatch.KERNEL_DTYPES:
        out = torch.empty_like(grad, dtype=dtype, memory_format=torch.contiguous_format)  # every element written
        return torch.mul(grad, factor.float().reshape(1), out=out)
    return torch.mul(grad.float(), factor.float()).to(dtype)


def _scale_in_place(grad: torch.Tensor, factor: torch.Tensor, rows: int) -> torch.Tensor:
    """grad *= factor, computed in fp32 (one rounding): one op for the kernels' dtypes (as `_scaled`:
    the (1,) float32 factor makes the product float32, rounded into grad), elsewhere a chunk of rows
    at a time (bounded temporaries)."""
    if grad.dtype in _dispatch.KERNEL_DTYPES:
        return grad.mul_(factor.float().reshape(1))
    for s in range(0, grad.shape[0], rows):
        grad[s:s + rows] = grad[s:s + rows].float().mul_(factor)
    return grad


#: float32's largest finite value: what an infinite grad_output is scaled by (`_backward`).
_FP32_MAX = torch.finfo(torch.float32).max


def _backward(ctx, grad_output, *_unused):
    _dispatch.check_first_order("fused_linear_cross_entropy")
    ignore_index, softcap, reduction, rows, triton_path, hidden_shape = ctx.options
    if reduction != "none":
        # A gradient summed over no token is zero whatever grad_output is, as stock's nll_loss writes
        # no term for an ignored token. transformers' mean of an all-ignored batch is `sum / 0` (a NaN
        # loss, stock's too) and hands this backward an infinite grad_output: scaling the saved
        # zeros by it would give NaN gradients, which the optimizer step writes into every weight.
        # Clamped to float32's largest value (NaN stays NaN); a finite grad_output is unchanged.
        grad_output = grad_output.float().clamp(-_FP32_MAX, _FP32_MAX)
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    h_dtype, w_dtype, b_dtype = ctx.dtypes
    if ctx.in_dtype and not ctx.grad_h_given:
        # The forward's grad_h and grad_w (the weight's dtype: `weight_sum_in_dtype`) are scaled in
        # place, in fp32 (one rounding, as `_scaled`: `_scale_in_place`), and handed over: a
        # scaled copy would hold a second (V, H) beside the saved one. Through `.data`, as above the
        # budget; a later backward through a retained graph recomputes them (the last branch).
        saved_h, saved_w, saved_b = ctx.saved_tensors[:3]
        factor = grad_output.float()
        grad_h = _scale_in_place(saved_h.data, factor, rows).view(hidden_shape) if need_h else None
        grad_w = _scale_in_place(saved_w.data, factor, rows) if need_w else None
        grad_b = _scaled(saved_b, grad_output, b_dtype) if need_b else None
        ctx.grad_h_given = True
    elif not ctx.recompute and not ctx.in_dtype:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        grad_h = _scaled(grad_h, grad_output, h_dtype) if need_h else None
        if need_h and grad_h.shape != hidden_shape:
            grad_h = grad_h.view(hidden_shape)
        grad_w = _scaled(grad_w, grad_output, w_dtype) if need_w else None
        grad_b = _scaled(grad_b, grad_output, b_dtype) if need_b else None
    elif reduction == "none":
        hidden, weight, bias, labels, lse = ctx.saved_tensors[3:]
        grad_h, grad_w, grad_b = _fused_linear_cross_entropy_backward_op.backward_call(
            ctx, grad_output, hidden, weight, bias, labels, lse, ignore_index, softcap, rows,
            need_h, need_w, need_b, triton_path)
    else:  # above the budget; or a second backward after the in-dtype sum was handed over
        saved_h, _, _, hidden, weight, bias, labels, lse = ctx.saved_tensors
        scale = grad_output.float()
        if reduction == "mean":
            scale = scale / (labels != ignore_index).sum().clamp(min=1)
        # The forward's grad_h (already divided by the kept tokens) is scaled in place and handed
        # over: a copy would hold a second (N, H) beside the (V, H) result. Through `.data`, so
        # neither this nor a user's in-place work on the .grad that adopts it bumps the saved
        # tensor's version; a later backward through a retained graph recomputes grad_h instead.
        again = need_h and ctx.grad_h_given
        grad_h, grad_w, grad_b = _fused_linear_cross_entropy_backward_op.backward_call(
            ctx, scale, hidden, weight, bias, labels, lse, ignore_index, softcap, rows,
            again, need_w, need_b, triton_path)
        if need_h and not again:
            grad_h = _scale_in_place(saved_h.data, grad_output.float(), rows).view(hidden_shape)
            ctx.grad_h_given = True
    return ((grad_h if need_h else None), (grad_w if need_w else None), (grad_b if need_b else None),
            *(None,) * 10)


_fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin: _chunked_pass(..., triton_path=False), over cross_entropy's twin rows
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------


def _check_inputs(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size) -> None:
    _dispatch.check_tensor("hidden", hidden, "of shape (..., H)")
    _dispatch.check_tensor("weight", weight, "of shape (V, H)")
    for name, t in (("hidden", hidden), ("weight", weight)):
        _dispatch.check_floating(name, t)
    if hidden.dim() < 1:
        raise ValueError(f"hidden must have shape (..., H), got {tuple(hidden.shape)}")
    hidden_size = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but hidden of shape {tuple(hidden.shape)} needs "
            f"weight of shape (V, {hidden_size})"
        )
    vocab = weight.shape[0]
    if vocab < 1:
        raise ValueError(f"weight must have shape (V, H) with V >= 1, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; they must match")
    if bias is not None:
        _dispatch.check_tensor("bias", bias, f"of shape ({vocab},) or None")
        if tuple(bias.shape) != (vocab,):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)} but weight of shape {tuple(weight.shape)} needs "
                f"bias of shape ({vocab},)"
            )
        if bias.dtype != hidden.dtype:
            raise ValueError(f"bias has dtype {bias.dtype} but hidden has {hidden.dtype}; they must match")
    _check_options(ignore_index, softcap, reduction)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    _check_labels(labels, hidden.shape[:-1], vocab, ignore_index, against=f"hidden of shape {tuple(hidden.shape)}")
    _dispatch.check_same_device(hidden=hidden, weight=weight, bias=bias, labels=labels)


_PLAIN = (torch.Tensor, torch.nn.Parameter)
# (shapes, dtypes, options) that passed _check_inputs: the checks depend on nothing else but the
# devices, which are compared on every call
_CHECKED: set = set()


def _checked(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size) -> None:
    """_check_inputs, decided once per shape and options (its steps cost more host time than the
    rest of the call's Python); ValueError naming a bad argument as _check_inputs gives it."""
    if torch.compiler.is_compiling():  # traced once a compile, free in the graph: no set to keep
        return _check_inputs(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size)
    if (type(hidden) in _PLAIN and type(weight) in _PLAIN and type(labels) in _PLAIN
            and (bias is None or type(bias) in _PLAIN) and type(ignore_index) is int
            and (softcap is None or type(softcap) in (int, float)) and type(reduction) is str
            and (chunk_size is None or type(chunk_size) is int)):
        key = (hidden.shape, weight.shape, labels.shape, None if bias is None else (bias.shape, bias.dtype),
               hidden.dtype, weight.dtype, labels.dtype, ignore_index, softcap, reduction, chunk_size)
        if key in _CHECKED and hidden.device == weight.device == labels.device and (
                bias is None or bias.device == hidden.device):
            return
        _check_inputs(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size)
        if len(_CHECKED) > 4096:  # many sequence lengths: keep the set bounded
            _CHECKED.clear()
        _CHECKED.add(key)
        return
    _check_inputs(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size)


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T (+ bias), labels) without materialising the (N, V) logits.

    hidden (..., H), weight (V, H), bias (V,) or None, labels (...) integer; hidden, weight and
    bias share one floating dtype and device. ignore_index, softcap and reduction behave as in
    `cross_entropy` (loss in float32; all-ignored gives 0 with zero gradients; an out-of-range
    label raises ValueError on CPU and gives NaN on GPU).

    Gradients flow to hidden, weight and bias, each only if it requires grad, in its own dtype.
    For "mean" and "sum" they are computed during the forward, chunk by chunk, and scaled by
    grad_output in the backward; for "none" the backward recomputes each chunk's logits. grad of
    weight is summed in float32 across chunks, or, when that (V, H) sum would exceed
    WEIGHT_FP32_BYTES, computed in the backward per vocabulary block over all tokens (one more
    logits matmul; see the module docstring), or, where WEIGHT_DTYPE_SUM_CHUNKS allows (off by
    default), summed in the weight's dtype over the forward's few chunks.

    chunk_size: tokens per chunk (default: as many as fit CHUNK_BYTES of logits on the Triton
    path, TORCH_CHUNK_BYTES on the plain-torch path).
    """
    _checked(hidden, weight, labels, bias, ignore_index, softcap, reduction, chunk_size)
    triton_path = _dispatch.use_triton(hidden)
    if chunk_size is None:
        budget = CHUNK_BYTES if triton_path else TORCH_CHUNK_BYTES
        # The plain-torch path holds each chunk's gradient in fp32 on CPU: budget fp32 logits there.
        itemsize = 4 if not triton_path and hidden.device.type == "cpu" else hidden.element_size()
        chunk_size = chunk_rows(labels.numel(), weight.shape[0], itemsize, budget)
    grad = torch.is_grad_enabled()
    need_h, need_w = grad and hidden.requires_grad, grad and weight.requires_grad
    need_b = grad and bias is not None and bias.requires_grad
    softcap = None if softcap is None else float(softcap)
    return _fused_linear_cross_entropy_op(
        hidden, weight, bias, labels, ignore_index, softcap, reduction, chunk_size,
        need_h, need_w, need_b, True, triton_path)[0]
