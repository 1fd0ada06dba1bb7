"""What telemetry makes of a fit's loop events: the phase clock told what
the loop does, the slow-step alarm judging the stretches between sync
points, the recompile alarm told each compile, and the garbage-collection
policy run where the host waits anyway. The loop tells `FitTelemetry` what
happened; it never calls a clock, an alarm or the collector itself.
"""

from collections.abc import Callable
from typing import Any

from .._typing import GCMode
from ._alarms import Recompiles, SlowSteps
from ._clock import PhaseClock, TimePhase
from ._gc import Collector


class FitTelemetry:
    """One fit's telemetry, observing its loop (a context manager around
    the loop: the collection policy holds inside it).

    Attributes:
        clock: the fit's phase clock.
        phase: ``phase(name)``: the loop goes on in phase `name` (data,
            step, host, eval, ...).
    """

    def __init__(self, clock: PhaseClock, *, gc: GCMode, slow_steps: float | None):
        """Args:
        clock: the fit's phase clock.
        gc: the garbage-collection policy (see the trainer's ``gc``).
        slow_steps: the slow-step alarm's factor (None: off).
        """
        self.clock = clock
        self._collector = Collector(gc)
        self._slow = SlowSteps(clock, slow_steps)
        self._recompiles = Recompiles()
        # Told several times a step: the clock's own method, no call between.
        self.phase: Callable[[TimePhase], float] = clock.switch

    def __enter__(self) -> "FitTelemetry":
        self._collector.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._collector.__exit__(*exc)

    def pass_started(self, step: int) -> None:
        """A pass starts after `step`: a new stretch of steps begins."""
        self._slow.restart(step)

    def call_started(self, step: int) -> None:
        """The loop waits for the data of the call after `step`."""
        self._slow.began(self.clock.switch("data"), step)

    def synced(self, done: int, step: int | None = None) -> None:
        """The host waited for the device up to step `done` (the loop being
        at `step`): the stretch since the last such point is judged."""
        self._slow.waited(done, step)

    def sync_point(self) -> None:
        """A sync point, while the device runs the steps since the last one."""
        self._collector.at_sync()

    def epoch_ending(self) -> None:
        """An epoch's end, while the device finishes its steps."""
        self._collector.at_epoch_end()

    def evaluated(self, step: int) -> None:
        """An evaluation after `step` ended: the next stretch starts after it."""
        self._slow.restart(step)

    def compiled(self, kind: str, since: int, batch: str, arguments: list[Any]) -> None:
        """`kind` compiled (the clock's compiles from index `since` on), for a
        batch of types `batch`, with `arguments` (name, type, sharding) of
        each argument leaf."""
        self.clock.name_compiles(since, f"{kind}, batch {batch}")
        self._recompiles.compiled(kind, arguments)
