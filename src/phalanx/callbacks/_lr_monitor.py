"""`px.callbacks.LearningRateMonitor`: the learning rate the optimizer
uses added to the metrics, so loggers and `trainer.history` see it.

The rate is the optimizer's (the schedule it was given, evaluated on the host
at the trainer's step, or read from the optimizer and its state) times the
rate multiplier of the run's state (`TrainState.lr_scale`, which
`ReduceLROnPlateau` lowers). It declares the metric it adds
(`added_metrics`), so a monitor of it after this callback is checked before
the fit, and changes nothing else of the run.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from typing_extensions import override

from .._state._learning_rate import multiplier
from .._typing import validates_own_arguments
from .._validate import is_int, positive_int
from ._base import Callback, StepInfo, TrainerLike
from ._read_rate import rate_or_multiplier, warn_if_unreadable


# Steps whose rates one compiled call of the schedule computes.
_BLOCK = 1024


class LearningRateMonitor(Callback):
    """Adds the learning rate to the metrics, as a float named `name`.

    The value after `n` updates is the rate the next update uses:
    ``schedule(n)`` (optax counts updates from 0), with `n` the trainer's
    real step, so it follows the schedule across several `fit` calls, times
    the run's rate multiplier (`TrainState.lr_scale`: 1.0 unless
    `ReduceLROnPlateau` or the user lowered it). Without a `schedule`, the
    optimizer's own rate is read from it and its state, as
    `ReduceLROnPlateau` reads it (optax's optimizers, injected or scheduled
    rates, several groups: the first group's); where phalanx cannot read it,
    it says so once (when the first fit starts) and logs the multiplier
    instead. It is written into the step's metrics every `log_every` steps
    (this reads the state, a device sync, as any logger would at that step)
    and into each epoch's metrics, so it lands in `trainer.history`. (Read
    from the optimizer, a step inside a compiled call of
    ``steps_per_call > 1`` gets the rate after the call, the state the hooks
    see; a `schedule` gives each step's own.)

    It adds metrics, so it runs before the loggers (which declare they add
    none) wherever it is listed in ``callbacks=``.

    Args:
        schedule: the optax schedule given to the optimizer (a function
            step -> rate), or a constant rate; None: the optimizer's rate,
            read from it.
        log_every: steps between log points.
        name: the metric's name.

    Raises:
        TypeError: `schedule` is neither a number nor callable.
        ValueError: `log_every` is not a positive int, or `name` is empty.

    Example:
        ```python
        schedule = optax.cosine_decay_schedule(1e-3, decay_steps=10_000)
        trainer = px.DataParallelTrainer(
            model,
            optax.adam(schedule),
            callbacks=[LearningRateMonitor(log_every=50), logger],
        )
        trainer.fit(data, epochs=3)
        trainer.history["lr"]  # the rate at the end of each epoch
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        schedule: float | Callable[[int], Any] | None = None,
        *,
        log_every: int = 10,
        name: str = "lr",
    ) -> None:
        if not (
            schedule is None
            or is_int(schedule)
            or isinstance(schedule, float)
            or callable(schedule)
        ):
            raise TypeError(
                f"schedule={schedule!r} is neither a number nor callable; pass the "
                "optax schedule given to the optimizer (e.g. "
                "optax.cosine_decay_schedule(1e-3, 1000)), a constant rate, or "
                "None to read the optimizer's"
            )
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty str, e.g. 'lr'")
        self.schedule = schedule
        self.name = name
        self._said = False  # that the rate cannot be read: once is enough
        # The rates of a block of steps, computed in one compiled call: op
        # by op, an optax schedule compiled each of its ~7 operations (~0.15 s
        # in all), and every call, queued on a device behind the steps in
        # flight, took ~0.3 ms at each log point (8 CPU devices, 2 cores).
        self._table: tuple[int, np.ndarray] | None = None
        self._jitted: Callable[[Any], Any] | None = None
        self._traceable = callable(schedule)

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """The rate, as `name`."""
        return (self.name,)

    def rate(self, step: int) -> float:
        """The schedule's learning rate after `step` updates, as a float
        (before the run's multiplier).

        Raises:
            TypeError: the schedule does not return one number.
        """
        assert self.schedule is not None, "a monitor without one reads the state"
        if not callable(self.schedule):
            return float(self.schedule)
        # Explicit fetch: optax schedules compute with jnp, on the default device.
        value = np.asarray(jax.device_get(self._evaluate(step)))
        if value.ndim != 0 or not np.issubdtype(value.dtype, np.number):
            raise TypeError(
                f"schedule({step}) returned {value!r}, not one number; pass a "
                "schedule that maps a step to a scalar learning rate"
            )
        return float(value)

    def used(self, trainer: TrainerLike, step: int) -> float:
        """The rate the update after `step` updates uses (where the
        optimizer's cannot be read, the multiplier)."""
        if self.schedule is None:
            return rate_or_multiplier(trainer)
        return self.rate(step) * multiplier(trainer.state.lr_scale)

    def _evaluate(self, step: int) -> Any:
        """``schedule(step)``: read from the rates of its block of steps,
        where the schedule can be traced and vectorised."""
        schedule = self.schedule
        assert callable(schedule)
        if self._traceable:
            try:
                return self._from_table(schedule, step)
            except Exception:  # Python control flow on the step, or no array:
                self._traceable = False  # op by op from now on (its error, if any)
        return schedule(step)

    def _from_table(self, schedule: Callable[[Any], Any], step: int) -> np.ndarray:
        start = step - step % _BLOCK
        if self._table is None or self._table[0] != start:
            if self._jitted is None:
                self._jitted = jax.jit(jax.vmap(schedule))
            steps = np.arange(start, start + _BLOCK, dtype=np.int32)
            self._table = (start, np.asarray(jax.device_get(self._jitted(steps))))
        return self._table[1][step - start]

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        if self.schedule is None:
            if not self._said:
                self._said = warn_if_unreadable(
                    info.trainer,
                    "LearningRateMonitor",
                    f"{self.name!r} logs the multiplier of its final update "
                    "instead (pass the schedule given to the optimizer to log "
                    "the rate)",
                )
            return
        # Fail before the first update rather than at the first log point.
        rate = self.rate(info.step)
        if not math.isfinite(rate):
            raise ValueError(
                f"schedule({info.step}) = {rate}; pass a schedule of finite rates"
            )

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if info.step % self.log_every == 0:
            self._write(info)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        self._write(info)

    def _write(self, info: StepInfo) -> None:
        metrics = info.metrics
        if self.name in metrics:
            raise ValueError(
                f"LearningRateMonitor(name={self.name!r}) would overwrite the "
                f"metric {self.name!r} already in {sorted(metrics)}; pick another "
                "name"
            )
        metrics[self.name] = self.used(info.trainer, info.step)
