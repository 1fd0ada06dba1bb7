"""The environment variables a multi-process run is described by.

JAX itself reads ``JAX_COORDINATOR_ADDRESS``; it has no variables for the
number of processes and the process id, so phalanx uses JAX-style names for
them (set by ``phalanx launch``, or by hand: see the README). Also here:
what a launcher and its processes tell each other besides (the restart a
process belongs to, the exit code of a process that hung).
"""

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
