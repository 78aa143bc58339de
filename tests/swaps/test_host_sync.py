"""No swapped op waits for the device: the GPU path's host code (Triton's path chosen, every launch
a no-op, on CPU tensors: benchmarks/overhead.py's `launches_stubbed`) runs a whole training step
without one operation that synchronizes host and device on CUDA (a tensor read as a Python
number, a nonzero / masked_select / unique whose size the host must know, a repeat_interleave
without its output size, `.tolist()`). One such call per op and layer would stall the GPU's queue
dozens of times a step. Stock's own (transformers' padding-mask check) are not counted."""
from __future__ import annotations

import collections
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from accel_patch import report, swap_kernels

from _models import build, padded_batch

sys.path.insert(0, str(Path(__file__).resolve().parent / "experts"))
try:
    import _moe_models
finally:
    sys.path.pop(0)

ROOT = Path(__file__).resolve().parents[2]
OURS = (str(ROOT / "accel_patch") + os.sep, str(ROOT / "kernels" / "accel_kernels") + os.sep)
#: aten ops whose CUDA kernels make the host wait for the device
SYNCING = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2",
           "unique_consecutive", "unique_dim", "equal", "allclose", "bincount", "histc", "masked_scatter_",
           "index_put_", "repeat_interleave"}


#: Host code that runs only on CPU tensors (`labels.device.type == "cpu"`): the label range check,
#: which on a GPU is left to the kernels (a bad label's row gives NaN).
CPU_ONLY = {"_check_label_range", "_check_label_range_by_lse"}
#: This file's own frames around a read (the counting wrappers, the dispatch mode).
HARNESS = {"read", "__torch_dispatch__", "_caller"}


def _caller():
    """The innermost frame of Python code that is neither torch's nor this harness's: "path:line
    function" where it is this project's (or this file's: the test of the check puts its read
    here), else None (stock's: transformers, PEFT; and the CPU-only checks)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if f"{os.sep}torch{os.sep}" in path or (path == __file__ and frame.name in HARNESS):
            continue
        ours = (path.startswith(OURS) and frame.name not in CPU_ONLY) or path == __file__
        return f"{Path(path).relative_to(ROOT)}:{frame.lineno} {frame.name}" if ours else None
    return None


#: The project's custom-op namespaces: a dispatch mode sees such an op as one call, and its
#: implementation runs below the mode; the mode runs it again under itself to see inside.
NAMESPACES = ("accel_kernels", "accel_patch_lora")


class _Syncs(TorchDispatchMode):
    def __init__(self, found=None):
        super().__init__()
        self.found = collections.Counter() if found is None else found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES:
            from torch._library.custom_ops import OPDEFS

            with _Syncs(self.found):
                return OPDEFS[f"{func.namespace}::{func.__name__.split('.')[0]}"]._init_fn(*args, **kwargs)
        name = func.overloadpacket.__name__
        sized = name == "repeat_interleave" and kwargs.get("output_size") is not None
        if name in SYNCING and not sized:
            where = _caller()
            if where is not None:
                self.found[f"{name} at {where}"] += 1
        return func(*args, **kwargs)


def _syncs_in_a_step(model, autocast=False):
    """What in the second of two training steps would wait for the device, counted by place."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import overhead
    finally:
        sys.path.pop(0)
    reads = collections.Counter()  # what a dispatch mode does not see of CPU tensors: their values read

    def counted(name):
        plain = getattr(torch.Tensor, name)

        def read(tensor, *args):
            where = _caller()
            if where is not None:
                reads[f"{name} at {where}"] += 1
            return plain(tensor, *args)
        return read

    batch = padded_batch()

    def step():
        model.train()
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).loss
        loss.backward()

    with overhead.launches_stubbed():
        step()  # the first call's decisions (probes, timings) are allowed their reads
        with pytest.MonkeyPatch.context() as patch, _Syncs() as syncs:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
                patch.setattr(torch.Tensor, name, counted(name))
            step()
    return syncs.found + reads


def test_a_lora_step_under_autocast_and_a_moe_step_under_checkpointing_never_wait_for_the_device():
    lora = get_peft_model(build("llama"), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05,
                                                     target_modules="all-linear"))
    swap_kernels(lora)
    moe = _moe_models.build("qwen3_moe")
    moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe = get_peft_model(moe, LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"))
    swap_kernels(moe)
    assert _syncs_in_a_step(lora, autocast=True) == {}
    assert _syncs_in_a_step(moe) == {}
    # the steps ran the swapped ops (the kernels' host code), not their fall-backs
    for model, ops in ((lora, ("lora_qkv", "lora_o", "lora_mlp", "rope", "fused_linear_cross_entropy")),
                       (moe, ("lora_qkv", "lora_o", "rope", "fused_linear_cross_entropy"))):
        for op in ops:
            assert set(report(model).calls[op]) == {"fused"}, (op, report(model).calls[op])
    assert set(report(moe).calls["experts"]) == {"fused (LoRA)"}, report(moe).calls["experts"]


@pytest.mark.parametrize("where", ["rms_norm", "experts"])
def test_a_read_of_a_device_value_in_a_kernel_s_host_code_is_found(monkeypatch, where):
    # the check itself: a .item() put into RMSNorm's or the experts' host path is reported with
    # its place, so the test above cannot pass by seeing nothing
    from accel_kernels.ops import moe_experts, rms_norm

    module, name = (rms_norm, "_forward_triton") if where == "rms_norm" else (moe_experts, "_route")
    plain = getattr(module, name)

    def reading(*args, **kwargs):
        args[0].sum().item()
        return plain(*args, **kwargs)

    monkeypatch.setattr(module, name, reading)
    model = build("llama") if where == "rms_norm" else _moe_models.build("qwen3_moe")
    swap_kernels(model)
    found = _syncs_in_a_step(model)
    assert found and all("at tests/swaps/test_host_sync.py" in k and "reading" in k for k in found), found
