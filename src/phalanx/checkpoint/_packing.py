"""Many arrays as one flat array per dtype, and back.

A training state is dozens of small arrays; orbax spends most of a save's
CPU time on each array's bookkeeping (metadata, TensorStore specs, files),
not on its bytes. Packing the state into one array per dtype before a save
makes the background writer's work nearly independent of the model's
depth. Both directions run on the devices, in one compiled call each.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Sharding
from jaxtyping import Array, Shaped


Layout = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf


@functools.cache
def _packer(sharding: Sharding):
    def pack(leaves: list[Array]) -> dict[str, Array]:
        groups: dict[str, list[Array]] = {}
        for leaf in leaves:
            groups.setdefault(str(leaf.dtype), []).append(jnp.ravel(leaf))
        # A lone part is copied explicitly: jit would hand back the input
        # buffer itself, which the next step may donate.
        return {
            dtype: jnp.concatenate(parts) if len(parts) > 1 else jnp.copy(parts[0])
            for dtype, parts in groups.items()
        }

    return jax.jit(pack, out_shardings=sharding)


def pack(leaves: list[Array], sharding: Sharding) -> dict[str, Shaped[Array, " size"]]:
    """`leaves` raveled and concatenated in order, one array per dtype (a
    new buffer: the leaves may be donated afterwards)."""
    return _packer(sharding)(leaves)


def packed_sizes(layout: Layout) -> dict[str, int]:
    """The length of each dtype's packed array."""
    sizes: dict[str, int] = {}
    for shape, dtype in layout:
        sizes[dtype] = sizes.get(dtype, 0) + math.prod(shape)
    return sizes


@functools.cache
def _unpacker(layout: Layout, sharding: Sharding):
    def unpack(packed: dict[str, Array]) -> list[Array]:
        offsets = dict.fromkeys(packed, 0)
        leaves = []
        for shape, dtype in layout:
            start, size = offsets[dtype], math.prod(shape)
            leaves.append(packed[dtype][start : start + size].reshape(shape))
            offsets[dtype] = start + size
        return leaves

    return jax.jit(unpack, out_shardings=sharding)


def unpack(
    packed: dict[str, Shaped[Array, " size"]], layout: Layout, sharding: Sharding
) -> list[Array]:
    """The leaves `pack` packed, given their shapes and dtypes in order."""
    return _unpacker(layout, sharding)(packed)
