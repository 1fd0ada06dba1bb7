"""``phalanx launch``: N local processes of one program on JAX's multi-process
runtime, as a cluster scheduler would start them.

Each process gets the coordinator (127.0.0.1 and a free port), the number of
processes and its own id in the environment that `phalanx.distributed.
initialize` reads, and optionally M fake CPU devices. Every output line is
prefixed with the rank. SIGINT/SIGTERM are forwarded to every process; when
one process fails, the others are stopped and the launcher exits non-zero
within a bounded time instead of waiting on a collective that never ends.
On Linux the processes also die with the launcher: killed with SIGKILL, or
crashed, it cannot stop them itself, and ranks left behind would hold their
devices and ports.

With ``--max-restarts N``, a failed run (a rank that exited non-zero, was
killed, or was ended by its hang watchdog) is started again, every rank of
it, up to N times: the program is expected to resume from its latest
checkpoint (``fit(resume="latest")``). Each start gets a fresh coordinator
port, the same run-folder stamp, ``PHALANX_RESTART_COUNT`` (0, 1, ...) and
JAX's persistent compile cache (a folder the launcher makes and removes,
unless ``JAX_COMPILATION_CACHE_DIR`` is set), so a restart reads its
programs instead of compiling them again.
"""

import datetime
import os
import shutil
import signal
import sys
import tempfile
import time

from .._env import HANG_EXIT_CODE, HANG_TIMEOUT, RESTART_COUNT
from ._ranks import SETTLE, LaunchArgs, LaunchError, Ranks, free_port


# After a process fails (or a signal arrives), the others get SIGTERM, then
# SIGKILL this many seconds later.
GRACE_SECONDS = 10.0
# The same when the run will be restarted: a process left after another died
# is blocked in a collective with it (or would be, saving a checkpoint on
# SIGTERM), so waiting longer only delays the restart.
RESTART_GRACE_SECONDS = 2.0


def check_command(command: tuple[str, ...]) -> None:
    """Raise LaunchError unless `command` names a program that can run."""
    program = command[0]
    found = shutil.which(program)
    if found is None:
        where = (
            "no such file"
            if os.sep in program
            else "not found on PATH; give its path, or install it"
        )
        if os.sep in program and os.path.exists(program):
            where = "not executable (chmod +x it, or run it with its interpreter)"
        raise LaunchError(f"command {program!r}: {where}")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    if code == HANG_EXIT_CODE:
        return f"was ended by its hang watchdog (exit code {code})"
    return f"exited with code {code}"


def run_launch(args: LaunchArgs, *, grace: float = GRACE_SECONDS) -> int:
    """Run `args.command` in `args.nproc` processes (again, every one, after
    a failure, up to `args.max_restarts` times); their combined exit code.

    Returns:
        0 when every process of the last start exits 0; otherwise the first
        failing process's code (128 + signal number for a process killed by
        a signal).
    """
    check_command(args.command)
    # One stamp for every start: a run folder named by it is resumed.
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    received: list[int] = []
    started: list[Ranks] = []

    def forward(signum: int, frame: object) -> None:
        del frame
        received.append(signum)
        for ranks in started:
            ranks.signal(signum)

    # Installed first: a signal while the processes start is not lost (they
    # run in their own sessions, so it would not reach them otherwise).
    previous = {
        signum: signal.signal(signum, forward)
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    extra, cache = _restart_environment(args)
    failure, restarts = None, 0
    try:
        while True:
            extra[RESTART_COUNT] = str(restarts)
            began = time.monotonic()
            # (A restart forks after the start before's threads have ended:
            # `_supervise` joined them, as die_with_parent needs.)
            ranks = Ranks(args, args.port or free_port(), stamp, extra)
            started[:] = [ranks]
            last = restarts == args.max_restarts
            wait = grace if last else min(grace, RESTART_GRACE_SECONDS)
            failure, stopping = _supervise(ranks, received, wait)
            if failure is None or received or last:
                break
            restarts += 1
            rank, code = failure
            print(
                f"phalanx launch: rank {rank} {describe_exit(code)} "
                f"{stopping - began:.1f} s after the start; every process "
                f"stopped in {time.monotonic() - stopping:.1f} s; restart "
                f"{restarts}/{args.max_restarts} of all {args.nproc} processes",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    if failure is not None and not received:  # after a signal, exits are expected
        rank, code = failure
        tried = f" (after {restarts} restarts)" if args.max_restarts else ""
        print(
            f"phalanx launch: rank {rank} {describe_exit(code)}; the other "
            f"processes were stopped{tried}",
            file=sys.stderr,
            flush=True,
        )
    if failure is None:
        return 0
    code = failure[1]
    return 128 - code if code < 0 else code


def _supervise(
    ranks: Ranks, received: list[int], grace: float
) -> tuple[tuple[int, int] | None, float]:
    """Wait for `ranks` to end, stopping the rest when one fails (or a
    signal in `received` asks); the first failure, as (rank, exit code),
    and when it was seen (`time.monotonic`)."""
    if received:
        ranks.signal(received[-1])
    failure, seen = None, time.monotonic()
    while failure is None and ranks.running():
        failure = ranks.first_failure()
        if failure is not None:
            # The exits that come with it, before any signal of ours: a
            # rank killed by SIGKILL is the one to blame (`first_failure`).
            time.sleep(SETTLE)
            seen = time.monotonic()
            ranks.stop(grace)
            # A hung rank's watchdog exit may come after: it is to blame (a
            # stop sends no exit code of the watchdog's).
            failure = ranks.first_failure()
        elif len(received) > 1:
            ranks.stop(0.0)  # a second signal: stop now
        time.sleep(0.05)
    ranks.join_output()
    if failure is None:
        failure, seen = ranks.first_failure(), time.monotonic()
    return failure, seen


def _restart_environment(args: LaunchArgs) -> tuple[dict[str, str], str | None]:
    """The launch's own variables for every process (the hang watchdog's
    deadline, if given), and the compile cache folder it made (None: none).
    A run that may restart keeps JAX's
    persistent compile cache in a folder of its own unless the user chose
    one (``JAX_COMPILATION_CACHE_DIR``), every program in it however quick
    its compile (JAX's default keeps only those of 1 s or more)."""
    extra: dict[str, str] = {}
    if args.hang_timeout is not None:
        extra[HANG_TIMEOUT] = args.hang_timeout
    if not args.max_restarts or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return extra, None
    cache = tempfile.mkdtemp(prefix="phalanx-launch-cache-")
    extra["JAX_COMPILATION_CACHE_DIR"] = cache
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        extra["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    print(
        f"phalanx launch: JAX's compile cache for the restarts is in {cache} "
        "(removed at the end; set JAX_COMPILATION_CACHE_DIR to keep one)",
        file=sys.stderr,
        flush=True,
    )
    return extra, cache
