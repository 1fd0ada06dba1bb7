"""`px.callbacks.Timeline`: where a fit's wall time went, phase by phase.

It reads the fit's `PhaseClock` (`StepInfo.clock`), which the loop keeps
whether or not a Timeline is there; it adds per-epoch ``time/<phase>`` and
``goodput`` metrics, prints a table at the end, and writes a JSON record and
a trace on request. It waits for no device and changes nothing of the run.
"""

import itertools
import json
import os
import pathlib
from typing import Any

import jax
from rich.console import Console
from rich.table import Table
from typing_extensions import override

from .._log import logger
from .._state._clock import PHASE_MEANINGS, PHASES, PhaseClock
from .._typing import validates_own_arguments
from .._validate import boolean
from ._base import Callback, StepInfo
from ._files import check_file_path


class Timeline(Callback):
    """Splits each fit's wall time into phases: ``step`` (dispatching
    compiled steps and waiting for the device at the loop's sync points),
    ``compile`` (every compile, named), ``data`` (waiting for batches),
    ``host`` (the loop's own work), ``eval``, ``checkpoint`` (the blocking
    part of saves), ``callbacks``, ``gc`` and ``other``. The parts sum to the
    wall time of the fit (from before `on_fit_start` to the loop's end).

    At each epoch's end it adds ``time/<phase>`` (seconds since the last
    epoch's end) and ``goodput`` (``step`` time ÷ wall time) to the metrics;
    place it before loggers. At the end of `fit` it prints a table (process
    0), and writes `path` (JSON: the phases, every compile with its name and
    seconds, a row per epoch) and `trace` (Chrome trace-event JSON of the
    phases, for https://ui.perfetto.dev or chrome://tracing; no profiler
    needed: up to 200,000 phase changes are kept, the rest counted).

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
            path: a JSON file written at the end of each fit (None: none).
            trace: a trace-event JSON file of the phases written at the end
                of each fit (None: none).
            table: print the table at the end of `fit`.
            keep_earlier: where `path` already holds a timeline when a fit
                starts (the same run before it was stopped and resumed, or
                an earlier fit), keep it in the new file: its fits under
                ``"earlier"`` and the sums over all of them under
                ``"total"`` (`phalanx train --resume` does this).
        """
        self.path = None if path is None else check_file_path(path, "path")
        self.trace = None if trace is None else check_file_path(trace, "trace")
        self.table = boolean("table", table)
        self.keep_earlier = boolean("keep_earlier", keep_earlier)
        self.epochs: list[dict[str, float]] = []
        self.earlier: list[dict[str, Any]] = []
        self._first_step = 0
        self._end_step: int | None = None
        self._clock: PhaseClock | None = None
        self._last: dict[str, float] = {}

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return (*(f"time/{phase}" for phase in PHASES), "goodput")

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._clock = clock = info.clock
        self.epochs = []
        self._last = {}
        self._first_step, self._end_step = info.step, None
        self.earlier = []
        if self.keep_earlier and self.path is not None:
            self.earlier = earlier_fits(self.path)
        if clock is not None:
            self._last = clock.totals()
            if self.trace is not None:
                clock.record()

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        if self._clock is None:
            return
        totals = self._clock.totals()
        row = {p: totals[p] - self._last.get(p, 0.0) for p in (*PHASES, "wall")}
        self._last = totals
        self.epochs.append({"epoch": info.epoch, "step": info.step, **row})
        metrics = info.metrics
        for phase in PHASES:
            metrics[f"time/{phase}"] = row[phase]
        metrics["goodput"] = row["step"] / row["wall"] if row["wall"] > 0 else 0.0

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        self._end_step = info.step
        self._finish()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        del error
        self._end_step = info.step
        self._finish()

    def record(self) -> dict[str, Any]:
        """The last fit's timeline as JSON data (what `path` holds)."""
        clock = self._clock
        if clock is None:
            return {}
        totals = clock.totals()
        wall = totals["wall"]
        this = {
            "wall_s": wall,
            "goodput": totals["step"] / wall if wall > 0 else 0.0,
            "first_step": self._first_step,
            "last_step": self._end_step,
            "phases": {phase: totals[phase] for phase in PHASES},
            "meanings": PHASE_MEANINGS,
            "compiles": [
                {
                    "name": c.name,
                    "function": c.function,
                    "phase": c.phase,
                    "seconds": c.seconds,
                    "at_s": c.at,
                }
                for c in clock.compiles
            ],
            "epochs": self.epochs,
        }
        return {**this, "earlier": self.earlier, "total": total(self.earlier, this)}

    def _finish(self) -> None:
        clock = self._clock
        if clock is None or jax.process_index() != 0:
            return
        record = self.record()
        if self.path is not None:
            _write(self.path, record)
        if self.trace is not None:
            _write(self.trace, trace_events(clock))
        if self.table:
            Console(stderr=False).print(timeline_table(record))


def earlier_fits(path: pathlib.Path) -> list[dict[str, Any]]:
    """The fits a timeline file at `path` records, earliest first (none if
    there is no file; a file that is not a timeline is said once and left
    to be overwritten)."""
    if not path.exists():
        return []
    try:
        record = json.loads(path.read_text())
        fits = [*record.get("earlier", []), record]
        for fit in fits:
            fit.pop("earlier", None)
            fit.pop("total", None)
            _check_fit(fit)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logger.warning(
            f"Timeline: {path} holds no timeline ({error!r}); it is replaced "
            "by this fit's, keeping nothing earlier"
        )
        return []
    return fits


def _check_fit(fit: dict[str, Any]) -> None:
    """Raises if `fit` is not one fit's record (`total` reads these)."""
    if not isinstance(fit["wall_s"], int | float) or not all(
        isinstance(fit["phases"].get(p, 0.0), int | float) for p in PHASES
    ):
        raise TypeError("a fit's wall_s and phases must be numbers")


def total(earlier: list[dict[str, Any]], this: dict[str, Any]) -> dict[str, Any]:
    """The sums over `earlier` fits and `this` one: their wall time, goodput
    and phases, and the steps computed again after a resume (those a fit
    reached past where the next one started: work lost with the stop)."""
    fits = [*earlier, this]
    wall = sum(fit["wall_s"] for fit in fits)
    phases = {p: sum(fit["phases"].get(p, 0.0) for fit in fits) for p in PHASES}
    again = 0
    for before, after in itertools.pairwise(fits):
        reached, start = before.get("last_step"), after.get("first_step")
        if reached is not None and start is not None:
            again += max(0, reached - start)
    return {
        "fits": len(fits),
        "wall_s": wall,
        "goodput": phases["step"] / wall if wall > 0 else 0.0,
        "steps_again": again,
        "phases": phases,
    }


def timeline_table(record: dict[str, Any]) -> Table:
    """The table `Timeline` prints: each phase's seconds and share of the
    wall time, then the compiles; and, where it keeps earlier fits, their
    sums."""
    wall = record["wall_s"]
    table = Table(
        title=f"where the time went: {wall:.2f} s, goodput {record['goodput']:.0%}",
        title_justify="left",
    )
    run = record.get("total")
    if run is not None and run["fits"] > 1:
        table.caption = (
            f"with the {run['fits'] - 1} earlier fit(s) kept: {run['wall_s']:.2f} s, "
            f"goodput {run['goodput']:.0%}, {run['steps_again']} step(s) "
            "computed again after a resume"
        )
        table.caption_justify = "left"
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    table.add_column("what it is")
    for phase, seconds in record["phases"].items():
        share = seconds / wall if wall > 0 else 0.0
        table.add_row(phase, f"{seconds:.3f}", f"{share:.1%}", PHASE_MEANINGS[phase])
    compiles = record["compiles"]
    for each in sorted(compiles, key=lambda c: -c["seconds"])[:5]:
        table.add_row("", f"{each['seconds']:.3f}", "", f"compile: {each['name']}")
    if len(compiles) > 5:
        table.add_row("", "", "", f"... {len(compiles)} compiles in all")
    return table


def trace_events(clock: PhaseClock) -> dict[str, Any]:
    """The phases (track 1) and the compiles (track 2) as Chrome trace
    events ("X": complete events, microseconds from the clock's start)."""
    start = clock.start
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name", "args": {"name": "fit"}},
        {
            "ph": "M",
            "pid": 1,
            "tid": 2,
            "name": "thread_name",
            "args": {"name": "compiles"},
        },
    ]
    for phase, begin, end in clock.segments or ():
        events.append(_event(phase, begin - start, end - begin, 1))
    for each in clock.compiles:
        events.append(_event(each.name, each.at - each.seconds, each.seconds, 2))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"dropped_phase_changes": clock.dropped},
    }


def _event(name: str, at: float, seconds: float, track: int) -> dict[str, Any]:
    return {
        "name": name,
        "ph": "X",
        "pid": 1,
        "tid": track,
        "ts": round(at * 1e6, 1),
        "dur": round(seconds * 1e6, 1),
    }


def _write(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
