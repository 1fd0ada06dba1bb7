"""The environment variables a multi-process run is described by.

JAX itself reads ``JAX_COORDINATOR_ADDRESS``; it has no variables for the
number of processes and the process id, so phalanx uses JAX-style names for
them (set by ``phalanx launch``, or by hand: see the README). Also here:
what a launcher and its processes tell each other besides (the restart a
process belongs to, the exit code of a process that hung, the hang
watchdog's deadline, read and checked without JAX).
"""

import math
import os
from typing import Literal


COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
# The launch's start time (YYYYmmdd-HHMMSS), the same in every process: names
# a run folder every process agrees on.
LAUNCH_STAMP = "PHALANX_LAUNCH_STAMP"
# How many times ``phalanx launch --max-restarts`` has restarted the run
# ("0" in the first processes).
RESTART_COUNT = "PHALANX_RESTART_COUNT"
# The exit code of a process its hang watchdog ended (EX_TEMPFAIL in
# sysexits.h: a temporary failure, worth a retry).
HANG_EXIT_CODE = 75
# The hang watchdog's deadline for a trainer left at hang_timeout="auto":
# seconds, or "off" (``phalanx launch --hang-timeout``).
HANG_TIMEOUT = "PHALANX_HANG_TIMEOUT"
# Its shortest deadline, in seconds: below it a healthy run's first
# callbacks or checkpoint write outlast the deadline and end it at step 0.
MIN_HANG_TIMEOUT = 1.0


def hang_timeout_from_env() -> float | Literal["off"] | None:
    """``PHALANX_HANG_TIMEOUT`` read: seconds, ``"off"``, or None (unset).

    Raises:
        ValueError: it is set to neither seconds (at least
            `MIN_HANG_TIMEOUT`) nor ``off``.
    """
    given = os.environ.get(HANG_TIMEOUT, "").strip()
    if not given:
        return None
    if given.lower() == "off":
        return "off"
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= MIN_HANG_TIMEOUT):
        raise ValueError(
            f"{HANG_TIMEOUT}={given!r}: set it to a number of seconds, at least "
            f"{MIN_HANG_TIMEOUT:g} (e.g. 600), or off, or unset it"
        )
    return seconds
