"""What a trainer's methods do with its parts (`TrainerParts`): snapshot
and restore the run, set its state, build a program to trace or inspect
with, count a step's FLOPs, lower or compute a step, evaluate, predict.
Each takes the parts and the values it needs, never the trainer."""

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

from .._engine.feed._prepare import first_program
from .._engine.program._lint import layout_warnings, stacked_leaves
from .._engine.program._program import Program
from .._engine.program._programs import StepValues
from .._engine.program._summary import ModelSummary, StepMemory, summarize
from .._engine.run._evaluate import evaluate
from .._engine.run._predict import predict_inputs
from .._engine.step._layout import leaf_names
from .._state._history import History
from .._state._run import Run
from .._state._snapshot import Snapshot
from .._state._sums import EpochSums
from .._state._train_state import TrainState
from .._telemetry._flops import StepFlops
from .._typing import HostMetrics, validates_own_arguments
from ..callbacks._dispatch import Callbacks
from ..checkpoint._settings import check_same_settings
from ..strategies._placement import put_state, replicated_copies
from ._parts import TrainerParts, checked_leaves


def snapshot_of(
    parts: TrainerParts, history: History, callbacks: Callbacks
) -> Snapshot:
    """The run as it is now (see `DataParallelTrainer.snapshot`); under the
    held guard, the state from before a last step whose gradient was not
    finite (``_engine/step/_held.py``: this waits for that step)."""
    strategy = parts.strategy
    run = parts.slot.settle()
    data, eval_data = parts.current.data_states()
    return Snapshot(
        state=parts.builder.build(run.leaves),
        progress=run.progress,
        history=history.state_dict(),
        data=data,
        eval_data=eval_data,
        settings=parts.settings,
        callbacks=callbacks.state_dicts(),
        strategy=type(strategy).__name__,
        devices=strategy.num_devices,
    )


def restore_into(
    parts: TrainerParts, snapshot: Snapshot, history: History, callbacks: Callbacks
) -> None:
    """Continue from `snapshot` (see `DataParallelTrainer.restore`): every
    part checked before any is set, so a refused snapshot leaves the run
    (its state, progress and history) as it was.

    Raises:
        ValueError: the snapshot is of another model, optimizer or run, or
            its history is not one `History.state_dict` writes.
    """
    check_same_settings(parts.settings, snapshot.settings, "snapshot")
    leaves = checked_leaves(parts.layout, snapshot.state)
    History().load_state_dict(snapshot.history)  # (checked: it raises here)
    progress = snapshot.progress
    if progress.sums is not None:  # a fit donates them: keep the snapshot's
        copies = replicated_copies(list(progress.sums), parts.strategy.mesh)
        progress = dataclasses.replace(progress, sums=EpochSums(*copies))
    # A callback may refuse its state: before the run changes.
    callbacks.load_state_dicts(snapshot.callbacks)
    parts.slot.put(Run(put_state(leaves, parts.layout.shardings), progress))
    history.load_state_dict(snapshot.history)
    parts.current.snapshot_restored()


def averaged_model(state: TrainState) -> Any:
    """The model of `state` with the moving average of its parameters in
    their place (see `DataParallelTrainer.ema_model`).

    Raises:
        ValueError: the state keeps no average.
    """
    if state.ema is None:
        raise ValueError(
            "ema_model: this trainer keeps no moving average of the weights; "
            "pass DataParallelTrainer(..., ema=0.999) to keep one"
        )
    return state.averaged_model


def set_state(parts: TrainerParts, state: TrainState) -> None:
    """Make `state` (of the trainer's structure) the run's, at its step."""
    leaves = checked_leaves(parts.layout, state)
    step = int(jax.device_get(state.step))
    parts.slot.put(
        Run(
            parts.copy(put_state(leaves, parts.layout.shardings)),
            dataclasses.replace(parts.slot.progress, step=step),
        )
    )


def program_for(parts: TrainerParts, batch: Any) -> Program:
    """The trainer's program, built for `batch` if it has none yet (to
    trace, evaluate or inspect with: `fit` compiles its own)."""
    programs = parts.programs
    program = programs.first
    if program is None:
        program = first_program(parts.pipeline, programs, batch, "batch", compile=False)
    return program


def flops_for(parts: TrainerParts, batch: Any) -> StepFlops | None:
    """The train step's FLOPs for batches like `batch` (None: those last
    trained on; None before any)."""
    pipeline, programs = parts.pipeline, parts.programs
    size = pipeline.size
    if batch is not None:
        program_for(parts, batch)
        size = pipeline.size_of(batch, "batch")
    program = programs.first
    if program is None or size is None:
        return None
    return programs.flops(program, size)


def lower_for(parts: TrainerParts, batch: Any) -> jax.stages.Lowered:
    """The train step lowered for `batch`, from the run's state."""
    program = program_for(parts, batch)
    placed = parts.pipeline.prepare(batch, "batch", None)
    sums = parts.programs.epoch_sums(program)
    return program.traced.lower(
        parts.slot.leaves, *sums, placed.leaves, placed.weight, placed.total
    )


def step_values(parts: TrainerParts, batch: Any) -> StepValues:
    """What a training step on `batch` computes from the run's state."""
    program = program_for(parts, batch)
    placed = parts.pipeline.prepare(batch, "batch", None, train=True)
    return parts.programs.values(
        program, parts.slot.leaves, placed.leaves, placed.weight, placed.total
    )


def evaluate_data(
    parts: TrainerParts, data: Iterable[Any], *, depth: int, sync_every: int
) -> HostMetrics:
    """Loss and metrics over every example of `data`, from the run's state."""
    return evaluate(
        parts.pipeline,
        parts.programs,
        parts.slot.leaves,
        data,
        "data",
        depth=depth,
        sync_every=sync_every,
    )


@validates_own_arguments
def predict_with(parts: TrainerParts, x: Any, batch_size: int | None) -> Any:
    """The model's outputs for every row of `x`, from the run's state."""
    return predict_inputs(
        x,
        batch_size,
        programs=parts.programs,
        pipeline=parts.pipeline,
        state=parts.slot.leaves,
    )


def step_memory(parts: TrainerParts, batch: Any) -> StepMemory | None:
    """What a train step on batches like `batch` takes on each device: read
    from the fit's compiled program of that step size where there is one,
    else compiled from the step lowered for `batch` (nothing runs)."""
    program_for(parts, batch)
    program = parts.programs.get(parts.pipeline.size_of(batch, "batch"))
    if program is not None and program.compiled and program.train_many is None:
        return StepMemory.of_stats(program.memory)
    return StepMemory.of(lower_for(parts, batch).compile())


def summary_of(
    parts: TrainerParts,
    state: TrainState,
    step: StepMemory | None,
    flops: StepFlops | None,
) -> ModelSummary:
    """The summary of the run's `state` (see `DataParallelTrainer.summary`),
    with the layout lint's lines."""
    layout = parts.layout
    strategy = parts.strategy
    lint = layout_warnings(
        leaf_names(layout.treedef),
        layout.structs,
        layout.shardings,
        strategy.split_min_size(),
        stacked_leaves(layout.treedef),
    )
    return summarize(layout, state, strategy, step, flops=flops, warnings=tuple(lint))
