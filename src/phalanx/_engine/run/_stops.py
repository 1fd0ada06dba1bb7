"""Where a fit's stop requests meet (`StopRequests`): a callback's
``trainer.stop_training`` (Keras' flag) and a signal's `preempt` (from the
handler `_preemption.preemption` installs). The loop asks `stopping` where
a call ends and acts on it there; nothing here stops anything itself or
tells anyone.
"""

from ...callbacks._base import TrainerLike


class StopRequests:
    """A fit's requests to stop at the next step boundary.

    A signal's request is the fit's own (the handler only notes it here; the
    run the loop returns carries it in its progress); a callback's is the
    trainer's ``stop_training``, read each time it is asked.
    """

    def __init__(self, trainer: TrainerLike):
        """Args:
        trainer: whose ``stop_training`` a callback sets.
        """
        self._trainer = trainer
        self._signal: int | None = None

    @property
    def signal(self) -> int | None:
        """The signal that asked the run to stop (None: none)."""
        return self._signal

    def preempt(self, signum: int) -> None:
        """Stop at the next step boundary (from a signal handler)."""
        self._signal = signum

    def stopping(self) -> bool:
        """Whether a callback or a signal asked the run to stop."""
        return self._signal is not None or self._trainer.stop_training
