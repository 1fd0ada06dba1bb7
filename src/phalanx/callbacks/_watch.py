"""What the callbacks that act on a monitored metric share (`EarlyStopping`,
`ReduceLROnPlateau`): their monitor, mode and `min_delta` checked, which
value they judge at an epoch's end or an evaluation's, and whether a value
improves on the best so far."""

import abc
import math
from typing import Any

import numpy as np
from typing_extensions import override

from .._typing import MetricValue
from .._validate import finite_at_least, one_of
from ._base import Callback, StepInfo


class AbstractWatch(Callback):
    """A callback that judges `monitor` after each epoch, or, an ``eval_``
    metric of a fit that evaluates every ``eval_every`` steps, after each of
    those evaluations (`_judge`); lower is better where `mode` is
    ``"min"``, higher where ``"max"``, by more than `min_delta`."""

    def __init__(self, monitor: str, mode: str, min_delta: float) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise TypeError(
                f"monitor={monitor!r} must be a metric's name, e.g. 'eval_loss'"
            )
        self.monitor = monitor
        self.mode = one_of(
            "mode",
            mode,
            ("min", "max"),
            hint="'min' if lower is better, e.g. a loss; 'max' if higher is, "
            "e.g. an accuracy",
        )
        self.min_delta = finite_at_least(
            "min_delta",
            min_delta,
            0.0,
            example="1e-4",
            hint="the direction comes from mode=",
        )
        self.best = math.inf if mode == "min" else -math.inf
        self.wait = 0  # values judged since the best, as each callback counts

    @override
    def monitors(self) -> tuple[str, ...]:
        """The metric it watches, `monitor`."""
        return (self.monitor,)

    def improves(self, value: float) -> bool:
        """Whether `value` beats the best so far by more than `min_delta`."""
        return improves(value, self.best, self.mode, self.min_delta)

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        value = at_eval_end(info, self.monitor)
        if value is not None:
            self._judge(info, value)

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        value = at_epoch_end(info, self.monitor, type(self).__name__)
        if value is not None:
            self._judge(info, value)

    @abc.abstractmethod
    def _judge(self, info: StepInfo, value: float) -> None:
        """Act on `value`, the monitor's at this point."""

    @override
    def state_dict(self) -> dict[str, Any]:
        """The best value and the count since it (a subclass adds its own)."""
        return {"best": self.best, "wait": self.wait}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict`."""
        self.best = float(state["best"])
        self.wait = int(state["wait"])


def improves(value: float, best: float, mode: str, min_delta: float) -> bool:
    """Whether `value` beats `best` by more than `min_delta`, lower being
    better where `mode` is ``"min"``, higher where ``"max"`` (NaN never
    does)."""
    if mode == "min":
        return value < best - min_delta
    return value > best + min_delta


def at_eval_end(info: StepInfo, monitor: str) -> float | None:
    """The monitor's value after an evaluation of ``fit(eval_every=)`` (those
    at epoch ends are judged with their epoch's metrics); None elsewhere."""
    if info.eval_every is not None and monitor in info.metrics:
        return monitored_number(info.metrics[monitor], monitor)
    return None


def at_epoch_end(info: StepInfo, monitor: str, owner: str) -> float | None:
    """The monitor's value at an epoch's end; None for an ``eval_`` one that
    is judged at each of ``fit(eval_every=)``'s evaluations instead.

    Raises:
        KeyError: the epoch has no such metric (the message names those it
            has, and `owner`, the callback's class).
    """
    metrics = info.metrics
    if monitor in metrics:
        return monitored_number(metrics[monitor], monitor)
    if info.eval_every is not None and monitor.startswith("eval_"):
        return None
    raise KeyError(
        f"{owner}(monitor={monitor!r}): epoch {info.epoch} has no such metric; it "
        f"has {sorted(metrics)}. Pass one of those (eval_* metrics need "
        "fit(eval_data=...); values from other callbacks need those callbacks "
        f"placed before {owner})"
    )


def monitored_number(value: MetricValue, monitor: str) -> float:
    """A monitored metric's value, which must be a number.

    Raises:
        TypeError: it is an array (a confusion matrix).
    """
    if isinstance(value, np.ndarray):
        raise TypeError(
            f"monitor={monitor!r} is an array of shape {value.shape} (e.g. a "
            "confusion matrix), which cannot improve or worsen; monitor a number, "
            "e.g. an F1 score or a loss"
        )
    return float(value)
