"""Layout lint (issue 43, item 3): a large leaf left whole under a split
layout and an uneven split are each said in one line naming the leaf, in
`summary()`; layouts as meant say nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import phalanx as px
from helpers import make_model
from phalanx._engine.program._lint import layout_warnings


class Odd(eqx.Module):
    """A layer the 8-way split divides (16 x 8) and one it does not (13 x 7)."""

    even: eqx.nn.Linear
    odd: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.even = eqx.nn.Linear(16, 8, key=k1)
        self.odd = eqx.nn.Linear(7, 13, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.odd(self.even(x)[:7])


def test_a_leaf_left_whole_under_a_split_layout_is_named():
    strategy = px.FullyShardedStrategy(8, min_size=64)
    trainer = px.DataParallelTrainer(
        Odd(jax.random.key(0)), optax.sgd(0.1), strategy=strategy, progress=False
    )
    warnings = trainer.summary().warnings
    # odd.weight (91 elements) is whole on every device; odd.bias (13) is
    # under min_size, even.weight is split: neither is said.
    named = [w for w in warnings if w.startswith("state.model.odd.weight ")]
    assert len(named) == 1 and "whole on each of the 8 devices" in named[0]
    assert not [w for w in warnings if "bias" in w or "even" in w]
    assert "layout: state.model.odd.weight" in str(trainer.summary())


def test_layouts_as_meant_say_nothing():
    for strategy in (px.ShardingStrategy(8), px.FullyShardedStrategy(8)):
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-3), strategy=strategy, progress=False
        )
        assert trainer.summary().warnings == ()


def test_an_uneven_split_is_named_with_its_padding():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    structs = [
        jax.ShapeDtypeStruct((10,), jnp.float32),
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
    ]
    shardings = [NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("fsdp"))]
    (line,) = layout_warnings(["state.a", "state.b"], structs, shardings, None)
    # 10 rows in 4 shards of 3: 2 rows of padding, on each of the 2 data
    # replicas: 16 bytes.
    assert line.startswith("state.a float32[10] is split unevenly")
    assert "16 B of padding" in line
