"""Fused LoRA or PEFT's forward, timed on the device (accel_patch/swaps/lora/timing.py): the faster
runs, each call shape is timed once, the side runs change nothing the step sees (its values, its
RNG, its gradients, its saved tensors, the other sites' counts), and where timing cannot be done
without being seen, or is switched off, every reproducible call runs fused untimed.

CUDA is the timed device; here the CPU is added to it (`timed_here`), the fused functions run their
plain-torch ops and PEFT its layers, as on a GPU."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from peft.tuners.lora.layer import Linear as LoraLinear
from torch.utils._python_dispatch import TorchDispatchMode

from accel_kernels import _timing
from accel_patch.swaps import report
from accel_patch.swaps.lora import plans, timing
from accel_patch.swaps.lora import sites as lora_sites

from _models import build, padded_batch, rel, training_step
from test_lora import all_calls, calls, peft_model

DROPOUT = 0.1
#: The tiny Llama's timed call shapes: q/k/v on the embeddings (no grad: frozen) and on a layer's
#: output (grad), o, the MLP.
SHAPES = 4


@pytest.fixture
def timed_here(monkeypatch):
    monkeypatch.setattr(timing, "TIMED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(timing, "_timed", {})


def seconds_with(monkeypatch, slow: str | None):
    """`timing._seconds` run for real, the `slow` path a second slower; the paths asked, in order."""
    asked, inner = [], timing._seconds

    def seconds(path, *args):
        asked.append(path)
        return inner(path, *args) + (1.0 if path == slow else 0.0)

    monkeypatch.setattr(timing, "_seconds", seconds)
    return asked


def seeded_step(model, seed=5):
    torch.manual_seed(seed)
    loss, grads, _ = training_step(model, padded_batch())
    return loss, grads, torch.get_rng_state()


@pytest.mark.parametrize("slow", ["peft", pytest.param("fused", marks=pytest.mark.slow)])
def test_the_faster_path_runs_and_each_call_shape_is_timed_once(timed_here, monkeypatch, slow):
    base = build("llama")
    stock = peft_model(base, "stock", lora_dropout=DROPOUT)
    twin = peft_model(base, "swap-then-peft", lora_dropout=DROPOUT)
    asked = seconds_with(monkeypatch, slow)
    loss0, grads0, _ = seeded_step(stock)
    loss1, grads1, _ = seeded_step(twin)
    assert rel(loss1, loss0) <= 1e-5 and grads1.keys() == grads0.keys()
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    timed = timing.timed_calls()
    assert len(timed) == SHAPES and asked == ["fused", "peft"] * (timing.TIMED_ROUNDS + 1) * SHAPES
    faster = "peft" if slow == "fused" else "fused"
    assert {t.path for t in timed.values()} == {faster}
    assert all(t.ms[slow] > 1000 > t.ms[faster] for t in timed.values())
    first = {op: dict(outcomes) for op, outcomes in calls(twin).items()}  # calls() is a live view
    figures = r" \(timed: fused [\d.e+]+ ms, peft [\d.e+]+ ms\)"
    plain, with_figures = (timing.FUSED, timing.FUSED + figures) if faster == "fused" else (
        timing.FASTER_UNFUSED + " (timed)", re.escape(timing.FASTER_UNFUSED) + figures)
    kind = "success" if faster == "fused" else "by design"
    for op, outcomes in first.items():
        assert sum(outcomes.values()) == 2, outcomes  # one count a call: a group's, not a projection's
        assert sum(1 for o in outcomes if re.fullmatch(with_figures, o)) == (2 if op == "lora_qkv" else 1), outcomes
        assert set(outcomes) - {plain} == {o for o in outcomes if re.fullmatch(with_figures, o)}, outcomes
        assert all(report.outcome_kind(o) == kind for o in outcomes)
    # the next step runs every shape's answer, untimed
    seeded_step(twin)
    assert len(asked) == 2 * (timing.TIMED_ROUNDS + 1) * SHAPES
    after = calls(twin)
    for op, outcomes in after.items():
        assert sum(outcomes.values()) == 4, outcomes
        assert outcomes[plain] == first[op].get(plain, 0) + sum(first[op].values())
        assert set(outcomes) == set(first[op]) | {plain}


def test_the_side_runs_leave_the_step_as_an_untimed_one_and_both_paths_really_ran(timed_here, monkeypatch):
    """Fused kept (PEFT's side runs a second slower), the RNG restored after the side runs' dropout,
    no gradient accumulated by them, none of their saves seen by the caller's hooks, no call of a
    site beneath counted: the step, its RNG after it, what it saved and the other sites' counts are an
    untimed twin's, bit for bit."""
    base = build("llama")
    twin = peft_model(base, "swap-then-peft", lora_dropout=DROPOUT)
    untimed = copy.deepcopy(twin)
    ran = {"fused": 0, "peft layer": 0}

    def counting(name, inner):
        def run(*args, **kwargs):
            ran[name] += 1
            return inner(*args, **kwargs)
        return run

    monkeypatch.setattr(lora_sites, "fused_mlp", counting("fused", lora_sites.fused_mlp))
    monkeypatch.setattr(lora_sites, "fused_linears", counting("fused", lora_sites.fused_linears))
    monkeypatch.setattr(LoraLinear, "forward", counting("peft layer", LoraLinear.forward))
    saved = []

    def step(model):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            return seeded_step(model)

    asked = seconds_with(monkeypatch, "peft")
    loss1, grads1, rng1 = step(twin)
    timed_saves, timed_ran = list(saved), dict(ran)
    monkeypatch.setattr(timing, "TIMED_DEVICE_TYPES", ())
    saved.clear()
    ran.update({"fused": 0, "peft layer": 0})
    loss0, grads0, rng0 = step(untimed)
    assert torch.equal(loss1, loss0) and torch.equal(rng1, rng0)
    assert grads1.keys() == grads0.keys() and all(torch.equal(grads1[n], g) for n, g in grads0.items())
    assert timed_saves == saved
    # both paths ran on the side, (rounds + 1) times each per shape; no PEFT layer ran in the step itself
    assert len(asked) == 2 * (timing.TIMED_ROUNDS + 1) * SHAPES and ran["peft layer"] == 0
    assert timed_ran["fused"] == ran["fused"] + (timing.TIMED_ROUNDS + 1) * SHAPES
    projections = {"lora_qkv": 3, "lora_o": 1, "lora_mlp": 3}
    layers_run = sum(projections[key[0]] for key in timing.timed_calls())
    assert timed_ran["peft layer"] == (timing.TIMED_ROUNDS + 1) * layers_run
    others = {op: o for op, o in all_calls(twin).items() if op not in projections}
    assert others and others == {op: o for op, o in all_calls(untimed).items() if op not in projections}


@pytest.mark.slow
def test_under_non_reentrant_checkpointing_the_recompute_runs_the_timed_answer(timed_here, monkeypatch):
    """transformers' default checkpointing: the layer's first forward times (the checkpoint sees none of
    the side runs' saves, and its RNG replay gets the masks the forward drew), the recompute inside
    the backward runs each shape's answer untimed; the step is an untimed twin's bit for bit."""
    twin = peft_model(build("llama"), "swap-then-peft", lora_dropout=DROPOUT)
    twin.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    untimed = copy.deepcopy(twin)
    asked = seconds_with(monkeypatch, "fused")  # PEFT's forward kept: the recompute must run it too
    loss1, grads1, rng1 = seeded_step(twin)
    monkeypatch.setattr(timing, "TIMED_DEVICE_TYPES", ())
    loss0, grads0, rng0 = seeded_step(untimed)
    assert torch.equal(loss1, loss0) and torch.equal(rng1, rng0)
    assert grads1.keys() == grads0.keys() and all(torch.equal(grads1[n], g) for n, g in grads0.items())
    shapes = len(timing.timed_calls())  # in checkpointed layers every q/k/v input needs a gradient
    assert shapes == 3 and len(asked) == 2 * (timing.TIMED_ROUNDS + 1) * shapes
    for op, outcomes in calls(twin).items():  # two layers' forwards and their recomputes
        assert sum(outcomes.values()) == 4 and outcomes[timing.FASTER_UNFUSED + " (timed)"] == 3, outcomes


@pytest.mark.slow
def test_a_group_with_an_unadapted_projection_times_both_paths(timed_here):
    """q/v-only LoRA (a common recipe): k has no adapter, so on the first layer's input, which needs
    no gradient, PEFT's k output has nothing to differentiate; both paths are still timed."""
    twin = peft_model(build("llama"), "swap-then-peft", lora_dropout=DROPOUT, target_modules=["q_proj", "v_proj"])
    seeded_step(twin)
    timed = timing.timed_calls()
    assert len(timed) == 2 and all(set(t.ms) == {"fused", "peft"} and not t.errors for t in timed.values()), timed


# --- the gates, on `choose` itself: a tiny group (one projection) and stand-in paths ------------

def group(requires_grad=True):
    x = torch.randn(4, 8, requires_grad=requires_grad)
    A, B = torch.nn.Parameter(torch.randn(2, 8)), torch.nn.Parameter(torch.randn(6, 2))
    proj = plans.Proj(torch.randn(6, 8), None, "plain", torch.float32, True, 2.0, 0.0, None, True, "promote")

    def fused(v):
        return (v @ proj.weight.T + 2.0 * (v @ A.T) @ B.T,)

    def peft(v):
        return (v @ proj.weight.T + (v @ A.T) @ B.T * 2.0,)

    return x, [proj], [A, B], fused, peft


def choose(x, projs, adapters, fused, peft, timed=True):
    return timing.choose(timed, "lora_o", x, projs, adapters, fused, peft)


class _Seen(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _InBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        _InBackward.answer = choose(*group())
        return g


def test_where_the_side_runs_would_be_seen_nothing_is_timed_and_the_call_runs_fused(timed_here, monkeypatch):
    timed = []
    monkeypatch.setattr(timing, "_time", lambda x, adapters, fused, peft: timed.append(1) or _timing.Timing(
        "peft", {"fused": 2.0, "peft": 1.0}, {}))
    untimed = (timing.FUSED, None)
    assert choose(*group(), timed=False) == untimed  # ACCEL_PATCH_LORA_PATH=fused
    with monkeypatch.context() as m:
        m.setattr(timing, "TIMED_DEVICE_TYPES", ("cuda",))
        assert choose(*group()) == untimed
    with monkeypatch.context() as m:
        m.setattr(timing.sites, "compiling", lambda: True)
        assert choose(*group()) == untimed
    with monkeypatch.context() as m:
        m.setattr(timing, "TIMED_SHAPES", 0)
        assert choose(*group()) == untimed
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert choose(*group()) == untimed
    finally:
        handle.remove()
    x, projs, adapters, fused, peft = group()
    hook = adapters[0].register_hook(lambda g: g)
    assert choose(x, projs, adapters, fused, peft) == untimed
    hook.remove()
    x, projs, adapters, fused, peft = group(requires_grad=False)
    for a in adapters:
        a.requires_grad_(False)
    assert choose(x, projs, adapters, fused, peft) == untimed  # nothing to differentiate
    with torch.no_grad():
        assert choose(*group()) == untimed
    with torch.autograd.graph.disable_saved_tensors_hooks("the caller's"):
        assert choose(*group()) == untimed
    with _Seen():
        assert choose(*group()) == untimed
    _InBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert _InBackward.answer == untimed
    assert timed == [] and timing.timed_calls() == {}
    # where none holds: timed once, the answer kept for the shape (rows rounded up to a power of two);
    # a gradient hook on the input does not stop it (the side runs take a detached view of x)
    x, projs, adapters, fused, peft = group()
    x.register_hook(lambda g: g)
    path, timing_ = choose(x, projs, adapters, fused, peft)
    assert (path, timed) == ("peft", [1]) and timing_.ms == {"fused": 2.0, "peft": 1.0}
    assert choose(x[:3].contiguous(), projs, adapters, fused, peft) == ("peft", None) and timed == [1]


def test_the_side_runs_count_no_call_of_a_site_beneath(timed_here):
    """PEFT's side run of an MLP calls the forward beneath the LoRA site (a `glu` swap, which counts
    its calls): none of the side runs' calls is counted."""
    table = {}
    x, projs, adapters, fused, peft = group()

    def counted_peft(v):
        timing.sites.count_into(table, "glu", "fused")
        return peft(v)

    found = timing._time(x, adapters, fused, counted_peft)
    assert set(found.ms) == {"fused", "peft"} and table == {}
    timing.sites.count_into(table, "glu", "fused")  # outside the side runs: counted
    assert table == {"glu": {"fused": 1}}


def test_a_path_that_raises_is_left_out_and_said_and_the_fused_path_stands_when_both_do(timed_here, monkeypatch):
    x, projs, adapters, fused, peft = group()

    def seconds(raising):
        def run(path, *args):
            if path in raising:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
            return 0.001
        return run

    monkeypatch.setattr(timing, "_seconds", seconds({"peft"}))
    path, found = choose(x, projs, adapters, fused, peft)
    assert path == "fused" and found.ms == {"fused": 1.0}
    assert timing.outcome(path, found) == ("fused (timed: fused 1 ms, peft raised OutOfMemoryError: CUDA out of "
                                           "memory. Tried to allocate 2.00 GiB)")
    monkeypatch.setattr(timing, "_timed", {})
    monkeypatch.setattr(timing, "_seconds", seconds({"fused", "peft"}))
    path, found = choose(x, projs, adapters, fused, peft)
    assert path == "fused" and found.ms == {} and set(found.errors) == {"fused", "peft"}


def test_the_switch_runs_every_call_fused_untimed_and_a_bad_value_refuses_the_sites(timed_here, monkeypatch):
    base = build("llama")
    monkeypatch.setenv(timing.PATH_SWITCH, "Fused")
    twin = peft_model(base, "swap-then-peft")
    seeded_step(twin)
    assert timing.timed_calls() == {}
    assert {op: set(o) for op, o in calls(twin).items()} == {op: {"fused"} for op in ("lora_qkv", "lora_o", "lora_mlp")}
    monkeypatch.setenv(timing.PATH_SWITCH, "sometimes")
    from accel_patch import swap_kernels

    refused = swap_kernels(copy.deepcopy(base), "lora").refused
    assert {(r.where.rsplit(".", 1)[1], r.op) for r in refused} == {
        ("self_attn", "lora_qkv"), ("self_attn", "lora_o"), ("mlp", "lora_mlp")}, refused
    assert all(r.reason == "BadSwitch: ACCEL_PATCH_LORA_PATH='sometimes' is not one of auto, fused (any case), "
               "or leave it unset" for r in refused), refused
