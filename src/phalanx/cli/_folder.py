"""The run folder of ``phalanx train`` (and ``phalanx find-lr``'s), left as
it was found when the run fails before its first step (nothing a failed
start writes stays behind), so that the same command works once the cause
is fixed.

It never removes what it did not write: an earlier run's files under
``--resume`` are restored as they were, and under ``--overwrite`` only
phalanx's own files of the earlier run are replaced, never another
program's.
"""

import os
import shutil
from pathlib import Path

from typing_extensions import override

from ..callbacks._base import Callback, StepInfo
from ._args import CONFIG_FILE


# Files `phalanx train` writes into a run folder; --overwrite replaces only these.
RUN_FILES = (
    CONFIG_FILE,
    "metrics.csv",
    "metrics.jsonl",
    "history.png",
    "tensorboard",
    "checkpoints",
    "profile",
    "timeline.json",
    "trace.json",
)
# Everything a run may write there: its files and W&B's (--logger wandb).
WRITTEN = (*RUN_FILES, "wandb")
# Files `phalanx find-lr` writes (and replaces, with --overwrite).
FIND_LR_FILES = ("lr_find.json", "lr_find.png")
# Files a resumed run rewrites before its first step (the loggers keep only
# their checkpointed rows): restored if it fails there.
REWRITTEN = (CONFIG_FILE, "metrics.csv", "metrics.jsonl")


class RunFolder:
    """A run folder that `undo` returns to how `create` found it, unless the
    run got as far as its first step or a checkpoint. `files`: the names
    the command writes there (``phalanx train``'s by default)."""

    def __init__(self, path: Path, *, resume: bool, files: tuple[str, ...] = WRITTEN):
        self.path = path
        self.resume = resume
        self.files = files
        # Added to the run's callbacks: it notes the first step.
        self.marker = FirstStep()
        self._made: Path | None = None  # the highest folder `create` made
        self._before: set[Path] | None = None  # None: nothing to undo here
        self._contents: dict[Path, bytes] = {}
        self._steps: set[str] = set()

    def create(self, *, main: bool) -> None:
        """Make the folder. On the main process (the one that writes the
        run's files) note what it holds first and, for a new run, remove
        an earlier run's files (--overwrite)."""
        missing = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        if not main:
            return
        self._made = missing[-1] if missing else None
        if not self.resume:
            _remove_earlier_run(self.path, self.files)
        self._before = set(self._written())
        if self.resume:
            self._contents = {
                path: path.read_bytes()
                for path in (self.path / name for name in REWRITTEN)
                if path.is_file()
            }
        self._steps = self._checkpoints()

    def undo(self) -> None:
        """After a failure: remove what the run wrote and restore what it
        rewrote, unless it completed a step or saved a checkpoint (then
        there is a run to continue with --resume). Best effort: a file
        that cannot be removed stays."""
        before = self._before
        if before is None or self.marker.reached or self._checkpoints() - self._steps:
            return
        self._before = None
        if self._made is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            # Folders above it that this run made, where nothing else was put.
            folder = self.path
            while folder != self._made:
                folder = folder.parent
                try:
                    folder.rmdir()
                except OSError:
                    break
            return
        for path in self._written():
            if path in before or not os.path.lexists(path):
                continue
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            except OSError:
                pass
        for path, contents in self._contents.items():
            try:
                if not path.is_file() or path.read_bytes() != contents:
                    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                    temporary.write_bytes(contents)
                    os.replace(temporary, path)
            except OSError:
                pass

    def _written(self) -> list[Path]:
        """Every path under the names a run writes, parents before their
        contents (symbolic links not followed)."""
        out = []
        for name in self.files:
            top = self.path / name
            if not os.path.lexists(top):
                continue
            out.append(top)
            if top.is_dir() and not top.is_symlink():
                for folder, dirs, files in os.walk(top):
                    out.extend(Path(folder, child) for child in (*dirs, *files))
        return out

    def _checkpoints(self) -> set[str]:
        folder = self.path / "checkpoints"
        if not folder.is_dir():
            return set()
        return {child.name for child in folder.iterdir() if child.name.isdigit()}


class FirstStep(Callback):
    """Notes that the fit completed a step."""

    def __init__(self):
        self.reached = False

    @override
    def on_step_end(self, info: StepInfo) -> None:
        del info
        self.reached = True


def _remove_earlier_run(run: Path, files: tuple[str, ...]) -> None:
    """The files of an earlier run in `run` that a new run would not replace
    itself (--overwrite), of those named in `files`: its logs, events,
    checkpoints and trace (W&B's folder is W&B's to keep)."""
    for name in files:
        if name == "tensorboard":
            for events in (run / name).glob("events.out.tfevents.*"):
                events.unlink()
        elif name == "checkpoints":
            for step in (run / name).glob("[0-9]*"):
                shutil.rmtree(step)
        elif name == "profile":
            shutil.rmtree(run / name, ignore_errors=True)
        elif name != "wandb":
            (run / name).unlink(missing_ok=True)
