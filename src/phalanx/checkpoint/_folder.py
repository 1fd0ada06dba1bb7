"""A folder of training snapshots, written by orbax in the background.

`CheckpointFolder` is the store behind `px.callbacks.Checkpoint`: orbax's
`CheckpointManager` over the folder, which checkpoints it keeps
(`_retention.py`), the writer thread that hands each save to orbax while
training goes on (`_writer.py`), one clear error for a failed write
(`_errors.py`), and reading a snapshot back (`_resume.py`). It decides how
a snapshot is written, kept and read, never when one is saved (the
callback's policy), and it never touches the trainer.
"""

import functools
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, final

import jax
import orbax.checkpoint as ocp

from .._log import logger
from .._state._snapshot import Snapshot
from .._typing import HostMetrics, scalar_metrics
from ..strategies._placement import single_process
from ._errors import (
    CheckpointWriteError,
    quiet_orbax_errors,
    release_failed_io,
    write_error,
)
from ._items import SaveItems, item_handlers, save_compiler, save_items
from ._resume import Restored, is_step_folder, read_checkpoint, said_resumed
from ._retention import metric_fn, retention
from ._writer import WriterThread, lower_priority, thread_ids


# The subfolder orbax moves retired steps into before phalanx deletes them.
TRASH = "retired"


@final
class CheckpointFolder:
    """The checkpoints of one run, one step folder each, in `directory`.

    Saves are asynchronous: `save` copies the arrays (`_packing.py`) and
    returns, and a writer thread hands the copy to orbax, which writes while
    training goes on. They are atomic: a step folder appears only when
    complete. The newest `keep` are kept, or with `monitor` the best `keep`
    ranked by it and the newest of any kind. A failed save raises one
    `CheckpointWriteError`, once, at the next call that waits for it.
    """

    def __init__(self, directory: Path, *, keep: int, monitor: str | None, mode: str):
        self.directory = directory
        self._keep = keep
        self._monitor = monitor
        self._mode = mode
        self._manager: ocp.CheckpointManager | None = None
        self._threads: set[int] = set()
        self._writer = WriterThread("phalanx-checkpoint")
        # How many saves may be pending on the writer (see `save`).
        self._queue = 1
        # The failed save's error, once raised: closing must not raise it again.
        self._failure: BaseException | None = None
        self._last_step = 0  # the step of the newest save handed to orbax
        # Steps whose checkpoints a resume found unreadable: saved anew.
        self._damaged: set[int] = set()

    def start(self) -> None:
        """Before a fit: forget an earlier fit's failed save, and fail now
        (PermissionError) if the folder cannot be written."""
        self._failure = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as error:
            raise PermissionError(
                f"Checkpoint directory={str(self.directory)!r} is not writable "
                f"({error.strerror}); choose a folder you can write to"
            ) from None

    def prepare(self, snapshot: Snapshot) -> None:
        """Compile the copy a save of snapshots shaped as `snapshot` makes, on
        the writer thread while training goes on: the first save then copies
        without compiling (~20-50 ms, ~1% of a short run)."""
        if not single_process():  # (across processes, saves run in step)
            return
        compile_pack = save_compiler(snapshot)
        if compile_pack is not None:
            self._writer.submit(functools.partial(_compile, compile_pack))

    def raise_failed(self) -> None:
        """Raise the error of a save that has failed by now (without waiting
        for one still being written): a failed save stops training."""
        self._raise_once(self._writer.failed())

    def save(
        self, snapshot: Snapshot, metrics: HostMetrics | None, *, wait: bool
    ) -> Path:
        """Save `snapshot` (ranked by `metrics`, if given) without waiting for
        the devices or the disk; with `wait`, return once it is committed.

        Returns:
            The step folder it is (being) written to.
        """
        step = snapshot.progress.step
        # Each snapshot waiting for the writer holds a copy of the state: a
        # small one on the host (~0.5 MB for the default CLI) may wait beside
        # the one being written, so that a write that runs long (the writer
        # yields the cores to training and to other processes) does not hold
        # up the next save; a larger one waits for the one before it. A
        # failed save raises here. (First: `prepare`'s compile, which may
        # still be running there.)
        self._raise_once(self._writer.wait(self._queue - 1))
        # Taken now, at the step boundary: the JSON part, and a copy of the
        # arrays (on the host, or queued on a device: the next step donates
        # the originals).
        items = save_items(snapshot)
        self._queue = 2 if items.on_host else 1
        numbers = None if metrics is None else scalar_metrics(metrics)
        if not single_process():
            # Orbax synchronises processes with collectives of its own, which
            # must run in the same order as training's on every process.
            self._write(step, items, numbers, commit=False)
        else:
            write = functools.partial(self._write, step, items, numbers, commit=True)
            self._writer.submit(write)
        if wait:
            self.wait()
        return self.directory / str(step)

    def _write(
        self,
        step: int,
        items: SaveItems,
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
                if not damaged and (self._monitor is None or metrics is None):
                    return
                manager.delete(step)
                self._damaged.discard(step)
                self._empty_trash()
            self._last_step = step
            if metrics is None and self._monitor is not None:
                # Unranked (a mid-epoch save, an epoch end between two
                # evaluations): empty metrics, as `retention` expects. Given
                # none, orbax logs "Requested `tracked_metric`; did not
                # provide metrics." at every such save once it tracks a best.
                metrics = {}
            manager.save(step, args=items.orbax_args(), metrics=metrics, force=True)
            # Orbax's writer threads (those started since the manager was
            # made) yield the cores to training; threads they start inherit it.
            threads = thread_ids()
            lower_priority(threads - self._threads)
            self._threads = threads
            if commit:
                manager.wait_until_finished()
                # The step this save retired, removed now, between saves: not
                # on the way of the next (the one a fit's end waits for).
                self._empty_trash()
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

    def wait(self) -> None:
        """Wait until every save so far is committed; raise if one failed."""
        self._raise_once(self._writer.wait())
        if self._manager is not None:
            try:
                self._manager.wait_until_finished()
            except Exception as error:
                self._raise_once(self._write_failed(self._last_step, error))

    def read(self, like: Snapshot, resume: Any) -> Restored | None:
        """The checkpoint `resume` names (``"latest"``: this folder's newest
        readable one), laid out as `like`; None where ``"latest"`` finds none.
        Steps of this folder skipped as unreadable are saved anew later."""
        restored = read_checkpoint(like, resume, self.directory)
        if restored is not None and restored.path.parent == self.directory:
            self._damaged.update(restored.skipped)
        return restored

    def load(self, resume: Any, like: Snapshot) -> Snapshot | None:
        """As `read`, the snapshot alone, and a line saying what it resumes
        (``resumed from step N (epoch E) of PATH``); where ``"latest"`` finds
        none, a note says that the run starts fresh."""
        restored = self.read(like, resume)
        if restored is None:
            if jax.process_index() == 0:
                logger.info(
                    f"resume='latest': no checkpoint in {self.directory} yet; "
                    "starting fresh"
                )
            return None
        said_resumed(restored)
        return restored.snapshot

    def close(self) -> None:
        """Wait for pending saves to be committed, then release the manager."""
        try:
            self.wait()
        finally:
            self._writer.shutdown()
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
            monitor = self._monitor
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True,
                # Folders are made by the save call itself, so that a folder
                # that cannot be made fails that call. Made in the background,
                # the failure left orbax's other threads waiting for it, and
                # the process could never exit (they are not daemons).
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                preservation_policy=retention(self._keep, monitor, self._mode),
                # With a best_fn orbax writes each save's metrics, so that a
                # resumed run still ranks the earlier checkpoints.
                best_fn=None if monitor is None else metric_fn(monitor, self._mode),
                best_mode=self._mode,
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


def _compile(compile_pack: Callable[[], None]) -> None:
    """Run `compile_pack`; a failure is not a failed save: the save's own
    copy compiles again, on the training thread, and raises it there."""
    try:
        compile_pack()
    except Exception:
        logger.debug("compiling a checkpoint's copy ahead of the save failed")


def _children(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:
        return []
