"""Research code subclasses the trainer: a loss with a regulariser, an extra
metric, collectives inside the loss, a gradient transform."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, max_abs_diff


def l2(model) -> jax.Array:
    return jnp.asarray(
        sum(
            jnp.sum(p**2)
            for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        )
    )


class L2Trainer(px.DataParallelTrainer):
    @override
    def loss(self, model, outputs, targets):
        losses = super().loss(model, outputs, targets)
        assert isinstance(losses, jax.Array)  # the built-in loss's, per example
        return losses + 1e-2 * l2(model)

    @override
    def metrics(self, outputs, targets):
        top2 = jnp.argsort(outputs, axis=-1)[:, -2:]
        hit = jnp.any(top2 == targets[:, None], axis=-1).astype(jnp.float32)
        return {**super().metrics(outputs, targets), "top2": hit}


@pytest.mark.parametrize("name", ["loss", "weight", "skipped"])
def test_a_metric_may_not_take_the_trainers_own_names(name):
    class Clashing(px.DataParallelTrainer):
        @override
        def metrics(self, outputs, targets):
            return {name: jnp.zeros(outputs.shape[0])}

    x, y = make_data(16)
    trainer = Clashing(make_model(), optax.adam(1e-2))
    # Its own message, not wrapped as a batch that does not fit the model.
    message = rf"^metrics\(\) returned a metric named '{name}'.*rename it, e\.g\."
    with pytest.raises(ValueError, match=message):
        trainer.fit([(x, y)], steps=1)
    assert int(trainer.state.step) == 0


def test_regularised_loss_and_extra_metric():
    x, y = make_data(64)
    model = make_model()
    trainer = L2Trainer(model, optax.adam(1e-2), strategy=px.PmapStrategy(8))
    trainer.fit([(x, y)], steps=10)

    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    def loss(params):
        m = eqx.combine(params, static)
        ce = optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(x), y)
        return jnp.mean(ce) + 1e-2 * l2(m)

    # Jitted: run op by op, the ten steps took ~6 s of CPU (and a minute on
    # a busy machine), each operation dispatched and compiled on its own.
    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state

    for _ in range(10):
        params, opt_state = step(params, opt_state)
    assert max_abs_diff(trainer.model, eqx.combine(params, static)) <= 1e-5
    logs = trainer.history[-1]
    assert set(logs) == {"loss", "accuracy", "top2"}
    assert logs["top2"] >= logs["accuracy"]
    assert trainer.evaluate([(x, y)])["top2"] >= 0


class ContrastiveTrainer(px.DataParallelTrainer):
    """InfoNCE over the global batch: every device's embeddings are negatives."""

    @override
    def loss(self, model, outputs, targets):
        del model, targets
        axis = self.strategy.axis_name
        everyone = jax.lax.all_gather(outputs, axis, tiled=True)
        # Scale by the global mean squared norm, computed with psum.
        total = jax.lax.psum(jnp.sum(outputs**2), axis)
        count = jax.lax.psum(outputs.shape[0], axis)
        logits = outputs @ everyone.T / (total / count)
        own = jax.lax.axis_index(axis) * outputs.shape[0] + jnp.arange(outputs.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, own)


@pytest.mark.parametrize("devices", [2, 8])
def test_collectives_in_the_loss_match_one_device(devices):
    # A global-batch loss written per device with all_gather / psum gives the
    # same update on 8 devices as on one device holding the whole batch.
    x, _ = make_data(32)
    y = np.zeros(32, np.int32)  # unused by the loss
    runs = []
    for n in (1, devices):
        trainer = ContrastiveTrainer(
            make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(n)
        )
        trainer.fit([(x, y)], steps=10)
        runs.append(trainer)
    assert max_abs_diff(runs[0].model, runs[1].model) <= 1e-5
    assert runs[1].history[-1]["loss"] == pytest.approx(
        runs[0].history[-1]["loss"], rel=1e-5
    )


class ClippingTrainer(px.DataParallelTrainer):
    @override
    def gradients(self, grads, state):
        return jax.tree.map(lambda g: jnp.clip(g, -1e-3, 1e-3), grads)


def test_gradient_transform_hook():
    x, y = make_data(32)
    plain = px.DataParallelTrainer(make_model(), optax.sgd(1.0))
    clipped = ClippingTrainer(make_model(), optax.sgd(1.0))
    for trainer in (plain, clipped):
        trainer.fit([(x, y)], steps=1)
    step = max_abs_diff(clipped.model, make_model())
    assert step <= 1e-3 + 1e-7
    assert max_abs_diff(plain.model, make_model()) > step


class BrokenGradients(px.DataParallelTrainer):
    @override
    def gradients(self, grads, state):
        return jax.tree.map(lambda g: g[..., None], grads)


def test_gradients_must_match_parameters():
    x, y = make_data(32)
    trainer = BrokenGradients(make_model(), optax.sgd(1.0))
    with pytest.raises(
        TypeError, match=r"gradient of model.layers\[0\].weight is float32"
    ):
        trainer.fit([(x, y)], steps=1)
    assert int(trainer.state.step) == 0


class DictTrainer(px.DataParallelTrainer):
    @override
    def split_batch(self, batch):
        return batch["image"], batch["label"]


def test_custom_batch_structure():
    x, y = make_data(32)
    trainer = DictTrainer(make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(4))
    trainer.fit([{"image": x, "label": y}], steps=3)
    assert int(trainer.state.step) == 3
    assert set(trainer.evaluate([{"image": x, "label": y}])) == {"loss", "accuracy"}


def test_dict_batches_with_sample_weight_work_by_default():
    # {"x", "y", "sample_weight"} dicts need no hook overrides; a zero weight
    # drops an example exactly.
    x, y = make_data(32)
    weight = np.ones(32, np.float32)
    weight[20:] = 0
    weighted = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    weighted.fit([{"x": x, "y": y, "sample_weight": weight}], steps=3)
    dropped = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    dropped.fit([{"x": x[:20], "y": y[:20]}], steps=3)
    assert max_abs_diff(weighted.model, dropped.model) <= 1e-5


def test_weighted_and_unweighted_batches_mix():
    # Sample weights are folded into the step's weights on the host, so a run
    # fed (x, y, w) can be evaluated on (x, y) with one compiled step.
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit([(x, y, np.ones(32, np.float32))], steps=2)
    trainer.fit([(x, y)], steps=2)
    assert set(trainer.evaluate([(x, y)])) == {"loss", "accuracy"}
    with pytest.raises(ValueError, match=r"sample_weight values outside \[0, inf\)"):
        trainer.fit([(x, y, -np.ones(32, np.float32))], steps=1)
    with pytest.raises(ValueError, match=r"one number per example, shape \(32,\)"):
        trainer.fit([(x, y, np.ones(31, np.float32))], steps=1)
