"""The one interface through which a fit's loop tells the rest what happened
(`FitEvents`): the callbacks' hooks (each told a `StepInfo` built here) and
telemetry (`FitTelemetry`: the clock, the alarms, the collector). The loop
calls only these methods; what each event does is decided here and in the
observers, not in the loop. Events only tell: what asks the run to stop is
`StopRequests` (``_stops.py``), where the data stands `DataPosition`
(``_position.py``).
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from ..._state._progress import RunProgress
from ..._state._sums import StepSums
from ..._telemetry._clock import PhaseClock, TimePhase
from ..._telemetry._observer import FitTelemetry
from ..._typing import HostMetrics
from ...callbacks._base import StepInfo, TrainerLike
from ...callbacks._dispatch import Callbacks


class FitEvents:
    """A fit's events, told to its callbacks and its telemetry.

    Attributes:
        max_epochs, total_steps: the fit's epochs and steps from the run's
            start, where known up front.
    """

    def __init__(
        self,
        trainer: TrainerLike,
        callbacks: Callbacks,
        telemetry: FitTelemetry,
        *,
        totals: tuple[int | None, int | None],
        eval_every: int | None,
        steps_per_call: int,
    ):
        """Args:
        trainer: what callbacks are told about.
        callbacks: the fit's callbacks.
        telemetry: the fit's telemetry.
        totals: ``(max_epochs, total_steps)`` of the fit.
        eval_every: the fit's ``eval_every``.
        steps_per_call: the trainer's ``steps_per_call``.
        """
        self._trainer = trainer
        self._callbacks = callbacks
        self._telemetry = telemetry
        self._clock: PhaseClock = telemetry.clock
        self.max_epochs, self.total_steps = totals
        self._eval_every = eval_every
        self._steps_per_call = steps_per_call
        # The loop goes on in a phase (several times a step), and a call
        # starts after a step (once a call): telemetry's own methods, no
        # call between.
        self.phase: Callable[[TimePhase], object] = telemetry.phase
        self.call_started: Callable[[int], None] = telemetry.call_started

    # -------------------------------------------- what a callback is told

    def info(
        self,
        progress: RunProgress,
        metrics: StepSums | HostMetrics | None = None,
        examples: int = 0,
        *,
        step: int | None = None,
        last_in_call: bool = True,
    ) -> StepInfo:
        """What a callback is told at `progress` (at `step`, default its)."""
        plan = progress.plan
        return StepInfo(
            self._trainer,
            progress.step if step is None else step,
            progress.epoch,
            metrics or {},
            examples=examples,
            max_epochs=self.max_epochs,
            total_steps=self.total_steps,
            start_epoch=plan.start_epoch,
            start_step=plan.start_step,
            last_in_call=last_in_call,
            eval_every=self._eval_every,
            clock=self._clock,
            steps_per_call=self._steps_per_call,
        )

    # ------------------------------------------------------- the callbacks

    @property
    def wants_steps(self) -> bool:
        """Whether any callback is told each step."""
        return bool(self._callbacks.step_hooks)

    def epoch_started(self, progress: RunProgress) -> None:
        self._clock.switch("host")
        self._callbacks.epoch_start(self.info(progress))

    def epoch_ended(
        self, progress: RunProgress, logs: HostMetrics, examples: int
    ) -> None:
        """An epoch ended at `progress` (before it moved to the next epoch)
        with `logs`, after `examples` examples (every process's)."""
        self._callbacks.epoch_end(self.info(progress, logs, examples))
        self._clock.switch("host")

    def step_ended(
        self,
        progress: RunProgress,
        metrics: StepSums,
        examples: int,
        step: int,
        last: bool,
    ) -> None:
        """Step `step` of a call ended (`last`: the call's last)."""
        info = self.info(progress, metrics, examples, step=step, last_in_call=last)
        self._callbacks.step_end(info)

    @contextlib.contextmanager
    def evaluating(self, progress: RunProgress) -> Iterator[None]:
        """An evaluation after `progress`'s step (the block computes it)."""
        with self._clock.within("eval"):
            self._callbacks.eval_start(self.info(progress))
            yield
        self._telemetry.evaluated(progress.step)

    def evaluated(self, progress: RunProgress, metrics: HostMetrics) -> None:
        """An evaluation's results (inside `evaluating`)."""
        self._callbacks.eval_end(self.info(progress, metrics))

    # --------------------------------------------------------- telemetry

    def __enter__(self) -> "FitEvents":
        self._telemetry.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._telemetry.__exit__(*exc)

    @property
    def compile_count(self) -> int:
        """The compiles so far (compared before and after a call)."""
        return self._clock.compile_count

    def pass_started(self, step: int) -> None:
        self._telemetry.pass_started(step)

    def synced(self, done: int, step: int | None = None) -> None:
        self._telemetry.synced(done, step)

    def sync_point(self) -> None:
        self._telemetry.sync_point()

    def epoch_ending(self) -> None:
        self._telemetry.epoch_ending()

    def compiled(self, kind: str, since: int, batch: str, arguments: list[Any]) -> None:
        self._telemetry.compiled(kind, since, batch, arguments)
