"""The values a batch becomes on its way to a step.

`FirstBatch` is the first batch a trainer sees, as the programs are built
from it; `DeviceBatch` is a batch checked, padded and placed, ready for a
step. Plain named tuples: nothing here checks, pads, places or compiles
(the `BatchPipeline` makes them).
"""

from typing import Any, NamedTuple

import jax
import numpy as np

from .._checks._batch import BatchSpec, Signature


class FirstBatch(NamedTuple):
    """The first batch a trainer sees, as the steps are built from it.

    Attributes:
        spec: the structure, shapes and dtypes every later batch must have.
        size: the examples of its global step (every process's slice, padded).
        labels: its targets (for a hint when they do not fit the model).
        signature: its `signature` (checked: no need to check it again).
        n: its examples.
    """

    spec: BatchSpec
    size: int
    labels: Any
    signature: Signature
    n: int


class DeviceBatch(NamedTuple):
    """A batch ready for a step.

    Attributes:
        leaves: the leaves of ``(inputs, targets)``: split across devices, or
            NumPy arrays the step itself places (single process).
        weight: per-example weights (sample weights; 0 for padding), split
            across devices.
        total: Σ weight over the global batch, replicated.
        size: examples in the padded step; pass it back as `first` for the
            rest of the pass.
        n: this process's real examples.
        total_value: `total` on the host, where known (one process).
    """

    leaves: list[jax.Array | np.ndarray]
    weight: jax.Array
    total: jax.Array
    size: int
    n: int
    total_value: float | None = None
