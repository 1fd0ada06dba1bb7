"""Layouts proven at trace time, and the planted-layout suite (issue 43,
items 3-4): each wrong layout below is caught, before a step runs, with the
leaf named: by the strategy's own checks when it is built, by the layout
lint (`summary().warnings`), or by the proofs run once per compile (a
`LayoutError`); the examples' layouts say nothing."""

import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import phalanx as px
from helpers import host_arrays, make_model
from phalanx._engine.program._lint import layout_warnings
from phalanx._engine.program._proofs import LayoutError
from stacked_transformer import RULES, Transformer


ROOT = pathlib.Path(__file__).resolve().parents[2]
X = np.zeros((16, 5), np.float32)
Y = np.zeros(16, np.int32)
TOKENS = np.zeros((16, 8), np.int32)


def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)


def transformer(vocab: int = 32) -> Transformer:
    return Transformer(vocab=vocab, width=32, layers=2, heads=2, key=jax.random.key(0))


def lint(rules, vocab: int = 32, **mesh) -> tuple[str, ...]:
    strategy = px.MeshStrategy(**mesh, rules=rules, min_size=64)
    trainer = px.DataParallelTrainer(
        transformer(vocab),
        optax.adam(1e-3),
        strategy=strategy,
        loss=loss,
        progress=False,
    )
    return trainer.summary().warnings


class Constrained(eqx.Module):
    """A linear layer whose weight the model constrains to `spec` (a user's
    `with_sharding_constraint` on a parameter)."""

    weight: jax.Array
    mesh: Mesh = eqx.field(static=True)
    spec: P = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = jax.lax.with_sharding_constraint(
            self.weight, NamedSharding(self.mesh, self.spec)
        )
        return x @ weight


class ConstrainedLayer(eqx.Module):
    """One layer of a stack, constraining its weight inside the loop."""

    weight: jax.Array
    mesh: Mesh = eqx.field(static=True)

    def __init__(self, key: jax.Array, mesh: Mesh):
        self.weight = jax.random.normal(key, (64, 64)) * 0.1
        self.mesh = mesh

    def __call__(self, x: jax.Array) -> jax.Array:
        moved = NamedSharding(self.mesh, P(None, "fsdp"))  # stored P("fsdp", None)
        return jnp.tanh(x @ jax.lax.with_sharding_constraint(self.weight, moved))


class TwoAxes(px.strategies.DeviceMeshStrategy):
    """A user's strategy on a 2 x 4 mesh, the batch split over both axes;
    `forget` leaves the sums unreduced over "chips", `transpose` lays each
    gradient out transposed against its parameter."""

    mesh: Mesh
    axis_name: tuple[str, str] = ("hosts", "chips")  # pyright: ignore[reportIncompatibleVariableOverride]
    deterministic: bool = False
    forget: bool = False
    transpose: bool = False

    def __init__(self, *, forget: bool = False, transpose: bool = False):
        self.mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), self.axis_name)
        self.forget = forget
        self.transpose = transpose

    def state_spec(self, role, leaf):
        if role != "other" and leaf.ndim == 2 and leaf.shape[0] % 4 == 0:
            return P("chips")
        return P()

    def gradient_shardings(self, params):
        if not self.transpose:
            return None
        return jax.tree.map(
            lambda s: (
                NamedSharding(self.mesh, P(None, "chips"))
                if s.spec == P("chips")
                else s
            ),
            params,
        )

    def reduce(self, fn, replicated, carry, examples):
        if not self.forget:
            return self.reduce_per_device(fn, replicated, carry, examples)

        def per_device(replicated, carry, examples):
            sums, carry = fn(replicated, carry, examples)
            return jax.lax.psum(sums, "hosts"), carry  # "chips" forgotten

        gathered = jax.tree.map(lambda x: x, replicated)
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P(), P(), P(self.axis_name)),
            out_specs=(P(), P()),
            check_vma=False,
        )(gathered, carry, examples)

    def map(self, fn, replicated, examples):
        return self.map_per_device(fn, replicated, examples)


# --- caught when the strategy is built ------------------------------------------


def test_a_rule_matching_nothing_names_the_nearest_paths():
    typo = [(r"blocks\.layers\.atention\.query_proj\.weight", (None, "tensor", None))]
    with pytest.raises(ValueError, match="matches no parameter") as caught:
        lint(typo, data=1, fsdp=2, tensor=4)
    assert "'blocks.layers.attention.query_proj.weight'" in str(caught.value)


def test_a_rule_on_an_axis_the_mesh_lacks_is_refused():
    with pytest.raises(ValueError, match="'model' is not a mesh axis"):
        lint([(r"blocks\.layers\.up\.weight", (None, "model", None))], fsdp=8)


def test_a_rule_splitting_a_dimension_unevenly_is_refused():
    with pytest.raises(
        ValueError, match="splits 'head.weight' of shape \\[30, 32\\] 4 ways"
    ):
        lint([(r"head\.weight", ("tensor", None))], vocab=30, fsdp=2, tensor=4)


def test_a_rule_missing_the_layer_axis_names_the_leaf():
    with pytest.raises(ValueError, match="blocks.layers.up.weight' of shape"):
        lint([(r"blocks\.layers\.up\.weight", ("tensor", None))], fsdp=2, tensor=4)


# --- caught by the layout lint -----------------------------------------------------


def test_a_rule_splitting_the_layer_axis_is_named():
    warnings = lint(
        [(r"blocks\.layers\.up\.weight", ("fsdp", None, None))], fsdp=2, tensor=4
    )
    named = [
        w for w in warnings if w.startswith("state.model.blocks.layers.up.weight ")
    ]
    assert len(named) == 1 and "split along its layer axis" in named[0]


def test_a_large_leaf_left_whole_by_a_rule_is_named():
    warnings = lint([(r"blocks\.layers\.up\.weight", (None, None, None))], fsdp=8)
    named = [
        w for w in warnings if w.startswith("state.model.blocks.layers.up.weight ")
    ]
    assert len(named) == 1 and "whole on each of the 8 devices" in named[0]


def test_devices_holding_unequal_parts_are_named():
    """A leaf on half of the devices (a user strategy's sub-mesh): those
    hold 2 KiB more than the others."""
    devices = np.array(jax.devices()[:8])
    everywhere = Mesh(devices, ("data",))
    half = Mesh(devices[:4], ("data",))
    structs = [jax.ShapeDtypeStruct((8, 64), jnp.float32)] * 2
    shardings = [NamedSharding(everywhere, P()), NamedSharding(half, P())]
    warnings = layout_warnings(
        ["state.model.a", "state.model.b"], structs, shardings, None
    )
    assert warnings == [
        "the devices hold unequal parts of the state: 2.0 KiB to 4.0 KiB (100% "
        "more on the fullest, most of it state.model.b), and a step needs the "
        "fullest's memory on every device; lay every leaf out over all of the "
        "strategy's devices"
    ]


# --- caught once per compile (LayoutError, nothing run) -------------------------


@pytest.mark.parametrize("spec", [P(None, "fsdp"), P("fsdp", None)])
def test_a_constraint_resharding_a_parameter_is_an_error(spec):
    strategy = px.MeshStrategy(fsdp=8, min_size=16)
    model = Constrained(jnp.ones((64, 32)) * 0.01, strategy.mesh, spec)
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-3), strategy=strategy, progress=False
    )
    before = host_arrays(trainer.state)
    data = [(np.zeros((16, 64), np.float32), Y)]
    if spec == P("fsdp", None):  # as it is stored: nothing to say
        trainer.fit(data)
        return
    with pytest.raises(
        LayoutError, match=r"state\.model\.weight is stored as P\('fsdp',\)"
    ):
        trainer.fit(data)
    after = host_arrays(trainer.state)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_gathering_a_parameter_where_it_is_used_is_not_a_reshard():
    strategy = px.MeshStrategy(fsdp=8, min_size=16)
    model = Constrained(jnp.ones((64, 32)) * 0.01, strategy.mesh, P())
    trainer = px.DataParallelTrainer(
        model, optax.sgd(0.1), strategy=strategy, progress=False
    )
    trainer.fit([(np.zeros((16, 64), np.float32), Y)])


def test_a_constraint_inside_a_stacked_layer_names_the_stack():
    strategy = px.MeshStrategy(fsdp=8, min_size=16)
    model = px.models.Stacked(
        lambda k: ConstrainedLayer(k, strategy.mesh), 2, key=jax.random.key(0)
    )
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-3), strategy=strategy, loss="mse", progress=False
    )
    data = [(np.zeros((16, 64), np.float32), np.zeros((16, 64), np.float32))]
    with pytest.raises(
        LayoutError, match=r"state\.model\.layers\.weight .*one layer of it"
    ):
        trainer.fit(data)


def test_a_gradient_left_unreduced_on_one_axis_is_an_error():
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=TwoAxes(forget=True), progress=False
    )
    with pytest.raises(LayoutError, match=r"gradient: .*whole along \['chips'\]"):
        trainer.fit([(X, Y)])


def test_a_gradient_laid_out_against_its_parameter_is_an_error():
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=TwoAxes(transpose=True), progress=False
    )
    with pytest.raises(
        LayoutError, match=r"state\.model\.layers\[\d\]\.weight: its gradient"
    ):
        trainer.fit([(np.zeros((16, 5), np.float32), Y)])


def test_the_user_strategy_as_meant_trains():
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=TwoAxes(), progress=False
    )
    trainer.fit([(X, Y)])
    assert trainer.summary().warnings == ()


@pytest.mark.parametrize("spec", [P(), P("fsdp")])
def test_a_batch_placed_in_another_layout_is_named(spec):
    strategy = px.MeshStrategy(data=2, fsdp=4)
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=strategy, progress=False
    )
    x = jax.device_put(X, NamedSharding(strategy.mesh, spec))
    with pytest.raises(ValueError, match=r"leaf batch\[0\] is placed .* as P\("):
        trainer.fit([(x, Y)])
    placed = jax.device_put(X, strategy.batch_sharding)
    trainer.fit([(placed, Y), (jnp.asarray(X), Y)])  # as split, or on one device


@pytest.mark.parametrize("where", ["replicated", "one device"])
def test_a_later_batch_placed_in_another_layout_is_named(where):
    # Each batch that would move is read (only those: a batch laid out as
    # the strategy splits batches costs no check), not the first alone; a
    # leaf committed to one device (jax.device_put(x, device)) would move
    # too, unlike an uncommitted one (jnp.asarray) the pipeline places.
    strategy = px.MeshStrategy(data=2, fsdp=4)
    trainer = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), strategy=strategy, progress=False
    )
    target = (
        NamedSharding(strategy.mesh, P()) if where == "replicated" else jax.devices()[1]
    )
    data = [(X, Y), (X, jax.device_put(Y, target))]
    with pytest.raises(
        ValueError, match=r"batch 1 of epoch 0 leaf batch\[1\] is placed"
    ):
        trainer.fit(data)


# --- the examples say nothing ------------------------------------------------------


def test_the_transformer_example_is_laid_out_as_meant():
    spec = importlib.util.spec_from_file_location(
        "transformer_example", ROOT / "examples" / "transformer.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    strategy = px.MeshStrategy(data=2, fsdp=2, tensor=2, rules=example.RULES)
    model = px.sharded_model(
        lambda key: example.Transformer(20, 2, key), strategy, key=jax.random.key(0)
    )
    trainer = px.DataParallelTrainer(
        model,
        optax.adamw(3e-3),
        strategy=strategy,
        loss=example.next_char_loss,
        progress=False,
    )
    assert trainer.summary().warnings == ()
    chars = np.zeros((8, example.CONTEXT), np.int32)
    trainer.fit([(chars, chars)])  # the proofs pass


def test_the_tests_transformer_under_its_rules_is_laid_out_as_meant():
    assert lint(RULES, data=2, fsdp=2, tensor=2) == ()
