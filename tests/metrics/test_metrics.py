"""`px.metrics`: dataset-level metrics equal scikit-learn's under every
strategy, device count, ragged last batch, sample weights and
``steps_per_call``, in training and in evaluations."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn import metrics as sk

import phalanx as px
from helpers import make_strategy


(X_TRAIN, Y_TRAIN), (X_TEST, Y_TEST) = px.data.load_digits()
# Uneven sample weights; a batch of 48 leaves a ragged last batch of 24.
WEIGHTS = np.linspace(0.25, 2.0, len(Y_TEST)).astype(np.float32)
BATCH = 48


def metrics_of(outputs, targets):
    return {
        # Not in alphabetical order: the packed sums are read by name.
        "recall": px.metrics.recall(outputs, targets, num_classes=10),
        "f1": px.metrics.f1(outputs, targets, num_classes=10),
        "accuracy": (jnp.argmax(outputs, -1) == targets).astype(jnp.float32),
        "f1_micro": px.metrics.f1(outputs, targets, num_classes=10, average="micro"),
        "f1_weighted": px.metrics.f1(
            outputs, targets, num_classes=10, average="weighted"
        ),
        "precision": px.metrics.precision(outputs, targets, num_classes=10),
        "confusion": px.metrics.confusion_matrix(outputs, targets, num_classes=10),
        "auc": px.metrics.auc(outputs, targets, num_classes=10),
    }


class MetricsTrainer(px.DataParallelTrainer):
    def metrics(self, outputs, targets):
        return metrics_of(outputs, targets)


@pytest.fixture(scope="module")
def trained():
    """A digits classifier, trained for a few epochs (every class predicted,
    some wrongly)."""
    model = px.models.MLP(64, 10, (32,), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), strategy=px.ShardingStrategy(1), progress=False
    )
    trainer.fit(px.data.ArrayLoader((X_TRAIN, Y_TRAIN), 128), epochs=3)
    logits = np.asarray(trainer.predict(X_TEST))
    return trainer.model, logits


def reference(logits: np.ndarray, weights: np.ndarray) -> dict:
    """scikit-learn's values of every metric of `metrics_of`."""
    pred = logits.argmax(-1)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
    score = ft.partial(sk.f1_score, Y_TEST, pred, sample_weight=weights)
    return {
        "f1": score(average="macro"),
        "f1_micro": score(average="micro"),
        "f1_weighted": score(average="weighted"),
        # scikit-learn documents zero_division=0 but annotates a str.
        "precision": sk.precision_score(
            Y_TEST,
            pred,
            average="macro",
            sample_weight=weights,
            zero_division=0,  # pyright: ignore[reportArgumentType]
        ),
        "recall": sk.recall_score(Y_TEST, pred, average="macro", sample_weight=weights),
        "accuracy": sk.accuracy_score(Y_TEST, pred, sample_weight=weights),
        "confusion": sk.confusion_matrix(
            Y_TEST, pred, labels=range(10), sample_weight=weights
        ),
        "auc": sk.roc_auc_score(
            Y_TEST, probs, multi_class="ovr", average="macro", sample_weight=weights
        ),
    }


def batches():
    return [
        (X_TEST[i : i + BATCH], Y_TEST[i : i + BATCH], WEIGHTS[i : i + BATCH])
        for i in range(0, len(Y_TEST), BATCH)
    ]


def assert_matches(got: dict, want: dict, prefix: str = "") -> None:
    for name, value in want.items():
        tolerance = 1e-3 if name == "auc" else 1e-5  # the AUC's binning
        np.testing.assert_allclose(
            got[prefix + name], value, rtol=0, atol=tolerance, err_msg=name
        )


SETUPS = [
    (kind, devices, k)
    for kind in ("sharding", "pmap", "fsdp", "sharding+acc2")
    for devices in (1, 2, 8)
    for k in (1,)
] + [("sharding", 8, 4), ("pmap+acc2", 2, 4)]


@pytest.mark.parametrize(("kind", "devices", "steps_per_call"), SETUPS)
def test_metrics_equal_scikit_learn(trained, kind, devices, steps_per_call):
    model, logits = trained
    want = reference(logits, WEIGHTS)
    # A learning rate of 0: training sums the metrics of the same model that
    # evaluates, over the same examples (a pass over the test set).
    trainer = MetricsTrainer(
        model,
        optax.sgd(0.0),
        strategy=make_strategy(kind, devices),
        steps_per_call=steps_per_call,
        progress=False,
    )
    trainer.fit(batches(), epochs=1)
    assert_matches(trainer.history[-1], want)
    assert_matches(trainer.evaluate(batches()), want)
