import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, final

import jax
import orbax.checkpoint as ocp
from typing_extensions import override

from .._log import logger
from .._state._snapshot import Snapshot
from .._typing import HostMetrics, validates_own_arguments
from .._validate import one_of, optional_positive_int, positive_int
from ..checkpoint._errors import (
    CheckpointWriteError,
    quiet_orbax_errors,
    release_failed_io,
    write_error,
)
from ..checkpoint._items import item_handlers, save_args
from ..checkpoint._resume import Restored, is_step_folder, read_checkpoint
from ..checkpoint._retention import metric_fn, retention
from ..checkpoint._writer import lower_priority, thread_ids
from ..data import Resumable
from ..strategies._placement import single_process
from ._base import Callback, StepInfo, TrainerLike


# The subfolder orbax moves retired steps into before phalanx deletes them.
TRASH = "retired"


@final
class Checkpoint(Callback):
    """Saves full training snapshots with orbax, for exact resume.

    A snapshot holds the `TrainState` (parameters, model state, optimizer
    state, step, PRNG key), the running sums of a part-done epoch, the
    trainer's counters, plan and history, the data loader's `state_dict`,
    every stateful callback's `state_dict`, and metadata (phalanx version,
    model class, strategy, device count). Saves are asynchronous: a save
    queues a copy of the arrays on the devices and returns, and a writer
    thread hands it to orbax, which writes while training goes on. They are
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
        self._manager: ocp.CheckpointManager | None = None
        self._threads: set[int] = set()
        # Saves are handed to one writer thread, in order: training goes on
        # while it waits for the device and hands the arrays to orbax.
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        # The failed save's error, once raised: closing must not raise it again.
        self._failure: BaseException | None = None
        self._last_step = 0  # the step of the newest save handed to orbax
        # Steps whose checkpoints a resume found unreadable: saved anew.
        self._damaged: set[int] = set()
        # A multiple of every_n_steps was reached inside a compiled call of
        # several steps, or an evaluation ranks a save: saved when the call's
        # last step is reported.
        self._due = False
        # The metrics of fit's last evaluation every eval_every steps, and its
        # step: the save at that step is ranked by them.
        self._evaluation: tuple[int, HostMetrics] | None = None

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        del info
        self._failure = None
        self._due = False
        self._evaluation = None
        self._writable()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if self._pending is not None and self._pending.done():
            self._wait_for_writer()  # a failed save stops training now
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
        del info
        self.close()

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
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

    def save_snapshot(
        self,
        snapshot: Snapshot,
        *,
        metrics: HostMetrics | None = None,
        wait: bool = False,
    ) -> Path:
        """Save `snapshot` without waiting for the devices or the disk; with
        `wait`, return once it is committed.

        Returns:
            The step folder it is (being) written to.
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
        step = snapshot.progress.step
        # Taken now, at the step boundary: the JSON part, and a copy of the
        # arrays queued on the devices (the next step donates the originals).
        args = save_args(snapshot)
        metrics = None if metrics is None else dict(metrics)
        # At most one snapshot waits for the writer (each holds a copy of
        # the state); a failed save raises here.
        self._wait_for_writer()
        if not single_process():
            # Orbax synchronises processes with collectives of its own, which
            # must run in the same order as training's on every process.
            self._write(step, args, metrics, commit=False)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, "phalanx-checkpoint")
            self._pending = self._writer.submit(
                self._write, step, args, metrics, commit=True
            )
        if wait:
            self._wait()
        return self.directory / str(step)

    def _write(
        self,
        step: int,
        args: ocp.args.Composite,
        metrics: dict[str, float] | None,
        *,
        commit: bool,
    ) -> None:
        """Hand one snapshot to orbax (on the writer thread; on the training
        thread in a multi-process run); with `commit`, wait until it is
        written, so that a failed write fails this call."""
        try:
            manager = self._open()
            # orbax waits for the previous save before starting one anyway;
            # wait first so that a save of this same step in flight is seen
            # as done.
            manager.wait_until_finished()
            self._empty_trash()
            if step in manager.all_steps():
                # Saved after this very step already (an every_n_steps save at
                # an epoch's last step): resuming from it replays the epoch's
                # end exactly. Only a ranking by `monitor` needs this epoch's
                # metrics on it, and a damaged one (which resume skipped) must
                # be replaced: then it is saved again. The old folder leaves
                # by an atomic rename first: a kill in between leaves the
                # previous checkpoint as the latest, never a half-written one.
                damaged = step in self._damaged
                if not damaged and (self.monitor is None or metrics is None):
                    return
                manager.delete(step)
                self._damaged.discard(step)
                self._empty_trash()
            self._last_step = step
            if metrics is None and self.monitor is not None:
                # Unranked (a mid-epoch save, an epoch end between two
                # evaluations): empty metrics, as `retention` expects. Given
                # none, orbax logs "Requested `tracked_metric`; did not
                # provide metrics." at every such save once it tracks a best.
                metrics = {}
            manager.save(step, args=args, metrics=metrics, force=True)
            # Orbax's writer threads (those started since the manager was
            # made) yield the cores to training; threads they start inherit it.
            threads = thread_ids()
            lower_priority(threads - self._threads)
            self._threads = threads
            if commit:
                manager.wait_until_finished()
        except Exception as error:
            raise self._write_failed(step, error) from error

    def _write_failed(self, step: int, error: Exception) -> CheckpointWriteError:
        """The one error a failed save raises: what failed, and what is kept."""
        kept = [
            int(p.name)
            for p in _children(self.directory)
            if is_step_folder(p) and p.name != str(step)
        ]
        failure = write_error(error, self.directory, step, kept)
        failure.__cause__ = error
        return failure

    def _raise_once(self, error: BaseException | None) -> None:
        """Raise a failed save's error, once: the failures that follow from it
        (orbax re-raises it on every wait) are not news."""
        if error is not None and self._failure is None:
            self._failure = error
            raise error

    def _wait_for_writer(self) -> None:
        """Wait until the writer thread has handed every snapshot to orbax
        (and, in a single process, orbax has written it); raise the error of
        one that failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._raise_once(pending.exception())

    def _wait(self) -> None:
        """Wait until every save so far is committed; raise if one failed."""
        self._wait_for_writer()
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
            except Exception as error:
                self._raise_once(self._write_failed(self._last_step, error))

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
        restored = self._read(trainer.snapshot(), resume)
        return None if restored is None else restored.path

    def restore(self, trainer: TrainerLike, resume: Any, data: Any = None) -> None:
        """Load a checkpoint into `trainer` (its state, progress, history and
        callbacks) and, where it is `Resumable`, into `data`.

        Args:
            resume: ``"latest"`` (this callback's newest readable checkpoint;
                with none yet, the trainer starts fresh and says so), or the
                path of a checkpoint folder or of one step in it.

        Raises:
            FileNotFoundError: a path with no complete checkpoint in it.
            ValueError: the checkpoint is from another model or optimizer, or
                cannot be read (the message names the path and why).
        """
        snapshot = self.load_snapshot(resume, trainer.snapshot())
        if snapshot is None:
            return
        trainer.restore(snapshot)
        if snapshot.data is not None and isinstance(data, Resumable):
            data.load_state_dict(snapshot.data)

    def load_snapshot(self, resume: Any, like: Snapshot) -> Snapshot | None:
        """The snapshot `resume` names (``"latest"``: this callback's newest
        readable checkpoint), laid out as `like`; None (and a note saying
        the run starts fresh) where ``"latest"`` finds none yet.

        Raises:
            FileNotFoundError: as `restore`.
            ValueError: as `restore`.
        """
        restored = self._read(like, resume)
        if restored is None:
            if jax.process_index() == 0:
                logger.info(
                    f"resume='latest': no checkpoint in {self.directory} yet; "
                    "starting fresh"
                )
            return None
        return restored.snapshot

    def _read(self, like: Snapshot, resume: Any) -> Restored | None:
        restored = read_checkpoint(like, resume, self.directory)
        if restored is not None and restored.path.parent == self.directory:
            self._damaged.update(restored.skipped)
        return restored

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager."""
        try:
            self._wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
            if self._manager is not None:
                manager, self._manager = self._manager, None
                try:
                    manager.close()
                except Exception as error:
                    self._raise_once(self._write_failed(self._last_step, error))
                finally:
                    release_failed_io(self._failure)
                self._empty_trash()

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._threads = thread_ids()  # training's, before orbax starts any
            quiet_orbax_errors()
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                # Folders are made by the save call itself, so that a folder
                # that cannot be made fails that call. Made in the background,
                # the failure left orbax's other threads waiting for it, and
                # the process could never exit (they are not daemons).
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                preservation_policy=retention(self.keep, self.monitor, self.mode),
                # With a best_fn orbax writes each save's metrics, so that a
                # resumed run still ranks the earlier checkpoints.
                best_fn=None
                if self.monitor is None
                else metric_fn(self.monitor, self.mode),
                best_mode=self.mode,
                # A kill while orbax deletes an old step must not leave a
                # half-deleted folder that still lists as a checkpoint: orbax
                # renames it (atomic) into TRASH, which phalanx then empties.
                todelete_subdir=TRASH,
                # Temporary folders of saves a kill interrupted.
                cleanup_tmp_directories=True,
            )
            self._empty_trash()
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=item_handlers()
            )
        return self._manager

    def _empty_trash(self) -> None:
        """Remove the steps orbax has retired (by then no longer listed)."""
        shutil.rmtree(self.directory / TRASH, ignore_errors=True)

    def _writable(self) -> None:
        """Fail before training if checkpoints cannot be written."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as error:
            raise PermissionError(
                f"Checkpoint directory={str(self.directory)!r} is not writable "
                f"({error.strerror}); choose a folder you can write to"
            ) from None


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []
