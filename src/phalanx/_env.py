"""The environment variables a multi-process run is described by.

JAX itself reads ``JAX_COORDINATOR_ADDRESS``; it has no variables for the
number of processes and the process id, so phalanx uses JAX-style names for
them (set by ``phalanx launch``, or by hand: see the README).
"""

COORDINATOR = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAX_NUM_PROCESSES"
PROCESS_ID = "JAX_PROCESS_ID"
# The launch's start time (YYYYmmdd-HHMMSS), the same in every process: names
# a run folder every process agrees on.
LAUNCH_STAMP = "PHALANX_LAUNCH_STAMP"
