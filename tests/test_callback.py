"""AccelPatchCallback in a stock Trainer and in TRL's SFTTrainer: kernels swapped before training,
throughput and memory in every logged step, one callback however it is asked for."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import accel_patch
from accel_patch import AccelPatchCallback
from accel_patch.swaps import sites
from accel_patch.integrations.callback import training_logs

METRICS = ("tokens_per_second", "step_time_s", "peak_memory_mib")


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0))


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=8, seq=10):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 128, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.ones_like(self.ids[i])
        mask[:3] = 0  # 3 pad tokens of 10 in every row: tokens are counted from the attention mask
        return {"input_ids": self.ids[i], "attention_mask": mask, "labels": self.ids[i].masked_fill(mask == 0, -100)}


class Recorder(TrainerCallback):
    """What a report_to integration would receive: callbacks after ours see the logs it saw."""

    def __init__(self):
        self.logs = []
        self.swapped_at_train_begin = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.swapped_at_train_begin = sites.is_swapped(model.model.layers[0].mlp)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def args(tmp_path, **extra):
    return TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=2,
                             learning_rate=1e-3, save_strategy="no", report_to="none", disable_tqdm=True,
                             use_cpu=True, dataloader_num_workers=0, **extra)


def ours(trainer):
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, AccelPatchCallback)]


def first_reader(trainer):
    """The first of the trainer's callbacks that may read the logs: all but transformers'
    DefaultFlowCallback, which stays at the head."""
    from transformers.trainer_callback import DefaultFlowCallback

    return next(cb for cb in trainer.callback_handler.callbacks if not isinstance(cb, DefaultFlowCallback))


@pytest.mark.slow  # over 2 s: a subprocess or a Trainer run
def test_a_stock_trainer_swaps_a_constructed_model_and_logs_throughput_and_memory(tmp_path):
    model = tiny_llama()
    assert not sites.is_swapped(model.model.norm)  # built by its constructor: not swapped by the load hook
    recorder = Recorder()
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=Rows(), callbacks=[recorder])
    assert len(ours(trainer)) == 1 and first_reader(trainer) is ours(trainer)[0]
    assert sites.is_swapped(model.model.norm) and sites.is_swapped(model)  # at on_init_end, fused loss included
    trainer.train()
    assert recorder.swapped_at_train_begin is True
    assert not any(k in h for h in trainer.state.log_history for k in (*METRICS, "accel_patch_swap"))  # as stock
    steps = training_logs(trainer)
    assert [h["step"] for h in steps] == [2, 4]
    for h in steps:  # (the peak is the growth over the window's start: 0 is a possible value)
        assert all(isinstance(h[k], float) and h[k] > 0 for k in METRICS if k != "peak_memory_mib"), h
        assert isinstance(h["peak_memory_mib"], float) and h["peak_memory_mib"] >= 0, h
    for h in steps:  # 2 rows of 7 unmasked tokens a step
        assert h["tokens_per_second"] * h["step_time_s"] == pytest.approx(14, rel=1e-6)
    assert steps[0]["accel_patch_swap"] == "rms_norm 5, rope 2, glu+tiled 2, fused_linear_cross_entropy 1"
    assert steps[0]["accel_patch_topology"] == "1 process(es) on 1 node(s), cpu, none; accelerate: single-device"
    assert "accel_patch_swap" not in steps[1]
    assert not any("accel_patch_fallbacks" in h or "accel_patch_rank_sync" in h for h in steps)  # all fused; 1 process
    seen = [l for l in recorder.logs if "loss" in l]
    assert all(all(k in l for k in METRICS) for l in seen)  # what report_to integrations receive


PEAK_WINDOW = """
import resource, torch
from accel_patch.integrations.callback import AccelPatchCallback
callback = AccelPatchCallback()
big = torch.ones(160 << 18)  # 160 MiB once: the process's lifetime peak is at least that
del big
callback._reset_peak_memory()  # a log (or the start of training) opens the window
step = torch.ones(48 << 18)  # what one step allocates: 48 MiB
del step
peak = callback._peak_memory_mib()
assert 44 <= peak <= 80, peak
assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 >= 160 + peak  # not the lifetime peak
assert callback._peak_memory_mib() < 16  # the next window: nothing allocated
"""


@pytest.mark.slow  # over 2 s: a fresh interpreter
def test_on_cpu_the_peak_memory_is_the_windows_growth_not_the_lifetime_peak():
    # In a process of its own: in a test worker that ran others before, the resident level the
    # window is measured over moved by itself (two clean-clone runs on two workers measured 0.0)
    import subprocess
    import sys

    from _env import child_env

    proc = subprocess.run([sys.executable, "-c", PEAK_WINDOW], env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


class WithReferencePass(Trainer):
    """A trainer whose step also runs the model under no_grad (a reference pass, as DPO's with
    adapters disabled): those tokens are not trained on."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            model(**inputs)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


@pytest.mark.slow  # over 2 s: a Trainer run
def test_tokens_per_second_counts_the_tokens_the_step_trains_on(tmp_path):
    trainer = WithReferencePass(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows())
    trainer.train()
    for h in training_logs(trainer):  # 2 rows of 7 tokens a step, once
        assert h["tokens_per_second"] * h["step_time_s"] == pytest.approx(14, rel=1e-6)


@pytest.mark.slow  # over 2 s: two Trainer runs
def test_an_explicit_callback_is_never_registered_twice(tmp_path):
    mine = AccelPatchCallback(metrics=False)
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows(), callbacks=[mine])
    assert ours(trainer) == [mine] and first_reader(trainer) is mine
    trainer.add_callback(AccelPatchCallback())
    trainer.add_callback(AccelPatchCallback)
    assert ours(trainer) == [mine]
    trainer.train()
    assert not any("tokens_per_second" in h for h in training_logs(trainer))


def test_callback_ops_on_a_model_swapped_before_the_trainer_say_what_it_keeps(tmp_path, caplog):
    """A swap adds ops and never removes one: a model swapped before the Trainer (at load) keeps
    its ops whatever the callback's `ops=` asks, and the callback says which, and how to narrow it.
    Nothing is said when the model runs only what was asked."""
    model = tiny_llama()
    accel_patch.swap_kernels(model, "rms_norm,rope")
    with caplog.at_level("WARNING", logger="accel_patch"):
        Trainer(model=model, args=args(tmp_path), train_dataset=Rows(), callbacks=[AccelPatchCallback(ops="rms_norm")])
    said = [r.getMessage() for r in caplog.records if "keeps" in r.getMessage()]
    assert len(said) == 1 and "keeps rope" in said[0] and "restore_kernels" in said[0], said
    caplog.clear()
    with caplog.at_level("WARNING", logger="accel_patch"):
        Trainer(model=model, args=args(tmp_path), train_dataset=Rows(),
                callbacks=[AccelPatchCallback(ops="rms_norm,rope")])
    assert not [r for r in caplog.records if "keeps" in r.getMessage()]


def test_add_callback_replaces_the_automatic_one(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows())
    assert ours(trainer)[0].automatic
    mine = AccelPatchCallback(ops="rms_norm")
    trainer.add_callback(mine)
    assert ours(trainer) == [mine] and first_reader(trainer) is mine


def test_the_automatic_callback_is_one_of_transformers_default_callbacks_until_disabled(tmp_path):
    # code that lists a Trainer's callbacks from DEFAULT_CALLBACKS (transformers' own tests) finds it
    from transformers.trainer import DEFAULT_CALLBACKS
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

    from accel_patch.integrations.callback import AutomaticCallback

    assert DEFAULT_CALLBACKS[0] is DefaultFlowCallback and AutomaticCallback in DEFAULT_CALLBACKS
    trainer = Trainer(model=tiny_llama(), args=args(tmp_path), train_dataset=Rows())
    listed = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert listed == DEFAULT_CALLBACKS + [PrinterCallback]  # disable_tqdm: the printer
    accel_patch.disable()
    try:
        assert AutomaticCallback not in DEFAULT_CALLBACKS
    finally:
        accel_patch.enable()
    assert DEFAULT_CALLBACKS.count(AutomaticCallback) == 1


def test_accel_patch_callback_0_leaves_trainers_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCEL_PATCH_CALLBACK", "0")
    accel_patch.disable()
    accel_patch.enable()
    try:
        record = next(s for s in accel_patch.status() if s.name == "trainer-callback")
        assert record.state == "skipped" and "ACCEL_PATCH_CALLBACK=0" in record.reason
        model = tiny_llama()
        trainer = Trainer(model=model, args=args(tmp_path), train_dataset=Rows())
        assert ours(trainer) == [] and not sites.is_swapped(model.model.norm)
    finally:
        monkeypatch.delenv("ACCEL_PATCH_CALLBACK")
        accel_patch.disable()
        accel_patch.enable()


@pytest.mark.slow  # over 1.5 s: the quick loop keeps to one minute
def test_a_model_init_trainer_gets_module_kernels_at_train_begin(tmp_path, caplog):
    built = []

    def model_init():
        built.append(tiny_llama())
        return built[-1]

    trainer = Trainer(model_init=model_init, args=args(tmp_path), train_dataset=Rows())
    with caplog.at_level("WARNING", logger="accel_patch"):
        trainer.train()
    model = trainer.model
    assert sites.is_swapped(model.model.layers[0].mlp)
    state = model.__dict__[sites.STATE_ATTR]
    if built.index(model) > 0:  # Trainer rebuilt the model in train(): it met the callback prepared
        assert not sites.is_swapped(model) and "already prepared" in str(state.refused)
        assert "after the model was prepared" in caplog.text


@pytest.mark.slow
def test_trl_sft_trainer_gets_the_callback_and_the_kernels(tmp_path):
    trl = pytest.importorskip("trl")  # in the test extras; absent on the GPU image
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i + 4 for i in range(100)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(i)}" for i in torch.randint(0, 100, (12,), generator=g)) for _ in range(16)]
    config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                           learning_rate=1e-3, save_strategy="no", report_to="none", disable_tqdm=True,
                           use_cpu=True, dataloader_num_workers=0, max_length=16)
    model = tiny_llama()
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_dict({"text": texts}),
                             processing_class=tokenizer)
    assert len(ours(trainer)) == 1
    assert sites.is_swapped(model.model.norm) and sites.is_swapped(model.model.layers[0].mlp)
    trainer.train()
    steps = training_logs(trainer)
    assert len(steps) == 2 and all(all(k in h for k in METRICS) for h in steps), steps
    assert steps[0]["accel_patch_swap"].endswith("; LM head: ours, in TRL's place")
    assert all(len(v) <= 100 for h in steps for v in h.values() if isinstance(v, str))
    assert set(accel_patch.report(model).calls["fused_linear_cross_entropy"]) == {"fused (in TRL's head)"}


@pytest.mark.slow
def test_a_dora_adapter_in_a_trainer_logs_its_fallbacks_once_per_reason(tmp_path, caplog):
    """PEFT's forward runs for every LoRA call (DoRA); the logs say so at every
    log, the logger warns once per op and reason, the report counts the fused loss, and every
    logged string fits a console line."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    trainer = Trainer(model=model, args=args(tmp_path), train_dataset=Rows())
    with caplog.at_level("WARNING", logger="accel_patch"):
        trainer.train()
    steps = training_logs(trainer)
    # every LoRA call ran PEFT's forward: the line does not claim the LoRA sites
    assert steps[0]["accel_patch_swap"] == "norm 5, rope 2, glu+tiled 2, loss 1; lora mlp/qkv/o: not run (see fall-backs)"
    dora = "PEFT's forward: a LoRA variant (DoraLinearVariant, e.g. DoRA)"
    for h in steps:  # 2 steps a log, 2 layers: 4 calls of each site since the last log
        assert h["accel_patch_fallbacks"] == f"lora_mlp x4 {dora}; +2 more", h
    assert all(len(v) <= 100 for h in steps for v in h.values() if isinstance(v, str))
    warned = [r.getMessage() for r in caplog.records if "ran another forward" in r.getMessage()]
    assert sorted(w.split(" of the swapped ")[1].split(" ran")[0] for w in warned) == ["lora_mlp", "lora_o", "lora_qkv"]
    assert all(dora in w for w in warned)  # once per op and reason, not once per log
    calls = accel_patch.report(model).calls
    assert calls["fused_linear_cross_entropy"] == {"fused": 4} and calls["lora_mlp"] == {dora: 8}
