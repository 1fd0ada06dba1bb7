"""A run's full snapshot as a value, and what stores snapshots."""

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ._progress import RunProgress
from ._state import TrainState
from ._typing import HostMetrics


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything needed to continue a run exactly.

    `DataParallelTrainer.snapshot` makes one and `DataParallelTrainer.restore`
    loads one; checkpoints convert them to files and back, and never touch
    the trainer itself.

    Attributes:
        state: the `TrainState`, its arrays on the devices as the strategy
            lays them out. Taken during `fit`, they are the run's own
            buffers, valid until its next step (which donates them): copy
            them (a checkpoint packs them at once) to keep them longer.
        progress: the `RunProgress`: counters, plan, the epoch's sums.
        history: the trainer's `History.state_dict()`.
        data: where the training data's loader stands (its `state_dict`),
            or None.
        callbacks: each callback's `state_dict`, by ``"index:ClassName"``.
        strategy: the strategy's class name (metadata).
        devices: the strategy's device count (metadata).
    """

    state: TrainState
    progress: RunProgress
    history: dict[str, Any]
    data: Any = None
    callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)
    strategy: str = ""
    devices: int = 0


@runtime_checkable
class SnapshotStore(Protocol):
    """Something that saves and loads snapshots (a callback, e.g.
    `px.callbacks.Checkpoint`). The trainer runs stores after every other
    callback, asks each to save at a preemption, and resumes from the
    first one."""

    def save_snapshot(
        self,
        snapshot: Snapshot,
        *,
        metrics: HostMetrics | None = None,
        wait: bool = False,
    ) -> Path:
        """Save `snapshot` (with `wait`, return once it is committed);
        return where it is (being) written."""
        ...

    def load_snapshot(
        self, resume: str | os.PathLike[str], like: Snapshot
    ) -> Snapshot | None:
        """The snapshot `resume` names (``"latest"`` or a path), its arrays
        laid out as `like`'s; None where ``"latest"`` finds none yet."""
        ...
