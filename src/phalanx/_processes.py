"""Host-side work that every process of a multi-process run does together:
checking that their batch slices agree (before the step's collectives, which
would otherwise hang or fail obscurely), and gathering predictions."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ._checks import BatchSpec, Leaf


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


def predict_across_processes(
    run: Callable[[list[Leaf], int], Any],
    leaves: list[Leaf],
    chunk: int | None,
    step_size: Callable[[int], int],
) -> Any:
    """Outputs for every process's rows, in process order, on every process.

    Args:
        run: ``run(part, size)``: the outputs (a global array) for this
            process's rows `part` padded to `size`, every process at once.
        leaves: this process's rows.
        chunk: rows per process per call (None: all at once).
        step_size: this process's padded size for a chunk of n rows.
    """
    counts = multihost_utils.process_allgather(np.array([leaves[0].shape[0]]))
    rows = [int(n) for n in np.asarray(counts).ravel()]
    chunk = chunk or max(rows)
    size = step_size(min(chunk, max(rows)))
    pieces: list[list[Any]] = [[] for _ in rows]
    for start in range(0, max(rows), chunk):
        part = [leaf[start : start + chunk] for leaf in leaves]  # maybe empty
        out = multihost_utils.process_allgather(run(part, size), tiled=True)
        for p, n in enumerate(rows):
            k = max(0, min(chunk, n - start))
            pieces[p].append(
                jax.tree.map(lambda o, p=p, k=k: o[p * size : p * size + k], out)
            )
    ordered = [piece for process in pieces for piece in process]
    return jax.tree.map(lambda *parts: jnp.asarray(np.concatenate(parts)), *ordered)
