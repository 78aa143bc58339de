"""The demo's own output: what it silences (only what its set-up causes, only while it runs) and
the labels on Trainer's progress bars. Its arguments are tested in test_cli.py; whole runs, plain
and under torchrun, in integration_tests/test_demo.py.
"""
from __future__ import annotations

import logging
import types
import warnings

from accel_patch.cli import demo

PEFT_ASKS = "`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` instead."
BNB_PROBE = "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'."


def warn_from(module: str, message: str, category=FutureWarning) -> list[str]:
    """The warnings that get through when `module` warns `message`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return [str(w.message) for w in caught]


def log_from(logger: str, message: str, caplog) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logging.getLogger(logger).warning(message)
    return [r.getMessage() for r in caplog.records]


def test_demo_silences_the_warnings_its_set_up_causes(caplog):
    with demo.quiet_demo_noise():
        assert warn_from("transformers.modeling_utils", PEFT_ASKS) == []
        assert log_from("bitsandbytes.backends.cpu.ops", BNB_PROBE, caplog) == []


def test_demo_silences_nothing_else(caplog):
    with demo.quiet_demo_noise():
        # Another message, another category, or another module: shown.
        other = "`something_else` is deprecated"
        assert warn_from("transformers.modeling_utils", other) == [other]
        assert warn_from("transformers.modeling_utils", PEFT_ASKS, category=UserWarning) == [PEFT_ASKS]
        assert warn_from("my_training_script", PEFT_ASKS) == [PEFT_ASKS]
        assert log_from("bitsandbytes.backends.cpu.ops", "another warning", caplog) == ["another warning"]
        assert log_from("my_training_script", BNB_PROBE, caplog) == [BNB_PROBE]


def test_demo_silences_only_while_it_runs(caplog):
    with demo.quiet_demo_noise():
        pass
    assert warn_from("transformers.modeling_utils", PEFT_ASKS) == [PEFT_ASKS]
    assert log_from("bitsandbytes.backends.cpu.ops", BNB_PROBE, caplog) == [BNB_PROBE]


def test_progress_bars_say_what_they_count(capsys):
    progress = demo.labelled_progress()
    args = types.SimpleNamespace()
    state = types.SimpleNamespace(is_world_process_zero=True, max_steps=3, global_step=0)

    progress.eval_label = "eval before training"
    progress.on_prediction_step(args, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar.desc.startswith("eval before training")
    progress.on_evaluate(args, state, None)

    progress.on_train_begin(args, state, None)
    assert progress.training_bar.desc.startswith("train")
    progress.on_train_end(args, state, None)

    progress.eval_label = "eval after training"
    progress.on_prediction_step(args, state, None, eval_dataloader=[1, 2])
    assert progress.prediction_bar.desc.startswith("eval after training")
    progress.on_evaluate(args, state, None)

    err = capsys.readouterr().err  # tqdm draws on stderr
    for label in ("eval before training:", "train:", "eval after training:"):
        assert label in err


def test_progress_bars_only_on_the_main_process(capsys):
    progress = demo.labelled_progress()
    state = types.SimpleNamespace(is_world_process_zero=False, max_steps=3, global_step=0)
    progress.on_train_begin(types.SimpleNamespace(), state, None)
    progress.on_prediction_step(types.SimpleNamespace(), state, None, eval_dataloader=[1])
    assert (progress.training_bar, progress.prediction_bar) == (None, None)
    assert capsys.readouterr().err == ""
