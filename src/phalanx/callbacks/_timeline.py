"""`px.callbacks.Timeline`: where a fit's wall time went, phase by phase
and callback by callback.

It reads the fit's `PhaseClock` (`StepInfo.clock`), which the loop keeps
whether or not a Timeline is there; it adds per-epoch ``time/<phase>`` and
``goodput`` metrics, prints a table at the end, writes a JSON record (during
the fit too, so a killed run's survives) and a trace on request, and keeps
its record in each checkpoint. It waits for no device and changes nothing
of the run.
"""

import os
import time
from typing import Any

import jax
from rich.console import Console
from typing_extensions import override

from .._telemetry._clock import PHASES, PhaseClock
from .._telemetry._timeline_record import (
    Fit,
    continued,
    earlier_fits,
    epoch_row,
    fit_record,
    goodput,
    total,
    write_json,
)
from .._telemetry._timeline_views import timeline_table, trace_events
from .._typing import validates_own_arguments
from .._validate import boolean
from ._base import Callback, StepInfo
from ._budget import TimeBudget
from ._files import check_file_path


# During a fit, `path` is rewritten at most every this many seconds, and in
# at most this share of the time (a write took ~0.3 ms: ~0.1%).
_WRITE_EVERY_S = 0.25
_WRITE_SHARE = 0.005


class Timeline(Callback):
    """Splits each fit's wall time into phases: ``step`` (dispatching
    compiled steps and waiting for the device: at the loop's sync points,
    and where a callback first reads a step's metrics), ``compile`` (every
    compile, named), ``data`` (waiting for batches), ``host`` (the loop's
    own work), ``eval``, ``checkpoint`` (the blocking part of saves),
    ``callbacks``, ``gc`` and ``other``. The parts sum to the wall time of
    the fit (from before `on_fit_start` to the loop's end). The time of
    each callback's hooks is told apart too, by its name (the class name,
    with its ``state_name`` if set): a compile inside a hook is named by
    its callback.

    At each epoch's end it adds ``time/<phase>`` (seconds since the last
    epoch's end) and ``goodput`` (``step`` time ÷ wall time) to the metrics
    (which reach every logger: callbacks that add metrics run first). At
    the end of `fit` it prints a table (process 0): the phases, the
    callbacks that took the most time, the compiles. It writes `path`
    (JSON: the phases, each callback's seconds, every compile with its name
    and seconds, a row per epoch) and `trace` (Chrome trace-event JSON of
    the phases, for https://ui.perfetto.dev or chrome://tracing; no profiler
    needed: up to 200,000 phase changes are kept, the rest counted).

    `path` is written at the end of `fit` and also while it runs (at most
    every quarter second, in under 0.5% of the time, atomically), so a
    killed run leaves its timeline as of a moment before. Its record is also kept in
    each checkpoint (its `state_dict`): a fit resumed from one continues
    the run's timeline, the fits before it kept under ``"earlier"`` and
    summed under ``"total"``, whose ``steps_again`` counts the steps
    trained past where a resume went on from (work a stop or a kill lost;
    with `keep_earlier`, a killed fit counts as far as its file got).

    Measuring adds no wait for the device: ``step`` is the device's time as
    the host sees it (an asynchronous dispatch returns at once; the loop
    waits at its sync points), so goodput near 1 means the host keeps the
    device fed.

    Example:
        ```python
        timeline = px.callbacks.Timeline(path="runs/a/timeline.json")
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[timeline])
        ```
    """

    ends_last = True  # its table and record include the others' fit ends

    @validates_own_arguments
    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        trace: str | os.PathLike[str] | None = None,
        table: bool = True,
        keep_earlier: bool = False,
    ):
        """
        Args:
            path: a JSON file written during and at the end of each fit
                (None: none).
            trace: a trace-event JSON file of the phases written at the end
                of each fit (None: none).
            table: print the table at the end of `fit`.
            keep_earlier: where `path` already holds a timeline when a fit
                starts (the same run before it was stopped or killed and
                resumed, or an earlier fit), keep it in the new file: its
                fits under ``"earlier"`` and the sums over all of them under
                ``"total"`` (`phalanx train --resume` does this). A fit
                resumed from a checkpoint keeps the fits its checkpoint
                holds either way; the file adds how far each got after it.
        """
        self.path = None if path is None else check_file_path(path, "path")
        self.trace = None if trace is None else check_file_path(trace, "trace")
        self.table = boolean("table", table)
        self.keep_earlier = boolean("keep_earlier", keep_earlier)
        self.epochs: list[dict[str, Any]] = []
        self.earlier: list[Fit] = []
        self._restored: list[Fit] | None = None
        self._started = 0.0
        self._first_step = 0
        self._step = 0  # the last step its hooks were told of
        self._ended: str | None = None
        self._clock: PhaseClock | None = None
        self._last: dict[str, float] = {}
        self._writes = TimeBudget(_WRITE_SHARE, first=0.0, floor=_WRITE_EVERY_S)
        self._writing = False  # whether this process writes `path` in the fit

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return (*(f"time/{phase}" for phase in PHASES), "goodput")

    @property
    @override
    def needs_steps(self) -> bool:
        """Called after steps only to rewrite `path` while the fit runs."""
        return self.path is not None

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._clock = clock = info.clock
        self.epochs = []
        self._last = {}
        self._started = time.time()
        self._first_step = self._step = info.step
        self._ended = None
        kept, self._restored = self._restored or [], None
        found = []
        if self.keep_earlier and self.path is not None:
            found = earlier_fits(self.path)
        self.earlier = continued(kept, found)
        self._writes.restart()
        self._writing = self.path is not None and jax.process_index() == 0
        if clock is not None:
            self._last = clock.totals()
            if self.trace is not None:
                clock.record()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._step = info.step
        if info.last_in_call and self._writing and self._writes.due():
            self._write()

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        self._step = info.step
        if self._clock is None:
            return
        totals = self._clock.totals()
        row, self._last = epoch_row(totals, self._last), totals
        self.epochs.append({"epoch": info.epoch, "step": info.step, **row})
        metrics = info.metrics
        for phase in PHASES:
            metrics[f"time/{phase}"] = row[phase]
        metrics["goodput"] = goodput(row)
        if self._writing and self._writes.due():
            self._write()

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        self._step = info.step
        self._ended = "returned"
        self._finish()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        self._step = info.step
        self._ended = f"raised {type(error).__name__}"
        self._finish()

    def state_dict(self) -> dict[str, Any]:
        """The run's timeline so far, kept in each checkpoint: the fits
        before this one and this one up to now."""
        return {"fits": self.fits()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The timeline of the run a checkpoint resumes: the next fit goes on
        from its fits (see `state_dict`)."""
        self._restored = [dict(fit) for fit in state["fits"]]

    def fits(self) -> list[Fit]:
        """The records of the fits before the last one and of the last one
        (up to now, if it runs)."""
        this = self._this()
        return [*self.earlier, *([this] if this else [])]

    def record(self) -> dict[str, Any]:
        """The last fit's timeline as JSON data (what `path` holds)."""
        this = self._this()
        if not this:
            return {}
        return {**this, "earlier": self.earlier, "total": total(self.earlier, this)}

    def _this(self) -> Fit:
        """The record of the last fit (up to now, if it runs); empty before
        any."""
        if self._clock is None:
            return {}
        return fit_record(
            self._clock,
            started=self._started,
            ended=self._ended,
            steps=(self._first_step, self._step),
            epochs=self.epochs,
        )

    def _write(self) -> None:
        """Rewrite `path` with the record so far."""
        assert self.path is not None
        with self._writes.spend():
            write_json(self.path, self.record())

    def _finish(self) -> None:
        clock = self._clock
        if clock is None or jax.process_index() != 0:
            return
        record = self.record()
        if self.path is not None:
            write_json(self.path, record)
        if self.trace is not None:
            write_json(self.trace, trace_events(clock))
        if self.table:
            Console(stderr=False).print(timeline_table(record))
