"""The training loop as a function: `fit_loop` runs passes over the data,
with a bounded in-flight window, from the run in a `RunSlot` to the run it
returns.

The loop puts the next run (the state's arrays and its progress, one `Run`)
into the slot after every compiled call (`_loop_calls.py` makes them), so
that the trainer, its callbacks and a snapshot always see the state and
progress of the same step. It builds each program it runs explicitly
(`first_program` for the first batch of all, `Programs.resized` for a new
step size) before a batch of it is placed, and tells everything else what
happened through one interface, `FitEvents` (the callbacks and telemetry);
it never calls a clock, an alarm or a callback itself, and reaches through
no object it is handed. Where a call ends it asks `StopRequests` whether
to stop, and it notes the pass it trains on in `DataPosition` (where a
snapshot reads the data's position).
"""

import dataclasses
from collections.abc import Callable, Sized
from typing import Any, NamedTuple

import jax

from ..._checks._run_errors import empty_data_message, nonfinite_error
from ..._state._run import Run, RunSlot
from ..._state._sums import FLAGS, StepSums
from ..._typing import HostMetrics
from ...data import Resumable
from ...strategies._placement import to_host
from ..feed._feed import Feed
from ..program._program import Program
from ._events import FitEvents
from ._loop_calls import call_group, pass_progress
from ._loop_inputs import FitData, LoopParts, LoopSettings
from ._loop_programs import build_first, build_from_peek, program_for
from ._position import DataPosition
from ._stops import StopRequests


@dataclasses.dataclass
class _Window:
    """The loop's own running record: the in-flight window and the epoch.

    Attributes:
        flags: the epoch's flags at the last sync point (not donated by the
            steps), which the next sync point waits on; None: none yet.
        flags_step: the step of those flags.
        examples: examples (all processes') trained on in the epoch.
        check_metrics: still to be called before the first step.
        program: the program of the last call (None: none yet in this fit),
            the next call's while its step size stays.
    """

    flags: jax.Array | None = None
    flags_step: int = 0
    examples: int = 0
    check_metrics: Callable[[tuple[str, ...], tuple[str, ...]], None] | None = None
    program: Program | None = None


class _Loop(NamedTuple):
    """What the loop's levels (an epoch, its pass over the data) work with
    for one fit, passed whole from one to the next: `fit_loop`'s arguments
    and the loop's own running record."""

    slot: RunSlot
    fit: FitData
    events: FitEvents
    stops: StopRequests
    position: DataPosition
    parts: LoopParts
    settings: LoopSettings
    window: _Window


def fit_loop(
    slot: RunSlot,
    fit: FitData,
    events: FitEvents,
    stops: StopRequests,
    position: DataPosition,
    parts: LoopParts,
    settings: LoopSettings,
) -> Run:
    """Epochs from the run in `slot` until its plan is done, a callback
    stops training, or a signal came (`stops`); the run it ends with (also
    left in the slot), its progress noting the signal (``preempted``)."""
    window = _Window(check_metrics=fit.check_metrics)
    loop = _Loop(slot, fit, events, stops, position, parts, settings, window)
    with events:
        while not stops.stopping():
            progress = slot.progress
            if progress.done():
                break
            _epoch(loop)
    slot.settle()
    # (A restored snapshot may carry the signal that stopped its own run.)
    progress = dataclasses.replace(slot.progress, preempted=stops.signal)
    return slot.advance(progress)


def _epoch(loop: _Loop) -> None:
    """Train on one pass over the data (or its rest, after a resume), then
    evaluate (at epoch ends), log the epoch and tell `epoch_ended`; return
    early when the plan is done, a callback stops training, or a signal
    came."""
    slot, fit, events, stops, position, parts, settings, window = loop
    data, progress, programs = fit.data, slot.progress, parts.programs
    epoch = progress.epoch
    events.epoch_started(progress)
    # Resumed from a snapshot of the epoch's last step: only its end is left.
    done = isinstance(data, Sized) and 0 < len(data) <= progress.epoch_steps
    if done and programs.first is None:
        build_from_peek(data, parts)
    # A plain re-iterable resumed mid-epoch restarts its epoch: skip what
    # was trained on (a Resumable loader resumes by itself).
    skip = 0 if isinstance(data, Resumable) else progress.epoch_steps
    window.flags = None  # the epoch's end waits for every step
    window.examples = 0
    events.phase("data")  # the pass's first batch is read and prepared here
    feed = Feed(
        parts.pipeline,
        () if done else data,
        depth=settings.prefetch,
        where=lambda i: f"batch {i} of epoch {epoch}",
        skip=skip,
        train=True,
        group=programs.steps_per_call,
        rows=progress.local_pass_rows(),
    )
    head = feed.head
    if programs.first is None and head is not None:
        build_first(parts, events, head, f"batch {skip} of epoch {epoch}")
    events.pass_started(progress.step)
    try:
        with position.reading(feed), feed:
            _train_pass(loop, feed)
    finally:
        events.phase("host")
    if stops.signal is not None:
        return  # mid-epoch: the checkpoint keeps the epoch's sums
    progress = slot.progress
    epoch_sums = progress.sums
    if epoch_sums is None:
        raise ValueError(empty_data_message("data", epoch))
    events.epoch_ending()  # while the device finishes the steps
    events.phase("step")
    fetched = jax.device_get(epoch_sums)
    events.phase("host")
    events.synced(progress.step)
    logs = _epoch_logs(slot, parts, fetched)
    if fit.eval_sets is not None and fit.eval_every is None:
        logs.update(_evaluation(slot, fit, events, parts))
    progress, history = slot.progress, parts.history
    history.append(logs, progress.step)
    slot.advance(progress.next_epoch())
    events.epoch_ended(progress, logs, window.examples)


def _evaluation(
    slot: RunSlot, fit: FitData, events: FitEvents, parts: LoopParts
) -> HostMetrics:
    """Evaluate every set now (after the slot's step): recorded in the
    history and told to the callbacks, its metrics the same dict."""
    progress, sets, history = slot.progress, fit.eval_sets, parts.history
    assert sets is not None
    with events.evaluating(progress):
        metrics = parts.evaluate(sets)
        history.append_evaluation(progress.step, progress.epoch, metrics)
        events.evaluated(progress, metrics)
    return metrics


def _train_pass(loop: _Loop, feed: Feed) -> None:
    """Compiled calls of `steps_per_call` steps (single steps where the
    pass or the plan has fewer left, or the step size changes) until the
    pass ends, the plan is done, a callback stops training, or a signal
    came; each of those is acted on where a call ends, and a call ends at
    each step ``eval_every`` evaluates after."""
    # Locals: read every step.
    slot, fit, events, stops, _, parts, settings, window = loop
    k, every = parts.programs.steps_per_call, fit.eval_every
    sync_every = settings.sync_every
    processes = jax.process_count()  # every process's slice of a batch
    call_started, phase = events.call_started, events.phase
    while True:
        progress = slot.progress
        left = progress.steps_left()
        size = k if left is None else min(k, left)
        if every is not None:  # up to the next evaluation
            size = min(size, every - progress.step % every)
        call_started(progress.step)
        group = feed.take(size)
        phase("host")
        if not group:
            return
        program, first = window.program, group[0]
        # The same program as the last call's, its sums' names set: nothing
        # to look up or check (the steady state).
        if (
            program is None
            or program.size != first.size * processes
            or progress.sums is None
            or progress.pass_rows is None
        ):
            program = window.program = program_for(parts, events, first)
            if window.check_metrics is not None:  # once, before the first step
                window.check_metrics(
                    program.sums.metric_names, program.eval_sums.metric_names
                )
                window.check_metrics = None
            progress = pass_progress(slot.progress, program, first)
        before = progress.step
        window.examples += sum([placed.n for placed in group]) * processes
        rows = call_group(slot, events, parts, program, group, progress, k)
        progress = slot.progress
        if progress.step // sync_every > before // sync_every:
            _sync(slot, events, settings, window, parts)
        # An evaluation after this call's last step comes before that step's
        # hooks: a checkpoint saved there holds it.
        evaluates = every is not None and progress.step % every == 0
        if events.wants_steps or evaluates:
            last = len(group) - 1
            for i, (placed, row) in enumerate(zip(group, rows, strict=True)):
                if i == last and evaluates:
                    _evaluation(slot, fit, events, parts)
                if not events.wants_steps:
                    continue
                # The slices are equal but for the last batch of a pass, at
                # most one example apart.
                sums = StepSums(row[0], program.step_sums, row[1])
                n = placed.n * processes
                events.step_ended(slot.progress, sums, n, before + i + 1, i == last)
            progress = slot.progress
        if stops.stopping() or progress.plan.done(progress.step, None):
            return


def _sync(
    slot: RunSlot,
    events: FitEvents,
    settings: LoopSettings,
    window: _Window,
    parts: LoopParts,
) -> None:
    """Wait for the device as far as the previous sync point (a bounded
    in-flight window that never drains: the steps since then keep the
    device busy meanwhile); surface a bad step up to there."""
    progress = slot.progress
    epoch_sums = progress.sums
    assert epoch_sums is not None
    flags, window.flags = window.flags, epoch_sums.flags
    done, window.flags_step = window.flags_step, progress.step
    events.sync_point()  # while the device runs the steps since the last one
    if flags is None:
        return
    events.phase("step")
    if settings.nan_policy == "raise":
        fetched = jax.device_get(flags)
        events.phase("host")
        _raise_if_nonfinite(slot, parts, fetched)
    else:
        jax.block_until_ready(flags)
        events.phase("host")
    events.synced(done, progress.step)


def _epoch_logs(slot: RunSlot, parts: LoopParts, epoch_sums: Any) -> HostMetrics:
    """The epoch's means from its sums, fetched (each divided once by the
    epoch's total weight)."""
    _raise_if_nonfinite(slot, parts, epoch_sums.flags)
    programs, layout, run = parts.programs, parts.layout, slot.run
    program = programs.first
    assert program is not None, "an epoch's sums come from a program's steps"
    sums, step_sums = program.sums, program.step_sums
    average = sums.means(epoch_sums.sums)
    logs = {k: average[k] for k in ["loss", *sorted(set(average) - {"loss"})]}
    if "skipped" in step_sums.names:  # skip, or overflows skip too
        logs["skipped_steps"] = float(epoch_sums.flags[FLAGS.index("skipped")])
    scale = layout.loss_scale(run.leaves)
    if scale is not None:  # dynamic: the scale the next step will use
        logs["loss_scale"] = float(to_host(scale.scale))
    return logs


def _raise_if_nonfinite(slot: RunSlot, parts: LoopParts, flags: Any) -> None:
    """Raise FloatingPointError if a step had a non-finite gradient; the
    progress goes back to that step (the state was frozen there)."""
    _, step, leaf = (int(flag) for flag in flags)
    if step >= 0:
        layout = parts.layout
        slot.settle()  # the state from before that step
        run = slot.advance(dataclasses.replace(slot.progress, step=step))
        model = layout.unflatten(run.leaves).model
        raise nonfinite_error(step, leaf, model)
