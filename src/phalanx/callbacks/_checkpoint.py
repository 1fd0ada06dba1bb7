import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, final

import jax
import orbax.checkpoint as ocp
from typing_extensions import override

from .._typing import validates_own_arguments
from ..checkpoint._snapshot import (
    check_compatible,
    item_handlers,
    read_host,
    restore,
    snapshot,
)
from ._background import lower_priority, thread_ids
from ._callback import Callback, StepInfo


if TYPE_CHECKING:
    from .._trainer import DataParallelTrainer


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
    kept, or with `monitor` the best `keep` epoch-end checkpoints.
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
        """Args:
        directory: the folder of this run's checkpoints (created if needed).
        every_n_steps: save after every this many steps (None: never).
        every_n_epochs: save after every this many epochs (None: never).
        keep: how many checkpoints to keep.
        monitor: an epoch metric (e.g. ``"eval_loss"``): keep the best
            `keep` epoch-end checkpoints by it, and the newest checkpoint
            of any kind (to resume from), instead of the newest `keep`.
        mode: ``"min"`` or ``"max"``: which `monitor` values are best.

        Raises:
            TypeError, ValueError: a bad argument (the message names it).
        """
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory={directory!r} must be a str or path")
        for name, value in (
            ("every_n_steps", every_n_steps),
            ("every_n_epochs", every_n_epochs),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name}={value!r} must be a positive int or None")
        if not _positive_int(keep):
            raise ValueError(f"keep={keep!r} must be an int >= 1, e.g. keep=3")
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
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

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        del info
        self._writable()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if self.every_n_steps and info.step % self.every_n_steps == 0:
            self.save(info.trainer)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        if self.every_n_epochs and (info.epoch + 1) % self.every_n_epochs == 0:
            self.save(info.trainer, metrics=info.metrics)

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
        trainer: "DataParallelTrainer",
        *,
        metrics: dict[str, float] | None = None,
        wait: bool = False,
    ) -> Path:
        """Save a snapshot of `trainer` as it is now, without waiting for the
        devices or the disk; with `wait`, return once it is committed.

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
        states = {
            f"{i}:{type(c).__name__}": getattr(c, "state_dict")()  # noqa: B009
            for i, c in enumerate(trainer.callbacks)
            if c is not self and callable(getattr(c, "state_dict", None))
        }
        step = trainer._step
        # Taken now, at the step boundary: the JSON part, and a copy of the
        # arrays queued on the devices (the next step donates the originals).
        args = snapshot(trainer, trainer._data, states)
        metrics = None if metrics is None else dict(metrics)
        # At most one snapshot waits for the writer (each holds a copy of
        # the state); a failed save raises here.
        self._wait_for_writer()
        if jax.process_count() > 1:
            # Orbax synchronises processes with collectives of its own, which
            # must run in the same order as training's on every process.
            self._write(step, args, metrics)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, "phalanx-checkpoint")
            self._pending = self._writer.submit(self._write, step, args, metrics)
        if wait:
            self._wait()
        return self.directory / str(step)

    def _write(
        self, step: int, args: ocp.args.Composite, metrics: dict[str, float] | None
    ) -> None:
        """Hand one snapshot to orbax (on the writer thread; on the training
        thread in a multi-process run)."""
        manager = self._open()
        # orbax waits for the previous save before starting one anyway; wait
        # first so that a save of this same step in flight is seen as done.
        manager.wait_until_finished()
        self._empty_trash()
        if step in manager.all_steps():
            # Saved after this very step already (an every_n_steps save at an
            # epoch's last step): resuming from it replays the epoch's end
            # exactly. Only a ranking by `monitor` needs this epoch's metrics
            # on it: then it is saved again. The old folder leaves by an
            # atomic rename first: a kill in between leaves the previous
            # checkpoint as the latest, never a half-written one.
            if self.monitor is None or metrics is None:
                return
            manager.delete(step)
            self._empty_trash()
        manager.save(step, args=args, metrics=metrics, force=True)
        # Orbax's writer threads (those started since the manager was made)
        # yield the cores to training; threads they start inherit it.
        threads = thread_ids()
        lower_priority(threads - self._threads)
        self._threads = threads

    def _wait_for_writer(self) -> None:
        """Wait until the writer thread has handed every snapshot to orbax;
        raise the error of one that failed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _wait(self) -> None:
        """Wait until every save so far is committed; raise if one failed."""
        self._wait_for_writer()
        if self._manager is not None:
            self._manager.wait_until_finished()

    def check(self, trainer: "DataParallelTrainer", resume: Any = "latest") -> None:
        """Raise as `restore` would, without changing anything (for tools that
        want to refuse a bad resume before starting)."""
        self._restore(trainer, resume, apply=False)

    def restore(self, trainer: "DataParallelTrainer", resume: Any, data: Any) -> None:
        """Load a checkpoint into `trainer`, `data` and the trainer's callbacks.

        Args:
            resume: ``"latest"`` (this callback's newest complete checkpoint),
                or the path of a checkpoint folder or of one step in it.

        Raises:
            FileNotFoundError: no such folder, or no complete checkpoint in it.
            ValueError: the checkpoint is from another model or optimizer, or
                cannot be read (the message names the path).
        """
        host = self._restore(trainer, resume, apply=True)
        if host["data"] is not None and hasattr(data, "load_state_dict"):
            data.load_state_dict(host["data"])
        for i, callback in enumerate(trainer.callbacks):
            state = host["callbacks"].get(f"{i}:{type(callback).__name__}")
            load = getattr(callback, "load_state_dict", None)
            if state is not None and callable(load):
                load(state)

    def _restore(
        self, trainer: "DataParallelTrainer", resume: Any, *, apply: bool
    ) -> dict[str, Any]:
        folder, step = self._locate(resume)
        with ocp.CheckpointManager(folder) as manager:
            if step is None:
                step = manager.latest_step()
            if step is None or step not in manager.all_steps():
                raise FileNotFoundError(
                    f"resume={str(resume)!r}: no complete checkpoint in {folder}; "
                    "start without resume, or point at a folder a Checkpoint wrote"
                )
            where = folder / str(step)
            with _unreadable(resume, where):
                host = read_host(manager, step)
            check_compatible(trainer, host, str(where))
            if apply:
                with _unreadable(resume, where):
                    restore(trainer, manager, step, host)
        return host

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager."""
        try:
            self._wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
            if self._manager is not None:
                self._manager.close()
                self._manager = None
                self._empty_trash()

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._threads = thread_ids()  # training's, before orbax starts any
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                preservation_policy=self._preservation(),
                # With a best_fn orbax writes each save's metrics, so that a
                # resumed run still ranks the earlier checkpoints.
                best_fn=None if self.monitor is None else self._metric,
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

    def _preservation(
        self,
    ) -> (
        ocp.checkpoint_managers.LatestN | ocp.checkpoint_managers.AnyPreservationPolicy
    ):
        """Which checkpoints stay: the newest `keep`; with `monitor`, the best
        `keep` epoch ends by it, and the newest checkpoint (to resume from)."""
        policies = ocp.checkpoint_managers
        if self.monitor is None:
            return policies.LatestN(n=self.keep)
        best = policies.BestN(
            get_metric_fn=self._metric,
            reverse=self.mode == "min",  # the best sort last
            n=self.keep,
            keep_checkpoints_without_metrics=False,
        )
        return policies.AnyPreservationPolicy([best, policies.LatestN(n=1)])

    def _metric(self, metrics: dict[str, float]) -> float:
        return metrics[self.monitor]  # pyright: ignore[reportArgumentType]

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

    def _locate(self, resume: Any) -> tuple[Path, int | None]:
        if resume == "latest":
            folder, step = self.directory, None
        else:
            path = Path(resume).absolute()
            if path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists():
                folder, step = path.parent, int(path.name)
            else:
                folder, step = path, None
        if not folder.is_dir():
            raise FileNotFoundError(
                f"resume={str(resume)!r}: checkpoint folder {folder} does not exist; "
                "start without resume, or pass the folder a Checkpoint wrote"
            )
        return folder, step


@contextlib.contextmanager
def _unreadable(resume: Any, where: Path) -> Iterator[None]:
    """Report any error reading checkpoint `where` as one clear ValueError
    (orbax reports missing or damaged files with several types, including a
    bare Exception)."""
    try:
        yield
    except Exception as error:
        raise ValueError(
            f"resume={str(resume)!r}: checkpoint {where} cannot be read ({error}); "
            "it may be corrupt: resume from an older step folder, or start again"
        ) from error


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
