"""`SnapshotStore`: the capability of saving and loading a run's snapshots.

A callback that also subclasses `SnapshotStore` declares that it keeps
snapshots (`px.callbacks.Checkpoint` does); the trainer finds its stores by
that base class alone, never by probing for methods. This module defines the
contract only: it writes nothing, and knows nothing of orbax or of folders
(`_folder.py` is the orbax store; `_resume.py` finds the snapshot a fit
resumes from).
"""

import abc
import os
from pathlib import Path

from .._state._snapshot import Snapshot


class SnapshotStore(abc.ABC):
    """A callback that saves and loads `Snapshot`s, e.g.
    `px.callbacks.Checkpoint`.

    Subclass it beside `px.Callback` to declare a store of your own. The
    trainer runs stores after every other callback (so that a snapshot holds
    what the others did for its step), asks each to save, and waits, when a
    signal stops the run, and resumes ``fit(resume=)`` from the first one.

    Example:
        ```python
        class Remote(px.Callback, px.checkpoint.SnapshotStore):
            def save_snapshot(self, snapshot, *, wait=False): ...
            def load_snapshot(self, resume, like): ...
        ```
    """

    @abc.abstractmethod
    def save_snapshot(self, snapshot: Snapshot, *, wait: bool = False) -> Path:
        """Save `snapshot`; with `wait`, return only once it is committed.

        Returns:
            Where it is (being) written.
        """

    @abc.abstractmethod
    def load_snapshot(
        self, resume: str | os.PathLike[str], like: Snapshot
    ) -> Snapshot | None:
        """The snapshot `resume` names, its arrays laid out as `like`'s.

        Args:
            resume: ``"latest"`` (this store's newest readable snapshot) or
                the path of one.
            like: the restoring trainer's own snapshot (its strategy's
                layout, its model and optimizer).

        Returns:
            The snapshot; None where ``"latest"`` finds none yet (a run's
            first start).

        Raises:
            FileNotFoundError: `resume` names nothing this store holds.
            ValueError: the snapshot cannot be read, or is of another model
                or optimizer (the message says which, and what to do).
        """
