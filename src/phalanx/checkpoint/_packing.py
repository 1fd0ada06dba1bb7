"""Many arrays as one flat array per dtype, and back.

A training state is dozens of small arrays; orbax spends most of a save's
CPU time on each array's bookkeeping (metadata, TensorStore specs, files),
not on its bytes. Packing the state's replicated arrays into one array per
dtype before a save makes the background writer's work nearly independent
of the model's depth. Arrays split over devices are not packed (packing
would gather them): they are copied as they lie and saved one by one. Both
directions run on the devices, in one compiled call each.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Sharding
from jaxtyping import Array, Shaped


Layout = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf


@functools.cache
def _packer(replicated: Sharding, kept: tuple[Sharding, ...]):
    def pack(
        leaves: list[Array], others: list[Array]
    ) -> tuple[dict[str, Array], list[Array]]:
        groups: dict[str, list[Array]] = {}
        for leaf in leaves:
            groups.setdefault(str(leaf.dtype), []).append(jnp.ravel(leaf))
        # A lone part is copied explicitly: jit would hand back the input
        # buffer itself, which the next step may donate.
        packed = {
            dtype: jnp.concatenate(parts) if len(parts) > 1 else jnp.copy(parts[0])
            for dtype, parts in groups.items()
        }
        return packed, [jnp.copy(x) for x in others]

    return jax.jit(pack, out_shardings=(replicated, list(kept)))


def pack(
    leaves: list[Array], others: list[Array], replicated: Sharding
) -> tuple[dict[str, Shaped[Array, " size"]], list[Array]]:
    """`leaves` raveled and concatenated in order, one array per dtype
    (replicated), and copies of `others` laid out as they are: new buffers,
    so the originals may be donated afterwards."""
    kept = tuple(x.sharding for x in others)
    return _packer(replicated, kept)(leaves, others)


def packed_sizes(layout: Layout) -> dict[str, int]:
    """The length of each dtype's packed array."""
    sizes: dict[str, int] = {}
    for shape, dtype in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return sizes


@functools.cache
def _unpacker(layout: Layout, shardings: tuple[Sharding, ...]):
    def unpack(packed: dict[str, Array]) -> list[Array]:
        offsets = dict.fromkeys(packed, 0)
        leaves = []
        for shape, dtype in layout:
            start, size = offsets[dtype], math.prod(shape)
            leaves.append(packed[dtype][start : start + size].reshape(shape))
            offsets[dtype] = start + size
        return leaves

    return jax.jit(unpack, out_shardings=list(shardings))


def unpack(
    packed: dict[str, Shaped[Array, " size"]],
    layout: Layout,
    shardings: tuple[Sharding, ...],
) -> list[Array]:
    """The leaves `pack` packed, given their shapes and dtypes in order,
    each laid out as `shardings` say."""
    return _unpacker(layout, shardings)(packed)
