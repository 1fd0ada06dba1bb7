"""`phalanx._contracts.AbstractStacked`: what the layers below a model know of
layers stored stacked, held by a user's own stack (not `px.models.Stacked`):
`MeshStrategy` never splits its layer axis, the layout lint and the planner
see it, the step lays each layer out through `each_layer`, and it trains to
one device's update. The sequence split's contract: test_sequence_split.py."""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import phalanx as px
from phalanx._contracts import AbstractStacked
from phalanx._plan._space import has_stack


IN, WIDTH, LAYERS, CLASSES = 4, 8, 8, 3
# What the step asked of `Loop` while it was traced: ("use", shapes of the
# arrays passed through `use`) and ("again", primitive name, answer).
ASKED: list[tuple[Any, ...]] = []


def run_layers(
    layers: eqx.nn.Linear,
    x: jax.Array,
    use: Callable[[Any], Any] | None = None,
    again: Callable[..., bool] | None = None,
) -> jax.Array:
    """`x` through each layer of `layers` (arrays with a leading layer axis)
    in a Python loop, each layer's arrays through `use` first; the backward
    pass computes again what `again` says instead of keeping it."""
    params, static = eqx.partition(layers, eqx.is_array)

    def layer(x: jax.Array, arrays: Any) -> jax.Array:
        if use is not None:
            arrays = use(arrays)
        return x + jnp.tanh(eqx.combine(arrays, static)(x))

    if again is not None:
        policy = again
        layer = jax.checkpoint(layer, policy=lambda *a, **p: not policy(*a, **p))
    for i in range(layers.weight.shape[0]):
        x = layer(x, jax.tree.map(lambda a, i=i: a[i], params))
    return x


def stacked_linears(key: jax.Array) -> eqx.nn.Linear:
    """LAYERS linear layers of WIDTH, stored stacked: weight (8, 8, 8), bias
    (8, 8). The layer axis is the first of equal ones, the one a split by
    size takes unless told it is the layers'."""
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(
        jax.random.split(key, LAYERS)
    )


class Loop(AbstractStacked):
    """A user's own stack: a Python loop over its layers (no `jax.lax.scan`),
    each layer's arrays passed through `use` where the step asks."""

    layers: eqx.nn.Linear
    use: Callable[[Any], Any] | None = eqx.field(static=True, default=None)
    again: Callable[..., bool] | None = eqx.field(static=True, default=None)

    def each_layer(
        self, use: Callable[[Any], Any], again: Callable[..., bool]
    ) -> "Loop":
        def used(arrays: Any) -> Any:
            ASKED.append(("use", tuple(a.shape for a in jax.tree.leaves(arrays))))
            return use(arrays)

        def computed_again(primitive: Any, *avals: Any, **params: Any) -> bool:
            answer = again(primitive, *avals, **params)
            ASKED.append(("again", primitive.name, answer))
            return answer

        return dataclasses.replace(self, use=used, again=computed_again)

    def __call__(self, x: jax.Array) -> jax.Array:
        return run_layers(self.layers, x, self.use, self.again)


class Plain(eqx.Module):
    """The same arrays and computation as `Loop`, not declared stacked."""

    layers: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return run_layers(self.layers, x)


class Net(eqx.Module):
    inp: eqx.nn.Linear
    stack: Loop | Plain
    out: eqx.nn.Linear

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.stack(jax.nn.relu(self.inp(x))))


def net(stacked: bool = True) -> Net:
    one, two, three = jax.random.split(jax.random.key(0), 3)
    layers = stacked_linears(two)
    return Net(
        eqx.nn.Linear(IN, WIDTH, key=one),  # 32 and 8 elements: whole
        Loop(layers) if stacked else Plain(layers),
        eqx.nn.Linear(WIDTH, CLASSES, key=three),  # 24 and 3: whole
    )


def trainer(strategy: px.Strategy, stacked: bool = True) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        net(stacked), optax.adam(1e-2, eps=1e-4), strategy=strategy, progress=False
    )


def batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, 64).astype(np.int32)
    return [(x[:32], y[:32]), (x[32:], y[32:])]


def fsdp(**options: Any) -> px.MeshStrategy:
    return px.MeshStrategy(data=1, fsdp=8, min_size=64, **options)


def spec(leaf: jax.Array) -> P:
    return leaf.sharding.spec  # pyright: ignore[reportAttributeAccessIssue]


# --- what a subclass must declare ---------------------------------------------------


def test_a_stack_must_say_how_each_layer_is_laid_out():
    class NoEachLayer(AbstractStacked):
        layers: eqx.nn.Linear

    with pytest.raises(TypeError, match="each_layer"):
        NoEachLayer(stacked_linears(jax.random.key(0)))  # pyright: ignore[reportAbstractUsage]
    assert isinstance(Loop(stacked_linears(jax.random.key(0))), AbstractStacked)


# --- the layout ---------------------------------------------------------------------


def test_fsdp_never_splits_a_users_stack_along_its_layers():
    stacked = trainer(fsdp()).state
    # Split by size along the longest dimension fsdp divides, never the
    # first (the layers'): each layer is gathered whole on its turn.
    layers = stacked.model.stack.layers
    assert (spec(layers.weight), spec(layers.bias)) == (
        P(None, "fsdp"),
        P(None, "fsdp"),
    )
    # Below min_size: whole.
    assert {
        spec(leaf) for leaf in (stacked.model.inp.weight, stacked.model.out.weight)
    } == {P()}
    # adam's moments lie as their parameters.
    adam: Any = stacked.opt_state
    mu = adam[0].mu.stack.layers
    assert (spec(mu.weight), spec(mu.bias)) == (P(None, "fsdp"), P(None, "fsdp"))
    # The same arrays, not declared stacked: their first dimension is split.
    plain = trainer(fsdp(), stacked=False).state.model.stack.layers
    assert (spec(plain.weight), spec(plain.bias)) == (P("fsdp"), P("fsdp"))


def test_the_layout_lint_names_a_rule_splitting_a_users_layer_axis():
    rules = [(r"stack\.layers\.weight", ("fsdp", None, None))]

    def named(stacked: bool) -> list[str]:
        warnings = trainer(fsdp(rules=rules), stacked).summary().warnings
        return [
            w
            for w in warnings
            if w.startswith("state.model.") and "split along its layer axis" in w
        ]

    (line,) = named(stacked=True)
    assert line.startswith("state.model.stack.layers.weight ")
    assert named(stacked=False) == []


def test_the_planner_sees_a_users_stack():
    # It weighs remat settings only for a model with a stack.
    assert has_stack(net(stacked=True))
    assert not has_stack(net(stacked=False))


# --- the step -----------------------------------------------------------------------


def test_a_users_stack_trains_as_one_device_and_lays_out_each_layer():
    ASKED.clear()
    results = px.testing.assert_equivalent(
        trainer,
        batches(),
        strategies=[
            ("fsdp", fsdp()),
            # tensor > 1: the step computes with each parameter gathered
            # over the batch axes, a stacked one layer at a time.
            ("tensor", px.MeshStrategy(data=2, fsdp=2, tensor=2, min_size=64)),
        ],
        steps=2,
    )
    assert set(results) == {"fsdp", "tensor"}
    # `use` ran inside the loop, on one layer's arrays (no layer axis)...
    used = {asked[1] for asked in ASKED if asked[0] == "use"}
    assert used == {((WIDTH, WIDTH), (WIDTH,))}
    # ... and the backward pass computes its layouts again (a gathered layer,
    # kept, would keep the whole stack gathered) and nothing else.
    answers = {asked[1:] for asked in ASKED if asked[0] == "again"}
    assert ("sharding_constraint", True) in answers
    assert {name for name, answer in answers if answer} == {"sharding_constraint"}
    assert any(not answer for _, answer in answers)
