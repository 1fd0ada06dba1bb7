"""px.testing.assert_equivalent: passes on correct losses (collectives
included, under the strategies where they apply) and names the set-up and the
parameter leaf on planted data-parallel bugs."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model


# SGD, not adam: adam's update hides a gradient off by a constant factor.
SGD = optax.sgd(0.5)
X, Y = make_data(32)
BATCHES = [(X, Y)]
STEPS = 2


def maker(trainer_class=px.DataParallelTrainer, **kwargs):
    def make_trainer(strategy):
        return trainer_class(
            make_model(), SGD, strategy=strategy, progress=False, **kwargs
        )

    return make_trainer


def ce(outputs, targets):
    return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)


class L2Trainer(px.DataParallelTrainer):
    """Correct: a penalty added to every example's loss."""

    @override
    def loss(self, model, outputs, targets):
        weights = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
        penalty = 1e-3 * sum(jnp.sum(w**2) for w in weights)
        return super().loss(model, outputs, targets) + penalty


class GlobalCentringTrainer(px.DataParallelTrainer):
    """Correct under a per-device strategy: logits centred by the mean over
    the global batch (a mean of the devices' equal-sized means)."""

    @override
    def loss(self, model, outputs, targets):
        mean = jax.lax.pmean(outputs.mean(axis=0), self.strategy.axis_name)
        return ce(outputs - mean[None, :], targets)


class LocalCentringTrainer(px.DataParallelTrainer):
    """Bug (c): logits centred by the mean over the device's own batch."""

    @override
    def loss(self, model, outputs, targets):
        return ce(outputs - outputs.mean(axis=0)[None, :], targets)


class PerDeviceMeanTrainer(px.DataParallelTrainer):
    """Bug (a): every example gets its device's batch mean."""

    @override
    def loss(self, model, outputs, targets):
        losses = ce(outputs, targets)
        return jnp.broadcast_to(losses.mean(), losses.shape)


class PsummedLossTrainer(px.DataParallelTrainer):
    """Bug (b): a psum of the per-example losses (phalanx sums once already)."""

    @override
    def loss(self, model, outputs, targets):
        return jax.lax.psum(ce(outputs, targets), self.strategy.axis_name)


class HardCodedAxisTrainer(px.DataParallelTrainer):
    """Bug (b'): a collective over an axis name the strategy does not use."""

    @override
    def loss(self, model, outputs, targets):
        losses = ce(outputs, targets)
        return losses - jax.lax.pmean(losses.mean(), "data") + losses.mean()


def test_correct_custom_loss_passes_every_default_setup():
    differences = px.testing.assert_equivalent(
        maker(L2Trainer, loss=ce), BATCHES, steps=STEPS
    )
    assert len(differences) == 4
    assert {name.split(" on ")[0].split("(")[0] for name in differences} == {
        "ShardingStrategy",
        "PmapStrategy",
        "AccumulatingStrategy",
        "FullyShardedStrategy",
    }
    assert all(name.endswith("on 8 devices") for name in differences)
    assert max(differences.values()) <= 1e-5


def test_correct_collective_passes_under_per_device_strategies():
    differences = px.testing.assert_equivalent(
        maker(GlobalCentringTrainer),
        BATCHES,
        strategies=[px.PmapStrategy(), ("fsdp", px.FullyShardedStrategy(min_size=1))],
        steps=STEPS,
    )
    assert list(differences) == ["PmapStrategy on 8 devices", "fsdp"]


def message(make_trainer, batches=BATCHES, **kwargs) -> str:
    with pytest.raises(AssertionError) as caught:
        px.testing.assert_equivalent(make_trainer, batches, steps=STEPS, **kwargs)
    text = str(caught.value)
    assert "The usual causes" in text and "per example" in text
    return text


def test_collective_under_sharding_strategy_fails_naming_the_setup():
    text = message(maker(GlobalCentringTrainer))
    assert text.startswith("ShardingStrategy on 8 devices could not train 2 steps")
    assert "unbound axis name" in text
    assert "collectives need a per-device strategy" in text


def test_per_device_mean_fails_naming_the_leaf():
    # Unequal weights per device: a device's batch mean is not its share of
    # the global weighted mean.
    w = np.linspace(0.1, 2.0, len(X)).astype(np.float32)
    text = message(
        maker(PerDeviceMeanTrainer), [(X, Y, w)], strategies=[px.PmapStrategy()]
    )
    found = re.match(
        r"PmapStrategy on 8 devices: parameter (\S+) differs from one device "
        r"on the full batch by (\S+) \(max abs; atol=1e-05\) after 2 steps",
        text,
    )
    assert found, text
    assert found[1] == "layers[0].weight"
    assert float(found[2]) > 1e-5


def test_psum_of_the_losses_fails():
    text = message(maker(PsummedLossTrainer), strategies=[px.PmapStrategy()])
    assert text.startswith("PmapStrategy on 8 devices: parameter layers[0].weight")


def test_collective_over_the_wrong_axis_fails():
    # The one-device reference binds "data"; the set-up's axis is "devices".
    strategy = px.PmapStrategy(axis_name="devices")
    text = message(maker(HardCodedAxisTrainer), strategies=[("devices", strategy)])
    assert text.startswith("devices could not train 2 steps: NameError")
    assert "self.strategy.axis_name" in text


def test_dependence_on_the_local_batch_fails_where_the_batch_is_split():
    # ShardingStrategy runs one global program: its "local" batch is the
    # global one, so it passes; PmapStrategy's slice is 4 examples.
    text = message(
        maker(LocalCentringTrainer),
        strategies=[px.ShardingStrategy(), px.PmapStrategy()],
    )
    assert text.startswith("PmapStrategy on 8 devices: parameter layers[0].weight")
    assert "depends on the per-device batch size" in text


def test_bad_arguments():
    with pytest.raises(TypeError, match="make_trainer=.* is not callable"):
        px.testing.assert_equivalent(None, BATCHES)  # pyright: ignore[reportArgumentType]
    for steps in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"steps=.* must be an int >= 1, e.g. 10"):
            px.testing.assert_equivalent(maker(), BATCHES, steps=steps)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="batches is empty"):
        px.testing.assert_equivalent(maker(), [])
    with pytest.raises(TypeError, match="neither a strategy nor"):
        px.testing.assert_equivalent(maker(), BATCHES, strategies=["pmap"])  # pyright: ignore[reportArgumentType]


def test_make_trainer_must_use_its_strategy():
    def ignores(strategy):
        del strategy
        return px.DataParallelTrainer(make_model(), SGD, progress=False)

    with pytest.raises(ValueError, match="ignored its strategy"):
        px.testing.assert_equivalent(ignores, BATCHES, steps=1)
