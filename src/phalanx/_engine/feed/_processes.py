"""Checking that every process's slice of a batch agrees, before the step's
collectives (which would otherwise hang or fail obscurely)."""

import jax
import numpy as np
from jax.experimental import multihost_utils

from ..program._spec import BatchSpec, Leaf


_WIDTH = 1024  # bytes of each process's description that are compared


def check_same_slices(leaves: list[Leaf], treedef: object, where: str) -> None:
    """Raise on every process if the processes' slices of a batch differ in
    structure, shapes or dtypes (one tiny all-gather; a no-op in one process).

    Raises:
        ValueError: names each process and its slice.
    """
    if jax.process_count() == 1:
        return
    mine = BatchSpec.of(leaves, treedef).describe()
    mine = f"{leaves[0].shape[0]} examples {mine}"
    encoded = np.zeros(_WIDTH, np.uint8)
    raw = mine.encode()[:_WIDTH]
    encoded[: len(raw)] = np.frombuffer(raw, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(encoded))
    slices = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]
    if len(set(slices)) > 1:
        listing = "; ".join(f"process {i}: {text}" for i, text in enumerate(slices))
        raise ValueError(
            f"data: the processes' slices of {where} differ ({listing}); every "
            "process must hand the same shapes, e.g. with px.data.ArrayLoader, "
            "which gives each process an equal slice of every global batch"
        )
