"""The fit running now, as the trainer's methods see it between the loop's
steps (`CurrentFit`): what a callback called outside the loop is told, the
data's position for a snapshot, and whether the next fit continues a
restored snapshot's epoch. It changes only at the moments its methods
name (a fit starts or ends, a fit's run is set, a snapshot is restored),
from ``_assembly/`` alone (``tests/test_one_home.py``).
"""

from typing import Any

from .._engine.run._events import FitEvents
from .._engine.run._position import DataPosition
from .._state._progress import RunProgress
from .._telemetry._clock import PhaseClock
from .._typing import HostMetrics
from ..callbacks._base import StepInfo, TrainerLike


class CurrentFit:
    """The fit running now, and what the last one left for callbacks called
    outside a fit."""

    def __init__(self) -> None:
        self._events: FitEvents | None = None
        self._position: DataPosition | None = None
        self._totals: tuple[int | None, int | None] = (None, None)
        self._clock: PhaseClock | None = None
        self._restored = False

    @property
    def clock(self) -> PhaseClock | None:
        """The last fit's phase clock (its hooks read it at the end)."""
        return self._clock

    @property
    def restored(self) -> bool:
        """Whether the next fit continues a restored snapshot's epoch."""
        return self._restored

    def fit_started(
        self,
        events: FitEvents,
        position: DataPosition,
        totals: tuple[int | None, int | None],
        clock: PhaseClock,
    ) -> None:
        """A fit starts, telling `events`, its data at `position`; its
        ``(max_epochs, total_steps)`` and `clock` stay after it ends."""
        self._events, self._position = events, position
        self._totals, self._clock = totals, clock

    def fit_ended(self) -> None:
        """The running fit ended (however it did)."""
        self._events = self._position = None

    def run_set(self) -> None:
        """A fit's run is set: a restored snapshot's epoch (if any) is now
        that fit's to continue; the next fit starts afresh."""
        self._restored = False

    def snapshot_restored(self) -> None:
        """A snapshot was restored: the next fit continues its epoch."""
        self._restored = True

    def info(
        self,
        trainer: TrainerLike,
        progress: RunProgress,
        metrics: HostMetrics | None = None,
    ) -> StepInfo:
        """What a callback is told at `progress` outside the loop's steps:
        the running fit's view, or the run's between fits."""
        if self._events is not None:
            return self._events.info(progress, metrics)
        max_epochs, total_steps = self._totals
        return StepInfo(
            trainer,
            progress.step,
            progress.epoch,
            metrics or {},
            max_epochs=max_epochs,
            total_steps=total_steps,
            start_epoch=progress.plan.start_epoch,
            start_step=progress.plan.start_step,
            clock=self._clock,
        )

    def data_states(self) -> tuple[Any, dict[str, Any]]:
        """Where the running fit's data stands, as a snapshot keeps it: the
        training data's state and the evaluation sets' by prefix (outside a
        fit: None and none)."""
        position = self._position
        if position is None:
            return None, {}
        return position.data_state(), position.eval_states()
