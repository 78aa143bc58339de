"""cross_entropy against a float64 reference: loss and gradient of logits, every dtype and reduction.

Shapes stay small: on CPU the Triton interpreter runs one Python program per row.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import accel_kernels._dispatch as dispatch
import accel_kernels._launch as launch
import accel_kernels.ops.cross_entropy as ce_module
from _quick import matrix
from accel_kernels import cross_entropy

from _checks import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]


def _capped(z: torch.Tensor, softcap):
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _loss_and_grad(fn, logits, grad_output):
    """(loss, d(loss . grad_output)/d logits) of fn(logits) for a leaf copy of logits."""
    x = logits.detach().clone().requires_grad_()
    loss = fn(x)
    loss.backward(grad_output.to(loss.dtype))
    return loss.detach(), x.grad


def _reference(logits, labels, grad_output, ignore_index=-100, softcap=None, reduction="mean"):
    """float64 on CPU, torch's own ops; "mean" of an all-ignored batch defined as 0 like ours."""
    def fn(x):
        loss = F.cross_entropy(_capped(x, softcap).reshape(-1, x.shape[-1]), labels.cpu().reshape(-1).long(),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.view(labels.shape) if reduction == "none" else loss
    return _loss_and_grad(fn, logits.detach().cpu().double(), grad_output.cpu().double())


def _stock(logits, labels, grad_output, ignore_index=-100, softcap=None, reduction="mean"):
    """Eager torch in the logits' own dtype and device: what the error bound is measured against."""
    def fn(x):
        loss = F.cross_entropy(_capped(x, softcap).reshape(-1, x.shape[-1]), labels.reshape(-1).long(),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.view(labels.shape) if reduction == "none" else loss
    return _loss_and_grad(fn, logits, grad_output)


def _ours(logits, labels, grad_output, **kw):
    return _loss_and_grad(lambda x: cross_entropy(x, labels, **kw), logits, grad_output)


def _grad_output(labels, reduction, device):
    if reduction == "none":
        return torch.rand(labels.shape, device=device) + 0.5
    return torch.tensor(1.7, device=device)  # not 1: the backward must scale by it


def _check(logits, labels, dtype, what="", **kw):
    reduction = kw.get("reduction", "mean")
    go = _grad_output(labels, reduction, logits.device)
    loss, grad = _ours(logits, labels, go, **kw)
    ref_loss, ref_grad = _reference(logits, labels, go, **kw)
    stock_loss, stock_grad = (None, None) if dtype == torch.float32 else _stock(logits, labels, go, **kw)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    assert_close(loss, ref_loss, dtype, stock=stock_loss, what=f"loss {what}")
    assert_close(grad, ref_grad, dtype, stock=stock_grad, what=f"grad logits {what}")


@pytest.mark.parametrize("dtype, reduction", matrix(
    DTYPES, REDUCTIONS, quick=lambda dtype, reduction: dtype == torch.float32 or reduction == "mean"))
def test_matches_float64_over_several_blocks(device, dtype, reduction, monkeypatch):
    # vocab 1000 in blocks of 256: four blocks, the last one ragged; leading dims (B, S); some ignored
    monkeypatch.setattr(ce_module, "MAX_BLOCK", 256)
    logits = (torch.randn(2, 5, 1000, device=device) * 3).to(dtype)
    labels = torch.randint(0, 1000, (2, 5), device=device)
    labels[0, 1] = labels[1, 3] = -100
    _check(logits, labels, dtype, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(device, dtype, reduction):
    logits = (torch.randn(7, 333, device=device) * 20).to(dtype)  # large enough for the cap to bend them
    labels = torch.randint(0, 333, (7,), device=device)
    labels[2] = -100
    _check(logits, labels, dtype, softcap=5.0, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_above_64k(device, dtype):
    vocab = 70001  # several blocks of the default size; not a power of two
    logits = (torch.randn(3, vocab, device=device) * 4).to(dtype)
    labels = torch.tensor([0, vocab - 1, 12345], device=device)
    _check(logits, labels, dtype)
    _check(logits, labels, dtype, softcap=30.0, reduction="none")


def test_single_row(device):
    logits = torch.randn(77, device=device)  # shape (V,) with a 0-dim label
    labels = torch.tensor(5, device=device)
    for reduction in REDUCTIONS:
        _check(logits, labels, torch.float32, reduction=reduction)
    _check(logits[None], labels[None], torch.float32)


def test_custom_ignore_index_and_int32_labels(device):
    logits = torch.randn(9, 50, device=device)
    labels = torch.randint(0, 50, (9,), device=device, dtype=torch.int32)
    labels[[1, 4]] = 7  # class 7 is ignored, -100 would be out of range
    _check(logits, labels, torch.float32, ignore_index=7, reduction="none")
    _check(logits, labels, torch.float32, ignore_index=7)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_loss_and_gradient(device, reduction):
    logits = torch.randn(2, 3, 40, device=device, requires_grad=True)
    labels = torch.full((2, 3), -100, device=device)
    loss = cross_entropy(logits, labels, reduction=reduction)
    loss.sum().backward()
    assert torch.equal(loss.detach(), torch.zeros_like(loss))  # "mean" too: 0, not 0/0 = NaN
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_noncontiguous_logits_and_labels(device):
    big = torch.randn(2, 4, 130, device=device) * 3
    labels = torch.randint(0, 120, (2, 6), device=device)[:, ::2]  # strided labels (2, 3)
    labels[1, 2] = -100
    cases = {
        "shifted (two row strides)": big[:, :-1, :],
        "vocab slice (row stride > V)": big[:, 1:, :120],
        "columns strided (transposed storage)": torch.randn(120, 3, 2, device=device).permute(2, 1, 0),
    }
    for what, logits in cases.items():
        assert not logits.is_contiguous()
        _check(logits, labels, torch.float32, what=what, softcap=2.0, reduction="none")


def test_callers_logits_not_modified(device):
    logits = torch.randn(6, 300, device=device, requires_grad=True)
    before = logits.detach().clone()
    labels = torch.randint(0, 300, (6,), device=device)
    cross_entropy(logits, labels, softcap=10.0).backward()
    assert torch.equal(logits.detach(), before)
    assert not torch.equal(logits.grad, before)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_plain_torch_path_agrees_with_triton(device, reduction, monkeypatch):
    logits = torch.randn(2, 4, 500, device=device) * 8
    labels = torch.randint(0, 500, (2, 4), device=device)
    labels[1, 0] = -100
    go = _grad_output(labels, reduction, device)
    kw = dict(softcap=6.0, reduction=reduction)
    assert dispatch.use_triton(logits)  # GPU tensors, or CPU tensors under the interpreter
    with launch.recording() as launched:
        loss_t, grad_t = _ours(logits, labels, go, **kw)
    assert set(launched) == {"_ce_forward_kernel", "_ce_backward_kernel"}
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    with launch.recording() as launched:
        loss_p, grad_p = _ours(logits.cpu(), labels.cpu(), go.cpu(), **kw)
    assert launched == []
    torch.testing.assert_close(loss_p, loss_t.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_p, grad_t.cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad", [-1, 40, 1000])
def test_out_of_range_label_raises_on_cpu(bad):
    logits = torch.randn(4, 40)
    labels = torch.tensor([1, bad, -100, 3])
    with pytest.raises(ValueError, match=rf"labels contains {bad}.*V=40"):
        cross_entropy(logits, labels)


def test_non_finite_logits_with_good_labels_do_not_raise():
    # the CPU range check runs when a row's lse is not finite; NaN logits make one so, and the
    # labels, all in range, must pass it: a NaN loss, as eager gives, not a label error
    logits = torch.randn(4, 40)
    logits[2, 5] = float("nan")
    labels = torch.tensor([1, 39, 0, -100])
    loss = cross_entropy(logits, labels, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch"])
def test_out_of_range_label_gives_nan_without_host_check(device, triton_path):
    # What a GPU does, where no host check runs: NaN for that row, never a silent wrong loss.
    logits = torch.randn(4, 40, device=device, requires_grad=True)
    labels = torch.tensor([1, 40, -100, -3], device=device)
    # the op as the public function calls it, less the CPU range check (False: as on a GPU)
    op = torch.ops.accel_kernels.cross_entropy
    loss = op(logits, labels, -100, None, "none", False, triton_path)[0]
    loss.sum().backward()
    assert torch.isnan(loss[[1, 3]]).all() and torch.isfinite(loss[[0, 2]]).all()
    assert torch.isnan(logits.grad[[1, 3]]).all() and torch.isfinite(logits.grad[[0, 2]]).all()
    assert torch.isnan(op(logits, labels, -100, None, "mean", False, triton_path)[0])


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch"])
def test_the_forward_s_loss_and_gradient_keep_their_precision_next_to_a_large_max(device, triton_path):
    # Logits near 1e5 (an fp32 ulp there is 0.008): the loss and the gradient the forward writes
    # (the fused loss's chunks take theirs from it) come from (z - max) - log(sum) as eager's
    # log_softmax does; from the rounded lse = max + log(sum) they were 6e-4 (loss) and 2e-4
    # (gradient) off float64 here, where the bound is 1e-5.
    torch.manual_seed(0)
    x = (torch.randn(8, 257, device=device) + 1e5).float()
    labels = torch.randint(0, 257, (8,), device=device)
    ref = x.detach().cpu().double().requires_grad_()
    ref_loss = F.cross_entropy(ref, labels.cpu(), reduction="none")
    ref_loss.sum().backward()
    forward, _ = ce_module._row_functions(triton_path)
    loss, lse = torch.empty(8, device=device), torch.empty(8, 2, device=device)
    grad = torch.empty_like(x)
    with launch.recording() as launched:
        forward(x, labels, -100, None, loss, lse, grad=grad, scale=torch.ones(1, device=device))
    assert ("_ce_forward_kernel" in launched) == triton_path
    assert_close(loss, ref_loss, torch.float32, what="loss")
    assert_close(grad, ref.grad, torch.float32, what="forward's gradient")


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch"])
def test_the_backward_keeps_eager_s_precision_next_to_a_large_max(device, triton_path, monkeypatch):
    # The backward recomputes the softmax from what the forward saved of each row: its max and the
    # log of its sum apart, so (z - max) - log(sum) as eager. From one rounded fp32 lse the
    # gradient was 2e-4 off float64 at logits near 1e5 (eager: 1e-7), and four bf16 logits tied
    # at 3e38 got a gradient of 1 each instead of 1/4.
    if not triton_path:
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    torch.manual_seed(0)
    logits = (torch.randn(8, 257, device=device) + 1e5).float()
    labels = torch.randint(0, 257, (8,), device=device)
    labels[3] = -100
    with launch.recording() as launched:
        _check(logits, labels, torch.float32, reduction="sum")
        _check(logits, labels, torch.float32, reduction="none")
    assert ("_ce_backward_kernel" in launched) == triton_path
    tied = torch.full((1, 8), -1e38, device=device).to(torch.bfloat16)
    tied[0, :4] = 3e38
    x = tied.clone().requires_grad_()
    cross_entropy(x, torch.tensor([7], device=device), reduction="sum").backward()
    assert x.grad[0].tolist() == [0.25] * 4 + [0.0] * 3 + [-1.0], x.grad


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(labels=torch.zeros(4, 2, dtype=torch.long)), r"labels has shape \(4, 2\).*labels of shape \(4,\)"),
        (dict(labels=torch.zeros(4)), r"labels must be an integer tensor"),
        (dict(labels=torch.zeros(4, dtype=torch.bool)), r"labels must be an integer tensor"),
        (dict(logits=torch.zeros(4, 10, dtype=torch.long)), r"logits must be a floating-point tensor"),
        (dict(logits=torch.zeros(4, 0)), r"logits must have shape \(\.\.\., V\) with V >= 1"),
        (dict(reduction="avg"), r"reduction must be one of"),
        (dict(softcap=0.0), r"softcap must be a finite number > 0"),
        (dict(softcap=-3.0), r"softcap must be a finite number > 0"),
        (dict(softcap=float("nan")), r"softcap must be a finite number > 0"),
        (dict(softcap=float("inf")), r"softcap must be a finite number > 0"),
        (dict(ignore_index=1.5), r"ignore_index must be an int"),
        (dict(labels=torch.zeros(4, dtype=torch.long, device="meta")), r"labels is on meta"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    args = dict(logits=torch.randn(4, 10), labels=torch.zeros(4, dtype=torch.long))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        cross_entropy(**args)
