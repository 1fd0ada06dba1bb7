"""A run as one value, and the one place a trainer keeps it.

A `Run` is the train state's arrays (as the strategy lays them out) and the
`RunProgress` that says where they are: the two always move together, so
they travel together. A `RunSlot` holds a trainer's current run, between
fits and during one: the trainer reads it (``trainer.state``,
``trainer.progress``, ``trainer.snapshot()``), and every change goes
through its own methods (`put`, `advance`, `settle`), here and nowhere else
(``tests/test_one_home.py``): the state set or a snapshot restored, the
loop's run after each compiled call. Nothing here places arrays; settling
a run with a spare reads one flag back from the devices.
"""

import dataclasses

import jax

from ._progress import RunProgress
from ._sums import FLAGS


_BAD = FLAGS.index("nonfinite_step")


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

    def settled(self) -> "Run":
        """This run without its spare: its state, or the spare where its
        last step had a non-finite gradient (the state from before it; the
        step's flags say so). Waits for that step where the run holds a
        spare: what the held guard leaves is resolved here wherever a run
        is handed out whole."""
        if self.spare is None:
            return self
        progress = self.progress
        bad = -1 if progress.sums is None else int(progress.sums.flags[_BAD])
        last_was_bad = bad >= 0 and progress.step == bad + 1
        return Run(self.spare if last_was_bad else self.leaves, progress)


class RunSlot:
    """Where a trainer's current `Run` lives: the one home of its state.

    Replaced whole, never changed in place, and only through the methods
    below: whoever holds a `Run` read from here holds a consistent state and
    progress.
    """

    def __init__(self, run: Run):
        self._run = run

    @property
    def run(self) -> Run:
        """The current run (read-only: `put` replaces it)."""
        return self._run

    @property
    def progress(self) -> RunProgress:
        """The current run's progress."""
        return self._run.progress

    @property
    def leaves(self) -> list[jax.Array]:
        """The current run's state, as its arrays."""
        return self._run.leaves

    def put(self, run: Run) -> Run:
        """Make `run` the current run (the state set, a snapshot restored,
        a compiled call's result); `run`."""
        self._run = run
        return run

    def advance(self, progress: RunProgress) -> Run:
        """Replace the current run's progress (its state unchanged); the new
        run."""
        return self.put(self._run.replace(progress=progress))

    def settle(self) -> Run:
        """Resolve the current run's spare, if any (see `Run.settled`); the
        run, now the current one."""
        return self.put(self._run.settled())
