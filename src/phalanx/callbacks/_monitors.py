"""Checks, before a fit's first step, that each monitored metric is one the
run produces.

`Checkpoint(monitor=)` and `EarlyStopping(monitor)` read their metric at
epoch ends, or, an ``eval_`` one under ``fit(eval_every=)``, after each of
those evaluations. A name the run never produces would fail only after an
epoch's training, or (under ``eval_every``) never be judged at all. The
names a run produces are its step's (``loss`` and the `metrics` hook's),
known once the first batch has been traced through the model; those of its
evaluation sets (each prefixed as `fit` names it); the trainer's own epoch
additions (``skipped_steps``, ``loss_scale``); and those the callbacks
before the monitor declare they add (`Callback.added_metrics`). A callback
before the monitor that declares nothing there but adds in its epoch or
evaluation hooks may add any name, so its monitor is taken on trust. Which
metrics a callback monitors is what it declares (`Callback.monitors`), never
an attribute probed for. Nothing here runs on the devices.
"""

import difflib
from collections.abc import Sequence

from .._typing import EvalSets
from ._base import Callback


def check_monitors(
    callbacks: Sequence[Callback],
    sets: EvalSets | None,
    *,
    eval_every: int | None = None,
    step_metrics: Sequence[str] | None = None,
    eval_metrics: Sequence[str] | None = None,
    epoch_extras: Sequence[str] = (),
) -> None:
    """Raise ValueError for a callback monitoring a metric `fit` will not
    produce, naming the closest one it will.

    Args:
        callbacks: the fit's callbacks, in the order they run.
        sets: `fit`'s evaluation sets (their metrics' prefixes), or None.
        eval_every: `fit`'s ``eval_every``.
        step_metrics: the names of a step's metrics, ``loss`` first; None
            before the first batch has been traced (only what the sets
            decide is checked then).
        eval_metrics: the same of an evaluation's (the trainer's
            `eval_metrics`); None where not yet known (as `step_metrics`).
        epoch_extras: what the trainer adds to every epoch's metrics.
    """
    prefixes = [prefix for prefix, _ in sets or ()]
    monitored = [(i, c, m) for i, c in enumerate(callbacks) for m in c.monitors()]
    for i, callback, monitor in monitored:
        earlier = callbacks[:i]
        name = f"{type(callback).__name__}(monitor={monitor!r})"
        at_evaluations = monitor.startswith("eval_") and eval_every is not None
        if _may_add(earlier, at_evaluations=at_evaluations):
            continue
        if monitor.startswith("eval_"):
            _check_sets(name, monitor, prefixes)
        if step_metrics is None or eval_metrics is None:
            continue  # the rest is checked once the first batch is traced
        produced = [prefix + metric for prefix in prefixes for metric in eval_metrics]
        if not at_evaluations:
            produced = [*step_metrics, *epoch_extras, *produced, *_added(earlier)]
        if monitor not in produced:
            raise ValueError(
                _unknown(name, monitor, produced, prefixes, eval_metrics, eval_every)
            )


def _check_sets(name: str, monitor: str, prefixes: list[str]) -> None:
    """Raise for an ``eval_`` monitor that no evaluation set can give."""
    if not prefixes:
        raise ValueError(
            f"{name} watches a metric of eval_data, but fit was given no "
            "eval_data; pass eval_data=..., or monitor a training metric "
            f"(e.g. monitor={monitor.removeprefix('eval_')!r})"
        )
    if not any(monitor.startswith(prefix) for prefix in prefixes):
        names = ", ".join(f"{prefix}<metric>" for prefix in prefixes)
        raise ValueError(
            f"{name} watches no metric of fit's eval_data sets, whose metrics "
            f"are named {names}; monitor one of those, e.g. "
            f"monitor={prefixes[0] + 'loss'!r}"
        )


def _unknown(
    name: str,
    monitor: str,
    produced: list[str],
    prefixes: list[str],
    eval_metrics: Sequence[str],
    eval_every: int | None,
) -> str:
    """The message for a monitor that is none of the `produced` names."""
    where = (
        f"the evaluations every {eval_every} steps give"
        if monitor.startswith("eval_") and eval_every is not None
        else "this fit's epochs give"
    )
    close = difflib.get_close_matches(monitor, produced, n=1, cutoff=0.6) or [
        name for name in produced if name.startswith(monitor)
    ]
    guess = f" Did you mean {close[0]!r}?" if close else ""
    # eval_val_loss with one unnamed set (whose metrics are eval_loss, ...).
    named = monitor.removeprefix("eval_").partition("_")
    unnamed = prefixes == ["eval_"] and named[2] in eval_metrics
    sets = (
        " eval_data is one unnamed set, so its metrics are eval_<metric>; name "
        f"it, eval_data={{{named[0]!r}: batches}}, for {monitor!r}."
        if unnamed
        else ""
    )
    return (
        f"{name} watches a metric this fit never produces: {where} "
        f"{', '.join(produced)}.{guess}{sets} Monitor one of those; a metric that "
        "a callback adds (LearningRateMonitor's 'lr', Throughput's, your own) "
        "needs that callback before this one in callbacks="
    )


def _may_add(earlier: Sequence[Callback], *, at_evaluations: bool) -> bool:
    """Whether a callback among `earlier` that declares nothing of what it
    adds (`Callback.added_metrics`) has a hook that may add a metric: at
    evaluations, or with `at_evaluations` False also at epoch ends."""
    for callback in earlier:
        kind = type(callback)
        adds = kind.on_eval_end is not Callback.on_eval_end or (
            not at_evaluations and kind.on_epoch_end is not Callback.on_epoch_end
        )
        if adds and callback.added_metrics() is None:
            return True
    return False


def _added(earlier: Sequence[Callback]) -> list[str]:
    """The names the callbacks among `earlier` declare they add to the
    epochs' metrics."""
    return [name for callback in earlier for name in callback.added_metrics() or ()]
