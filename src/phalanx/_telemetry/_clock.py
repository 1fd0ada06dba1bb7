"""The phase clock of a fit: where its wall time goes, phase by phase.

The loop and the callback dispatcher say which phase the thread running
`fit` is in (`PhaseClock.switch`, `enter`, `leave`); every moment between
the clock's start and stop is charged to exactly one phase, so the phases
sum to the wall time by construction. Two things are moved in from
outside: the time JAX spends compiling (tracing, lowering, XLA's compile or
a persistent-cache read), from the phase it happened in to ``"compile"``,
by one process-wide listener of JAX's compile events; and Python's garbage
collections on that thread, to ``"gc"``, by one `gc.callbacks` entry. The
clock reads no device value and waits for nothing: ``"step"`` is the time
the host spends dispatching compiled calls and waiting at the loop's own
sync points, the device's time as the host sees it.

Time charged to a phase while a callback runs is also charged to that
callback, by the name the dispatcher gives it (`PhaseClock.by_callback`):
the per-callback seconds of a phase sum to that phase's callback time, a
compile or a collection inside a hook moving out of both alike.
"""

import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import Iterator
from typing import Literal, TypeAlias

import jax


TimePhase: TypeAlias = Literal[
    "compile", "data", "step", "host", "checkpoint", "eval", "callbacks", "gc", "other"
]
# Every phase, in the order tables show them.
PHASES: tuple[TimePhase, ...] = (
    "step",
    "compile",
    "data",
    "host",
    "eval",
    "checkpoint",
    "callbacks",
    "gc",
    "other",
)
PHASE_MEANINGS: dict[str, str] = {
    "step": "dispatching compiled steps and waiting for the device (sync points, "
    "a step's metrics read)",
    "compile": "tracing, lowering and compiling (or reading the compile cache)",
    "data": "waiting for the next batch (loading, checking, placing)",
    "host": "the loop's own work between calls",
    "eval": "evaluations in fit",
    "checkpoint": "the blocking part of checkpoint saves",
    "callbacks": "callbacks' hooks",
    "gc": "Python's garbage collector",
    "other": "the rest (starting and ending the fit)",
}
# JAX's compile events (jax/_src/dispatch.py): a top-level trace, its
# lowering to MLIR, and XLA's compile, which wraps a persistent-cache read.
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_BACKEND = "/jax/core/compile/backend_compile_duration"
_EVENTS = frozenset((_TRACE, _LOWER, _BACKEND))
# Trace segments kept at most (~100 bytes each): a trace of a long run keeps
# its beginning and counts the rest.
TRACE_CAP = 200_000


@dataclasses.dataclass
class Compile:
    """One executable JAX built (or read from its cache) during a fit.

    Attributes:
        name: what the loop was doing, e.g. ``"train step, batch
            f32[64,784] i32[64]"``; else ``"<callback>: <function>"`` for
            one in a callback's hook, or ``"<phase>: <function>"``.
        function: the name JAX gives the compiled function.
        phase: the phase it happened in.
        seconds: its tracing, lowering and compiling, in seconds.
        at: when it ended, in seconds from the clock's start.
    """

    name: str
    function: str
    phase: str
    seconds: float
    at: float


class PhaseClock:
    """Where one fit's wall time goes, by exclusive phase (see the module).

    Attributes:
        start: `time.perf_counter()` when the clock was made.
        phase: the phase charged now.
        compiles: every compile on the fit's thread while the clock ran.
        compile_count: ``len(compiles)`` (read by the loop after each call).
        segments: where tracing is on (`record`), each phase's stretches as
            ``(phase, start, end)`` in `perf_counter` seconds; else None.
        dropped: segments left out of `segments` past its cap.
        owner: the callback whose hook runs now (its name), or None.
        by_callback: the seconds charged to each callback's hooks so far,
            by name (see `callback_totals` for the open stretch too).
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.spent: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.phase: str = "other"
        self.since = self.start
        self.stopped: float | None = None
        self.compiles: list[Compile] = []
        self.compile_count = 0
        self.segments: list[tuple[str, float, float]] | None = None
        self.dropped = 0
        self.owner: str | None = None
        self.by_callback: dict[str, float] = {}
        self._segment = self.start  # where the current phase's stretch began
        self._stack: list[tuple[str, str | None]] = []
        self._thread: int | None = None
        self._pending = 0.0  # compile time of a compile not yet finished
        self._spans: list[tuple[float, float]] = []  # recent compile spans

    # ------------------------------------------------------------ charging

    def switch(self, phase: str, owner: str | None = None) -> float:
        """Charge the time since the last change to the current phase (and
        callback, if one runs) and go on in `phase`, in the hook of the
        callback named `owner` (None: none); the time now (`perf_counter`)."""
        now = time.perf_counter()
        old, spent = self.phase, now - self.since
        self.spent[old] += spent
        if self.owner is not None:
            by = self.by_callback
            by[self.owner] = by.get(self.owner, 0.0) + spent
        self.owner = owner
        self.since = now
        if old != phase:
            self.phase = phase
            if self.segments is not None:
                self._record(old, now)
        return now

    def enter(self, phase: str, owner: str | None = None) -> None:
        """Go into `phase` (in `owner`'s hook) until the matching `leave`."""
        self._stack.append((self.phase, self.owner))
        self.switch(phase, owner)

    def leave(self) -> None:
        """Back to the phase (and callback) `enter` left."""
        self.switch(*self._stack.pop())

    @contextlib.contextmanager
    def within(self, phase: str, owner: str | None = None) -> Iterator[None]:
        """`enter` and `leave` around a block."""
        self.enter(phase, owner)
        try:
            yield
        finally:
            self.leave()

    def _record(self, phase: str, now: float) -> None:
        segments = self.segments
        assert segments is not None
        # Moved on first: a collection the append sets off records itself
        # from here.
        start, self._segment = self._segment, now
        if len(segments) < TRACE_CAP:
            segments.append((phase, start, now))
        else:
            self.dropped += 1

    # ------------------------------------------------------------- running

    @contextlib.contextmanager
    def running(self) -> Iterator["PhaseClock"]:
        """Measure the calling thread's compiles and collections while the
        block runs; the clock stops at its end."""
        _listen()
        self._thread = thread = threading.get_ident()
        _CLOCKS[thread] = self
        try:
            yield self
        finally:
            if _CLOCKS.get(thread) is self:
                del _CLOCKS[thread]
            self.stop()

    def stop(self) -> None:
        """Charge the time so far and stop (idempotent)."""
        if self.stopped is None:
            self.stopped = self.switch("other")
            if self.segments is not None:
                self._record("other", self.stopped)

    def ended(self) -> bool:
        """Whether the clock has stopped (its fit is over)."""
        return self.stopped is not None

    def record(self) -> None:
        """Keep the phases' stretches from now on, for a trace."""
        if self.segments is None:
            self.segments = []
            self._segment = self.switch(self.phase)

    def totals(self, now: float | None = None) -> dict[str, float]:
        """Seconds spent in each phase so far (the open stretch included, up
        to `now`, a `perf_counter` time: default now), and ``"wall"``: the
        seconds since the start (to the stop)."""
        if self.stopped is not None:
            now = self.stopped
        elif now is None:
            now = time.perf_counter()
        spent = dict(self.spent)
        if self.stopped is None:
            spent[self.phase] += now - self.since
        spent["wall"] = now - self.start
        return spent

    def callback_totals(self, now: float | None = None) -> dict[str, float]:
        """Seconds charged to each callback's hooks so far, by name (the
        open stretch included, up to `now` as in `totals`)."""
        spent = dict(self.by_callback)
        owner = self.owner
        if owner is not None and self.stopped is None:
            now = time.perf_counter() if now is None else now
            spent[owner] = spent.get(owner, 0.0) + now - self.since
        return spent

    # ------------------------------------------------------------ compiles

    def compiled(self, event: str, seconds: float, function: str) -> None:
        """One of JAX's compile events, `seconds` long, just ended on this
        clock's thread: its time moves from the current phase to
        ``"compile"`` (a span inside one already counted, as a function
        traced inside another, counts once)."""
        now = time.perf_counter()
        begin = now - seconds
        inside = 0.0
        while self._spans and self._spans[-1][0] >= begin:
            start, end = self._spans.pop()
            inside += end - start
        self._spans.append((begin, now))
        del self._spans[:-16]
        new = max(seconds - inside, 0.0)
        self.spent[self.phase] -= new
        if self.owner is not None:
            by = self.by_callback
            by[self.owner] = by.get(self.owner, 0.0) - new
        self.spent["compile"] += new
        self._pending += new
        if event == _BACKEND:
            # Named by the callback whose hook compiled it, else the phase.
            name = f"{self.owner or self.phase}: {function}"
            done = Compile(name, function, self.phase, self._pending, now - self.start)
            self.compiles.append(done)
            self.compile_count += 1
            self._pending = 0.0

    def name_compiles(self, since: int, name: str) -> None:
        """Name the compiles from index `since` on (those of one call)."""
        for each in self.compiles[since:]:
            each.name = name


# The running clock of each thread, for the process-wide listeners.
_CLOCKS: dict[int, PhaseClock] = {}
_LISTENING = threading.Lock()
_listening = False


def _on_event(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event in _EVENTS:
        clock = _CLOCKS.get(threading.get_ident())
        if clock is not None:
            clock.compiled(event, duration_secs, str(kwargs.get("fun_name", "?")))


def _on_gc(phase: str, info: dict[str, int]) -> None:
    del info
    clock = _CLOCKS.get(threading.get_ident())
    if clock is None:
        return
    if phase == "start":
        clock.enter("gc")
    elif clock._stack:
        clock.leave()


def _listen() -> None:
    """Register the listeners once per process (they cost nothing while no
    clock runs: one dictionary look-up per event)."""
    global _listening
    with _LISTENING:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            gc.callbacks.append(_on_gc)
            _listening = True
