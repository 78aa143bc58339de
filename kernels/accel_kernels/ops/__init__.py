"""The op modules, one per op (swiglu and geglu share `_glu.py`), each in the order the package
docstring gives. Import the public functions from `accel_kernels`; this package exports nothing,
so `accel_kernels.ops.rms_norm` is always the module and `accel_kernels.rms_norm` the function.
"""
