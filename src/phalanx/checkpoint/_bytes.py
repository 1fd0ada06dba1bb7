"""A state's replicated arrays saved as one array of their bytes, and back.

Orbax's work per save, and the files it writes and syncs, grow with the
number of arrays, not with their bytes: one array of bytes, where packing by
dtype leaves several (the parameters and optimizer state, the key's data,
the step), takes the default CLI's writer ~15 ms a save instead of ~18.

The bytes are the arrays packed by dtype (`_packing.py`), one dtype after
another in the order the leaves first show them, each as it lies in memory.
A small state on CPU devices is copied straight into them by NumPy on the
training thread (no program to compile or dispatch: ~20 us for the default
CLI's 0.5 MB); any other is packed on its device (an asynchronous copy) and
read into bytes on the writer thread (`DeviceParts`). Restoring views the
bytes as each leaf's dtype, on the host, which is exact for every dtype.
"""

import math
from typing import NamedTuple

import numpy as np
from jax.sharding import Sharding
from jaxtyping import Array

from ..strategies._placement import put_state


# The key of the array of bytes among a checkpoint's arrays, and the value
# of its "packed" entry.
BYTES = "bytes"
# A state up to this size on CPU devices is copied by NumPy on the training
# thread (a synchronous copy: ~0.4 ms a MiB here); a larger one by its
# device, without waiting.
HOST_COPY_BYTES = 1 << 20

Layout = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each leaf


def host_bytes(leaves: list[Array]) -> np.ndarray:
    """The bytes of `leaves` (each on one CPU device): a new host buffer.
    Each leaf is read once it is computed (at an epoch's end it is; a save
    after a step still running waits for that step)."""
    groups: dict[np.dtype, list[np.ndarray]] = {}
    for leaf in leaves:
        groups.setdefault(leaf.dtype, []).append(
            np.asarray(leaf).reshape(-1).view(np.uint8)
        )
    return np.concatenate([part for parts in groups.values() for part in parts])


class DeviceParts(NamedTuple):
    """Leaves packed by dtype on a device, not waited for: read into bytes
    on the writer thread."""

    parts: list[Array]  # one per dtype, in the order the leaves show them

    def read(self) -> np.ndarray:
        """Their bytes, once the device has copied them (on an accelerator,
        a transfer to the host)."""
        return np.concatenate(
            [np.asarray(part).reshape(-1).view(np.uint8) for part in self.parts]
        )


def packed_bytes(layout: Layout) -> int:
    """The length of the bytes of leaves of `layout`."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in layout)


def unpack_bytes(
    packed: np.ndarray, layout: Layout, shardings: tuple[Sharding, ...]
) -> list[Array]:
    """The leaves whose bytes `packed` (on the host) holds, given their shapes
    and dtypes in order, each laid out as `shardings` say."""
    order: dict[str, list[int]] = {}
    for i, (_, dtype) in enumerate(layout):
        order.setdefault(dtype, []).append(i)
    leaves: list[np.ndarray | None] = [None] * len(layout)
    start = 0
    for dtype, indices in order.items():
        kind = np.dtype(dtype)
        for i in indices:
            shape = layout[i][0]
            end = start + math.prod(shape) * kind.itemsize
            leaves[i] = packed[start:end].view(kind).reshape(shape)
            start = end
    return put_state(leaves, shardings)
