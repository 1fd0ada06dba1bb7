"""Grain's own datasets given to `fit` directly: a `grain.MapDataset`,
`IterDataset` or `DataLoader` whose elements are this process's batches,
resumed from grain's iterator state instead of re-reading the epoch.

`fit` wraps such data in `GrainIterable` (`resumable`), which is
`Resumable`: its state is the epoch and grain's own iterator state after the
last batch taken, which a checkpoint keeps with the run. grain is never
imported here unless the data is grain's.
"""

import sys
from collections.abc import Iterator
from typing import Any, final


_END = object()


def resumable(data: Any) -> Any:
    """`data` wrapped in `GrainIterable` where it is one of grain's
    datasets or loaders, else `data` itself."""
    grain = sys.modules.get("grain")  # not imported: nothing of grain's here
    if grain is None:
        return data
    if isinstance(data, grain.MapDataset | grain.IterDataset | grain.DataLoader):
        return GrainIterable(data)
    return data


@final
class GrainIterable:
    """A grain dataset or loader as `Resumable` data: each pass yields the
    rest of the current epoch (until grain's iterator ends), and
    `state_dict` says where the next batch comes from in grain's terms.

    The iterator looks one batch ahead, so that the state after an epoch's
    last batch already names the next epoch (as `ArrayLoader`'s does), and
    keeps that batch for the next pass if the consumer stops.

    Each process's state is its own (grain's position in its shard): a
    multi-process run's checkpoints keep every process's, and a resume
    gives each its own back.
    """

    def __init__(self, dataset: Any):
        import jax  # only for the process count, which the state records

        self.dataset = dataset
        self._processes = jax.process_count()
        self._epoch = 0
        self._after: Any = None  # grain's state after the last batch taken
        self._iterator: Any = None
        self._pending: Any = _END  # read ahead, not yet yielded

    def __iter__(self) -> Iterator[Any]:
        """Yield the rest of the current epoch, then move to the next."""
        epoch = self._epoch
        if self._iterator is None:
            self._iterator = self._open()
        iterator = self._iterator
        batch = self._take()
        while batch is not _END:
            after = _state(iterator)
            following = next(iterator, _END)
            if following is _END:
                self._close()
                self._epoch, self._after = epoch + 1, None
            else:
                self._after, self._pending = after, following
            yield batch
            if following is _END:
                return
            batch = self._take()
        self._close()  # an epoch with no batches
        self._epoch, self._after = epoch + 1, None

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "iterator", "processes"}``: grain's iterator state
        (None at an epoch's start) of this process."""
        return {
            "epoch": self._epoch,
            "iterator": self._after,
            "processes": self._processes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`: grain's iterator is set there on the next
        pass (nothing before it is read).

        Raises:
            ValueError: `state` is not one this wrapper made, or was saved
                with another number of processes (grain's iterator state is
                of one process's shard, and does not re-shard).
        """
        if not isinstance(state, dict) or set(state) != {
            "epoch",
            "iterator",
            "processes",
        }:
            raise ValueError(
                f"data state {state!r} is not a grain iterator's position as "
                "phalanx saves it; resume with the data the run trained on"
            )
        if state["processes"] != self._processes:
            raise ValueError(
                f"the checkpoint's data position is grain's iterator state of "
                f"a run on {state['processes']} process(es), here "
                f"{self._processes}: each process's {type(self.dataset).__name__} "
                "iterator state is its own shard's and does not carry over; "
                f"resume on {state['processes']} process(es), or read with "
                "px.data.GrainLoader, which resumes on any number"
            )
        self._close()
        self._epoch, self._after = int(state["epoch"]), state["iterator"]

    def _take(self) -> Any:
        if self._pending is not _END:
            batch, self._pending = self._pending, _END
            return batch
        return next(self._iterator, _END)

    def _open(self) -> Any:
        absl_flags_parsed()
        iterator = iter(self.dataset)
        if self._after is not None:
            saved = self._after
            iterator.set_state(saved.encode() if _is_loader(iterator) else saved)
        return iterator

    def _close(self) -> None:
        iterator, self._iterator, self._pending = self._iterator, None, _END
        import grain

        if isinstance(iterator, grain.DatasetIterator):  # (a DataLoader's has none)
            iterator.close()


def _state(iterator: Any) -> Any:
    """grain's iterator state as JSON data (a loader's is JSON bytes)."""
    state = iterator.get_state()
    return state.decode() if _is_loader(iterator) else state


def _is_loader(iterator: Any) -> bool:
    import grain

    return isinstance(iterator, grain.DataLoaderIterator)


def absl_flags_parsed() -> None:
    """Mark absl's flags parsed where no program did (absl.app): grain's
    worker processes read one of its flags and fail if they are not."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
