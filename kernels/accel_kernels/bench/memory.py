"""Peak memory counted on any device: the bytes of tensor storage alive at once.

`LiveBytes` is a TorchDispatchMode that counts every storage the ops under it make, once, from
the op that made it until it is freed, and keeps the peak of their sum: what
torch.cuda.max_memory_allocated counts of a step's rise on a GPU, here on a CPU too. Only op
outputs are counted, never an op's own scratch (a CPU matmul's packing buffers, which a GPU's
cuBLAS does not make and the profiler's memory events would count). Used by the kernel tests'
memory bounds and by benchmarks/step_memory.py.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among those the ops under it make (`peak`;
    `at`: the op that reached it). Storages of the tensors in `before` are not counted.

    into_ops: run accel_kernels' custom ops (which a dispatch mode reaches as one op) below the
    mode, so that what their implementations allocate is counted as well."""

    def __init__(self, before=(), into_ops: bool = False):
        super().__init__()
        self.live = self.peak = 0
        self.at = ""
        self.into_ops = into_ops
        self.counted: dict = {}
        self.before = {t.untyped_storage().data_ptr() for t in before if t is not None}

    def _freed(self, key, size):
        self.live -= size
        self.counted.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.into_ops and func.namespace == "accel_kernels":
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.counted and key not in self.before:
                    self.counted[key] = size
                    self.live += size
                    if self.live > self.peak:
                        self.peak, self.at = self.live, str(func)
                    weakref.finalize(storage, self._freed, key, size)
        return out
