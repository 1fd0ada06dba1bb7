"""The progress, throughput, learning-rate and early-stopping callbacks: what
they show and record, that they read device metrics only at log points, and
that early stopping stops at the right epoch with the best epoch's weights."""

import io
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rich.console
import rich.file_proxy
from typing_extensions import override

import phalanx as px
import phalanx.callbacks._progress_bar as progress_module
from helpers import make_data, make_model, params_of
from phalanx._typing import HostMetrics
from phalanx.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ProgressBar,
    Throughput,
)
from phalanx.callbacks._epoch_table import EpochTable


BATCH = 16


def batches(n_batches: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    x, y = make_data(BATCH * n_batches, seed)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def console(*, terminal: bool) -> rich.console.Console:
    return rich.console.Console(file=io.StringIO(), force_terminal=terminal, width=120)


def output(con: rich.console.Console) -> str:
    file = con.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def found(pattern: str, line: str) -> str:
    """The first group of `pattern` in `line`, which must match."""
    match = re.search(pattern, line)
    assert match is not None, (pattern, line)
    return match[1]


class Unsized:
    """Re-iterable batches without a length: the fit's total is unknown."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


class StepMetrics(px.Callback):
    """Records the step metrics it is shown at every `every`-th step."""

    def __init__(self, every: int):
        self.every = every
        self.seen: dict[int, HostMetrics] = {}

    @override
    def on_step_end(self, info):
        if info.step % self.every == 0:
            self.seen[info.step] = dict(info.metrics)


# ------------------------------------------------------------------ ProgressBar


def test_progress_plain_lines_and_epoch_table():
    con = console(terminal=False)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[ProgressBar(log_every=2, console=con)],
    )
    trainer.fit(batches(4), epochs=2, eval_data=batches(2, seed=1))
    text = output(con)
    assert "\x1b" not in text  # no live display, no colour codes
    lines = text.splitlines()
    steps = [line for line in lines if " step " in line]
    assert [found(r"step (\S+)", line) for line in steps] == [
        "2/8",
        "4/8",
        "6/8",
        "8/8",
    ]
    assert all(re.search(r"loss \d\.\d{4} +[\d,]+ ex/s +eta ", s) for s in steps)
    assert steps[0].startswith("epoch 1/2") and steps[-1].startswith("epoch 2/2")
    heading = [line.split() for line in lines if line.split()[:2] == ["epoch", "loss"]]
    assert heading == [
        ["epoch", "loss", "accuracy", "ex/s", "eval", "loss", "eval", "acc", "time"]
    ]
    rows = [line.split() for line in lines if re.match(r" +\d/2 ", line)]
    assert [row[0] for row in rows] == ["1/2", "2/2"]
    for row, epoch in zip(rows, trainer.history, strict=True):
        assert float(row[1]) == pytest.approx(epoch["loss"], abs=1e-4)
        assert float(row[2]) == pytest.approx(epoch["accuracy"], abs=1e-4)
        assert float(row[3].replace(",", "")) > 0
        assert float(row[4]) == pytest.approx(epoch["eval_loss"], abs=1e-4)
        assert float(row[5]) == pytest.approx(epoch["eval_accuracy"], abs=1e-4)
        assert row[6].endswith("s")


def test_progress_unknown_total_and_no_eval():
    con = console(terminal=False)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        loss="mse",
        callbacks=[ProgressBar(log_every=3, console=con)],
    )
    x, _ = make_data(48)
    targets = np.zeros((48, 3), np.float32)
    trainer.fit(Unsized([(x[:24], targets[:24]), (x[24:], targets[24:])]), epochs=3)
    text = output(con)
    assert "step 3/?" in text and "step 6/?" in text and "eta" not in text
    heading = next(
        line for line in text.splitlines() if "ex/s" in line and "time" in line
    )
    # No accuracy for mse, no eval columns without eval_data.
    assert heading.split() == ["epoch", "loss", "ex/s", "time"]


def test_progress_live_bar_on_a_terminal_is_stopped_at_fit_end():
    con = console(terminal=True)
    bar = ProgressBar(log_every=2, console=con)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[bar])
    trainer.fit(batches(4), epochs=2)
    text = output(con)
    assert "\x1b[" in text  # drawn live, with cursor control
    assert "8/8" in text and "ex/s" in text and "eta" in text
    assert re.search(r"epoch\s+loss\s+accuracy\s+ex/s\s+time", text)
    assert con._live_stack == []
    assert not isinstance(sys.stdout, rich.file_proxy.FileProxy)


def test_progress_live_bar_is_stopped_on_exception():
    con = console(terminal=True)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[ProgressBar(log_every=1, console=con)],
    )
    good = batches(2)
    x, y = good[1]
    with pytest.raises(ValueError, match="labels"):
        trainer.fit([good[0], (x, y + 5)], epochs=1)  # class 5 of 3: bad batch 1
    assert con._live_stack == []
    assert not isinstance(sys.stdout, rich.file_proxy.FileProxy)


class WithError(px.DataParallelTrainer):
    """A subclass with a metric of its own."""

    @override
    def metrics(self, outputs, targets):
        error = 1.0 - (jnp.argmax(outputs, axis=-1) == targets).astype(jnp.float32)
        return {**super().metrics(outputs, targets), "error": error}


def test_fit_shows_progress_by_default_one_row_per_epoch(capsys):
    trainer = WithError(make_model(), optax.adam(1e-2))
    trainer.fit(batches(4), epochs=2, eval_data=batches(2, seed=1))
    lines = capsys.readouterr().out.splitlines()
    # Not a terminal: no step lines, a heading and a row per epoch.
    assert [line.split() for line in lines[:1]] == [
        [
            "epoch",
            "loss",
            "accuracy",
            "error",
            "ex/s",
            "eval",
            "loss",
            "eval",
            "acc",
            "eval",
            "error",
            "time",
        ]
    ]
    rows = [line.split() for line in lines[1:]]
    assert [row[0] for row in rows] == ["1/2", "2/2"]
    for row, epoch in zip(rows, trainer.history, strict=True):
        assert float(row[3]) == pytest.approx(epoch["error"], abs=1e-4)
        assert float(row[3]) == pytest.approx(1 - epoch["accuracy"], abs=1e-4)
        assert float(row[7]) == pytest.approx(epoch["eval_error"], abs=1e-4)
        assert float(row[4].replace(",", "")) > 0  # ex/s


def test_default_rows_cost_the_loop_no_call_per_step(capsys, monkeypatch):
    steps = []
    monkeypatch.setattr(ProgressBar, "on_step_end", lambda _, i: steps.append(i.step))
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(batches(4), epochs=1)
    assert steps == [] and "1/1" in capsys.readouterr().out
    # A live bar is drawn from the steps.
    terminal = console(terminal=True)
    monkeypatch.setattr(progress_module, "Console", lambda: terminal)
    trainer.fit(batches(4), epochs=1)
    assert steps == [5, 6, 7, 8] and "\x1b[" in output(terminal)


def test_progress_false_prints_nothing(capsys):
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), progress=False)
    trainer.fit(batches(4), epochs=2, eval_data=batches(2, seed=1))
    trainer.evaluate(batches(2))
    assert capsys.readouterr() == ("", "")


def test_a_progress_bar_of_ones_own_replaces_the_default(capsys):
    con = console(terminal=False)
    bar = ProgressBar(log_every=2, console=con)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[bar])
    trainer.fit(batches(4), epochs=1)
    assert capsys.readouterr().out == ""
    assert "step 4/4" in output(con)
    # Replacing the callbacks brings the default back (and keeps it out of
    # the callbacks' list and their saved state).
    trainer.callbacks = []
    assert trainer.callbacks == ()
    trainer.fit(batches(4), epochs=1)
    assert "epoch" in capsys.readouterr().out


def test_epoch_table_heading_follows_the_metrics():
    class EveryOtherEpoch(px.Callback):
        @override
        def on_epoch_end(self, info):
            if info.epoch % 2 == 1:
                info.metrics["lr"] = 1e-4

    con = console(terminal=False)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[EveryOtherEpoch(), ProgressBar(console=con, plain_steps=False)],
    )
    trainer.fit(batches(2), epochs=3)
    lines = output(con).splitlines()
    headings = [line.split() for line in lines if line.split()[0] == "epoch"]
    assert headings == [
        ["epoch", "loss", "accuracy", "ex/s", "time"],
        ["epoch", "loss", "accuracy", "lr", "ex/s", "time"],
        ["epoch", "loss", "accuracy", "ex/s", "time"],
    ]
    assert "1.000e-04" in lines[3]


class Scored(px.DataParallelTrainer):
    """Accuracy, F1 and AUC: with lr, 7 columns of metrics a set."""

    @override
    def metrics(self, outputs, targets):
        return {
            **super().metrics(outputs, targets),
            "f1": px.metrics.f1(outputs, targets),
            "auc": px.metrics.auc(outputs, targets),
        }


@pytest.mark.parametrize("names", [("val", "test"), ("val", "test", "holdout")])
def test_several_eval_sets_fit_100_columns_a_row_each(names):
    con = console(terminal=False)  # 120 wide: the table keeps within 100
    trainer = Scored(
        make_model(),
        optax.adam(1e-2),
        callbacks=[LearningRateMonitor(1e-2), ProgressBar(console=con)],
    )
    sets = {name: batches(1, seed=i + 1) for i, name in enumerate(names)}
    trainer.fit(batches(2), epochs=2, eval_data=sets)
    lines = [line for line in output(con).splitlines() if "step" not in line]
    assert max(map(len, lines)) <= 100, lines
    assert lines[0] == (
        "  epoch        loss    accuracy         auc          f1          lr"
        "        ex/s     time"
    )
    metrics = ("loss", "accuracy", "auc", "f1")
    for epoch, history in enumerate(trainer.history):
        rows = lines[1 + epoch * (1 + len(names)) :][: 1 + len(names)]
        assert rows[0].split()[0] == f"{epoch + 1}/2"
        for name, row in zip(names, rows[1:], strict=True):
            want = [f"{history[f'eval_{name}_{m}']:.4f}" for m in metrics]
            assert row.split() == [name, *want]


def test_metrics_past_100_columns_are_named_under_the_heading():
    values = {"loss": 0.5, **{f"metric_{i}": 0.25 for i in range(9)}}
    values |= {"eval_loss": 0.5, "eval_metric_0": 0.25, "ex/s": 100.0, "time": 1.0}
    table = EpochTable.of(values)
    assert table.heading() == (
        "  epoch        loss    metric_0    metric_1    metric_2    metric_3"
        "    metric_4        ex/s     time"
    )
    assert table.note() == (
        "(not shown, for width: metric_5, metric_6, metric_7, metric_8; in "
        "trainer.history and the loggers)"
    )
    assert table.rows("1/3", values) == [
        "    1/3      0.5000      0.2500      0.2500      0.2500      0.2500"
        "      0.2500         100    1.00s",
        "   eval      0.5000      0.2500",
    ]
    # One set and a few metrics in a row: the table as it always was.
    few = {"loss": 0.5, "ex/s": 100.0, "eval_loss": 0.5, "time": 1.0}
    assert EpochTable.of(few).heading() == (
        "  epoch        loss        ex/s   eval loss     time"
    )


def test_progress_argument_is_checked():
    with pytest.raises(TypeError, match="progress"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), progress="yes")  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------- Throughput


def test_throughput_in_step_metrics_and_history():
    recorder = StepMetrics(every=2)
    con = console(terminal=False)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[
            Throughput(log_every=2),
            recorder,
            ProgressBar(log_every=2, console=con),
        ],
    )
    trainer.fit(batches(4), epochs=2, eval_data=batches(1))
    assert sorted(recorder.seen) == [2, 4, 6, 8]
    for metrics in recorder.seen.values():
        assert metrics["examples_per_sec"] > 0 and metrics["steps_per_sec"] > 0
        # Both count the same window: BATCH examples a step.
        ratio = metrics["examples_per_sec"] / metrics["steps_per_sec"]
        assert ratio == pytest.approx(BATCH)
    assert len(trainer.history["examples_per_sec"]) == 2
    for epoch in trainer.history:
        assert epoch["examples_per_sec"] > 0
        assert epoch["examples_per_sec"] / epoch["steps_per_sec"] == pytest.approx(
            BATCH
        )
    # A ProgressBar after it shows its figures rather than its own.
    lines = output(con).splitlines()
    shown = [line.split()[3] for line in lines if re.match(r" +\d/2 ", line)]
    assert shown == [f"{v:,.0f}" for v in trainer.history["examples_per_sec"]]
    shown = [found(r"([\d,]+) ex/s", line) for line in lines if "step" in line]
    assert shown == [f"{m['examples_per_sec']:,.0f}" for m in recorder.seen.values()]


# ------------------------------------------------------------ LearningRateMonitor


def test_lr_monitor_follows_the_schedule_at_real_steps():
    schedule = optax.cosine_decay_schedule(0.1, decay_steps=20, alpha=0.1)
    recorder = StepMetrics(every=3)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(schedule),
        callbacks=[LearningRateMonitor(schedule, log_every=3), recorder],
    )
    trainer.fit(batches(4), epochs=3)
    trainer.fit(batches(4), epochs=1)  # the step carries on across fits
    assert sorted(recorder.seen) == [3, 6, 9, 12, 15]
    for step, metrics in recorder.seen.items():
        assert metrics["lr"] == pytest.approx(
            float(np.asarray(schedule(step))), rel=1e-6
        )
    assert trainer.history["lr"] == pytest.approx(
        [float(np.asarray(schedule(s))) for s in (4, 8, 12, 16)], rel=1e-6
    )
    assert int(trainer.state.step) == 16


def test_lr_monitor_constant_rate_and_name():
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.sgd(0.05),
        callbacks=[LearningRateMonitor(0.05, name="learning_rate")],
    )
    trainer.fit(batches(2), epochs=2)
    assert trainer.history["learning_rate"] == [0.05, 0.05]


def test_lr_monitor_refuses_to_overwrite_a_metric():
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.sgd(0.05),
        callbacks=[LearningRateMonitor(0.05, name="loss")],
    )
    with pytest.raises(ValueError, match="overwrite the metric 'loss'"):
        trainer.fit(batches(2))


def test_lr_monitor_rejects_a_bad_schedule_before_training():
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.sgd(0.05),
        callbacks=[LearningRateMonitor(lambda step: jnp.ones(3))],
    )
    with pytest.raises(TypeError, match="not one number"):
        trainer.fit(batches(2))
    assert int(trainer.state.step) == 0


# ---------------------------------------------------------------- EarlyStopping


class Script(px.Callback):
    """Overwrites the epoch's `name` with scripted values; keeps every epoch's
    parameters (copied before the next step donates them)."""

    def __init__(self, values, name="eval_loss"):
        self.values = values
        self.name = name
        self.params: list[list[np.ndarray]] = []

    @override
    def on_epoch_end(self, info):
        info.metrics[self.name] = self.values[info.epoch]
        self.params.append([np.asarray(p) for p in params_of(info.state.model)])


def assert_params_equal(model, expected):
    got = [np.asarray(p) for p in params_of(model)]
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


def test_early_stopping_stops_after_patience_and_restores_the_best():
    # best at epoch 3; epochs 4, 5, 6 do not improve by more than 0.1: stop at 6.
    script = Script([5.0, 4.0, 4.5, 3.0, 2.95, 3.2, 3.0, 1.0, 0.5, 0.1])
    stopper = EarlyStopping(patience=3, min_delta=0.1, restore_best_weights=True)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[script, stopper]
    )
    trainer.fit(batches(4), epochs=10)
    assert len(trainer.history) == 7
    assert trainer.history["eval_loss"] == [5.0, 4.0, 4.5, 3.0, 2.95, 3.2, 3.0]
    assert (stopper.best, stopper.best_epoch, stopper.stopped_epoch) == (3.0, 3, 6)
    assert_params_equal(trainer.model, script.params[3])
    assert int(trainer.state.step) == 4 * 4  # the whole state of epoch 3
    # The restored state trains on (it is the trainer's own, not a donated copy).
    trainer.fit(batches(4), steps=1)
    assert int(trainer.state.step) == 17


def test_early_stopping_restores_at_fit_end_without_stopping():
    script = Script([3.0, 1.0, 2.0, 2.5], name="score")
    stopper = EarlyStopping("score", mode="max", patience=5, restore_best_weights=True)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[script, stopper]
    )
    trainer.fit(batches(2), epochs=4)
    assert not trainer.stop_training and len(trainer.history) == 4
    assert (stopper.best, stopper.best_epoch, stopper.wait) == (3.0, 0, 3)
    assert_params_equal(trainer.model, script.params[0])


def test_early_stopping_keeps_the_last_weights_by_default():
    script = Script([1.0, 2.0, 3.0])
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[script, EarlyStopping(patience=2)],
    )
    trainer.fit(batches(2), epochs=5)
    assert len(trainer.history) == 3
    assert_params_equal(trainer.model, script.params[2])


def test_early_stopping_names_the_available_metrics():
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[EarlyStopping("acc")]
    )
    # Before the first step (tests/checks/test_mistakes.py has more such monitors).
    with pytest.raises(ValueError, match=r"accuracy\. Did you mean 'accuracy'"):
        trainer.fit(batches(2))
    assert int(trainer.state.step) == 0


def test_early_stopping_state_dict_round_trip():
    script = Script([2.0, 1.0, 1.5])
    stopper = EarlyStopping(patience=4)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[script, stopper]
    )
    trainer.fit(batches(2), epochs=3)
    state = stopper.state_dict()
    assert state == {
        "best": 1.0,
        "best_epoch": 1,
        "best_step": 4,
        "wait": 1,
        "stopped_epoch": None,
    }
    fresh = EarlyStopping(patience=4)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # A state saved before best_step existed still loads.
    older = EarlyStopping(patience=4)
    older.load_state_dict({k: v for k, v in state.items() if k != "best_step"})
    assert older.state_dict() == {**state, "best_step": None}


# ------------------------------------------------------------------- arguments


# Each call passes a wrong value on purpose: its type too, where pyright says so.
@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: ProgressBar(log_every=0), ValueError, ["log_every=0", ">= 1"]),
        (lambda: ProgressBar(console=sys.stdout), TypeError, ["console=", "Console"]),  # pyright: ignore[reportArgumentType]
        (lambda: Throughput(log_every=True), ValueError, ["log_every=True"]),
        (lambda: LearningRateMonitor("1e-3"), TypeError, ["schedule='1e-3'"]),  # pyright: ignore[reportArgumentType]
        (lambda: LearningRateMonitor(1e-3, log_every=2.5), ValueError, ["2.5"]),  # pyright: ignore[reportArgumentType]
        (lambda: LearningRateMonitor(1e-3, name=""), ValueError, ["name=''"]),
        (lambda: EarlyStopping(mode="low"), ValueError, ["mode='low'", "'max'"]),  # pyright: ignore[reportArgumentType]
        (lambda: EarlyStopping(patience=0), ValueError, ["patience=0"]),
        (lambda: EarlyStopping(min_delta=-1.0), ValueError, ["min_delta=-1.0"]),
        (lambda: EarlyStopping(monitor=""), TypeError, ["monitor=''"]),
        (
            lambda: EarlyStopping(restore_best_weights=1),  # pyright: ignore[reportArgumentType]
            TypeError,
            ["restore_best_weights=1"],
        ),
    ],
)
def test_arguments_are_checked(make, error, words):
    with pytest.raises(error) as caught:
        make()
    for word in words:
        assert word in str(caught.value)


# ----------------------------------------------------------- syncs: log points


def test_callbacks_read_device_metrics_only_at_log_points(monkeypatch):
    k = 4
    now: list = ["before"]

    class Clock(px.Callback):
        @override
        def on_fit_start(self, info):
            now[0] = "fit start"

        @override
        def on_step_end(self, info):
            now[0] = info.step

    schedule = optax.linear_schedule(0.01, 0.001, 12)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(schedule),
        sync_every=1000,  # the trainer's own syncs only at the epoch's end
        callbacks=[
            Clock(),
            Throughput(log_every=k),
            LearningRateMonitor(schedule, log_every=k),
            ProgressBar(log_every=k, console=console(terminal=False)),
            EarlyStopping("loss", patience=5, restore_best_weights=True),
        ],
    )
    data = batches(12)
    trainer.fit(data[:1], steps=1)  # compile outside the counted run
    fetches: list[tuple[object, bool]] = []
    real_get = jax.device_get

    def counting_get(tree):
        # A step's packed sums: one float vector (the epoch's sums come as a
        # pair with their integer flags; other reads here are scalars).
        step_metrics = isinstance(tree, jax.Array) and tree.ndim == 1
        fetches.append((now[0], step_metrics))
        return real_get(tree)

    monkeypatch.setattr(jax, "device_get", counting_get)
    with jax.transfer_guard_device_to_host("disallow"):
        trainer.fit(data, epochs=1)
    # Steps 2..13: log points at 4, 8, 12; one fetch of the step's metrics each,
    # shared by the three callbacks that read them.
    assert [step for step, metrics in fetches if metrics] == [4, 8, 12]
    assert {step for step, _ in fetches} <= {"fit start", 4, 8, 12, 13}


def test_state_copy_survives_donation():
    # What EarlyStopping relies on: a copy taken at epoch end outlives the step.
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(batches(1), steps=1)
    copy = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, trainer.state)
    trainer.fit(batches(1), steps=1)
    assert int(copy.step) == 1 and int(trainer.state.step) == 2
    trainer.state = copy
    assert int(trainer.state.step) == 1
