"""Shared numeric checks for kernel tests: relative error against a float64 reference.

The bound follows the dtype instead of being tuned until a test passes: float32 results must be
within 1e-5 of the float64 reference; bf16/fp16 results no worse than 1.5x the error of the stock
torch computation in that dtype, plus a small floor.
"""
from __future__ import annotations

import torch

FP32_BOUND = 1e-5
LOW_PRECISION_FLOOR = {torch.bfloat16: 1e-3, torch.float16: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf."""
    # on the CPU: a GPU result meets a reference computed on the CPU
    out = out.detach().cpu().to(torch.float64)
    ref = ref.detach().cpu().to(torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def bound_for(dtype: torch.dtype, stock: torch.Tensor | None, ref: torch.Tensor) -> float:
    """The allowed relative error for a result of `dtype`; `stock` is torch's own result in that dtype."""
    if dtype in (torch.float32, torch.float64):
        return FP32_BOUND
    if stock is None:
        raise ValueError(f"a {dtype} check needs the stock torch result to set its bound")
    return 1.5 * rel_err(stock, ref) + LOW_PRECISION_FLOOR[dtype]


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, stock: torch.Tensor | None = None, what: str = "output") -> None:
    err = rel_err(out, ref)
    bound = bound_for(dtype, stock, ref)
    assert err <= bound, f"{what}: relative error {err:.3e} exceeds {bound:.3e} ({dtype})"
