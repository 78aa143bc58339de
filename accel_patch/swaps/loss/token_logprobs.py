"""Per-token log-probabilities of a linear head over the labelled rows, never the full logits.

`token_logprobs(hidden, weight, bias, labels, ...)` is what a trainer that scores tokens one by one
(TRL's fused LM head, `add_fused_lm_head`) needs from the head, computed with accel_kernels'
`fused_linear_cross_entropy`:

- `log_probs`: log p(label) of every position, 0 where the label is `ignore_index`, with gradients
  to hidden, weight and bias. Only labelled rows reach the kernel (they are selected before the
  matmul, as the deferred loss does: `deferred.labelled_rows`), with `reduction="none"` so each
  token keeps its own gradient (the kernel's backward recomputes each chunk's logits).
- `entropy` and `is_top1` (whether the label is the first most likely token, as `argmax`), only
  when asked, without gradient: one no-grad pass over the same rows, one chunk of logits at a time
  (`METRIC_CHUNK_BYTES` of float32 logits), so they cost one more matmul and no (N, V) buffer.

The logits are `scale * (hidden @ weight.T + bias)`, soft-capped as `softcap * tanh(z / softcap)`
when `softcap` is set, in the dtype autocast gives the matmul (the kernel and the metric pass use
the same one), cross-entropy in float32. Importing this module imports torch, not transformers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .deferred import labelled_rows

#: Float32 logits one metric chunk may hold (the pass also makes one or two temporaries of that size).
METRIC_CHUNK_BYTES = 64 << 20


def _compute_inputs(hidden, weight, bias, fp32: bool):
    """hidden, weight, bias in the dtype the head's matmul runs in, and the autocast state to leave."""
    device_type = hidden.device.type
    if fp32:
        cast = torch.float32
    elif torch.is_autocast_enabled(device_type):
        cast = torch.get_autocast_dtype(device_type)
    else:
        cast = weight.dtype
    if hidden.dtype != cast:
        hidden = hidden.to(cast)
    if weight.dtype != cast:
        weight = weight.to(cast)
    if bias is not None and bias.dtype != cast:
        bias = bias.to(cast)
    return hidden, weight, bias


def _metrics(h, w, b, y, softcap, want_entropy: bool, want_top1: bool):
    """(entropy, is_top1) of the rows of h (no gradient), chunk by chunk."""
    n, vocab = h.shape[0], w.shape[0]
    entropy = torch.empty(n, dtype=torch.float32, device=h.device) if want_entropy else None
    top1 = torch.empty(n, dtype=torch.bool, device=h.device) if want_top1 else None
    rows = max(1, METRIC_CHUNK_BYTES // (vocab * 4))
    with torch.no_grad():
        for s in range(0, n, rows):
            e = min(n, s + rows)
            z = F.linear(h[s:e], w, b).float()
            if softcap is not None:
                z = torch.tanh(z / softcap).mul_(softcap)
            if want_top1:
                top1[s:e] = z.argmax(-1) == y[s:e]
            if want_entropy:
                lse = torch.logsumexp(z, -1)
                p = torch.softmax(z, -1)
                entropy[s:e] = lse - (p.mul_(z)).sum(-1)
    return entropy, top1


def token_logprobs(hidden, weight, bias, labels, *, ignore_index: int = -100, scale: float = 1.0,
                   softcap: float | None = None, fp32: bool = False, entropy: bool = False, top1: bool = False):
    """(log_probs, entropy, is_top1), each shaped like `labels` (entropy and is_top1 None unless
    asked), of the logits `scale * F.linear(hidden, weight, bias)` (soft-capped when `softcap`).

    hidden (..., H), weight (V, H), bias (V,) or None, labels (...) integer. Under autocast the
    matmul runs in autocast's dtype (`fp32=True`: in float32, as TRL's `cast_lm_head_to_fp32`).
    Positions whose label is `ignore_index` get 0 in every output and reach no kernel.
    """
    from accel_kernels import fused_linear_cross_entropy

    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    mask = labels != ignore_index
    h, w, b = _compute_inputs(hidden, weight, bias, fp32)
    h, y, _ = labelled_rows(h.reshape(-1, h.shape[-1]), labels.reshape(-1), ignore_index)
    if scale != 1.0:
        h = h * scale
        b = b * scale if b is not None else None
    with torch.autocast(h.device.type, enabled=False):
        nll = fused_linear_cross_entropy(h, w, y, bias=b, ignore_index=ignore_index, softcap=softcap,
                                         reduction="none")
        ent, is_top1 = _metrics(h.detach(), w.detach(), None if b is None else b.detach(), y, softcap,
                                entropy, top1) if (entropy or top1) else (None, None)
    # masked_scatter keeps the output connected to the graph even when no label is kept (as TRL).
    log_probs = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, -nll)
    if ent is not None:
        ent = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, ent)
    if is_top1 is not None:
        is_top1 = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device).masked_scatter(mask, is_top1)
    return log_probs, ent, is_top1

