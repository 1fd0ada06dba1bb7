"""Attention one block of keys at a time, exact: the online softmax.

A query's softmax over all keys is built from blocks of keys as they come:
a running maximum of the scores (for a stable exponent), a running sum of
the exponentials and a running sum of the values they weigh, rescaled when
the maximum grows (Milakov & Gimelshein 2018; FlashAttention). The ring
(`_ring.py`) feeds it the blocks its schedule names, computed here in `jnp`
(`attend_block`) or by a kernel that returns each block's output and
log-sum-exp (`fold`); `blockwise_attention` is a whole sequence one block of
queries by one block of keys at a time, the memory of attention on a CPU.
Scores and sums are kept in float32 whatever the inputs' dtype.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


def fold(
    stats: Stats,
    out: Float[Array, "heads seq dim"],
    lse: Float[Array, "heads seq"],
) -> Stats:
    """`stats` after the queries see one more block of keys, given that
    block's attention output and each query's log-sum-exp of its scores (a
    kernel's, `_splash.attend`): the block's weights sum to ``exp(lse)``."""
    # As in `attend_block`, the peak cancels: no gradient through it. The
    # gradient reaches `lse` through the block's weight.
    peak = jax.lax.stop_gradient(jnp.maximum(stats.peak, lse))
    rescale, weight = jnp.exp(stats.peak - peak), jnp.exp(lse - peak)
    block = jnp.swapaxes(out, 0, 1).astype(jnp.float32) * weight.T[..., None]
    return Stats(
        stats.out * rescale.T[..., None] + block, peak, stats.total * rescale + weight
    )


def blockwise_attention(
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    *,
    causal: bool,
    block: int,
) -> Float[Array, "seq heads dim"]:
    """Attention of a whole sequence, `block` queries by `block` keys at a
    time (both lengths divisible by it): each block's scores recomputed in
    the backward pass, the causal blocks above the diagonal skipped.

    Holds one ``heads × block × block`` score matrix instead of XLA's
    ``heads × seq × kv_seq``.
    """
    seq, heads, dim = query.shape
    kv_seq = key.shape[0]
    scale = jnp.asarray(1 / np.sqrt(dim), query.dtype)
    queries = (query * scale).reshape(seq // block, block, heads, dim)
    keys = key.reshape(kv_seq // block, block, heads, dim)
    values = value.reshape(kv_seq // block, block, heads, dim)
    masks = None if mask is None else mask.reshape(kv_seq // block, block)
    positions = jnp.arange(block)
    attend = jax.checkpoint(attend_block)

    def rows(inputs: tuple[Array, Array]) -> Array:
        qi, q = inputs

        def see(stats: Stats, j: Array) -> tuple[Stats, None]:
            visible = None if masks is None else masks[j][None]
            if causal:
                rows, columns = qi * block + positions, j * block + positions
                below = rows[:, None] >= columns[None]
                visible = below if visible is None else below & visible

            def compute(stats: Stats) -> Stats:
                return attend(stats, q, keys[j], values[j], visible)

            if not causal:
                return compute(stats), None
            # Blocks whose every key comes after every query: skipped.
            return jax.lax.cond(j <= qi, compute, lambda s: s, stats), None

        stats, _ = jax.lax.scan(
            see, empty_stats(block, heads, dim), jnp.arange(kv_seq // block)
        )
        return finish(stats, query.dtype)

    out = jax.lax.map(rows, (jnp.arange(seq // block), queries))
    return out.reshape(seq, heads, dim)
