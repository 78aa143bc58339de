"""accel_kernels: Triton kernels for LLM fine-tuning, each with a hand-written backward and a
plain-torch path of the same math.

Importing this package patches nothing. It imports torch and triton, never accel_patch,
transformers or accelerate.
"""
from .cross_entropy import cross_entropy
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .geglu import geglu
from .rms_norm import rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = ["cross_entropy", "fused_linear_cross_entropy", "geglu", "rms_norm", "rope", "swiglu"]
