"""`px.models.TransformerBlock`: stacked, with its sequence split over the
context axis, it computes what it computes on one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import phalanx as px
from phalanx._contracts import SequenceSplit, splitting_sequences
from phalanx.strategies._device_mesh import make_mesh


BATCH = ("data", "fsdp")


def tensor_spec(path, leaf):
    """The heads over "tensor": the projection to q, k, v split on its
    outputs (whole heads), the projection back on its inputs (after the layer axis)."""
    name = jax.tree_util.keystr(path)
    if name.endswith("qkv_proj.weight"):
        return P(None, "tensor", None)
    if name.endswith("qkv_proj.bias"):
        return P(None, "tensor")
    if name.endswith("output_proj.weight"):
        return P(None, None, "tensor")
    return P()


@pytest.mark.parametrize(
    ("implementation", "axes"),
    [
        ("ring", {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}),
        ("all_gather", {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}),
        ("ring", {"data": 1, "fsdp": 2, "context": 2, "tensor": 2}),
    ],
    ids=["ring", "all_gather", "ring-heads-over-tensor"],
)
def test_stacked_blocks_on_a_split_sequence_equal_one_device(implementation, axes):
    model = px.models.Stacked(
        lambda key: px.models.TransformerBlock(
            16, heads=2, mlp_width=32, implementation=implementation, key=key
        ),
        2,
        key=jax.random.key(0),
        remat=True,
    )
    params, static = eqx.partition(model, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (2, 16, 16))
    mesh = make_mesh(None, axes)

    def loss(params, x, split):
        model = eqx.combine(params, static)
        with splitting_sequences(split):
            y = jax.vmap(model, axis_name="batch", spmd_axis_name=split and BATCH)(x)
        return jnp.mean(y**2)

    want = jax.jit(jax.value_and_grad(loss), static_argnums=2)(params, x, None)
    split = SequenceSplit(mesh, "context", BATCH)
    x = jax.device_put(x, NamedSharding(mesh, P(BATCH, "context")))
    placed = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.device_put(
            leaf, NamedSharding(mesh, tensor_spec(path, leaf))
        ),
        params,
    )
    have = jax.jit(jax.value_and_grad(loss), static_argnums=2)(placed, x, split)
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_block_is_causal():
    block = px.models.TransformerBlock(8, heads=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (6, 8))
    changed = x.at[4:].set(0.0)
    np.testing.assert_allclose(block(x)[:4], block(changed)[:4], rtol=1e-6)
    assert not np.allclose(block(x)[4:], block(changed)[4:])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="heads=3 does not divide width=8"):
        px.models.TransformerBlock(8, heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="implementation='flash' is not one of"):
        px.models.TransformerBlock(8, 2, implementation="flash", key=jax.random.key(0))  # pyright: ignore[reportArgumentType]
    block = px.models.TransformerBlock(8, heads=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"one sequence of shape \(seq, 8\)"):
        block(jnp.ones((4, 6)))
