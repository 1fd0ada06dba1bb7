"""A resume refuses what it cannot honour before it touches the trainer
(issue 54, item 2): a host record holding what no save writes (a negative
step, a step that is not an int, a malformed history), a data position the
loader refuses (past its epoch, another batch size) are each refused in one
line, and the trainer (every leaf of its state, its step, its history) and
the loader are left as they were, to the bit. A learning rate a schedule
computed in float32 is the rate ``optax.adam`` of the same number uses."""

import dataclasses
import json
import shutil

import numpy as np
import optax
import pytest

import phalanx as px
from helpers import host_arrays, make_data, make_model
from phalanx.checkpoint._resume import restore_run
from phalanx.checkpoint._settings import check_same_settings


X, Y = make_data(64, seed=3)


def loader(batch_size: int = 16) -> px.data.ArrayLoader:
    return px.data.ArrayLoader((X, Y), batch_size, seed=1)  # 4 steps an epoch


def trainer(optimizer=None, *callbacks, seed: int = 1) -> px.DataParallelTrainer:
    """A trainer with `optimizer`, by default ``phalanx train --lr 0.01``'s
    (cli/_train.py make_schedule: the default cosine schedule, which gives
    its first rate in float32)."""
    optimizer = optimizer or optax.adam(optax.cosine_decay_schedule(0.01, 100))
    return px.DataParallelTrainer(
        make_model(seed), optimizer, callbacks=callbacks, progress=False
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint folder holding step 4 (an epoch's end)."""
    folder = tmp_path_factory.mktemp("saved")
    trainer(None, px.callbacks.Checkpoint(folder), seed=0).fit(loader(), epochs=1)
    return folder


def tampered(saved, tmp_path, change) -> str:
    """A copy of `saved` whose step 4 host record `change` edited; the path
    of that step."""
    folder = tmp_path / "tampered"
    shutil.copytree(saved, folder)
    record = folder / "4" / "host" / "metadata"
    host = json.loads(record.read_text())
    change(host)
    record.write_text(json.dumps(host))
    return str(folder / "4")


def unreadable(step: str, why: str) -> str:
    return (
        f"resume={step!r}: checkpoint {step} cannot be read (ValueError: its host "
        f"record's {why}); it may be corrupt: resume from an older step folder, or "
        "start again"
    )


def as_it_was(trainer: px.DataParallelTrainer):
    """What must not change: every leaf of the state, the step, the history."""
    return host_arrays(trainer.state), trainer.progress.step, repr(trainer.history)


def assert_unchanged(trainer, before) -> None:
    leaves, step, history = as_it_was(trainer)
    assert len(leaves) == len(before[0])
    assert all(np.array_equal(a, b) for a, b in zip(leaves, before[0], strict=True))
    assert (step, history) == before[1:] == (0, "History(0 epochs: [])")


def _set(**entries):
    return lambda host: host.update(entries)


def _history_epoch(host):
    host["history"]["epochs"] = [0.5]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_set(step=-3), "step=-3 must be an int >= 0"),
        (_set(step="four"), "step='four' must be an int >= 0"),
        (_history_epoch, "history['epochs'][0]=0.5 must be a dict of metrics by name"),
    ],
)
def test_a_tampered_host_record_is_refused_before_the_trainer_changes(
    saved, tmp_path, change, why
):
    step = tampered(saved, tmp_path, change)
    resumed = trainer()
    before, data = as_it_was(resumed), loader()
    with pytest.raises(ValueError) as refused:
        resumed.fit(data, epochs=2, resume=step)
    assert str(refused.value) == unreadable(step, why)
    assert_unchanged(resumed, before)
    assert data.state_dict() == {"epoch": 0, "position": 0, "batch_size": 16}


@pytest.mark.parametrize("case", ["past its epoch", "another batch size"])
def test_a_data_position_the_loader_refuses_leaves_the_trainer_as_it_was(
    saved, tmp_path, case
):
    if case == "past its epoch":
        step = tampered(saved, tmp_path, _set(data={"epoch": 1, "position": 9}))
        data, message = (
            loader(),
            "state_dict['position']=9 is past the 4 batches of an epoch of this "
            "loader; load a state saved from a loader with the same data, "
            "batch_size and drop_last",
        )
    else:
        step, data = str(saved / "4"), loader(batch_size=32)
        message = (
            "ArrayLoader's batch_size=32 differs from the batch_size=16 its state "
            "was saved with (position 0 of epoch 1, in batches of 16): resumed, "
            "its batches would be another run's; build the ArrayLoader with "
            "batch_size=16 to continue the run, or start a new run without resume"
        )
    resumed = trainer()
    before, position = as_it_was(resumed), data.state_dict()
    with pytest.raises(ValueError) as refused:
        resumed.fit(data, epochs=2, resume=step)
    assert str(refused.value) == message
    assert_unchanged(resumed, before)
    assert data.state_dict() == position


def test_a_snapshot_the_trainer_refuses_puts_the_data_back():
    snapshot = dataclasses.replace(
        trainer().snapshot(), data={"epoch": 1, "position": 2, "batch_size": 16}
    )
    data = loader()

    def refuse(snapshot: px.Snapshot) -> None:
        assert data.state_dict()["position"] == 2  # the data went first
        raise ValueError("refused")

    with pytest.raises(ValueError, match="^refused$"):
        restore_run(snapshot, refuse, data)
    assert data.state_dict() == {"epoch": 0, "position": 0, "batch_size": 16}


def test_a_float32_learning_rate_resumes_into_the_same_python_one(saved):
    step = saved / "4"
    host = json.loads((step / "host" / "metadata").read_text())
    assert host["settings"]["learning_rate"] == float(np.float32(0.01)) != 0.01
    python = trainer(optax.adam(optax.constant_schedule(0.01)))  # 0.01 in float64
    px.callbacks.Checkpoint(saved).restore(python, step)
    assert python.progress.step == 4
    # Without a schedule, adam keeps no count: refused for that, not the rate.
    with pytest.raises(ValueError) as refused:
        px.callbacks.Checkpoint(saved).restore(trainer(optax.adam(0.01)), step)
    assert str(refused.value) == (
        f"checkpoint {step} is from another model or optimizer (model MLP): at "
        ".opt_state[1].count it holds int32[] but this trainer (MLP) has .key "
        "key<fry>[]; build the trainer exactly as for the checkpointed run"
    )


def test_learning_rates_refused_are_shown_apart():
    with pytest.raises(ValueError) as refused:
        check_same_settings(
            {"learning_rate": 0.01}, {"learning_rate": 0.0100001}, "checkpoint c/4"
        )
    theirs, ours = (
        f"an optimizer whose first update's learning rate is {rate}"
        for rate in ("0.0100001", "0.01")
    )
    assert str(refused.value) == (
        f"checkpoint c/4 is of a run with {theirs}, but this trainer has {ours}: "
        "resumed, every update from there on would be another run's; build the "
        f"trainer with {theirs} to continue that run, or start a new run without "
        "resume"
    )
