"""Strategies written here against the public contract alone.

A fourth strategy against the abstract `px.Strategy`: parameters replicated,
the optimizer state split over the data axis (as ZeRO-1 does). And one on a
2-D mesh of the 8 devices against `px.strategies.DeviceMeshStrategy`,
implementing only its abstract members: the batch split over both axes
(2 × 4), the optimizer state over the second. Each must train to the update
of one device on the full batch, and its layout must hold wherever phalanx
handles state: after `fit`, in `state`, through a checkpoint's save and
restore (and `fit(resume=)`), and `save_model`."""

from typing import Any, ClassVar, final

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, max_abs_diff, reference_fit
from phalanx.strategies._device_mesh import make_mesh
from phalanx.strategies._strategy import AxisName


@final
class ShardedOptimizerStrategy(px.Strategy):
    """Replicated parameters; each optimizer-state array whose leading axis
    divides over the devices is split along it."""

    mesh: Mesh
    axis_name: AxisName  # one name here

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
        axis_name: AxisName = "data"

        def __init__(self):
            self.mesh = Mesh(np.array(jax.devices()[:2]), ("data",))

        @property
        def num_devices(self) -> int:
            return 2

        @property
        def batch_sharding(self) -> NamedSharding:
            return NamedSharding(self.mesh, P("data"))

        @property
        def batch_multiple(self) -> int:
            return 2

        def state_shardings(self, state):
            return NamedSharding(self.mesh, P())  # one, not one per array

        def reduce(self, fn, replicated, carry, examples):
            return fn(replicated, carry, examples)

        def map(self, fn, replicated, examples):
            return fn(replicated, examples)

    with pytest.raises(TypeError, match="Broken.state_shardings returned"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=Broken())


# --- a strategy on a 2-D mesh, from DeviceMeshStrategy's abstract members ---


@final
class TwoAxisStrategy(px.strategies.DeviceMeshStrategy):
    """A 2 × 4 mesh ("rows", "cols") of the 8 devices: the batch split over
    `axis_name` (both axes by default), parameters whole, each optimizer-state
    array whose leading axis 4 divides split along it over "cols"."""

    mesh: Mesh
    axis_name: AxisName  # a tuple of names here
    deterministic: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]

    def __init__(self, axis_name: tuple[str, ...] = ("rows", "cols")):
        devices = np.array(jax.devices()[:8]).reshape(2, 4)
        self.mesh = Mesh(devices, ("rows", "cols"))
        self.axis_name = axis_name

    @override
    def state_spec(self, role, leaf) -> P:
        if role == "optimizer_state" and leaf.shape[0] % 4 == 0:
            return P("cols")
        return P()

    @override
    def reduce(self, fn, replicated, carry, examples):
        return self.reduce_per_device(fn, replicated, carry, examples)

    @override
    def map(self, fn, replicated, examples):
        return self.map_per_device(fn, replicated, examples)


def ragged_batches() -> list[Any]:
    """64 examples in batches of 32, 20 and 12: the last two padded."""
    x, y = make_data(64, seed=4)
    return [(x[:32], y[:32]), (x[32:52], y[32:52]), (x[52:], y[52:])]


@pytest.fixture(scope="module")
def trained_2d(batches):
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=TwoAxisStrategy()
    )
    trainer.fit(batches, epochs=5)
    return trainer


def test_the_base_derives_a_two_axis_layout():
    strategy = TwoAxisStrategy()
    assert strategy.num_devices == 8 and strategy.batch_multiple == 8
    assert strategy.batch_axes == ("rows", "cols")
    assert strategy.batch_sharding.spec == P(("rows", "cols"))
    # A batch split over one axis: padded to that axis's size only.
    rows = TwoAxisStrategy(("rows",))
    assert rows.batch_multiple == 2 and rows.batch_sharding.spec == P("rows")


def test_make_mesh_builds_meshes_of_several_axes():
    mesh = make_mesh(None, {"rows": 2, "cols": -1})
    assert dict(mesh.shape) == {"rows": 2, "cols": 4}
    assert list(mesh.devices[0]) == jax.devices()[:4]  # the last axis fastest
    assert make_mesh(2, "data").axis_names == ("data",)
    with pytest.raises(ValueError, match=r"\{'rows': 3, 'cols': -1\} do not fit 8"):
        make_mesh(None, {"rows": 3, "cols": -1})
    with pytest.raises(ValueError, match=r"multiply to 4, not to the 8 devices"):
        make_mesh(None, {"rows": 2, "cols": 2})


def test_a_two_axis_strategy_matches_one_device(trained_2d, batches):
    reference = reference_fit(make_model(), batches, steps=10)
    assert max_abs_diff(trained_2d.model, reference) <= 1e-5
    assert int(trained_2d.state.step) == 10


def test_two_axis_set_ups_pass_the_equivalence_test():
    def make_trainer(strategy):
        return px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), strategy=strategy, progress=False
        )

    results = px.testing.assert_equivalent(
        make_trainer,
        ragged_batches(),
        strategies=[
            ("batch over rows and cols", TwoAxisStrategy()),
            ("batch over rows only", TwoAxisStrategy(("rows",))),
            ("2 microbatches", px.AccumulatingStrategy(TwoAxisStrategy(), 2)),
        ],
        steps=3,
    )
    assert len(results) == 3


def test_its_collectives_take_axis_name():
    # A loss that sums over the batch axes by hand (a tuple of two names) is
    # the loss of one device on the whole batch.
    class Summed(px.DataParallelTrainer):
        @override
        def loss(self, model, outputs, targets):
            losses = super().loss(model, outputs, targets)
            assert isinstance(losses, jax.Array)  # the built-in loss's
            axes = self.strategy.axis_name
            total = jax.lax.psum(jnp.sum(losses), axes)
            return losses + jax.lax.stop_gradient(total) * 0

    x, y = make_data(32)
    trainer = Summed(make_model(), optax.adam(1e-2), strategy=TwoAxisStrategy())
    trainer.fit([(x, y)], epochs=2)
    assert max_abs_diff(trainer.model, reference_fit(make_model(), [(x, y)], 2)) <= 1e-5


def test_a_two_axis_layout_holds_after_fit(trained_2d):
    expected = expected_specs(trained_2d)
    assert P("cols") in expected and P() in expected
    assert specs(trained_2d.state) == expected
    assert set(specs(trained_2d.model)) == {P()}


def test_a_two_axis_layout_holds_through_checkpoint_and_resume(batches, tmp_path):
    def trainer(seed):
        return px.DataParallelTrainer(
            make_model(seed),
            optax.adam(1e-2),
            strategy=TwoAxisStrategy(),
            callbacks=[px.callbacks.Checkpoint(tmp_path, every_n_epochs=1)],
        )

    first = trainer(0)
    first.fit(batches, epochs=2)
    restored = trainer(1)
    px.callbacks.Checkpoint(tmp_path, every_n_epochs=None).restore(restored, "latest")
    assert specs(restored.state) == expected_specs(restored)
    assert eqx.tree_equal(
        jax.device_get(eqx.filter(restored.state, eqx.is_array)),
        jax.device_get(eqx.filter(first.state, eqx.is_array)),
    )
    resumed = trainer(2)
    resumed.fit(batches, epochs=3, resume="latest")  # the third epoch only
    assert int(resumed.state.step) == 6
    assert specs(resumed.state) == expected_specs(resumed)
    reference = reference_fit(make_model(), batches, steps=6)
    assert max_abs_diff(resumed.model, reference) <= 1e-5


def test_a_two_axis_layout_holds_through_save_model(trained_2d, tmp_path):
    before = specs(trained_2d.state)
    px.save_model(tmp_path / "model.npz", trained_2d.model)
    loaded = px.load_model(tmp_path / "model.npz", like=make_model(seed=1))
    assert max_abs_diff(loaded, trained_2d.model) == 0
    assert specs(trained_2d.state) == before
    # And onto the 2-D layout from a replicated one, by the state setter.
    other = px.DataParallelTrainer(
        make_model(seed=2), optax.adam(1e-2), strategy=px.ShardingStrategy(2)
    )
    other.state = trained_2d.state
    assert set(specs(other.state)) == {P()}
    fresh = px.DataParallelTrainer(
        make_model(seed=2), optax.adam(1e-2), strategy=TwoAxisStrategy()
    )
    fresh.state = other.state
    assert specs(fresh.state) == before


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TwoAxisStrategy(("rows", "depth")), r"axis_name=\('rows', 'depth'\)"),
        (lambda: TwoAxisStrategy(()), "must name one or more distinct axes"),
    ],
)
def test_a_mesh_strategy_must_split_batches_over_its_axes(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_state_spec_that_does_not_divide_is_refused():
    @final
    class Uneven(px.strategies.DeviceMeshStrategy):
        mesh: Mesh
        axis_name: AxisName = "data"
        deterministic: ClassVar[bool] = False  # pyright: ignore[reportIncompatibleVariableOverride]

        def __init__(self):
            self.mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

        @override
        def state_spec(self, role, leaf):
            return P("data")  # the test model's [3, 8] does not split 8 ways

        @override
        def reduce(self, fn, replicated, carry, examples):
            return fn(replicated, carry, examples)

        @override
        def map(self, fn, replicated, examples):
            return fn(replicated, examples)

    with pytest.raises(
        ValueError, match=r"Uneven.state_spec\('parameters', float32\[3, 8\]\)"
    ):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=Uneven())
