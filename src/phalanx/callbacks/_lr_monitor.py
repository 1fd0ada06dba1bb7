"""`px.callbacks.LearningRateMonitor`: the optimizer's learning rate added
to the metrics, so loggers and `trainer.history` see it.

It evaluates the optax schedule on the host at the trainer's step; it
declares the metric it adds (`added_metrics`), so a monitor of it after this
callback is checked before the fit, and changes nothing else of the run.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import is_int, positive_int
from ._base import Callback, StepInfo


# Steps whose rates one compiled call of the schedule computes.
_BLOCK = 1024


class LearningRateMonitor(Callback):
    """Adds the learning rate to the metrics, as a float named `name`.

    The value after `n` updates is ``schedule(n)``: the rate the next update
    uses (optax counts updates from 0), with `n` the trainer's real step, so it
    follows the schedule across several `fit` calls. It is written into the
    step's metrics every `log_every` steps (this reads them, a device sync, as
    any logger would at that step) and into each epoch's metrics, so it lands
    in `trainer.history`.

    It adds metrics, so it runs before the loggers (which declare they add
    none) wherever it is listed in ``callbacks=``.

    Args:
        schedule: the optax schedule given to the optimizer (a function
            step -> rate), or a constant rate.
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
            callbacks=[LearningRateMonitor(schedule, log_every=50), logger],
        )
        trainer.fit(data, epochs=3)
        trainer.history["lr"]  # the rate at the end of each epoch
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        schedule: float | Callable[[int], Any],
        *,
        log_every: int = 10,
        name: str = "lr",
    ) -> None:
        if not (is_int(schedule) or isinstance(schedule, float) or callable(schedule)):
            raise TypeError(
                f"schedule={schedule!r} is neither a number nor callable; pass the "
                "optax schedule given to the optimizer (e.g. "
                "optax.cosine_decay_schedule(1e-3, 1000)) or a constant rate"
            )
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} must be a non-empty str, e.g. 'lr'")
        self.schedule = schedule
        self.name = name
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
        """The learning rate after `step` updates, as a float.

        Raises:
            TypeError: the schedule does not return one number.
        """
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
        metrics[self.name] = self.rate(info.step)
