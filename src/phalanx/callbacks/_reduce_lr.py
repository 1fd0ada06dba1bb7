"""`px.callbacks.ReduceLROnPlateau`: lowers the learning rate when a
monitored metric stops improving (Keras' callback of the name, PyTorch's
scheduler).

The rate lives in the optimizer state of an optimizer built with
`optax.inject_hyperparams`, so it is checkpointed with the rest of the state
and a resumed run goes on at the rate it had; the callback keeps only its
counters. It decides from the global values every process sees alike, so it
runs on every process.
"""

from typing import Any, Literal

import equinox as eqx
from typing_extensions import override

from .._state._hyperparams import hyperparam_value, with_hyperparam
from .._typing import validates_own_arguments
from .._validate import finite_at_least, int_at_least, positive_int
from ._base import StepInfo
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

    The optimizer must be built with `optax.inject_hyperparams`, so that the
    rate is a value of its state the callback can change between steps:
    ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``. Every
    injected `hyperparam` of the state is scaled (a constant: a schedule
    given there is recomputed each step, over what this sets).

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
        hyperparam: the injected hyperparameter to scale.
        name: the metric the rate is logged as.

    Raises:
        TypeError, ValueError: an argument is invalid (the message names it).

    Example:
        ```python
        tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
        plateau = ReduceLROnPlateau("eval_loss", factor=0.5, patience=3)
        trainer = px.DataParallelTrainer(model, tx, callbacks=[plateau])
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
        hyperparam: str = "learning_rate",
        name: str = "lr",
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        for argument, value, example in (
            ("hyperparam", hyperparam, "'learning_rate'"),
            ("name", name, "'lr'"),
        ):
            if not isinstance(value, str) or not value:
                raise TypeError(
                    f"{argument}={value!r} must be a non-empty str, e.g. {example}"
                )
        if not (
            isinstance(factor, (int, float))
            and not isinstance(factor, bool)
            and 0 < factor < 1
        ):
            raise ValueError(
                f"factor={factor!r} must be a number in (0, 1), what the rate is "
                "multiplied by; e.g. factor=0.1"
            )
        self.hyperparam, self.name = hyperparam, name
        self.factor = float(factor)
        self.patience = positive_int("patience", patience, example="10")
        self.min_lr = finite_at_least("min_lr", min_lr, 0.0, example="1e-6")
        self.cooldown = int_at_least("cooldown", cooldown, 0, example="2")
        self.cooldown_left = 0
        self.reductions = 0

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """The rate, as `name`."""
        return (self.name,)

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        # Before the first step: an optimizer without the rate in its state.
        self.rate(info.trainer.state.opt_state)

    def rate(self, opt_state: Any) -> float:
        """The rate the next update uses (the first injected one's).

        Raises:
            TypeError: no `optax.inject_hyperparams` state holds `hyperparam`.
        """
        owner = f"ReduceLROnPlateau(hyperparam={self.hyperparam!r})"
        return hyperparam_value(opt_state, self.hyperparam, owner)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        super().on_epoch_end(info)
        if self.name in info.metrics:
            raise ValueError(
                f"ReduceLROnPlateau(name={self.name!r}) would overwrite the metric "
                f"{self.name!r} already in {sorted(info.metrics)}; pick another name"
            )
        info.metrics[self.name] = self.rate(info.trainer.state.opt_state)

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
        if self.rate(state.opt_state) <= self.min_lr:
            return
        self.cooldown_left = self.cooldown
        self.reductions += 1
        reduced = with_hyperparam(
            state.opt_state,
            self.hyperparam,
            lambda rate: max(rate * self.factor, self.min_lr),
        )
        info.trainer.state = eqx.tree_at(lambda s: s.opt_state, state, reduced)

    def state_dict(self) -> dict[str, Any]:
        """The best value, the count since it, the cooldown left and the
        reductions made (the rate itself is in the optimizer state)."""
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
