"""The values a batch becomes on its way to a step.

`FirstBatch` is the first batch a trainer sees, as the programs are built
from it; `DeviceBatch` is a batch checked, padded and placed, ready for a
step (`pad` fills a short one; `quick_key` names a batch seen before).
Nothing here checks, places or compiles (the `BatchPipeline` does).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..program._spec import BatchSpec, Leaf


class FirstBatch(NamedTuple):
    """The first batch a trainer sees, as the steps are built from it.

    Attributes:
        spec: the structure, shapes and dtypes every later batch must have.
        size: the examples of its global step (every process's slice, padded).
        labels: its targets (for a hint when they do not fit the model).
    """

    spec: BatchSpec
    size: int
    labels: Any


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


def quick_key(
    leaves: list[Any], treedef: Any, first: int | None, train: bool
) -> tuple[Any, ...] | None:
    """The key of a batch's quick path where every leaf is an array (else
    None): its structure, each leaf's shape and dtype (a device leaf's
    abstract value, read once) and layout (None on the host)."""
    described: list[tuple[Any, ...]] = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            described.append((leaf.aval, leaf.sharding))
        elif isinstance(leaf, np.ndarray):
            described.append((leaf.shape, leaf.dtype, None))
        else:
            return None
    return treedef, tuple(described), first, train


def pad(leaves: list[Leaf], size: int) -> list[Leaf]:
    """Pad every leaf with zeros along the leading axis to `size` examples
    (on the host, or on device for a `jax.Array`)."""
    return [
        leaf
        if leaf.shape[0] == size
        else (jnp if isinstance(leaf, jax.Array) else np).concatenate(
            [leaf, np.zeros((size - leaf.shape[0], *leaf.shape[1:]), leaf.dtype)]
        )
        for leaf in leaves
    ]
