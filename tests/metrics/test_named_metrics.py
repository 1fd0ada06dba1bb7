"""``DataParallelTrainer(metrics=)``: the built-in metrics by name (the
CLI's ``--metric`` names, one list) or a mapping of functions, without a
subclass; checked when the trainer is built; names known before any batch;
refused beside a subclass's own `metrics` hook."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model
from phalanx._metric_names import METRIC_NAMES
from phalanx.cli._parser import METRICS
from phalanx.metrics._named import BUILT_IN


DATA = [make_data(32, seed=s) for s in range(3)]
TEST = [make_data(24, seed=9)]
KNOWN = "accuracy, f1, precision, recall, auc, confusion_matrix"


def trainer(cls=px.DataParallelTrainer, **options) -> px.DataParallelTrainer:
    return cls(make_model(), optax.adam(1e-2), progress=False, **options)


class Subclassed(px.DataParallelTrainer[px.models.MLP]):
    """The same metrics the way a subclass says them."""

    @override
    def metrics(self, outputs, targets):
        return {
            **super().metrics(outputs, targets),  # accuracy
            "f1": px.metrics.f1(outputs, targets),
            "auc": px.metrics.auc(outputs, targets),
        }


def test_names_log_what_a_subclass_logs():
    named = trainer(metrics=("accuracy", "f1", "auc", "f1"))  # repeats dropped
    named.fit(DATA, epochs=2, eval_data=TEST)
    hooked = trainer(Subclassed)
    hooked.fit(DATA, epochs=2, eval_data=TEST)
    assert set(named.history[-1]) == {
        *("loss", "accuracy", "f1", "auc"),
        *("eval_loss", "eval_accuracy", "eval_f1", "eval_auc"),
    }
    assert named.history.epochs == hooked.history.epochs  # to the bit
    assert named.evaluate(TEST) == hooked.evaluate(TEST)


def test_a_mapping_of_functions_statistics_and_names():
    def top2(outputs, targets):  # per example: the label among the 2 best
        best = jnp.argsort(outputs, axis=-1)[:, -2:]
        return jnp.any(best == targets[:, None], axis=-1).astype(jnp.float32)

    mapped = trainer(
        metrics={
            "top2": top2,
            "recall": lambda o, t: px.metrics.recall(o, t, average="micro"),
            "acc": "accuracy",
        }
    )
    mapped.fit(DATA, epochs=1)
    results = mapped.evaluate(TEST)
    assert sorted(results) == ["acc", "loss", "recall", "top2"]
    x, y = TEST[0]
    scores = np.asarray(mapped.predict(x))
    best = np.argsort(scores, axis=-1)[:, -2:]
    assert results["top2"] == pytest.approx(np.mean(np.any(best == y[:, None], -1)))
    accuracy = np.mean(scores.argmax(-1) == y)
    # micro-averaged recall of one label per example is the accuracy
    assert results["acc"] == pytest.approx(accuracy)
    assert results["recall"] == pytest.approx(accuracy)


def test_one_hot_targets_score_as_their_labels():
    # categorical_cross_entropy's one-hot rows: the labels their arg-max.
    one_hot = [(x, np.eye(3, dtype=np.float32)[y]) for x, y in DATA]
    names = ("accuracy", "f1", "confusion_matrix")
    categorical = trainer(loss="categorical_cross_entropy", metrics=names)
    categorical.fit(one_hot, epochs=1)
    labels = trainer(metrics=names)
    labels.fit(DATA, epochs=1)
    got, want = categorical.history[-1], labels.history[-1]
    assert (got["accuracy"], got["f1"]) == (want["accuracy"], want["f1"])
    np.testing.assert_array_equal(got["confusion_matrix"], want["confusion_matrix"])


def test_no_metrics_logs_the_loss_alone():
    bare = trainer(metrics=())
    bare.fit(DATA, epochs=1)
    assert list(bare.history[-1]) == ["loss"]
    assert list(bare.evaluate(TEST)) == ["loss"]


def test_the_names_are_known_before_any_batch():
    calls = []

    def mine(outputs, targets):
        calls.append(1)
        return jnp.zeros(outputs.shape[0])

    watching = trainer(
        metrics={"mine": mine},
        callbacks=[px.callbacks.EarlyStopping(monitor="eval_mien")],
    )
    with pytest.raises(ValueError, match=r"Did you mean 'eval_mine'\?"):
        watching.fit(DATA, epochs=1, eval_data=TEST)
    assert calls == []  # refused before the first batch was traced
    watching.callbacks = [px.callbacks.EarlyStopping(monitor="eval_mine")]
    watching.fit(DATA, epochs=1, eval_data=TEST)


@pytest.mark.parametrize(
    ("metrics", "error", "message"),
    [
        (
            ("accuracy", "f2"),
            ValueError,
            f"metrics: unknown metric 'f2'; the built-in ones are {KNOWN}; for "
            "your own, pass a mapping of names to fn(outputs, targets) -> "
            "per-example values or a px.metrics statistic",
        ),
        (
            "f1",
            TypeError,
            "metrics='f1' is one name; pass a tuple of names, e.g. metrics=('f1',)",
        ),
        (
            (px.metrics.f1,),
            TypeError,
            f"metrics holds {px.metrics.f1!r}, which is not a built-in metric's "
            f"name ({KNOWN}); for a function of your own, pass a mapping that "
            "names it, e.g. metrics={'top2': top2}",
        ),
        (
            {"loss": "accuracy"},
            ValueError,
            "metrics['loss']: 'loss' is a name the trainer logs itself (loss, "
            "weight, skipped, skipped_steps, loss_scale); rename it, e.g. "
            "'loss_metric'",
        ),
        (
            {"top2": 2},
            TypeError,
            "metrics['top2']=2 is neither a function of (outputs, targets) "
            "returning per-example values or a px.metrics statistic, nor a "
            f"built-in name ({KNOWN})",
        ),
        (
            {"acc": "acuracy"},
            ValueError,
            f"metrics['acc']: unknown metric 'acuracy'; the built-in ones are {KNOWN}",
        ),
        (
            3,
            TypeError,
            "metrics=3 must be a tuple of built-in names, e.g. metrics=('accuracy', "
            "'f1', 'auc'), or a mapping of names to fn(outputs, targets), e.g. "
            "metrics={'top2': top2}",
        ),
    ],
)
def test_bad_metrics_are_refused_when_built(metrics, error, message):
    with pytest.raises(error) as refused:
        trainer(metrics=metrics)
    assert str(refused.value).startswith(message)


def test_classifier_metrics_of_a_regression_are_refused():
    with pytest.raises(ValueError) as refused:
        trainer(loss="mse", metrics=("f1",))
    assert str(refused.value) == (
        "metrics: 'f1' scores a classifier, but loss='mse' is not a classification "
        "loss; use loss='cross_entropy' (or 'categorical_cross_entropy'), or pass "
        "metrics as a mapping of names to fn(outputs, targets), e.g. metrics="
        "{'mae': lambda o, t: jnp.abs(o - t).mean(-1)}"
    )


def test_a_subclass_with_its_own_hook_is_refused_the_argument():
    with pytest.raises(TypeError) as refused:
        trainer(Subclassed, metrics=("f1",))
    assert str(refused.value) == (
        "metrics=('f1',) and Subclassed.metrics, its own metrics hook, both say "
        "what a step logs; pass one: drop metrics=, or return those from the hook "
        "(px.metrics.f1(outputs, targets), ...)"
    )


def test_one_list_of_names_for_the_trainer_and_the_cli():
    assert tuple(BUILT_IN) == METRIC_NAMES
    assert METRICS is METRIC_NAMES
