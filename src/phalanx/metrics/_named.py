"""Metrics by name: what ``DataParallelTrainer(metrics=)`` and ``phalanx
train --metric`` take, made into the functions a step calls.

`BUILT_IN` makes each name of `METRIC_NAMES` (the one list of the built-in
metrics, the CLI's ``--metric`` choices too) into its function.
`metric_functions` checks the trainer's ``metrics``
argument when the trainer is built, before any batch, and turns it into
``{name: fn(outputs, targets)}``, each function giving per-example values
or a `Statistic`: the step sums them as it sums the loss. The dataset-level
ones are this package's own functions, called without ``num_classes``
(they count the classes on the outputs' class axis). Nothing here runs a
step or reads a batch.
"""

import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._metric_names import METRIC_NAMES, MetricName
from .._typing import LossName
from ._auc import auc
from ._confusion import confusion_matrix, f1, precision, recall
from ._labels import predicted_labels, true_labels
from ._statistic import Statistic


# What a metric function computes: per-example values (averaged like the
# loss) or a dataset-level statistic.
MetricFn: TypeAlias = Callable[[Any, Any], Float[Array, " batch"] | Statistic]
# The names of the trainer's own entries among a step's sums and metrics: no
# metric may take them.
RESERVED_NAMES = ("loss", "weight", "skipped", "skipped_steps", "loss_scale")


def accuracy(outputs: Array, targets: Array) -> Float[Array, " batch"]:
    """1 where the predicted class (the arg-max score; for one score per
    example, above 0) is the true one (the label, or the arg-max of one-hot
    or soft targets), else 0."""
    hit = predicted_labels(outputs, from_logits=True) == true_labels(targets)
    dtype = outputs.dtype if jnp.issubdtype(outputs.dtype, jnp.floating) else None
    return hit.astype(dtype or jnp.float32)


# The built-in metrics: accuracy per example, the others over every example
# of an epoch or evaluation (F1, precision and recall macro-averaged, the
# mean over classes; the AUC binary for two classes, else the mean of each
# class's against the rest).
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
        return {name: _built_in(name, "metrics", loss) for name in default}
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
    return functions


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
