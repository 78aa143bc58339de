"""Per-token log-probabilities of a linear head over the labelled rows, never the full logits.

`token_logprobs(hidden, weight, bias, labels, ...)` is what a trainer that scores tokens one by one
(TRL's fused LM head, `add_fused_lm_head`) needs from the head, computed with accel_kernels'
`fused_linear_cross_entropy`:

- `log_probs`: log p(label) of every position, 0 where the label is `ignore_index`, with gradients
  to hidden, weight and bias. Only labelled rows reach the kernel (they are selected before the
  matmul, as the deferred loss does: `deferred.labelled_rows`), with `reduction="none"` so each
  token keeps its own gradient (the kernel's backward recomputes each chunk's logits).
- `entropy`, `log_sum_sq_probs` (log of the sum of squared probabilities), `mean_logits` and
  `is_top1` (whether the label is the first most likely token, as `argmax`), only when asked: one
  more pass over the same rows, one chunk of logits at a time (`METRIC_CHUNK_BYTES` of float32
  logits), so they cost one more matmul and no (N, V) buffer. The entropy carries a gradient (a
  trainer that adds it to its loss, as GRPO's entropy bonus, trains on it; its backward recomputes
  each chunk, and never runs when the entropy is only logged); the others are metrics, without.
  Under no_grad (a reference model's pass) nothing is kept.

The logits are `scale * (hidden @ weight.T + bias)`, soft-capped as `softcap * tanh(z / softcap)`
when `softcap` is set, in the dtype autocast gives the matmul (the kernel and the metric pass use
the same one), cross-entropy in float32. Importing this module imports torch, not transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import sites
from .deferred import labelled_rows

#: Float32 logits one metric chunk may hold (the pass also makes one or two temporaries of that size).
METRIC_CHUNK_BYTES = 64 << 20


def _compute_inputs(hidden, weight, bias, fp32: bool):
    """hidden, weight, bias in the dtype the head's matmul runs in, and the autocast state to leave."""
    device_type = hidden.device.type
    if fp32:
        cast = torch.float32
    else:
        cast = sites.autocast_dtype(device_type) or weight.dtype
    if hidden.dtype != cast:
        hidden = hidden.to(cast)
    if weight.dtype != cast:
        weight = weight.to(cast)
    if bias is not None and bias.dtype != cast:
        bias = bias.to(cast)
    return hidden, weight, bias


def _chunk_logits(h, w, b, softcap):
    """Float32 logits of the rows h (soft-capped when asked) and tanh's value for the backward."""
    z = F.linear(h, w, b).float()
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


class _Metrics(torch.autograd.Function):
    """entropy, log(sum p^2), mean logit and is_top1 of the rows of h, one chunk of logits at a
    time; entropy is differentiable (a trainer that adds it to the loss, as GRPO's entropy bonus,
    gets its gradient; one that detaches it never runs this backward), the others are not. Saves
    h, w, b (the tensors the log-prob kernel saves too) and two floats per row."""

    @staticmethod
    def forward(ctx, h, w, b, y, softcap, flags):
        ctx.set_materialize_grads(False)
        want_entropy, want_sq, want_mean, want_top1 = flags
        n, vocab = h.shape[0], w.shape[0]
        f32 = dict(dtype=torch.float32, device=h.device)
        lse = torch.empty(n, **f32)
        entropy = torch.empty(n, **f32) if want_entropy else None
        sq = torch.empty(n, **f32) if want_sq else None
        mean = torch.empty(n, **f32) if want_mean else None
        top1 = torch.empty(n, dtype=torch.bool, device=h.device) if want_top1 else None
        rows = max(1, METRIC_CHUNK_BYTES // (vocab * 4))
        for s in range(0, n, rows):
            e = min(n, s + rows)
            z, _ = _chunk_logits(h[s:e], w, b, softcap)
            if want_top1:
                top1[s:e] = z.argmax(-1) == y[s:e]  # the first maximum, as argmax
            if want_mean:
                mean[s:e] = z.sum(-1) / vocab
            lse[s:e] = torch.logsumexp(z, -1)
            if want_sq:
                sq[s:e] = torch.logsumexp(2 * z, -1) - 2 * lse[s:e]
            if want_entropy:
                p = torch.softmax(z, -1)
                entropy[s:e] = lse[s:e] - p.mul_(z).sum(-1)
            del z
        ctx.softcap, ctx.rows = softcap, rows
        ctx.save_for_backward(h, w, b, lse, entropy)
        ctx.mark_non_differentiable(*(t for t in (sq, mean, top1) if t is not None))
        return entropy, sq, mean, top1

    @staticmethod
    def backward(ctx, grad_entropy, *_):
        h, w, b, lse, entropy = ctx.saved_tensors
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
        if grad_entropy is None or entropy is None:
            return None, None, None, None, None, None
        grad_entropy = grad_entropy.float()
        gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if needs_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if needs_w else None
        gb = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if needs_b and b is not None else None
        # On CPU bf16/fp16 matmuls run far slower than fp32 ones: the gradient matmuls take the
        # rounded chunk gradient in fp32 there, as the fused kernel's plain-torch twin does.
        wide = h.device.type == "cpu" and h.dtype != torch.float32
        w_mm = w.float() if wide and gh is not None else w
        for s in range(0, h.shape[0], ctx.rows):
            e = min(h.shape[0], s + ctx.rows)
            z, t = _chunk_logits(h[s:e], w, b, ctx.softcap)
            log_p = z.sub_(lse[s:e, None])
            # d entropy / d z_j = -p_j (log p_j + entropy)
            g = log_p.exp() * (log_p + entropy[s:e, None])
            g.mul_(-grad_entropy[s:e, None])
            if t is not None:
                g.mul_(1 - t * t)
            g = g.to(h.dtype)
            if wide:
                g = g.float()
            if gh is not None:
                gh[s:e] = g @ w_mm
            if gw is not None:
                gw.addmm_(g.t(), h[s:e].float()) if wide else gw.add_((g.t() @ h[s:e]).float())
            if gb is not None:
                gb.add_(g.float().sum(0))
        return (None if gh is None else gh.to(h.dtype), None if gw is None else gw.to(w.dtype),
                None if gb is None else gb.to(b.dtype), None, None, None)


#: The per-token fields `token_logprobs` computes besides log_probs (TRL's names).
METRICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def token_logprobs(hidden, weight, bias, labels, *, ignore_index: int = -100, scale: float = 1.0,
                   softcap: float | None = None, fp32: bool = False, outputs=("log_probs",)):
    """{"log_probs": ..., and each of `outputs` among METRICS}, each shaped like `labels`, of the
    logits `scale * F.linear(hidden, weight, bias)` (soft-capped when `softcap`).

    hidden (..., H), weight (V, H), bias (V,) or None, labels (...) integer. Under autocast the
    matmul runs in autocast's dtype (`fp32=True`: in float32, as TRL's `cast_lm_head_to_fp32`).
    Positions whose label is `ignore_index` get 0 in every output and reach no kernel. log_probs
    and entropy carry gradients; log_sum_sq_probs, mean_logits and is_top1 do not.
    """
    from accel_kernels import fused_linear_cross_entropy

    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    unknown = [o for o in outputs if o != "log_probs" and o not in METRICS]
    if unknown:
        raise ValueError(f"outputs {unknown} are not among log_probs, {', '.join(METRICS)}")
    mask = labels != ignore_index
    h, w, b = _compute_inputs(hidden, weight, bias, fp32)
    h, y, _ = labelled_rows(h.reshape(-1, h.shape[-1]), labels.reshape(-1), ignore_index)
    if scale != 1.0:
        h = h * scale
        b = b * scale if b is not None else None
    flags = tuple(m in outputs for m in METRICS)
    with torch.autocast(h.device.type, enabled=False):
        nll = fused_linear_cross_entropy(h, w, y, bias=b, ignore_index=ignore_index, softcap=softcap,
                                         reduction="none")
        metrics = _Metrics.apply(h, w, b, y, softcap, flags) if any(flags) else (None,) * len(METRICS)
    # masked_scatter keeps the output connected to the graph even when no label is kept (as TRL).
    result = {"log_probs": torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, -nll)}
    for name, value in zip(METRICS, metrics):
        if value is not None:
            result[name] = torch.zeros(mask.shape, dtype=value.dtype, device=mask.device).masked_scatter(mask, value)
    return result
