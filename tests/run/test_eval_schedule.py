"""fit's evaluation schedule: evaluation every N steps, several named eval
sets, the callbacks acting on evaluations (loggers, early stopping, best
checkpoints) and exact resume between two evaluations."""

import io
import json
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib.image
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import rich.console
from typing_extensions import override

import phalanx as px
from helpers import RaiseAt, make_data, make_model, max_abs_diff, read_scalars
from phalanx.callbacks._plot_curves import curves as _curves


X, Y = make_data(100, seed=3)
VAL = make_data(24, seed=4)
TEST = make_data(40, seed=5)
# Two sets, the second of two batches of unequal size.
SETS = {
    "val": [VAL],
    "test": [(TEST[0][:30], TEST[1][:30]), (TEST[0][30:], TEST[1][30:])],
}
NAMES = ["eval_val_loss", "eval_val_accuracy", "eval_test_loss", "eval_test_accuracy"]


def loader():
    return px.data.ArrayLoader((X, Y), 16, seed=1)  # 7 steps per epoch


def make_trainer(callbacks=(), **kwargs):
    return px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=list(callbacks),
        progress=False,
        **kwargs,
    )


class Evaluations(px.Callback):
    """The hooks around fit's evaluations, and what `trainer.evaluate` gives
    on each set at each evaluation (the state there)."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.direct: list[dict[str, float]] = []
        self.models: dict[int, eqx.Module] = {}

    @override
    def on_step_end(self, info):
        self.events.append(("step", info.step))

    @override
    def on_eval_start(self, info):
        if info.eval_every is not None:
            self.events.append(("eval_start", info.step))

    @override
    def on_eval_end(self, info):
        if info.eval_every is None:  # a trainer.evaluate below
            return
        self.events.append(("eval_end", info.step))
        trainer = info.trainer
        assert isinstance(trainer, px.DataParallelTrainer)  # it has evaluate()
        direct = {}
        for name, data in SETS.items():
            for metric, value in trainer.evaluate(data).items():
                direct[f"eval_{name}_{metric}"] = value
        self.direct.append(direct)
        self.models[info.step] = jax.tree.map(
            lambda x: jnp.copy(x) if eqx.is_array(x) else x, info.trainer.model
        )


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_eval_every_evaluates_every_set_after_every_nth_step(steps_per_call):
    recorder = Evaluations()
    trainer = make_trainer([recorder], steps_per_call=steps_per_call)
    trainer.fit(loader(), epochs=3, eval_data=SETS, eval_every=4)
    evaluations = trainer.history.evaluations
    # 21 steps; a compiled call of 3 steps ends at each evaluation's step.
    assert [(e["step"], e["epoch"]) for e in evaluations] == [
        (4, 0),
        (8, 1),
        (12, 1),
        (16, 2),
        (20, 2),
    ]
    for evaluation, direct in zip(evaluations, recorder.direct, strict=True):
        assert list(evaluation) == ["step", "epoch", *NAMES]
        assert {k: evaluation[k] for k in NAMES} == direct
    # Each evaluation's hooks come before its step's on_step_end.
    for step in (4, 8, 12, 16, 20):
        i = recorder.events.index(("step", step))
        assert recorder.events[i - 2 : i] == [("eval_start", step), ("eval_end", step)]
    assert recorder.events.count(("eval_end", 4)) == 1
    # The epochs' metrics hold no evaluation; the history says where it is.
    assert all(not name.startswith("eval_") for name in trainer.history.names)
    with pytest.raises(KeyError, match="history.evaluations"):
        trainer.history["eval_val_loss"]


def test_eval_every_gives_the_same_results_under_steps_per_call():
    runs = []
    for steps_per_call in (1, 4):
        trainer = make_trainer(steps_per_call=steps_per_call)
        trainer.fit(loader(), epochs=2, eval_data=[VAL], eval_every=6)
        runs.append(trainer.history.evaluations)
    assert [e["step"] for e in runs[0]] == [6, 12]
    for one, four in zip(*runs, strict=True):
        assert (
            one.keys() == four.keys() == {"step", "epoch", "eval_loss", "eval_accuracy"}
        )
        np.testing.assert_allclose(one["eval_loss"], four["eval_loss"], rtol=1e-6)


def test_several_sets_at_epoch_ends():
    recorder = Evaluations()
    trainer = make_trainer([recorder])
    trainer.fit(loader(), epochs=2, eval_data=SETS)
    last = trainer.history[-1]
    assert [name for name in last if name.startswith("eval_")] == NAMES
    for name, data in SETS.items():
        for metric, value in trainer.evaluate(data).items():
            assert last[f"eval_{name}_{metric}"] == value
    # Recorded as evaluations too, at the epochs' last steps; reported once
    # each to on_eval_end, with eval_every=None (the epoch's row holds them).
    assert [(e["step"], e["epoch"]) for e in trainer.history.evaluations] == [
        (7, 0),
        (14, 1),
    ]
    assert trainer.history.evaluations[-1] == {
        "step": 14,
        "epoch": 1,
        **{name: last[name] for name in NAMES},
    }
    assert recorder.direct == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"eval_data": [VAL], "eval_every": 0}, ValueError, "eval_every"),
        (
            {"eval_data": [VAL], "eval_every": 2.5},
            (TypeError, ValueError),
            "eval_every",
        ),
        ({"eval_every": 5}, ValueError, "eval_every=5 .* no eval_data"),
        ({"eval_data": {}}, ValueError, "no sets"),
        ({"eval_data": {"a b": [VAL]}}, ValueError, "set named 'a b'.*letters"),
        ({"eval_data": {1: [VAL]}}, ValueError, "set named 1"),
        (
            {"eval_data": {"val": 3}},
            TypeError,
            r"eval_data\['val'\]=int is not iterable",
        ),
        (
            {"eval_data": {"val": VAL}},
            TypeError,
            r"eval_data\['val'\]=\(x, y\) is one batch",
        ),
        ({"eval_data": {"x": VAL[0], "y": VAL[1]}}, TypeError, "one dict batch"),
    ],
)
def test_bad_eval_arguments_fail_before_training(kwargs, error, match):
    trainer = make_trainer()
    with pytest.raises(error, match=match):
        trainer.fit(loader(), epochs=1, **kwargs)
    assert int(trainer.state.step) == 0


def test_a_monitor_of_no_named_set_fails_before_training():
    stopper = px.callbacks.EarlyStopping("eval_loss")
    trainer = make_trainer([stopper])
    with pytest.raises(
        ValueError, match=r"eval_val_<metric>, eval_test_<metric>.*'eval_val_loss'"
    ):
        trainer.fit(loader(), eval_data=SETS, eval_every=4)
    assert int(trainer.state.step) == 0


def test_an_empty_set_is_named():
    trainer = make_trainer()
    with pytest.raises(ValueError, match=r"eval_data\['test'\]: yielded no batches"):
        trainer.fit(loader(), eval_data={"val": [VAL], "test": []}, eval_every=2)
    assert int(trainer.state.step) == 2  # where the first evaluation found it


def test_early_stopping_counts_evaluations_and_restores_the_best():
    # mode="max" on a falling loss: the first evaluation stays the best.
    stopper = px.callbacks.EarlyStopping(
        "eval_val_loss", mode="max", patience=2, restore_best_weights=True
    )
    recorder = Evaluations()
    trainer = make_trainer([recorder, stopper])
    trainer.fit(loader(), epochs=5, eval_data=SETS, eval_every=4)
    assert [e["step"] for e in trainer.history.evaluations] == [4, 8, 12]
    assert (stopper.best_step, stopper.best_epoch, stopper.stopped_epoch) == (4, 0, 1)
    assert stopper.best == trainer.history.evaluations[0]["eval_val_loss"]
    # Stopped after step 12 (mid-epoch 1), then the state of step 4 put back.
    assert len(trainer.history) == 2
    assert int(trainer.state.step) == 4
    assert max_abs_diff(trainer.model, recorder.models[4]) == 0
    assert stopper.state_dict()["best_step"] == 4


@pytest.mark.parametrize("mode", ["min", "max"])
def test_checkpoint_keeps_the_best_evaluations(tmp_path, mode):
    checkpoint = px.callbacks.Checkpoint(
        tmp_path, keep=2, monitor="eval_test_loss", mode=mode
    )
    trainer = make_trainer([checkpoint])
    trainer.fit(loader(), epochs=3, eval_data=SETS, eval_every=3)
    evaluations = trainer.history.evaluations
    assert [e["step"] for e in evaluations] == [3, 6, 9, 12, 15, 18, 21]
    losses = {e["step"]: e["eval_test_loss"] for e in evaluations}
    ranked = sorted(losses, key=losses.__getitem__, reverse=mode == "max")
    # The best two evaluations, and the newest checkpoint (an epoch end that
    # is an evaluation's step too); the other epoch ends (7, 14) rank nowhere.
    kept = sorted(int(p) for p in os.listdir(tmp_path) if p.isdigit())
    assert kept == sorted({*ranked[:2], 21})
    with ocp.CheckpointManager(tmp_path) as manager:
        for step in kept:
            assert manager.metrics(step)["eval_test_loss"] == losses[step]


def _run(folder, *, crash=None, every=5, resume=None):
    """3 epochs of 7 steps evaluating every 4 steps, logged as JSON lines and
    CSV every 2 steps, checkpointed every `every` steps; killed at `crash`."""
    callbacks = [
        px.callbacks.JSONLogger(folder / "metrics.jsonl", log_every=2),
        px.callbacks.CSVLogger(folder / "metrics.csv", log_every=2),
        px.callbacks.EarlyStopping("eval_test_loss", mode="max", patience=10),
        px.callbacks.Checkpoint(
            folder / "checkpoints", every_n_steps=every, every_n_epochs=None
        ),
    ]
    if crash is not None:  # after the loggers: they keep their checkpoint keys
        callbacks.append(RaiseAt(crash))
    trainer = make_trainer(callbacks)
    data = loader()
    fit = lambda: trainer.fit(  # noqa: E731
        data, epochs=3, eval_data=SETS, eval_every=4, resume=resume
    )
    if crash is None:
        fit()
    else:
        with pytest.raises(RuntimeError, match="boom"):
            fit()
    return trainer


# Killed at step 10: resumed from step 5 (mid-epoch 0, between the
# evaluations of steps 4 and 8: that of step 8 is made again), or from step 8
# (an evaluation's step: its checkpoint holds it, and it is not made again).
@pytest.mark.parametrize(("every", "saved"), [(5, 5), (4, 8)])
def test_resume_between_evaluations_writes_each_evaluation_once(tmp_path, every, saved):
    straight = _run(tmp_path / "straight", every=every)
    killed = tmp_path / "killed"
    _run(killed, crash=10, every=every)
    rows = [
        json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [4, 8]
    assert (
        max(int(p) for p in os.listdir(killed / "checkpoints") if p.isdigit()) == saved
    )
    resumed = _run(killed, every=every, resume="latest")

    assert resumed.history.evaluations == straight.history.evaluations
    [stopper], [reference] = (
        [c for c in t.callbacks if isinstance(c, px.callbacks.EarlyStopping)]
        for t in (resumed, straight)
    )
    assert stopper.state_dict() == reference.state_dict()
    assert reference.state_dict()["best_step"] in (4, 8, 12, 16, 20)
    assert resumed.history.epochs == straight.history.epochs
    assert max_abs_diff(resumed.model, straight.model) == 0
    for name in ("metrics.jsonl", "metrics.csv"):
        assert (killed / name).read_text() == (tmp_path / "straight" / name).read_text()
    rows = [
        json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [(r["step"], r["epoch"]) for r in rows if r["kind"] == "eval"]
    assert evals == [(4, 0), (8, 1), (12, 1), (16, 2), (20, 2)]
    first = next(row for row in rows if row["kind"] == "eval")
    assert list(first) == ["kind", "step", "epoch", *NAMES]


def test_tensorboard_and_progress_show_evaluations(tmp_path):
    out = io.StringIO()
    console = rich.console.Console(file=out, force_terminal=False, width=200)
    trainer = make_trainer(
        [
            px.callbacks.TensorBoardLogger(tmp_path, log_every=7),
            px.callbacks.ProgressBar(console=console, plain_steps=False),
        ]
    )
    trainer.fit(loader(), epochs=2, eval_data=SETS, eval_every=5)
    scalars = read_scalars(tmp_path)
    values = [(e["step"], e["eval_val_loss"]) for e in trainer.history.evaluations]
    assert [step for step, _ in values] == [5, 10]
    logged = scalars["eval/val_loss"]
    assert [step for step, _ in logged] == [step for step, _ in values]
    assert [v for _, v in logged] == pytest.approx([v for _, v in values])
    assert [step for step, _ in scalars["eval/test_accuracy"]] == [5, 10]
    assert [step for step, _ in scalars["epoch/loss"]] == [7, 14]
    text = out.getvalue()
    # Two sets' metrics in one line would pass 100 characters: a line each.
    assert "epoch 1/2  step 5/14  val   loss " in text
    assert "epoch 2/2  step 10/14  val   loss " in text
    assert "epoch 2/2  step 10/14  test  loss " in text
    assert max(map(len, text.splitlines())) <= 100, text


@pytest.mark.parametrize("eval_every", [None, 5])
def test_plot_draws_each_set_beside_its_train_metric(tmp_path, eval_every):
    plot = px.callbacks.PlotHistory(tmp_path / "history.png")
    trainer = make_trainer([plot])
    trainer.fit(loader(), epochs=2, eval_data=SETS, eval_every=eval_every)
    plot.wait()
    history = trainer.history
    assert history.steps == [7, 14]
    assert plot._names(history) == ["loss", "accuracy"]  # a panel each
    curves = {
        label: (xs, ys)
        for label, xs, ys in _curves(history, "loss", by_step=eval_every is not None)
    }
    assert list(curves) == ["train", "val", "test"]
    evaluations = history.evaluations
    if eval_every is None:  # against epochs
        assert curves["train"] == ([1.0, 2.0], history["loss"])
        assert curves["test"] == ([1.0, 2.0], history["eval_test_loss"])
    else:  # against steps: the epochs' ends, the evaluations' steps
        assert curves["train"] == ([7.0, 14.0], history["loss"])
        assert curves["val"] == ([5.0, 10.0], [e["eval_val_loss"] for e in evaluations])
    image = matplotlib.image.imread(tmp_path / "history.png")
    assert image.shape == (300, 800, 4)  # 2 panels of 4 × 3 inches


class SlowSet:
    """An eval set that takes two seconds to read."""

    def __iter__(self):
        time.sleep(2.0)
        yield VAL


def test_throughput_leaves_evaluations_out_of_its_log_points():
    throughput = px.callbacks.Throughput(log_every=4)
    rates = Rates()
    trainer = make_trainer([throughput, rates])
    data = px.data.ArrayLoader((X, Y), 6, seed=1)  # 17 steps: no epoch end
    trainer.fit(data, steps=8, eval_data=SlowSet(), eval_every=4)
    # The log point of step 8 measures steps 5 to 8, and the evaluation of
    # two seconds after step 8 (before its hooks): were it counted, those 4
    # steps would run at under 2 steps a second, however fast they ran (the
    # bound is no timing of the steps, which a busy machine stretches).
    assert set(rates.steps_per_sec) == {4, 8}
    assert rates.steps_per_sec[8] > 2
    # The epoch's figure is its wall-clock pace, evaluations included.
    assert trainer.history[0]["steps_per_sec"] < 2  # 8 steps and 4 s of it


class Rates(px.Callback):
    def __init__(self):
        self.steps_per_sec = {}

    @override
    def on_step_end(self, info):
        if info.step % 4 == 0:
            self.steps_per_sec[info.step] = info.metrics["steps_per_sec"]
