"""Timing two ways of computing one call on the device, on the call's own inputs, to keep the faster.

Some choices between two correct computations depend on the device and the shape more than any
model written here can say (which backward the experts op runs; a fused LoRA function or PEFT's
layers). Where a call could run either, its first call of each call shape runs both on the side and
every later call of that shape runs the faster: a model that is wrong on some device costs one
timing, not every step.

A side run must change nothing the caller can see: it runs on detached views of the call's inputs
(the same storage, no copy) or takes gradients with `torch.autograd.grad` (returned and dropped,
never accumulated into `.grad`), under its own saved-tensor hooks (a checkpoint or offload around
the call sees none of its saves) and with the global RNG restored after it (`forked_rng`).
`side_runs_allowed` says where that holds; the callers add what is theirs (which device types
they time, their own switches). This module knows torch only.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections import namedtuple

import torch

from . import _library

#: Timed rounds per candidate, after one untimed run each (Triton compiles its kernels there, the
#: first cuBLAS call picks its algorithm): the best of the rounds counts.
ROUNDS = 2

clock = time.perf_counter


class Timing(namedtuple("Timing", "path ms errors")):
    """What timing the candidates of one call shape found: the path kept, each candidate's best
    milliseconds ({path: ms}, the ones that ran) and what each that raised said ({path: message})."""

    __slots__ = ()

    def note(self, what: str = "timed") -> str:
        """One line for a report: '<what>: triton 2.01 ms, grouped_mm 2.32 ms'."""
        parts = [f"{p} {ms:.3g} ms" for p, ms in self.ms.items()]
        parts += [f"{p} raised {message}" for p, message in self.errors.items()]
        return f"{what}: " + ", ".join(parts)


def side_runs_allowed(tensors, device: torch.device, graded=()) -> bool:
    """Whether a call on these tensors (None allowed) may run candidates on the side: with grad,
    something among them to differentiate, outside any backward (a reentrant checkpoint's
    recompute), no CUDA graph being captured, nothing that would see the side runs (a
    TorchDispatchMode, e.g. a FLOP counter; a functorch transform), plain tensors only, saved-tensor
    hooks enabled (the side runs push their own). `graded`: those of them whose gradients the side
    runs take themselves (not through detached views): none may carry a gradient hook, which
    `torch.autograd.grad` fires for a gradient it only returns."""
    present = [t for t in tensors if t is not None]
    return (torch.is_grad_enabled() and any(t.requires_grad for t in present)
            and torch._C._current_graph_task_id() == -1
            and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
            and not _library._dispatch_modes() and not _library._functorch_active()
            and all(type(t) in _library._PLAIN for t in present)
            and not any(t._backward_hooks for t in graded)
            and torch._C._autograd._saved_tensors_hooks_is_enabled())


def _keep(t):
    return t


def own_saves():
    """The side run's own saved-tensor hooks (identity), with grad on: a checkpoint, an offload or
    a recompute scope around the call sees none of the side run's saves."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_keep, _keep))
    stack.enter_context(torch.enable_grad())
    return stack


def forked_rng(device: torch.device):
    """The global RNG of the CPU and of `device` saved on entry and restored on exit: a side run's
    draws (dropout) leave the call's own draws as they would have been without it."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best(seconds: dict, rule: str, rounds: int = ROUNDS) -> Timing:
    """Time each candidate ({path: () -> seconds of one run}): one untimed run each, then `rounds`
    rounds alternating them, the best of each kept. The fastest is kept (the rule's on a tie); a
    candidate that raises (out of memory, say) is left out and said, and if all raise the rule stands."""
    ms, errors = {}, {}
    for round_ in range(rounds + 1):
        for path, run in seconds.items():
            if path in errors:
                continue
            try:
                taken = run()
            except Exception as error:  # noqa: BLE001 - left out of the choice, and said
                errors[path] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
                ms.pop(path, None)
                continue
            if round_:
                ms[path] = min(ms.get(path, math.inf), taken * 1e3)
    if not ms:
        return Timing(rule, ms, errors)
    fastest = min(ms.values())
    return Timing(rule if ms.get(rule) == fastest else min(ms, key=ms.get), ms, errors)
