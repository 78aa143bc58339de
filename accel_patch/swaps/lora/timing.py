"""Fused or PEFT's forward, timed on the device: a fused LoRA call never runs slower than PEFT's.

The fused functions do PEFT's arithmetic in fewer passes, but whether one call of them is faster
than PEFT's layers depends on the device, the shape and the settings (autocast, dropout, the
adapters' dtype) more than a model written here can say: at a few hundred tokens the host work of
either path is most of its time, at thousands the bytes are. So on a CUDA device the first eager
call of each call shape (`_key`: the group, the input's dtype, width and layout, its rows rounded
up to a power of two, each projection's kind, shapes, dtypes, dropout and autocast, the adapters'
shapes, dtypes and which need a gradient) runs a forward and a backward of both on the side
(`_seconds`) and every later call of that shape runs the faster, counted:

- "fused (timed: fused 1.31 ms, peft 1.52 ms)" at the call that timed, "fused" after it;
- "faster unfused: PEFT's forward (timed: ...)" at the call that timed, "faster unfused: PEFT's
  forward (timed)" after it: by design, not a fall-back (swaps/report.py). Such a call keeps
  PEFT's activations for backward, as stock does: the fused path's memory saving is given up for
  that shape, never exceeded.

The side runs change nothing the step sees (accel_kernels._timing): the input detached, the
adapters' gradients returned by `torch.autograd.grad` and dropped (never accumulated into `.grad`;
a gradient hook on an adapter stops the timing, since it would fire), their own saved-tensor hooks
(a checkpoint or the norm recompute around the call sees none of their saves), the global RNG
restored after them (their dropout draws leave the call's own masks as they would have been), and
no call of a site beneath counted (`sites.uncounted`). PEFT's side runs call its modules: where a
global module hook is registered (a module tracker) nothing is timed, as it would see them.

Not timed, and the call runs fused: off CUDA (the fused functions run plain torch ops there; the
tests add the CPU), while torch.compile or torch.jit traces, inside a backward (a reentrant
checkpoint's recompute), during CUDA-graph capture, under a TorchDispatchMode or a functorch
transform, with saved-tensor hooks disabled, on tensor subclasses, without grad, past
TIMED_SHAPES shapes, and where ACCEL_PATCH_LORA_PATH=fused (every reproducible call fused,
untimed: a run that must repeat another's rounding, or one that wants the memory first).
"""
from __future__ import annotations

import torch

from accel_kernels import _launch, _timing

from .. import sites

FUSED = "fused"
PEFT = "peft"
#: The device types whose calls are timed (CUDA; tests add the CPU).
TIMED_DEVICE_TYPES = ("cuda",)
#: How many call shapes keep a timed answer; a call of a further shape runs fused.
TIMED_SHAPES = 64
#: Timed rounds per path, after one untimed run each: the best counts.
TIMED_ROUNDS = _timing.ROUNDS
#: The switch: "auto" (unset or blank: timed where the device is timed) or "fused" (never timed).
PATH_SWITCH = "ACCEL_PATCH_LORA_PATH"
PATHS = ("auto", "fused")
#: The outcome of a call that runs PEFT's forward because it was timed faster at its shape.
FASTER_UNFUSED = "faster unfused: PEFT's forward"

_timed: dict = {}


def path_mode(environ=None) -> str:
    """ACCEL_PATCH_LORA_PATH: "auto" (unset or blank) or "fused"; any other value raises
    core.switches.BadSwitch naming the variable, its value and the valid ones."""
    from ...core import switches

    return switches.choice(PATH_SWITCH, PATHS, environ) or "auto"


def timed_calls() -> dict:
    """{call shape: Timing} of every call shape timed in this process (a copy)."""
    return dict(_timed)


def outcome(path: str, timing) -> str:
    """The count of a call that runs `path`: "fused" or FASTER_UNFUSED, with the figures of the
    call that timed them."""
    if path == FUSED:
        return FUSED if timing is None else f"{FUSED} ({timing.note()})"
    return f"{FASTER_UNFUSED} ({'timed' if timing is None else timing.note()})"


def choose(timed: bool, op: str, x: torch.Tensor, projs, adapters, fused, peft, extra=()):
    """(path, timing): FUSED or PEFT for this call of group `op`, and the Timing when this call
    timed them (else None). `fused` and `peft` take an input and return the group's outputs (a
    tuple): the fused function and PEFT's forward on it; `extra` adds what else decides the call's
    work (the MLP's activation and how it is computed). `timed`: the site's switch (`path_mode`)."""
    if not timed or x.device.type not in TIMED_DEVICE_TYPES or sites.compiling():
        return FUSED, None
    key = _key(op, x, projs, adapters, extra)
    known = _timed.get(key)
    if known is not None:
        return known.path, None
    if (len(_timed) >= TIMED_SHAPES or _global_module_hooks()
            or not _timing.side_runs_allowed([x, *adapters], x.device, adapters)):
        return FUSED, None
    timing = _time(x, adapters, fused, peft)
    _timed[key] = timing
    return timing.path, timing


def _key(op, x, projs, adapters, extra) -> tuple:
    """The call shape: read at every timed-device call, so made of what is cheap to read (a Proj's
    fields after its tensors: kind, compute dtype, adapted, scale, dropout, autocast, casts)."""
    shape = x.shape
    return (op, x.device, x.dtype, x.requires_grad, x.is_contiguous(), shape[-1],
            _launch.next_power_of_2(max(1, x.numel() // max(1, shape[-1]))),
            tuple([(p[2:], p.weight.shape, p.weight.dtype, p.bias is None) for p in projs]),
            tuple([a.shape for a in adapters]), tuple([a.requires_grad for a in adapters]),
            adapters[0].dtype, extra)


def _global_module_hooks() -> bool:
    """Whether a hook registered for every module would run in PEFT's side runs."""
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _time(x, adapters, fused, peft) -> _timing.Timing:
    """Both paths of one call, timed (accel_kernels._timing.best), the RNG restored and nothing
    counted around them."""
    generator = torch.Generator(device=x.device).manual_seed(0)
    with _timing.forked_rng(x.device), sites.uncounted():
        return _timing.best({FUSED: lambda: _seconds(FUSED, fused, x, adapters, generator),
                             PEFT: lambda: _seconds(PEFT, peft, x, adapters, generator)}, FUSED, TIMED_ROUNDS)


def _seconds(path, run, x, adapters, generator) -> float:
    """Seconds of one forward and backward of `run` (the `path` of `_time`) on a detached view of x,
    the device synchronized around each (the upstream gradients drawn between them, from
    `generator`, untimed)."""
    leaf = x.detach().requires_grad_(x.requires_grad)
    wants = ([leaf] if x.requires_grad else []) + [a for a in adapters if a.requires_grad]
    device = x.device
    with _timing.own_saves():
        _timing.synchronize(device)
        start = _timing.clock()
        outs = run(leaf)
        _timing.synchronize(device)
        seconds = _timing.clock() - start
        # a projection without an adapter on an input that needs no gradient (k of q/v-only LoRA on
        # the embeddings) gives an output with nothing to differentiate: PEFT's, not the fused one's
        outs = [o for o in outs if o.requires_grad]
        grads = [torch.randn(o.shape, generator=generator, device=device, dtype=torch.float32).to(o.dtype)
                 for o in outs]
        _timing.synchronize(device)
        start = _timing.clock()
        grads = torch.autograd.grad(outs, wants, grads, allow_unused=True)
        _timing.synchronize(device)
        seconds += _timing.clock() - start
    del outs, grads
    return seconds
