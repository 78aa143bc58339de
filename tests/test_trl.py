"""accel-patch in TRL's trainers (the `trl-fused-head` patch): our fused loss in the place of the LM
head SFTTrainer installs, with TRL's losses and metrics; TRL's own head (and loss) where its shape
is not one we know, said in the report; the reference model of DPO, KTO and GRPO swapped like the
policy, so they train as stock."""
from __future__ import annotations

import math
import types

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import accel_patch
from accel_patch.patches import trl_fused_head
from accel_patch.swaps import sites
from accel_patch.swaps.layers import tiled_mlp
from accel_patch.swaps.apply import report_of

SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
WORDS = 40


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(WORDS)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def words(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g))


def common(tmp_path, **extra):
    return {**dict(output_dir=str(tmp_path), max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                   disable_tqdm=True, use_cpu=True, dataloader_num_workers=0, bf16=False), **extra}


class stock_accel_patch:
    """accel-patch turned off for a block (the stock run), on again after."""

    def __enter__(self):
        accel_patch.disable()

    def __exit__(self, *exc):
        accel_patch.enable()
        return False


def steps_of(trainer):
    from accel_patch.integrations.callback import training_logs

    return training_logs(trainer)  # as the loggers got them: with the callback's keys


def close(a, b, rel=2e-5, abs_=1e-6):
    return a == pytest.approx(b, rel=rel, abs=abs_)


# --- the patch's shape guard (no TRL needed) -----------------------------------------------------


def test_a_trl_whose_head_has_another_shape_is_skipped_with_the_reason():
    def moved(model, temperature=1.0):
        pass

    assert trl_fused_head.patch.check(types.SimpleNamespace(add_fused_lm_head=moved)) == (
        "add_fused_lm_head takes ('model', 'temperature'), not ('model', 'temperature', 'cast_lm_head_to_fp32', "
        "'outputs') (verified on trl 1.16)")
    assert "no add_fused_lm_head" in trl_fused_head.patch.check(types.SimpleNamespace())

    def same(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs",)):
        pass

    assert "FusedCausalLMOutput" in trl_fused_head.patch.check(types.SimpleNamespace(add_fused_lm_head=same))


@pytest.mark.slow  # imports TRL
def test_a_reference_model_gets_its_own_trainers_ops_never_the_last_trainers():
    """TRL installs a trainer's policy head, then its reference model's: the reference model is
    swapped with that policy's ops; a later trainer's reference model is not given them."""
    trl_utils = pytest.importorskip("trl.trainer.utils")

    class Trainer:  # a TRL trainer's set-up calls, policy first
        def __init__(self, policy, ref=None):
            trl_utils.add_fused_lm_head(policy)
            if ref is not None:
                trl_utils.add_fused_lm_head(ref)

    sft_policy = tiny_llama()
    accel_patch.swap_kernels(sft_policy, ops=["rms_norm"])  # a trainer with no reference model
    dpo_policy, dpo_ref = tiny_llama(), tiny_llama()
    accel_patch.swap_kernels(dpo_policy, ops=["rms_norm", "glu"])
    Trainer(sft_policy)
    Trainer(dpo_policy, dpo_ref)
    assert set(report_of(dpo_ref).swapped) == {"rms_norm", "glu"}
    lone_ref = tiny_llama()
    Trainer(sft_policy)
    trl_utils.add_fused_lm_head(lone_ref)  # another caller's model: the environment's ops, not SFT's
    assert "glu" in report_of(lone_ref).swapped and "rope" in report_of(lone_ref).swapped


# --- the head, field by field ---------------------------------------------------------------------


def _labels_with_hits(model, ids):
    """Completion-only labels (the first half ignored), half of the rest the model's own argmax, so
    that is_top1 has both values."""
    with torch.no_grad():
        top = model(input_ids=ids).logits.argmax(-1)
    labels = ids.clone()
    labels[:, 1:] = torch.where(torch.arange(ids.shape[1] - 1) % 2 == 0, top[:, :-1], ids[:, 1:])
    labels[:, : ids.shape[1] // 2] = -100
    return labels


DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")
GRPO_OUTPUTS = ("log_probs", "entropy")
#: (trainer whose add_fused_lm_head call it is, outputs, temperature, the entropy bonus in the loss, autocast)
HEAD_CASES = {
    "sft-fp32": (SFT_OUTPUTS, 1.0, 0.0, False),
    "sft-bf16": (SFT_OUTPUTS, 1.0, 0.0, True),
    "dpo-wpo-fp32": (DPO_OUTPUTS + ("log_sum_sq_probs",), 1.0, 0.0, False),
    "grpo-entropy-bonus-fp32": (GRPO_OUTPUTS, 0.7, 0.3, False),
    "grpo-entropy-bonus-bf16": (GRPO_OUTPUTS, 0.7, 0.3, True),
}


@pytest.fixture
def kernel_rows(monkeypatch):
    """The rows each call of the fused log-prob kernel received."""
    import accel_kernels

    seen = []
    kernel = accel_kernels.fused_linear_cross_entropy

    def spy(hidden, *args, **kwargs):
        seen.append(hidden.shape[0])
        return kernel(hidden, *args, **kwargs)

    monkeypatch.setattr(accel_kernels, "fused_linear_cross_entropy", spy)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("case", list(HEAD_CASES))
def test_our_head_gives_what_trls_head_gives(case, kernel_rows):
    """Each trainer's call of add_fused_lm_head: every field TRL's head gives, under its temperature,
    with the entropy's gradient where the loss trains on it (GRPO's entropy bonus), on the labelled
    rows only; and TRL's own head, on a twin of the model, as the reference."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    outputs, temperature, entropy_coef, autocast = HEAD_CASES[case]
    model = tiny_llama()
    accel_patch.swap_kernels(model)
    trl_utils.add_fused_lm_head(model, temperature=temperature, outputs=outputs)  # ours in front of TRL's
    assert report_of(model).head == trl_fused_head.OURS
    with stock_accel_patch():
        twin = tiny_llama()
        trl_utils.add_fused_lm_head(twin, temperature=temperature, outputs=outputs)  # TRL's head alone
    ids = torch.randint(4, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = _labels_with_hits(model, ids)
    kernel_rows.clear()  # (the swap's probe ran the kernel too)

    def run(m):
        m.train()  # dropout is 0 in this config
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        loss = out.loss - entropy_coef * (out.entropy * out.label_mask).sum() / out.label_mask.sum()
        loss.backward()
        grads = (m.lm_head.weight.grad.clone(), m.model.layers[1].mlp.down_proj.weight.grad.clone())
        m.zero_grad(set_to_none=True)
        return out, grads

    ours, ours_grads = run(model)
    assert kernel_rows == [int((labels[:, 1:] != -100).sum())]  # the prompt rows reach no kernel
    assert accel_patch.report(model).calls["fused_linear_cross_entropy"] == {trl_fused_head.FUSED_CALL: 1}
    trls, trls_grads = run(twin)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-5)
    assert torch.equal(ours.label_mask, trls.label_mask)
    for field in [o for o in outputs if o != "is_top1"] + ["loss"]:
        torch.testing.assert_close(getattr(ours, field), getattr(trls, field), **tol, msg=field)
        assert (getattr(ours, field)[~ours.label_mask] == 0).all() if field != "loss" else True
    for field in ("log_sum_sq_probs", "mean_logits", "is_top1"):  # what the trainer did not ask for: None
        if field not in outputs:
            assert getattr(ours, field) is None
    torch.testing.assert_close(ours_grads, trls_grads, **tol)
    if "is_top1" in outputs:
        hits = trls.is_top1[trls.label_mask]
        assert hits.any() and not hits.all()
        if autocast:  # bf16 logits tie more often; the argmax of two roundings may differ on a tie
            assert (ours.is_top1 == trls.is_top1).float().mean() > 0.9
        else:
            assert torch.equal(ours.is_top1, trls.is_top1)


@pytest.mark.slow
def test_a_moe_model_with_the_router_loss_runs_our_head_with_trls_aux_loss():
    """TRL turns on the router's auxiliary loss for MoE models: our head returns it beside the
    log-probs (the loss includes it as TRL's does), so ours runs in training passes too, counted."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def qwen3_moe():
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            output_router_logits=True, router_aux_loss_coef=0.5, pad_token_id=0))

    model = qwen3_moe()
    accel_patch.swap_kernels(model)
    trl_utils.add_fused_lm_head(model, outputs=SFT_OUTPUTS)
    with stock_accel_patch():
        twin = qwen3_moe()
        trl_utils.add_fused_lm_head(twin, outputs=SFT_OUTPUTS)  # TRL's head alone
    ids = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (model, twin):
        m.train()
        out = m(input_ids=ids, labels=ids, fused_lm_head=True)
        out.loss.backward()
        outs.append((out, m.lm_head.weight.grad.clone(), m.model.layers[0].mlp.gate.weight.grad.clone()))
    (ours, ours_head, ours_router), (trls, trls_head, trls_router) = outs
    assert accel_patch.report(model).calls["fused_linear_cross_entropy"] == {trl_fused_head.FUSED_CALL: 1}
    assert ours.aux_loss is not None and trls.aux_loss is not None
    torch.testing.assert_close(ours.aux_loss, trls.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.loss, trls.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_router, trls_router, rtol=1e-4, atol=1e-6)  # the aux loss trains the router
    torch.testing.assert_close(ours_head, trls_head, rtol=1e-4, atol=1e-6)
    assert "LM head: ours" in accel_patch.report(model).short()


@pytest.mark.slow
def test_a_reference_pass_under_no_grad_keeps_nothing_and_is_counted_as_ours():
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = tiny_llama()
    accel_patch.swap_kernels(model)
    trl_utils.add_fused_lm_head(model)  # a reference model's call: log_probs only
    ids = torch.randint(4, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.log_probs.grad_fn is None and out.entropy is None
    model.eval()  # evaluation mode too: our head, nothing kept
    with torch.no_grad():
        again = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert torch.equal(again.log_probs, out.log_probs)
    assert accel_patch.report(model).calls["fused_linear_cross_entropy"] == {trl_fused_head.FUSED_NO_GRAD: 2}


@pytest.mark.slow
def test_a_head_shape_we_do_not_know_keeps_trls_head_and_says_so(caplog):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    model = tiny_llama()
    accel_patch.swap_kernels(model)
    trl_forward_before = model.__dict__.get("forward")
    with caplog.at_level("INFO", logger="accel_patch"):
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "surprisal_rank"))  # a field our head does not give
    assert model.__dict__["forward"] is not trl_forward_before  # TRL's own, as TRL installed it
    assert model.forward.__func__.__code__.co_filename.endswith("trl/trainer/utils.py")
    report = report_of(model)
    assert "fused_linear_cross_entropy" not in report.swapped
    assert any("TRL's fused LM head runs" in r.reason for r in report.refused)
    assert report.short().endswith("LM head: TRL's") and "TRL's fused LM head runs" in caplog.text
    other = tiny_llama()
    accel_patch.swap_kernels(other, ops="rms_norm")  # no fused loss to put in TRL's place
    trl_utils.add_fused_lm_head(other, outputs=SFT_OUTPUTS)
    assert other.forward.__func__.__code__.co_filename.endswith("trl/trainer/utils.py")
    assert report_of(other).short() == "rms_norm 5; LM head: TRL's"


# --- trainers -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sft_trains_with_our_loss_and_stock_losses_and_metrics(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    # A small vocabulary of repeated words and a high learning rate: the model gets tokens right.
    data = datasets.Dataset.from_dict({"prompt": [words(g, 6) for _ in range(12)],
                                       "completion": [" ".join(["w1 w2 w3"] * 3) for _ in range(12)]})

    def train():
        model = tiny_llama()
        config = trl.SFTConfig(**common(tmp_path, max_steps=4, per_device_train_batch_size=4, learning_rate=3e-2,
                                        max_length=32))
        trainer = trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer())
        trainer.train()
        return trainer, model

    with stock_accel_patch():
        stock, stock_model = train()
    ours, model = train()
    assert sites.STATE_ATTR not in stock_model.__dict__
    assert model.__dict__[sites.STATE_ATTR].loss_calls == {"fused (in TRL's head)": 4}
    a, b = steps_of(stock), steps_of(ours)
    assert len(a) == len(b) == 4
    assert b[0]["accel_patch_swap"] == "rms_norm 5, rope 2, glu+tiled 2, fused_linear_cross_entropy 1; LM head: ours, in TRL's place"
    # counted in the report like every op decided per call; nothing fell back, and the logs fit a console
    calls = accel_patch.report(model).calls  # (the tiled MLP's short-sequence calls are by design)
    assert calls == {"fused_linear_cross_entropy": {"fused (in TRL's head)": 4}, "tiled_mlp": {tiled_mlp.SHORT: 16},
                     "rope": {"fused": 16}}
    assert not any("accel_patch_fallbacks" in h for h in b)
    assert all(len(v) <= 100 for h in b for v in h.values() if isinstance(v, str))
    assert any(h["mean_token_accuracy"] > 0 for h in a)  # the metric is exercised, not only 0
    for x, y in zip(a, b):
        for key in ("loss", "entropy"):
            assert close(y[key], x[key]), (key, x, y)
        assert close(y["grad_norm"], x["grad_norm"], rel=1e-4), (x, y)  # after steps at lr 3e-2
        assert y["mean_token_accuracy"] == x["mean_token_accuracy"] and y["num_tokens"] == x["num_tokens"]


@pytest.mark.slow
def test_packed_sft_with_lora_trains_as_stock(tmp_path):
    """Packing (TRL's default strategy: best-fit rows, padding-free, position_ids restarting at each
    sequence) with a recipe LoRA (all-linear, r=16, dropout 0.05): the fused LoRA, RoPE and loss see
    the packed rows' positions and give stock's losses and gradient norms."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    peft = pytest.importorskip("peft")
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"text": [words(g, int(n)) for n in torch.randint(6, 30, (16,), generator=g)]})

    def train():
        config = trl.SFTConfig(**common(tmp_path, per_device_train_batch_size=4, learning_rate=1e-2, max_length=64,
                                        packing=True, seed=0))
        lora = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                               task_type="CAUSAL_LM")
        trainer = trl.SFTTrainer(model=tiny_llama(), args=config, train_dataset=data, processing_class=tokenizer(),
                                 peft_config=lora)
        trainer.train()
        return trainer

    with stock_accel_patch():
        stock = train()
    ours = train()
    batch = next(iter(ours.get_train_dataloader()))
    assert "position_ids" in batch and int((batch["position_ids"] == 0).sum()) > 1  # several sequences a row
    calls = accel_patch.report(ours.model).calls
    for op in ("lora_qkv", "lora_o", "lora_mlp", "rope"):
        # 2 layers, 3 steps, each layer run again in backward (TRL's default gradient checkpointing)
        assert calls[op] == {"fused": 12}, (op, calls)
    assert calls["fused_linear_cross_entropy"] == {"fused (in TRL's head)": 3}
    a, b = steps_of(stock), steps_of(ours)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert close(y["loss"], x["loss"]), (x, y)
        assert close(y["grad_norm"], x["grad_norm"], rel=1e-4), (x, y)


def _preference_rows(n=8):
    g = torch.Generator().manual_seed(0)
    return {"prompt": [words(g, 5) for _ in range(n)], "chosen": [words(g, 4) for _ in range(n)],
            "rejected": [words(g, 4) for _ in range(n)]}


@pytest.mark.slow
def test_dpo_swaps_the_reference_model_and_trains_as_stock(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict(_preference_rows())

    def train():
        model, ref = tiny_llama(), tiny_llama()
        config = trl.DPOConfig(**common(tmp_path, per_device_train_batch_size=4, learning_rate=1e-3, max_length=24))
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=config, train_dataset=data,
                                 processing_class=tokenizer())
        trainer.train()
        return trainer, ref

    with stock_accel_patch():
        stock, _ = train()
    ours, ref = train()
    assert sites.is_swapped(ref.model.layers[0].mlp) and sites.is_swapped(ref.model.norm)  # as the policy
    # our head on both, DPO's own loss on their log-probs: every call counted as ours
    assert report_of(ours.model).head == report_of(ref).head == trl_fused_head.OURS
    assert accel_patch.report(ours.model).calls["fused_linear_cross_entropy"] == {trl_fused_head.FUSED_CALL: 3}
    assert accel_patch.report(ref).calls["fused_linear_cross_entropy"] == {trl_fused_head.FUSED_NO_GRAD: 3}
    a, b = steps_of(stock), steps_of(ours)
    # step 1 exactly as stock: the policy is the reference
    assert b[0]["loss"] == a[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert b[0]["rewards/accuracies"] == a[0]["rewards/accuracies"] == 0.0
    assert b[0]["rewards/margins"] == a[0]["rewards/margins"] == 0.0
    assert b[0]["accel_patch_swap"].endswith("LM head: ours, in TRL's place")
    for x, y in zip(a, b):
        assert close(y["loss"], x["loss"]) and close(y["grad_norm"], x["grad_norm"], rel=1e-4), (x, y)
        for key in ("logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy"):  # mean_logits, is_top1
            assert close(y[key], x[key], rel=1e-4), (key, x, y)


@pytest.mark.slow
def test_kto_trains_as_stock_with_the_reference_model_swapped(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    rows = _preference_rows()
    data = datasets.Dataset.from_dict({"prompt": rows["prompt"] * 2, "completion": rows["chosen"] + rows["rejected"],
                                       "label": [True] * 8 + [False] * 8})

    def train():
        model, ref = tiny_llama(), tiny_llama()
        config = trl.KTOConfig(**common(tmp_path, per_device_train_batch_size=4, learning_rate=1e-3, max_length=24))
        trainer = trl.KTOTrainer(model=model, ref_model=ref, args=config, train_dataset=data,
                                 processing_class=tokenizer())
        trainer.train()
        return trainer, ref

    with stock_accel_patch():
        stock, _ = train()
    ours, ref = train()
    assert sites.is_swapped(ref.model.layers[0].mlp)
    assert report_of(ours.model).head == report_of(ref).head == trl_fused_head.OURS
    assert trl_fused_head.FUSED_CALL in accel_patch.report(ours.model).calls["fused_linear_cross_entropy"]
    for x, y in zip(steps_of(stock), steps_of(ours)):
        assert close(y["loss"], x["loss"]) and close(y["grad_norm"], x["grad_norm"], rel=1e-4), (x, y)
        assert close(y["kl"], x["kl"], abs_=1e-6), (x, y)


def _length_reward(completions, **kwargs):
    return [float(len(c)) / 10 for c in completions]


@pytest.mark.slow
def test_grpo_trains_as_stock_with_an_in_process_reward(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(0)
    data = datasets.Dataset.from_dict({"prompt": [words(g, 5) for _ in range(8)]})

    saved = tmp_path / "policy"
    tiny_llama().save_pretrained(saved)  # GRPO builds its reference (beta > 0) from the policy's path

    def train():
        torch.manual_seed(0)
        config = trl.GRPOConfig(**common(tmp_path, per_device_train_batch_size=4, learning_rate=1e-3,
                                         num_generations=2, max_completion_length=6, seed=0, beta=0.04))
        trainer = trl.GRPOTrainer(model=str(saved), reward_funcs=_length_reward, args=config, train_dataset=data,
                                  processing_class=tokenizer())
        trainer.train()
        return trainer

    with stock_accel_patch():
        stock = train()
    ours = train()
    assert sites.is_swapped(ours.ref_model.model.layers[0].mlp)
    # our head's log-probs and entropy feed GRPO's own ratio, clipping and KL
    assert report_of(ours.model).head == report_of(ours.ref_model).head == trl_fused_head.OURS
    assert accel_patch.report(ours.model).calls["fused_linear_cross_entropy"][trl_fused_head.FUSED_CALL] == 3
    a, b = steps_of(stock), steps_of(ours)
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        assert close(y["loss"], x["loss"], abs_=1e-5) and close(y["reward"], x["reward"]), (x, y)
        assert close(y["kl"], x["kl"], abs_=1e-6), (x, y)
