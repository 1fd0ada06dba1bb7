"""Ring attention on one device's chunk of a sequence split over an axis.

Runs inside `jax.shard_map` (manual over the context axis): each device holds
a contiguous chunk of the queries, keys and values. The keys and values (and
their padding mask) travel round the ring with `jax.lax.ppermute`, one
neighbour's chunk per step, while the device folds each into an online
softmax (`_blockwise.py`) of its own queries: no device ever holds more than
two chunks of keys, and no score matrix larger than a chunk's square.

Causal attention first moves each device's halves to the balanced layout
(device ``d`` holds the halves ``d`` and ``2n - 1 - d``), so that every
device computes two full blocks a step instead of device ``n - 1`` computing
``n`` times device 0's; the output moves back. The blocks each step computes
are `_ring_schedule.ring_schedule`'s. On a TPU each block is one call of
JAX's Pallas splash kernel (`_splash.attend`, parts a multiple of 128 long),
which returns the block's log-sum-exp for the online softmax; elsewhere each
block's scores are computed in `jnp` and recomputed in the backward pass
(`jax.checkpoint`): the step keeps the chunks it received, not their scores.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from . import _splash
from ._attention_inputs import AttentionInputs
from ._blockwise import Stats, attend_block, empty_stats, finish, fold
from ._ring_schedule import ring_schedule, slot_tables
from ._tpu_attention import kernel_for


# Key/value parts travelling the ring: keys, values, and the padding mask or
# None, each with a leading axis of parts.
_Chunk = tuple[Array, Array, Array | None]


def ring_attention(
    inputs: AttentionInputs, *, axis: str, n: int, causal: bool
) -> Float[Array, "seq heads dim"]:
    """Exact attention of this device's chunk of queries over every device's
    keys, the sequence split in order over the `n` devices of `axis`.

    Causal attention needs ``seq == kv_seq`` divisible by ``2 n``; the caller
    checks.
    """
    device = jax.lax.axis_index(axis)
    parts = 2 if causal else 1
    query = inputs.query
    query = query * jnp.asarray(1 / np.sqrt(query.shape[-1]), query.dtype)
    chunks = (query, inputs.key, inputs.value, inputs.mask)
    if causal:
        chunks = tuple(None if x is None else _to_balanced(x, axis, n) for x in chunks)
    else:
        chunks = tuple(None if x is None else x[None] for x in chunks)
    q, k, v, m = chunks
    assert q is not None and k is not None and v is not None
    _, seq, heads, dim = q.shape
    stats = jax.tree.map(
        lambda *s: jnp.stack(s), *[empty_stats(seq, heads, dim)] * parts
    )
    kv_seq = k.shape[1]
    interpret = kernel_for(
        seq,
        kv_seq,
        dim,
        q.dtype,
        causal=causal,
        what="ring attention",
        instead="its blocks in jnp",
    )

    schedule = ring_schedule(n, causal=causal, layout="balanced")
    first = functools.partial(
        _step, *slot_tables(schedule, range(1)), interpret=interpret, step=0
    )
    later = functools.partial(
        _step, *slot_tables(schedule, range(1, n)), interpret=interpret
    )
    ring = [(i, (i + 1) % n) for i in range(n)]

    def send(chunk: _Chunk) -> _Chunk:
        return jax.tree.map(lambda x: jax.lax.ppermute(x, axis, ring), chunk)

    # Each step sends the chunk it holds on while computing with it; the last
    # step sends nothing.
    chunk: _Chunk = (k, v, m)
    arriving = send(chunk)
    stats = first(stats, q, chunk, device)

    def body(
        carry: tuple[_Chunk, Stats], step: Array
    ) -> tuple[tuple[_Chunk, Stats], None]:
        chunk, stats = carry
        arriving = send(chunk)
        return (arriving, later(stats, q, chunk, device, step=step - 1)), None

    (chunk, stats), _ = jax.lax.scan(body, (arriving, stats), jnp.arange(1, n - 1))
    stats = later(stats, q, chunk, device, step=n - 2)
    out = jax.vmap(lambda part: finish(part, query.dtype))(stats)
    if causal:
        return _to_contiguous(out, axis, n)
    return out[0]


def _step(
    kinds: tuple[bool, ...],
    query_parts: list[list[list[int]]],
    key_parts: list[list[list[int]]],
    stats: Stats,
    query: Float[Array, "parts seq heads dim"],
    chunk: _Chunk,
    device: Array,
    *,
    interpret: bool | None,
    step: int | Array,
) -> Stats:
    """`stats` after the blocks of one step: slot ``j`` of `device` at
    `step` is its query part ``query_parts[step][device][j]`` against the
    chunk's key part ``key_parts[step][device][j]``; by the splash kernel
    unless `interpret` is None (`kernel_for`)."""
    keys, values, mask = chunk
    qs = jnp.asarray(query_parts, jnp.int32)[step, device]
    ks = jnp.asarray(key_parts, jnp.int32)[step, device]
    for slot, causal in enumerate(kinds):
        qi, ki = qs[slot], ks[slot]
        old = jax.tree.map(lambda s, qi=qi: s[qi], stats)
        key_mask = None if mask is None else mask[ki]
        block = (query[qi], keys[ki], values[ki], key_mask)
        new = _attend(old, *block, causal=causal, interpret=interpret)
        stats = jax.tree.map(lambda s, x, qi=qi: s.at[qi].set(x), stats, new)
    return stats


def _attend(
    stats: Stats,
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    *,
    causal: bool,
    interpret: bool | None,
) -> Stats:
    """`stats` after one block: by the splash kernel unless `interpret` is
    None, else in `jnp`."""
    if interpret is not None:
        # The kernel's layout is (heads, seq, dim).
        q, k, v = (jnp.swapaxes(x, 0, 1) for x in (query, key, value))
        return fold(stats, *_splash.attend(q, k, v, mask, causal, interpret))
    seq = query.shape[0]
    visible = None if mask is None else mask[None]
    if causal:
        diagonal = jnp.tril(jnp.ones((seq, seq), bool))
        visible = diagonal if visible is None else diagonal & visible
    # Each block's scores are recomputed in the backward pass, one block at a
    # time: the step keeps its inputs (the chunks, the running softmax), never
    # a score matrix. Measured at seq 8192 over context=4: 69 MiB of
    # temporaries a device, 85 MiB checkpointing each step whole, 101 MiB
    # keeping the scores (docs/guides).
    return jax.checkpoint(attend_block)(stats, query, key, value, visible)


def _balancing_moves(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first and second half go in the balanced layout:
    the half ``a`` of the ``2n`` goes to device ``a`` if ``a < n``, else to
    ``2n - 1 - a``. Device ``i`` holds ``2i`` and ``2i + 1``: its first
    halves, and its second halves, each move as one permutation."""

    def home(a: int) -> int:
        return a if a < n else 2 * n - 1 - a

    return [(i, home(2 * i)) for i in range(n)], [
        (i, home(2 * i + 1)) for i in range(n)
    ]


def _to_balanced(x: Array, axis: str, n: int) -> Array:
    """This device's contiguous chunk -> its two balanced halves, stacked
    (front: half ``d``, back: half ``2n - 1 - d``)."""
    evens, odds = _balancing_moves(n)
    half = x.shape[0] // 2
    even = jax.lax.ppermute(x[:half], axis, evens)
    odd = jax.lax.ppermute(x[half:], axis, odds)
    # Device d's front half d came from the even halves when d is even.
    d_is_even = jax.lax.axis_index(axis) % 2 == 0
    front = jnp.where(d_is_even, even, odd)
    back = jnp.where(d_is_even, odd, even)
    return jnp.stack([front, back])


def _to_contiguous(x: Array, axis: str, n: int) -> Array:
    """`_to_balanced` undone: the two halves stacked -> the contiguous chunk."""
    evens, odds = _balancing_moves(n)
    d_is_even = jax.lax.axis_index(axis) % 2 == 0
    # Of halves d and 2n - 1 - d, exactly one is even-numbered.
    even = jnp.where(d_is_even, x[0], x[1])
    odd = jnp.where(d_is_even, x[1], x[0])
    first = jax.lax.ppermute(even, axis, [(b, a) for a, b in evens])
    second = jax.lax.ppermute(odd, axis, [(b, a) for a, b in odds])
    return jnp.concatenate([first, second])
