"""`px.callbacks.Throughput`: examples and steps per second added to the
metrics, and the `RateMeter` that counts them (shared with `ProgressBar`).

Rates are measured on the host between points where the device has caught
up (a read of the step's metrics), never by timing a dispatch; it declares
the metrics it adds (`added_metrics`) and changes nothing else of the run.
"""

import time

import jax
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import positive_int
from ._base import Callback, StepInfo


class RateMeter:
    """Examples and steps counted on the host since a start time.

    The rates are only real once the device has caught up: read them after a
    sync (e.g. after reading `StepInfo.metrics`), and restart when the device
    is idle (an epoch's start follows the previous epoch's fetched sums).
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.examples = 0
        self.steps = 0
        self._paused: float | None = None

    def restart(self) -> None:
        """Count from zero, from now."""
        self.start = time.perf_counter()
        self.examples = 0
        self.steps = 0
        self._paused = None

    def pause(self, info: StepInfo) -> None:
        """Stop the clock once the device has finished the steps so far
        (while `fit` evaluates between steps: not the steps' pace)."""
        jax.block_until_ready(info.state)
        self._paused = time.perf_counter()

    def resume(self) -> None:
        """Restart the clock `pause` stopped, the time between left out."""
        if self._paused is not None:
            self.start += time.perf_counter() - self._paused
            self._paused = None

    def add(self, examples: int) -> None:
        """Count one step of `examples` examples."""
        self.examples += examples
        self.steps += 1

    def seconds(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def rates(self) -> tuple[float, float]:
        """``(examples per second, steps per second)`` since the start."""
        seconds = max(self.seconds(), 1e-9)
        return self.examples / seconds, self.steps / seconds


class Throughput(Callback):
    """Adds ``examples_per_sec`` and ``steps_per_sec`` to the metrics.

    Every `log_every` steps it reads the step's metrics, which waits for the
    device, so the figures are the device's real pace over the steps since the
    previous log point (the first window of a run includes compilation). At
    each epoch's end it adds the same two figures over the whole epoch, from
    its first step to its end: evaluations, if any, are included (those of
    ``fit(eval_every=)`` are left out of the log points' figures). The epoch
    figures land in `trainer.history`.

    Place it **before** any logger in ``callbacks=``: callbacks see the values
    that earlier callbacks added, not those of later ones.

    Args:
        log_every: steps between log points (each one a device sync).

    Raises:
        ValueError: `log_every` is not a positive int.

    Example:
        ```python
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), callbacks=[Throughput(log_every=50), logger]
        )
        trainer.fit(data, epochs=3)
        trainer.history["examples_per_sec"]  # one figure per epoch
        ```
    """

    @validates_own_arguments
    def __init__(self, *, log_every: int = 10) -> None:
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        self._window = RateMeter()
        self._epoch = RateMeter()

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """The two rates."""
        return ("examples_per_sec", "steps_per_sec")

    @override
    def on_epoch_start(self, info: StepInfo) -> None:
        del info
        # The device is idle here: the previous epoch ended with a fetch.
        self._window.restart()
        self._epoch.restart()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._window.add(info.examples)
        self._epoch.add(info.examples)
        if info.step % self.log_every == 0:
            metrics = info.metrics  # waits for this step: the timing is real
            examples, steps = self._window.rates()
            metrics["examples_per_sec"] = examples
            metrics["steps_per_sec"] = steps
            self._window.restart()

    @override
    def on_eval_start(self, info: StepInfo) -> None:
        if info.eval_every is not None:  # between two steps
            self._window.pause(info)

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        del info
        self._window.resume()

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        examples, steps = self._epoch.rates()
        info.metrics["examples_per_sec"] = examples
        info.metrics["steps_per_sec"] = steps
