"""The Trainer callback never breaks its host: every event, with whatever model the Trainer hands
it (transformers' own CallbackHandler tests hand it the string "test_model"), raises nothing of
its own; a part that fails is logged once and turns off, the others go on."""
from __future__ import annotations

import logging

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler, TrainerCallback

import transformers.trainer  # noqa: F401 - where every Trainer comes from: the trainer-callback patch binds there

from accel_patch import AccelPatchCallback
from accel_patch.integrations import callback as callback_module

EVENTS = sorted(n for n in dir(TrainerCallback) if n.startswith("on_"))


def every_event(handler, args, state, control):
    """transformers' CallbackHandlerTest::test_call_event_passes_kwargs, in shape: every event
    through the handler, with the kwargs a Trainer passes (logs and metrics included)."""
    state.global_step = 1
    for event in EVENTS:
        handler.call_event(event, args, state, control, logs={"loss": 1.0, "learning_rate": 1e-3},
                           metrics={"eval_loss": 1.0})


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "accel_patch" and r.levelno >= logging.WARNING]


@pytest.fixture
def trainer_args(tmp_path):
    return TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)


@pytest.mark.parametrize("model", ["test_model", None, torch.nn.Linear(4, 4)], ids=["string", "none", "plain-module"])
def test_every_event_with_an_odd_model_raises_nothing_and_says_so_once(caplog, trainer_args, model):
    handler = CallbackHandler([], model, None, None, None)
    assert isinstance(handler.callbacks[0], AccelPatchCallback)  # the automatic one, first of these
    state, control = TrainerState(), TrainerControl()
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        every_event(handler, trainer_args, state, control)
        first = warnings_of(caplog)
        every_event(handler, trainer_args, state, control)  # a second round says nothing new
    assert warnings_of(caplog) == first
    assert len(first) == len(set(first)), first
    if isinstance(model, str):
        assert any("handed the callback a str" in w for w in first), first
    assert not any("failed and is off" in w for w in first), first  # skipped, not broken


def test_a_part_that_raises_is_logged_once_and_off_while_the_others_go_on(caplog, trainer_args, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("measured nothing")

    ours = AccelPatchCallback()
    monkeypatch.setattr(ours, "_metrics_values", broken)
    handler = CallbackHandler([ours], torch.nn.Linear(4, 4), None, None, None)
    state, control = TrainerState(), TrainerControl()
    logs = {"loss": 1.0}
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        for _ in range(3):
            handler.on_train_begin(trainer_args, state, control)
            handler.on_log(trainer_args, state, control, logs)
    failed = [w for w in warnings_of(caplog) if "failed and is off" in w]
    assert failed == ["accel_patch: the callback's metrics failed and is off for this run (training goes on): "
                      "ZeroDivisionError: measured nothing"]
    assert callback_module.METRICS in ours._off and callback_module.FALLBACKS not in ours._off


@pytest.mark.parametrize("name, value", [("ACCEL_PATCH_SYNC_CHECK", "eror"), ("ACCEL_PATCH_SYNC_EVERY", "ten")])
def test_a_bad_rank_sync_switch_stops_a_run_of_several_processes_and_warns_in_one(
        caplog, trainer_args, monkeypatch, name, value):
    """A safety switch: several processes never train unchecked because of a typo; one process
    never runs the check, so it is told and goes on."""
    monkeypatch.setenv(name, value)
    state, control = TrainerState(), TrainerControl()
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        CallbackHandler([], torch.nn.Linear(4, 4), None, None, None).on_train_begin(trainer_args, state, control)
    (warned,) = [w for w in warnings_of(caplog) if name in w]
    assert f"{name}={value!r} is not valid" in warned and "training goes on" in warned
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(callback_module.RunStopped, match=f"{name}={value!r} is not valid.*the run stops here"):
        CallbackHandler([], torch.nn.Linear(4, 4), None, None, None).on_train_begin(trainer_args, state, control)


@pytest.mark.parametrize("rank, warns", [("0", True), ("1", False)])
def test_drift_is_warned_by_rank_0_only_even_where_every_rank_reads_as_process_zero(
        caplog, monkeypatch, rank, warns):
    """Under accelerate state NO every rank is the Trainer's process zero: the group's (here the
    launcher's) rank decides who warns; every rank keeps the value for its logs."""
    from accel_patch.core import rank_sync

    drift = rank_sync.RankSync("drift", 3, 2, (1,), 4, 1, 1e-3, "w", 0, None, 0.0,
                               "DRIFT: rank(s) 1 differ from rank 0 at step 3: 1/4 tensors, ~1.0e-03, w")
    monkeypatch.setattr(rank_sync, "check_rank_sync", lambda *a, **k: drift)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    ours, state = AccelPatchCallback(), TrainerState(global_step=3)
    assert state.is_world_process_zero
    with caplog.at_level(logging.WARNING, logger="accel_patch"):
        ours._check_sync(torch.nn.Linear(2, 2), state)
    assert any("DRIFT" in w for w in warnings_of(caplog)) == warns
    assert ours._sync_logged is drift
