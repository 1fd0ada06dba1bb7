"""px.testing.assert_equivalent: passes on correct losses (collectives
included, under the strategies where they apply), names the set-up, the step
and the value on planted data-parallel bugs, and tells an adam-amplified
zero-gradient leaf from a wrong strategy."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, params_of


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
        losses = super().loss(model, outputs, targets)
        assert isinstance(losses, jax.Array)  # the built-in loss's, per example
        return losses + penalty


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


class StraightThroughPsumTrainer(px.DataParallelTrainer):
    """Bug (b''): a psum whose value cancels but whose gradient does not: the
    loss is right, the gradient 9x under 8 devices, 2x on one."""

    @override
    def loss(self, model, outputs, targets):
        losses = ce(outputs, targets)
        summed = jax.lax.psum(losses, self.strategy.axis_name)
        return losses + summed - jax.lax.stop_gradient(summed)


class HardCodedAxisTrainer(px.DataParallelTrainer):
    """Bug (b'): a collective over an axis name the strategy does not use."""

    @override
    def loss(self, model, outputs, targets):
        losses = ce(outputs, targets)
        return losses - jax.lax.pmean(losses.mean(), "data") + losses.mean()


def test_correct_custom_loss_passes_every_default_setup():
    results = px.testing.assert_equivalent(
        maker(L2Trainer, loss=ce), BATCHES, steps=STEPS
    )
    assert {name.split(" on ")[0].split("(")[0] for name in results} == {
        "ShardingStrategy",
        "PmapStrategy",
        "AccumulatingStrategy",
        "FullyShardedStrategy",
        "MeshStrategy",
    }
    assert all(name.endswith("on 8 devices") for name in results)
    for result in results.values():
        assert isinstance(result, px.testing.Equivalence)
        assert result.gradient <= 1e-4 and result.values <= 1e-4
        assert result.model_state == 0 and result.parameters <= 1e-5
        assert result.amplified == ()


def test_default_fully_sharded_setup_splits_the_model():
    # min_size from the model: the larger half of the splittable leaves of
    # MLP(5, 3, hidden=(8,)) (weights 8x5 = 40 and 3x8 = 24, bias 8) split.
    results = px.testing.assert_equivalent(maker(), BATCHES, steps=1)
    (name,) = [name for name in results if name.startswith("FullyShardedStrategy")]
    assert name == "FullyShardedStrategy(min_size=24) on 8 devices"
    assert results[name].split == ("layers[0].weight", "layers[1].weight")
    # Hybrid sharding: replicated over 2, the same leaves split over 4.
    hybrid = "MeshStrategy(data=2, fsdp=4, min_size=24) on 8 devices"
    assert results[hybrid].split == results[name].split
    assert all(not r.split for n, r in results.items() if n not in (name, hybrid))


def test_correct_collective_passes_under_per_device_strategies():
    results = px.testing.assert_equivalent(
        maker(GlobalCentringTrainer),
        BATCHES,
        strategies=[px.PmapStrategy(), ("fsdp", px.FullyShardedStrategy(min_size=1))],
        steps=STEPS,
    )
    assert list(results) == ["PmapStrategy on 8 devices", "fsdp"]
    assert len(results["fsdp"].split) == 3


def message(make_trainer, batches=BATCHES, **kwargs) -> str:
    with pytest.raises(AssertionError) as caught:
        px.testing.assert_equivalent(make_trainer, batches, steps=STEPS, **kwargs)
    text = str(caught.value)
    assert "The usual causes" in text and "per example" in text
    return text


STEP_0 = (
    r"PmapStrategy on 8 devices: at step 0, from the same state as one "
    r"device on the full batch, "
)


def test_collective_under_sharding_strategy_fails_naming_the_setup():
    text = message(maker(GlobalCentringTrainer))
    assert text.startswith("ShardingStrategy on 8 devices could not train")
    assert "unbound axis name" in text
    assert "collectives need a per-device strategy" in text


def test_per_device_mean_fails_naming_the_loss():
    # Unequal weights per device: a device's batch mean is not its share of
    # the global weighted mean.
    w = np.linspace(0.1, 2.0, len(X)).astype(np.float32)
    text = message(
        maker(PerDeviceMeanTrainer), [(X, Y, w)], strategies=[px.PmapStrategy()]
    )
    found = re.match(
        STEP_0 + r"the loss is (\S+) where one device computes (\S+) "
        r"\(difference (\S+), (\S+) of its scale; rtol=0.0001\)",
        text,
    )
    assert found, text
    assert float(found[4]) > 1e-2


def test_psum_of_the_losses_fails():
    text = message(maker(PsummedLossTrainer), strategies=[px.PmapStrategy()])
    assert re.match(STEP_0 + r"the loss is \S+ where one device computes", text)


def test_a_wrong_gradient_behind_a_right_loss_fails_naming_the_leaf():
    text = message(maker(StraightThroughPsumTrainer), strategies=[px.PmapStrategy()])
    found = re.match(
        STEP_0 + r"the gradient of (\S+) differs by (\S+) \(max abs\), (\S+) "
        r"of its scale",
        text,
    )
    assert found, text
    assert found[1] == "layers[0].weight"
    assert float(found[3]) > 1  # 9x against 2x: off by several times its size


def test_collective_over_the_wrong_axis_fails():
    # The one-device reference binds "data"; the set-up's axis is "devices".
    strategy = px.PmapStrategy(axis_name="devices")
    text = message(maker(HardCodedAxisTrainer), strategies=[("devices", strategy)])
    assert text.startswith("devices could not train: NameError")
    assert "self.strategy.axis_name" in text


def test_dependence_on_the_local_batch_fails_where_the_batch_is_split():
    # ShardingStrategy runs one global program: its "local" batch is the
    # global one, so it passes; PmapStrategy's slice is 4 examples.
    text = message(
        maker(LocalCentringTrainer),
        strategies=[px.ShardingStrategy(), px.PmapStrategy()],
    )
    assert re.match(STEP_0 + "the loss is", text)
    assert "depends on the per-device batch size" in text


class ShiftedMLP(eqx.Module):
    """A shift added to every hidden unit and centred away at once: its
    gradient is zero in exact arithmetic, rounding noise in float32."""

    hidden: eqx.nn.Linear
    shift: jax.Array
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.hidden = eqx.nn.Linear(5, 16, key=k1)
        self.shift = jnp.full((1,), 0.5)
        self.out = eqx.nn.Linear(16, 3, key=k2)

    def __call__(self, x):
        h = self.hidden(x) + self.shift
        return self.out(jnp.tanh(h - h.mean()))


def test_an_adam_amplified_zero_gradient_is_named_not_blamed():
    def make(optimizer):
        def make_trainer(strategy):
            model = ShiftedMLP(jax.random.key(0))
            return px.DataParallelTrainer(
                model, optimizer, strategy=strategy, progress=False
            )

        return make_trainer

    strategies = [px.ShardingStrategy(), px.PmapStrategy()]
    with_adam = px.testing.assert_equivalent(
        make(optax.adam(1e-2)), BATCHES, strategies=strategies, steps=3
    )
    # adam's first step moves every entry by about its learning rate, in the
    # direction the rounding points: a wrong strategy would look the same.
    assert any(r.amplified == ("shift",) for r in with_adam.values())
    # Far beyond atol=1e-5 (by how much depends on the rounding, so on the
    # compiler: 6e-4 to 4e-3 measured), yet not blamed on the strategy.
    assert max(r.parameters for r in with_adam.values()) > 1e-4
    with_sgd = px.testing.assert_equivalent(
        make(optax.sgd(0.5)), BATCHES, strategies=strategies, steps=3
    )
    assert all(r.amplified == () and r.parameters <= 1e-6 for r in with_sgd.values())


def test_an_update_beyond_the_optimizers_rounding_fails():
    # The second signal on its own: the parameters a step leads to, against
    # atol plus what the optimizer makes of the step's rounding.
    from phalanx.testing._compare import Allowance, check_update

    found = [("w", 2e-5, 1.0), ("shift", 3e-3, 1.0)]
    allowed = {"w": Allowance(0.0, False), "shift": Allowance(4e-3, True)}
    assert check_update("s", 0, 1e-5, found[1:], allowed) == (3e-3, {"shift"})
    with pytest.raises(AssertionError) as caught:
        check_update("s", 2, 1e-5, found, allowed)
    assert str(caught.value).startswith(
        "s: at step 2, from the same state as one device on the full batch, the "
        "update leaves parameter w 2e-05 (max abs) away from one device's, more "
        "than atol=1e-05 plus 0, what the optimizer makes of the rounding"
    )
    allowed["shift"] = Allowance(1e-3, True)
    with pytest.raises(AssertionError, match="zero up to rounding .* optax.sgd"):
        check_update("s", 0, 1e-5, found[1:], allowed)


def test_compute_step_is_the_step_fit_takes():
    trainer = maker()(px.PmapStrategy())
    values = trainer.compute_step((X, Y))
    assert trainer.progress.step == 0  # nothing applied
    fitted = maker()(px.PmapStrategy())
    fitted.fit(BATCHES, steps=1)
    assert values.metrics["loss"] == pytest.approx(fitted.history["loss"][0])
    assert values.metrics.keys() == {"loss", "accuracy"}
    for a, b in zip(
        params_of(values.state.model), params_of(fitted.model), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    trainer.state = values.state
    assert trainer.progress.step == 1
    shapes = [p.shape for p in params_of(trainer.model)]
    assert [g.shape for g in jax.tree.leaves(values.grads)] == shapes


def test_bad_arguments():
    with pytest.raises(TypeError, match="make_trainer=.* is not callable"):
        px.testing.assert_equivalent(None, BATCHES)  # pyright: ignore[reportArgumentType]
    for steps in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"steps=.* must be an int >= 1, e.g. 10"):
            px.testing.assert_equivalent(maker(), BATCHES, steps=steps)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"rtol=-1 must be a finite number"):
        px.testing.assert_equivalent(maker(), BATCHES, rtol=-1)
    with pytest.raises(ValueError, match=r"atol=-1 must be a finite number"):
        px.testing.assert_equivalent(maker(), BATCHES, atol=-1)
    with pytest.raises(ValueError, match="batches is empty"):
        px.testing.assert_equivalent(maker(), [])
    with pytest.raises(TypeError, match="neither a strategy nor"):
        px.testing.assert_equivalent(maker(), BATCHES, strategies=["pmap"])  # pyright: ignore[reportArgumentType]


def test_make_trainer_must_use_its_strategy_and_model():
    def ignores(strategy):
        del strategy
        return px.DataParallelTrainer(make_model(), SGD, progress=False)

    with pytest.raises(ValueError, match="ignored its strategy"):
        px.testing.assert_equivalent(ignores, BATCHES, steps=1)
    seeds = iter(range(10))

    def another_model(strategy):
        model = make_model(next(seeds))
        return px.DataParallelTrainer(model, SGD, strategy=strategy, progress=False)

    with pytest.raises(ValueError, match=r"parameter layers\[0\]\.weight differs"):
        px.testing.assert_equivalent(another_model, BATCHES, steps=1)
