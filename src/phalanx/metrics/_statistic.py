"""`Statistic`: a metric of a whole dataset, as per-example statistics that
add up.

A per-example metric (accuracy) is a weighted mean, which the step gets
from sums: Σ weight · value and Σ weight. A dataset-level metric (F1, AUC)
is not a mean of per-example values, and averaging it per device or per
batch gives a wrong value. It is, though, a function of a sum: F1 of the
confusion matrix, AUC of score histograms. A `Statistic` says what each
example adds to that sum and how to read the metric from the total; the
step sums it exactly as it sums the loss (across devices, microbatches,
steps of one call, sample weights, padding and processes), and the host
reads the metric once, at log points and evaluations.
"""

import abc
from collections.abc import Mapping
from typing import Any, TypeAlias

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float


class Statistic(eqx.Module):
    """Per-example sufficient statistics of a dataset-level metric.

    Return one from the trainer's `metrics` or `eval_metrics` hook (or among
    the loss's values) in place of per-example values. The built-in ones
    (`f1`, `precision`, `recall`, `confusion_matrix`, `auc`) are made by
    functions of the same names. To write your own, subclass it with the
    per-example arrays as fields (leading axis: the batch), configuration
    as static fields, and implement `total` and `read`.

    Example:
        ```python
        class Recall(px.metrics.Statistic):  # of class 1, a sum of 2 numbers
            hit: Float[Array, " batch"]
            positive: Float[Array, " batch"]

            def total(self, weight):
                return jnp.stack([weight @ self.hit, weight @ self.positive])

            def read(self, total):  # NaN where class 1 never occurred
                return float(total[0] / total[1]) if total[1] else float("nan")
        ```
    """

    @abc.abstractmethod
    def total(self, weight: Float[Array, " batch"]) -> Float[Array, "*shape"]:
        """Σ over this slice's examples of ``weight`` times each example's
        statistics (an example of weight 0 is padding and adds nothing); the
        same shape for every slice. The step adds these totals up."""

    @abc.abstractmethod
    def read(self, total: np.ndarray) -> float | np.ndarray:
        """The metric from the total over every example (on the host, in
        NumPy). Only static fields may be used here: the arrays are gone."""


class Summed(eqx.Module):
    """A statistic's total over a slice, and the statistic without its
    arrays (its `read` is all that is left of it)."""

    total: Float[Array, "*shape"]
    statistic: Statistic = eqx.field(static=True)

    @classmethod
    def of(cls, statistic: Statistic, weight: Float[Array, " batch"]) -> "Summed":
        return cls(
            statistic.total(weight),
            eqx.filter(statistic, eqx.is_array, inverse=True),
        )

    def read(self, total: Any) -> float | np.ndarray:
        return self.statistic.read(np.asarray(total, np.float64))


# What the `metrics` hooks return, and the loss beside its losses: per-example
# values (averaged like the loss) or statistics, by name.
Metrics: TypeAlias = Mapping[str, Float[Array, " batch"] | Statistic]
# What the `loss` hook returns: per-example losses (under parameter groups,
# one per group, by group name), alone or with values to log (summed the
# same way as the metrics).
Losses: TypeAlias = Float[Array, " batch"] | Mapping[str, Float[Array, " batch"]]
LossResult: TypeAlias = Losses | tuple[Losses, Metrics]
