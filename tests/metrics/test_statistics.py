"""`px.metrics` beyond the multi-class averages: binary tasks, a statistic
of one's own, the mistakes a user makes, and what loggers, monitors,
checkpoints and resume do with a metric that is an array."""

import json
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float
from sklearn import metrics as sk
from typing_extensions import override

import phalanx as px
import phalanx.callbacks._arrays as arrays
from helpers import StopAt, make_data, make_model


RNG = np.random.default_rng(0)
XB = RNG.normal(size=(90, 3)).astype(np.float32)
YB = (XB[:, 0] + 0.8 * RNG.normal(size=90) > 0).astype(np.int32)
WB = RNG.uniform(0.2, 2.0, size=90).astype(np.float32)
BINARY = [(XB[i : i + 32], YB[i : i + 32], WB[i : i + 32]) for i in range(0, 90, 32)]


class RecallOfOne(px.metrics.Statistic):
    """The docstring's own statistic: recall of class 1, from two sums."""

    hit: Float[Array, " batch"]
    positive: Float[Array, " batch"]

    @override
    def total(self, weight):
        return jnp.stack([weight @ self.hit, weight @ self.positive])

    @override
    def read(self, total):
        return float(total[0] / total[1])


class Binary(px.DataParallelTrainer):
    def metrics(self, outputs, targets):
        logit = outputs[:, 0]  # one score per example
        two = jnp.stack([-logit, logit], axis=-1) / 2  # the same, as 2 logits
        hit = ((logit > 0) & (targets == 1)).astype(jnp.float32)
        return {
            "f1": px.metrics.f1(logit, targets, num_classes=2, average="binary"),
            "f1_two": px.metrics.f1(two, targets, num_classes=2, average="binary"),
            "precision": px.metrics.precision(
                jax.nn.sigmoid(logit),
                targets,
                num_classes=2,
                average="binary",
                from_logits=False,
            ),
            "auc": px.metrics.auc(logit, targets),
            "auc_two": px.metrics.auc(two, targets),
            "mine": RecallOfOne(hit, (targets == 1).astype(jnp.float32)),
        }


def test_binary_metrics_and_a_statistic_of_ones_own():
    model = px.models.Linear(3, 1, key=jax.random.key(1))
    trainer = Binary(
        model, optax.sgd(0.0), loss=lambda o, t: o[:, 0] ** 2, progress=False
    )
    got = trainer.evaluate(BINARY)
    score = np.asarray(jax.vmap(model)(jnp.asarray(XB)))[:, 0]
    pred = (score > 0).astype(int)
    want = {
        "f1": sk.f1_score(YB, pred, sample_weight=WB),
        "f1_two": sk.f1_score(YB, pred, sample_weight=WB),
        "precision": sk.precision_score(YB, pred, sample_weight=WB),
        "auc": sk.roc_auc_score(YB, score, sample_weight=WB),
        "auc_two": sk.roc_auc_score(YB, score, sample_weight=WB),
        "mine": sk.recall_score(YB, pred, sample_weight=WB),
    }
    for name, value in want.items():
        tolerance = 1e-3 if name.startswith("auc") else 1e-6
        assert abs(got[name] - value) <= tolerance, (name, got[name], value)


@pytest.mark.parametrize(
    ("metric", "error"),
    [
        (
            lambda o, t: px.metrics.f1(o, t, num_classes=5),
            r"^metrics\(\): px.metrics.f1: outputs of shape \(16, 3\), but "
            r"num_classes=5; pass scores of shape \(batch, 5\)",
        ),
        (
            lambda o, t: px.metrics.recall(o, t, num_classes=3, average="binary"),
            r"recall: average='binary' scores class 1 of a binary task, but "
            "num_classes=3",
        ),
        (
            lambda o, t: px.metrics.precision(
                o,
                t,
                num_classes=3,
                average="mean",  # pyright: ignore[reportArgumentType]
            ),
            r"precision: average='mean'; pass one of 'macro', 'micro'",
        ),
        (
            lambda o, t: px.metrics.auc(o[:, 0], t, num_classes=3),
            r"auc: outputs of shape \(16,\) \(one score per example\) with "
            "num_classes=3",
        ),
        (
            lambda o, t: px.metrics.f1(o[:, :1], t),
            r"^metrics\(\): px.metrics.f1: outputs of shape \(16, 1\) hold one "
            r"score per example, in an axis of 1: no classes to count",
        ),
        (
            lambda o, t: px.metrics.auc(o, t, num_classes=3, num_thresholds=1),
            r"auc: num_thresholds=1; pass an int >= 2",
        ),
    ],
)
def test_mistakes_are_named_before_anything_runs(metric, error):
    class Wrong(px.DataParallelTrainer):
        def metrics(self, outputs, targets):
            return {"m": metric(outputs, targets)}

    trainer = Wrong(make_model(), optax.sgd(0.1), progress=False)
    x, y = make_data(16)
    with pytest.raises(ValueError, match=error):
        trainer.fit([(x, y)], epochs=1)
    assert trainer.progress.step == 0


@eqx.filter_jit  # one program, not op by op: ~3x faster here
def total(statistic: px.metrics.Statistic, weight: jax.Array) -> jax.Array:
    return statistic.total(weight)


def read(statistic: px.metrics.Statistic, weight: np.ndarray):
    return statistic.read(np.asarray(total(statistic, jnp.asarray(weight))))


@pytest.mark.parametrize(
    "metric",
    [
        px.metrics.f1,
        px.metrics.precision,
        px.metrics.recall,
        px.metrics.confusion_matrix,
        px.metrics.auc,
    ],
)
def test_num_classes_is_counted_on_per_class_outputs(metric):
    outputs = jnp.asarray(RNG.normal(size=(40, 10)), jnp.float32)
    targets = jnp.asarray(RNG.integers(0, 10, 40), jnp.int32)
    weight = np.ones(40, np.float32)
    # auc took 2 classes by default and refused these 10 classes' scores.
    counted = read(metric(outputs, targets), weight)
    np.testing.assert_array_equal(
        counted, read(metric(outputs, targets, num_classes=10), weight)
    )
    # One score per example: a binary task.
    score, label = outputs[:, 0], (targets > 4).astype(jnp.int32)
    np.testing.assert_array_equal(
        read(metric(score, label), weight),
        read(metric(score, label, num_classes=2), weight),
    )


def test_f1_without_num_classes_in_the_metrics_hook_trains():
    class F1(px.DataParallelTrainer):
        def metrics(self, outputs, targets):
            return {"f1": px.metrics.f1(outputs, targets)}  # 3 classes, counted

    class Told(px.DataParallelTrainer):
        def metrics(self, outputs, targets):
            return {"f1": px.metrics.f1(outputs, targets, num_classes=3)}

    got = F1(make_model(), optax.sgd(0.1), progress=False).evaluate(batches(2))
    want = Told(make_model(), optax.sgd(0.1), progress=False).evaluate(batches(2))
    assert got["f1"] == want["f1"]


@pytest.mark.parametrize(
    ("outputs", "advice"),
    [
        (
            np.zeros((16, 1), np.float32),
            "px.metrics.f1: outputs of shape (16, 1) hold one score per example, "
            "in an axis of 1: no classes to count for num_classes=None; pass "
            "outputs[:, 0] (shape (batch,): a binary task), or a score per "
            "class, of shape (batch, num_classes)",
        ),
        (  # per-token outputs, one label per example: see test_token_metrics.py
            np.zeros((16, 4, 3), np.float32),
            "px.metrics.f1: targets of shape (16,) do not fit outputs of shape "
            "(16, 4, 3); pass class labels of shape (16, 4) (per token, negative "
            "ones left out) or one-hot targets of shape (16, 4, 3)",
        ),
    ],
)
def test_outputs_with_no_classes_to_count_ask_for_num_classes(outputs, advice):
    with pytest.raises(ValueError) as error:
        px.metrics.f1(jnp.asarray(outputs), jnp.zeros(16, jnp.int32))
    assert str(error.value) == advice


class Confused(px.DataParallelTrainer):
    def metrics(self, outputs, targets):
        return {
            "confusion": px.metrics.confusion_matrix(outputs, targets, num_classes=3),
            "f1": px.metrics.f1(outputs, targets, num_classes=3),
        }


def batches(n: int = 4, seed: int = 0):
    x, y = make_data(16 * n, seed)
    return [(x[i : i + 16], y[i : i + 16]) for i in range(0, 16 * n, 16)]


def test_a_confusion_matrix_in_history_loggers_and_checkpoints(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(arrays, "_SAID", set())  # as in a new process
    loggers = [
        px.callbacks.CSVLogger(tmp_path / "m.csv", log_every=2),
        px.callbacks.JSONLogger(tmp_path / "m.jsonl", log_every=2),
        px.callbacks.TensorBoardLogger(tmp_path / "tb", log_every=2),
        px.callbacks.PlotHistory(tmp_path / "h.png"),
        px.callbacks.Checkpoint(tmp_path / "ckpt"),
    ]
    trainer = Confused(
        make_model(), optax.adam(1e-2), callbacks=loggers, progress=False
    )
    with caplog.at_level(logging.INFO, logger="phalanx"):
        trainer.fit(batches(), epochs=2, eval_data=batches(1, seed=1))
    matrix = trainer.history[-1]["confusion"]
    assert isinstance(matrix, np.ndarray) and matrix.shape == (3, 3)
    assert matrix.sum() == 64  # every example of the epoch, once
    evaluated = trainer.history[-1]["eval_confusion"]
    assert isinstance(evaluated, np.ndarray) and evaluated.sum() == 16
    # The CSV and TensorBoard files hold numbers only: one line says so, for
    # both loggers, the matrix and its evaluations'.
    header = (tmp_path / "m.csv").read_text().splitlines()[0].split(",")
    assert "f1" in header and "confusion" not in header
    said = [r.getMessage() for r in caplog.records if "leave out" in r.getMessage()]
    assert said == [
        "loggers that write numbers only (CSV, TensorBoard, MLflow, W&B) leave "
        "out 'confusion' (an array of shape (3, 3)) and its evaluations' "
        "(eval_...); it is in trainer.history, and a JSONLogger writes it"
    ]
    # JSON holds the matrix as nested lists.
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    epoch = [row for row in map(json.loads, lines) if row["kind"] == "epoch"]
    np.testing.assert_array_equal(epoch[-1]["confusion"], matrix)
    # A checkpoint keeps the history's arrays; a new trainer resumes them.
    again = Confused(make_model(), optax.adam(1e-2), progress=False)
    again.fit(batches(), epochs=2, resume=tmp_path / "ckpt")
    np.testing.assert_array_equal(again.history[-1]["confusion"], matrix)


@pytest.mark.parametrize(
    "watch",
    [
        lambda _: px.callbacks.EarlyStopping(monitor="confusion", patience=1),
        lambda folder: px.callbacks.Checkpoint(folder, monitor="confusion"),
    ],
)
def test_monitoring_an_array_is_refused(watch, tmp_path):
    trainer = Confused(
        make_model(), optax.sgd(0.1), callbacks=[watch(tmp_path)], progress=False
    )
    with pytest.raises(TypeError, match="monitor='confusion' is an array of shape"):
        trainer.fit(batches(), epochs=1)


def test_resume_mid_epoch_sums_statistics_exactly(tmp_path):
    straight = Confused(make_model(), optax.adam(1e-2), progress=False)
    straight.fit(batches(), epochs=1)

    saving = px.callbacks.Checkpoint(tmp_path, every_n_steps=2, every_n_epochs=None)
    first = Confused(
        make_model(), optax.adam(1e-2), callbacks=[saving, StopAt(2)], progress=False
    )
    first.fit(batches(), epochs=1)
    resumed = Confused(make_model(), optax.adam(1e-2), progress=False)
    resumed.fit(batches(), epochs=1, resume=tmp_path)
    np.testing.assert_array_equal(
        resumed.history[-1]["confusion"], straight.history[-1]["confusion"]
    )
    assert resumed.history[-1]["f1"] == straight.history[-1]["f1"]

    # Resumed with other metrics, the epoch's sums cannot go on.
    other = px.DataParallelTrainer(make_model(), optax.adam(1e-2), progress=False)
    with pytest.raises(ValueError, match="in the middle of epoch 0 with running sums"):
        other.fit(batches(), epochs=1, resume=tmp_path)
