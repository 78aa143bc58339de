"""A norm's output kept as the call that made it (`accel_kernels.ops.rms_norm.outputs_recomputed`):
the consumers inside the scope save the norm call instead of its output, and their backward gets
the output computed again, once, bit for bit."""
import gc

import pytest
import torch

import accel_kernels._dispatch as dispatch
import accel_kernels._launch as _launch
import accel_kernels.ops.rms_norm as module
from accel_kernels import _library, rms_norm
from accel_kernels.bench.memory import LiveBytes

# the outputs as the allocator makes them: the guard fixture makes them views of a guarded buffer
pytestmark = pytest.mark.usefixtures("unguarded_outputs")


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """These tests' outputs are a few hundred bytes: under the size the scope opens for."""
    monkeypatch.setattr(module, "RECOMPUTE_MIN_BYTES", 0)


def _inputs(device, dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(6, 32, device=device, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(32, device=device, dtype=dtype)).requires_grad_()
    a = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(32, 8, device=device, dtype=dtype, requires_grad=True)
    return x, w, a, b


def _consume(y, a, b):
    """Consumers that save y whole, through a 3-D view, a slice at an offset and a transpose."""
    return ((y @ a).sum() + (y.unsqueeze(0) @ b).square().sum() + (y[2:] @ b).sum()
            + (a.t() @ y.t()).square().sum())


def _grads(device, recompute: bool, count: list, backwards: int = 1):
    x, w, a, b = _inputs(device)
    y = rms_norm(x, w)
    scope = module.outputs_recomputed(y, lambda: count.append(1)) if recompute else None
    assert (scope is not None) == recompute
    if scope is None:
        loss = _consume(y, a, b)
    else:
        with scope:
            loss = _consume(y, a, b)
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return [t.grad for t in (x, w, a, b)]


def test_consumers_get_the_output_recomputed_once_and_the_gradients_bit_for_bit(device):
    count = []
    kept = _grads(device, False, [])
    with _launch.recording() as launched:
        recomputed = _grads(device, True, count)
    for k, r in zip(kept, recomputed):
        assert torch.equal(k, r)
    assert count == [1]  # four consumers, one recompute
    # the forward's launch and the backward's recompute; then the norm's own backward
    assert launched.count("_rms_norm_fwd_kernel") == 2


def test_the_output_is_not_held_after_the_forward(device, monkeypatch):
    """The scope's consumers hold the call, not the output: the forward leaves y's bytes fewer."""
    monkeypatch.setattr(_library, "_dispatch_modes", lambda: 0)  # the eager path under LiveBytes
    held = {}
    for recompute in (False, True):
        x, w, a, b = _inputs(device)
        with LiveBytes([x, w, a, b]) as live:
            y = rms_norm(x, w)
            nbytes = y.nbytes
            scope = module.outputs_recomputed(y) if recompute else None
            with scope if scope is not None else torch.enable_grad():
                loss = _consume(y, a, b)
            del y
            gc.collect()  # Triton's interpreter holds a launch's arguments in a reference cycle
            held[recompute] = live.live
        loss.backward()
    assert held[False] - held[True] == nbytes, held


def test_a_retained_graph_recomputes_for_each_backward(device):
    count = []
    once = _grads(device, False, [])
    twice = _grads(device, True, count, backwards=2)
    for o, t in zip(once, twice):
        assert torch.equal(2 * o, t)
    assert count == [1, 1]


def test_a_backward_through_some_consumers_only(device):
    x, w, a, b = _inputs(device)
    y = rms_norm(x, w)
    with module.outputs_recomputed(y):
        first, second = (y @ a).sum(), (y @ b).sum()
    (ga,) = torch.autograd.grad(first, [a])
    assert torch.equal(ga, torch.autograd.grad((rms_norm(x, w) @ a).sum(), [a])[0])
    second.backward()
    assert torch.equal(b.grad, torch.autograd.grad((rms_norm(x, w) @ b).sum(), [b])[0])


@pytest.mark.parametrize("written", ["the output", "the norm's input"])
def test_a_write_after_the_save_raises_as_autograd_does(device, written):
    x, w, a, _ = _inputs(device)
    h = x * 1
    y = rms_norm(h, w)
    with module.outputs_recomputed(y):
        loss = (y @ a).sum()
    with torch.no_grad():
        (y if written == "the output" else h).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_output_modified_before_the_scope_is_saved_as_it_is(device):
    count = []
    x, w, a, _ = _inputs(device)
    y = rms_norm(x, w)
    with torch.no_grad():  # its node stays the norm's; its version is 1
        y.mul_(2)
    with module.outputs_recomputed(y, lambda: count.append(1)):
        loss = (y @ a).sum()
    loss.backward()
    assert count == []
    assert torch.equal(a.grad, y.detach().t() @ torch.ones(6, 16, dtype=y.dtype, device=device))


def test_a_norm_inside_the_scope_keeps_its_own_rstd(device):
    """A norm of the output inside the scope: its x (the output) is kept as the first call, its
    rstd (output 1 of its own call, which it saves) as it is. Three recomputes: the second norm's
    output for the matmul, which reads the first's, and the first's again for the second norm's
    own backward (the first was dropped once its one saved tensor had it)."""
    count = []
    results = []
    for recompute in (False, True):
        x, w, a, _ = _inputs(device)
        y = rms_norm(x, w)
        scope = module.outputs_recomputed(y, lambda: count.append(1)) if recompute else None
        with scope if scope is not None else torch.enable_grad():
            loss = (rms_norm(y, w) @ a).square().sum()
        loss.backward()
        results.append([x.grad, w.grad, a.grad])
    for k, r in zip(*results):
        assert torch.equal(k, r)
    assert count == [1, 1, 1]


def test_stands_aside_where_it_cannot_apply(device, monkeypatch):
    x, w, a, _ = _inputs(device)
    y = rms_norm(x, w)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # checkpointing's, a user's
        assert module.outputs_recomputed(y) is None
    with torch.no_grad():
        assert module.outputs_recomputed(y) is None
    assert module.outputs_recomputed(x * 1) is None  # no norm's output
    freed = rms_norm(x, w)
    freed.sum().backward()  # the norm's saved tensors are gone: nothing to recompute from
    assert module.outputs_recomputed(freed) is None
    y32 = rms_norm(x.float(), w.float())
    with torch.autocast(device.type, dtype=torch.bfloat16):  # consumers save their bf16 casts of it
        assert module.outputs_recomputed(y32) is None
        assert module.outputs_recomputed(y32, saved_as_is=True) is not None  # a fused LoRA function's x
    monkeypatch.setattr(module, "RECOMPUTE_MIN_BYTES", y.nbytes + 1)  # too few bytes to pay
    assert module.outputs_recomputed(y) is None
    monkeypatch.setattr(module, "RECOMPUTE_MIN_BYTES", y.nbytes)
    assert module.outputs_recomputed(y) is not None
    monkeypatch.setattr(module, "RECOMPUTE_OUTPUTS", False)
    assert module.outputs_recomputed(y) is None


@pytest.mark.parametrize("release", ["storage freed", "zero-3 parameter"])
def test_stands_aside_where_the_weight_may_be_gone_by_the_backward(device, release):
    """An FSDP unit of the norm alone frees its gathered weight after the norm's forward; ZeRO-3
    releases a parameter after each module's forward: the recompute could not read it."""
    x, w, a, _ = _inputs(device)
    weight = torch.nn.Parameter(w.detach().clone())
    if release == "zero-3 parameter":
        weight.ds_id = 0  # what DeepSpeed marks its partitioned parameters with
    y = rms_norm(x, weight)
    if release == "storage freed":
        assert module.outputs_recomputed(y) is not None
        weight.untyped_storage().resize_(0)
    assert module.outputs_recomputed(y) is None


@pytest.mark.parametrize("call", ["gated", "twin"])
def test_outputs_the_kernel_cannot_recompute_are_saved_as_they_are(device, monkeypatch, call):
    count = []
    x, w, a, _ = _inputs(device)
    if call == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
        y = rms_norm(x, w)
    else:
        y = rms_norm(x, w, gate=torch.randn_like(x), activation="silu")
    scope = module.outputs_recomputed(y, lambda: count.append(1))
    with scope:
        loss = (y @ a).sum()
    loss.backward()
    assert count == []
    assert torch.equal(a.grad, y.detach().t() @ torch.ones(6, 16, dtype=y.dtype, device=device))
