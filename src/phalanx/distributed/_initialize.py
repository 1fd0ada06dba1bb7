"""`initialize`: this process joins a multi-process run (a thin layer over
`jax.distributed.initialize`), described by the arguments, the environment
``phalanx launch`` sets, or the cluster. It must run before JAX computes
anything; a single-process run makes it a no-op. It checks every argument
first and, on processes other than 0, waits for the coordinator to answer,
so a mistake is an exception saying why rather than jaxlib aborting the
process."""

import os
import socket
import sys
import time
from typing import Any

import jax

from .._env import COORDINATOR, NUM_PROCESSES, PROCESS_ID
from .._typing import validates_own_arguments
from .._validate import int_at_least, positive_int


@validates_own_arguments
def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: int = 120,
) -> None:
    """Join this process to a multi-process run (wraps `jax.distributed.initialize`).

    Call it first thing in the program, before JAX computes anything. Where
    the run is described, in this order: the arguments; the environment
    (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``,
    as ``phalanx launch`` sets them); JAX's cluster auto-detection (SLURM,
    Open MPI, TPU pods, ...). A run of one process (nothing described, or
    one process) makes it a no-op, so the same program runs either way. CPU
    collectives go over gloo.

    Args:
        coordinator_address: ``host:port`` of process 0.
        num_processes: how many processes the run has.
        process_id: this process's id, ``0 <= process_id < num_processes``.
        timeout: seconds to wait for every process to join.

    Raises:
        ValueError: a bad argument or environment variable (named).
        RuntimeError: JAX has already computed something in this process,
            or the processes did not all join within `timeout` seconds.
    """
    if jax.distributed.is_initialized():
        return
    coordinator = coordinator_address or os.environ.get(COORDINATOR) or None
    count = _int("num_processes", num_processes, NUM_PROCESSES, minimum=1)
    rank = _int("process_id", process_id, PROCESS_ID, minimum=0)
    positive_int(
        "timeout", timeout, example="120", hint="seconds to wait for every process"
    )
    if count == 1:
        return
    if count is not None and rank is not None and rank >= count:
        raise ValueError(
            f"process_id={rank} must be below num_processes={count} (ids run "
            f"from 0 to {count - 1})"
        )
    described = coordinator is not None or count is not None or rank is not None
    if described and None in (coordinator, count, rank):
        missing = [
            name
            for name, value in (
                (f"coordinator_address (or {COORDINATOR})", coordinator),
                (f"num_processes (or {NUM_PROCESSES})", count),
                (f"process_id (or {PROCESS_ID})", rank),
            )
            if value is None
        ]
        raise ValueError(
            f"a multi-process run needs {', '.join(missing)} as well; pass all "
            "three, or start the program with `phalanx launch`"
        )
    if coordinator is not None and rank != 0:
        # jaxlib aborts the process when it cannot reach the coordinator:
        # check first, so that the error is an exception saying why.
        _wait_for(coordinator, timeout, f"process {rank} of {count}")
    # CPU collectives across processes (a no-op for accelerators).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator, count, rank, initialization_timeout=timeout
        )
        if jax.process_count() > 1:
            _exit_at_once_on_errors()
    except ValueError as error:
        if not described and "coordinator_address" in str(error):
            return  # no cluster detected: a single-process run
        raise
    except RuntimeError as error:  # jaxlib's XlaRuntimeError included
        if "must be called before" in str(error):
            raise RuntimeError(
                "phalanx.distributed.initialize() must run before JAX computes "
                "anything (or lists devices): JAX sets up its devices once, for "
                "one process or for all. Call it first thing in the program."
            ) from None
        raise RuntimeError(
            f"process {rank} of {count} could not join the run at {coordinator} "
            f"within {timeout} s ({error}); check that every process was started "
            "with the same coordinator address and that process 0 is running"
        ) from error


def _exit_at_once_on_errors() -> None:
    """Make an uncaught exception end this process as soon as it is printed.

    At exit, JAX waits (up to 5 minutes) for every other process to exit
    too; those wait in a collective for this one, so one process failing
    held the whole run until that timeout. Leaving at once (`os._exit`,
    after the traceback and flushing the output) ends the others' collective
    (or lets the launcher or the cluster stop them): the run ends promptly
    with this process's error.
    """
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        interrupted = issubclass(kind, KeyboardInterrupt)
        os._exit(getattr(value, "exit_code", 130) if interrupted else 1)

    sys.excepthook = excepthook


def _wait_for(address: str, timeout: int, who: str) -> None:
    """Wait until something listens at ``host:port`` `address`."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"coordinator_address={address!r} must be host:port, e.g. 10.0.0.1:1234"
        )
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{who} could not reach the coordinator at {address} within "
                    f"{timeout} s ({error.strerror or error}); start process 0 "
                    "(it hosts the coordinator) and check the address and port"
                ) from None
            time.sleep(0.2)


def _int(name: str, value: int | None, variable: str, *, minimum: int) -> int | None:
    """An argument, else its environment variable, checked."""
    source = name
    if value is None and os.environ.get(variable):
        source, text = variable, os.environ[variable]
        try:
            value = int(text)
        except ValueError:
            raise ValueError(
                f"environment variable {variable}={text!r} must be an integer"
            ) from None
    return None if value is None else int_at_least(source, value, minimum)
