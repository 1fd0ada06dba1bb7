"""A run as one value, and the one place a trainer keeps it.

A `Run` is the train state's arrays (as the strategy lays them out) and the
`RunProgress` that says where they are: the two always move together, so
they travel together. A `RunSlot` holds a trainer's current run, between
fits and during one: the trainer reads it (``trainer.state``,
``trainer.progress``, ``trainer.snapshot()``) and replaces it when the
state is set or a snapshot restored; the loop replaces it after each
compiled call. Nothing here touches the devices.
"""

import dataclasses

import jax

from ._progress import RunProgress


@dataclasses.dataclass(frozen=True)
class Run:
    """The train state's arrays and where the run is.

    Attributes:
        leaves: the `TrainState`'s arrays, flat (as `StateLayout` orders and
            the strategy lays them out). A step donates them: a run that has
            been stepped from is spent.
        progress: the step, epoch, plan and the epoch's sums.
        spare: under the held guard (``_engine/step/_held.py``), the state the
            last step read, which the next step donates (and returns where
            the last step's gradient was not finite); None elsewhere.
    """

    leaves: list[jax.Array]
    progress: RunProgress
    spare: list[jax.Array] | None = None

    def replace(
        self,
        *,
        leaves: list[jax.Array] | None = None,
        progress: RunProgress | None = None,
    ) -> "Run":
        """This run with new `leaves` (and no spare) and/or `progress`."""
        if leaves is not None:
            return Run(leaves, self.progress if progress is None else progress)
        return dataclasses.replace(
            self, progress=self.progress if progress is None else progress
        )


class RunSlot:
    """Where a trainer's current `Run` lives: the one home of its state.

    Replaced whole, never changed in place: whoever holds a `Run` read from
    here holds a consistent state and progress.
    """

    def __init__(self, run: Run):
        self.run = run

    @property
    def progress(self) -> RunProgress:
        """The current run's progress."""
        return self.run.progress

    @property
    def leaves(self) -> list[jax.Array]:
        """The current run's state, as its arrays."""
        return self.run.leaves

    def advance(self, progress: RunProgress) -> Run:
        """Replace the current run's progress (its state unchanged); the new
        run."""
        self.run = run = self.run.replace(progress=progress)
        return run
