"""Aligned host arrays for a loader's batches, reused once nothing holds them.

NumPy only: the pool hands out memory that JAX on CPU can use without a copy,
and never reuses a buffer an array still views.
"""

import math
import sys

import numpy as np


# JAX on CPU uses a NumPy array's memory in place, without a copy, when its
# data starts on a 64-byte boundary; NumPy's own allocations promise only 16.
ALIGN = 64
# Memory kept per batch shape: enough for the steps in flight (the trainer's
# `sync_every`, 16 by default) and the batches prepared ahead.
LIMIT = 32
# sys.getrefcount of a kept buffer that no array views: the pool's list, the
# loop variable, and getrefcount's own argument.
_UNUSED = 3


class BufferPool:
    """Uninitialised C-contiguous arrays whose data starts on an `ALIGN`-byte
    boundary, each backed by a buffer reused once nothing views it.

    A batch handed out may be used in place by JAX (placed on a CPU device
    without a copy) and stays referenced while its step is in flight, so a
    buffer is reused only when its reference count shows every array viewing
    it gone: NumPy points every view at the buffer that owns the memory, and
    nothing but this pool can make a new one. Fresh memory for every batch
    would cost the kernel's page faults instead: at 2048 × 784 float32, ~500
    faults per batch and ~10% of the step on a 2-core machine.
    """

    def __init__(self, limit: int = LIMIT):
        self._limit = limit
        self._kept: dict[tuple[tuple[int, ...], np.dtype], list[np.ndarray]] = {}

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An aligned array of `shape` and `dtype`, contents undefined."""
        kept = self._kept.setdefault((shape, dtype), [])
        nbytes = math.prod(shape) * dtype.itemsize
        for buffer in kept:
            if sys.getrefcount(buffer) == _UNUSED:
                return _aligned(buffer, nbytes, shape, dtype)
        buffer = np.empty(nbytes + ALIGN, np.uint8)
        if len(kept) < self._limit:  # beyond it, a batch gets fresh memory
            kept.append(buffer)
        return _aligned(buffer, nbytes, shape, dtype)


def _aligned(
    buffer: np.ndarray, nbytes: int, shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    start = -buffer.ctypes.data % ALIGN
    return buffer[start : start + nbytes].view(dtype).reshape(shape)
