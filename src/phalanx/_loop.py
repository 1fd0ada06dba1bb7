"""The training loop: a pass over the data, the bounded in-flight window, and
the epoch's logs. `DataParallelTrainer.fit` drives it; it reads and updates
the trainer's loop state (step, epoch, the epoch's on-device sums)."""

from collections.abc import Iterable, Sized
from typing import TYPE_CHECKING, Any

import jax

from ._batching import DeviceBatch
from ._checks import empty_data_message, nonfinite_error
from ._prefetch import Feed
from ._run import RunPlan
from ._sums import FLAGS, EpochSums, StepSums, means
from ._typing import HostMetrics
from .callbacks._callback import Callback, overrides


if TYPE_CHECKING:
    from ._trainer import DataParallelTrainer


def run_epoch(
    trainer: "DataParallelTrainer", data: Iterable[Any], eval_data: Any
) -> None:
    """Train on one pass over `data` (or its rest, after a resume), then
    evaluate, log the epoch and call `on_epoch_end`; return early when the
    fit's plan is done, a callback stops training, or a signal came."""
    epoch = trainer._epoch
    trainer._notify("on_epoch_start", trainer._info())
    step_hooks = [c for c in trainer._callbacks_here if overrides(c, "on_step_end")]
    # Resumed from a snapshot of the epoch's last step: only its end is left.
    done = isinstance(data, Sized) and 0 < len(data) <= trainer._epoch_steps
    # A plain re-iterable resumed mid-epoch restarts its epoch: skip what
    # was trained on (a stateful loader resumes by itself).
    skip = 0 if hasattr(data, "load_state_dict") else trainer._epoch_steps
    trainer._feed = Feed(
        trainer._batches,
        () if done else data,
        depth=trainer.prefetch,
        where=lambda i: f"batch {i} of epoch {epoch}",
        skip=skip,
        train=True,
    )
    try:
        with trainer._feed as batches:
            train_pass(trainer, batches, step_hooks)
    finally:
        trainer._feed = None
    if trainer._preempted is not None:
        return  # mid-epoch: the checkpoint keeps the epoch's sums
    if trainer._acc is None:
        raise ValueError(empty_data_message("data", epoch))
    logs = epoch_logs(trainer, jax.device_get(trainer._acc))
    trainer._acc, trainer._epoch_steps = None, 0
    if eval_data is not None:
        logs.update({f"eval_{k}": v for k, v in trainer.evaluate(eval_data).items()})
    trainer.history.append(logs)
    info = trainer._info(logs)
    trainer._epoch += 1
    trainer._notify("on_epoch_end", info)


def train_pass(
    trainer: "DataParallelTrainer",
    batches: Iterable[DeviceBatch],
    step_hooks: list[Callback],
) -> None:
    """A step per batch until the pass ends, the fit's plan is done, a
    callback stops training, or a signal came."""
    for placed in batches:
        acc = trainer._steps.train_acc() if trainer._acc is None else trainer._acc
        trainer._leaves, acc, sums = trainer._steps.train(
            trainer._leaves, acc, placed.leaves, placed.weight, placed.total
        )
        trainer._acc = acc
        trainer._step += 1
        trainer._epoch_steps += 1
        if trainer._step % trainer.sync_every == 0:
            sync(trainer, acc)
        if step_hooks:
            # Every process's examples (the slices are equal but for the
            # last batch of a pass, at most one example apart).
            info = trainer._info(
                StepSums(sums, trainer._steps.step_names),
                examples=placed.n * jax.process_count(),
            )
            for callback in step_hooks:
                callback.on_step_end(info)
        if trainer._preempted is not None:
            return
        if trainer.stop_training or trainer._run.done(trainer._step, None):
            return


def sync(trainer: "DataParallelTrainer", acc: EpochSums) -> None:
    """Wait for the device (bounded in-flight window); surface a bad step."""
    if trainer.nan_policy == "raise":
        raise_if_nonfinite(trainer, jax.device_get(acc.flags))
    else:
        jax.block_until_ready(acc.flags)


def epoch_logs(trainer: "DataParallelTrainer", acc: Any) -> HostMetrics:
    """The epoch's means from its sums, fetched (each divided once by the
    epoch's total weight)."""
    raise_if_nonfinite(trainer, acc.flags)
    # After a resume at an epoch's last step, the epoch ends before any batch
    # has built the steps: the names are then the checkpoint's.
    average = means(acc.sums, trainer._steps.sum_names)
    logs = {k: average[k] for k in ["loss", *sorted(set(average) - {"loss"})]}
    if trainer.nan_policy == "skip":
        logs["skipped_steps"] = float(acc.flags[FLAGS.index("skipped")])
    return logs


def raise_if_nonfinite(trainer: "DataParallelTrainer", flags: Any) -> None:
    """Raise FloatingPointError if a step had a non-finite gradient; the
    trainer's step goes back to it (its state was frozen there)."""
    _, step, leaf = (int(flag) for flag in flags)
    if step >= 0:
        trainer._step = step
        raise nonfinite_error(step, leaf, trainer.state.model)


def plan(data: Iterable[Any], run: RunPlan, step: int) -> tuple[int | None, int | None]:
    """A run's epochs, and its steps from its start, where known up front."""
    per_epoch = len(data) if isinstance(data, Sized) else None
    total = None
    if run.epochs is not None and per_epoch is not None:
        total = run.start_step + run.epochs * per_epoch
    if run.steps is not None:
        end = run.start_step + run.steps
        total = end if total is None else min(total, end)
    return run.epochs, None if total is None else max(total, step) - run.start_step
