"""MLP and experts forms of the 2026 families, built from their own config classes: Granite's
shared MLP (`input_linear` fused gate+up, `output_linear`) runs the GLU kernel; Nemotron-H's
non-gated ReLU² MLP runs the ReLU² kernel; both non-gated MLPs (and Apertus's xIELU, refused by
the glu site with its form named) are tiled;
LongCat-Flash's identity "zero" experts run on the experts op; Nemotron-H's non-gated experts are
refused with their form named. Each swap is checked against stock on a forward and backward, and
the kernel is seen to run (launches, `report.calls`), not only the numbers."""
from __future__ import annotations

import copy

import pytest
import torch

import accel_patch
from accel_kernels import _launch
from accel_patch.swaps import probe
from accel_patch.swaps.layers import mlp, tiled_mlp

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)


def build(config_name: str, **kwargs):
    """(stock, copy to swap) of a tiny model of the config class, or a skip where this transformers
    has no such family."""
    model_name = config_name.replace("Config", "ForCausalLM")
    if not hasattr(transformers, config_name) or not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)  # the class itself, not from_config: the load hook would swap (and probe) every op
    stock = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**TINY, **kwargs}))
    probe.cache.clear()
    return stock, copy.deepcopy(stock)


def step(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_step(stock, ours, batch, grad_bound=1e-4):
    l0, g0 = step(stock, batch)
    l1, g1 = step(ours, batch)
    assert torch.allclose(l0, l1, rtol=1e-5, atol=1e-6), (l0, l1)
    assert g0 and g0.keys() == g1.keys()
    for name in g0:
        err = ((g1[name] - g0[name]).norm() / g0[name].norm().clamp_min(1e-30)).item()
        assert err <= grad_bound, (name, err)
    return g0


def batch(tokens: int = 8, rows: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (rows, tokens), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


GRANITE = {
    "GraniteMoeHybridConfig": dict(intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=1,
                                   num_local_experts=4, num_experts_per_tok=2, layer_types=["attention"],
                                   mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8),
    "GraniteMoeSharedConfig": dict(intermediate_size=16, shared_intermediate_size=24, num_hidden_layers=1,
                                   num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("config_name", sorted(GRANITE))
def test_granites_shared_mlp_runs_the_glu_kernel_and_trains_as_stock(config_name):
    stock, ours = build(config_name, **GRANITE[config_name])
    report = accel_patch.swap_kernels(ours, ops=["glu"])
    assert report.swapped == {"glu": 1}, report
    assert not report.refused, report.refused
    with _launch.recording() as launched:
        assert_same_step(stock, ours, batch())
    # the shared MLP's input_linear holds gate and up: its halves are read in place (the row kernels)
    assert launched.count("_glu_forward_rows_kernel") == 1 and launched.count("_glu_backward_rows_kernel") == 1, launched


def test_experts_held_as_modules_with_3d_weights_are_no_gated_mlp():
    """JetMoE's MoE names its expert banks `input_linear` / `output_linear` too (3-D weights, a forward
    that routes): not a glu candidate, and no refusal row either."""
    if not hasattr(transformers, "JetMoeConfig"):
        pytest.skip("transformers has no JetMoE")
    from transformers.models.jetmoe import modeling_jetmoe

    config = transformers.JetMoeConfig(**TINY, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                       kv_channels=16)
    moe = modeling_jetmoe.JetMoeMoE(config)
    assert moe.input_linear.weight.dim() == 3
    assert mlp.candidate(moe) is None and tiled_mlp.candidate(moe) is None


NEMOTRON_H = dict(intermediate_size=48, head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1)
NON_GATED = {
    "NemotronHConfig": ("ReLUSquaredActivation", dict(NEMOTRON_H, hybrid_override_pattern="*-")),
    "ApertusConfig": ("XIELUActivation", dict(intermediate_size=48, num_hidden_layers=1)),
}


@pytest.fixture
def tile_everything(monkeypatch):
    """Tile every call of the tiny models, 4 tokens a chunk (the documented knobs, read per call)."""
    monkeypatch.setattr(tiled_mlp, "MIN_ELEMENTS", 1)
    monkeypatch.setattr(tiled_mlp, "chunk_tokens", lambda hidden, intermediate: 4)


def test_nemotron_hs_relu2_mlp_runs_the_relu_squared_kernel_and_trains_as_stock():
    stock, ours = build("NemotronHConfig", **NON_GATED["NemotronHConfig"][1])
    report = accel_patch.swap_kernels(ours, ops=["glu"])
    assert report.swapped == {"glu": 1}, report
    assert not report.refused, report.refused
    with _launch.recording() as launched:
        assert_same_step(stock, ours, batch())
    assert launched.count("_relu_squared_forward_kernel") == 1, launched
    assert launched.count("_relu_squared_backward_kernel") == 1, launched


def test_a_relu2_mlp_whose_activation_computes_something_else_is_refused():
    """The name says ReLU², the numbers decide: an activation named so that computes relu(x) is refused."""
    stock, ours = build("NemotronHConfig", **NON_GATED["NemotronHConfig"][1])
    [module] = [m for n, m in ours.named_modules() if n.endswith("mixer") and hasattr(m, "up_proj")]
    module.act_fn.forward = torch.relu
    report = accel_patch.swap_kernels(ours, ops=["glu"])
    [refusal] = [r for r in report.refused if r.op == "glu"]
    assert "ReLUSquaredActivation does not compute relu2" in refusal.reason, refusal


@pytest.mark.parametrize("config_name", sorted(NON_GATED))
def test_a_non_gated_mlp_is_tiled_and_trains_as_stock(tile_everything, config_name):
    act, kwargs = NON_GATED[config_name]
    stock, ours = build(config_name, **kwargs)
    report = accel_patch.swap_kernels(ours, ops=["glu", "tiled_mlp"])
    if act == "ReLUSquaredActivation":  # the ReLU² kernel runs in each chunk
        assert report.swapped == {"glu": 1, "tiled_mlp": 1}, report
    else:  # no kernel for xIELU: refused with the form named, tiled all the same
        assert report.swapped == {"tiled_mlp": 1}, report
        [refusal] = [r for r in report.refused if r.op == "glu"]
        assert refusal.reason.startswith(f"non-gated MLP down_proj({act}(up_proj(x))): no fused kernel"), refusal
    with _launch.recording() as launched:
        grads = assert_same_step(stock, ours, batch(tokens=9))  # 18 tokens: chunks of 4, ..., 4 and 2
    assert accel_patch.report(ours).calls["tiled_mlp"] == {tiled_mlp.TILED: 1}
    if act == "ReLUSquaredActivation":  # 5 chunks forward, 5 recomputed in backward
        assert launched.count("_relu_squared_forward_kernel") == 10, launched
    else:  # the activation's own parameters train through the chunks
        assert any(n.endswith("act_fn.alpha_p") for n in grads), sorted(grads)


def test_nemotron_hs_non_gated_experts_are_refused_with_their_form():
    stock, ours = build("NemotronHConfig", **NEMOTRON_H, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, hybrid_override_pattern="E")
    report = accel_patch.swap_kernels(ours, ops=["experts"])
    [refusal] = [r for r in report.refused if r.op == "experts"]
    assert refusal.where.endswith("mixer.experts"), refusal
    assert refusal.reason.startswith("non-gated MoE experts, down_proj(ReLUSquaredActivation(up_proj(x)))"), refusal
    assert "the op computes a GLU" in refusal.reason


LONGCAT = dict(ffn_hidden_size=48, expert_ffn_hidden_size=16, num_layers=1, n_routed_experts=4, zero_expert_num=2,
               moe_topk=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=8, head_dim=8)


@pytest.mark.slow  # the experts op interpreted, forward and backward: ~3 s
def test_longcat_flashs_zero_experts_run_on_the_experts_op_and_train_as_stock():
    stock, ours = build("LongcatFlashConfig", **LONGCAT)
    report = accel_patch.swap_kernels(ours, ops=["experts"])
    assert report.swapped == {"experts": 1}, report
    assert not report.refused, report.refused
    [experts] = [m for n, m in ours.named_modules() if n.endswith("mlp.experts")]
    [router] = [m for n, m in ours.named_modules() if n.endswith("mlp.router")]
    # transformers up to 5.24 keeps the 2 identity experts in the experts module (gate_up holds 6,
    # down 4: the site adds their tokens); from 5.25 the MoE block adds them and routes the
    # experts module only to the 4 with weights
    assert experts.down_proj.shape[0] == 4 and experts.gate_up_proj.shape[0] in (4, 6)
    routed = []
    router.register_forward_hook(lambda m, args, out: routed.append(out[-1]))
    with _launch.recording() as launched:
        assert_same_step(stock, ours, batch(tokens=12))
    assert bool((routed[0] >= 4).any()), "no token went to a zero expert: the step proves nothing about them"
    assert accel_patch.report(ours).calls["experts"] == {"fused": 1}
    assert {"_moe_gate_up_kernel", "_moe_weight_grad_kernel"} <= set(launched), sorted(set(launched))


def test_zero_experts_the_op_cannot_take_are_refused_with_the_reason():
    """A down bank holding more experts than gate_up: no reading of it is in the op."""
    from accel_patch.swaps import experts

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 4, 4))
            self.act_fn = torch.nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            return hidden_states

    module = Experts()
    found = experts.candidate(module)
    verdict = experts.probe_verdict(module, torch.float32, found)
    assert isinstance(verdict, str) and "identity (zero) experts" in verdict, verdict


@pytest.mark.slow  # PEFT's LoRA on the experts, the op interpreted: ~4 s
def test_longcat_flashs_zero_experts_with_lora_on_the_experts_train_as_stock_peft():
    """PEFT's factors for gate_up hold the zero experts too: the op reads the routed experts' only."""
    peft = pytest.importorskip("peft")
    stock, ours = build("LongcatFlashConfig", **LONGCAT)
    config = dict(r=2, lora_alpha=4, target_modules=[], lora_dropout=0.0, init_lora_weights=False,
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    models = []
    for model in (stock, ours):
        torch.manual_seed(3)
        models.append(peft.get_peft_model(model, peft.LoraConfig(**config)))
    report = accel_patch.swap_kernels(models[1], ops=["experts"])
    assert report.swapped == {"experts": 1}, report
    grads = assert_same_step(*models, batch(tokens=12))
    assert any("lora_A" in n for n in grads), sorted(grads)
    assert accel_patch.report(models[1]).calls["experts"] == {"fused (LoRA)": 1}
