"""Run a library's background threads at the lowest CPU priority.

Orbax writes a checkpoint from its own threads (Python threads and
TensorStore's ``ts_pool_worker`` pool) while training goes on. On a host
where training keeps every core busy, a writer at normal priority preempts
the XLA threads of the step in flight, and one stalled XLA thread stalls the
whole step. At the lowest priority (nice 19) the writer uses the cores only
when training leaves them idle. Linux only (per-thread nice values); a no-op
elsewhere.
"""

import os
import sys


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
