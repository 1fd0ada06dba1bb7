"""``phalanx launch``: N local processes of one program on JAX's multi-process
runtime, as a cluster scheduler would start them.

Each process gets the coordinator (127.0.0.1 and a free port), the number of
processes and its own id in the environment that `phalanx.distributed.
initialize` reads, and optionally M fake CPU devices. Every output line is
prefixed with the rank. SIGINT/SIGTERM are forwarded to every process; when
one process fails, the others are stopped and the launcher exits non-zero
within a bounded time instead of waiting on a collective that never ends.
"""

import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from .distributed._env import COORDINATOR, LAUNCH_STAMP, NUM_PROCESSES, PROCESS_ID


# After a process fails (or a signal arrives), the others get SIGTERM, then
# SIGKILL this many seconds later.
GRACE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    nproc: int
    command: tuple[str, ...]
    devices_per_process: int | None = None
    port: int | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(
    args: LaunchArgs, rank: int, port: int, stamp: str
) -> dict[str, str]:
    """The environment of process `rank`."""
    env = dict(os.environ)
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
        # NOTES-jax-cpu trap 1: XLA:CPU collectives need 2 threads per device.
        env.setdefault("NPROC", str(2 * m))
    return env


class _Ranks:
    """The running processes and the threads that copy their output."""

    def __init__(self, args: LaunchArgs, port: int):
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.processes: list[subprocess.Popen[str]] = []
        self.copiers: list[threading.Thread] = []
        self._lock = threading.Lock()
        for rank in range(args.nproc):
            process = subprocess.Popen(
                args.command,
                env=rank_environment(args, rank, port, stamp),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,  # signals reach it only through us
            )
            self.processes.append(process)
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

    def _copy(self, rank: int, stream: IO[str], out: IO[str]) -> None:
        with stream:
            for line in stream:
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
        """(rank, exit code) of the first process found to have failed."""
        for rank, process in enumerate(self.processes):
            code = process.poll()
            if code not in (None, 0):
                return rank, code
        return None

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
        for copier in self.copiers:
            copier.join(5)


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def run_launch(args: LaunchArgs, *, grace: float = GRACE_SECONDS) -> int:
    """Run `args.command` in `args.nproc` processes; their combined exit code.

    Returns:
        0 when every process exits 0; otherwise the first failing process's
        code (128 + signal number for a process killed by a signal).
    """
    port = args.port or free_port()
    received: list[int] = []
    started: list[_Ranks] = []

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
    try:
        ranks = _Ranks(args, port)
        started.append(ranks)
        if received:
            ranks.signal(received[-1])
        failure = None
        while failure is None and ranks.running():
            failure = ranks.first_failure()
            if failure is not None:
                ranks.stop(grace)
            elif len(received) > 1:
                ranks.stop(0.0)  # a second signal: stop now
            time.sleep(0.05)
        ranks.join_output()
        failure = failure or ranks.first_failure()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failure is not None and not received:  # after a signal, exits are expected
        rank, code = failure
        print(
            f"phalanx launch: rank {rank} {describe_exit(code)}; the other "
            "processes were stopped",
            file=sys.stderr,
            flush=True,
        )
    if failure is None:
        return 0
    code = failure[1]
    return 128 - code if code < 0 else code
