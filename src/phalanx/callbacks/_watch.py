"""What the callbacks that act on a monitored metric share (`EarlyStopping`,
`ReduceLROnPlateau`): which value they judge at an epoch's end or an
evaluation's, and whether a value improves on the best so far."""

from ._base import StepInfo


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
        return float(info.metrics[monitor])
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
        return float(metrics[monitor])
    if info.eval_every is not None and monitor.startswith("eval_"):
        return None
    raise KeyError(
        f"{owner}(monitor={monitor!r}): epoch {info.epoch} has no such metric; it "
        f"has {sorted(metrics)}. Pass one of those (eval_* metrics need "
        "fit(eval_data=...); values from other callbacks need those callbacks "
        f"placed before {owner})"
    )
