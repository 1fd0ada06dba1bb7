"""A run's full snapshot as one immutable value: `Snapshot`.

Everything needed to continue a run exactly, as the trainer hands it out and
takes it back. It converts nothing: `phalanx.checkpoint` turns snapshots into
files and back (and declares what stores them), and it never holds the
trainer."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._progress import RunProgress
from ._train_state import TrainState


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Everything needed to continue a run exactly.

    `DataParallelTrainer.snapshot` makes one and `DataParallelTrainer.restore`
    loads one; checkpoints convert them to files and back, and never touch
    the trainer itself.

    Attributes:
        state: the `TrainState`, its arrays on the devices as the strategy
            lays them out. Taken during `fit`, they (and the epoch's sums)
            are the run's own buffers, valid until its next step (which
            donates them): `copy` the snapshot to keep it longer (a
            checkpoint packs the arrays at once).
        progress: the `RunProgress`: counters, plan, the epoch's sums.
        history: the trainer's `History.state_dict()`.
        data: where the training data's loader stands (its `state_dict`),
            or None.
        eval_data: where each `Resumable` evaluation set of the fit stands
            (its `state_dict`), by the prefix of its metrics (``"eval_"``,
            ``"eval_val_"``): a loader that shuffles gives the next
            evaluation the order the run would have given it, so the
            evaluation sums its examples as the run would have, to the bit.
        settings: the trainer's settings that shape every update (the
            averaged weights' decay, the precision, the loss, the parameter
            groups, the optimizer's first learning rate), as plain data: a
            resume with other ones would be another run, and is refused.
        callbacks: each stateful callback's `state_dict`, by its `state_key`
            (``"ClassName"``, or ``"ClassName:state_name"``).
        strategy: the strategy's class name (metadata).
        devices: the strategy's device count (metadata).
    """

    state: TrainState
    progress: RunProgress
    history: dict[str, Any]
    data: Any = None
    eval_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)
    strategy: str = ""
    devices: int = 0

    def copy(self) -> "Snapshot":
        """This snapshot with copies of its device arrays (laid out as they
        are), valid however the run goes on."""

        def copied(tree: Any) -> Any:
            return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)

        progress = dataclasses.replace(self.progress, sums=copied(self.progress.sums))
        return dataclasses.replace(self, state=copied(self.state), progress=progress)
