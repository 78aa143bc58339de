"""Fused LoRA (accel_patch/swaps/lora/): a training step equals PEFT stock, family by family, in
both swap orders, LoRA and QLoRA; every fall-back runs PEFT's forward and is counted; the probe
refuses a broken backward; the swap is reversible and changes nothing the user saves."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers.models.llama.modeling_llama import LlamaAttention

import accel_patch
from accel_patch import restore_kernels, swap_kernels
from accel_patch.swaps import lora, ops, probe, sites
from accel_patch.swaps.lora import plans
from accel_patch.swaps.layers import tiled_mlp

from _models import build, padded_batch, rel, training_step
from test_peft_and_checkpoints import assert_same_files

ALL_LINEAR = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules="all-linear")
LORA_OPS = "lora_mlp,lora_qkv,lora_o"


def peft_model(base, order, ops_=None, **config):
    model = copy.deepcopy(base)
    torch.manual_seed(3)  # the same adapter initialisation in every order
    if order == "swap-then-peft":
        swap_kernels(model, ops_)
        return get_peft_model(model, LoraConfig(**{**ALL_LINEAR, **config}))
    model = get_peft_model(model, LoraConfig(**{**ALL_LINEAR, **config}))
    if order == "peft-then-swap":
        swap_kernels(model, ops_)
    return model


def calls(model) -> dict:
    """The LoRA sites' call counts (the fused loss and the tiled MLP count their own calls beside them:
    `all_calls`)."""
    return {op: outcomes for op, outcomes in all_calls(model).items() if op in lora.OPS}


def all_calls(model) -> dict:
    return accel_patch.swaps.apply.unwrap(model).__dict__[sites.STATE_ATTR].calls


def assert_step_equals_stock(stock, twin, batch=None):
    batch = batch or padded_batch()
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert grads0 and grads1.keys() == grads0.keys()
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, (worst, rel(grads1[worst], grads0[worst]))


# (family, layers with a gated MLP): mixtral's experts are 3-D (the experts site's), gpt_neox's MLP is not gated.
GATED = {"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2", "granite", "cohere"}
QUICK = {("llama", "swap-then-peft"), ("phi3", "peft-then-swap")}


@pytest.mark.parametrize("family, order", [
    (f, o) if (f, o) in QUICK else pytest.param(f, o, marks=pytest.mark.slow)
    for f in sorted(GATED | {"mixtral", "gpt_neox"}) for o in ("swap-then-peft", "peft-then-swap")])
def test_a_lora_training_step_equals_peft_stock_in_float32(family, order):
    base = build(family)
    stock = peft_model(base, "stock")
    twin = peft_model(base, order)
    assert_step_equals_stock(stock, twin)
    layers = base.config.num_hidden_layers
    expected = {"lora_qkv": {"fused": layers}, "lora_o": {"fused": layers}}
    if family in GATED:
        expected["lora_mlp"] = {"fused": layers}
    assert calls(twin) == expected
    if family in GATED:  # the tiled MLP on top: short sequences run the fused LoRA MLP whole
        assert all_calls(twin)["tiled_mlp"] == {tiled_mlp.SHORT: layers}


RECIPES = {
    # rsLoRA: alpha / sqrt(r), a scale that is no power of two (never folded into the r-wide product)
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, lora_dropout=0.05),
    # ranks and scales per layer: each projection's own shapes and scale in one fused call
    "rank and alpha patterns": dict(r=8, lora_alpha=16, lora_dropout=0.1, alpha_pattern={"v_proj": 3},
                                    rank_pattern={"layers.0.self_attn.q_proj": 4, "down_proj": 2}),
    # one layer adapted: the other's sites run as without adapters, uncounted
    "layers_to_transform": dict(r=8, lora_alpha=16, lora_dropout=0.05, layers_to_transform=[1],
                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_lora_configs_train_as_peft_stock_with_dropout(recipe):
    """Under autocast the same configurations' scales are held bit for bit by the q/k/v function's
    test (test_lora_autocast.py)."""
    config = RECIPES[recipe]
    base = build("llama")
    stock, twin = peft_model(base, "stock", **config), peft_model(base, "peft-then-swap", **config)
    batch = padded_batch()
    steps = []
    for model in (stock, twin):
        torch.manual_seed(11)  # the same dropout draws: the fused path draws them in PEFT's order
        steps.append(training_step(model, batch))
    (loss0, grads0, _), (loss1, grads1, _) = steps
    assert grads1.keys() == grads0.keys() and any("lora_A" in n for n in grads0)
    assert rel(loss1, loss0) <= 1e-5, (loss1, loss0)
    worst = max(grads0, key=lambda n: rel(grads1[n], grads0[n]))
    assert rel(grads1[worst], grads0[worst]) <= 1e-4, (worst, rel(grads1[worst], grads0[worst]))
    adapted = 1 if "layers_to_transform" in config else base.config.num_hidden_layers
    assert calls(twin) == {op: {"fused": adapted} for op in ("lora_qkv", "lora_o", "lora_mlp")}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma", "phi3"])
def test_a_bfloat16_lora_step_is_as_close_to_float64_as_stock(family):
    """bf16 base, float32 adapters (PEFT's default autocast_adapter_dtype): within stock's own error."""
    reference = peft_model(build(family, torch.float64), "stock")
    base = build(family, torch.bfloat16)
    stock = peft_model(base, "stock")
    twin = peft_model(base, "peft-then-swap")
    adapters = [p for n, p in twin.named_parameters() if "lora_A" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)  # the mixed-dtype path
    batch = padded_batch()
    loss_ref, grads_ref, _ = training_step(reference, batch)
    loss0, grads0, _ = training_step(stock, batch)
    loss1, grads1, _ = training_step(twin, batch)
    assert rel(loss1, loss_ref) <= 1.5 * rel(loss0, loss_ref) + 2e-3
    names = sorted(grads_ref)
    flat = {k: torch.cat([g[n].double().flatten() for n in names]) for k, g in (("ref", grads_ref), ("stock", grads0), ("twin", grads1))}
    assert rel(flat["twin"], flat["ref"]) <= 1.5 * rel(flat["stock"], flat["ref"]) + 2e-3
    # Per tensor, the small adapter gradients of a tiny bf16 model are rounding noise: the kernels
    # without LoRA ops already reach 2.2x stock's error on a q_proj.lora_A here (2026-12-01).
    for name, ref in grads_ref.items():
        assert rel(grads1[name], ref) <= 3 * rel(grads0[name], ref) + 2e-3, name
    assert calls(twin)["lora_mlp"] == {"fused": base.config.num_hidden_layers}


# --- what the fused MLP saves for backward --------------------------------------------------


def test_the_fused_mlp_saves_only_x_gate_up_and_the_r_wide_products():
    base = build("llama")
    model = peft_model(base, "peft-then-swap")
    mlp_ = model.base_model.model.model.layers[0].mlp
    x = torch.randn(2, 5, base.config.hidden_size, requires_grad=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp_(x)
    inter, r = base.config.intermediate_size, ALL_LINEAR["r"]
    # x, gate, up, and each projection's r-wide drop(x) A^T (float32 throughout: no adapter casts
    # to keep), so that backward does not compute it again
    assert sum(saved) == 10 * (base.config.hidden_size + 2 * inter + 3 * r) * 4, saved
    # nothing kept beside save_for_backward: the fused node (eager: the op's functions without the
    # custom-op boundary) holds its spec, a flag and where the kept products lie among the saved
    node = out.grad_fn.next_functions[0][0]
    assert type(node).__name__ == "_EagerMLPBackward"
    held = torch.utils._pytree.tree_leaves(dict(vars(node)))
    assert not [v for v in held if isinstance(v, torch.Tensor)], held
    assert sorted(node.kept_at) == [(0, "xa"), (1, "xa"), (2, "xa")]


def test_the_fused_mlp_in_eager_never_crosses_a_custom_op_boundary(monkeypatch):
    # the boundary costs tens of microseconds a call: in eager the fused functions and the GLU they
    # call run their implementations directly, forward and backward
    model = peft_model(build("llama"), "peft-then-swap", lora_dropout=0.1)
    model.train()
    mlp_ = model.base_model.model.model.layers[0].mlp
    crossed = []
    for namespace in (torch.ops.accel_kernels, torch.ops.accel_patch_lora):
        for name in ("glu", "glu_backward", "mlp", "mlp_backward"):
            if hasattr(namespace, name):
                real = getattr(namespace, name)
                monkeypatch.setattr(namespace, name, lambda *a, _n=name, _r=real: crossed.append(_n) or _r(*a))
    x = torch.randn(2, 5, mlp_.gate_proj.in_features, requires_grad=True)
    mlp_(x).sum().backward()
    assert crossed == [], crossed
    assert calls(model) == {"lora_mlp": {"fused": 1}}


# --- QLoRA ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    build("llama").save_pretrained(path)
    return path


def qlora(checkpoint, monkeypatch, kernels):
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    monkeypatch.setenv("ACCEL_PATCH_KERNELS", kernels)  # the load hook swaps these: swap before PEFT
    model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=quant)
    monkeypatch.delenv("ACCEL_PATCH_KERNELS")
    return model


@pytest.mark.parametrize("order", ["swap-then-peft", pytest.param("peft-then-swap", marks=pytest.mark.slow)])
def test_qlora_on_cpu_trains_as_stock_with_the_4bit_base_dequantized_inside(monkeypatch, checkpoint, order):
    pytest.importorskip("bitsandbytes")
    stock = qlora(checkpoint, monkeypatch, "0")
    twin = qlora(checkpoint, monkeypatch, "lora" if order == "swap-then-peft" else "0")
    assert type(twin.model.layers[0].mlp.gate_proj).__name__ == "Linear4bit"
    packed = [(p, p.detach().clone()) for p in twin.parameters()]
    torch.manual_seed(3)
    stock = get_peft_model(stock, LoraConfig(**ALL_LINEAR))
    torch.manual_seed(3)
    twin = get_peft_model(twin, LoraConfig(**ALL_LINEAR))
    if order == "peft-then-swap":
        swap_kernels(twin, LORA_OPS)
    assert_step_equals_stock(stock, twin)
    assert calls(twin) == {op: {"fused": 2} for op in ("lora_mlp", "lora_qkv", "lora_o")}
    assert all(torch.equal(p, value) for p, value in packed)  # the 4-bit weights are never modified


# --- decided at call time: every fall-back runs PEFT's forward and is counted ------------------


FALLBACKS = {
    # name: (LoraConfig overrides, change after get_peft_model, outcome counted for the MLP)
    "DoRA": ({"use_dora": True}, None, "PEFT's forward: a LoRA variant (DoraLinearVariant, e.g. DoRA)"),
    "lora_bias": ({"lora_bias": True}, None, "PEFT's forward: lora_bias"),
    "two active adapters": ({}, "two_adapters", "PEFT's forward: more than one active adapter (default, second)"),
    "fan_in_fan_out": ({}, "fan_in_fan_out", "PEFT's forward: fan_in_fan_out"),
    "mixed dtypes": ({}, "float64_adapter", "PEFT's forward: mixed dtypes (input torch.float32, adapter torch.float64/torch.float64)"),
    "other base layer": ({}, "int8_like_base", "PEFT's forward: base layer Int8Like is neither a plain nor a bitsandbytes 4-bit linear"),
    "an adapter layer under the LoRA layer": ({}, "nested", "PEFT's forward: an adapter layer "
                                              "(peft.tuners.lora.layer.Linear) under the LoRA layer"),
    "a forward set on the instance": ({}, "instance_forward", "PEFT's forward: a forward set on a projection's instance"),
    "a parametrized adapter weight": ({}, "parametrized", "PEFT's forward: an adapter weight that is not a "
                                      "parameter (parametrized)"),
}


class Halved(torch.nn.Module):
    """A parametrization: the adapter computes with half its stored weight."""

    def forward(self, w):
        return 0.5 * w


class Int8Like(torch.nn.Linear):
    """Stands for a quantized base the fused path cannot compute (bitsandbytes 8-bit, GPTQ, ...)."""

    def forward(self, x):
        return super().forward(x)


def _change(model, what):
    mlps = [m for n, m in model.named_modules() if n.endswith("mlp")]
    if what == "two_adapters":
        torch.manual_seed(4)
        model.add_adapter("second", LoraConfig(**ALL_LINEAR))
        model.base_model.set_adapter(["default", "second"])
    elif what == "fan_in_fan_out":
        for m in mlps:
            m.up_proj.fan_in_fan_out = True
    elif what == "float64_adapter":
        for m in mlps:
            m.up_proj.lora_A["default"].double()  # PEFT then computes that adapter in float64
            m.up_proj.lora_B["default"].double()
    elif what == "int8_like_base":
        for m in mlps:
            old = m.up_proj.base_layer
            new = Int8Like(old.in_features, old.out_features, bias=False)
            new.weight = old.weight
            m.up_proj.base_layer = new
    elif what == "nested":  # a LoHa/LoKr layer of a mixed model, or a model wrapped twice: its term counts
        for m in mlps:
            m.up_proj.base_layer = copy.deepcopy(m.up_proj)
    elif what == "instance_forward":  # X-LoRA's way of wrapping a projection, or a user's
        for m in mlps:
            m.up_proj.forward = lambda x, *a, _f=m.up_proj.forward, **k: 0.5 * _f(x, *a, **k)
    elif what == "parametrized":
        for m in mlps:
            torch.nn.utils.parametrize.register_parametrization(m.up_proj.lora_A["default"], "weight", Halved())


QUICK_FALLBACKS = {"lora_bias", "other base layer"}


@pytest.mark.parametrize("name", [n if n in QUICK_FALLBACKS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(FALLBACKS)])
def test_each_fall_back_runs_pefts_forward_for_that_call_and_is_counted(name):
    config, change, outcome = FALLBACKS[name]
    base = build("llama")
    stock = peft_model(base, "stock", **config)
    twin = peft_model(base, "swap-then-peft", **config)
    for m in (stock, twin):
        _change(m, change)
    batch = padded_batch()
    torch.manual_seed(5)
    loss0, grads0, _ = training_step(stock, batch)
    torch.manual_seed(5)  # the same dropout masks
    loss1, grads1, _ = training_step(twin, batch)
    assert grads1.keys() == grads0.keys()
    assert rel(loss1, loss0) <= 1e-5 and max(rel(grads1[k], g) for k, g in grads0.items()) <= 1e-4
    assert calls(twin)["lora_mlp"] == {outcome: 2}, calls(twin)


HOOKED = {
    # name: (module under each decoder layer, hook kind, the op whose calls run PEFT's forward)
    "gate_proj backward": ("mlp.gate_proj", "backward", "lora_mlp"),
    "k_proj backward": ("self_attn.k_proj", "backward", "lora_qkv"),
    "o_proj forward": ("self_attn.o_proj", "forward", "lora_o"),
    "up_proj's lora_A forward": ("mlp.up_proj.lora_A.default", "forward", "lora_mlp"),
    "v_proj's base pre-forward": ("self_attn.v_proj.base_layer", "pre", "lora_qkv"),
}
QUICK_HOOKED = {"gate_proj backward", "k_proj backward"}


@pytest.mark.parametrize("name", [n if n in QUICK_HOOKED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(HOOKED)])
def test_a_hook_on_a_projection_runs_as_in_stock_peft_with_pefts_forward_counted(name):
    """The fused functions never call the projections' modules: a hook registered on one (or on
    its base layer or adapter) sends that group's call to PEFT's forward, so the hook runs as often
    as in stock PEFT, with the same step."""
    where, kind, op = HOOKED[name]
    base = build("llama")
    stock, twin = peft_model(base, "stock"), peft_model(base, "swap-then-peft")
    ran = {}
    for label, model in (("stock", stock), ("twin", twin)):
        ran[label] = 0

        def hook(*_, label=label):
            ran[label] += 1

        for layer in model.base_model.model.model.layers:
            module = layer.get_submodule(where)
            {"backward": module.register_full_backward_hook, "forward": module.register_forward_hook,
             "pre": module.register_forward_pre_hook}[kind](hook)
    assert_step_equals_stock(stock, twin)
    assert ran["stock"] == base.config.num_hidden_layers and ran["twin"] == ran["stock"]
    assert calls(twin)[op] == {"PEFT's forward: hooks on a projection": base.config.num_hidden_layers}, calls(twin)


class ReadsItsProjections(LlamaAttention):
    """An attention forward that reads its projections' attributes besides calling them (as
    gpt_neo's reads `self.q_proj.weight.dtype`)."""

    def forward(self, hidden_states, *args, **kwargs):
        hidden_states = hidden_states.to(self.q_proj.weight.dtype)
        assert self.k_proj.in_features == self.o_proj.out_features == hidden_states.shape[-1]
        return super().forward(hidden_states, *args, **kwargs)


def reading_projections(model):
    for layer in model.base_model.model.model.layers:
        layer.self_attn.__class__ = ReadsItsProjections
    return model


@pytest.mark.slow  # about 2 s
def test_an_attention_reading_its_projections_attributes_sees_the_projections_and_fuses():
    base = build("llama")
    stock = reading_projections(peft_model(base, "stock"))
    twin = reading_projections(peft_model(base, "peft-then-swap"))
    assert_step_equals_stock(stock, twin)
    assert calls(twin)["lora_qkv"] == calls(twin)["lora_o"] == {"fused": base.config.num_hidden_layers}


@pytest.mark.slow  # over 2 s
def test_an_adapter_disabled_merged_switched_or_removed_after_the_swap_is_seen_at_the_next_call():
    base = build("llama")
    stock, twin = peft_model(base, "stock"), peft_model(base, "swap-then-peft")
    batch = padded_batch()
    with stock.disable_adapter(), twin.disable_adapter(), torch.no_grad():  # off: the module's forward
        assert rel(twin(**batch).loss, stock(**batch).loss) <= 1e-5
    assert calls(twin)["lora_mlp"] == {lora.NO_ADAPTER: 2}
    for m in (stock, twin):  # a second adapter, switched to
        torch.manual_seed(4)
        m.add_adapter("second", LoraConfig(**ALL_LINEAR))
        m.set_adapter("second")
    assert_step_equals_stock(stock, twin)
    assert calls(twin)["lora_mlp"] == {lora.NO_ADAPTER: 2, "fused": 2}
    for m in (stock, twin):
        m.merge_adapter()
    stock.eval(), twin.eval()
    with torch.no_grad():
        assert rel(twin(**batch).logits, stock(**batch).logits) <= 1e-5
    assert calls(twin)["lora_mlp"][lora.NO_ADAPTER] == 4
    for m in (stock, twin):
        m.unmerge_adapter()
        m.delete_adapter("second")
        m.set_adapter("default")
    assert_step_equals_stock(stock, twin)
    assert calls(twin)["lora_mlp"]["fused"] == 4


def test_a_projection_is_read_through_its_own_get_base_layer():
    """Each call finds a LoRA layer's base as PEFT's get_base_layer does (the walk down the
    base_layer submodules, read from their dicts), and through a class's own get_base_layer where
    one replaces PEFT's."""
    model = peft_model(build("llama"), "stock")
    layers = [m for m in model.modules() if plans._is_lora_layer(m)]
    assert len(layers) == 14 and all(plans.base_layer(m) is m.get_base_layer() for m in layers)
    m = layers[0]
    other = torch.nn.Linear(m.in_features, m.out_features, bias=False).requires_grad_(False)
    m.__class__ = type("OwnBase", (type(m),), {"get_base_layer": lambda self: other})
    assert plans.base_layer(m) is other
    proj, _ = plans.projection(m, torch.randn(3, m.in_features))
    assert proj.weight is other.weight


@pytest.mark.slow
def test_a_base_layer_the_fused_path_cannot_compute_is_refused_at_swap_time():
    base = build("llama")
    model = get_peft_model(copy.deepcopy(base), LoraConfig(**ALL_LINEAR))
    mlp0 = model.base_model.model.model.layers[0].mlp
    old = mlp0.down_proj.base_layer
    mlp0.down_proj.base_layer = Int8Like(old.in_features, old.out_features, bias=False)
    report = swap_kernels(model, "lora")
    refused = [r for r in report.refused if r.op == "lora_mlp"]
    assert [r.where for r in refused] == ["model.layers.0.mlp"]
    assert "projection down_proj is Int8Like: neither a plain nor a bitsandbytes 4-bit linear" in refused[0].reason
    assert report.swapped["lora_mlp"] == 1


# --- the probe checks gradients: a broken backward is refused ---------------------------------


@pytest.fixture
def fresh_probes():
    probe.cache.clear()
    yield
    probe.cache.clear()


def _drop_dB(original):
    def broken(*args):
        dx, dA, dB = original(*args)
        return dx, dA, None if dB is None else torch.zeros_like(dB)
    return broken


@pytest.mark.parametrize("mutation, op, expect", [
    ("drop dB", "lora_mlp", ".B relative error"),
    pytest.param("drop dB", "lora_qkv", ".B relative error", marks=pytest.mark.slow),
    pytest.param("swap gate and up in backward", "lora_mlp", "relative error", marks=pytest.mark.slow),
])
def test_the_probe_refuses_a_broken_backward(monkeypatch, fresh_probes, mutation, op, expect):
    if mutation == "drop dB":
        monkeypatch.setattr(lora.functions, "proj_backward", _drop_dB(lora.functions.proj_backward))
    else:
        original = lora.functions.glu_backward
        monkeypatch.setattr(lora.functions, "glu_backward", lambda act, dh, gate, up: original(act, dh, up, gate))
    model = peft_model(build("llama"), "peft-then-swap", ops_="lora")
    report = swap_kernels(model, "lora")
    refused = [r for r in report.refused if r.op == op]
    assert len(refused) == 2 and "differs from PEFT's LoRA" in refused[0].reason and expect in refused[0].reason
    assert op not in report.swapped


# --- reversible; nothing saved changes --------------------------------------------------------


@pytest.mark.slow  # over 2 s
def test_restore_puts_back_the_same_objects_and_adapters_save_the_same_bytes(tmp_path):
    base = build("llama")
    stock = peft_model(base, "stock")
    twin = peft_model(base, "stock")
    before = {n: dict(m.__dict__) for n, m in twin.named_modules()}
    swap_kernels(twin)
    stock.save_pretrained(tmp_path / "stock")
    twin.save_pretrained(tmp_path / "twin")
    assert_same_files(tmp_path / "stock", tmp_path / "twin")
    training_step(twin, padded_batch())
    assert restore_kernels(twin)
    after = {n: dict(m.__dict__) for n, m in twin.named_modules()}
    assert before.keys() == after.keys()
    for name, d in before.items():
        assert after[name].keys() == d.keys(), name
        for key in ("forward", "_old_forward", lora.SITE_ATTR, lora.INNER_ATTR):
            assert after[name].get(key) is d.get(key), (name, key)


@pytest.mark.slow
def test_a_deep_copy_of_a_swapped_model_is_restored_whole():
    twin = peft_model(build("llama"), "peft-then-swap")
    copied = copy.deepcopy(twin)
    layers = copied.base_model.model.model.layers
    layers[1].extra = copy.deepcopy(layers[0].mlp)  # a copy made after the swap, as modules_to_save does
    restore_kernels(copied)
    assert not any(sites.is_swapped(m) for m in copied.modules())
    left = {(n, a) for n, m in copied.named_modules() for a in m.__dict__ if a.startswith("_accel_patch")}
    assert not left, sorted(left)  # the LoRA site's data and the forward it sat on are gone too


@pytest.mark.slow
def test_layers_peft_replicates_after_the_swap_are_counted_in_the_report_and_restored():
    """PEFT's `layer_replication` deep-copies each decoder layer (weights shared) after a swap made
    before `get_peft_model`: the copies' sites first count into tables of their own, which the
    report adopts, so every layer that ran is counted; restore puts the copies' forwards back."""
    base = build("llama")
    config = {**ALL_LINEAR, "layer_replication": [[0, 2], [0, 2]]}
    torch.manual_seed(3)
    stock = get_peft_model(copy.deepcopy(base), LoraConfig(**config))
    twin = copy.deepcopy(base)
    swap_kernels(twin)
    torch.manual_seed(3)  # the same adapters
    twin = get_peft_model(twin, LoraConfig(**config))
    assert len(twin.base_model.model.model.layers) == 4
    assert_step_equals_stock(stock, twin)
    for _ in range(2):  # a second report adopts nothing twice
        counted = accel_patch.report(twin).calls
        assert {op: counted[op] for op in (*lora.OPS, "rope")} == {op: {lora.FUSED: 4} for op in (*lora.OPS, "rope")}
    restore_kernels(twin)
    assert not any(sites.is_swapped(m) for m in twin.modules())


@pytest.mark.slow
def test_a_deep_copy_of_a_swapped_model_counts_its_own_calls_from_zero():
    """The copy (a reference model, as TRL makes one) reports what ran on it, not the original's
    calls; the original's counts are left as they were."""
    twin = peft_model(build("llama"), "peft-then-swap")
    training_step(twin, padded_batch())
    copied = copy.deepcopy(twin)
    assert calls(copied) == {}
    training_step(copied, padded_batch())
    training_step(copied, padded_batch())
    assert calls(copied) == {op: {lora.FUSED: 4} for op in lora.OPS}
    assert calls(twin) == {op: {lora.FUSED: 2} for op in lora.OPS}


# --- names and the glu interplay --------------------------------------------------------------


def test_lora_names_are_accepted_everywhere_ops_are_chosen():
    from accel_patch.integrations import config_entry

    assert ops.resolve_ops("lora") == ("lora_mlp", "lora_qkv", "lora_o")
    assert ops.resolve_ops(["glu", "lora_o"]) == ("glu", "lora_o")
    assert ops.ops_from_env({"ACCEL_PATCH_KERNELS": "rms_norm,lora"}) == ("rms_norm", "lora_mlp", "lora_qkv", "lora_o")
    assert config_entry._kernels("swiglu, lora") == "glu,lora_mlp,lora_qkv,lora_o"
    with pytest.raises(ValueError, match="'lora_up'"):
        ops.resolve_ops("lora_up")


def test_with_glu_the_fused_lora_mlp_wins_and_runs_the_glu_kernel():
    from accel_kernels import _launch

    twin = peft_model(build("llama"), "swap-then-peft", ops_="glu,lora_mlp")
    with _launch.recording() as launched:
        training_step(twin, padded_batch())
    assert {"_glu_forward_kernel", "_glu_backward_kernel"} <= set(launched)
    assert calls(twin) == {"lora_mlp": {"fused": 2}}
    report = swap_kernels(twin)  # asking again: counts both and the calls so far
    assert report.swapped["glu"] == 2 and report.swapped["lora_mlp"] == 2
    assert "lora_mlp" in str(report) and "fused" in str(report)
    with twin.disable_adapter(), _launch.recording() as launched, torch.no_grad():
        twin(**padded_batch())
    assert "_glu_forward_kernel" in launched  # no adapter: the glu forward beneath
    assert calls(twin)["lora_mlp"][lora.NO_ADAPTER] == 2


# --- Trainer: gradient accumulation and gradient checkpointing --------------------------------


@pytest.mark.slow
def test_trainer_with_accumulation_and_checkpointing_logs_and_learns_as_peft_stock(tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    from test_training import Rows

    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "0")  # nothing swapped by the Trainer callback: the twin by hand
    base = build("llama")
    stock = peft_model(base, "stock")
    twin = peft_model(base, "swap-then-peft")

    def train(model, out):
        args = TrainingArguments(output_dir=str(out), max_steps=2, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs={"use_reentrant": False},
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none",
                                 disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, seed=0, data_seed=0)
        trainer = Trainer(model=model, args=args, train_dataset=Rows())
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}

    losses0, weights0 = train(stock, tmp_path / "stock")
    losses1, weights1 = train(twin, tmp_path / "twin")
    assert len(losses0) == 2 and losses1 == pytest.approx(losses0, rel=1e-5)
    assert weights0 and max(rel(weights1[n], w) for n, w in weights0.items()) <= 1e-4
    # 4 micro-batches x 2 layers, each forward run again by checkpointing in backward
    assert calls(twin) == {op: {"fused": 16} for op in ("lora_mlp", "lora_qkv", "lora_o")}
    assert all_calls(twin)["tiled_mlp"] == {tiled_mlp.SHORT: 16}


@pytest.mark.slow
def test_a_bitsandbytes_8bit_base_is_refused_at_swap_time_with_the_reason(monkeypatch, checkpoint):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    monkeypatch.setenv("ACCEL_PATCH_KERNELS", "0")
    model = LlamaForCausalLM.from_pretrained(checkpoint, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    report = swap_kernels(model, "lora")
    assert not report.swapped
    reasons = {(r.op, r.reason) for r in report.refused}
    assert ("lora_mlp", "projection gate_proj is Linear8bitLt: neither a plain nor a bitsandbytes 4-bit linear") in reasons
    assert {op for op, _ in reasons} == {"lora_mlp", "lora_qkv", "lora_o"}


def test_an_attention_with_a_quantized_output_projection_still_fuses_its_qkv():
    model = get_peft_model(copy.deepcopy(build("llama")), LoraConfig(**ALL_LINEAR))
    attn = model.base_model.model.model.layers[0].self_attn
    old = attn.o_proj.base_layer
    attn.o_proj.base_layer = Int8Like(old.in_features, old.out_features, bias=False)
    report = swap_kernels(model, "lora")
    assert report.swapped == {"lora_mlp": 2, "lora_qkv": 2, "lora_o": 1}
    (refused,) = report.refused
    assert refused == ("model.layers.0.self_attn", "lora_o",
                       "projection o_proj is Int8Like: neither a plain nor a bitsandbytes 4-bit linear")


def test_a_model_without_lora_layers_takes_the_sites_fast_path(monkeypatch):
    # No PEFT layer under a site: one dict check, the module's own forward, nothing counted, and
    # the fused LoRA plan is never looked for (what keeps benchmarks/overhead.py within 1.1x).
    twin = build("llama")
    report = swap_kernels(twin)
    assert {"lora_mlp", "lora_qkv", "lora_o"} == set(report.waiting)  # installed, waiting for adapters
    monkeypatch.setattr(lora.sites, "_plan", lambda *a: pytest.fail("a site without LoRA layers planned a fused call"))
    stock = build("llama")
    loss0, _, _ = training_step(stock, padded_batch())
    loss1, _, _ = training_step(twin, padded_batch())
    assert rel(loss1, loss0) <= 1e-5
    assert {op: c for op, c in calls(twin).items() if op in lora.OPS} == {}


def _bart_pair(dropout):
    """A tiny Bart with LoRA on every attention projection (its decoder's cross-attention reads
    keys and values from the encoder's states): stock PEFT and swapped, the same adapters."""
    import transformers

    torch.manual_seed(0)
    base = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2))
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])
    pair = []
    for swap in (False, True):
        torch.manual_seed(3)
        model = get_peft_model(copy.deepcopy(base), config)
        if swap:
            swap_kernels(model, "lora_qkv,lora_o")
        pair.append(model.train())
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(3, 100, (2, 12), generator=g),
             "labels": torch.randint(3, 100, (2, 10), generator=g)}
    ran = []
    for model in pair:
        torch.manual_seed(5)
        out = model(**batch)
        out.loss.backward()
        ran.append((out.logits.detach(), torch.get_rng_state(),
                    {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    return ran, calls(pair[1])


@pytest.mark.slow
def test_a_cross_attention_runs_pefts_projections_with_pefts_dropout_masks():
    """An attention called with a second input for keys and values (Bart's decoder's
    cross-attention: `key_value_states`) runs its q/k/v as PEFT does, one dropout mask each in
    PEFT's order: the same logits, gradients and RNG state after the step as stock, with the
    self-attentions fused. Red when the group is fused from the queries' input (masks drawn for
    keys and values on the wrong tensor, the group computed twice)."""
    ((l0, rng0, g0), (l1, rng1, g1)), counted = _bart_pair(dropout=0.1)
    assert torch.equal(rng1, rng0), "the step drew other random numbers than stock"
    assert rel(l1, l0) <= 1e-6 and g1.keys() == g0.keys()
    assert max(rel(g1[n], g) for n, g in g0.items()) <= 1e-5
    assert counted["lora_qkv"] == {"fused": 2, "PEFT's forward: cross-attention (key_value_states)": 1}, counted


@pytest.mark.slow
def test_a_group_projection_called_on_another_input_is_pefts_and_counted(monkeypatch):
    """An attention of a form the site does not know passing keys and values another tensor
    (here Bart's cross-attention with its keyword unrecognised): the group fused from the queries'
    input is not computed again; the other projections run PEFT's forward, counted, and the step
    equals stock's. Red when the group is fused a second time from the second input."""
    monkeypatch.setattr(lora.sites, "CROSS_INPUTS", ())
    ran, counted = _bart_pair(dropout=0.0)
    (l0, _, g0), (l1, _, g1) = ran
    assert rel(l1, l0) <= 1e-6 and max(rel(g1[n], g) for n, g in g0.items()) <= 1e-5
    assert counted["lora_qkv"] == {"fused": 3, lora.sites.ANOTHER_INPUT: 1}, counted


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mlp", "attention"])
def test_a_second_derivative_through_fused_lora_raises_instead_of_losing_its_part(where):
    """Fused LoRA's backwards are first-order: under backward(create_graph=True) (a gradient
    penalty, a Hessian-vector product) they raise, naming the way out, instead of handing autograd
    constants that drop the projections' part of the second derivative. Red when the backward runs
    through create_graph."""
    base = build("llama")
    twin = peft_model(base, "swap-then-peft", LORA_OPS, target_modules=["up_proj"] if where == "mlp" else ["q_proj"])
    batch = padded_batch()
    loss = twin(**batch).loss
    params = [p for p in twin.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="fused LoRA gives first-order gradients only.*ACCEL_PATCH_KERNELS"):
        torch.autograd.grad(loss, params, create_graph=True)
    assert calls(twin)["lora_mlp" if where == "mlp" else "lora_qkv"] == {"fused": 2}, calls(twin)


@pytest.mark.slow
def test_adalora_runs_pefts_forward_counted_as_such_not_as_no_adapter():
    """AdaLoRA keeps its adapters as a ParameterDict of SVD factors, which the fused functions do
    not compute: PEFT's forward runs, counted with that reason (it read "no active LoRA adapter"
    before, which was untrue), and the step equals stock's."""
    from peft import AdaLoraConfig

    base = build("llama")
    config = AdaLoraConfig(init_r=6, target_r=4, total_step=10, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "v_proj", "up_proj"])
    pair = []
    for swap in (False, True):
        torch.manual_seed(3)
        model = copy.deepcopy(base)
        if swap:
            swap_kernels(model, LORA_OPS)
        pair.append(get_peft_model(model, config))
    assert_step_equals_stock(*pair)
    reason = "PEFT's forward: adapters held as a ParameterDict (AdaLoRA's SVD form)"
    assert calls(pair[1]) == {"lora_qkv": {reason: 2}, "lora_mlp": {reason: 2},
                              "lora_o": {lora.sites.NO_ADAPTER: 2}}, calls(pair[1])  # o_proj: no adapter


@pytest.mark.slow
@pytest.mark.parametrize("order", ["swap-then-peft", "peft-then-swap"])
def test_a_peft_mixed_model_is_seen_through_by_report_swap_and_restore(order):
    """get_peft_model(..., mixed=True) returns a PeftMixedModel, which has no get_base_model: the
    report, the swap and the restore reach the transformers model inside it, as through a
    PeftModel. Red when the report of the wrapper is None (swapped before) or the swap's state
    lands on the wrapper (swapped after)."""
    model = copy.deepcopy(build("llama"))
    if order == "swap-then-peft":
        swap_kernels(model, LORA_OPS)
    torch.manual_seed(3)
    mixed = get_peft_model(model, LoraConfig(**{**ALL_LINEAR, "target_modules": ["q_proj", "v_proj"]}), mixed=True)
    if order == "peft-then-swap":
        swap_kernels(mixed, LORA_OPS)
    assert accel_patch.swaps.apply.unwrap(mixed) is model
    training_step(mixed, padded_batch())
    assert accel_patch.report(mixed).calls["lora_qkv"] == {"fused": 2}
    restore_kernels(mixed)
    assert accel_patch.report(mixed) is None
    assert not [m for m in model.modules() if "forward" in m.__dict__]
