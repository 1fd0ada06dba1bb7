"""Issue 33, part 3: the slow-step alarm (a planted stall named, a steady
run silent) and the recompile alarm (the changing leaf named)."""

import os
import time

import numpy as np
import optax
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model
from phalanx._engine.feed._batch_checks import batch_leaf_names
from phalanx._telemetry._alarms import busy_machine, recompile_message
from test_timeline import LowerRate, batches


class Stall(px.Callback):
    """Sleeps `seconds` after step `at`."""

    def __init__(self, at: int, seconds: float = 0.5):
        self.at, self.seconds = at, seconds

    @override
    def on_step_end(self, info):
        if info.step == self.at:
            time.sleep(self.seconds)


def slow_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "slow steps" in line]


def trainer(**kwargs) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(),
        kwargs.pop("optimizer", optax.adam(1e-2)),
        strategy=px.ShardingStrategy(1),
        progress=False,
        **kwargs,
    )


def load(monkeypatch, average: float, cores: int = 2) -> None:
    """The machine's load average and this process's cores, as read."""
    monkeypatch.setattr(os, "getloadavg", lambda: (average, average, average))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))


def test_a_stall_in_a_callback_is_named(capsys, monkeypatch):
    load(monkeypatch, 0.5)  # a quiet machine: no word of other programs
    run = trainer(callbacks=[Stall(70)], sync_every=4)
    run.fit(batches(100), epochs=1)
    lines = slow_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "grew in callbacks (+0.5" in lines[0] and "busy" not in lines[0]
    assert "step 70's" in lines[0]  # the slowest step, within its window
    assert "slow_steps=" in lines[0]  # how to tune it


def test_a_busy_machine_is_said(monkeypatch):
    load(monkeypatch, 5.25)
    assert busy_machine() == (
        ", while the machine was busy (load average 5.2 on 2 CPUs: other "
        "programs may have taken the time)"
    )
    load(monkeypatch, 2.0)  # as many waiting as there are cores: not busy
    assert busy_machine() == ""


def test_a_steady_run_stays_silent(capsys):
    run = trainer(sync_every=4)
    run.fit(batches(50), epochs=10)  # 500 steps, 125 windows judged
    assert int(run.state.step) == 500
    assert slow_lines(capsys.readouterr().err) == []


def test_slow_steps_none_turns_it_off(capsys):
    run = trainer(callbacks=[Stall(30)], sync_every=2, slow_steps=None)
    run.fit(batches(40), epochs=1)
    assert slow_lines(capsys.readouterr().err) == []


def test_a_weakly_typed_leaf_raises_no_alarm(capsys):
    run = trainer(
        optimizer=optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.9),
        callbacks=[LowerRate((2, 4), ("learning_rate", "b1"))],
    )
    run.fit(batches(6), epochs=1)
    assert "compiled a third time" not in capsys.readouterr().err


def test_the_alarm_names_a_state_leaf():
    before = [("state.x", "float32[]", None), ("batch['x']", "float32[8,5]", None)]
    now = [("state.x", "~float32[]", None), ("batch['x']", "float32[8,5]", None)]
    message = recompile_message("train step", before, now)
    assert message.startswith(
        "the train step compiled a third time in this fit: state.x: "
        "float32[] -> ~float32[]. Each new shape"
    )
    assert "jnp.full_like" in message


class Growing:
    """Dict batches that double in size each epoch: a new shape each pass."""

    def __init__(self):
        self.size = 4

    def __iter__(self):
        self.size *= 2
        x, y = make_data(2 * self.size)
        return iter(
            [{"x": x[i : i + self.size], "y": y[i : i + self.size]} for i in (0, 1)]
        )


def test_a_third_compile_names_batch_leaves_by_their_path(capsys):
    trainer(sync_every=1).fit(Growing(), epochs=3)  # batches of 8, 16, 32
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "compiled a third time" in line]
    assert len(lines) == 1, err
    assert (
        "the train step compiled a third time in this fit: batch['x']: "
        "float32[16,5] -> float32[32,5]; batch['y']: int32[16] -> int32[32]; "
        "the batch's example weights: float32[16] -> float32[32]. Each new "
        "shape"
    ) in lines[0]


def test_batch_leaves_are_named_by_their_place_in_the_users_batch():
    x, y = np.zeros((4, 2)), np.zeros(4)
    # An autoencoder's (x, x): each place named once.
    assert batch_leaf_names((x, x), x, x) == ["batch[0]", "batch[1]"]
    nested = {"x": {"image": x, "mask": y}, "y": y}
    assert batch_leaf_names(nested, nested["x"], y) == [
        "batch['x']['image']",
        "batch['x']['mask']",
        "batch['y']",
    ]
    # Parts computed by a split_batch: their place in (x, y).
    assert batch_leaf_names((x, y), [x * 2, x], y + 1) == ["x[0]", "batch[0]", "y"]


def test_bad_settings_are_named():
    x, y = make_data(8)
    del x, y
    for value in (1.0, "3", -2):
        try:
            trainer(slow_steps=value)
        except ValueError as error:
            assert f"slow_steps={value!r}" in str(error)
        else:
            raise AssertionError(value)
