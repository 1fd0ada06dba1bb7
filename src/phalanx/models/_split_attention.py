"""Attention over a sequence split over the context axis: the `jax.shard_map`
that gives each device its chunk, and the all-gather variant.

The model runs in the global view: one example's arrays, the sequence laid
out over ``"context"``. Attention is the one place that needs every
position, so it goes manual over the context axis (and over the axes the
examples are split over, so that the vmap over examples keeps them split:
`SequenceSplit.batch_axes`) and exchanges chunks itself: all of them at once
(`all_gather_attention`), or one at a time round a ring (`_ring.py`). Other
mesh axes larger than one device (``"tensor"``) split the heads inside it
where they divide them, so that each device attends with its own heads in
its own program, where a Pallas kernel can run (XLA's partitioner does not
split one); where they do not divide, they stay automatic and the blocks
are XLA's.
"""

import functools
from collections.abc import Callable
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .._contracts import SequenceSplit
from . import _splash
from ._attention_inputs import AttentionInputs
from ._blockwise import empty_stats, finish, fold
from ._ring import ring_attention
from ._tpu_attention import kernel_for, splash_attention


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
    `implementation` (``"all_gather"``, ``"ring"``, or ``"xla"``: the
    all-gather, never a kernel)."""
    local: Callable[[AttentionInputs], Array] = functools.partial(
        ring_attention, axis=split.axis, n=split.size, causal=causal
    )
    if implementation != "ring":
        local = functools.partial(
            all_gather_attention,
            axis=split.axis,
            n=split.size,
            causal=causal,
            kernel=implementation != "xla",
        )
    # Inside a per-device program (manual over the data axes), the inner
    # shard_map must name the mesh it runs in, the abstract one with those
    # axes manual; JAX refuses the concrete mesh there ("context mesh should
    # match").
    abstract = jax.sharding.get_abstract_mesh()
    mesh = abstract if not abstract.empty and abstract.manual_axes else split.mesh
    heads = _head_axes(split, query.shape[1], manual=abstract.manual_axes)
    chunks = P(split.axis, heads or None)
    inputs = AttentionInputs(query, key, value, mask)
    return jax.shard_map(
        local,
        mesh=mesh,
        # Each array split along its sequence axis, the heads over `heads`.
        in_specs=(
            jax.tree.map(lambda x: chunks if x.ndim == 3 else P(split.axis), inputs),
        ),
        out_specs=chunks,
        axis_names={split.axis, *split.batch_axes, *heads},
        # The ring's and the gather's collectives are written for the chunks
        # as they are; no replication to check.
        check_vma=False,
    )(inputs)


def _head_axes(
    split: SequenceSplit, heads: int, *, manual: "tuple[str, ...] | frozenset[str]"
) -> tuple[str, ...]:
    """The other mesh axes larger than one device (``"tensor"``), for the
    heads to be split over inside attention where they divide them: each
    head's attention is its own, and a per-device program is what a Pallas
    kernel needs (XLA does not split one). Empty where they do not divide."""
    taken = {split.axis, *split.batch_axes, *manual}
    others = tuple(
        name
        for name, size in split.mesh.shape.items()
        if name not in taken and size > 1
    )
    size = int(np.prod([split.mesh.shape[name] for name in others]))
    return others if heads % size == 0 else ()


def all_gather_attention(
    inputs: AttentionInputs, *, axis: str, n: int, causal: bool, kernel: bool = True
) -> Float[Array, "seq heads dim"]:
    """This device's chunk of queries over every device's keys and values,
    gathered: simple and one collective each way, but each device holds the
    whole sequence's keys. By the splash kernel where `kernel` and it takes
    the chunks, else XLA's chunk × sequence score matrix."""
    query = inputs.query
    keys, values = _gather(inputs.key, axis), _gather(inputs.value, axis)
    mask = None
    if inputs.mask is not None:
        mask = jax.lax.all_gather(inputs.mask, axis, tiled=True)
    seq, _, dim = query.shape
    interpret = None
    if kernel:
        # Causal, each device's chunk of keys is a block; else all are one.
        kv_seq = inputs.key.shape[0] if causal else keys.shape[0]
        what = "all-gather attention"
        interpret = kernel_for(seq, kv_seq, dim, query.dtype, causal=causal, what=what)
    if interpret is not None:
        return _by_kernel(query, keys, values, mask, axis, n, causal, interpret)
    visible = None if mask is None else mask[None]
    if causal:
        seq, everywhere = query.shape[0], keys.shape[0]
        first = jax.lax.axis_index(axis) * seq
        rows = first + jnp.arange(seq)
        causal_mask = rows[:, None] >= jnp.arange(everywhere)[None]
        visible = causal_mask if visible is None else causal_mask & visible
    return jax.nn.dot_product_attention(
        query, keys, values, mask=None if visible is None else visible[None]
    )


def _by_kernel(
    query: Float[Array, "seq heads dim"],
    keys: Float[Array, "kv_seq heads dim"],
    values: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    axis: str,
    n: int,
    causal: bool,
    interpret: bool,
) -> Float[Array, "seq heads dim"]:
    """`all_gather_attention` by the splash kernel: the device's queries
    against each device's chunk of keys, folded into an online softmax
    (non-causal: one call over every key). Causal, the chunks before the
    device's own are full blocks, its own the diagonal, the later ones
    skipped: which is which is known only at run time (`jax.lax.switch`)."""
    if not causal:
        return splash_attention(
            query, keys, values, mask, causal=False, interpret=interpret
        )
    seq, _, dim = query.shape
    scale = jnp.asarray(1 / np.sqrt(dim), query.dtype)
    q = jnp.swapaxes(query * scale, 0, 1)
    device = jax.lax.axis_index(axis)
    stats = empty_stats(seq, query.shape[1], dim)
    for j in range(n):
        chunk = slice(j * seq, (j + 1) * seq)
        k, v = jnp.swapaxes(keys[chunk], 0, 1), jnp.swapaxes(values[chunk], 0, 1)
        m = None if mask is None else mask[chunk]

        def see(stats, diagonal: bool, k=k, v=v, m=m):
            return fold(stats, *_splash.attend(q, k, v, m, diagonal, interpret))

        kind = (j <= device).astype(jnp.int32) + (j < device).astype(jnp.int32)
        stats = jax.lax.switch(
            kind,
            [
                lambda s: s,
                functools.partial(see, diagonal=True),
                functools.partial(see, diagonal=False),
            ],
            stats,
        )
    return finish(stats, query.dtype)


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
