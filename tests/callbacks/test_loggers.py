"""File loggers and the history plot: every file they write is read back."""

import csv
import json
import math
import os
import pathlib
import subprocess
import sys

import jax
import matplotlib.image
import numpy as np
import optax
import pytest
from tensorboardX.proto import event_pb2
from typing_extensions import override

import phalanx as px
from helpers import RaiseAt, make_data, make_model, read_events, read_scalars
from phalanx.callbacks import CSVLogger, JSONLogger, PlotHistory, TensorBoardLogger


STEPS_PER_EPOCH = 4
TRAIN_METRICS = ["loss", "accuracy"]
EVAL_METRICS = ["eval_loss", "eval_accuracy"]
# Generated protobuf classes are invisible to static checkers.
Event = event_pb2.Event  # pyright: ignore[reportAttributeAccessIssue]


def batches(n: int = STEPS_PER_EPOCH, size: int = 16, seed: int = 0):
    x, y = make_data(n * size, seed)
    return [(x[i : i + size], y[i : i + size]) for i in range(0, n * size, size)]


def eval_batches():
    return [make_data(24, seed=1)]


def loggers(
    folder: pathlib.Path, log_every: int
) -> list[CSVLogger | JSONLogger | TensorBoardLogger]:
    return [
        CSVLogger(folder / "metrics.csv", log_every=log_every),
        JSONLogger(folder / "metrics.jsonl", log_every=log_every),
        TensorBoardLogger(folder / "tb", log_every=log_every),
    ]


def read_csv(path: pathlib.Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows; every line must have exactly the header's fields."""
    with open(path, newline="") as file:
        lines = list(csv.reader(file))
    header, body = lines[0], lines[1:]
    assert all(len(line) == len(header) for line in body), lines
    return header, [dict(zip(header, line, strict=True)) for line in body]


def read_jsonl(path: pathlib.Path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def cells(row: dict[str, str], names: list[str]) -> dict[str, float]:
    return {name: float(row[name]) for name in names}


class AddHostValues(px.Callback):
    """Adds host values at step ends from `start` on, as an LR logger would."""

    def __init__(self, start: int):
        self.start = start

    @override
    def on_step_end(self, info):
        if info.step >= self.start:
            info.metrics["lr"] = 0.5 / info.step
            info.metrics["bad"] = float("nan") if info.step % 2 else float("-inf")


def test_files_agree_with_history(tmp_path):
    plot = PlotHistory(tmp_path / "history.png")
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[*loggers(tmp_path, 3), plot]
    )
    trainer.fit(batches(), epochs=3, eval_data=eval_batches())
    plot.wait()  # drawn on a thread of its own

    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header[:3] == ["kind", "step", "epoch"]
    assert sorted(header[3:]) == sorted(TRAIN_METRICS + EVAL_METRICS)
    # Eval columns first appear at the first epoch end: after the train ones.
    assert set(header[3:5]) == set(TRAIN_METRICS)
    steps = [row for row in rows if row["kind"] == "step"]
    epochs = [row for row in rows if row["kind"] == "epoch"]
    assert [int(r["step"]) for r in steps] == [3, 6, 9, 12]
    assert [int(r["epoch"]) for r in steps] == [0, 1, 2, 2]
    assert all(r[name] == "" for r in steps for name in EVAL_METRICS)
    assert [int(r["step"]) for r in epochs] == [4, 8, 12]
    assert [int(r["epoch"]) for r in epochs] == [0, 1, 2]
    assert len(rows) == 7
    for row, logs in zip(epochs, trainer.history, strict=True):
        assert cells(row, TRAIN_METRICS + EVAL_METRICS) == logs  # exact: repr

    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        assert line["kind"] == row["kind"]
        assert (line["step"], line["epoch"]) == (int(row["step"]), int(row["epoch"]))
        names = [n for n in header[3:] if row[n] != ""]
        assert sorted(line) == sorted(["kind", "step", "epoch", *names])
        assert {n: line[n] for n in names} == cells(row, names)

    scalars = read_scalars(tmp_path / "tb")
    for name in TRAIN_METRICS:
        assert scalars[f"train/{name}"] == [
            (int(r["step"]), float(np.float32(r[name]))) for r in steps
        ]
        assert scalars[f"epoch/{name}"] == [
            (int(r["step"]), float(np.float32(r[name]))) for r in epochs
        ]
        assert scalars[f"eval/{name}"] == [
            (int(r["step"]), float(np.float32(r[f"eval_{name}"]))) for r in epochs
        ]
    assert len(scalars) == 3 * len(TRAIN_METRICS)

    png = tmp_path / "history.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape == (300, 800, 4)  # 2 panels of 4 × 3 inches at 100 dpi
    assert image.std() > 0.05  # something is drawn
    assert sorted(os.listdir(tmp_path)) == [
        "history.png",
        "metrics.csv",
        "metrics.jsonl",
        "tb",
    ]  # no temporary files left


def test_plot_one_epoch_and_chosen_metrics(tmp_path):
    plots = [
        PlotHistory(tmp_path / "one.png", metrics=["loss"]),
        PlotHistory(tmp_path / "all.png"),
    ]
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=plots)
    trainer.fit(batches(), epochs=1)
    for plot in plots:
        plot.wait()
    one = matplotlib.image.imread(tmp_path / "one.png")
    assert one.shape == (300, 400, 4)
    # A single point is still drawn (a marker): the panel is not blank.
    assert one.std() > 0.05
    assert matplotlib.image.imread(tmp_path / "all.png").shape == (300, 800, 4)


def test_plot_is_not_redrawn_when_the_history_is_unchanged(tmp_path):
    path = tmp_path / "history.png"
    drawn = []  # the file as each epoch end left it, and as fit left it
    plot = PlotHistory(path, max_share=1)  # redrawn at every epoch end

    class Seen(px.Callback):  # after the plot
        @override
        def added_metrics(self):  # adds none, as the plot: runs after it
            return ()

        @override
        def on_epoch_end(self, info):
            plot.wait()
            drawn.append(os.stat(path).st_mtime_ns)

    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[plot, Seen()]
    )
    trainer.fit(batches(), epochs=1)
    plot.wait()
    drawn.append(os.stat(path).st_mtime_ns)
    assert drawn[0] == drawn[1]  # fit's end drew nothing new
    trainer.evaluate(eval_batches())  # (not in the history)
    trainer.fit(batches(), epochs=1)
    plot.wait()
    drawn.append(os.stat(path).st_mtime_ns)
    assert drawn[1] < drawn[2] == drawn[3]


def test_plot_unknown_metric_names_the_history(tmp_path):
    plot = PlotHistory(tmp_path / "h.png", metrics=["loss", "nope"])
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[plot])
    with pytest.raises(ValueError, match=r"no 'nope'; it has \['loss', 'accuracy'\]"):
        trainer.fit(batches(), epochs=1)


def test_host_values_from_earlier_callbacks_and_non_finite(tmp_path):
    """Values an earlier callback adds are logged; a column appearing mid-file
    rewrites it; NaN/inf round-trip (CSV "nan", JSON "NaN"/"-Infinity")."""
    callbacks = [AddHostValues(start=4), *loggers(tmp_path, 2)]
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=callbacks
    )
    trainer.fit(batches(), epochs=2)

    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header[-2:] == ["lr", "bad"]
    steps = [row for row in rows if row["kind"] == "step"]
    assert [(r["step"], r["lr"]) for r in steps[:2]] == [("2", ""), ("4", "0.125")]
    assert [r["bad"] for r in steps] == ["", "-inf", "-inf", "-inf"]
    # Epoch logs are the history's dict: the step-time additions are not in it.
    assert all(r["lr"] == "" for r in rows if r["kind"] == "epoch")

    lines = [line for line in read_jsonl(tmp_path / "metrics.jsonl") if "bad" in line]
    assert [line["bad"] for line in lines] == ["-Infinity"] * 3
    assert all(math.isinf(float(line["bad"])) for line in lines)
    assert [line["lr"] for line in lines] == [0.125, 0.5 / 6, 0.0625]

    scalars = read_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["train/lr"]] == [4, 6, 8]
    assert all(value == -math.inf for _, value in scalars["train/bad"])


def test_crash_leaves_complete_rows(tmp_path):
    callbacks = [*loggers(tmp_path, 3), RaiseAt(7)]
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=callbacks
    )
    with pytest.raises(RuntimeError, match="boom at step 7"):
        trainer.fit(batches(), epochs=3, eval_data=eval_batches())

    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [(r["kind"], int(r["step"])) for r in rows] == [
        ("step", 3),
        ("epoch", 4),
        ("step", 6),
    ]
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(line["kind"], line["step"]) for line in lines] == [
        ("step", 3),
        ("epoch", 4),
        ("step", 6),
    ]
    # The event file was closed and is whole.
    assert [s for s, _ in read_scalars(tmp_path / "tb")["train/loss"]] == [3, 6]
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv", "metrics.jsonl", "tb"]


def test_failed_header_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    """The header is widened all or nothing: the old file stays whole."""
    logger = CSVLogger(tmp_path / "metrics.csv", log_every=1)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[logger])
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 3:  # header, +train columns, +eval columns: fail here
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        trainer.fit(batches(n=2), epochs=1, eval_data=eval_batches())
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert sorted(header) == sorted(["kind", "step", "epoch", *TRAIN_METRICS])
    assert [(r["kind"], r["step"]) for r in rows] == [("step", "1"), ("step", "2")]
    assert os.listdir(tmp_path) == ["metrics.csv"]


@pytest.mark.parametrize("log_every", [1, 4])
def test_device_metrics_fetched_only_at_log_points(tmp_path, monkeypatch, log_every):
    steps = 16

    def run(callbacks) -> int:
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), callbacks=callbacks, sync_every=64
        )
        trainer.fit(batches(), steps=2)  # compile outside the counted run
        fetches = []
        real_get = jax.device_get
        monkeypatch.setattr(
            jax, "device_get", lambda t: fetches.append(t) or real_get(t)
        )
        with jax.transfer_guard_device_to_host("disallow"):
            trainer.fit(batches(n=steps), epochs=1)
        monkeypatch.setattr(jax, "device_get", real_get)
        return len(fetches)

    baseline = run([])
    # Three loggers share one fetch per log point (StepInfo caches the metrics).
    assert run(loggers(tmp_path, log_every)) == baseline + steps // log_every


def test_later_fits_append_and_a_new_logger_starts_afresh(tmp_path):
    csv_logger = CSVLogger(tmp_path / "metrics.csv", log_every=2)
    json_logger = JSONLogger(tmp_path / "metrics.jsonl", log_every=2)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), callbacks=[csv_logger, json_logger]
    )
    trainer.fit(batches(), epochs=1)
    trainer.fit(batches(), epochs=1)
    _, rows = read_csv(tmp_path / "metrics.csv")
    expected = [("step", 2), ("step", 4), ("epoch", 4)]
    expected += [("step", 6), ("step", 8), ("epoch", 8)]
    assert [(r["kind"], int(r["step"])) for r in rows] == expected
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(line["kind"], line["step"]) for line in lines] == expected

    fresh = CSVLogger(tmp_path / "metrics.csv", log_every=2)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=[fresh])
    trainer.fit(batches(n=2), epochs=1)
    _, rows = read_csv(tmp_path / "metrics.csv")
    assert [(r["kind"], int(r["step"])) for r in rows] == [("step", 2), ("epoch", 2)]


def test_resume_from_state_dict_is_exact(tmp_path):
    """Checkpoint after epoch 0, crash in epoch 1 after rows were logged,
    resume: the files read as if the run had never crashed."""
    first = loggers(tmp_path, 3)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=first)
    trainer.fit(batches(), epochs=1, eval_data=eval_batches())
    saved = [logger.state_dict() for logger in first]
    state, history = trainer.state, trainer.history.state_dict()
    trainer.callbacks = (*first, RaiseAt(7))
    with pytest.raises(RuntimeError):
        trainer.fit(batches(), epochs=1, eval_data=eval_batches())

    second = loggers(tmp_path, 3)
    for logger, logger_state in zip(second, saved, strict=True):
        logger.load_state_dict(logger_state)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), callbacks=second)
    trainer.state = state
    trainer.history.load_state_dict(history)
    trainer.fit(batches(), epochs=1, eval_data=eval_batches())

    expected = [("step", 3), ("epoch", 4), ("step", 6), ("epoch", 8)]
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert [(r["kind"], int(r["step"])) for r in rows] == expected
    assert set(EVAL_METRICS) <= set(header)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(line["kind"], line["step"]) for line in lines] == expected
    # The resumed event file tells TensorBoard to hide the crashed run's
    # events after step 4 (SessionLog START at the purge step).
    starts = [e.step for e in read_events(tmp_path / "tb") if e.session_log.status]
    assert starts == [5]


@pytest.mark.parametrize("make", [CSVLogger, JSONLogger, TensorBoardLogger])
def test_logger_arguments_checked_when_built(tmp_path, make):
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=rf"log_every={bad!r} must be an int >= 1"):
            make(tmp_path / "out", log_every=bad)
    make(tmp_path / "missing" / "out")  # its folder is made at the first fit
    with pytest.raises(TypeError, match=r"must be a str or os.PathLike"):
        make(3)
    assert os.listdir(tmp_path) == []  # nothing is written before fit


@pytest.mark.parametrize("make", [CSVLogger, JSONLogger, PlotHistory])
def test_file_path_is_not_a_folder(tmp_path, make):
    with pytest.raises(IsADirectoryError, match=r"is a folder; pass a file path, e.g"):
        make(tmp_path)


def test_logdir_is_not_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=r"logdir=.* is a file"):
        TensorBoardLogger(tmp_path / "file")


def test_plot_arguments_checked_when_built(tmp_path):
    with pytest.raises(ValueError, match=r"no image suffix.*'\.png'"):
        PlotHistory(tmp_path / "history.txt")
    with pytest.raises(TypeError, match=r"metrics='loss' must be a list"):
        PlotHistory(tmp_path / "h.png", metrics="loss")
    with pytest.raises(TypeError, match=r"holds 3, not a str"):
        PlotHistory(tmp_path / "h.png", metrics=["loss", 3])  # pyright: ignore
    with pytest.raises(ValueError, match=r"pass the train name 'loss'"):
        PlotHistory(tmp_path / "h.png", metrics=["eval_loss"])
    with pytest.raises(ValueError, match=r"names no metric"):
        PlotHistory(tmp_path / "h.png", metrics=[])
    with pytest.raises(ValueError, match=r"repeats a name"):
        PlotHistory(tmp_path / "h.png", metrics=["loss", "loss"])
    PlotHistory(tmp_path / "missing" / "h.png")  # its folder is made when drawn
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    ("make", "module", "extra"),
    [
        (lambda path: TensorBoardLogger(path / "tb"), "tensorboardX", "tensorboard"),
        (
            lambda path: PlotHistory(path / "h.png"),
            "matplotlib.backends.backend_agg",
            "plot",
        ),
    ],
)
def test_missing_extra_is_named(tmp_path, monkeypatch, make, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(ImportError, match=rf"pip install 'phalanx\[{extra}\]'"):
        make(tmp_path)


def test_plot_leaves_the_users_backend_alone(tmp_path):
    """No pyplot, no matplotlib.use: a user's backend and figures are untouched."""
    script = f"""
import sys, matplotlib
from phalanx._state._history import History
from phalanx.callbacks import PlotHistory
plot = PlotHistory({str(tmp_path / "h.png")!r})
plot._draw(History([{{"loss": 1.0}}]))
plot.wait()
backend = dict.__getitem__(matplotlib.rcParams, "backend")  # without resolving it
print("matplotlib.pyplot" in sys.modules, backend)
"""
    env = {**os.environ, "MPLBACKEND": "svg"}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.split() == ["False", "svg"]
    assert matplotlib.image.imread(tmp_path / "h.png").shape == (300, 400, 4)
