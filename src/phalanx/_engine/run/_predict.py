"""`predict`: every row through the compiled predict step, in chunks."""

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

from ..._typing import validates_own_arguments
from ..._validate import optional_positive_int
from ...strategies._placement import put_batch, single_process
from ..feed._batch_checks import flatten_batch, num_examples
from ..feed._device_batch import pad
from ..feed._pipeline import BatchPipeline
from ..program._programs import Programs
from ..program._spec import Leaf


def predict_rows(
    step: Callable[[list[jax.Array], list[jax.Array]], Any],
    state: list[jax.Array],
    leaves: list[Leaf],
    batch_size: int | None,
    step_size: Callable[[int], int],
    split: Sequence[Sharding],
) -> Any:
    """The outputs of `step` for every row of `leaves`, in order.

    Args:
        step: the compiled predict step, ``step(state, inputs)``.
        state: the state's arrays.
        leaves: the inputs' leaves (this process's rows).
        batch_size: rows per call (None: all at once).
        step_size: the padded size of a call of n rows (this process's part).
        split: where each of a call's input leaves goes.
    """
    if not single_process():  # each process's rows; the global result
        return predict_across_processes(
            lambda part, size: step(state, put_batch(pad(part, size), split)),
            leaves,
            batch_size,
            step_size,
        )
    n = leaves[0].shape[0]
    chunk = n if batch_size is None else batch_size
    size = step_size(min(chunk, n))
    outputs = []
    for start in range(0, n, chunk):
        part = [leaf[start : start + chunk] for leaf in leaves]
        out = step(state, put_batch(pad(part, size), split))
        outputs.append(jax.tree.map(lambda o, k=part[0].shape[0]: o[:k], out))
    if len(outputs) == 1:
        return outputs[0]
    return jax.tree.map(lambda *os: jnp.concatenate(os), *outputs)


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


@validates_own_arguments
def predict_inputs(
    x: Any,
    batch_size: int | None,
    *,
    programs: Programs,
    pipeline: BatchPipeline,
    state: list[jax.Array],
) -> Any:
    """The model's outputs for every row of `x` (see
    `DataParallelTrainer.predict`), from the state's arrays `state`.

    Raises:
        TypeError: `x` is a loader or an iterable of batches.
        ValueError: bad rows or `batch_size`.
    """
    if isinstance(x, Iterable) and not isinstance(
        x, np.ndarray | jax.Array | tuple | list | dict
    ):
        raise TypeError(
            f"x={type(x).__name__} is a loader or an iterable of batches; "
            "predict takes the inputs themselves: an array (or pytree of "
            "arrays) with one row per example, e.g. trainer.predict(x_test); "
            "for a loader, predict each batch's x and concatenate"
        )
    leaves, treedef = flatten_batch(x, "x")
    num_examples(leaves, treedef, "x")
    batch_size = optional_positive_int("batch_size", batch_size)
    step, splits = programs.predict(treedef, leaves)
    return predict_rows(
        step,
        state,
        leaves,
        batch_size,
        lambda rows: pipeline.step_size(rows, None),
        splits,
    )
