"""The processes of one ``phalanx launch`` start: what the launch is asked
(`LaunchArgs`), each rank's environment, and `Ranks`, which starts the
processes (dying with the launcher on Linux), copies their output line by
line with the rank in front, and stops them."""

import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

from .._env import (
    COORDINATOR,
    HANG_EXIT_CODE,
    LAUNCH_STAMP,
    NUM_PROCESSES,
    PROCESS_ID,
)
from ._gloo_notes import GlooNotes


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    nproc: int
    command: tuple[str, ...]
    devices_per_process: int | None = None
    port: int | None = None
    # Keep gloo's connection notes in the output.
    verbose: bool = False
    # Start every process again this many times at most after a failure.
    max_restarts: int = 0
    # PHALANX_HANG_TIMEOUT for every process: seconds, "off", or None (unset).
    hang_timeout: str | None = None


class LaunchError(Exception):
    """A command `launch` cannot start: reported in one line, exit code 2."""


# prctl(2) option: the signal a process gets when its parent thread exits.
_PR_SET_PDEATHSIG = 1
# Seconds a failure's peers may take to fail after it (`first_failure`).
SETTLE = 0.2
# Seconds a hung rank's watchdog exit may be seen after a peer's failure
# (`first_failure`): the peers that saw its dump exit 1 s after it, but the
# coordination service it hosted may abort them at once, and a large
# process takes a while to end.
HANG_SETTLE = 2.0


def die_with_parent() -> Callable[[], None] | None:
    """A function for `subprocess.Popen`'s `preexec_fn` that makes the child
    receive SIGKILL when this process dies; None off Linux (no prctl).

    The kernel sends the signal when the *thread* that forked the child
    exits, so the processes must be started from the thread that lives as
    long as the launcher (the main one), and before any other thread starts
    (preexec_fn runs Python between fork and exec). A launcher that died
    before the child's prctl took effect would go unnoticed: the child then
    finds another parent and kills itself.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before fork
    parent = os.getpid()

    def set_death_signal() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(
    args: LaunchArgs, rank: int, port: int, stamp: str, extra: dict[str, str]
) -> dict[str, str]:
    """The environment of process `rank` (`extra`: the launch's own
    variables, e.g. the restart count)."""
    env = dict(os.environ) | extra
    env[COORDINATOR] = f"127.0.0.1:{port}"
    env[NUM_PROCESSES] = str(args.nproc)
    env[PROCESS_ID] = str(rank)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the launcher as printed
    env[LAUNCH_STAMP] = stamp
    if args.devices_per_process is not None:
        m = args.devices_per_process
        # Only the CPU platform: on a host with accelerators JAX uses those.
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={m}"
        # XLA:CPU's cross-device all-reduce needs a thread pool of 2 threads per
        # device, or it can starve and abort ("JAX on CPU", docs/architecture.md).
        env.setdefault("NPROC", str(2 * m))
    return env


class Ranks:
    """The running processes and the threads that copy their output."""

    def __init__(self, args: LaunchArgs, port: int, stamp: str, extra: dict[str, str]):
        self.verbose = args.verbose
        self.processes: list[subprocess.Popen[str]] = []
        self.copiers: list[threading.Thread] = []
        self.waiters: list[threading.Thread] = []
        # (rank, code, when its waiter saw it: time.monotonic) in exit order
        self.exits: list[tuple[int, int, float]] = []
        self._lock = threading.Lock()
        # Every process first, then the threads: die_with_parent's preexec_fn
        # is only safe while this process has no other thread.
        preexec = die_with_parent()
        for rank in range(args.nproc):
            try:
                process = subprocess.Popen(
                    args.command,
                    env=rank_environment(args, rank, port, stamp, extra),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    errors="replace",
                    start_new_session=True,  # signals reach it only through us
                    preexec_fn=preexec,
                )
            except OSError as error:
                self.stop(0.0)
                raise LaunchError(
                    f"command {args.command[0]!r} cannot be started "
                    f"({error.strerror or error})"
                ) from None
            self.processes.append(process)
        for rank, process in enumerate(self.processes):
            for stream, out in (
                (process.stdout, sys.stdout),
                (process.stderr, sys.stderr),
            ):
                assert stream is not None
                copier = threading.Thread(
                    target=self._copy, args=(rank, stream, out), daemon=True
                )
                copier.start()
                self.copiers.append(copier)
            # A waiter per process records the order of exits: when one rank
            # dies, its peers fail soon after on the broken connection, and
            # a poll every 50 ms could find both gone and blame the wrong one.
            waiter = threading.Thread(
                target=self._wait, args=(rank, process), daemon=True
            )
            waiter.start()
            self.waiters.append(waiter)

    def _wait(self, rank: int, process: subprocess.Popen[str]) -> None:
        code = process.wait()
        with self._lock:
            self.exits.append((rank, code, time.monotonic()))

    def _copy(self, rank: int, stream: IO[str], out: IO[str]) -> None:
        gloo = GlooNotes()
        with stream:
            for line in stream:
                kept = line if self.verbose else gloo(line)
                if kept is None:
                    continue
                line = kept
                with self._lock:
                    out.write(f"[{rank}] {line}")
                    out.flush()

    def signal(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:
                    pass

    def first_failure(self) -> tuple[int, int] | None:
        """(rank, exit code) of the process to blame: the first to fail,
        unless one that failed soon after it was a cause of its own: killed
        by SIGKILL within `SETTLE` s (nothing in a run sends it: the OOM
        killer does, or a user's ``kill -9``), or ended by its hang
        watchdog within `HANG_SETTLE` s. A rank's peers fail soon after it
        on the broken connection (an error, or JAX's coordination service's
        SIGABRT the moment a watchdog's exit closes the service), and the
        waiters' threads may see a peer's exit first."""
        with self._lock:
            failed = [(r, c, when) for r, c, when in self.exits if c != 0]
        if not failed:
            return None
        first = failed[0][2]
        windows = {-signal.SIGKILL: SETTLE, HANG_EXIT_CODE: HANG_SETTLE}
        own = [
            (r, c)
            for r, c, when in failed
            if c in windows and when - first <= windows[c]
        ]
        return own[0] if own else failed[0][:2]

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def stop(self, grace: float) -> None:
        """SIGTERM every live process; SIGKILL those left after `grace` s."""
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        for process in self.processes:
            process.wait()

    def join_output(self) -> None:
        for waiter in self.waiters:
            waiter.join()  # every process has exited: these end at once
        for copier in self.copiers:
            copier.join(5)
