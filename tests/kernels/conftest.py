import os

# The interpreter must be chosen before triton is imported: every kernel test runs the real
# Triton code on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
