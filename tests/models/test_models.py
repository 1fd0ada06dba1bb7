"""Any Equinox model trains under every strategy: plain, with Dropout (keys),
with BatchNorm (state)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import (
    CLASSES,
    IN,
    STRATEGIES,
    BatchNormMLP,
    DropoutMLP,
    make_data,
    max_abs_diff,
    params_of,
)


@pytest.fixture(scope="module")
def data():
    x, y = make_data(64)
    return [(x[:32], y[:32]), (x[32:], y[32:])]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_equinox_mlp_trains(name, data):
    model = eqx.nn.MLP(IN, CLASSES, width_size=16, depth=2, key=jr.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), strategy=STRATEGIES[name]()
    )
    trainer.fit(data, epochs=20)
    assert trainer.history[-1]["loss"] < 0.7 * trainer.history[0]["loss"]


def dropout_fit(strategy, seed, data, p=0.5):
    model = DropoutMLP(p, key=jr.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), strategy=strategy, seed=seed
    )
    trainer.fit(data, epochs=3)
    return trainer


def test_dropout_keys_are_reproducible_and_layout_free(data):
    # Keys depend on (seed, step, example), not on devices or microbatches: every
    # strategy gives the same update, and the same seed gives the same run.
    runs = {name: dropout_fit(make(), 1, data) for name, make in STRATEGIES.items()}
    one_device = dropout_fit(px.ShardingStrategy(1), 1, data)
    for trainer in runs.values():
        assert max_abs_diff(trainer.model, one_device.model) <= 1e-5
    assert (
        max_abs_diff(dropout_fit(px.PmapStrategy(8), 1, data).model, runs["pmap"].model)
        == 0
    )
    assert (
        max_abs_diff(dropout_fit(px.PmapStrategy(8), 2, data).model, runs["pmap"].model)
        > 1e-4
    )
    no_dropout = dropout_fit(px.PmapStrategy(8), 1, data, p=0.0)
    assert max_abs_diff(no_dropout.model, runs["pmap"].model) > 1e-4


def test_dropout_draws_a_fresh_mask_every_step():
    losses = []

    class Record(px.Callback):
        @override
        def on_step_end(self, info):
            losses.append(info.metrics["loss"])

    x, y = make_data(16)
    trainer = px.DataParallelTrainer(
        DropoutMLP(0.5, key=jr.key(0)), optax.sgd(0.0), callbacks=[Record()]
    )
    trainer.fit([(x, y)], steps=4)  # no learning: only the masks change
    assert len(set(losses)) == 4
    # Evaluation runs in inference mode: no dropout, no key dependence.
    assert trainer.evaluate([(x, y)]) == trainer.evaluate([(x, y)])


def batchnorm_fit(strategy, axis_name, data, epochs=3, mode="batch"):
    # SGD, not adam: the bias before a BatchNorm has a true gradient of 0, and
    # adam would blow float noise in it up to full-size steps.
    model, state = eqx.nn.make_with_state(BatchNormMLP)(axis_name, mode, key=jr.key(0))
    trainer = px.DataParallelTrainer(
        model, optax.sgd(0.1), strategy=strategy, model_state=state
    )
    trainer.fit(data, epochs=epochs)
    return trainer


def running_stats(trainer):
    return [np.asarray(leaf) for leaf in jax.tree.leaves(trainer.state.model_state)]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_batchnorm_trains_and_updates_state(name, data):
    trainer = batchnorm_fit(STRATEGIES[name](), "batch", data, epochs=20)
    assert trainer.history[-1]["loss"] < 0.85 * trainer.history[0]["loss"]
    counter, mean, var = running_stats(trainer)
    # One update of the running statistics per microbatch, in order.
    assert (
        counter == 40 * getattr(trainer.strategy, "microbatches", 1)
        and np.max(np.abs(mean)) > 0
        and np.min(var) > 0
    )
    predictions = trainer.predict(data[0][0])
    assert predictions.shape == (32, CLASSES)


@pytest.mark.parametrize("mode", ["batch", "ema"])
def test_batchnorm_statistics_are_global(mode, data):
    # ShardingStrategy: the "batch" axis is the whole global batch. PmapStrategy:
    # name the device axis too for global statistics. Both then equal one device.
    one = batchnorm_fit(px.ShardingStrategy(1), "batch", data, mode=mode)
    sharded = batchnorm_fit(px.ShardingStrategy(8), "batch", data, mode=mode)
    pmapped = batchnorm_fit(px.PmapStrategy(8), ("batch", "data"), data, mode=mode)
    local = batchnorm_fit(px.PmapStrategy(8), "batch", data, mode=mode)
    for trainer in (sharded, pmapped):
        assert max_abs_diff(trainer.model, one.model) <= 1e-5
        for a, b in zip(running_stats(trainer), running_stats(one), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    # Per-device statistics (4 examples each) give a different update.
    assert max_abs_diff(local.model, one.model) > 1e-4


# BatchNorm's default mode="ema" writes a constant into its state: it must
# train inside jax.shard_map too (PmapStrategy, AccumulatingStrategy around
# either strategy, a deterministic reduction), not only in the global view.
EMA_STRATEGIES = {
    **STRATEGIES,
    "sharding+acc": lambda: px.AccumulatingStrategy(px.ShardingStrategy(8), 2),
    "sharding+deterministic": lambda: px.ShardingStrategy(8, deterministic=True),
}


@pytest.mark.parametrize("name", list(EMA_STRATEGIES))
def test_batchnorm_ema_trains_and_updates_state(name, data):
    trainer = batchnorm_fit(EMA_STRATEGIES[name](), "batch", data, 20, mode="ema")
    assert trainer.history[-1]["loss"] < 0.85 * trainer.history[0]["loss"]
    first_time, mean, var = running_stats(trainer)
    assert not first_time and np.max(np.abs(mean)) > 0 and np.min(var) > 0
    assert trainer.predict(data[0][0]).shape == (32, CLASSES)


def test_batchnorm_ema_accumulation_matches_one_device(data):
    # With k microbatches over n devices, microbatch j is rows j*m..(j+1)*m of
    # every device's slice (m = batch / (n k)). Reordered so that these are
    # the rows one device's microbatch j holds, and with global statistics,
    # n devices give one device's update and running statistics: the state
    # is threaded through the microbatches in order, on every device alike.
    def fit(inner, axis_name, k=2):
        n = inner.num_devices
        batches = [
            tuple(
                x.reshape(k, n, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
                for x in batch
            )
            for batch in data
        ]
        strategy = px.AccumulatingStrategy(inner, k)
        return batchnorm_fit(strategy, axis_name, batches, mode="ema")

    one = fit(px.ShardingStrategy(1), "batch")
    pmapped = fit(px.PmapStrategy(8), ("batch", "data"))
    assert max_abs_diff(pmapped.model, one.model) <= 1e-5
    for a, b in zip(running_stats(pmapped), running_stats(one), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # Around ShardingStrategy the step runs per device too: "batch" is each
    # device's microbatch, as under PmapStrategy.
    local = [fit(inner(8), "batch") for inner in (px.ShardingStrategy, px.PmapStrategy)]
    assert max_abs_diff(local[0].model, local[1].model) <= 1e-5
    assert max_abs_diff(local[0].model, one.model) > 1e-4


def test_reference_models():
    key = jr.key(0)
    linear = px.models.Linear(3, 2, key=key)
    assert linear(jnp.ones(3)).shape == (2,)
    assert px.models.Linear(3, 2, use_bias=False, key=key).layer.bias is None
    mlp = px.models.MLP(4, 2, hidden=(5, 6, 7), activation=jnp.tanh, key=key)
    assert [layer.weight.shape for layer in mlp.layers] == [
        (5, 4),
        (6, 5),
        (7, 6),
        (2, 7),
    ]
    assert mlp(jnp.ones(4)).shape == (2,)
    assert len(params_of(px.models.MLP(4, 2, hidden=(), key=key))) == 2
    with pytest.raises(ValueError, match=r"shape \(4,\), got x.shape=\(3,\)"):
        mlp(jnp.ones(3))
    with pytest.raises(ValueError, match=r"hidden=\(0,\)"):
        px.models.MLP(3, 2, hidden=(0,), key=key)
