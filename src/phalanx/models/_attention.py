"""`px.models.dot_product_attention`: attention of one example that stays
exact when a strategy splits the sequence over devices.

Where the sequence is whole on its devices it is JAX's Pallas splash kernel
on a TPU (`_tpu_attention.py`), else `jax.nn.dot_product_attention` (cuDNN's
fused kernel on GPUs that take it). Where `MeshStrategy(context=N)`
splits it (`phalanx._contracts.sequence_split`), it exchanges the chunks
itself: all-gathered, or round a ring (`_split_attention.py`, `_ring.py`).
Arguments are checked at trace time, on static shapes.
"""

from typing import Literal, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .._contracts import sequence_split
from .._log import logger
from .._typing import validates_own_arguments
from .._validate import boolean
from ._blockwise import blockwise_attention
from ._split_attention import split_attention
from ._tpu_attention import kernel_for, splash_attention


Implementation: TypeAlias = Literal["auto", "all_gather", "ring", "xla"]
IMPLEMENTATIONS = ("auto", "all_gather", "ring", "xla")

# The reasons cuDNN refused, each said once per process.
_refusals: set[str] = set()
# On a CPU, sequences at least this long are attended `BLOCKWISE` queries
# by `BLOCKWISE` keys at a time (`blockwise_attention`), not by XLA's
# attention, whose score matrix grows with their square.
BLOCKWISE_FROM = 4096
BLOCKWISE = 512


@validates_own_arguments
def dot_product_attention(
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    *,
    causal: bool = False,
    mask: Bool[Array, " kv_seq"] | None = None,
    implementation: Implementation = "auto",
) -> Float[Array, "seq heads dim"]:
    """Scaled dot-product attention of one example (no batch axis), exact
    whether or not a strategy splits its sequence over devices.

    The same computation as `jax.nn.dot_product_attention` without its batch
    axis: ``softmax(q kᵀ / sqrt(dim)) v`` over the visible keys. Where the
    sequence is whole it is that computation by a fused kernel where the
    chip has one: on a TPU JAX's Pallas splash kernel (sequences a multiple
    of 128 long, bfloat16 or float32, head dims up to 256, in one device's
    program; float32 exact under ``jax.default_matmul_precision("highest")``
    as XLA's is), on a GPU cuDNN's (it takes bfloat16 and float16); on a CPU
    sequences of 4,096 and more one block of 512 at a time; else XLA's,
    with one warning saying why the kernel did not take the arguments.
    Where `MeshStrategy(context=N)` splits the sequence over ``N`` devices,
    each device attends with its chunk of the queries:

    - ``"all_gather"``: gathers every device's keys and values. One
      collective; each device holds the whole sequence's keys. On a TPU
      its chunk of queries against each device's chunk of keys is one
      splash kernel call (chunks a multiple of 128 long), else XLA's
      ``seq/N × seq`` score matrix.
    - ``"ring"``: passes the keys and values round the devices, one chunk a
      step (``N - 1`` steps of `jax.lax.ppermute`, overlapping compute), with
      an online softmax; each device holds two chunks. Each block is one
      splash kernel call on a TPU (parts a multiple of 128 long), else a
      ``seq/N × seq/N`` score matrix recomputed in the backward pass. Causal
      attention is load-balanced: each device holds two opposite halves of
      chunks (``d`` and ``2N - 1 - d`` of ``2N``), so every device computes
      the same blocks and none of the fully masked ones.
    - ``"auto"``: the ring where the sequence allows it (divisible by
      ``2N`` for causal attention), else the all-gather.
    - ``"xla"``: XLA's attention, never a kernel: the whole score matrix
      (the all-gather's, where the sequence is split).

    Args:
        query: the queries, ``(seq, heads, dim)``.
        key: the keys, ``(kv_seq, heads, dim)``.
        value: the values, shaped as `key`.
        causal: each query sees only the keys at its position and before
            (``kv_seq == seq`` where the sequence is split for the ring).
        mask: which keys are real (True) and which padding (False), one per
            key position. Every query must see at least one key (pad at the
            end, or keep one real key); where none, the output is undefined.
        implementation: ``"auto"``, ``"all_gather"``, ``"ring"`` or
            ``"xla"``; where the sequence is not split, each but ``"xla"``
            is the fused kernel where there is one.

    Returns:
        The attended values, shaped as `query`.

    Raises:
        TypeError: `causal` is not True or False.
        ValueError: an unknown `implementation`; shapes that do not agree,
            or a split sequence that does not divide into the chunks it
            needs; a mask that is not boolean of shape ``(kv_seq,)``.

    Example:
        ```python
        x = jax.random.normal(jax.random.key(0), (128, 4, 16))
        out = px.models.dot_product_attention(x, x, x, causal=True)  # (128, 4, 16)
        ```
    """
    causal = boolean("causal", causal, numpy=True)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    mask = None if mask is None else jnp.asarray(mask)
    _check(query, key, value, mask, implementation)
    split = sequence_split()
    if split is None or split.size == 1:
        if implementation == "xla":
            return _xla(query, key, value, mask, causal=causal)
        return _whole(query, key, value, mask, causal=causal)
    n = split.size
    seq, kv_seq = query.shape[0], key.shape[0]
    if seq % n or kv_seq % n:
        raise ValueError(
            f"query seq={seq} and key kv_seq={kv_seq} must be divisible by the "
            f"context axis' {n} devices the sequence is split over; pad the "
            "sequence (and mask the padding)"
        )
    ring_fits = not causal or (seq == kv_seq and seq % (2 * n) == 0)
    if implementation == "ring" and not ring_fits:
        raise ValueError(
            f"implementation='ring' with causal=True over context={n} needs "
            f"seq == kv_seq divisible by 2 × {n} = {2 * n} (each device holds "
            f"two half-chunks), got seq={seq}, kv_seq={kv_seq}; pad the "
            "sequence or use implementation='all_gather'"
        )
    if implementation == "auto":
        implementation = "ring" if ring_fits else "all_gather"
    return split_attention(
        split, implementation, query, key, value, mask, causal=causal
    )


def _check(
    query: Array, key: Array, value: Array, mask: Array | None, implementation: str
) -> None:
    """Raise one clear line for arguments attention cannot take."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}; "
            "'auto' picks the ring where the sequence allows it"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 3 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"{name} of shape {tuple(x.shape)} and dtype {x.dtype} must be "
                "floating of shape (seq, heads, dim), one example: the trainer "
                "maps the model over the batch"
            )
    if key.shape != value.shape or query.shape[1:] != key.shape[1:]:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and value "
            f"{tuple(value.shape)} must be (seq, heads, dim), (kv_seq, heads, dim) "
            "and (kv_seq, heads, dim): the same heads and dim, key and value alike"
        )
    if mask is not None and (mask.shape != key.shape[:1] or mask.dtype != jnp.bool_):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} and dtype {mask.dtype} must be a "
            f"boolean padding mask of shape ({key.shape[0]},): True for each real "
            "key position, False for padding"
        )


def _whole(
    query: Array, key: Array, value: Array, mask: Array | None, *, causal: bool
) -> Array:
    """Attention over a sequence whole on its devices: on a TPU the splash
    kernel where it takes the arguments and runs in one device's program; on
    a GPU cuDNN's fused kernel where it takes them; on a CPU, long
    sequences a block at a time; else XLA's."""
    (seq, _, dim), kv_seq = query.shape, key.shape[0]
    interpret = kernel_for(
        seq, kv_seq, dim, query.dtype, causal=causal, what="dot_product_attention"
    )
    if interpret is not None:
        return splash_attention(
            query, key, value, mask, causal=causal, interpret=interpret
        )
    visible = None if mask is None else mask[None, None, None]
    if _platform() == "gpu":
        try:
            return jax.nn.dot_product_attention(
                query,
                key,
                value,
                mask=visible,
                is_causal=causal,
                implementation="cudnn",
            )
        # cuDNN says no at trace time, for its dtypes, shapes or version.
        except (ValueError, NotImplementedError, RuntimeError) as refusal:
            reason = (
                str(refusal).splitlines()[0] if str(refusal) else type(refusal).__name__
            )
            if reason not in _refusals:
                _refusals.add(reason)
                logger.warning(
                    "cuDNN's fused attention does not take these arguments (%s); "
                    "using XLA's attention, which keeps the whole score matrix",
                    reason,
                )
    block = BLOCKWISE
    if (
        _platform() == "cpu"
        and min(seq, kv_seq) >= BLOCKWISE_FROM
        and seq % block == kv_seq % block == 0
        and (not causal or seq == kv_seq)
    ):
        return blockwise_attention(query, key, value, mask, causal=causal, block=block)
    return _xla(query, key, value, mask, causal=causal)


def _xla(
    query: Array, key: Array, value: Array, mask: Array | None, *, causal: bool
) -> Array:
    """XLA's attention: the whole score matrix."""
    visible = None if mask is None else mask[None, None, None]
    return jax.nn.dot_product_attention(
        query, key, value, mask=visible, is_causal=causal, implementation="xla"
    )


def _platform() -> str:
    """The platform attention compiles for (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return jax.default_backend()
