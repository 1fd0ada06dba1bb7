"""Attention over a sequence split over the context axis: the `jax.shard_map`
that gives each device its chunk, and the all-gather variant.

The model runs in the global view: one example's arrays, the sequence laid
out over ``"context"``. Attention is the one place that needs every
position, so it goes manual over the context axis (and over the axes the
examples are split over, so that the vmap over examples keeps them split:
`SequenceSplit.batch_axes`) and exchanges chunks itself: all of them at once
(`all_gather_attention`), or one at a time round a ring (`_ring.py`). Other
mesh axes (``"tensor"``, splitting heads) stay automatic.
"""

import functools
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .._contracts import SequenceSplit
from ._attention_inputs import AttentionInputs
from ._ring import ring_attention


def split_attention(
    split: SequenceSplit,
    implementation: str,
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    *,
    causal: bool,
) -> Float[Array, "seq heads dim"]:
    """Attention of one example whose sequence `split` splits, by
    `implementation` (``"all_gather"`` or ``"ring"``)."""
    local: Callable[[AttentionInputs], Array] = functools.partial(
        ring_attention if implementation == "ring" else all_gather_attention,
        axis=split.axis,
        n=split.size,
        causal=causal,
    )
    # Inside a per-device program (manual over the data axes), the inner
    # shard_map must name the mesh it runs in, the abstract one with those
    # axes manual; JAX refuses the concrete mesh there ("context mesh should
    # match").
    abstract = jax.sharding.get_abstract_mesh()
    mesh = abstract if not abstract.empty and abstract.manual_axes else split.mesh
    chunked = P(split.axis)
    return jax.shard_map(
        local,
        mesh=mesh,
        # One spec for the whole bundle: each of its arrays (the mask too,
        # where there is one) split along its sequence axis.
        in_specs=chunked,
        out_specs=chunked,
        axis_names={split.axis, *split.batch_axes},
        # The ring's and the gather's collectives are written for the chunks
        # as they are; no replication to check.
        check_vma=False,
    )(AttentionInputs(query, key, value, mask))


def all_gather_attention(
    inputs: AttentionInputs, *, axis: str, n: int, causal: bool
) -> Float[Array, "seq heads dim"]:
    """This device's chunk of queries over every device's keys and values,
    gathered: simple and one collective each way, but each device holds the
    whole sequence's keys and a chunk × sequence score matrix."""
    del n
    query = inputs.query
    keys, values = _gather(inputs.key, axis), _gather(inputs.value, axis)
    visible = None
    if inputs.mask is not None:
        visible = jax.lax.all_gather(inputs.mask, axis, tiled=True)[None]
    if causal:
        seq, everywhere = query.shape[0], keys.shape[0]
        first = jax.lax.axis_index(axis) * seq
        rows = first + jnp.arange(seq)
        causal_mask = rows[:, None] >= jnp.arange(everywhere)[None]
        visible = causal_mask if visible is None else causal_mask & visible
    return jax.nn.dot_product_attention(
        query, keys, values, mask=None if visible is None else visible[None]
    )


def _gather(x: Array, axis: str) -> Array:
    """Every device's chunk of `x`, in order along the first axis.

    Its own backward pass: JAX 0.10's transpose of `all_gather` (a
    reduce-scatter) fails to lower inside a shard_map manual over only some
    axes under `jax.vmap` (an AssertionError); the sum over devices and the
    device's own slice of it is the same gradient.
    """
    return cast(Array, _gather_differentiable(x, axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_differentiable(x: Array, axis: str) -> Array:
    return jax.lax.all_gather(x, axis, axis=0, tiled=True)


def _gather_forward(x: Array, axis: str) -> tuple[Array, int]:
    return jax.lax.all_gather(x, axis, axis=0, tiled=True), x.shape[0]


def _gather_backward(axis: str, size: int, grad: Array) -> tuple[Array]:
    total = jax.lax.psum(grad, axis)
    start = jax.lax.axis_index(axis) * size
    return (jax.lax.dynamic_slice_in_dim(total, start, size, 0),)


_gather_differentiable.defvjp(_gather_forward, _gather_backward)
