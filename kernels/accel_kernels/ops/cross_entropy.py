"""Cross-entropy over a large vocabulary: ignore_index, optional logit soft-capping, three reductions.

One Triton program per row (token) walks the vocabulary in blocks of at most MAX_BLOCK columns
with an online max / log-sum-exp in fp32, so any vocabulary size works (256k included) and the
loss is accumulated in fp32 whatever the logits' dtype.

Why the forward saves the per-row log-sum-exp and the backward recomputes the softmax, rather
than writing the gradient during the forward (Liger's way): on a GPU this op is bound by memory
traffic over the (N, V) logits. Saving lse costs one read of the logits in the forward and one
read + one write in the backward, with grad_output folded into that write; computing the gradient
in the forward costs two reads + one write there, and another read + write in the backward to
scale it by grad_output (or a host sync to skip that when it is 1). Recomputing is the cheaper of
the two, does no gradient work in evaluation, and holds one logits-dtype buffer (the gradient)
only while the backward runs. The fused linear cross-entropy (fused_linear_cross_entropy.py) does
want the gradient during the forward, in place in its own chunk buffer: `_forward_triton(...,
grad=...)` is that mode of the same kernel.

What is saved of a row is its log-sum-exp in two parts, `lse` of shape (N, 2) fp32: the row's max
and the log of its sum of exp(z - max). The loss, the gradient the forward writes and the backward's
softmax are all computed as eager's log_softmax computes them, (z - max) - log(sum), exact where |z|
is large. One fp32 lse = max + log(sum) would be rounded to half an ulp of |lse|: the softmax
recomputed from it was off by up to |lse| x 6e-8 a row (6e-4 at logits near 1e4, 2e-4 of the
gradient's norm measured at 1e5, where eager's error is 1e-7), and four logits tied at 3e38 in bf16
got a gradient of 1 each instead of 1/4. The second float costs 4 bytes a row.

The host functions and their plain-torch twins work row-wise with one signature each:
`_forward_triton` / `_forward_torch` and `_backward_triton` / `_backward_torch` (the twin is the same
math, processing a bounded number of rows at a time). The fused op runs them on its chunks of
logits, picked by `_row_functions(triton_path)`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _dispatch, _launch, _library
from .._triton import cast_rounded, jit, tl

REDUCTIONS = ("mean", "sum", "none")

# Columns per block of the kernels' vocabulary loop: 8192 fp32 values over 16 warps is 16 values a
# thread per live tensor, enough loads in flight to stream HBM without spilling registers.
MAX_BLOCK = 8192

# Rows the plain-torch twin processes at once: it materialises a few fp32 copies of them.
TORCH_ROWS_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _tanh(x):
    """tanh of fp32 x from exp (libdevice tanh is not reachable alike across Triton versions and the interpreter)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@jit
def _zero_row(g_row, n_cols, BLOCK: tl.constexpr):
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        tl.store(g_row + cols, tl.zeros([BLOCK], dtype=g_row.dtype.element_ty), mask=cols < n_cols)


@jit
def _write_grad_row(x_row, g_row, label, shift, log_d, scale, n_cols, softcap,
                    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """g = scale * (softmax(z) - onehot(label)) * dz/dx for one row; g_row may alias x_row.

    softmax(z) = exp((z - shift) - log_d) with shift + log_d the row's log-sum-exp: the forward
    passes its running max and log of the sum (z - max is exact near the max, as eager's
    log_softmax computes it); the backward the two saved by the forward."""
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh(x / softcap)
            z = softcap * t
        else:
            z = x
        p = tl.exp((z - shift) - log_d)
        g = tl.where(cols == label, p - 1.0, p) * scale
        if HAS_SOFTCAP:
            g = g * (1.0 - t * t)  # d/dx softcap * tanh(x / softcap)
        tl.store(g_row + cols, cast_rounded(g, g_row.dtype.element_ty), mask=mask)


@jit
def _ce_forward_kernel(
    X, stride_xa, stride_xb, rows_b,  # row r starts at X + (r // rows_b) * stride_xa + (r % rows_b) * stride_xb
    Y, stride_y,
    LOSS, LSE,  # fp32: one per row; two per row (max, log of the sum of exp(z - max))
    GRAD, stride_g,  # written only when WRITE_GRAD; may be X itself (in place)
    SCALE, stride_scale,  # fp32 gradient scale: one per row, or stride 0 for one for all
    n_cols, ignore_index, softcap,
    HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + (row // rows_b) * stride_xa + (row % rows_b) * stride_xb
    label = tl.load(Y + row * stride_y).to(tl.int64)
    if label == ignore_index:
        tl.store(LOSS + row, 0.0)
        tl.store(LSE + 2 * row, 0.0)
        tl.store(LSE + 2 * row + 1, 0.0)
        if WRITE_GRAD:
            _zero_row(GRAD + row * stride_g, n_cols, BLOCK)
    else:
        # Online log-sum-exp: m is the running max, d the sum of exp(z - m).
        m = float("-inf")
        d = 0.0
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(x_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
            if HAS_SOFTCAP:
                z = tl.where(mask, softcap * _tanh(z / softcap), float("-inf"))
            m_new = tl.maximum(m, tl.max(z, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that start with -inf logits
            d = d * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
            m = m_new
        log_d = tl.log(d)
        # An out-of-range label gives a NaN loss (and NaN gradient) instead of reading out of bounds:
        # a host check would cost a sync, and tl.device_assert only fires in Triton debug mode.
        in_range = (label >= 0) & (label < n_cols)
        z_t = tl.load(x_row + tl.where(in_range, label, 0)).to(tl.float32)
        if HAS_SOFTCAP:
            z_t = softcap * _tanh(z_t / softcap)
        log_d = tl.where(in_range, log_d, float("nan"))
        # (m - z_t) + log d, eager's order: m + log d rounded to fp32 first would lose log d's low
        # bits where |m| is large (an ulp of 1e4 is 1e-3)
        tl.store(LOSS + row, (m - z_t) + log_d)
        tl.store(LSE + 2 * row, m)
        tl.store(LSE + 2 * row + 1, log_d)
        if WRITE_GRAD:
            scale = tl.load(SCALE + row * stride_scale)
            _write_grad_row(x_row, GRAD + row * stride_g, label, m, log_d, scale, n_cols, softcap,
                            HAS_SOFTCAP, BLOCK)


@jit
def _ce_backward_kernel(
    X, stride_xa, stride_xb, rows_b,
    Y, stride_y,
    LSE,  # (max, log of the sum) per row, from the forward
    GRAD, stride_g,
    SCALE, stride_scale,
    n_cols, ignore_index, softcap,
    label_offset,  # the rows' first column in the vocabulary (a block of it: the fused loss's weight pass)
    HAS_SOFTCAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + (row // rows_b) * stride_xa + (row % rows_b) * stride_xb
    g_row = GRAD + row * stride_g
    label = tl.load(Y + row * stride_y).to(tl.int64)
    if label == ignore_index:
        _zero_row(g_row, n_cols, BLOCK)
    else:
        m = tl.load(LSE + 2 * row)
        log_d = tl.load(LSE + 2 * row + 1)  # NaN for an out-of-range label: the gradient row is NaN too
        scale = tl.load(SCALE + row * stride_scale)
        # a label outside the block is no column of it: no one-hot term in this row
        _write_grad_row(x_row, g_row, label - label_offset, m, log_d, scale, n_cols, softcap, HAS_SOFTCAP,
                        BLOCK)


# --------------------------------------------------------------------------------------------
# Host launch (row-wise; the fused op calls these on its chunks)
# --------------------------------------------------------------------------------------------


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = min(_launch.next_power_of_2(n_cols), MAX_BLOCK)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def _row_strides(x: torch.Tensor) -> tuple[int, int, int]:
    """(stride_a, stride_b, rows_b) of the kernels' two-level row addressing for a 2-D or 3-D x."""
    if x.dim() == 2:
        return x.stride(0), 0, 1
    return x.stride(0), x.stride(1), x.shape[1]


def _scale_stride(scale: torch.Tensor) -> int:
    return 0 if scale.numel() == 1 else scale.stride(0)


def _forward_triton(x, labels, ignore_index, softcap, loss, lse, grad=None, scale=None):
    """Per-row loss and lse (fp32, written into `loss` (N,) and `lse` (N, 2) contiguous: max and
    log of the sum of exp(z - max)) of the logits rows of x.

    x: (N, V) or (A, B, V) with unit column stride (rows r = a * B + b); labels: (N,) integer.
    If `grad` is given ((N, V) contiguous, may be x itself), also writes scale * d loss_r / d x_r
    into it; `scale` is an fp32 tensor of one element or one per row.
    """
    n_cols = x.shape[-1]
    n_rows = labels.shape[0]
    if n_rows == 0:
        return
    block, num_warps = _launch_config(n_cols)
    write_grad = grad is not None
    if not write_grad:
        grad, scale = lse, lse  # unused pointers
    _launch.launch(
        _ce_forward_kernel, (n_rows,),
        x, *_row_strides(x), labels, labels.stride(0), loss, lse,
        grad, grad.stride(0) if write_grad else 0, scale, _scale_stride(scale) if write_grad else 0,
        n_cols, ignore_index, 1.0 if softcap is None else float(softcap),
        HAS_SOFTCAP=softcap is not None, WRITE_GRAD=write_grad, BLOCK=block,
        num_warps=num_warps,
    )


def _backward_triton(x, labels, ignore_index, softcap, lse, scale, grad, label_offset: int = 0):
    """Writes scale * d loss_r / d x_r into grad ((N, V) contiguous) from the lse of the forward.

    label_offset: x's rows are the vocabulary's columns from label_offset on (a block of them,
    with the whole vocabulary's lse): a row's label is its column label - label_offset, none
    where that falls outside x."""
    n_cols = x.shape[-1]
    n_rows = labels.shape[0]
    if n_rows == 0:
        return
    block, num_warps = _launch_config(n_cols)
    _launch.launch(
        _ce_backward_kernel, (n_rows,),
        x, *_row_strides(x), labels, labels.stride(0), lse, grad, grad.stride(0),
        scale, _scale_stride(scale), n_cols, ignore_index,
        1.0 if softcap is None else float(softcap), label_offset,
        HAS_SOFTCAP=softcap is not None, BLOCK=block, num_warps=num_warps,
    )


# --------------------------------------------------------------------------------------------
# torch.library ops (see _library.py): forward, backward, fake implementations, autograd formula
# --------------------------------------------------------------------------------------------


def _flat_labels(labels: torch.Tensor) -> torch.Tensor:
    y = labels if labels.dim() == 1 else labels.reshape(-1)  # (a view costs more than the test)
    if y.dtype not in (torch.int32, torch.int64):
        y = y.long()
    return y


def _rows_view(logits: torch.Tensor, triton_rows: bool) -> torch.Tensor:
    """The logits as rows without copying where possible: (N, V), or (A, B, V) for the kernels."""
    vocab = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if logits.dim() == 2:  # rows already (a view costs more than the test)
        return logits
    try:
        return logits.view(-1, vocab)
    except RuntimeError:
        pass
    if triton_rows and logits.dim() >= 3:  # e.g. logits[:, :-1, :]: two row strides, no copy
        try:
            return logits.view(-1, logits.shape[-2], vocab)
        except RuntimeError:
            pass
    return logits.reshape(-1, vocab)


@_library.custom_op("cross_entropy", used=1)
def _cross_entropy_op(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, softcap: Optional[float],
                      reduction: str, check_label_range: bool, triton_path: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, lse (N, 2) float32 (each row's max and log of its sum), n_valid int64 scalar). check_label_range: raise ValueError on CPU
    labels outside [0, V) (checked here, at run time, where the values are: also when compiled)."""
    forward_rows, _ = _row_functions(triton_path)
    x = _rows_view(logits, triton_path)
    y = _flat_labels(labels)
    n = y.shape[0]
    loss = _dispatch.empty((n,), dtype=torch.float32, device=logits.device)
    lse = _dispatch.empty((n, 2), dtype=torch.float32, device=logits.device)
    forward_rows(x, y, ignore_index, softcap, loss, lse)
    if check_label_range:
        _check_label_range_by_lse(labels, lse, logits.shape[-1], ignore_index)
    n_valid = (y != ignore_index).sum()  # a device tensor: no host sync
    if reduction == "none":
        return loss.view(labels.shape), lse, n_valid
    total = loss.sum()
    # All tokens ignored: 0 / 1 = 0 (and zero gradients), not eager torch's 0 / 0 = NaN.
    return (total / n_valid.clamp(min=1) if reduction == "mean" else total), lse, n_valid


@_cross_entropy_op.register_fake
def _(logits, labels, ignore_index, softcap, reduction, check_label_range, triton_path):
    n = labels.numel()
    loss = logits.new_empty(labels.shape if reduction == "none" else (), dtype=torch.float32)
    return loss, logits.new_empty((n, 2), dtype=torch.float32), logits.new_empty((), dtype=torch.int64)


@_library.custom_op("cross_entropy_backward")
def _cross_entropy_backward_op(grad_output: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                               lse: torch.Tensor, n_valid: torch.Tensor, ignore_index: int,
                               softcap: Optional[float], reduction: str, triton_path: bool) -> torch.Tensor:
    """d loss / d logits, of logits' shape and dtype."""
    _, backward_rows = _row_functions(triton_path)
    x = _rows_view(logits, triton_path)
    y = _flat_labels(labels)
    if reduction == "none":
        scale = grad_output.reshape(-1).float()
    elif reduction == "mean":
        scale = (grad_output.float() / n_valid.clamp(min=1)).reshape(1)
    else:
        scale = grad_output.float().reshape(1)
    grad = _dispatch.empty((y.shape[0], logits.shape[-1]), dtype=logits.dtype, device=logits.device)
    backward_rows(x, y, ignore_index, softcap, lse, scale, grad)
    return grad.view(logits.shape)


@_cross_entropy_backward_op.register_fake
def _(grad_output, logits, labels, lse, n_valid, ignore_index, softcap, reduction, triton_path):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, labels, ignore_index, softcap, reduction, _, triton_path = inputs
    _, lse, n_valid = output
    ctx.save_for_backward(logits, labels, lse, n_valid)
    ctx.options = (ignore_index, softcap, reduction, triton_path)
    ctx.set_materialize_grads(False)  # lse and n_valid get no gradient: allocate none for them


def _backward(ctx, grad_output, _dlse=None, _dn_valid=None):
    _dispatch.check_first_order("cross_entropy")
    logits, labels, lse, n_valid = ctx.saved_tensors
    ignore_index, softcap, reduction, triton_path = ctx.options
    grad = _cross_entropy_backward_op.backward_call(ctx, grad_output, logits, labels, lse, n_valid,
                                                          ignore_index, softcap, reduction, triton_path)
    return grad, None, None, None, None, None, None


_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Plain-torch twin (row-wise, same signatures as the host functions)
# --------------------------------------------------------------------------------------------


def _torch_row_blocks(x: torch.Tensor):
    step = max(1, TORCH_ROWS_ELEMENTS // max(1, x.shape[-1]))
    for start in range(0, x.shape[0], step):
        yield start, min(start + step, x.shape[0])


def _torch_capped(x: torch.Tensor, softcap):
    """(z, tanh) in fp32 for a block of logits rows; never writes into x."""
    z = x.float()
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


def _torch_rows(x, labels, ignore_index, softcap, scale, grad, loss=None, lse=None, saved_lse=None):
    """The plain-torch rows, both directions: computes lse and loss unless `saved_lse` is given, and
    the scaled gradient into `grad` if given (grad may be x itself: z is read before it is written).
    Works on TORCH_ROWS_ELEMENTS at a time and writes fp32 gradients straight into `grad`."""
    n_rows, n_cols = x.shape
    if scale is not None:
        scale = scale.reshape(-1).float().expand(n_rows)
    for s, e in _torch_row_blocks(x):
        z, t = _torch_capped(x[s:e], softcap)
        y = labels[s:e]
        valid = y != ignore_index
        hit = valid & (y >= 0) & (y < n_cols)  # rows with a usable label
        y_hit = torch.where(hit, y, 0).long().unsqueeze(1)
        z_t = z.gather(1, y_hit).squeeze(1)
        out = grad[s:e] if grad is not None and grad.dtype == torch.float32 else None
        if saved_lse is None:
            m = z.amax(1, keepdim=True)
            m = torch.where(m == float("-inf"), 0.0, m)  # rows of -inf logits, as in the kernel
            p = torch.sub(z, m, out=out).exp_()
            total = p.sum(1)
            m = m.squeeze(1)
            log_total = torch.where(valid, torch.where(hit, total.log(), float("nan")), 0.0)
            # (m - z_t) + log total, as the kernel and eager's log_softmax: no rounding of m + log total
            loss[s:e] = torch.where(valid, (m - z_t) + log_total, 0.0)
            lse[s:e, 0] = torch.where(valid, m, 0.0)
            lse[s:e, 1] = log_total
            if grad is None:
                continue
            factor = scale[s:e] / total  # p / total is the softmax
        else:
            shift = torch.where(valid, saved_lse[s:e, 0], float("inf"))  # exp(z - inf) = 0 on ignored rows
            p = torch.sub(z, shift.unsqueeze(1), out=out).sub_(saved_lse[s:e, 1].unsqueeze(1)).exp_()
            factor = scale[s:e]
        # NaN rows for an out-of-range label (as the kernel), zero rows for ignored ones.
        p.mul_(torch.where(valid, torch.where(hit, factor, float("nan")), 0.0).unsqueeze(1))
        rows = torch.nonzero(hit).squeeze(1)
        p[rows, y_hit[rows, 0]] -= scale[s:e][rows]
        if t is not None:
            p.mul_(t.square_().neg_().add_(1.0))  # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
        if out is None:
            grad[s:e].copy_(p)


def _forward_torch(x, labels, ignore_index, softcap, loss, lse, grad=None, scale=None):
    """`_forward_triton` in plain torch: same arguments, same results (x must be 2-D here)."""
    _torch_rows(x, labels, ignore_index, softcap, scale, grad, loss=loss, lse=lse)


def _backward_torch(x, labels, ignore_index, softcap, lse, scale, grad):
    """`_backward_triton` in plain torch (x must be 2-D here)."""
    _torch_rows(x, labels, ignore_index, softcap, scale, grad, saved_lse=lse)


def _row_functions(triton_path: bool):
    """(forward, backward) row functions: the host launches, or their plain-torch twins."""
    return (_forward_triton, _backward_triton) if triton_path else (_forward_torch, _backward_torch)


# --------------------------------------------------------------------------------------------
# Input checks (the fused op shares _check_options and _check_labels)
# --------------------------------------------------------------------------------------------


def _check_options(ignore_index, softcap, reduction) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if softcap is not None:
        is_number = isinstance(softcap, (int, float)) and not isinstance(softcap, bool)
        # a comparison, not math.isfinite: under torch.compile(dynamic=True) a config float is a
        # SymFloat, which dynamo compares but cannot hand to `math`
        if not is_number or not 0 < softcap < math.inf:
            raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap!r}")


def _check_labels(labels, expected_shape, vocab: int, ignore_index: int, against: str) -> None:
    """labels: an integer tensor of `expected_shape` (vocab and ignore_index are for the message
    of `_check_label_range`, which the ops run on the values)."""
    _dispatch.check_tensor("labels", labels, f"of an integer dtype and shape {tuple(expected_shape)}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but {against} needs labels of shape {tuple(expected_shape)}"
        )
    # the range (values, on CPU) is checked by the op itself at run time: _check_label_range


def _check_label_range(labels, vocab: int, ignore_index: int) -> None:
    """On CPU, ValueError unless every label is in [0, vocab) or ignore_index (on a GPU checking
    would cost a host sync: the kernels give NaN instead)."""
    if labels.device.type == "cpu" and labels.numel() > 0:
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            value = labels[bad].flatten()[0].item()
            raise ValueError(
                f"labels contains {value}, outside [0, V) for vocabulary size V={vocab} "
                f"(and not ignore_index={ignore_index})"
            )


def _check_label_range_by_lse(labels, lse, vocab: int, ignore_index: int) -> None:
    """`_check_label_range`, run only when the rows' lse is not all finite: a label out of range
    makes its row's lse NaN (kernels and twin alike), so one sum tells a good batch from one that
    needs the check (six CPU ops a call otherwise, more than the rest of the loss's host work)."""
    if labels.device.type == "cpu" and lse.numel() > 0 and not math.isfinite(lse.sum().item()):
        _check_label_range(labels, vocab, ignore_index)


def _check_inputs(logits, labels, ignore_index, softcap, reduction) -> None:
    _dispatch.check_tensor("logits", logits, "of shape (..., V)")
    _dispatch.check_floating("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    _check_options(ignore_index, softcap, reduction)
    _check_labels(labels, logits.shape[:-1], logits.shape[-1], ignore_index,
                  against=f"logits of shape {tuple(logits.shape)}")
    _dispatch.check_same_device(logits=logits, labels=labels)


# --------------------------------------------------------------------------------------------
# Entry
# --------------------------------------------------------------------------------------------


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits (..., V) against integer labels (...), like F.cross_entropy.

    - softcap: if given (> 0), the logits become softcap * tanh(logits / softcap) before the
      softmax (Gemma 2 style); the gradient goes through the cap.
    - reduction: "mean" over the tokens whose label is not ignore_index, "sum", or "none" (the
      per-token loss, shape labels.shape, 0 at ignored tokens). If every token is ignored, "mean"
      and "sum" both return 0 with zero gradients (eager torch's "mean" gives NaN).
    - The loss is returned in float32 whatever the logits' dtype (float32 accumulation); the
      gradient of logits has the logits' dtype. Not differentiable w.r.t. labels. The caller's
      logits are never written to.
    - Label out of range (not ignore_index and < 0 or >= V): ValueError on CPU tensors; on a GPU,
      checking would cost a host sync, so that token's loss and gradient are NaN instead.
    - Bad shapes, dtypes, devices or options raise ValueError naming the argument.

    Runs the Triton kernels on GPU tensors (and on CPU tensors when the kernels run under Triton's
    interpreter), the plain-torch twin elsewhere; the kernels compute in fp32, so float64 logits
    get fp32 accuracy there.
    """
    _check_inputs(logits, labels, ignore_index, softcap, reduction)
    softcap = None if softcap is None else float(softcap)
    return _cross_entropy_op(logits, labels, ignore_index, softcap, reduction, True,
                                                 _dispatch.use_triton(logits))[0]
