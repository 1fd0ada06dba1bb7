"""`px.callbacks.ReduceLROnPlateau`: lowers the learning rate when a
monitored metric stops improving (Keras' callback of the name, PyTorch's
scheduler).

It multiplies the rate multiplier phalanx keeps in the run's state
(`TrainState.lr_scale`, applied to the optimizer's final update), so it
works on any optimizer, a schedule included (the reduction multiplies the
schedule); being state, the multiplier is checkpointed and a resumed run
goes on at the rate it had; the callback keeps only its counters. It
decides from the global values every process sees alike, so it runs on
every process.
"""

from typing import Any, Literal

import equinox as eqx
import jax.numpy as jnp
from typing_extensions import override

from .._state._learning_rate import multiplier, next_rate
from .._typing import validates_own_arguments
from .._validate import finite_at_least, int_at_least, positive_int
from ._base import StepInfo, TrainerLike
from ._read_rate import rate_or_multiplier, warn_if_unreadable
from ._watch import AbstractWatch


class ReduceLROnPlateau(AbstractWatch):
    """Multiplies the learning rate by `factor` when `monitor` has not
    improved for `patience` epochs (or evaluations).

    It reads `monitor` as `EarlyStopping` does: after each epoch, or, an
    ``eval_`` metric of a fit that evaluates every ``eval_every`` steps,
    after each of those evaluations. A value improves on the best so far
    when it is lower (``mode="min"``) or higher (``mode="max"``) by more
    than `min_delta`. After `patience` values in a row without improvement
    the rate becomes ``max(rate * factor, min_lr)``, and the next `cooldown`
    values are not counted. Each epoch's metrics get the rate the next
    update uses, as `name`.

    It works on any optimizer: it multiplies phalanx's rate multiplier
    (`TrainState.lr_scale`), which scales the optimizer's final update. For
    optax's optimizers (``optax.adam(1e-3)``, one built with
    `optax.inject_hyperparams`, one in an `optax.chain` after clipping) the
    last transform is the rate, so this scales the rate exactly; a schedule
    is multiplied as a whole (it goes on decaying from the lower rate). The
    logged rate is the one used: the optimizer's rate (read from it and its
    state) times the multiplier. `min_lr` bounds the rate at each
    reduction (a schedule may take it lower afterwards). With several
    optimizers (``param_groups``) every group's rate is multiplied, so they
    keep their ratio; the logged rate and `min_lr` are those of the first
    group in the mapping (one frozen with ``optax.set_to_zero()`` skipped).

    Where phalanx cannot read the rate (a transform after it, such as
    ``optax.chain(optax.adam(1e-3), optax.clip(1.0))``, whose update is not
    proportional to the rate, or an optimizer of one's own), it says so
    once (when the first fit starts), still multiplies the final update,
    and logs the multiplier (1.0 until the first reduction) as `name`
    instead, which `min_lr` then bounds.

    It adds `name`, so it runs before the loggers (which declare they add
    none) wherever it is listed; place it after any callback that adds the
    monitored metric.

    Args:
        monitor: the metric to watch, e.g. ``"eval_loss"`` (needs
            ``fit(eval_data=...)``) or ``"loss"``.
        factor: what the rate is multiplied by, in (0, 1).
        patience: values in a row without improvement before a reduction.
        min_lr: the rate is never reduced below this.
        cooldown: values not counted after a reduction.
        mode: ``"min"`` if lower is better, ``"max"`` if higher is.
        min_delta: the least change that counts as an improvement.
        name: the metric the rate is logged as.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Example:
        ```python
        schedule = optax.cosine_decay_schedule(1e-3, decay_steps=10_000)
        plateau = ReduceLROnPlateau("eval_loss", factor=0.5, patience=3)
        trainer = px.DataParallelTrainer(
            model, optax.adam(schedule), callbacks=[plateau]
        )
        trainer.fit(train, epochs=50, eval_data=test)
        trainer.history["lr"]  # the rate after each epoch
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        monitor: str = "eval_loss",
        *,
        factor: float = 0.1,
        patience: int = 10,
        min_lr: float = 0.0,
        cooldown: int = 0,
        mode: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
        name: str = "lr",
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name={name!r} must be a non-empty str, e.g. 'lr'")
        if not (
            isinstance(factor, (int, float))
            and not isinstance(factor, bool)
            and 0 < factor < 1
        ):
            raise ValueError(
                f"factor={factor!r} must be a number in (0, 1), what the rate is "
                "multiplied by; e.g. factor=0.1"
            )
        self.name = name
        self.factor = float(factor)
        self.patience = positive_int("patience", patience, example="10")
        self.min_lr = finite_at_least("min_lr", min_lr, 0.0, example="1e-6")
        self.cooldown = int_at_least("cooldown", cooldown, 0, example="2")
        self.cooldown_left = 0
        self.reductions = 0
        self._said = False  # that the rate cannot be read: once is enough

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """The rate, as `name`."""
        return (self.name,)

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        # Before the first step: say once where the rate cannot be read.
        if not self._said:
            bound = f", and min_lr={self.min_lr:g} bounds it" if self.min_lr else ""
            self._said = warn_if_unreadable(
                info.trainer,
                "ReduceLROnPlateau",
                f"it multiplies the optimizer's final update, and {self.name!r} "
                f"logs that multiplier instead of the rate{bound}",
            )

    def rate(self, trainer: TrainerLike) -> float:
        """The rate the next update uses: the optimizer's times phalanx's
        multiplier; where the optimizer's cannot be read, the multiplier."""
        return rate_or_multiplier(trainer)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        super().on_epoch_end(info)
        if self.name in info.metrics:
            raise ValueError(
                f"ReduceLROnPlateau(name={self.name!r}) would overwrite the metric "
                f"{self.name!r} already in {sorted(info.metrics)}; pick another name"
            )
        info.metrics[self.name] = self.rate(info.trainer)

    @override
    def _judge(self, info: StepInfo, value: float) -> None:
        """Count `value`; reduce the rate after `patience` values without
        improvement (PyTorch's order: a value in the cooldown still sets a
        new best, and is never counted against it)."""
        if self.improves(value):
            self.best, self.wait = value, 0
        else:
            self.wait += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.wait = 0
        if self.wait < self.patience:
            return
        self.wait = 0
        state = info.trainer.state
        scale = multiplier(state.lr_scale)
        base = next_rate(info.trainer.optimizer, state.opt_state).value
        rate = scale if base is None else base * scale
        if rate <= self.min_lr:
            return
        # The floor as a multiplier (where the rate is unknown, the
        # multiplier itself is what min_lr bounds).
        floor = self.min_lr if base is None else self.min_lr / base
        reduced = jnp.asarray(max(scale * self.factor, floor), jnp.float32)
        if not float(reduced) < scale:  # at the floor already, in float32
            return
        self.cooldown_left = self.cooldown
        self.reductions += 1
        info.trainer.state = eqx.tree_at(lambda s: s.lr_scale, state, reduced)

    def state_dict(self) -> dict[str, Any]:
        """The best value, the count since it, the cooldown left and the
        reductions made (the multiplier itself is in the run's state)."""
        return {
            **super().state_dict(),
            "cooldown_left": self.cooldown_left,
            "reductions": self.reductions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        super().load_state_dict(state)
        self.cooldown_left = int(state["cooldown_left"])
        self.reductions = int(state["reductions"])
