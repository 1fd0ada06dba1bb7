"""Many arrays as few flat ones, and back.

A training state is dozens of small arrays; orbax spends most of a save's
CPU time on each array's bookkeeping (metadata, TensorStore specs, files
written and synced), not on its bytes. Packing the state's replicated arrays
before a save makes the background writer's work nearly independent of the
model's depth. Arrays split over devices are not packed (packing would
gather them): they are copied as they lie and saved one by one.

How, by where the state lives:

- One process: the replicated arrays' bytes, one host array (`_bytes.py`),
  copied from the first device's copy (every device holds the whole array):
  by NumPy for a small state on CPU devices (no program to compile or
  dispatch), else by one compiled call on that device (~20 us to dispatch,
  where a call over 8 devices took ~400-650 us), compiled ahead of the first
  save (`pack_compiler`) and read into bytes by the writer thread.
- Several processes: one array per dtype, replicated over the whole mesh
  (every process must hand orbax the same global arrays); unpacked on the
  devices, in one compiled call.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding
from jaxtyping import Array, Shaped

from ._bytes import BYTES, HOST_COPY_BYTES, DeviceParts, host_bytes


Layout = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf


def _grouped(leaves: list[Array]) -> dict[str, Array]:
    """`leaves` raveled and concatenated, one array per dtype."""
    groups: dict[str, list[Array]] = {}
    for leaf in leaves:
        groups.setdefault(str(leaf.dtype), []).append(jnp.ravel(leaf))
    # A lone part is copied explicitly: jit would hand back the input buffer
    # itself, which the next step may donate.
    return {
        dtype: jnp.concatenate(parts) if len(parts) > 1 else jnp.copy(parts[0])
        for dtype, parts in groups.items()
    }


@functools.cache
def _packer(replicated: Sharding, kept: tuple[Sharding, ...]):
    def pack(
        leaves: list[Array], others: list[Array]
    ) -> tuple[dict[str, Array], list[Array]]:
        return _grouped(leaves), [jnp.copy(x) for x in others]

    return jax.jit(pack, out_shardings=(replicated, list(kept)))


@functools.cache
def _local_packer(device: Sharding):
    def pack(leaves: list[Array]) -> list[Array]:
        # A list: in the order the leaves first show each dtype, as their
        # bytes are (a dict's come back in the order of its sorted keys).
        return list(_grouped(leaves).values())

    return jax.jit(pack, out_shardings=device)


@functools.cache
def _copier(kept: tuple[Sharding, ...]):
    def copy(others: list[Array]) -> list[Array]:
        return [jnp.copy(x) for x in others]

    return jax.jit(copy, out_shardings=list(kept))


# Packed arrays: by dtype (on the devices), or as bytes (`BYTES`): on the
# host, or on a device to be read into bytes by the writer.
Packed = dict[str, Shaped[Array, " size"] | Shaped[np.ndarray, " size"] | DeviceParts]


def pack(
    leaves: list[Array], others: list[Array], replicated: Sharding
) -> tuple[Packed, list[Array]]:
    """`leaves` (replicated over `replicated`'s devices) packed, and copies of
    `others` laid out as they are: new buffers, so the originals may be
    donated afterwards.

    In one process the packed leaves are their bytes (`_bytes.py`), under
    `BYTES`; across processes one array per dtype, replicated as
    `replicated` says (every process hands orbax the same global arrays)."""
    kept = tuple(x.sharding for x in others)
    if not replicated.is_fully_addressable:
        return _packer(replicated, kept)(leaves, others)
    # Each replicated leaf's copy on the first device of its mesh (the state's
    # arrays share one mesh): a view, no transfer.
    local = [x.addressable_data(0) for x in leaves]
    copies = _copier(kept)(others) if others else []
    if not local:
        return {}, copies
    if _copied_on_host(replicated, local):
        return {BYTES: host_bytes(local)}, copies
    return {BYTES: DeviceParts(_local_packer(local[0].sharding)(local))}, copies


def _copied_on_host(replicated: Sharding, leaves: list[Array]) -> bool:
    """Whether `leaves` are copied by NumPy: a small state on CPU devices."""
    return _on_host(replicated) and sum(x.nbytes for x in leaves) <= HOST_COPY_BYTES


@functools.cache
def _on_host(sharding: Sharding) -> bool:
    """Whether `sharding`'s devices are the host's CPU (their memory is the
    host's: NumPy copies it as well as they do, with no program to compile)."""
    return all(device.platform == "cpu" for device in sharding.device_set)


def pack_compiler(
    leaves: list[Array], others: list[Array], replicated: Sharding
) -> Callable[[], None] | None:
    """A function that compiles the calls `pack` makes for arrays shaped and
    laid out as these (read now: it holds no array), so that the first save
    finds them compiled: called on another thread ahead of it, it takes
    their compile (~20-50 ms) off the training thread. None where `pack`
    compiles nothing (a small state on CPU devices)."""
    kept = tuple(x.sharding for x in others)
    calls: list[tuple[Any, tuple[Any, ...]]] = []
    if not replicated.is_fully_addressable:
        calls.append(
            (_packer(replicated, kept), (_abstract(leaves), _abstract(others)))
        )
    else:
        if leaves and not _copied_on_host(replicated, leaves):
            device = leaves[0].addressable_data(0).sharding
            calls.append((_local_packer(device), (_abstract(leaves, device),)))
        if others:
            calls.append((_copier(kept), (_abstract(others),)))
    if not calls:
        return None

    def compile_pack() -> None:
        for jitted, args in calls:
            jitted.lower(*args).compile()

    return compile_pack


def _abstract(
    arrays: list[Array], sharding: Sharding | None = None
) -> list[jax.ShapeDtypeStruct]:
    """The shapes, dtypes and layouts of `arrays` (laid out as `sharding`,
    if given)."""
    return [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or x.sharding)
        for x in arrays
    ]


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
