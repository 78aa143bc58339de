"""fused_linear_cross_entropy against float64 references: loss and the gradients of hidden, weight
and bias, chunk boundaries, and the promise never to hold the full (N, V) logits.

Shapes stay small: on CPU the Triton interpreter runs one Python program per token.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import accel_kernels._dispatch as dispatch
import accel_kernels._launch as launch
import accel_kernels.ops.fused_linear_cross_entropy as flce_module
from _quick import matrix
from accel_kernels import fused_linear_cross_entropy
from accel_kernels.bench.memory import LiveBytes

from _checks import assert_close

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
REDUCTIONS = ["mean", "sum", "none"]


def _inputs(shape, hidden_size, vocab, dtype, device, bias=True, ignored=(), scale=0.5):
    hidden = torch.randn(*shape, hidden_size, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, device=device) * scale).to(dtype)
    b = (torch.randn(vocab, device=device) * scale).to(dtype) if bias else None
    labels = torch.randint(0, vocab, shape, device=device)
    labels.view(-1)[list(ignored)] = -100
    return hidden, weight, b, labels


def _grad_output(labels, reduction, device):
    if reduction == "none":
        return torch.rand(labels.shape, device=device) + 0.5
    return torch.tensor(1.7, device=device)  # not 1: the backward must scale by it


def _run(fn, hidden, weight, bias, grad_output):
    """(loss, grad hidden, grad weight, grad bias) of fn on leaf copies of the inputs."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    loss = fn(*leaves)
    loss.backward(grad_output.to(loss.dtype))
    return (loss.detach(), *[t.grad if t is not None else None for t in leaves])


def _eager(labels, ignore_index=-100, softcap=None, reduction="mean"):
    def fn(h, w, b):
        logits = h @ w.T if b is None else h @ w.T + b
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.to(h.device).reshape(-1).long(),
                               ignore_index=ignore_index, reduction=reduction)
        return loss.view(labels.shape) if reduction == "none" else loss
    return fn


def _reference(hidden, weight, bias, labels, grad_output, **kw):
    cpu64 = [t.detach().cpu().double() if t is not None else None for t in (hidden, weight, bias)]
    return _run(_eager(labels.cpu(), **kw), *cpu64, grad_output.cpu().double())


def _ours(hidden, weight, bias, labels, grad_output, chunk_size=None, **kw):
    return _run(lambda h, w, b: fused_linear_cross_entropy(h, w, labels, bias=b, chunk_size=chunk_size, **kw),
                hidden, weight, bias, grad_output)


def _check(hidden, weight, bias, labels, dtype, chunk_size=None, what="", **kw):
    go = _grad_output(labels, kw.get("reduction", "mean"), hidden.device)
    ours = _ours(hidden, weight, bias, labels, go, chunk_size=chunk_size, **kw)
    ref = _reference(hidden, weight, bias, labels, go, **kw)
    stock = [None] * 4 if dtype == torch.float32 else _run(_eager(labels, **kw), hidden, weight, bias, go)
    assert ours[0].dtype == torch.float32 and ours[0].shape == ref[0].shape
    for name, o, r, s, inp in zip(("loss", "grad hidden", "grad weight", "grad bias"), ours, ref, stock,
                                  (None, hidden, weight, bias)):
        if r is None:
            assert o is None, name
            continue
        if inp is not None:
            assert o.dtype == inp.dtype and o.shape == inp.shape, name
        assert_close(o, r, dtype, stock=s, what=f"{name} {what}")


@pytest.mark.parametrize("dtype, reduction", matrix(
    DTYPES, REDUCTIONS, quick=lambda dtype, reduction: dtype == torch.float32 or reduction == "mean"))
def test_matches_float64_across_chunks(device, dtype, reduction):
    # 2 x 9 = 18 tokens in chunks of 8: 8 + 8 + 2, the last chunk ragged; vocab not a power of two
    hidden, weight, bias, labels = _inputs((2, 9), 32, 500, dtype, device, ignored=(3, 9, 10))
    _check(hidden, weight, bias, labels, dtype, chunk_size=8, reduction=reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_without_bias(device, dtype, reduction):
    hidden, weight, bias, labels = _inputs((11,), 24, 300, dtype, device, bias=False, ignored=(5,), scale=3.0)
    _check(hidden, weight, None, labels, dtype, chunk_size=8, softcap=4.0, reduction=reduction)


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_any_chunk_size(device, chunk_size):
    hidden, weight, bias, labels = _inputs((7,), 16, 200, torch.float32, device, ignored=(0,))
    _check(hidden, weight, bias, labels, torch.float32, chunk_size=chunk_size, what=f"chunk {chunk_size}")


def test_vocab_above_64k(device):
    hidden, weight, bias, labels = _inputs((3,), 8, 70001, torch.float32, device)
    labels[0] = 70000
    _check(hidden, weight, bias, labels, torch.float32, softcap=20.0)


def test_custom_ignore_index(device):
    hidden, weight, bias, labels = _inputs((9,), 16, 64, torch.float32, device)
    labels[[2, 6]] = 3  # class 3 is ignored
    _check(hidden, weight, bias, labels, torch.float32, chunk_size=4, ignore_index=3)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_gives_zero_loss_and_gradients(device, reduction):
    hidden, weight, bias, labels = _inputs((2, 5), 8, 30, torch.float32, device, ignored=range(10))
    loss, gh, gw, gb = _ours(hidden, weight, bias, labels, _grad_output(labels, reduction, device), chunk_size=4,
                             reduction=reduction)
    for t in (loss, gh, gw, gb):
        assert torch.equal(t, torch.zeros_like(t))  # "mean" too: 0, not 0/0 = NaN


@pytest.mark.parametrize("way", ["fp32 sum", "vocab blocks", "dtype sum", "twin"])
def test_a_sum_over_no_token_has_zero_gradients_whatever_grad_output(device, way, monkeypatch):
    # transformers' mean of an all-ignored batch is `sum / 0` (a NaN loss, as stock's) and hands the
    # backward an infinite grad_output; stock's nll_loss writes no term for an ignored token, so its
    # gradients stay zero and the optimizer step harms nothing. Scaling saved zeros by inf gave NaN
    # gradients here, which that step writes into every weight.
    if way == "vocab blocks":
        _weight_pass_always(monkeypatch, 16 * 30 * 4)
    elif way == "dtype sum":
        _weight_sum_in_dtype(monkeypatch, 8)
    elif way == "twin":
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    dtype = torch.bfloat16 if way == "dtype sum" else torch.float32
    hidden, weight, bias, labels = _inputs((2, 5), 8, 30, dtype, device, ignored=range(10))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    for n_items in (0, torch.tensor(0, device=device)):  # a count of 0 tokens: Python's or a tensor
        total = fused_linear_cross_entropy(*leaves[:2], labels, bias=leaves[2], reduction="sum", chunk_size=4)
        loss = total / n_items if isinstance(n_items, torch.Tensor) else total * float("inf")
        assert torch.isnan(loss)  # as stock's
        loss.backward()
        for name, t in zip(("hidden", "weight", "bias"), leaves):
            assert torch.equal(t.grad, torch.zeros_like(t)), f"grad {name} ({way}): {t.grad.isnan().sum()} NaN"
            t.grad = None


def test_gradients_only_for_inputs_that_require_them(device):
    hidden, weight, bias, labels = _inputs((6,), 8, 40, torch.float32, device)
    for reduction in REDUCTIONS:
        h = hidden.clone().requires_grad_()  # weight and bias frozen, as under LoRA
        fused_linear_cross_entropy(h, weight, labels, bias=bias, reduction=reduction, chunk_size=4).sum().backward()
        go = torch.ones(6, device=device) if reduction == "none" else torch.tensor(1.0, device=device)
        ref = _reference(hidden, weight, bias, labels, go, reduction=reduction)
        assert_close(h.grad, ref[1], torch.float32, what=f"grad hidden ({reduction}, frozen weight)")
    assert not fused_linear_cross_entropy(hidden, weight, labels, bias=bias).requires_grad


def _weight_pass_always(monkeypatch, tile_bytes):
    """Every call takes the weight's own pass over vocabulary blocks, through tiles of tile_bytes."""
    monkeypatch.setattr(flce_module, "WEIGHT_FP32_BYTES", 0)
    monkeypatch.setattr(flce_module, "TORCH_WEIGHT_FP32_BYTES", 0)
    monkeypatch.setattr(flce_module, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(flce_module, "TORCH_CHUNK_BYTES", tile_bytes)


# quick: each reduction in fp32 over token chunks, each dtype's mean over one of the two tilings
@pytest.mark.parametrize("dtype, reduction, tiles", matrix(
    DTYPES, REDUCTIONS, ["all tokens", "token chunks"], quick=lambda dtype, reduction, tiles: (
        (dtype == torch.float32 and tiles == "token chunks")
        or (reduction == "mean" and (tiles == "all tokens") == (dtype != torch.float16)))))
def test_weight_pass_matches_float64(device, dtype, reduction, tiles, monkeypatch):
    tile_tokens = 18 if tiles == "all tokens" else 8
    # blocks of 64 vocabulary rows over 500 (labels land in different blocks, the last block is
    # ragged); a tile of every token (grad W of a block in one matmul) or of 8 (summed in fp32)
    _weight_pass_always(monkeypatch, tile_tokens * 64 * 4)
    hidden, weight, bias, labels = _inputs((2, 9), 32, 500, dtype, device, ignored=(3, 9, 10), scale=2.0)
    _check(hidden, weight, bias, labels, dtype, chunk_size=8, softcap=15.0, reduction=reduction,
           what=f"tile of {tile_tokens} tokens")


def _weight_sum_in_dtype(monkeypatch, chunks):
    """Above a zero fp32 budget, the weight's gradient summed in its own dtype over at most `chunks`
    token chunks (WEIGHT_DTYPE_SUM_CHUNKS), on the Triton path; a record of the way each call took
    to it: "dtype sum" (the forward's pass, in the weight's dtype) or "vocab blocks"."""
    monkeypatch.setattr(flce_module, "WEIGHT_FP32_BYTES", 0)
    monkeypatch.setattr(flce_module, "WEIGHT_DTYPE_SUM_CHUNKS", chunks)
    taken = []
    chunked, blocks = flce_module._chunked_pass, flce_module._weight_pass

    def chunked_pass(*args, w_sum_dtype=torch.float32, **kw):
        if kw["need_w"] and w_sum_dtype != torch.float32:
            taken.append("dtype sum")
        return chunked(*args, w_sum_dtype=w_sum_dtype, **kw)

    def weight_pass(*args, **kw):
        taken.append("vocab blocks")
        return blocks(*args, **kw)

    monkeypatch.setattr(flce_module, "_chunked_pass", chunked_pass)
    monkeypatch.setattr(flce_module, "_weight_pass", weight_pass)
    return taken


@pytest.mark.parametrize("chunk_size, way", [(8, "dtype sum"), (2, "dtype sum"), (1, "vocab blocks")],
                         ids=["3 chunks", "8 chunks", "16 chunks"])
@pytest.mark.parametrize("dtype, reduction", matrix(
    [torch.bfloat16, torch.float16], ["mean", "sum"],
    quick=lambda dtype, reduction: dtype == torch.bfloat16 and reduction == "mean"))
def test_weight_sum_in_its_dtype_matches_float64_up_to_its_chunk_limit(device, dtype, reduction, chunk_size, way,
                                                                      monkeypatch):
    # 16 tokens: chunks of 8 and 2 (3 and 8 roundings of each weight-gradient element, the limit)
    # sum in the weight's dtype within the bound of eager's error; chunks of 1 (16) take the pass
    # over vocabulary blocks instead
    taken = _weight_sum_in_dtype(monkeypatch, 8)
    hidden, weight, bias, labels = _inputs((2, 8), 32, 500, dtype, device, ignored=(3, 9, 10), scale=2.0)
    _check(hidden, weight, bias, labels, dtype, chunk_size=chunk_size, softcap=15.0, reduction=reduction,
           what=f"chunks of {chunk_size}")
    assert taken == [way]


def test_weight_sum_in_its_dtype_is_off_by_default_and_never_on_the_plain_torch_path(device, monkeypatch):
    assert flce_module.WEIGHT_DTYPE_SUM_CHUNKS == 0
    assert not flce_module.weight_sum_in_dtype(8192, 1024, 128_256, 4096, torch.bfloat16, triton_path=True)
    monkeypatch.setattr(flce_module, "WEIGHT_DTYPE_SUM_CHUNKS", 8)
    # the GPU benchmark's shape: 8 chunks of 1024 tokens (CHUNK_BYTES); 16 at twice the tokens
    rows = flce_module.chunk_rows(8192, 128_256, 2, flce_module.CHUNK_BYTES)
    assert flce_module.weight_sum_in_dtype(8192, rows, 128_256, 4096, torch.bfloat16, triton_path=True)
    assert not flce_module.weight_sum_in_dtype(16384, rows, 128_256, 4096, torch.bfloat16, triton_path=True)
    assert not flce_module.weight_sum_in_dtype(8192, rows, 128_256, 4096, torch.float32, triton_path=True)
    assert not flce_module.weight_sum_in_dtype(8192, rows, 128_256, 4096, torch.bfloat16, triton_path=False)
    assert not flce_module.weight_sum_in_dtype(8192, rows, 1000, 64, torch.bfloat16, triton_path=True)  # fp32 fits


def _two_backwards(leaves, labels, factor, chunk_size, keep_grad):
    """Two backwards of the loss of `leaves` (hidden, weight, bias) through a retained graph, each
    .grad worked on in place in between (a user, or gradient accumulation, does that to a tensor
    the first backward may have handed over), then kept for the second to add to or dropped; the
    first backward's gradients."""
    device = leaves[0].device
    loss = fused_linear_cross_entropy(*leaves[:2], labels, bias=leaves[2], chunk_size=chunk_size)
    loss.backward(torch.tensor(factor, device=device), retain_graph=True)
    first = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad.mul_(3.0)
        if not keep_grad:
            t.grad = None
    loss.backward(torch.tensor(factor, device=device))
    return first


@pytest.mark.parametrize("factor", [1.0, pytest.param(2.0, marks=pytest.mark.slow)])
def test_weight_sum_in_its_dtype_hands_over_and_a_second_backward_recomputes(device, factor, monkeypatch):
    # the forward's grad W and grad h, scaled in place and handed over by the first backward; a
    # second backward through the retained graph recomputes both (by the vocabulary pass), whatever
    # was done to .grad in between, and leaves the inputs alone
    taken = _weight_sum_in_dtype(monkeypatch, 8)
    hidden, weight, bias, labels = _inputs((10,), 8, 50, torch.bfloat16, device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    first = _two_backwards(leaves, labels, factor, 4, keep_grad=False)  # the second's .grad alone
    assert taken == ["dtype sum", "vocab blocks"]
    go = torch.tensor(factor, device=device)
    ref, stock = _reference(hidden, weight, bias, labels, go), _run(_eager(labels), hidden, weight, bias, go)
    for name, a, b, r, st in zip(("grad hidden", "grad weight", "grad bias"), first, leaves, ref[1:], stock[1:]):
        assert_close(a, r, torch.bfloat16, stock=st, what=f"{name}, first backward")
        assert_close(b.grad, r, torch.bfloat16, stock=st, what=f"{name}, second backward")
    for before, t in zip((hidden, weight, bias), leaves):
        assert torch.equal(before, t.detach())


@pytest.mark.parametrize("blocks", [False, True], ids=["fp32 sum", "vocab blocks"])
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_inputs_not_modified_and_second_backward_equal(device, factor, blocks, monkeypatch):
    if blocks:  # grad h handed over by the first backward: the second recomputes it
        _weight_pass_always(monkeypatch, 16 * 50 * 4)
    hidden, weight, bias, labels = _inputs((10,), 8, 50, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    first = _two_backwards(leaves, labels, factor, 3, keep_grad=True)
    for a, b in zip(first, leaves):
        torch.testing.assert_close(b.grad, 4.0 * a)  # the saved gradients were not touched
    for before, t in zip((hidden, weight, bias), leaves):
        assert torch.equal(before, t.detach())


@pytest.mark.parametrize("way", ["fp32 sum", "vocab blocks", "dtype sum"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_backward_scales_by_grad_output_in_float32_rounding_once(device, dtype, way, monkeypatch):
    # What the backward scales after the pass (the forward's grad h every way; its grad W where that
    # is summed in the weight's dtype) is read as float32, multiplied by grad_output and rounded once
    # into the gradient's dtype: grad(c * loss) == (grad(loss).float() * c).to(dtype) bit for bit.
    # c = 0.37 is no bf16 or fp16 number: rounded to the gradient's dtype before the product, some
    # bits differ.
    if way == "vocab blocks":
        _weight_pass_always(monkeypatch, 16 * 64 * 4)
    elif way == "dtype sum":
        taken = _weight_sum_in_dtype(monkeypatch, 8)
    hidden, weight, bias, labels = _inputs((10,), 8, 50, dtype, device, scale=2.0)
    ours = {c: _ours(hidden, weight, bias, labels, torch.tensor(c, device=device), chunk_size=4)
            for c in (1.0, 0.37)}
    scaled_after = ("grad hidden", "grad weight") if way == "dtype sum" else ("grad hidden",)
    for name, unit, scaled in zip(("grad hidden", "grad weight"), ours[1.0][1:3], ours[0.37][1:3]):
        if name in scaled_after:
            assert torch.equal(scaled, (unit.float() * 0.37).to(dtype)), f"{name}, {way}"
    if way == "dtype sum":
        assert taken == ["dtype sum", "dtype sum"]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_plain_torch_path_agrees_with_triton(device, reduction, monkeypatch):
    hidden, weight, bias, labels = _inputs((2, 5), 16, 250, torch.float32, device, ignored=(4,))
    go = _grad_output(labels, reduction, device)
    kw = dict(softcap=3.0, reduction=reduction, chunk_size=4)
    with launch.recording() as launched:
        triton_path = _ours(hidden, weight, bias, labels, go, **kw)
    assert launched and set(launched) <= {"_ce_forward_kernel", "_ce_backward_kernel"}
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)  # now the plain-torch twin
    with launch.recording() as launched:
        plain = _ours(*[t.cpu() for t in (hidden, weight, bias, labels, go)], **kw)
    assert launched == []
    for name, p, t in zip(("loss", "grad hidden", "grad weight", "grad bias"), plain, triton_path):
        torch.testing.assert_close(p, t.cpu(), rtol=1e-5, atol=1e-6, msg=name)


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor (in bytes) any torch op produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "accel_kernels":
            # an op of ours is one call here: run its implementation with this mode on, to see
            # every tensor made inside it (the CPU kernel of a custom op is its Python function)
            with self:
                return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.usefixtures("unguarded_outputs")
@pytest.mark.parametrize("path, reduction, blocks", [
    pytest.param(path, reduction, blocks, id=f"{path}-{reduction}-{'vocab blocks' if blocks else 'fp32 sum'}",
                 marks=[pytest.mark.slow] if (path, reduction, blocks) == ("triton", "none", True) else [])
    for blocks in (False, True)
    for path, reduction in [("torch", r) for r in REDUCTIONS] + [("triton", "none"), ("triton", "mean")]])
def test_never_materialises_full_logits(device, path, reduction, blocks, monkeypatch):
    # the twin on CPU; the kernels where they run: GPU tensors, or CPU ones under the interpreter
    if path == "torch":
        device = torch.device("cpu")
        monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    assert dispatch.use_triton(torch.empty(0, device=device)) == (path == "triton")
    n, hidden_size, vocab = 64, 8, 300
    # The default chunking, with a budget of 16 tokens' logits (and the weight's own pass, when
    # blocks, with a tile of the same budget).
    monkeypatch.setattr(flce_module, "TORCH_CHUNK_BYTES" if path == "torch" else "CHUNK_BYTES", 16 * vocab * 4)
    if blocks:
        monkeypatch.setattr(flce_module, "TORCH_WEIGHT_FP32_BYTES" if path == "torch" else "WEIGHT_FP32_BYTES", 0)
        monkeypatch.setattr(flce_module, "TILE_BYTES", 16 * vocab * 4)
    hidden, weight, bias, labels = _inputs((n,), hidden_size, vocab, torch.float32, device)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with _LargestOutput() as spy:
        loss = fused_linear_cross_entropy(*leaves[:2], labels, bias=leaves[2], reduction=reduction)
        loss.sum().backward()
    assert spy.largest <= 16 * vocab * 4, f"a tensor of {spy.largest} bytes; full logits have {n * vocab * 4}"
    ref = _reference(hidden, weight, bias, labels, torch.ones(n, device=device) if reduction == "none" else torch.tensor(1.0, device=device),
                     reduction=reduction)
    assert_close(leaves[1].grad, ref[2], torch.float32, what="grad weight")


@pytest.mark.usefixtures("unguarded_outputs")
@pytest.mark.parametrize("reduction, grad_output", [("mean", 1.0), ("mean", 0.25), ("sum", 1.0)])
def test_forward_backward_holds_the_gradients_and_one_tile(reduction, grad_output, monkeypatch):
    # The GPU benchmark's shape (8192 tokens, hidden 4096, vocab 128256) with every dimension / 32,
    # in fp32 on the plain-torch path (bf16 on a CPU adds an fp32 copy of the weight that a GPU
    # does not make), the fp32 budget / 32**2 and a tile of all tokens by 64 vocabulary rows, half
    # of grad h's bytes as on the GPU (8192 x 2048 bf16). What a forward+backward may hold at its
    # peak: the two results (grad W (V, H) and grad h (N, H)), one tile of logits, and small
    # per-token vectors; a copy of grad h (instead of scaling the forward's in place) or the old
    # fp32 (V, H) sum with a scaled copy of it (2x this) exceed it.
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    n, hidden_size, vocab = 256, 128, 4008
    tile = 4 * n * 64
    monkeypatch.setattr(flce_module, "TORCH_CHUNK_BYTES", tile)
    monkeypatch.setattr(flce_module, "TORCH_WEIGHT_FP32_BYTES", flce_module.WEIGHT_FP32_BYTES >> 10)
    hidden, weight, _, labels = _inputs((n,), hidden_size, vocab, torch.float32, "cpu", bias=False, ignored=(5,))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    with LiveBytes(before=[*leaves, labels], into_ops=True) as held:
        loss = fused_linear_cross_entropy(*leaves, labels, reduction=reduction)
        loss.backward(torch.tensor(grad_output))
    results = 4 * (vocab * hidden_size + n * hidden_size)
    small = 64 * n  # lse, loss, labels by block, scales: a few per-token vectors
    assert results <= held.peak <= results + tile + small, (held.peak, results, tile)  # the results at least
    ref = _reference(hidden, weight, None, labels, torch.tensor(grad_output), reduction=reduction)
    assert_close(leaves[0].grad, ref[1], torch.float32, what="grad hidden")
    assert_close(leaves[1].grad, ref[2], torch.float32, what="grad weight")


def test_chunk_rows_fits_the_budget():
    assert flce_module.chunk_rows(10_000, 128_256, 2, 256 << 20) == 1024  # 1046 rounded down to tiles of 64
    assert flce_module.chunk_rows(100, 128_256, 2, 256 << 20) == 100
    assert flce_module.chunk_rows(10_000, 10**9, 4, 1 << 20) == 1


def test_the_weight_gradient_pass_follows_the_fp32_budget():
    # the GPU benchmark's head (an fp32 (V, H) sum of 2004 MiB): the weight's own pass, by blocks
    # of 2048 vocabulary rows over 8192 tokens (32 MiB of bf16 logits)
    assert flce_module.weight_grad_by_blocks(128_256, 4096, triton_path=True)
    assert flce_module.chunk_rows(128_256, 8192, 2, flce_module.TILE_BYTES) == 2048
    # CPU heads keep the fp32 sum, as the CPU time rule was measured: the e2e benchmark's (31 MiB)
    # and the kernel benchmark's (125 MiB)
    assert not flce_module.weight_grad_by_blocks(32_000, 256, triton_path=False)
    assert not flce_module.weight_grad_by_blocks(32_000, 1024, triton_path=False)


@pytest.mark.parametrize("bad", [-1, 30])
def test_out_of_range_label_raises_on_cpu(bad):
    hidden, weight, bias, labels = _inputs((4,), 8, 30, torch.float32, "cpu")
    labels[2] = bad
    with pytest.raises(ValueError, match=rf"labels contains {bad}.*V=30"):
        fused_linear_cross_entropy(hidden, weight, labels, bias=bias)


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "torch"])
def test_out_of_range_label_gives_nan_without_host_check(device, triton_path):
    # What a GPU does, where no host check runs: NaN loss, never a silent wrong one.
    hidden, weight, bias, labels = _inputs((4,), 8, 30, torch.float32, device)
    labels[2] = 30
    # the op as the public function calls it, less the CPU range check (False: as on a GPU)
    op = torch.ops.accel_kernels.fused_linear_cross_entropy
    loss = op(hidden, weight, bias, labels, -100, None, "none", 2, False, False, False, False, triton_path)[0]
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()
    h = hidden.clone().requires_grad_()
    op(h, weight, bias, labels, -100, None, "mean", 2, True, False, False, False, triton_path)[0].backward()
    assert torch.isnan(h.grad[2]).all() and torch.isfinite(h.grad[[0, 1, 3]]).all()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(weight=torch.randn(10, 6)), r"weight has shape \(10, 6\).*weight of shape \(V, 8\)"),
        (dict(weight=torch.randn(80)), r"weight has shape \(80,\)"),
        (dict(bias=torch.randn(9)), r"bias has shape \(9,\).*bias of shape \(10,\)"),
        (dict(bias=torch.randn(10, dtype=torch.float64)), r"bias has dtype torch.float64"),
        (dict(weight=torch.randn(10, 8, dtype=torch.bfloat16)), r"weight has dtype torch.bfloat16 but hidden"),
        (dict(hidden=torch.zeros(4, 8, dtype=torch.long)), r"hidden must be a floating-point tensor"),
        (dict(labels=torch.zeros(4, 1, dtype=torch.long)), r"labels has shape \(4, 1\).*labels of shape \(4,\)"),
        (dict(labels=torch.zeros(4)), r"labels must be an integer tensor"),
        (dict(reduction="max"), r"reduction must be one of"),
        (dict(softcap=0), r"softcap must be a finite number > 0"),
        (dict(chunk_size=0), r"chunk_size must be a positive int"),
        (dict(weight=torch.randn(10, 8, device="meta")), r"weight is on meta"),
    ],
)
def test_bad_input_names_the_argument(kwargs, message):
    args = dict(hidden=torch.randn(4, 8), weight=torch.randn(10, 8), labels=torch.zeros(4, dtype=torch.long),
                bias=None)
    # a good call of the same shapes first: the checks are decided once per shape and options,
    # and what can differ between such calls (a device) must still be named
    fused_linear_cross_entropy(**args)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(**args)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_weight_pass_under_compile_equals_eager(reduction, monkeypatch):
    # the backward formula that scales grad h in place and hands it over, traced by AOTAutograd
    monkeypatch.setattr(dispatch, "use_triton", lambda t: False)
    _weight_pass_always(monkeypatch, 16 * 300 * 4)
    hidden, weight, bias, labels = _inputs((40,), 16, 300, torch.float32, "cpu", ignored=(3,))
    go = _grad_output(labels, reduction, "cpu")

    def fn(h, w, b):
        return fused_linear_cross_entropy(h, w, labels, bias=b, reduction=reduction)

    torch._dynamo.reset()
    compiled = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), hidden, weight, bias, go)
    ref = _reference(hidden, weight, bias, labels, go, reduction=reduction)
    for name, c, e, r in zip(("loss", "grad hidden", "grad weight", "grad bias"), compiled,
                             _run(fn, hidden, weight, bias, go), ref):
        assert_close(c, r, torch.float32, what=f"{name} compiled")
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.slow
def test_weight_sum_in_its_dtype_under_compile_equals_eager(device, monkeypatch):
    # the forward op's grad W in the weight's dtype (its fake says so) and the backward formula that
    # scales it in place and hands it over, traced by AOTAutograd
    taken = _weight_sum_in_dtype(monkeypatch, 8)
    hidden, weight, bias, labels = _inputs((16,), 16, 300, torch.bfloat16, device, ignored=(3,))
    go = torch.tensor(0.5, device=device)

    def fn(h, w, b):
        return fused_linear_cross_entropy(h, w, labels, bias=b, chunk_size=4)

    torch._dynamo.reset()
    compiled = _run(torch.compile(fn, backend="aot_eager", fullgraph=True), hidden, weight, bias, go)
    eager = _run(fn, hidden, weight, bias, go)
    assert taken == ["dtype sum", "dtype sum"]
    for name, c, e in zip(("loss", "grad hidden", "grad weight", "grad bias"), compiled, eager):
        assert c.dtype == e.dtype
        torch.testing.assert_close(c, e, rtol=0, atol=0, msg=name)


@pytest.mark.usefixtures("unguarded_outputs")
def test_weight_sum_in_its_dtype_passes_opcheck(monkeypatch):
    # the fake implementation gives grad W the weight's dtype where the forward sums it so
    _weight_sum_in_dtype(monkeypatch, 8)
    h, w, b = (torch.randn(*shape).to(torch.bfloat16).requires_grad_() for shape in ((2, 3, 8), (30, 8), (30,)))
    labels = torch.tensor([[1, -100, 7], [29, 0, 3]])
    out = torch.ops.accel_kernels.fused_linear_cross_entropy(h, w, b, labels, -100, None, "mean", 4,
                                                              True, True, True, True, True)
    assert out[3].dtype == torch.bfloat16 and out[3].shape == w.shape
    torch.library.opcheck(torch.ops.accel_kernels.fused_linear_cross_entropy,
                          (h, w, b, labels, -100, None, "mean", 4, True, True, True, True, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
