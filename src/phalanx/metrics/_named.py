"""Metrics by name: what ``DataParallelTrainer(metrics=)`` and ``phalanx
train --metric`` take, made into the functions a step calls.

`BUILT_IN` makes each name of `METRIC_NAMES` (the one list of the built-in
metrics, the CLI's ``--metric`` choices too) into its function.
`metric_functions` checks the trainer's ``metrics``
argument when the trainer is built, before any batch, and turns it into
``{name: fn(outputs, targets)}``, each function giving per-example values
or a `Statistic`: the step sums them as it sums the loss; a function that
fails on a batch's outputs and targets says it is the metric named. The
dataset-level
ones are this package's own functions, called without ``num_classes``
(they count the classes on the outputs' class axis). Nothing here runs a
step or reads a batch.
"""

import functools as ft
import re
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
from jaxtyping import Array, Float

from .._metric_names import METRIC_NAMES, MetricName
from .._typing import LossName
from ._accuracy import accuracy
from ._auc import auc
from ._confusion import confusion_matrix, f1, precision, recall
from ._labels import MetricArgumentError
from ._statistic import Statistic


# What a metric function computes: per-example values (averaged like the
# loss) or a dataset-level statistic.
MetricFn: TypeAlias = Callable[[Any, Any], Float[Array, " batch"] | Statistic]
# The names of the trainer's own entries among a step's sums and metrics: no
# metric may take them.
RESERVED_NAMES = ("loss", "weight", "skipped", "skipped_steps", "loss_scale")
# The start of CPython's messages for a call whose arguments do not bind.
_UNBOUND = re.compile(r"^[\w.<>]+\(\) (?:got |missing |takes )")


# The built-in metrics: accuracy per example (for per-token targets, over
# every token of an epoch or evaluation), the others over every example (or
# token) of an epoch or evaluation (F1, precision and recall
# macro-averaged, the mean over classes; the AUC binary for two classes,
# else the mean of each class's against the rest; not per token).
BUILT_IN: dict[MetricName, MetricFn] = {
    "accuracy": accuracy,
    "f1": f1,
    "precision": precision,
    "recall": recall,
    "auc": auc,
    "confusion_matrix": confusion_matrix,
}
# The built-in losses that score a classifier, which the built-in metrics do.
_CLASSIFIERS = ("cross_entropy", "categorical_cross_entropy")
_EXAMPLE = "metrics=('accuracy', 'f1', 'auc')"


def metric_functions(
    metrics: Any, loss: LossName | None, *, default: tuple[str, ...]
) -> dict[str, MetricFn]:
    """The trainer's ``metrics`` argument as ``{name: fn(outputs, targets)}``.

    Args:
        metrics: None (the loss's `default` names); a sequence of built-in
            names (`METRIC_NAMES`), repeats dropped; or a mapping of names to
            functions of ``(outputs, targets)`` (or to built-in names).
        loss: the built-in loss's name; None for a loss function.
        default: the names a built-in loss logs by itself.

    Raises:
        TypeError: `metrics` is of another type, or a mapping's value is
            neither a function nor a name.
        ValueError: an unknown or reserved name, or a built-in metric
            (which scores a classifier) with ``loss="mse"``.
    """
    if metrics is None:
        return {
            name: _naming(name, _built_in(name, "metrics", loss)) for name in default
        }
    if isinstance(metrics, str):
        raise TypeError(
            f"metrics={metrics!r} is one name; pass a tuple of names, e.g. "
            f"metrics=({metrics!r},)"
        )
    if isinstance(metrics, Mapping):
        chosen = dict(metrics)
    elif isinstance(metrics, list | tuple):
        for name in metrics:
            if not isinstance(name, str):
                raise TypeError(
                    f"metrics holds {name!r}, which is not a built-in metric's "
                    f"name ({', '.join(METRIC_NAMES)}); for a function of your own, "
                    "pass a mapping that names it, e.g. metrics={'top2': top2}"
                )
        chosen = {name: name for name in metrics}
    else:
        raise TypeError(
            f"metrics={metrics!r} must be a tuple of built-in names, e.g. "
            f"{_EXAMPLE}, or a mapping of names to fn(outputs, targets), e.g. "
            "metrics={'top2': top2}"
        )
    functions: dict[str, MetricFn] = {}
    for name, how in chosen.items():
        where = f"metrics[{name!r}]" if isinstance(metrics, Mapping) else "metrics"
        if not isinstance(name, str):
            raise TypeError(
                f"{where}: metric names are strings, got {name!r}; e.g. {_EXAMPLE}"
            )
        if name in RESERVED_NAMES:
            raise ValueError(
                f"{where}: {name!r} is a name the trainer logs itself "
                f"({', '.join(RESERVED_NAMES)}); rename it, e.g. {name + '_metric'!r}"
            )
        if isinstance(how, str):
            functions[name] = _built_in(how, where, loss)
        elif callable(how):
            functions[name] = typing.cast(MetricFn, how)
        else:
            raise TypeError(
                f"{where}={how!r} is neither a function of (outputs, targets) "
                "returning per-example values or a px.metrics statistic, nor a "
                f"built-in name ({', '.join(METRIC_NAMES)})"
            )
    return {name: _naming(name, fn) for name, fn in functions.items()}


def _naming(name: str, fn: MetricFn) -> MetricFn:
    """`fn`, whose failure on a batch's outputs and targets names it: the
    model and the loss have run on them when a metric is called, so a shape
    error there (JAX raises a ValueError or a plain TypeError) is the
    metric's, not the model's or the batch's."""

    @ft.wraps(fn)
    def metric(outputs: Any, targets: Any) -> Float[Array, " batch"] | Statistic:
        try:
            return fn(outputs, targets)
        except MetricArgumentError:
            raise  # names the metric already
        except (ValueError, IndexError, TypeError) as error:
            if isinstance(error, TypeError) and not _raised_inside(error):
                # A call whose arguments do not fit `fn`'s signature, or a
                # runtime type checker's complaint: the engine names those.
                raise
            raise MetricArgumentError(
                f"metrics[{name!r}] fails on outputs {_shapes(outputs)} and targets "
                f"{_shapes(targets)}, which the model and loss ran on: "
                f"{str(error).strip().rstrip('.')}; fix "
                "the metric for them, or leave it out of metrics="
            ) from error

    return metric


def _raised_inside(error: TypeError) -> bool:
    """Whether a plain TypeError was raised inside the function called (its
    traceback goes past the calling frame), not by the call itself nor by
    a call inside it whose arguments do not bind (CPython's wording, which
    `_checks/_calls.py` reads to name the call and its fix)."""
    traceback = error.__traceback__
    return (
        type(error) is TypeError
        and bool(traceback and traceback.tb_next)
        and _UNBOUND.match(str(error)) is None
    )


def _shapes(tree: Any) -> str:
    """A pytree's arrays as dtype[shape], e.g. int32[8, 4]."""
    parts = [f"{x.dtype}{list(x.shape)}" for x in jax.tree.leaves(tree)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _built_in(name: str, where: str, loss: LossName | None) -> MetricFn:
    """The built-in metric `name`, for a trainer of the `loss` given."""
    if name not in BUILT_IN:
        raise ValueError(
            f"{where}: unknown metric {name!r}; the built-in ones are "
            f"{', '.join(METRIC_NAMES)}; for your own, pass a mapping of names to "
            "fn(outputs, targets) -> per-example values or a px.metrics statistic"
        )
    if loss is not None and loss not in _CLASSIFIERS:
        raise ValueError(
            f"{where}: {name!r} scores a classifier, but loss={loss!r} is not a "
            "classification loss; use loss='cross_entropy' (or "
            "'categorical_cross_entropy'), or pass metrics as a mapping of names "
            "to fn(outputs, targets), e.g. metrics={'mae': lambda o, t: "
            "jnp.abs(o - t).mean(-1)}"
        )
    return BUILT_IN[typing.cast(MetricName, name)]
