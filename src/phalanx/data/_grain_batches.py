"""`LocalBatches`: a grain `MapDataset` whose element ``j`` is this
process's slice of global batch ``j``, counted across epochs.

Imported only by `GrainLoader` when it first reads (grain is an optional
extra). Element ``j`` is global batch ``j % batches_per_epoch`` of epoch
``j // batches_per_epoch``: the examples at positions ``[k·B, (k+1)·B)`` of
that epoch's permutation, of which process ``p`` of ``P`` reads the
contiguous ``B/P`` starting at ``k·B + p·B/P`` (as `ArrayLoader` slices).
The permutation is grain's stateless `index_shuffle` of ``(seed, epoch)``,
so which examples a global batch holds, and in which rows, depends on
neither the process count nor on where reading started: a run resumed at
batch ``j`` on any number of processes reads from there, and nothing before.
Random access is what makes that exact, so the source must be a
`MapDataset` (or a data source), not an `IterDataset`.
"""

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from ._grain_examples import OneShape
from ._loader import WEIGHT_KEY


Augment = Callable[[Any, np.random.Generator], Any]


class LocalBatches(grain.MapDataset):
    """This process's batches of `parent`'s examples; see the module."""

    def __init__(
        self,
        parent: grain.MapDataset,
        *,
        batch_size: int,
        process_index: int,
        process_count: int,
        shuffle: bool,
        seed: int,
        per_epoch: int,
        augment: Augment | None,
    ):
        super().__init__(parent)
        self._examples = len(parent)
        self._global = batch_size
        self._local = batch_size // process_count
        self._offset = process_index * self._local
        self._shuffle, self._seed, self._augment = shuffle, seed, augment
        self.per_epoch = per_epoch  # global batches an epoch (the loader's)
        self._shapes = OneShape()  # each process's (and worker's) own

    def __len__(self) -> int:
        # Epochs without end: the loader takes one epoch's batches per pass.
        return sys.maxsize // 2

    def __str__(self) -> str:
        return (
            f"LocalBatches(global={self._global}, local={self._local}, "
            f"offset={self._offset}, per_epoch={self.per_epoch})"
        )

    def __getitem__(self, index):  # pyright: ignore[reportIncompatibleMethodOverride]
        if isinstance(index, slice):
            return self.slice(index)
        epoch, batch = divmod(index, self.per_epoch)
        start = batch * self._global + self._offset
        positions = range(start, min(start + self._local, self._examples))
        rows = [self._row(self._epoch_seed(epoch), p) for p in positions]
        examples = list(self._parent._getitems(rows)) if rows else []
        if self._augment is not None:
            examples = [
                self._augment(example, np.random.default_rng([self._seed, epoch, p]))
                for example, p in zip(examples, positions, strict=True)
            ]
        self._shapes.check(examples, rows)
        template = examples[0] if examples else self._parent[0]
        return stack(examples, template, self._local)

    def _epoch_seed(self, epoch: int) -> int | None:
        """The permutation's seed for `epoch` (None: the natural order)."""
        if not self._shuffle:
            return None
        state = np.random.SeedSequence([self._seed, epoch]).generate_state(1)[0]
        return int(state) >> 1  # index_shuffle takes a signed 32-bit seed

    def _row(self, seed: int | None, position: int) -> int:
        """The example at `position` of the order `seed` fixes."""
        if seed is None:
            return position
        return grain.experimental.index_shuffle(
            position, max_index=self._examples - 1, seed=seed, rounds=4
        )


def stack(examples: Sequence[Any], template: Any, size: int) -> Any:
    """`examples` (tuples or dicts of arrays) stacked into a batch of `size`
    rows, zero-padded, with per-example weights (1 real, 0 padding) added
    as `ArrayLoader` adds them: ``(*parts, weight)`` or ``{..., "sample_weight":
    weight}``."""
    weight = np.zeros((size,), np.float32)
    weight[: len(examples)] = 1.0
    if isinstance(template, Mapping):
        keys = list(template)
        parts = [_column([e[k] for e in examples], template[k], size) for k in keys]
        return {**dict(zip(keys, parts, strict=True)), WEIGHT_KEY: weight}
    if isinstance(template, tuple | list):
        columns = range(len(template))
        parts = [_column([e[i] for e in examples], template[i], size) for i in columns]
        return (*parts, weight)
    raise TypeError(
        f"an example is a {type(template).__name__}; GrainLoader batches "
        "examples that are a tuple such as (x, y) or a dict such as "
        "{'x': x, 'y': y} of arrays: map the source to one"
    )


def _column(values: list[Any], template: Any, size: int) -> np.ndarray:
    like = np.asarray(template)
    out = np.zeros((size, *like.shape), like.dtype)
    if values:
        out[: len(values)] = np.stack([np.asarray(v) for v in values])
    return out


def exit_with_parent(worker_index: int, worker_count: int) -> None:
    """grain's worker init: end this worker when the process that started
    it is gone (killed with SIGKILL it cannot stop its workers, which would
    live on holding memory, their output pipes and multiprocessing's
    resource tracker).

    A thread polls the parent's pid: the kernel's parent-death signal
    follows the thread that forked, and grain starts workers from reading
    threads that end. The pid to watch is the one multiprocessing recorded
    when the parent started this worker, not this worker's parent now: a
    parent killed while the worker was still starting up (an evaluation
    pass's workers start at an epoch's end, and take a second or more to
    import) is already gone here, and the worker already an orphan.
    """
    del worker_index, worker_count
    started_by = multiprocessing.parent_process()
    parent = os.getppid() if started_by is None else started_by.pid

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="phalanx-parent-watch", daemon=True).start()
