"""The background writer of checkpoints: one thread, at the lowest priority.

`WriterThread` runs the writes handed to it one after another, on a thread of
its own, so that training goes on while a save waits for the devices and
hands the arrays to orbax; at most one write waits at a time (each holds a
copy of the state). Orbax then writes from threads of its own (Python
threads and TensorStore's ``ts_pool_worker`` pool). On a host where training
keeps every core busy, a writer at normal priority preempts the XLA threads
of the step in flight, and one stalled XLA thread stalls the whole step:
`lower_priority` puts those threads at nice 19, so that they use the cores
only when training leaves them idle (Linux only: per-thread nice values; a
no-op elsewhere). This module knows nothing of what is written.
"""

import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import final


_TASKS = "/proc/self/task"


def thread_ids() -> set[int]:
    """The ids of this process's threads now (empty where not Linux)."""
    if not sys.platform.startswith("linux"):
        return set()
    try:
        return {int(tid) for tid in os.listdir(_TASKS)}
    except OSError:
        return set()


def lower_priority(threads: set[int]) -> None:
    """Nice 19 for each of `threads` that still runs and is not one of
    XLA's (``tf_*``: the training step's own threads)."""
    for tid in threads:
        try:
            with open(f"{_TASKS}/{tid}/comm") as file:
                if file.read().startswith("tf_"):
                    continue
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except OSError:
            continue  # the thread has ended, or this is not permitted


@final
class WriterThread:
    """One thread running writes in the order they are handed over (started
    at the first); the caller waits for one before handing over the next."""

    def __init__(self, name: str):
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` on the thread (after `wait` for the one before)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, self._name)
        self._pending = self._executor.submit(write)

    @property
    def idle(self) -> bool:
        """Whether the write handed over last has ended (or there is none):
        `wait` then returns at once."""
        return self._pending is None or self._pending.done()

    def wait(self) -> BaseException | None:
        """Wait for the write handed over last; its error, if it failed."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.exception()

    def shutdown(self) -> None:
        """End the thread (once its write is done); a next write starts one."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
