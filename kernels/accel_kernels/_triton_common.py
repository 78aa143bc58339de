"""Triton helpers shared by the op modules."""
from __future__ import annotations

import triton
import triton.language as tl

from . import _dispatch

# The GPU rounds fp32 -> bf16 to nearest even; triton's CPU interpreter (3.9) truncates, an error
# of a whole bf16 ulp the GPU never makes. Under the interpreter, round in software as the GPU does.
SOFTWARE_BF16_ROUNDING = tl.constexpr(_dispatch.interpreting())


@triton.jit
def cast_rounded(x, dtype: tl.constexpr):
    """fp32 x cast to dtype, rounding to nearest even (also under the interpreter)."""
    if SOFTWARE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
