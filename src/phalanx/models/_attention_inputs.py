"""`AttentionInputs`: one example's arguments to attention, bundled as one
pytree for the implementations that split its sequence over devices.

`split_attention` hands the bundle to `jax.shard_map` whole, which gives each
device its chunk of every part; the implementations (`all_gather_attention`,
`ring_attention`) take it as their one array argument. Building it checks
the parts' shapes against each other (at trace time, under jaxtyping's
import hook); it holds arrays and computes nothing.
"""

from typing import final

import equinox as eqx
from jaxtyping import Array, Bool, Float


@final
class AttentionInputs(eqx.Module):
    """The queries, keys, values and padding mask of one example's attention
    (no batch axis): the whole sequence, or, inside `split_attention`'s
    `jax.shard_map`, one device's chunk of it."""

    query: Float[Array, "seq heads dim"]
    key: Float[Array, "kv_seq heads dim"]
    value: Float[Array, "kv_seq heads dim"]
    mask: Bool[Array, " kv_seq"] | None  # True for real keys; None: all real
