"""The one place accel_kernels imports triton, and the Triton helpers the op modules share.

pyproject installs triton on Linux only, and a broken install must not break `import
accel_kernels` either: when triton cannot be imported, `AVAILABLE` is False, `jit` gives
placeholder kernels that refuse to launch, and every op runs its plain-torch twin (see
`_dispatch.use_triton`). Op modules take `jit`, `tl` and `constexpr` from here and never import
triton themselves.

`INTERPRETING` records whether the kernels were defined for Triton's CPU interpreter: triton reads
TRITON_INTERPRET when `@triton.jit` decorates a function, so the value in force at import is the one
the kernels carry for the life of the process, whatever the environment says later.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception as error:  # ImportError, or a broken install failing inside triton's own import
    triton = tl = None
    IMPORT_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
    IMPORT_ERROR = None

AVAILABLE = triton is not None


class _NoTritonKernel:
    """What `jit` makes of a kernel when triton is missing: named like it, refuses to launch."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = fn.__name__

    def __getitem__(self, grid):
        raise RuntimeError(
            f"cannot launch {self.__name__}: triton could not be imported ({IMPORT_ERROR}); "
            f"accel_kernels runs its plain-torch paths only"
        )


if AVAILABLE:
    jit = triton.jit

    def constexpr(value):
        """A module-level constant that kernels may read (triton wants globals as constexpr)."""
        return tl.constexpr(value)
else:
    def jit(fn):
        return _NoTritonKernel(fn)

    def constexpr(value):
        return value


@jit
def cast_rounded(x, dtype: tl.constexpr):
    """fp32 x cast to dtype, rounding to nearest even (also under the interpreter)."""
    if SOFTWARE_BF16_ROUNDING and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


# Decided by what triton made of the function just above, not by re-reading the environment.
INTERPRETING = AVAILABLE and type(cast_rounded).__name__ == "InterpretedFunction"

# The GPU rounds fp32 -> bf16 to nearest even; triton's CPU interpreter (3.9) truncates, an error
# of a whole bf16 ulp the GPU never makes. Under the interpreter, round in software as the GPU does.
SOFTWARE_BF16_ROUNDING = constexpr(INTERPRETING)
