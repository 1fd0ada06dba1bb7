"""Values the loss returns beside itself, ``(losses, {name: values})``:
logged as metrics of training and evaluations, summed exactly under every
strategy; and the loss hook's mistakes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import make_data, make_model, make_strategy


X, Y = make_data(60, seed=3)  # batches of 16: a ragged last batch of 12
W = np.linspace(0.5, 1.5, len(Y)).astype(np.float32)
BATCHES = [(X[i : i + 16], Y[i : i + 16], W[i : i + 16]) for i in range(0, 60, 16)]


def parts(outputs, targets):
    fit = jax.nn.logsumexp(outputs, axis=-1) - jnp.take_along_axis(
        outputs, targets[:, None], axis=-1
    ).squeeze(-1)
    size = 1e-2 * jnp.sum(outputs**2, axis=-1)
    return fit, size


class LoggingLoss(px.DataParallelTrainer):
    def loss(self, model, outputs, targets):
        fit, size = parts(outputs, targets)
        values = {
            "fit": fit,
            "size": size,
            "f1": px.metrics.f1(outputs, targets, num_classes=outputs.shape[-1]),
        }
        return fit + size, values


def by_hand(model) -> dict[str, float]:
    outputs = jax.vmap(model)(X)
    fit, size = (np.asarray(v, np.float64) for v in parts(outputs, Y))
    mean = lambda v: float(np.sum(W * v) / np.sum(W))  # noqa: E731
    return {"loss": mean(fit + size), "fit": mean(fit), "size": mean(size)}


@pytest.mark.parametrize("kind", ["sharding", "pmap", "fsdp", "sharding+acc2", "mesh"])
def test_loss_values_are_logged_exactly_under_every_strategy(kind):
    model = make_model()
    trainer = LoggingLoss(
        model, optax.sgd(0.0), strategy=make_strategy(kind, 8), progress=False
    )
    trainer.fit(BATCHES, epochs=1, eval_data=BATCHES)
    want = by_hand(model)
    epoch = trainer.history[-1]
    for name, value in want.items():
        assert abs(epoch[name] - value) <= 1e-6 * max(1.0, abs(value)), name
        assert abs(epoch[f"eval_{name}"] - value) <= 1e-6 * max(1.0, abs(value))
    assert 0.0 <= epoch["f1"] <= 1.0 and epoch["f1"] == epoch["eval_f1"]


def test_a_loss_returning_a_wrong_pair_is_named():
    class Wrong(px.DataParallelTrainer):
        def loss(self, model, outputs, targets):  # pyright: ignore[reportIncompatibleMethodOverride]
            return parts(outputs, targets)  # a pair of arrays, not (losses, dict)

    trainer = Wrong(make_model(), optax.sgd(0.1), progress=False)
    with pytest.raises(TypeError, match=r"loss returned a tuple of 2.*\(losses, \{"):
        trainer.fit(BATCHES, epochs=1)


def test_a_value_named_like_a_metric_is_refused():
    class Clash(px.DataParallelTrainer):
        def loss(self, model, outputs, targets):
            fit, _ = parts(outputs, targets)
            return fit, {"accuracy": fit}

    trainer = Clash(make_model(), optax.sgd(0.1), progress=False)
    with pytest.raises(ValueError, match="'accuracy'.*rename one"):
        trainer.fit(BATCHES, epochs=1)
