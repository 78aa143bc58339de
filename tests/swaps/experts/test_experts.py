"""The experts site (accel_patch/swaps/experts/): every MoE family's experts swapped, one padded
training step equal to stock's (float32: loss 1e-5, gradients 1e-4; bf16 autocast within 3x
stock's own error against float64), whatever experts implementation the config picks; PEFT's LoRA
on the experts fused as split LoRA with PEFT's adapter gradients; what the op cannot do runs
PEFT's or the module's forward, counted; reversible; compiles fullgraph."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model

from accel_patch import report as live_report
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import experts, probe, sites
from accel_patch.swaps.layers import tiled_mlp

from _models import keeping_graphs, padded_batch, rel, training_step
from _moe_models import FAMILIES, build, experts_modules, pair

def on_the_twin(monkeypatch):
    """Run the op's plain-torch twin (same saved tensors, same hand-written backward) instead of the
    interpreted kernel: for tests of the site's decisions (tiling), not of the kernel, whose
    parity the steps above check; the interpreted kernel costs about 5 s a step at 150 tokens."""
    from accel_kernels import _dispatch

    monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)


def experts_calls(model):
    return live_report(model).calls.get(experts.OP, {})


def assert_step_equals(stock, twin, loss_bound=1e-5, grad_bound=1e-4):
    batch = padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= loss_bound, (loss1, loss0)
    assert grads0 and grads1.keys() == grads0.keys()
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= grad_bound, (worst, rel(grads1[worst], grads0[worst]))
    return grads0, grads1


#: The kernel configurations the families reach, one family each: the standard layout (SiLU, halves,
#: no bias: Mixtral, and the Qwen, OLMoE, DeepSeek, GLM, Granite families), gpt-oss's (transposed,
#: interleaved, biased, its clamped GLU), Llama 4's (transposed halves, top-1).
KERNEL_CONFIGURATIONS = ("mixtral", "gpt_oss", "llama4")


def swapped_pair(family):
    stock, twin = pair(family)
    report = swap_kernels(twin)
    modules = experts_modules(twin)
    assert modules and report.swapped.get(experts.OP) == len(modules), report
    assert all(sites.is_swapped(m) for m in modules.values())
    assert not [r for r in report.refused if r.op == experts.OP or "xperts" in r.where], report
    return stock, twin, modules


@pytest.mark.parametrize("family", [f if f == "qwen3_moe" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(FAMILIES)])
def test_every_experts_module_is_swapped_and_a_float32_step_on_the_twin_equals_stock(family, monkeypatch):
    # the site's plan (layout, gate/up order, activation, routing) for every family, on the op's
    # plain-torch twin: the kernel's parity per configuration is the next test's
    stock, twin, modules = swapped_pair(family)
    on_the_twin(monkeypatch)
    assert_step_equals(stock, twin)
    assert experts_calls(twin) == {"fused": len(modules)}


@pytest.mark.slow  # interpreted Triton: about 3 s a step
@pytest.mark.parametrize("family", KERNEL_CONFIGURATIONS)
def test_each_kernel_configuration_runs_interpreted_and_a_float32_step_equals_stock(family):
    stock, twin, modules = swapped_pair(family)
    from accel_kernels import _launch

    with _launch.recording() as launched:
        assert_step_equals(stock, twin)
    assert experts_calls(twin) == {"fused": len(modules)}
    # the Triton kernels ran (interpreted): gate/up with the GLU fused, and the weight gradients
    assert {"_moe_gate_up_kernel", "_moe_weight_grad_kernel"} <= set(launched), sorted(set(launched))


# every implementation on Mixtral's layout; gpt-oss's (transposed, interleaved, biased) on the
# implementations whose code differs by layout. grouped_mm, the default, is every other test's.
IMPLEMENTATIONS = [("mixtral", "eager"), ("mixtral", "batched_mm"), ("gpt_oss", "eager")]


@pytest.mark.slow
@pytest.mark.parametrize("family, implementation", IMPLEMENTATIONS)
def test_the_probe_and_the_step_hold_for_every_experts_implementation(family, implementation, monkeypatch):
    # the implementation changes the stock forward the probe and the step compare against, not
    # the op: it runs on its twin here (the interpreted kernel per configuration is the test above)
    probe.cache.clear()
    on_the_twin(monkeypatch)
    stock, twin = pair(family)
    for m in (stock, twin):
        m.config._experts_implementation = implementation
        m.set_experts_implementation(implementation) if hasattr(m, "set_experts_implementation") else None
    assert next(iter(experts_modules(twin).values())).config._experts_implementation == implementation
    report = swap_kernels(twin)
    assert report.swapped.get(experts.OP) == len(experts_modules(twin)), report
    assert_step_equals(stock, twin)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_a_bfloat16_autocast_step_is_within_three_times_stocks_own_error(family):
    reference, _ = pair(family, torch.float64)
    reference.set_experts_implementation("eager")  # torch._grouped_mm takes no float64
    stock, twin = pair(family)
    swap_kernels(twin)
    batch = padded_batch()
    loss_ref, grads_ref, _ = training_step(reference, batch)
    results = []
    for m in (stock, twin):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(training_step(m, batch))
    (loss0, grads0, _), (loss1, grads1, _) = results
    assert rel(loss1, loss_ref) <= 3 * rel(loss0, loss_ref) + 1e-3
    names = sorted(grads_ref)
    flat = {k: torch.cat([g[n].double().flatten() for n in names]) for k, g in (("ref", grads_ref), ("stock", grads0), ("twin", grads1))}
    assert rel(flat["twin"], flat["ref"]) <= 3 * rel(flat["stock"], flat["ref"]) + 1e-3
    assert experts_calls(twin) == {"fused": len(experts_modules(twin))}


# --- LoRA on the experts --------------------------------------------------------------------

LORA = dict(r=4, lora_alpha=8, init_lora_weights=False)


def peft_pair(family, order="peft-then-swap", **config):
    base = build(family)
    torch.manual_seed(3)
    stock = get_peft_model(copy.deepcopy(base), LoraConfig(**{**LORA, **config}))
    twin = copy.deepcopy(base)
    if order == "swap-then-peft":
        swap_kernels(twin)
    torch.manual_seed(3)
    twin = get_peft_model(twin, LoraConfig(**{**LORA, **config}))
    if order == "peft-then-swap":
        swap_kernels(twin)
    return stock, twin


@pytest.mark.slow
@pytest.mark.parametrize("family, order, config", [
    ("gpt_oss", "peft-then-swap", {"target_parameters": ["gate_up_proj", "down_proj"], "target_modules": []}),
    ("qwen3_moe", "swap-then-peft", {"target_modules": "all-linear"}),
    # rsLoRA: PEFT gives the fused gate/up twice the rank and alpha, so a scaling of its own (2a / sqrt(2r))
    ("qwen3_moe", "peft-then-swap", {"target_modules": "all-linear", "use_rslora": True}),
    ("mixtral", "peft-then-swap", {"target_parameters": ["down_proj"], "target_modules": []}),
    ("llama4", "peft-then-swap", {"target_parameters": ["gate_up_proj", "down_proj"], "target_modules": []}),
    ("qwen2_moe", "peft-then-swap", {"target_parameters": ["gate_up_proj", "down_proj"], "target_modules": []}),
])
def test_lora_on_the_experts_is_fused_and_gives_peft_s_adapter_gradients(family, order, config):
    stock, twin = peft_pair(family, order, **config)
    grads0, grads1 = assert_step_equals(stock, twin)
    assert all("lora_" in n for n in grads1 if "experts" in n)  # gradients to A and B only
    assert any("experts" in n and "lora_A" in n for n in grads1)
    assert experts_calls(twin) == {"fused (LoRA)": len(experts_modules(twin))}


@pytest.mark.slow
def test_lora_on_the_experts_never_reads_the_merged_weight():
    """PEFT's ParamWrapper folds W + s B A when it registers its parametrization (torch checks the
    parametrization's output once there) and again when the experts forward reads the parameter:
    the site reads the stored weight and the factors, so only PEFT's own check remains."""
    import peft.tuners.lora.layer as peft_lora

    stock, twin = peft_pair("gpt_oss", target_parameters=["gate_up_proj", "down_proj"], target_modules=[])
    wrappers = sum(type(m).__name__ == "ParamWrapper" for m in twin.modules())
    original = peft_lora._LoraFactorsProxy.forward
    folds = []

    def watched(self, W):
        folds.append(tuple(W.shape))
        return original(self, W)

    counts = []
    peft_lora._LoraFactorsProxy.forward = watched
    try:
        for m in (stock, twin):
            folds.clear()
            m(**padded_batch()).loss.backward()
            counts.append(len(folds))
    finally:
        peft_lora._LoraFactorsProxy.forward = original
    assert wrappers == 4 and counts == [2 * wrappers, wrappers], counts
    base = twin.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    assert isinstance(base.gate_up_proj, torch.nn.Parameter)  # PEFT's parametrization is gone after the call


@pytest.mark.slow
def test_several_active_adapters_run_peft_s_forward_counted_and_disabled_adapters_the_fused_base():
    stock, twin = peft_pair("qwen3_moe", target_modules="all-linear")
    layers = len(experts_modules(twin))
    for m in (stock, twin):
        torch.manual_seed(5)
        m.add_adapter("second", LoraConfig(**LORA, target_modules="all-linear"))
        m.base_model.set_adapter(["default", "second"])
    assert_step_equals(stock, twin)
    outcomes = experts_calls(twin)
    assert list(outcomes.values()) == [layers] and next(iter(outcomes)).startswith("PEFT's forward: "), outcomes
    for m in (stock, twin):
        m.base_model.set_adapter("default")
    batch = padded_batch()
    with stock.disable_adapter(), twin.disable_adapter():
        assert torch.allclose(twin(**batch).loss, stock(**batch).loss, rtol=1e-5, atol=0)
    assert experts_calls(twin)["fused"] == layers


# --- composition ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_router_and_its_aux_loss_stay_stock_and_restore_puts_the_forward_back():
    stock, twin = pair("qwen3_moe", router_aux_loss_coef=0.1)
    before = {n: m.__dict__.get("forward") for n, m in twin.named_modules()}
    swap_kernels(twin)
    batch = padded_batch()
    out0, out1 = stock(**batch), twin(**batch)
    assert out1.aux_loss is not None and torch.allclose(out1.aux_loss, out0.aux_loss, rtol=1e-6)
    assert all(not sites.is_swapped(m) for n, m in twin.named_modules() if n.endswith(".gate"))  # the router
    assert restore_kernels(twin)
    assert {n: m.__dict__.get("forward") for n, m in twin.named_modules()} == before
    assert not any(experts.SITE_ATTR in m.__dict__ for m in twin.modules())


@pytest.mark.slow
def test_a_long_checkpointed_call_runs_in_windows_on_the_twin(monkeypatch):
    on_the_twin(monkeypatch)
    import accel_kernels.ops.moe_experts as op

    monkeypatch.setenv(experts.site.TILE_BUDGET_SWITCH, "0")  # would tile every such call on the Triton path
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")  # the experts alone: the other kernels, interpreted, add only time
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "CHUNK_ELEMENTS", 1)  # chunks of `hidden` (64) tokens
    monkeypatch.setattr(op, "TWIN_WINDOW_BYTES", 1)  # a window per expert
    batch = {k: v.repeat(1, 30) for k, v in padded_batch().items()}  # 3 x 300 tokens
    batch["labels"][:, :5] = -100
    loss0, grads0, _ = training_step(stock, batch)
    twin.gradient_checkpointing_enable()  # where the recompute is paid anyway
    twin.config.use_cache = False
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, worst
    # the twin: not tiled (its windows bound what a call holds), the forward and its recompute
    assert experts_calls(twin) == {"fused": 2 * len(experts_modules(twin))}, experts_calls(twin)


def _tiling_site(monkeypatch, **env):
    """(the first experts module of a swapped tiny Qwen3-MoE, its site, the model), checkpointed,
    with the tiled MLP's thresholds at their least (chunks of `hidden` = 64 tokens)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model = pair("qwen3_moe")[1]
    swap_kernels(model, ops="experts")
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "CHUNK_ELEMENTS", 1)
    model.gradient_checkpointing_enable()
    model.train()
    module = next(iter(experts_modules(model).values()))
    return module, module.__dict__[experts.SITE_ATTR], model


def test_a_checkpointed_call_on_the_triton_path_tiles_only_above_the_memory_budget(monkeypatch):
    """Checkpointing alone does not tile the Triton path: a call tiles where what it would hold
    untiled (held_bytes) exceeds the budget, and runs whole up to it; without checkpointing (or with
    no grad) it never tiles, whatever it holds; the twin tiles only where tiled_mlp is named."""
    from accel_kernels import _dispatch

    module, site, model = _tiling_site(monkeypatch)
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: True)
    hidden = torch.zeros(900, model.config.hidden_size)  # 900 tokens, top-2, H 64, I 32, fp32
    held = experts.site.held_bytes(900, 2, 64, 32, 4, False)
    assert held == 900 * 2 * (3 * 32 + 64) * 4
    assert experts.site.held_bytes(900, 2, 64, 32, 4, True) == 900 * 2 * (4 * 32 + 2 * 64) * 4
    assert site.tile_budget is None and experts.site.tile_budget(site, hidden.device) == experts.site.TILE_BUDGET_BYTES
    assert held < experts.site.TILE_BUDGET_BYTES
    assert experts.site._tiling(module, site, hidden, 2, 4, False) is None  # checkpointed, within the budget
    for budget, want in ((held, None), (held - 1, 64), (0.0, 64), (float("inf"), None)):
        site.tile_budget = budget
        assert experts.site._tiling(module, site, hidden, 2, 4, False) == want, budget
    site.tile_budget = held  # the grouped_mm backward's temporaries count: the same call, over it
    assert experts.site._tiling(module, site, hidden, 2, 4, True) == 64
    assert experts.site._tiling(module, site, hidden, 2, 2, True) is None  # bf16: half the bytes
    site.tile_budget = 0.0
    with torch.no_grad():
        assert experts.site._tiling(module, site, hidden, 2, 4, False) is None
    model.gradient_checkpointing_disable()  # over the budget, not checkpointed: the budget alone never tiles
    assert experts.site._tiling(module, site, hidden, 2, 4, False) is None
    model.gradient_checkpointing_enable()
    monkeypatch.setattr(_dispatch, "use_triton", lambda t: False)  # the twin: its windows, never tiles
    assert experts.site._tiling(module, site, hidden, 2, 4, False) is None
    site.requested, site.tile_budget = True, None  # tiled_mlp named: tiles, budget or not, either path
    assert experts.site._tiling(module, site, hidden, 2, 4, False) == 64


def test_a_tiled_call_runs_each_chunk_with_the_backward_chosen_for_the_whole_call(monkeypatch):
    """auto's choice of backward depends on the call's tiles, so on its rows per expert: the site
    chooses once for the whole call (what it counts) and hands that choice, not "auto", to each
    chunk of a tiled call, whose fewer rows could choose otherwise."""
    import accel_kernels.ops.moe_experts as op

    on_the_twin(monkeypatch)
    module, site, model = _tiling_site(monkeypatch)
    site.requested = True  # tiled_mlp named: the twin tiles too, in chunks of 64 tokens
    real = op.backward_path
    # a stand-in for a GPU's auto: grouped_mm where the call is large, triton where it is small
    monkeypatch.setattr(op, "backward_path", lambda hidden, backward="auto", *a: backward if backward != "auto" else (
        "grouped_mm" if hidden.shape[0] > 64 else "triton"))
    run, given = experts.site.run, []

    def spy(*args):  # run(module, plan, hidden, index, weights, lora, autocast_dtype, save, backward)
        given.append(args[8])
        monkeypatch.setattr(op, "backward_path", real)  # the chunk itself runs the twin
        try:
            return run(*args[:8], "auto")
        finally:
            monkeypatch.setattr(op, "backward_path", fake)

    fake = op.backward_path
    monkeypatch.setattr(experts.site, "run", spy)
    hidden = torch.randn(200, model.config.hidden_size, requires_grad=True)
    index, weights = experts.site.routes(200, 2, 4, "cpu")
    module(hidden, index, weights).sum().backward()
    assert given == ["grouped_mm"] * 4, given  # 4 chunks of at most 64 tokens
    assert experts_calls(model) == {"fused (tiled, grouped_mm backward)": 1}, experts_calls(model)


def test_auto_reads_the_call_s_tiles_in_eager_and_nothing_of_them_while_compiling(monkeypatch):
    """On a CUDA device (a stand-in here) the site asks the op which tiles the call takes and auto
    follows them (large: Triton's backward); while torch.compile traces it asks nothing of them
    (none of that is traced) and auto's rule without them stands (grouped_mm where it was tried)."""
    import accel_kernels.ops.moe_experts as op

    module, site, _ = _tiling_site(monkeypatch)
    stand = type("Stand", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()
    monkeypatch.setattr(op._dispatch, "use_triton", lambda t: True)
    monkeypatch.setattr(op, "_grouped_mm_takes", lambda device, ct: True)
    monkeypatch.setattr(op, "TIMED_DEVICE_TYPES", ())  # auto's rule, untimed (timing: the tests below)
    asked = []
    monkeypatch.setattr(op, "call_tiles", lambda *a: asked.append(a) or op.LARGE_TILES)
    index, weights = torch.zeros(8, 2, dtype=torch.long), torch.ones(8, 2)
    path = experts.site._backward_path
    assert path(module, site.plan, stand, index, weights, "auto", None, None) == ("triton", None)
    assert len(asked) == 1
    monkeypatch.setattr(experts.site.sites, "compiling", lambda: True)
    assert path(module, site.plan, stand, index, weights, "auto", None, None) == ("grouped_mm", None)
    assert len(asked) == 1


def test_the_budget_weighs_a_call_in_its_compute_dtype(monkeypatch):
    """The forward hands the rule the bytes of the dtype the op computes in: autocast's, else
    hidden's (a bf16 autocast call holds half what a float32 one does)."""
    on_the_twin(monkeypatch)
    module, site, model = _tiling_site(monkeypatch)
    seen = []
    tiling = experts.site._tiling
    monkeypatch.setattr(experts.site, "_tiling", lambda *a: seen.append(a[4]) or tiling(*a))
    hidden = torch.randn(8, model.config.hidden_size)
    index, weights = experts.site.routes(8, 2, 4, "cpu")
    module(hidden, index, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        module(hidden, index, weights)
    assert seen == [4, 2], seen


def test_the_default_budget_is_a_fraction_of_a_cuda_devices_memory(monkeypatch):
    site = experts.site.Site(None, ("hidden",), {})
    memory = 80 << 30

    class Properties:
        total_memory = memory

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    monkeypatch.setattr(experts.site, "_device_memory", {})
    assert experts.site.tile_budget(site, torch.device("cuda:3")) == memory * experts.site.TILE_BUDGET_FRACTION
    assert experts.site.tile_budget(site, torch.device("cpu")) == experts.site.TILE_BUDGET_BYTES
    site.tile_budget = 1 << 20  # the switch's value wins everywhere
    assert experts.site.tile_budget(site, torch.device("cuda:3")) == 1 << 20
    # Qwen3-30B-A3B's experts at 4096 tokens (top-8, H 2048, I 768, bf16, the grouped_mm backward):
    # 448 MiB, well under the default on an 80 GB device
    assert experts.site.held_bytes(4096, 8, 2048, 768, 2, True) == 448 << 20


def test_the_tile_budget_switch_reads_sizes_and_names_a_bad_one(monkeypatch):
    from accel_patch.core import switches

    read = experts.site.tile_budget_switch
    assert read({}) is None and read({experts.site.TILE_BUDGET_SWITCH: " "}) is None
    for value, want in (("0", 0), ("4096", 4096), ("512MiB", 512 << 20), ("2G", 2 << 30), ("1.5 GiB", 3 << 29),
                        ("Inf", float("inf"))):
        assert read({experts.site.TILE_BUDGET_SWITCH: value}) == want, value
    for bad in ("2GB", "lots", "-1", "nan", "MiB"):
        with pytest.raises(switches.BadSwitch, match=rf"ACCEL_PATCH_EXPERTS_TILE_BUDGET='{bad}' is not a size"):
            read({experts.site.TILE_BUDGET_SWITCH: bad})
    module, site, _ = _tiling_site(monkeypatch, ACCEL_PATCH_EXPERTS_TILE_BUDGET="64KiB")  # read at the swap
    assert site.tile_budget == 64 << 10
    # a bad value refuses the site with the error at the swap (the walk's rule), never the swap
    monkeypatch.setenv(experts.site.TILE_BUDGET_SWITCH, "lots")
    model = pair("qwen3_moe")[1]
    report = swap_kernels(model, ops="experts")
    refused = [r for r in report.refused if r.op == experts.OP]
    assert not report.swapped.get(experts.OP) and len(refused) == len(experts_modules(model)), report
    assert all("ACCEL_PATCH_EXPERTS_TILE_BUDGET='lots' is not a size" in r.reason for r in refused), refused


@pytest.mark.slow  # interpreted Triton: two checkpointed steps of 3 x 50 tokens, about 5 s each
@pytest.mark.parametrize("budget, want", [(None, "fused"), ("0", "fused (tiled)")])
def test_a_checkpointed_step_on_the_triton_path_tiles_by_the_budget_and_equals_stock(monkeypatch, budget, want):
    """Interpreted kernels, float32, non-reentrant checkpointing: within the budget (the default)
    every call runs whole, over it (0) every call tiles, counted either way; both steps equal stock's."""
    from accel_kernels import _launch

    if budget is not None:
        monkeypatch.setenv(experts.site.TILE_BUDGET_SWITCH, budget)
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "CHUNK_ELEMENTS", 1)  # chunks of `hidden` (64) tokens: 3 a call
    batch = {k: v.repeat(1, 5) for k, v in padded_batch().items()}  # 3 x 50 tokens
    for model in (stock, twin):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    loss0, grads0, _ = training_step(stock, batch)
    with _launch.recording() as launched:
        loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, (worst, rel(grads1[worst], grads0[worst]))
    n = len(experts_modules(twin))
    assert experts_calls(twin) == {want: 2 * n}, experts_calls(twin)  # the forward and its recompute
    # every call launched its kernels: 3 forward launches per op call (3 per chunk when tiled)
    calls = 2 * n * (3 if want.endswith("(tiled)") else 1)
    assert launched.count("_moe_combine_kernel") >= calls, launched


@pytest.mark.slow
def test_a_named_tiled_mlp_tiles_the_experts_without_checkpointing(monkeypatch):
    on_the_twin(monkeypatch)
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")  # the experts alone: the other kernels, interpreted, add only time
    swap_kernels(twin, ops=["tiled_mlp"])  # named after a default swap: tiles from now on
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "CHUNK_ELEMENTS", 1)  # chunks of `hidden` (64) tokens
    batch = {k: v.repeat(1, 30) for k, v in padded_batch().items()}  # 3 x 300 tokens: 15 chunks
    batch["labels"][:, :5] = -100
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, worst
    assert experts_calls(twin) == {"fused (tiled)": len(experts_modules(twin))}


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [None, True])
def test_a_fullgraph_compiled_step_has_no_graph_break_holds_the_op_and_equals_stock(dynamic):
    """With dynamic=True the activation's alpha and limit reach the op's checks as SymFloats:
    red when a check hands them to `math` (dynamo cannot: a graph break)."""
    stock, twin = pair("qwen3_moe", output_router_logits=False)
    swap_kernels(twin)
    batch = padded_batch()
    torch._dynamo.reset()
    loss0, grads0, _ = training_step(stock, batch)
    graphs = []  # fullgraph: no graph break
    compiled = torch.compile(twin, fullgraph=True, dynamic=dynamic, backend=keeping_graphs(graphs))
    loss1, grads1, _ = training_step(compiled, batch)
    assert any("moe_experts" in str(n.target) for g in graphs for n in g.graph.nodes)
    grads1 = {n.replace("_orig_mod.", ""): g for n, g in grads1.items()}
    assert rel(loss1, loss0) <= 1e-5
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, worst
    assert set(experts_calls(twin)) == {"compiled: fused"}
    torch._dynamo.reset()


@pytest.mark.slow
def test_experts_sharded_before_the_swap_are_refused_with_the_reason_and_train_as_stock(tmp_path, monkeypatch):
    """FSDP2 on a one-process gloo group, applied before the swap: the experts' parameters are
    DTensor shards there, the probe cannot run the module on them (swapped first, FSDP2 unshards
    them for each forward and they run the op: integration_tests/test_fsdp.py)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        stock, twin = pair("qwen3_moe")
        for model in (stock, twin):
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        report = swap_kernels(twin)
        assert experts.OP not in report.swapped
        reasons = [r.reason for r in report.refused if r.op == experts.OP]
        assert reasons == ["MoE experts' gate_up_proj is a DTensor (sharded already): swap before sharding"] * len(
            experts_modules(twin)), report
        batch = padded_batch()
        loss0, grads0, _ = training_step(stock, batch)
        loss1, grads1, _ = training_step(twin, batch)
        assert rel(loss1, loss0) <= 1e-5 and grads1.keys() == grads0.keys()
        assert experts_calls(twin) == {}
    finally:
        dist.destroy_process_group()


# --- refusals -----------------------------------------------------------------------------------

def test_an_activation_that_is_not_what_it_names_is_refused_with_the_reason():
    model = build("qwen3_moe")

    class SiLU(torch.nn.Module):  # named SiLU, computes something else
        def forward(self, t):
            return torch.nn.functional.silu(t) * 1.01

    for m in experts_modules(model).values():
        m.act_fn = SiLU()
    report = swap_kernels(model)
    assert experts.OP not in report.swapped
    reasons = {r.reason for r in report.refused if r.op == experts.OP}
    assert len(reasons) == 1 and "differs from every reading of the MoE experts" in reasons.pop()


def test_separate_3d_gate_and_up_are_refused_with_the_reason():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Parameter(torch.randn(4, 8, 16))
            self.up_proj = torch.nn.Parameter(torch.randn(4, 8, 16))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 16, 8))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    holder = torch.nn.Sequential(Experts())
    report = swap_kernels(holder, ops="experts")
    assert [r.reason for r in report.refused] == ["MoE experts with separate 3-D gate and up parameters: the op takes one gate_up"]


@pytest.mark.slow
def test_a_4bit_base_leaves_the_experts_unquantized_and_their_lora_is_fused(tmp_path, monkeypatch):
    """transformers' bitsandbytes integration replaces nn.Linear modules only: the 3-D experts load
    as plain parameters beside Linear4bit attention, and LoRA on them is fused as on a float base."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, Qwen3MoeForCausalLM

    build("qwen3_moe").save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "0")  # the load hook swaps nothing: both start stock
    models = []
    for _ in range(2):
        model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, quantization_config=quant, device_map="cpu")
        torch.manual_seed(3)
        models.append(get_peft_model(model, LoraConfig(**LORA, target_modules="all-linear")))
    stock, twin = models
    layer = twin.base_model.model.model.layers[0]
    assert type(layer.self_attn.q_proj.base_layer).__name__ == "Linear4bit"
    base = layer.mlp.experts.get_base_layer()
    for name in ("gate_up_proj", "down_proj"):
        param = base.parametrizations[name].original if hasattr(base, "parametrizations") else base._parameters[name]
        assert type(param) is torch.nn.Parameter and param.dtype == torch.float32 and param.dim() == 3, (name, param)
    report = swap_kernels(twin, ops="experts")  # the experts alone: the other kernels run interpreted too
    assert report.swapped == {experts.OP: len(experts_modules(twin))}, report
    assert_step_equals(stock, twin)
    assert experts_calls(twin) == {"fused (LoRA)": len(experts_modules(twin))}


@pytest.mark.parametrize("mode", ["auto", "save", "recompute"])
def test_under_checkpointing_gate_up_are_recomputed_unless_told_to_save(monkeypatch, mode):
    """Auto recomputes gate/up in the op's backward, inside a checkpointed layer too (saving them
    there cost more memory than the recompute's time, docs/moe.md); told to save, the twin keeps
    them in every call with grad; a step equals stock either way."""
    on_the_twin(monkeypatch)
    monkeypatch.setenv(experts.site.GATE_UP_SWITCH, mode)
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")
    batch = padded_batch()
    n = len(experts_modules(twin))
    training_step(twin, batch)  # not checkpointed
    assert experts_calls(twin) == {"fused (saved gate/up)" if mode == "save" else "fused": n}
    for model in (stock, twin):
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    experts_calls(twin).clear()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss0) <= 1e-5
    assert max(rel(grads1[n], g) for n, g in grads0.items()) <= 1e-4
    # the forward and its recompute inside backward
    want = "fused (saved gate/up)" if mode == "save" else "fused"
    assert experts_calls(twin) == {want: 2 * n}, experts_calls(twin)


def test_the_backward_switch_reads_its_three_values_and_names_a_bad_one(monkeypatch):
    from accel_patch.core import switches

    assert experts.site.backward_mode({}) == "auto"
    assert experts.site.backward_mode({experts.site.BACKWARD_SWITCH: " "}) == "auto"
    for value in ("auto", "triton", "grouped_mm", " Grouped_MM "):
        assert experts.site.backward_mode({experts.site.BACKWARD_SWITCH: value}) == value.strip().lower()
    with pytest.raises(switches.BadSwitch, match=r"ACCEL_PATCH_EXPERTS_BACKWARD='cutlass' is not one of "
                                                 r"auto, triton, grouped_mm"):
        experts.site.backward_mode({experts.site.BACKWARD_SWITCH: "cutlass"})
    # at the swap, the walk's rule for a site whose reading raises: that site refused with the
    # error (the experts run the module's forward), never the swap, never a silent default
    monkeypatch.setenv(experts.site.BACKWARD_SWITCH, "cutlass")
    model = pair("qwen3_moe")[1]
    report = swap_kernels(model, ops="experts")
    refused = [r for r in report.refused if r.op == experts.OP]
    assert not report.swapped.get(experts.OP) and len(refused) == len(experts_modules(model)), report
    assert all("BadSwitch: ACCEL_PATCH_EXPERTS_BACKWARD='cutlass' is not one of auto, triton, grouped_mm"
               in r.reason for r in refused), refused


@pytest.mark.slow  # 3-4 s each
@pytest.mark.parametrize("backward", ["triton", "grouped_mm"])
def test_the_backward_switch_selects_what_the_count_says(monkeypatch, backward):
    """The Triton path (interpreted here) runs the backward the switch names, and each call with
    grad is counted with it: "grouped_mm backward" where the backward's GEMMs are grouped_mm calls
    (no Triton weight-gradient launch), plain "fused" where they are Triton launches; a step
    equals stock either way."""
    from accel_kernels import _launch

    import accel_kernels.ops.moe_experts as op

    monkeypatch.setenv(experts.site.BACKWARD_SWITCH, backward)
    monkeypatch.setattr(op, "GROUPED_MIN_WIDTH", 8)  # the tiny model's widths (64 and more at a real one's)
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")
    n = len(experts_modules(twin))
    real, grouped = torch._grouped_mm, []

    def counting(*args, **kwargs):
        grouped.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    with _launch.recording() as launched:
        loss0, grads0, _ = training_step(stock, padded_batch())
        grouped.clear()  # stock's own grouped_mm experts: every call counted below is the op's
        launched.clear()
        loss1, grads1, _ = training_step(twin, padded_batch())
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    want = "fused (grouped_mm backward)" if backward == "grouped_mm" else "fused"
    assert experts_calls(twin) == {want: n}, experts_calls(twin)
    assert ("_moe_weight_grad_kernel" in launched) == (backward == "triton"), launched
    assert bool(grouped) == (backward == "grouped_mm")
    experts_calls(twin).clear()
    with torch.no_grad():  # no backward to run: no note
        twin(**{k: v for k, v in padded_batch().items() if k != "labels"})
    assert experts_calls(twin) == {"fused": n}


def test_the_twin_counts_no_grouped_mm_backward_whatever_the_switch(monkeypatch):
    on_the_twin(monkeypatch)
    monkeypatch.setenv(experts.site.BACKWARD_SWITCH, "grouped_mm")
    stock, twin = pair("qwen3_moe")
    swap_kernels(twin, ops="experts")
    training_step(twin, padded_batch())
    assert experts_calls(twin) == {"fused": len(experts_modules(twin))}


@pytest.mark.slow  # interpreted Triton: two steps of each model, and one timing (six side runs), about 8 s
def test_auto_times_the_first_call_of_a_shape_says_so_and_the_step_equals_stock(monkeypatch):
    """Where auto times its two backwards (a GPU's; here the CPU's, both interpreted), the first
    experts call of the step's shape times them and its count says so with the figures; every
    other call (the second layer, the checkpoint's recomputes, the next step) runs the answer
    without timing, and the swap's probe times nothing. The step equals stock's under
    non-reentrant checkpointing (TRL's default): the side runs, inside the checkpointed forward,
    save through their own hooks, not the checkpoint's."""
    import accel_kernels.ops.moe_experts as op

    monkeypatch.setattr(op, "TIMED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(op, "_timed", {})
    monkeypatch.setattr(op, "GROUPED_MIN_WIDTH", 8)
    asked, inner = [], op._backward_seconds
    monkeypatch.setattr(op, "_backward_seconds", lambda path, *a, **k: asked.append(path) or (
        inner(path, *a, **k) + (1.0 if path == "triton" else 0.0)))  # grouped_mm the faster
    stock, twin, modules = swapped_pair("qwen3_moe")
    for model in (stock, twin):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    assert_step_equals(stock, twin)
    assert asked == ["triton", "grouped_mm"] * (op.TIMED_ROUNDS + 1)
    (timing,) = op.timed_backwards().values()
    assert timing.path == "grouped_mm", timing
    calls = experts_calls(twin)
    timed = f"fused (grouped_mm backward, {timing.note(op.TIMED_NOTE)})"
    n = 2 * len(modules)  # the layers' forwards and their recomputes
    assert calls == {timed: 1, "fused (grouped_mm backward)": n - 1}, calls
    assert_step_equals(stock, twin)
    assert len(asked) == 2 * (op.TIMED_ROUNDS + 1) and experts_calls(twin)[timed] == 1
