"""What the learning-rate callbacks (`LearningRateMonitor`,
`ReduceLROnPlateau`) read of the rate the optimizer's next update uses: the
rate, or phalanx's multiplier where the optimizer's cannot be read, and the
warning that says so. It reads the trainer's optimizer and state and
changes nothing; saying the warning once is the callback's.
"""

from .._log import logger
from .._state._learning_rate import multiplier, next_rate, used_rate
from ._base import TrainerLike


def rate_or_multiplier(trainer: TrainerLike) -> float:
    """The rate the next update uses: the optimizer's times phalanx's
    multiplier; where the optimizer's cannot be read, the multiplier."""
    state = trainer.state
    used = used_rate(trainer.optimizer, state)
    return multiplier(state.lr_scale) if used is None else used


def warn_if_unreadable(trainer: TrainerLike, callback: str, instead: str) -> bool:
    """Warn, where phalanx cannot read the rate of `trainer`'s optimizer,
    that `callback` does `instead` (a clause); whether it warned."""
    base = next_rate(trainer.optimizer, trainer.state.opt_state)
    if base.value is not None:
        return False
    logger.warning(
        f"{callback}: phalanx cannot read the optimizer's learning rate: "
        f"{base.why}; {instead}"
    )
    return True
