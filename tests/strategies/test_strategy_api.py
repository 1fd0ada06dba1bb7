"""A fourth strategy, written here against the abstract `px.Strategy` alone:
parameters replicated, the optimizer state split over the data axis (as
ZeRO-1 does). It must train to the update of one device on the full batch,
and its layout must hold wherever phalanx handles state: after `fit`, in
`state`, through a checkpoint's save and restore, and `save_model`."""

from typing import Any, final

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, max_abs_diff, reference_fit


@final
class ShardedOptimizerStrategy(px.Strategy):
    """Replicated parameters; each optimizer-state array whose leading axis
    divides over the devices is split along it."""

    mesh: Mesh
    axis_name: str

    def __init__(self, devices: int):
        self.axis_name = "data"
        self.mesh = Mesh(np.array(jax.devices()[:devices]), (self.axis_name,))

    @property
    @override
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    @override
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.axis_name))

    @property
    @override
    def batch_multiple(self) -> int:
        return self.mesh.size

    @override
    def state_shardings(self, state: Any) -> Any:
        replicated = NamedSharding(self.mesh, P())
        split = NamedSharding(self.mesh, P(self.axis_name))
        n = self.mesh.size
        return eqx.tree_at(
            lambda s: s.opt_state,
            jax.tree.map(lambda _: replicated, state),
            jax.tree.map(
                lambda x: split if x.ndim and x.shape[0] % n == 0 else replicated,
                state.opt_state,
            ),
        )

    @override
    def reduce(self, fn, replicated, carry, examples):
        # The global view: the compiler inserts the one all-reduce.
        return fn(replicated, carry, examples)

    @override
    def map(self, fn, replicated, examples):
        return fn(replicated, examples)


def specs(tree) -> list[Any]:
    """Each array's partition spec, in order."""
    return [x.sharding.spec for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def expected_specs(trainer) -> list[Any]:
    strategy = trainer.strategy
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        eqx.filter(trainer.state, eqx.is_array),
    )
    return [s.spec for s in jax.tree.leaves(strategy.state_shardings(abstract))]


@pytest.fixture(scope="module")
def batches():
    x, y = make_data(64)
    return [(x[:32], y[:32]), (x[32:], y[32:])]


@pytest.fixture(scope="module")
def trained(batches):
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=ShardedOptimizerStrategy(8)
    )
    trainer.fit(batches, epochs=5)
    return trainer


def test_it_matches_one_device_on_the_full_batch(trained, batches):
    reference = reference_fit(make_model(), batches, steps=10)
    assert max_abs_diff(trained.model, reference) <= 1e-5
    assert int(trained.state.step) == 10


def test_its_layout_holds_after_fit(trained):
    expected = expected_specs(trained)
    # The toy strategy does split something, and keeps the parameters whole.
    assert P("data") in expected and P() in expected
    assert specs(trained.state) == expected
    assert set(specs(trained.model)) == {P()}


def test_its_layout_holds_through_a_checkpoint(trained, batches, tmp_path):
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_epochs=None)
    checkpoint.save(trained, wait=True)
    checkpoint.close()
    restored = px.DataParallelTrainer(
        make_model(seed=1), optax.adam(1e-2), strategy=ShardedOptimizerStrategy(8)
    )
    checkpoint.restore(restored, "latest")
    assert specs(restored.state) == expected_specs(restored)
    assert eqx.tree_equal(
        jax.device_get(eqx.filter(restored.state, eqx.is_array)),
        jax.device_get(eqx.filter(trained.state, eqx.is_array)),
    )
    # Onto another strategy and device count: the values, laid out its way.
    replicated = px.DataParallelTrainer(
        make_model(seed=1), optax.adam(1e-2), strategy=px.PmapStrategy(4)
    )
    checkpoint.restore(replicated, "latest")
    assert set(specs(replicated.state)) == {P()}
    assert max_abs_diff(replicated.model, trained.model) == 0
    # And the restored run trains on, keeping its layout.
    restored.fit(batches, epochs=1)
    assert specs(restored.state) == expected_specs(restored)


def test_a_replicated_checkpoint_restores_onto_its_layout(trained, tmp_path):
    # Saved by a replicated strategy (every array packed), restored split.
    replicated = px.DataParallelTrainer(
        make_model(seed=1), optax.adam(1e-2), strategy=px.ShardingStrategy(4)
    )
    replicated.state = trained.state
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_epochs=None)
    checkpoint.save(replicated, wait=True)
    checkpoint.close()
    restored = px.DataParallelTrainer(
        make_model(seed=2), optax.adam(1e-2), strategy=ShardedOptimizerStrategy(8)
    )
    checkpoint.restore(restored, "latest")
    assert specs(restored.state) == expected_specs(restored)
    assert eqx.tree_equal(
        jax.device_get(eqx.filter(restored.state, eqx.is_array)),
        jax.device_get(eqx.filter(trained.state, eqx.is_array)),
    )


def test_its_layout_holds_through_save_model(trained, tmp_path):
    before = specs(trained.state)
    px.save_model(tmp_path / "model.npz", trained.model)
    loaded = px.load_model(tmp_path / "model.npz", like=make_model(seed=1))
    assert max_abs_diff(loaded, trained.model) == 0
    assert specs(trained.state) == before


def test_the_state_setter_lays_a_state_out_as_the_strategy_says(trained):
    other = px.DataParallelTrainer(
        make_model(seed=2), optax.adam(1e-2), strategy=px.ShardingStrategy(2)
    )
    trained_state = trained.state
    trainer = px.DataParallelTrainer(
        make_model(seed=2), optax.adam(1e-2), strategy=ShardedOptimizerStrategy(8)
    )
    trainer.state = other.state  # replicated on 2 devices: placed its way
    assert specs(trainer.state) == expected_specs(trainer)
    assert specs(trained.state) == specs(trained_state)


def test_a_strategy_must_give_one_sharding_per_array():
    class Broken(px.Strategy):
        mesh: Mesh
        axis_name: str = "data"

        def __init__(self):
            self.mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

        num_devices = property(lambda self: 2)
        batch_sharding = property(lambda self: NamedSharding(self.mesh, P("data")))
        batch_multiple = property(lambda self: 2)

        def state_shardings(self, state):
            return NamedSharding(self.mesh, P())  # one, not one per array

        def reduce(self, fn, replicated, carry, examples):
            return fn(replicated, carry, examples)

        def map(self, fn, replicated, examples):
            return fn(replicated, examples)

    with pytest.raises(TypeError, match="Broken.state_shardings returned"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=Broken())
