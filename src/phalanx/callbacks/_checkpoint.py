"""`px.callbacks.Checkpoint`: when a run saves its snapshots, and what ranks them.

The callback is the save policy only: every ``every_n_steps`` steps, every
``every_n_epochs`` epochs, after each ``eval_every`` evaluation of its
``monitor``, and which metrics rank each save. Writing, keeping and reading
back are its `CheckpointFolder`'s (`phalanx.checkpoint`), and a resume takes
`find_snapshot`, the path ``fit(resume=)`` takes; it changes the trainer only
through `trainer.restore`.
"""

import os
from pathlib import Path
from typing import Any, Literal, final

from typing_extensions import override

from .._state._snapshot import Snapshot
from .._typing import HostMetrics, validates_own_arguments
from .._validate import one_of, optional_positive_int, positive_int
from ..checkpoint._folder import CheckpointFolder
from ..checkpoint._resume import find_snapshot, restore_run
from ..checkpoint._store import SnapshotStore
from ._base import Callback, StepInfo, TrainerLike
from ._watch import monitored_number


@final
class Checkpoint(Callback, SnapshotStore):
    """Saves full training snapshots with orbax, for exact resume.

    A snapshot holds the `TrainState` (parameters, model state, optimizer
    state, step, PRNG key), the running sums of a part-done epoch, the
    trainer's counters, plan and history, the data loader's `state_dict`,
    every stateful callback's `state_dict`, and metadata (phalanx version,
    model class, strategy, device count). Saves are asynchronous: a save
    copies the arrays (a small state on CPU devices into host memory, else
    queued on a device, not waited for) and returns, and a writer thread
    hands the copy to orbax, which writes while training goes on (the cost:
    "What a save costs" in the checkpoints guide). They are
    atomic: a step folder appears only when complete. The newest `keep` are
    kept, or with `monitor` the best `keep` by it: epoch-end checkpoints,
    or in a fit evaluating every ``eval_every`` steps (an ``eval_`` monitor),
    a checkpoint saved after each evaluation.
    Checkpoint callbacks run after all others, so a snapshot includes what
    the loggers wrote for its step.

    Resume with ``trainer.fit(..., resume="latest")``; a snapshot restores
    onto any strategy and device count.

    Example:
        ```python
        ckpt = px.callbacks.Checkpoint("runs/a/checkpoints", every_n_steps=100)
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[ckpt])
        trainer.fit(loader, epochs=10, resume="latest")  # fresh or continued
        ```
    """

    # What a save blocks the loop for (the rest is written in the background).
    time_phase = "checkpoint"

    @validates_own_arguments
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        keep: int = 3,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
    ):
        """
        Args:
            directory: the folder of this run's checkpoints (created if needed).
            every_n_steps: save after every this many steps (None: never);
                with ``steps_per_call > 1``, at the end of the compiled call
                that reaches such a step.
            every_n_epochs: save after every this many epochs (None: never).
            keep: how many checkpoints to keep.
            monitor: an epoch metric (e.g. ``"eval_loss"``): keep the best
                `keep` epoch-end checkpoints by it, and the newest checkpoint
                of any kind (to resume from), instead of the newest `keep`.
                An ``eval_`` metric of ``fit(eval_every=N)``: save after each
                evaluation (at its step), and keep the best `keep` of those.
            mode: ``"min"`` or ``"max"``: which `monitor` values are best.

        Raises:
            TypeError, ValueError: a bad argument (the message names it).
        """
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory={directory!r} must be a str or path")
        every_n_steps = optional_positive_int("every_n_steps", every_n_steps)
        every_n_epochs = optional_positive_int("every_n_epochs", every_n_epochs)
        keep = positive_int("keep", keep, example="keep=3")
        mode = one_of("mode", mode, ("min", "max"))
        self.directory = Path(directory).absolute()
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep = keep
        self.monitor = monitor
        self.mode = mode
        self._folder = CheckpointFolder(
            self.directory, keep=keep, monitor=monitor, mode=mode
        )
        # A multiple of every_n_steps was reached inside a compiled call of
        # several steps, or an evaluation ranks a save: saved when the call's
        # last step is reported.
        self._due = False
        # The metrics of fit's last evaluation every eval_every steps, and its
        # step: the save at that step is ranked by them.
        self._evaluation: tuple[int, HostMetrics] | None = None

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """Nothing: it only reads its monitor."""
        return ()

    @override
    def monitors(self) -> tuple[str, ...]:
        """The metric that ranks the saves, `monitor`, if any."""
        return () if self.monitor is None else (self.monitor,)

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._due = False
        self._evaluation = None
        self._folder.start()
        self._folder.prepare(info.snapshot())

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._folder.raise_failed()  # a failed save stops training now
        if self.every_n_steps and info.step % self.every_n_steps == 0:
            self._due = True
        if self._due and info.last_in_call:  # the state is this step's
            self._due = False
            self.save_snapshot(info.snapshot(), metrics=self._ranking(info))

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        # An evaluation every eval_every steps comes before its step's
        # on_step_end, where the state (and every other callback) is saved.
        monitor = self.monitor
        if info.eval_every is not None and monitor and monitor in info.metrics:
            self._evaluation = (info.step, dict(info.metrics))
            self._due = True

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        if self.every_n_epochs and (info.epoch + 1) % self.every_n_epochs == 0:
            metrics: HostMetrics | None = info.metrics
            if (
                info.eval_every is not None
                and self.monitor is not None
                and self.monitor not in info.metrics
            ):  # ranked by the evaluations: this one only if it is one's step
                metrics = self._ranking(info)
            self.save_snapshot(info.snapshot(), metrics=metrics)

    def _ranking(self, info: StepInfo) -> HostMetrics | None:
        """The metrics ranking a save at this step: its evaluation's, if any."""
        evaluation = self._evaluation
        return evaluation[1] if evaluation and evaluation[0] == info.step else None

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        """`fit` returns once every save is on disk (or raises the one that
        failed)."""
        del info
        self.close()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        """The saves made before the failure are committed: a resume goes on
        from the newest."""
        del info, error
        self.close()

    def save(
        self,
        trainer: TrainerLike,
        *,
        metrics: HostMetrics | None = None,
        wait: bool = False,
    ) -> Path:
        """Save a snapshot of `trainer` as it is now (see `save_snapshot`)."""
        return self.save_snapshot(trainer.snapshot(), metrics=metrics, wait=wait)

    @override
    def save_snapshot(
        self,
        snapshot: Snapshot,
        *,
        metrics: HostMetrics | None = None,
        wait: bool = False,
    ) -> Path:
        """Save `snapshot` without waiting for the devices or the disk; with
        `wait`, return once it is committed.

        Args:
            metrics: the epoch's or evaluation's metrics, which rank the save
                by `monitor` (None: unranked).

        Returns:
            The step folder it is (being) written to.

        Raises:
            KeyError: `metrics` lack `monitor`.
            TypeError: `monitor` is an array (a confusion matrix).
            CheckpointWriteError: this save, or one before it, failed.
        """
        if (
            self.monitor is not None
            and metrics is not None
            and self.monitor not in metrics
        ):
            raise KeyError(
                f"monitor={self.monitor!r} is not among the epoch metrics "
                f"{sorted(metrics)}; pass one of them, e.g. monitor='eval_loss'"
            )
        if self.monitor is not None and metrics is not None:
            monitored_number(metrics[self.monitor], self.monitor)
        return self._folder.save(snapshot, metrics, wait=wait)

    def check(self, trainer: TrainerLike, resume: Any = "latest") -> Path | None:
        """Read the checkpoint `restore` would load, without changing anything
        (for tools that refuse a bad resume before starting).

        Returns:
            Its step folder, to pass to `fit`'s ``resume=``; None where
            ``resume="latest"`` finds no checkpoint yet.

        Raises:
            FileNotFoundError: as `restore`.
            ValueError: as `restore`.
        """
        restored = self._folder.read(trainer.snapshot(), resume)
        return None if restored is None else restored.path

    def restore(self, trainer: TrainerLike, resume: Any, data: Any = None) -> None:
        """Load a checkpoint into `trainer` (its state, progress, history and
        callbacks) and, where it is `Resumable`, into `data`: what
        ``fit(resume=)`` does before it trains (and, as it does, say so in
        one line: ``resumed from step N (epoch E) of PATH``).

        Args:
            resume: ``"latest"`` (this callback's newest readable checkpoint;
                with none yet, the trainer starts fresh and says so), or the
                path of a checkpoint folder or of one step in it.

        Raises:
            FileNotFoundError: a path with no complete checkpoint in it.
            ValueError: the checkpoint is from another model or optimizer, or
                of a run whose updates `trainer` would make otherwise
                (another ``ema``, ``precision``, ``loss``, ``param_groups``
                or learning rate), or cannot be read or holds what no save
                writes (the message names the path and why), or `data`
                refuses its position (another ``batch_size``). The trainer
                and `data` are then as they were.
        """
        snapshot = find_snapshot(resume, trainer.snapshot(), (self,))
        if snapshot is not None:
            restore_run(snapshot, trainer.restore, data)

    @override
    def load_snapshot(
        self, resume: str | os.PathLike[str], like: Snapshot
    ) -> Snapshot | None:
        """The snapshot `resume` names (``"latest"``: this callback's newest
        readable checkpoint), laid out as `like`; None (and a note saying
        the run starts fresh) where ``"latest"`` finds none yet.

        Raises:
            FileNotFoundError: as `restore`.
            ValueError: as `restore`.
        """
        return self._folder.load(resume, like)

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager.

        Raises:
            CheckpointWriteError: a save failed (and was not raised before).
        """
        self._folder.close()
