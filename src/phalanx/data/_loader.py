"""Batches of in-memory NumPy arrays: shuffled, padded, sliced per process.

NumPy only: the batches stay on the host (JAX is asked only for the process
index and count), and putting them on devices is the trainer's job.
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, final

import numpy as np
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import boolean, integer
from ._buffers import BufferPool
from ._epochs import EpochCursor, EpochLoader
from ._processes import process_layout


Arrays = Sequence[np.ndarray] | Mapping[str, np.ndarray]
Batch = tuple[np.ndarray, ...] | dict[str, np.ndarray]
WEIGHT_KEY = "sample_weight"


@final
class ArrayLoader(EpochLoader):
    """Batches of NumPy arrays that share a leading (examples) axis.

    Every batch has the same structure and shape, with per-example weights
    appended: ``(x, y)`` gives ``(x_b, y_b, w_b)``, the ``(x, y,
    sample_weight)`` triple `DataParallelTrainer` weights by; a dict gives
    ``{**arrays_b, "sample_weight": w_b}`` (override the trainer's
    `split_batch` and `sample_weight` to read it). Weights are float32, 1 for
    real examples. A short last batch is padded to `batch_size` with zeros of
    weight 0, so the update stays exact and one compilation serves every
    step; ``drop_last=True`` drops it instead.

    Batches are built in 64-byte-aligned arrays, which JAX on CPU places on
    a device without a copy; their memory is reused once nothing holds a
    batch any more (the loader keeps up to 32 such buffers per array).

    Each epoch is a fresh permutation, reproducible from ``(seed, epoch)``.
    With several processes, each yields only its contiguous slice of every
    global batch (`batch_size` is the global size), so together they cover
    every example exactly once per epoch.

    Iteration is stateful, for exact resume: the loader tracks `epoch` and
    `position` (batches already yielded this epoch). `iter` yields the rest
    of the current epoch, then moves to the next epoch, so ``iter`` again
    gives a new permutation, and breaking out mid-epoch and iterating again
    resumes at the next batch. Save `state_dict` with a checkpoint and
    restore it with `load_state_dict`.

    Example:
        ```python
        loader = px.data.ArrayLoader((x, y), batch_size=256, seed=0)
        len(loader)  # batches per epoch
        trainer.fit(loader, epochs=5)  # each epoch a new shuffle
        checkpoint = loader.state_dict()  # {"epoch": 5, "position": 0, ...}
        loader.load_state_dict(checkpoint)  # resume exactly
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        arrays: Arrays,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        """
        Args:
            arrays: a tuple or list, e.g. ``(x, y)``, or a dict of NumPy arrays
                with the same leading (examples) axis.
            batch_size: examples in a global batch, over all processes.
            shuffle: a new permutation every epoch; False keeps the given order.
            seed: with the epoch number, fixes each permutation.
            drop_last: drop a short last batch instead of padding it.
            process_index: this process, default ``jax.process_index()``.
            process_count: processes sharing each batch, default
                ``jax.process_count()``; must divide `batch_size`.

        Raises:
            TypeError, ValueError: an argument is invalid (the message names it).
        """
        self._keys, self._arrays = _check_arrays(arrays)
        # NumPy ints and bools pass too, and are kept as given.
        integer(
            "batch_size", batch_size, minimum=1, numpy=True, example="batch_size=256"
        )
        boolean("shuffle", shuffle, numpy=True)
        boolean("drop_last", drop_last, numpy=True)
        integer("seed", seed, minimum=0, numpy=True, example="seed=0")
        process_index, process_count = process_layout(
            batch_size, process_index, process_count
        )
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.process_index = process_index
        self.process_count = process_count
        self.num_examples = len(self._arrays[0])
        self._at = EpochCursor(self.num_examples, batch_size, drop_last)
        self._order: tuple[int, np.ndarray | None] | None = None
        self._buffers = BufferPool()

    @override
    def __iter__(self) -> Iterator[Batch]:
        """Yield the rest of the current epoch, then move to the next epoch."""
        return self._at.rest_of_epoch(self._read)

    def state_dict(self) -> dict[str, int]:
        """Where iteration stands: ``{"epoch": ..., "position": ...,
        "batch_size": ...}``."""
        return self._at.state_dict()

    @validates_own_arguments
    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Resume from a `state_dict`: the next batch is the one after it.

        Raises:
            TypeError, ValueError: `state_dict` is not one this loader made,
                or was saved by a loader of another `batch_size`.
        """
        self._at.load_state_dict(state_dict, "ArrayLoader", made_of="data")

    # ------------------------------------------------------------- batches

    def _permutation(self) -> np.ndarray | None:
        """This epoch's order of examples (None: the natural order)."""
        if self._order is None or self._order[0] != self._at.epoch:
            order = (
                np.random.default_rng([self.seed, self._at.epoch]).permutation(
                    self.num_examples
                )
                if self.shuffle
                else None
            )
            self._order = (self._at.epoch, order)
        return self._order[1]

    def _read(self) -> Batch:
        """This process's slice of the epoch's batch at `position`, padded,
        with weights."""
        local = self.batch_size // self.process_count
        start = self._at.position * self.batch_size + self.process_index * local
        stop = min(start + local, self.num_examples)
        real = max(stop - start, 0)
        order = self._permutation()
        rows = slice(start, start + real) if order is None else order[start:stop]
        parts = [
            _gather(self._buffers, array, rows, real, local) for array in self._arrays
        ]
        weight = self._buffers.empty((local,), np.dtype(np.float32))
        weight[:real], weight[real:] = 1.0, 0.0
        if self._keys is None:
            return (*parts, weight)
        return {**dict(zip(self._keys, parts, strict=True)), WEIGHT_KEY: weight}


def _gather(
    buffers: BufferPool,
    array: np.ndarray,
    rows: slice | np.ndarray,
    real: int,
    size: int,
) -> np.ndarray:
    """`array`'s `real` rows at `rows` (a slice or indices), zero-padded to
    `size` rows, in an aligned array (placed on a CPU device uncopied)."""
    out = buffers.empty((size, *array.shape[1:]), array.dtype)
    if isinstance(rows, slice):
        out[:real] = array[rows]
    else:  # indices from a permutation: always in range, so no checks
        np.take(array, rows, axis=0, out=out[:real], mode="clip")
    out[real:] = 0
    return out


def _check_arrays(arrays: Any) -> tuple[list[str] | None, list[np.ndarray]]:
    """The keys (None for a sequence) and arrays of `arrays`, checked."""
    if isinstance(arrays, Mapping):
        keys = list(arrays)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"arrays has non-string keys {bad!r}; use string keys, e.g. "
                "{'x': x, 'y': y}"
            )
        if WEIGHT_KEY in arrays:
            raise ValueError(
                f"arrays already has a {WEIGHT_KEY!r} key; the loader adds it "
                "(1 for real examples, 0 for padding): rename yours, e.g. 'weight'"
            )
        names, values = [f"arrays[{k!r}]" for k in keys], list(arrays.values())
    elif isinstance(arrays, tuple | list):
        keys = None
        names, values = [f"arrays[{i}]" for i in range(len(arrays))], list(arrays)
    else:
        raise TypeError(
            f"arrays is a {type(arrays).__name__}; pass a tuple such as (x, y) or "
            "a dict such as {'x': x, 'y': y} of NumPy arrays"
        )
    if not values:
        raise ValueError(
            f"arrays={arrays!r} is empty; pass at least one array, e.g. (x, y)"
        )
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, np.ndarray):
            raise TypeError(
                f"{name} is a {type(value).__name__}, not a NumPy array; convert "
                "it first, e.g. np.asarray(...)"
            )
        if value.ndim == 0 or value.dtype.kind not in "biuf":
            raise TypeError(
                f"{name} is a {value.dtype}{list(value.shape)} array; every array "
                "needs a leading examples axis and a numeric dtype, e.g. "
                "np.float32 features of shape (n, ...) and np.int32 labels (n,)"
            )
    sizes = {name: len(value) for name, value in zip(names, values, strict=True)}
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"arrays disagree on the number of examples (leading axis): {sizes}; "
            "every array must hold one row per example"
        )
    if len(values[0]) == 0:
        raise ValueError(f"arrays hold 0 examples ({sizes}); pass non-empty arrays")
    return keys, values
