"""One `fit` from its arguments to its end (`run_fit`): the arguments
checked, the run reset or resumed, the loop's events, stop requests, data
position, parts and settings put together, and the loop run between the
callbacks' `on_fit_start` and `on_fit_end`, a signal's stop saved by the
snapshot stores.

The trainer's `fit` is this function given the trainer's parts; it reads
the trainer only through what `TrainerLike` declares.
"""

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

from .._checks._arguments import (
    check_duration,
    check_eval_every,
    check_iterable,
    check_one_shot,
    eval_sets,
)
from .._checks._device_note import note_single_cpu_device
from .._engine.run._evaluate import evaluate_sets
from .._engine.run._events import FitEvents
from .._engine.run._loop import fit_loop
from .._engine.run._loop_inputs import FitData, LoopParts, LoopSettings
from .._engine.run._position import DataPosition
from .._engine.run._stops import StopRequests
from .._preemption import Preempted, preemption
from .._state._progress import RunPlan, RunProgress, fit_totals
from .._state._run import Run
from .._telemetry._clock import PhaseClock
from .._telemetry._observer import FitTelemetry
from .._telemetry._watchdog import (
    DEFAULT_FOLDER,
    HangTimeout,
    HangWatchdog,
    resolve_auto,
)
from .._typing import EvalSets, GCMode, HostMetrics, validates_own_arguments
from ..callbacks._base import TrainerLike
from ..callbacks._checkpoint import Checkpoint
from ..callbacks._dispatch import Callbacks
from ..callbacks._monitors import check_monitors
from ..checkpoint._resume import find_snapshot, restore_run
from ..data._grain_iterables import resumable as grain_resumable
from ._parts import TrainerParts, epoch_extras, info_now, metric_names


@dataclasses.dataclass(frozen=True)
class FitOptions:
    """The trainer's settings a fit reads beside those `TrainerLike` declares.

    Attributes:
        prefetch: batches prepared ahead.
        gc: the garbage-collection policy.
        slow_steps: the slow-step alarm's factor (None: off).
        hang_timeout: the hang watchdog's deadline (seconds, "auto", or
            None: off).
        default_split: whether batches are split by the default
            `split_batch` (what the data checks may assume).
    """

    prefetch: int
    gc: GCMode
    slow_steps: float | None
    hang_timeout: HangTimeout
    default_split: bool


@validates_own_arguments
def run_fit(
    trainer: TrainerLike,
    parts: TrainerParts,
    callbacks: Callbacks,
    options: FitOptions,
    data: Iterable[Any],
    *,
    epochs: int | None,
    steps: int | None,
    eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None,
    eval_every: int | None,
    resume: str | os.PathLike[str] | None,
) -> None:
    """Train `trainer` on `data` (see `DataParallelTrainer.fit`); the run it
    ends with is in ``parts.slot``."""
    clock = PhaseClock()  # the fit's wall time starts here ("other")
    epochs, steps = check_duration(epochs, steps)
    # grain's datasets resume from grain's iterator state, not by re-reading.
    data = grain_resumable(data)
    check_iterable(data, "data", default_split=options.default_split)
    sets = eval_sets(eval_data, default_split=options.default_split)
    eval_every = check_eval_every(eval_every, sets)
    extras = epoch_extras(trainer.precision, trainer.nan_policy)
    monitors = functools.partial(
        check_monitors, callbacks.all, sets, eval_every=eval_every, epoch_extras=extras
    )
    step_metrics, eval_metrics = metric_names(parts)
    monitors(step_metrics=step_metrics, eval_metrics=eval_metrics)
    note_single_cpu_device(trainer.strategy.num_devices)
    _start_run(trainer, parts, callbacks, data, sets, resume, (epochs, steps))
    trainer.stop_training = False
    slot, current = parts.slot, parts.current
    progress = slot.progress
    totals = fit_totals(data, progress)
    check_one_shot(data, sets, progress, total_steps=totals[1], eval_every=eval_every)
    telemetry = FitTelemetry(clock, gc=options.gc, slow_steps=options.slow_steps)
    stops, position = StopRequests(trainer), DataPosition(data, sets)
    events = FitEvents(
        trainer,
        callbacks,
        telemetry,
        totals=totals,
        eval_every=eval_every,
        steps_per_call=parts.programs.steps_per_call,
    )

    def evaluate(sets: EvalSets) -> HostMetrics:
        return evaluate_sets(
            parts.pipeline,
            parts.programs,
            slot.run.leaves,
            sets,
            depth=options.prefetch,
            sync_every=trainer.sync_every,
        )

    loop_parts = LoopParts(
        parts.pipeline, parts.programs, parts.layout, trainer.history, evaluate
    )
    settings = LoopSettings(options.prefetch, trainer.sync_every, trainer.nan_policy)
    # Metric names unknown until the first batch: checked before its step.
    check = None
    if step_metrics is None or eval_metrics is None:
        check = lambda names, eval_names: monitors(  # noqa: E731
            step_metrics=names, eval_metrics=eval_names
        )
    fit = FitData(data, sets, eval_every, check)
    current.fit_started(events, position, totals, clock)
    watchdog = _watchdog(options.hang_timeout, clock, parts, callbacks, trainer)
    with clock.running(), watchdog:
        try:
            try:
                # A callback failing to start (a tracker that cannot reach
                # its server) lets the others that started close their files.
                callbacks.fit_start(info_now(trainer, parts))
                with preemption(stops.preempt):
                    run = fit_loop(
                        slot, fit, events, stops, position, loop_parts, settings
                    )
                signum = run.progress.preempted
                if signum is not None:
                    clock.switch("checkpoint")
                    saved = [
                        store.save_snapshot(trainer.snapshot(), wait=True)
                        for store in callbacks.stores
                    ]
                    raise Preempted(signum, str(saved[0]) if saved else None)
            except BaseException as error:
                callbacks.exception(info_now(trainer, parts), error)
                raise
        finally:
            current.fit_ended()
        callbacks.fit_end(info_now(trainer, parts))


def _watchdog(
    timeout: HangTimeout,
    clock: PhaseClock,
    parts: TrainerParts,
    callbacks: Callbacks,
    trainer: TrainerLike,
) -> contextlib.AbstractContextManager[object]:
    """The fit's hang watchdog (a no-op one where it is off; "auto" as the
    environment says, see `resolve_auto`): its dumps go to the first
    `Checkpoint`'s folder, else ``./phalanx-hang``."""
    timeout = resolve_auto(timeout)
    if timeout is None:
        return contextlib.nullcontext()
    folders = [s.directory for s in callbacks.stores if isinstance(s, Checkpoint)]
    slot = parts.slot
    return HangWatchdog(
        clock,
        lambda: slot.progress.step,
        timeout=timeout if timeout == "auto" else float(timeout),
        sync_every=trainer.sync_every,
        folder=folders[0] if folders else Path(DEFAULT_FOLDER).absolute(),
        rank=jax.process_index(),
        processes=jax.process_count(),
    )


def _start_run(
    trainer: TrainerLike,
    parts: TrainerParts,
    callbacks: Callbacks,
    data: Iterable[Any],
    sets: EvalSets | None,
    resume: str | os.PathLike[str] | None,
    asked: tuple[int | None, int | None],
) -> None:
    """The run a fit starts from, in the slot: the current one in a new
    epoch (unless it continues a restored snapshot, or resumes, which
    restores one), its state copied (the loop donates it), its plan going
    as far as this fit is `asked` (``epochs``, ``steps``) from the run's
    start."""
    slot, current = parts.slot, parts.current
    run = slot.run.settled()  # (a fit stopped by an error may have left a spare)
    # A fit that ended early (an error, steps=) may have left a part-done
    # epoch behind.
    progress = run.progress
    if not current.restored:
        step, epoch = progress.step, progress.epoch
        progress = RunProgress(step, epoch, plan=RunPlan(step, epoch))
    slot.put(Run(parts.copy(run.leaves), progress))
    if resume is not None:
        snapshot = find_snapshot(resume, trainer.snapshot(), callbacks.stores)
        if snapshot is not None:  # the data checks its position first
            restore_run(snapshot, trainer.restore, data, sets or ())
    current.run_set()  # this fit continues it; the next starts afresh
    # The run's start is the checkpoint's; how far it goes is this call's.
    progress = slot.progress
    epochs, steps = asked
    plan = dataclasses.replace(progress.plan, epochs=epochs, steps=steps)
    slot.advance(dataclasses.replace(progress, plan=plan))
