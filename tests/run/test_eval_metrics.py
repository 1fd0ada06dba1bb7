"""The `eval_metrics` hook: metrics of evaluations only (Lightning's
``validation_step``), in `evaluate` and in `fit`'s evaluations."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import CLASSES, make_data, make_model


class TopTwo(px.DataParallelTrainer):
    """Accuracy in training; a top-2 accuracy on held-out data only."""

    @override
    def eval_metrics(self, outputs, targets):
        top2 = jax.lax.top_k(outputs, 2)[1]
        hit = jnp.any(top2 == targets[:, None], axis=-1)
        return {**self.metrics(outputs, targets), "top2": hit.astype(jnp.float32)}


def by_hand(trainer: px.DataParallelTrainer, x: np.ndarray, y: np.ndarray) -> float:
    """The top-2 accuracy of the trainer's model on (x, y), on the host."""
    logits = np.asarray(jax.vmap(trainer.model)(x))
    top2 = np.argsort(-logits, axis=-1)[:, :2]
    return float(np.mean(np.any(top2 == y[:, None], axis=-1)))


@pytest.mark.parametrize("strategy", [px.ShardingStrategy, px.PmapStrategy])
def test_evaluations_log_the_eval_metrics_and_training_does_not(strategy):
    assert CLASSES > 2  # top-2 differs from top-1
    x, y = make_data(96)
    held_out = make_data(40, seed=1)  # ragged: 40 rows on 8 devices, padded
    stopper = px.callbacks.EarlyStopping("eval_top2", mode="max", patience=5)
    trainer = TopTwo(
        make_model(), optax.adam(1e-2), strategy=strategy(8), callbacks=[stopper]
    )
    trainer.fit(px.data.ArrayLoader((x, y), 32), epochs=2, eval_data=[held_out])
    epoch = trainer.history[-1]
    assert "eval_top2" in epoch and "top2" not in epoch
    assert {"loss", "accuracy", "eval_loss", "eval_accuracy"} <= set(epoch)
    assert epoch["eval_top2"] == pytest.approx(by_hand(trainer, *held_out), abs=1e-6)
    assert stopper.best == max(trainer.history["eval_top2"])
    results = trainer.evaluate([held_out])
    assert set(results) == {"loss", "accuracy", "top2"}
    assert results["top2"] == pytest.approx(epoch["eval_top2"], abs=1e-6)
    assert results["top2"] >= results["accuracy"]


def test_a_monitor_of_a_metric_only_training_has_is_refused():
    # "eval_top3" is no evaluation metric: known once the first batch is
    # traced, and refused before the first step.
    x, y = make_data(32)
    stopper = px.callbacks.EarlyStopping("eval_top3", mode="max")
    trainer = TopTwo(make_model(), optax.adam(1e-2), callbacks=[stopper])
    with pytest.raises(ValueError, match=r"Did you mean 'eval_top2'\?"):
        trainer.fit([(x, y)], epochs=1, eval_data=[(x, y)])
    assert int(trainer.state.step) == 0


def test_a_bad_eval_metrics_names_its_hook():
    class Bad(px.DataParallelTrainer):
        @override
        def eval_metrics(self, outputs, targets):  # pyright: ignore[reportIncompatibleMethodOverride]
            return [outputs]  # a list, not a dict: wrong on purpose

    x, y = make_data(32)
    with pytest.raises(TypeError, match=r"eval_metrics\(\) returned a list"):
        Bad(make_model(), optax.adam(1e-2)).evaluate([(x, y)])
