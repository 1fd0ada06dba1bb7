"""Attention one block of keys at a time, exact: the online softmax.

A query's softmax over all keys is built from blocks of keys as they come:
a running maximum of the scores (for a stable exponent), a running sum of
the exponentials and a running sum of the values they weigh, rescaled when
the maximum grows (Milakov & Gimelshein 2018; FlashAttention). The ring
(`_ring.py`) feeds it the blocks its schedule names. Scores and sums are kept
in float32 whatever the inputs' dtype.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


# The score of a masked key, as `jax.nn.dot_product_attention` uses: finite,
# so that a block with every key masked keeps the running maximum finite and
# adds nothing once a visible key arrives (exp(masked - real) == 0).
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


class Stats(NamedTuple):
    """The running softmax of some queries over the keys seen so far."""

    out: Float[Array, "seq heads dim"]  # the weighted values, not yet divided
    peak: Float[Array, "heads seq"]  # the largest score
    total: Float[Array, "heads seq"]  # the sum of exp(score - peak)


def empty_stats(seq: int, heads: int, dim: int) -> Stats:
    """No key seen yet."""
    return Stats(
        out=jnp.zeros((seq, heads, dim), jnp.float32),
        peak=jnp.full((heads, seq), MASKED, jnp.float32),
        total=jnp.zeros((heads, seq), jnp.float32),
    )


def attend_block(
    stats: Stats,
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    visible: Bool[Array, "seq kv_seq"] | Bool[Array, "1 kv_seq"] | None,
) -> Stats:
    """`stats` after the queries see one more block of keys (those `visible`).

    `query` is already scaled (by 1/sqrt(dim)).
    """
    scores = jnp.einsum("qhd,khd->hqk", query, key, preferred_element_type=jnp.float32)
    if visible is not None:
        scores = jnp.where(visible[None], scores, MASKED)
    # The result does not depend on the peak (it cancels): no gradient
    # flows through it, which saves the max's backward pass.
    peak = jax.lax.stop_gradient(jnp.maximum(stats.peak, jnp.max(scores, axis=-1)))
    weights = jnp.exp(scores - peak[..., None])
    rescale = jnp.exp(stats.peak - peak)
    total = stats.total * rescale + jnp.sum(weights, axis=-1)
    values = jnp.einsum(
        "hqk,khd->qhd",
        weights.astype(value.dtype),
        value,
        preferred_element_type=jnp.float32,
    )
    out = stats.out * rescale.T[..., None] + values
    return Stats(out, peak, total)


def finish(stats: Stats, dtype: jnp.dtype) -> Float[Array, "seq heads dim"]:
    """The attention output: the weighted values over the sum of weights."""
    return (stats.out / stats.total.T[..., None]).astype(dtype)
