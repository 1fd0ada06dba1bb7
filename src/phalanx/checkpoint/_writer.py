"""The background writer of checkpoints: one thread, at the lowest priority.

`WriterThread` runs the writes handed to it one after another, on a thread of
its own, so that training goes on while a save waits for the devices and
hands the arrays to orbax; the caller bounds how many wait at a time (each
holds a copy of the state). Orbax then writes from threads of its own (Python
threads and TensorStore's ``ts_pool_worker`` pool). On a host where training
keeps every core busy, a writer at normal priority preempts the XLA threads
of the step in flight, and one stalled XLA thread stalls the whole step:
`lower_priority` puts those threads at nice 19, so that they use the cores
only when training leaves them idle (Linux only: per-thread nice values; a
no-op elsewhere). This module knows nothing of what is written.
"""

import os
import sys
from collections import deque
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
    at the first); the caller bounds how many are pending (`wait`)."""

    def __init__(self, name: str):
        self._name = name
        self._executor: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()  # oldest first

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write` on the thread, after those handed over before."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, self._name)
        self._pending.append(self._executor.submit(write))

    def failed(self) -> BaseException | None:
        """Without waiting: the error of the first write that has ended in
        one (those that have ended are forgotten, up to it)."""
        pending = self._pending
        while pending and pending[0].done():
            error = pending.popleft().exception()
            if error is not None:
                return error
        return None

    def wait(self, pending: int = 0) -> BaseException | None:
        """Wait until at most `pending` writes are left (the newest); the
        error of the first of those waited for that failed, if any."""
        first = None
        while len(self._pending) > pending:
            error = self._pending.popleft().exception()
            first = first or error
        return first

    def shutdown(self) -> None:
        """End the thread (once its writes are done); a next write starts one."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
