"""The hang watchdog: a background thread that notices when a fit stops
making progress, writes what every thread was doing, and ends the process.

A fit's progress is already recorded on its thread at no extra cost: the
phase clock notes the time of every phase change (several a step: data,
step, host, callbacks, checkpoint...), and an evaluation notes each batch
(`beat`). The watchdog only reads those times, every fraction of its
deadline; it takes no lock and adds no call to the loop. When the silence
outlasts the deadline (a step or collective that never returns, a callback
or checkpoint write that blocks) it writes ``hang-rank{r}.txt`` (the step,
the phase, the seconds of silence and every thread's Python stack, by
`faulthandler`) and exits the process with `HANG_EXIT_CODE`. The other
processes of the run see that dump appear in the folder (a shared one, as
checkpoints need) and write their own at once, naming their own phase;
each waits a few seconds for every process's dump before it exits, since a
process that exits ends the others (JAX's coordination service aborts them)
before they could write theirs.

A compile reports nothing until it ends, so a silence while the fit's
thread is tracing, lowering or compiling (its stack is in JAX's compiler)
is not counted.
"""

import collections
import datetime
import faulthandler
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Literal, TypeAlias

from .._env import (
    HANG_EXIT_CODE,
    MIN_HANG_TIMEOUT,
    hang_timeout_from_env,
)
from ._clock import PhaseClock


# (int: seconds as a user writes them, e.g. hang_timeout=600.)
HangTimeout: TypeAlias = float | int | Literal["auto"] | None
# "auto": at least this many seconds of silence...
AUTO_FLOOR_SECONDS = 300.0
# ...and at least this many times the median step times `sync_every`: the
# host may wait at a sync point for `sync_every` steps of device time, a
# normal silence.
AUTO_FACTOR = 3.0
# A process that dumped waits this long at most for the others' dumps.
PEER_WAIT_SECONDS = 10.0
# The folder of the dumps of a fit with no Checkpoint callback.
DEFAULT_FOLDER = "phalanx-hang"
# Where in JAX a thread traces, lowers or compiles (a silence, not a hang).
_COMPILING = (
    "/jax/_src/compiler.py",
    "/jax/_src/interpreters/partial_eval.py",
    "/jax/_src/interpreters/mlir.py",
)


class _Beat:
    """The time (`perf_counter`) of the last progress noted outside the
    phase clock (an evaluation's batches)."""

    at = 0.0


_BEAT = _Beat()


def beat() -> None:
    """Note progress now (one attribute write: cheap enough for a loop)."""
    _BEAT.at = time.perf_counter()


def interactive() -> bool:
    """Whether Python runs interactively (a notebook, IPython, ``python -i``),
    where ``hang_timeout="auto"`` is off: ending the process would end the
    user's session."""
    if hasattr(sys, "ps1") or sys.flags.interactive:
        return True
    ipython = sys.modules.get("IPython")  # a notebook's kernel, or its shell
    return ipython is not None and ipython.get_ipython() is not None


def resolve_auto(timeout: HangTimeout) -> HangTimeout:
    """`timeout`, where it is ``"auto"`` the environment's choice if made
    (``PHALANX_HANG_TIMEOUT``: seconds or ``off``, as ``phalanx launch
    --hang-timeout`` sets it), and off in an interactive session.

    Raises:
        ValueError: ``PHALANX_HANG_TIMEOUT`` is neither.
    """
    if timeout != "auto":
        return timeout
    given = hang_timeout_from_env()
    if given is not None:
        return None if given == "off" else given
    return None if interactive() else "auto"


def _compiling(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(_COMPILING):
            return True
        frame = frame.f_back
    return False


class HangWatchdog:
    """Ends the process when the fit on the thread that made it makes no
    progress for longer than its deadline (see the module).

    Use as a context manager around the fit's loop; the thread stops (and
    is joined) when the block ends.
    """

    def __init__(
        self,
        clock: PhaseClock,
        step: Callable[[], int],
        *,
        timeout: float | Literal["auto"],
        sync_every: int,
        folder: Path,
        rank: int,
        processes: int,
    ):
        """Args:
        clock: the fit's phase clock (its phase and the time it changed).
        step: the run's current step (read from the watchdog's thread).
        timeout: the deadline in seconds, or ``"auto"`` (the larger of
            `AUTO_FLOOR_SECONDS` and `AUTO_FACTOR` × `sync_every` × the
            median step time seen so far).
        sync_every: the trainer's ``sync_every``.
        folder: where ``hang-rank{rank}.txt`` is written.
        rank, processes: this process's index and the number of processes.
        """
        self._clock = clock
        self._step = step
        self._timeout = timeout
        self._sync_every = sync_every
        self.path = folder / f"hang-rank{rank}.txt"
        self._rank, self._processes = rank, processes
        self._thread = threading.get_ident()  # the fit's
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._seconds_per_step: collections.deque[float] = collections.deque(maxlen=101)
        # When the loop was last seen compiling (progress of a kind).
        self._compiled_at = 0.0
        self._seen: dict[str, int] = {}

    def deadline(self) -> float:
        """The seconds of silence that count as a hang now."""
        timeout = self._timeout
        if timeout != "auto":
            return float(timeout)
        per_step = self._seconds_per_step
        median = statistics.median(per_step) if per_step else 0.0
        return max(AUTO_FLOOR_SECONDS, AUTO_FACTOR * self._sync_every * median)

    def __enter__(self) -> "HangWatchdog":
        beat()
        self._watcher = threading.Thread(
            target=self._watch, name="phalanx-hang-watchdog", daemon=True
        )
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def _watch(self) -> None:
        last_step, stepped_at = self._step(), time.perf_counter()
        # The dumps already there (an earlier run's) are not this run's news.
        self._seen = self._dumps()
        while True:
            deadline = self.deadline()
            # Checked a few times a deadline: the exit comes at most a tenth
            # (and 1 s) late.
            if self._stop.wait(min(1.0, deadline / 10)):
                return
            now = time.perf_counter()
            step = self._step()
            if step > last_step:  # the run's pace, for "auto"
                self._seconds_per_step.append((now - stepped_at) / (step - last_step))
            if step != last_step:
                last_step, stepped_at = step, now
            if _compiling(sys._current_frames().get(self._thread)):
                self._compiled_at = now
            clock = self._clock
            since = max(clock.since, _BEAT.at, self._compiled_at, stepped_at)
            silent = now - since
            peers = self._fresh() if self._processes > 1 else []
            if (silent > deadline or peers) and not self._stop.is_set():
                if peers:
                    cause = f"{peers[0]} was written: another process hung"
                else:
                    cause = f"no progress for {silent:.3g} s"
                self._dump(step, clock.phase, clock.owner, silent, deadline, cause)
                self._await_peers()
                if peers:  # the hung process exits first: a launcher names it
                    time.sleep(1.0)
                os._exit(HANG_EXIT_CODE)
                return  # (where os._exit is replaced: the tests')

    def _dumps(self) -> dict[str, int]:
        """The dumps in the folder (by name) and when each was written."""
        try:
            found = self.path.parent.glob("hang-rank*.txt")
            return {path.name: path.stat().st_mtime_ns for path in found}
        except OSError:
            return {}

    def _fresh(self) -> list[str]:
        """The other processes' dumps written since this fit started."""
        seen = self._seen
        return sorted(
            name
            for name, written in self._dumps().items()
            if name != self.path.name and seen.get(name) != written
        )

    def _await_peers(self) -> None:
        """Wait (a few seconds at most) until every process has written its
        dump: a process that ends ends the others' too (JAX's coordination
        service stops them), before their own dump."""
        others = self._processes - 1
        give_up = time.monotonic() + PEER_WAIT_SECONDS
        while len(self._fresh()) < others and time.monotonic() < give_up:
            time.sleep(0.1)

    def _dump(
        self,
        step: int,
        phase: str,
        owner: str | None,
        silent: float,
        deadline: float,
        cause: str,
    ) -> None:
        """Write the dump and say where it is on stderr."""
        where = phase if owner is None else f"{phase} ({owner})"
        per_step = self._seconds_per_step
        median = f"{statistics.median(per_step):.4g} s" if per_step else "unknown"
        asked = "auto" if self._timeout == "auto" else f"{self._timeout:g}"
        lines = [
            f"phalanx hang watchdog: {cause}; the process ends "
            f"(exit code {HANG_EXIT_CODE})",
            f"rank: {self._rank} of {self._processes}",
            f"host: {socket.gethostname()}  pid: {os.getpid()}",
            f"time: {datetime.datetime.now(datetime.UTC).isoformat()}",
            f"step: {step}",
            f"phase: {where}",
            f"seconds since last progress: {silent:.1f}",
            f"deadline: {deadline:.1f} s (hang_timeout={asked})",
            f"median step: {median}",
            f"fit thread: 0x{self._thread:016x} (its stack is below)",
            "",
        ]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as file:
                file.write("\n".join(lines) + "\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            written = f"; stacks in {self.path}"
        except OSError as error:  # a full or read-only disk: stderr only
            written = f"; could not write {self.path} ({error.strerror})"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stderr.write(
            f"phalanx: {cause}, at step {step} in phase {where} (hang_timeout="
            f"{asked}, deadline {deadline:.3g} s){written}; exiting with code "
            f"{HANG_EXIT_CODE}\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()


def check_hang_timeout(value: object) -> None:
    """Raise TypeError/ValueError unless `value` is a ``hang_timeout``."""
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"hang_timeout={value!r}: pass the seconds without progress after "
            "which every process dumps its stacks and exits (e.g. "
            "hang_timeout=600), 'auto', or None to turn the watchdog off"
        )
    if not (math.isfinite(value) and value >= MIN_HANG_TIMEOUT):
        raise ValueError(
            f"hang_timeout={value!r}: pass a number of seconds, at least "
            f"{MIN_HANG_TIMEOUT:g} (e.g. hang_timeout=600), 'auto', or None to "
            "turn the watchdog off"
        )
