"""What every process of a run decides alike about a checkpoint folder.

A resume reads the folder's files on each process, and what each finds
decides which collectives it runs next: orbax's `CheckpointManager` syncs
the processes when it opens, a restore reads in step. A process that sees
the folder otherwise (made a moment before by a faster process that found
nothing and went on to train; listed while a file was half-written; one
that fails to read a step the others read) would run other collectives
than the rest, which then pair with the wrong partners: garbage bytes,
then gloo aborts. So process 0's view decides, and is broadcast
(`from_process_zero`); a read that fails on any process fails on all, for
the same reason (`failed_on`). Each is one tiny collective, in a
multi-process run only. What differs by process and must all be saved (a
grain iterator's position in its own shard) is gathered (`every_process`).
"""

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


_WIDTH = 512  # bytes of each process's reason that are compared
# The key of a data state saved by each process (`every_process`).
PER_PROCESS = "per_process"


def from_process_zero(value: Any) -> Any:
    """`value` as process 0 has it, on every process (itself in a
    single-process run): a JSON value (None, bools, numbers, lists)."""
    if jax.process_count() == 1:
        return value
    mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
    # Two broadcasts: the length, then the bytes (shapes must agree).
    size = int(multihost_utils.broadcast_one_to_all(np.int32(mine.size)))
    buffer = mine if jax.process_index() == 0 else np.zeros(size, np.uint8)
    sent = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return json.loads(sent.tobytes().decode())


def every_process(value: Any) -> list[Any]:
    """Every process's `value` (a JSON value), in process order, on every
    process (``[value]`` in a single-process run)."""
    if jax.process_count() == 1:
        return [value]
    mine = json.dumps(value).encode()
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(mine))))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: len(mine)] = np.frombuffer(mine, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(padded))
    return [
        json.loads(bytes(row[:size]).decode())
        for row, size in zip(gathered, sizes.reshape(-1), strict=True)
    ]


def failed_on(why: str | None) -> str | None:
    """Why a read failed (None: it succeeded on every process), the same on
    every process, given why it failed on this one (None: it read it): the
    first failing process's reason, named by process where that is not 0."""
    if jax.process_count() == 1:
        return why
    mine = np.zeros(_WIDTH, np.uint8)
    raw = (why or "").encode()[:_WIDTH]
    mine[: len(raw)] = np.frombuffer(raw, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(mine))
    reasons = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered]
    for rank, reason in enumerate(reasons):
        if reason:
            return reason if rank == 0 else f"on process {rank}: {reason}"
    return None
