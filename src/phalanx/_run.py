"""What a fit is doing, checkpoint lookup for `resume=`, and preemption."""

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from ._trainer import DataParallelTrainer
    from .callbacks import Callback
    from .callbacks._checkpoint import Checkpoint


@dataclasses.dataclass
class RunPlan:
    """A fit's plan: where it started and how far it goes (checkpointed, so a
    resumed fit keeps the original plan)."""

    start_step: int
    start_epoch: int
    epochs: int | None
    steps: int | None

    def done(self, step: int, epoch: int | None) -> bool:
        """Whether the plan is complete at `step` (and, if given, `epoch`)."""
        if self.steps is not None and step >= self.start_step + self.steps:
            return True
        return (
            epoch is not None
            and self.epochs is not None
            and epoch >= self.start_epoch + self.epochs
        )


class Preempted(KeyboardInterrupt):
    """`fit` stopped on SIGTERM/SIGINT after saving a checkpoint."""

    def __init__(self, signum: int, checkpoint: str | None):
        self.signum = signum
        self.exit_code = 128 + signum
        saved = f"; checkpoint saved in {checkpoint}" if checkpoint else ""
        super().__init__(
            f"stopped by {signal.Signals(signum).name} at a step boundary{saved}"
        )


def find_checkpoint(
    callbacks: Sequence["Callback"], resume: str | os.PathLike[str]
) -> "Checkpoint":
    """The Checkpoint callback that restores `resume` (or a reader for a path)."""
    from .callbacks._checkpoint import Checkpoint

    mine = [c for c in callbacks if isinstance(c, Checkpoint)]
    if resume == "latest":
        if not mine:
            raise ValueError(
                "resume='latest' needs a px.callbacks.Checkpoint in callbacks to "
                "know where checkpoints are; add one, or pass resume=PATH"
            )
        return mine[0]
    return mine[0] if mine else Checkpoint(resume, every_n_epochs=None)


@contextlib.contextmanager
def preemption(trainer: "DataParallelTrainer") -> Iterator[None]:
    """On SIGTERM or SIGINT, finish the step, save a checkpoint, then stop.

    The first signal sets a flag the loop checks at the next step boundary,
    where every `Checkpoint` callback saves and waits for the write to be
    committed, and `fit` raises `Preempted` (a KeyboardInterrupt; exit code
    128 + signal). A second SIGINT aborts at once.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        del frame
        if received and signum == signal.SIGINT:
            raise KeyboardInterrupt("second SIGINT: aborted without a checkpoint")
        received.append(signum)
        trainer.stop_training = True
        trainer._preempted = signum

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
