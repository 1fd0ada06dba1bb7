"""A pass's batches, prepared ahead on a background thread that runs only on
cores nothing else wants."""

import itertools
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import numpy as np

from ...data import Resumable
from ...strategies._placement import single_process


if TYPE_CHECKING:
    from ...strategies import Strategy
    from ._device_batch import DeviceBatch
    from ._pipeline import BatchPipeline


_T = TypeVar("_T")
_POLL_S = 0.05  # how often a blocked producer looks for `close`


class _End(NamedTuple):
    """The items ran out."""


class _Failed(NamedTuple):
    """Preparing the next item raised `error`."""

    error: BaseException


class Prefetcher(Generic[_T]):
    """`prepare(item)` for each of `items`, computed `depth` items ahead on a
    background thread.

    The thread asks the OS for the idle scheduling class (Linux
    ``SCHED_IDLE``), so it runs only on a core that would otherwise idle:
    checking and gathering the next batches fills the gaps in XLA's use of
    the cores instead of taking turns with it. (At normal priority the same
    thread gains nothing on a machine whose cores XLA keeps busy.) Results
    come out in order; an exception raised for an item is raised by `next`
    in its place, and the thread stops there. `close` stops the thread; the
    items it read ahead are dropped (the caller rewinds their source).
    """

    def __init__(self, items: Iterator[Any], prepare: Callable[[Any], _T], depth: int):
        self._items = items
        self._prepare = prepare
        self._queue: queue.Queue[_T | _End | _Failed] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, daemon=True)
        self._thread.start()

    def __iter__(self) -> "Prefetcher[_T]":
        return self

    def __next__(self) -> _T:
        if self._done:
            raise StopIteration
        result = self._queue.get()
        if isinstance(result, _End | _Failed):
            self._done = True
            if isinstance(result, _Failed):
                raise result.error
            raise StopIteration
        return result

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the item in hand)."""
        self._closed.set()
        self._thread.join()

    def _produce(self) -> None:
        _lower_priority()
        try:
            for item in self._items:
                if not self._put(self._prepare(item)):
                    return
            self._put(_End())
        except StopIteration as error:  # from a hook: not the end of the items
            self._put(_Failed(RuntimeError(f"StopIteration raised: {error!r}")))
        except BaseException as error:  # raised in the consumer, in order
            self._put(_Failed(error))

    def _put(self, result: _T | _End | _Failed) -> bool:
        """Queue `result`; False if the consumer closed the prefetcher first."""
        while not self._closed.is_set():
            try:
                self._queue.put(result, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False


def default_depth(strategy: "Strategy") -> int:
    """Batches to read ahead when the user does not say: 2, or 0 where the
    strategy runs on one CPU device.

    XLA spreads a single CPU device's step over every core, so the idle
    priority thread finds no core to use and the caller waits on it: on 2
    cores, host data at batch 256 trained at 0.90-0.96 of the speed of data
    already on the device when prepared on the calling thread, 0.88-0.90
    when read ahead. Eight fake CPU devices leave gaps (their collectives
    wait for one another) that the thread fills: 0.94-0.96 read ahead,
    0.90-0.95 not.
    """
    one_cpu = (
        strategy.num_devices == 1
        and next(iter(strategy.batch_sharding.device_set)).platform == "cpu"
    )
    return 0 if one_cpu else 2


def _lower_priority() -> None:
    """Put the calling thread in the idle scheduling class, where the OS
    offers it (Linux); elsewhere it keeps normal priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pyright: ignore[reportAttributeAccessIssue]
    except (AttributeError, OSError):
        pass


class Feed:
    """One pass over `data`: its batches checked, padded and placed, `depth`
    ahead on a `Prefetcher` where reading ahead loses nothing: in one process
    (several must issue their collectives in the same order, and a batch's
    total weight is a collective there), from data that can be iterated
    again or rewound (`Resumable`), not a one-shot iterator whose items read
    ahead would be gone. A context manager; entering it gives the batches.

    `state` is where a `Resumable` loader stands after the last batch taken,
    while batches are read ahead of it (`tracking`); on exit the loader is
    rewound there. Without read-ahead the loader's own state is exact and
    `tracking` is False.

    `take(limit)` gives the next batches of one step size, `group` at most
    (the steps of one compiled call): it looks one batch ahead to see the
    size change, so a `Resumable` loader is then always tracked.

    The pass's first batch is read on construction (`head`: the caller
    builds a program for it there when it has none) and prepared on the
    calling thread on entry: it fixes the pass's step shape (unless `rows`
    already did: a pass resumed in its middle pads as it did before) and
    shows where the batches are. Only host
    batches are read ahead: `jax.Array` batches already on the devices cost
    the host next to nothing to prepare.
    """

    def __init__(
        self,
        pipeline: "BatchPipeline",
        data: Iterable[Any],
        *,
        depth: int,
        where: Callable[[int], str],
        skip: int = 0,
        train: bool = False,
        group: int = 1,
        rows: int | None = None,
    ):
        self._pipeline = pipeline
        self._train = train
        self._where = where
        self._first = rows
        self._loader = data if isinstance(data, Resumable) else None
        rewinds = self._loader is not None
        # Where to rewind to if no batch is taken.
        self.state: Any = (
            self._loader.state_dict() if self._loader is not None else None
        )
        iterator = iter(data)
        self._ahead = (
            depth > 0 and single_process() and (rewinds or iterator is not data)
        )
        self._depth, self._group = depth, group
        # Provisional: the first batch's state is recorded in case the pass
        # turns out to be read ahead (settled once that batch is prepared).
        self.tracking = (self._ahead or group > 1) and rewinds
        self._numbered = (
            (i, batch, self._loader_state())
            for i, batch in enumerate(iterator)
            if i >= skip
        )
        self._head = next(self._numbered, None)
        self._prefetcher: Prefetcher[tuple[DeviceBatch, Any]] | None = None
        self._batches: Iterator[tuple[DeviceBatch, Any]] = iter(())
        self._next: tuple[DeviceBatch, Any] | None = None  # looked ahead at

    @property
    def head(self) -> Any:
        """The pass's first batch, as the user gave it (None for an empty
        pass): read, not yet prepared, so that a program can be built for
        it before any batch is placed."""
        return None if self._head is None else self._head[1]

    def _start(self) -> None:
        """Prepare the first batch (on the calling thread) and start reading
        ahead where that loses nothing."""
        head = self._head
        opening = [] if head is None else [self._prepare(head)]
        # Batches already on the devices cost the host next to nothing.
        ahead = self._ahead and any(
            isinstance(leaf, np.ndarray)
            for placed, _ in opening
            for leaf in placed.leaves
        )
        self.tracking = (ahead or self._group > 1) and self._loader is not None
        numbered = self._numbered
        if ahead:
            self._prefetcher = Prefetcher(numbered, self._prepare, self._depth)
        rest = self._prefetcher or map(self._prepare, numbered)
        self._batches = itertools.chain(opening, rest)

    def __enter__(self) -> Iterator["DeviceBatch"]:
        self._start()
        return self._taken()

    def __exit__(self, *exc: object) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self.tracking and self._loader is not None:
            self._loader.load_state_dict(self.state)

    def _taken(self) -> Iterator["DeviceBatch"]:
        for placed, state in self._batches:
            if self.tracking:
                self.state = state
            yield placed

    def take(self, limit: int) -> list["DeviceBatch"]:
        """The next batches, at most `limit`, all of the first one's step
        size (fewer where the pass ends or the size changes; none once it
        has ended)."""
        group: list[DeviceBatch] = []
        while len(group) < limit:
            item = self._next or next(self._batches, None)
            self._next = None
            if item is None:
                break
            placed, state = item
            if group and placed.size != group[0].size:
                self._next = item  # the first of the next group
                break
            group.append(placed)
            if self.tracking:
                self.state = state
        return group

    def _loader_state(self) -> Any:
        """Where a tracked loader stands (None when not tracking)."""
        if self.tracking and self._loader is not None:
            return self._loader.state_dict()
        return None

    def _prepare(self, item: tuple[int, Any, Any]) -> tuple["DeviceBatch", Any]:
        i, batch, state = item
        placed = self._pipeline.prepare(
            batch, self._where(i), self._first, train=self._train
        )
        self._first = placed.size if self._first is None else self._first
        return placed, state
