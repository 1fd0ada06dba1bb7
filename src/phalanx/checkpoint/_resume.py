"""The one way a run resumes: finding and reading the snapshot it goes on from.

`find_snapshot` serves ``fit(resume=)``, `px.callbacks.Checkpoint.restore`
and (through `fit`) ``phalanx train --resume``: the first snapshot store
among the callbacks loads it, or, with none, the checkpoint folder `resume`
names is read. ``resume="latest"`` (or a checkpoint folder) takes the newest
checkpoint that reads back whole: a damaged newest one (a truncated file,
unreadable JSON) is skipped with a warning naming it and why, and the next
older one is tried. With nothing to resume from yet, ``"latest"`` starts
fresh (a first run of a script that resumes whenever it can); a path that
names no checkpoint is an error, as is a folder whose every checkpoint is
damaged. A checkpoint read to resume from is said in one line, ``resumed
from step N (epoch E) of PATH``. In a multi-process run every process takes
the same path: process 0's view of the folder decides, and a checkpoint
unreadable on one process is skipped on all (`_agreement.py`). This module
reads; it never sets anything on the trainer: `restore_run` hands the
snapshot to the trainer's ``restore`` once the data is back where the run had
read it to (the loader checks its position first). A checkpoint whose host
record holds what no save writes (a negative step, a malformed history) is
damaged as an unreadable one is (`check_host`).
"""

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .._log import logger
from .._state._snapshot import Snapshot
from .._typing import EvalSets
from ..data import Resumable
from ._agreement import PER_PROCESS, failed_on, from_process_zero
from ._errors import quiet_orbax_errors, release_failed_io, summary
from ._items import check_compatible, from_checkpoint, read_arrays, read_host
from ._store import SnapshotStore


def find_snapshot(
    resume: str | os.PathLike[str], like: Snapshot, stores: Sequence[SnapshotStore]
) -> Snapshot | None:
    """The snapshot `resume` names, laid out as `like`: loaded by the first of
    `stores`, or, with none, read from the checkpoint folder `resume` names.

    Args:
        resume: ``"latest"`` (the first store's newest readable snapshot) or
            the path of a checkpoint folder or of one step in it.
        like: the restoring trainer's own snapshot (`trainer.snapshot()`).
        stores: the snapshot stores among the trainer's callbacks.

    Returns:
        The snapshot, for the caller to restore (`restore_run`); None where
        ``"latest"`` finds none yet.

    Raises:
        ValueError: ``"latest"`` without a store to say where checkpoints
            are; as `read_checkpoint`.
        FileNotFoundError: as `read_checkpoint`.
    """
    if stores:
        return stores[0].load_snapshot(resume, like)
    if resume == "latest":
        raise ValueError(
            "resume='latest' needs a px.callbacks.Checkpoint in callbacks to "
            "know where checkpoints are; add one, or pass resume=PATH"
        )
    restored = read_checkpoint(like, resume, Path(resume).absolute())
    if restored is None:
        return None
    said_resumed(restored)
    return restored.snapshot


def restore_run(
    snapshot: Snapshot,
    restore: Callable[[Snapshot], None],
    data: Any,
    eval_sets: EvalSets = (),
) -> None:
    """Continue the run `snapshot` holds: its data first (`resume_data`),
    then the trainer (`restore`, the trainer's ``restore``).

    A loader checks the position it is given before it moves (another batch
    size, a position past its epoch), so a position it refuses leaves the
    trainer as it was; a snapshot the trainer then refuses puts the data
    back where it stood.

    Raises:
        ValueError, TypeError: as the loaders' ``load_state_dict`` and
            `restore`; nothing has changed then.
    """
    loaders = [data, *(batches for _, batches in eval_sets)]
    before = [(x, x.state_dict()) for x in loaders if isinstance(x, Resumable)]
    try:
        resume_data(snapshot, data, eval_sets)
        restore(snapshot)
    except BaseException:
        for loader, state in before:
            loader.load_state_dict(state)
        raise


def resume_data(snapshot: Snapshot, data: Any, eval_sets: EvalSets = ()) -> None:
    """Put `data` back where the snapshot's run had read it to, where it is a
    `Resumable` loader and the snapshot knows its position; and so each of
    `eval_sets` (``(prefix, data)``: a loader that shuffles then gives the
    next evaluation the order it gave the run's)."""
    if snapshot.data is not None and isinstance(data, Resumable):
        data.load_state_dict(own_data_state(snapshot.data))
    for prefix, batches in eval_sets:
        state = snapshot.eval_data.get(prefix)
        if state is not None and isinstance(batches, Resumable):
            batches.load_state_dict(state)


def own_data_state(state: Any) -> Any:
    """This process's part of a snapshot's data state: all of it, or its
    own entry where each process saved its own (`PER_PROCESS`).

    Raises:
        ValueError: each process saved its own, and there were not as many.
    """
    if not (isinstance(state, dict) and set(state) == {PER_PROCESS}):
        return state
    states, processes = state[PER_PROCESS], jax.process_count()
    if len(states) != processes:
        raise ValueError(
            f"the checkpoint holds the data positions of {len(states)} "
            f"processes, each in its own shard, and this run has {processes}: "
            "they do not carry over to another process count; resume on "
            f"{len(states)} processes, or read with px.data.GrainLoader, which "
            "resumes on any number"
        )
    return states[jax.process_index()]


def eval_positions(eval_sets: EvalSets | None) -> dict[str, Any]:
    """Where each `Resumable` set of `eval_sets` stands, by its prefix (what
    a snapshot keeps as its `eval_data`)."""
    return {
        prefix: batches.state_dict()
        for prefix, batches in eval_sets or ()
        if isinstance(batches, Resumable)
    }


def said_resumed(restored: "Restored") -> None:
    """The line that says what a run resumed from (on the first process)."""
    progress = restored.snapshot.progress
    if jax.process_index() == 0:
        # The epoch as the progress bar counts it: the one the run goes on in.
        logger.info(
            f"resumed from step {progress.step} (epoch {progress.epoch + 1}) of "
            f"{restored.path}"
        )


@dataclasses.dataclass(frozen=True)
class Restored:
    """A checkpoint read back: where it was, the snapshot it holds, and the
    newer steps skipped as unreadable."""

    path: Path
    snapshot: Snapshot
    skipped: tuple[int, ...] = ()


def locate(resume: Any, directory: Path) -> tuple[Path, int | None]:
    """The checkpoint folder `resume` means, and its step if it names one."""
    if resume == "latest":
        return directory, None
    path = Path(resume).absolute()
    if is_step_folder(path):
        return path.parent, int(path.name)
    return path, None


def is_step_folder(path: Path) -> bool:
    """Whether `path` is the folder of one complete checkpoint (a step)."""
    return path.name.isdigit() and (path / "_CHECKPOINT_METADATA").exists()


def read_checkpoint(like: Snapshot, resume: Any, directory: Path) -> Restored | None:
    """The newest readable checkpoint `resume` points at, its arrays laid out
    as `like`'s; None where ``resume="latest"`` finds no checkpoint at all.

    Raises:
        FileNotFoundError: a `resume` path with no checkpoint in it.
        ValueError: every checkpoint there is damaged (each is named, with
            why), or the checkpoint is of another model, optimizer or format.
    """
    folder, step = locate(resume, directory)
    shown = f"resume={str(resume)!r}"
    # What process 0 sees decides on every process (`_agreement.py`): a
    # process that saw the folder made by a faster one, which had found
    # nothing and gone on to train, would open a manager (a collective) the
    # others never join.
    if not from_process_zero(folder.is_dir()):  # (a manager would create it)
        if resume == "latest":
            return None
        raise FileNotFoundError(
            f"{shown}: checkpoint folder {folder} does not exist; start without "
            "resume, or pass the folder a Checkpoint wrote"
        )
    damaged: list[tuple[Path, str]] = []
    quiet_orbax_errors()
    with ocp.CheckpointManager(folder) as manager:
        complete = from_process_zero(sorted(manager.all_steps())[::-1])
        steps = complete if step is None else [step] if step in complete else []
        if not steps:
            if resume == "latest":
                return None
            raise FileNotFoundError(
                f"{shown}: no complete checkpoint in {folder}; start without "
                "resume, or point at a folder a Checkpoint wrote"
            )
        for candidate in steps:
            path = folder / str(candidate)
            # A step unreadable on any process is skipped on all.
            host, why = _attempt(read_host, manager, candidate)
            if why is not None:
                damaged.append((path, why))
                continue
            # Not a damaged file: this checkpoint is of another run.
            check_compatible(like, host, str(path))
            arrays, why = _attempt(read_arrays, like, manager, candidate, host)
            if why is not None:
                damaged.append((path, why))
                continue
            for skipped, why in damaged if jax.process_index() == 0 else ():
                # (Said once: every process skipped it, for the same reason.)
                logger.warning(
                    f"{shown}: skipped checkpoint {skipped}, which cannot be read "
                    f"({why}); resuming from {path}"
                )
            return Restored(
                path,
                from_checkpoint(like, host, arrays),
                tuple(int(p.name) for p, _ in damaged),
            )
    if step is not None:
        raise ValueError(
            f"{shown}: checkpoint {folder / str(step)} cannot be read "
            f"({damaged[0][1]}); it may be corrupt: resume from an older step "
            "folder, or start again"
        )
    reasons = "; ".join(f"step {path.name}: {why}" for path, why in damaged)
    raise ValueError(
        f"{shown}: no checkpoint in {folder} can be read ({reasons}); they may "
        "be corrupt: start again without resume"
    )


def _attempt(read: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """`read`'s result and None, or None and why it failed on this process
    or on another (every process returns a reason, or none, alike)."""
    try:
        result, why = read(*args), None
    except Exception as error:
        result, why = None, _why(error)
    why = failed_on(why)
    return (None, why) if why is not None else (result, None)


def _why(error: Exception) -> str:
    """Why a checkpoint cannot be read, in a few words; the failed read's
    unfinished work is let go of first."""
    release_failed_io(error)
    return summary(error)
