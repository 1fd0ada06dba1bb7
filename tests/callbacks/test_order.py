"""Issue 41, item 4: values callbacks add to the metrics reach every logger,
whatever the order of ``callbacks=`` (callbacks that add metrics run
first, each group in the order given)."""

import csv
import json

import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model


ADDED = ["goodput", "lr", *(f"time/{p}" for p in ("step", "callbacks", "data"))]


def batches(n: int = 4) -> list:
    x, y = make_data(16 * n)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 16 * n, 16)]


class Rate(px.Callback):
    """Adds a made-up ``lr`` at epoch ends (declared, as a user would)."""

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return ("lr",)

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        info.metrics["lr"] = 0.5 / (info.epoch + 1)


@pytest.mark.parametrize("adders", ["first", "last"])
def test_added_metrics_reach_the_loggers_in_either_order(tmp_path, adders):
    timeline = px.callbacks.Timeline(table=False)
    loggers = [
        px.callbacks.CSVLogger(tmp_path / "m.csv", log_every=2),
        px.callbacks.JSONLogger(tmp_path / "m.jsonl", log_every=2),
    ]
    added: list[px.Callback] = [timeline, Rate()]
    callbacks = [*added, *loggers] if adders == "first" else [*loggers, *added]
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=callbacks, progress=False
    )
    # The order they run in: those adding metrics first, in the given order.
    assert trainer.callbacks == (*added, *loggers)
    trainer.fit(batches(), epochs=2)

    with open(tmp_path / "m.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["kind"] == "epoch"]
    lines = map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())
    lines = [line for line in lines if line["kind"] == "epoch"]
    assert len(rows) == len(lines) == 2
    for row, line, epoch in zip(rows, lines, trainer.history, strict=True):
        for name in ADDED:
            assert name in epoch, name
            assert float(row[name]) == epoch[name], name  # (repr: exact)
            assert line[name] == epoch[name], name


def test_a_monitor_of_an_added_metric_listed_before_its_adder():
    # EarlyStopping watches Rate's lr; listed first, it still runs after it.
    stopper = px.callbacks.EarlyStopping(monitor="lr", mode="max", patience=1)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[stopper, Rate()], progress=False
    )
    trainer.fit(batches(), epochs=3)
    assert len(trainer.history) == 2  # lr fell at once: stopped after patience 1
    assert stopper.best == 0.5
