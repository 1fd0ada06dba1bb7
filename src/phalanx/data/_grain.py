"""`GrainLoader`: batches read by Grain from data too large for memory,
resumed exactly on any number of processes.

Grain (the ``grain`` extra) does the reading: random access into the source
(ArrayRecord files, `Records`, any `MapDataset`), threads, and worker
processes that decode ahead. The loader decides which
examples each process reads (`_grain_batches.py`) and keeps its place as
``(epoch, position)`` in global batches, which means the same on one
process as on many; grain itself is imported on first read.
"""

from collections.abc import Iterator
from typing import Any, final

import numpy as np
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import boolean, integer
from ._buffers import BufferPool
from ._epochs import EpochCursor, EpochLoader
from ._grain_examples import unbatched
from ._grain_iterables import absl_flags_parsed
from ._processes import process_layout


@final
class GrainLoader(EpochLoader):
    """Batches of a Grain source's examples, shuffled, padded and sliced
    per process as `px.data.ArrayLoader` batches arrays, for data on disk.

    `source` is a `grain.MapDataset` of examples, each a tuple such as
    ``(x, y)`` or a dict of arrays (decode them with ``.map``: it runs on
    the examples read, in the workers), or a random-access data source such
    as ``grain.sources.ArrayRecordDataSource``. Batches are as
    `ArrayLoader`'s: per-example weights appended, a short last batch padded
    with zeros of weight 0 (``drop_last=True`` drops it).

    Each epoch is a fresh permutation of ``(seed, epoch)`` (grain's
    stateless `index_shuffle`: no order is held in memory). With several
    processes, each reads only its contiguous slice of every global batch
    (`batch_size` is the global size), so the processes together read every
    example once per epoch, each decoded once.

    Resume is exact and reads nothing twice: the state is ``{"epoch",
    "position", "batch_size"}``, the position in global batches, saved with
    the run's checkpoints, and the next batch is read straight from there by
    random access. A run stopped on P processes resumes on P′ with the same
    batches in the same rows; a loader of another `batch_size` refuses the
    state (its position would skip or repeat examples).

    ``worker_count > 0`` decodes in that many worker processes
    (`grain.MapDataset.mp_prefetch`); they start with each pass that begins
    at a new place (the first, and after a resume) and last across epochs.
    Functions they run must be importable (defined at a module's top level,
    the script's under ``if __name__ == "__main__":``).

    Example:
        ```python
        import grain

        examples = [(np.full(4, i, np.float32), np.int32(i % 2)) for i in range(100)]
        source = grain.MapDataset.source(examples)  # or an ArrayRecordDataSource
        loader = px.data.GrainLoader(source, batch_size=32, seed=0)
        x, y, weight = next(iter(loader))  # x: (32, 4); weight: 1 for real examples
        loader.state_dict()  # {"epoch": 0, "position": 1, "batch_size": 32}
        loader.close()
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        augment: Any = None,
        worker_count: int = 0,
        worker_buffer_size: int = 2,
        read_threads: int = 2,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        """
        Args:
            source: a `grain.MapDataset` of examples, or a random-access
                source (``len`` and ``[i]``), e.g.
                ``grain.sources.ArrayRecordDataSource``.
            batch_size: examples in a global batch, over all processes.
            shuffle: a new permutation every epoch; False keeps the order.
            seed: with the epoch number, fixes each permutation and `augment`.
            drop_last: drop a short last batch instead of padding it.
            augment: ``augment(example, rng) -> example``, random per example
                and epoch, `rng` a NumPy Generator seeded by ``(seed, epoch,
                position)``: the same draws after a resume or on other
                process counts.
            worker_count: processes decoding ahead (0: threads of this one).
            worker_buffer_size: batches each worker keeps ready.
            read_threads: threads reading batches ahead in this process
                (or in each worker).
            process_index: this process, default ``jax.process_index()``.
            process_count: processes sharing each batch, default
                ``jax.process_count()``; must divide `batch_size`.

        Raises:
            TypeError, ValueError: an argument is invalid (the message names it).
        """
        self._source = _check_source(source)
        unbatched(self._source)
        integer("batch_size", batch_size, minimum=1, numpy=True, example="256")
        boolean("shuffle", shuffle, numpy=True)
        boolean("drop_last", drop_last, numpy=True)
        integer("seed", seed, minimum=0, numpy=True, example="seed=0")
        integer("worker_count", worker_count, minimum=0, example="worker_count=2")
        integer("worker_buffer_size", worker_buffer_size, minimum=1, example="2")
        integer("read_threads", read_threads, minimum=1, example="read_threads=2")
        if augment is not None and not callable(augment):
            raise TypeError(
                f"augment={augment!r} is not callable; pass a function "
                "augment(example, rng) -> example, or None"
            )
        self.process_index, self.process_count = process_layout(
            batch_size, process_index, process_count
        )
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.drop_last, self.augment = drop_last, augment
        self.worker_count, self.worker_buffer_size = worker_count, worker_buffer_size
        self.read_threads = read_threads
        self.num_examples = len(self._source)
        if self.num_examples == 0:
            raise ValueError("source holds 0 examples; pass a non-empty source")
        self._at = EpochCursor(self.num_examples, batch_size, drop_last)
        # The open reader and the global batch it yields next.
        self._reader: tuple[Any, int] | None = None
        self._buffers = BufferPool()

    @override
    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch, then move to the next epoch."""
        return self._at.rest_of_epoch(self._read)

    def state_dict(self) -> dict[str, int]:
        """Where iteration stands: ``{"epoch": ..., "position": ...,
        "batch_size": ...}``, in global batches (the same on every
        process)."""
        return self._at.state_dict()

    @validates_own_arguments
    def load_state_dict(self, state_dict: Any) -> None:
        """Resume from a `state_dict`: the next batch is the one after it,
        read from there (nothing before it is read again).

        Raises:
            TypeError, ValueError: `state_dict` is not one this loader made,
                or was saved by a loader of another `batch_size`.
        """
        self._at.load_state_dict(state_dict, "GrainLoader", made_of="source")

    def close(self) -> None:
        """Stop the reader and its workers (a later read starts them again)."""
        if self._reader is not None:
            reader, self._reader = self._reader[0], None
            reader.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit grain may be gone
            pass

    # ------------------------------------------------------------- reading

    def _read(self) -> Any:
        """The next batch, from the open reader if it stands there, else
        from a new one opened at it."""
        index = self._at.index
        if self._reader is None or self._reader[1] != index:
            self.close()
            self._reader = (self._open(index), index)
        reader, _ = self._reader
        batch = next(reader)
        self._reader = (reader, index + 1)
        return self._own(batch)

    def _open(self, index: int) -> Any:
        """A grain iterator over this process's batches from global batch
        `index` (counted across epochs) on."""
        import grain

        from ._grain_batches import LocalBatches, exit_with_parent

        absl_flags_parsed()
        batches = LocalBatches(
            self._source,
            batch_size=self.batch_size,
            process_index=self.process_index,
            process_count=self.process_count,
            shuffle=self.shuffle,
            seed=self.seed,
            per_epoch=len(self),
            augment=self.augment,
        )
        options = grain.ReadOptions(
            num_threads=self.read_threads, prefetch_buffer_size=2 * self.read_threads
        )
        dataset = batches[index:].to_iter_dataset(options)
        if self.worker_count:
            dataset = dataset.mp_prefetch(
                grain.MultiprocessingOptions(
                    num_workers=self.worker_count,
                    per_worker_buffer_size=self.worker_buffer_size,
                ),
                worker_init_fn=exit_with_parent,
            )
        return iter(dataset)

    def _own(self, batch: Any) -> Any:
        """`batch` copied into this loader's aligned memory: JAX on CPU then
        uses it in place, and a worker's shared memory is released."""

        def own(array: np.ndarray) -> np.ndarray:
            out = self._buffers.empty(array.shape, array.dtype)
            out[...] = array
            return out

        if isinstance(batch, dict):
            return {key: own(value) for key, value in batch.items()}
        return tuple(own(value) for value in batch)


def _check_source(source: Any) -> Any:
    """`source` as a `grain.MapDataset`, or a clear error."""
    try:
        import grain
    except ImportError as missing:
        raise ImportError(
            "GrainLoader reads with grain, which is not installed; install "
            "phalanx's grain extra: pip install 'phalanx[grain]'"
        ) from missing

    if isinstance(source, grain.MapDataset):
        return source
    if isinstance(source, grain.IterDataset | grain.DataLoader):
        raise TypeError(
            f"source is a {type(source).__name__}, which reads only in order; "
            "GrainLoader needs random access (a grain.MapDataset or a data "
            "source) to resume anywhere. Pass the MapDataset before "
            ".to_iter_dataset(), or give the iterable to fit directly"
        )
    if isinstance(source, grain.sources.RandomAccessDataSource):  # len and [i]
        return grain.MapDataset.source(source)
    raise TypeError(
        f"source is a {type(source).__name__}; pass a grain.MapDataset or a "
        "random-access data source (len and [i]), e.g. "
        "grain.sources.ArrayRecordDataSource(paths)"
    )
