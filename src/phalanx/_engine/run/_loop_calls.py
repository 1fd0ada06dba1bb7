"""The loop's compiled calls: a group of prepared batches run as one call
of `k` stacked steps, or as one call a step.

`call_group` puts the next run into the slot after each call (the state
and progress of the same step, always) and returns each step's sums;
`pass_progress` readies the progress for a program's first call in a pass.
A call whose arguments the compiled step was not built for runs through the
step's `jax.jit`, its compile told through `FitEvents` like any other. Like
the loop, nothing here calls a clock, an alarm or a callback, or reaches
through an object it is handed.
"""

import dataclasses
from typing import Any

from ..._state._progress import RunProgress, resumed_sums_message
from ..._state._run import Run, RunSlot
from ..feed._device_batch import DeviceBatch
from ..program._ahead_of_time import mismatched
from ..program._program import Program
from ._events import FitEvents
from ._loop_inputs import LoopParts
from ._loop_programs import tell_compiled


def pass_progress(
    progress: RunProgress, program: Program, first: DeviceBatch
) -> RunProgress:
    """`progress` ready for a call of `program`: the epoch's sums known (a
    resumed epoch's checked against the program's), the pass's rows fixed
    by its first batch."""
    sums = program.sums
    names = sums.names
    if progress.sums is None:
        progress = dataclasses.replace(progress, sum_names=names)
    elif progress.sum_names != names:
        raise ValueError(resumed_sums_message(progress, names))
    if progress.pass_rows is None:  # the pass's first batch
        progress = progress.with_pass_rows(first.size)
    return progress


def call_group(
    slot: RunSlot,
    events: FitEvents,
    parts: LoopParts,
    program: Program,
    group: list[DeviceBatch],
    progress: RunProgress,
    k: int,
) -> list[tuple[Any, int | None]]:
    """Run `group`'s steps: one call of `k` stacked steps, or one call a
    step; the slot moves after each call. Each step's sums, as
    ``(sums, index in the call's sums or None)``."""
    run, programs, pipeline = slot.run, parts.programs, parts.pipeline
    leaves, epoch_sums = run.leaves, progress.sums
    if epoch_sums is None:
        epoch_sums = programs.epoch_sums(program)
    if len(group) > 1 and len(group) == k:
        assert program.train_many is not None
        batch, weight, total = pipeline.stack(group)
        args = (leaves, *epoch_sums, batch, weight, total)
        kind = f"train step x{k}"
        leaves, epoch_sums, sums = _run(events, parts, program, kind, args)
        slot.put(Run(leaves, progress.stepped(epoch_sums, k)))
        return [(sums, i) for i in range(k)]
    rows: list[tuple[Any, int | None]] = []
    spare = run.spare
    for placed in group:
        args = (leaves, *epoch_sums, placed.leaves, placed.weight, placed.total)
        if program.spare is not None:  # the state the last call read, donated here
            spare = program.spare(leaves) if spare is None else spare
            args = (leaves, spare, *args[1:])
        before = leaves
        leaves, epoch_sums, sums = _run(events, parts, program, "train step", args)
        # (A call through the step's jit donated the state: no spare.)
        spare = before if program.held and not before[0].is_deleted() else None
        progress = progress.stepped(epoch_sums)
        slot.put(Run(leaves, progress, spare))
        rows.append((sums, None))
    return rows


def _run(
    events: FitEvents,
    parts: LoopParts,
    program: Program,
    kind: str,
    args: tuple[Any, ...],
) -> Any:
    """One train call of `program` (`kind`: stacked or single); a call whose
    arguments the compiled step was not built for (a state leaf of another
    type or sharding: nothing was donated) runs through the step's
    `jax.jit`, its compile told to the alarms like any other."""
    step = program.train_many if kind != "train step" else program.train
    assert step is not None
    compiles = events.compile_count
    events.phase("step")
    try:
        out = step(*args)
    except (TypeError, ValueError) as error:
        if not mismatched(error) or step is not program.train:
            raise
        # The gated step (not held): the state, then what follows the spare.
        out = program.traced(args[0], *args[2 if program.held else 1 :])
    events.phase("host")
    if events.compile_count != compiles:
        tell_compiled(events, parts, kind, compiles, args)
    return out
