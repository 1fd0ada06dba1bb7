"""The confusion matrix, and precision, recall and F1 read from it."""

import typing
from typing import Literal, TypeAlias

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from typing_extensions import TypedDict, Unpack

from .._typing import validates_own_arguments
from ._labels import MetricArgumentError, check_classes, predicted_labels, true_labels
from ._statistic import Statistic


Average: TypeAlias = Literal["macro", "micro", "weighted", "binary"]
_AVERAGES = ("macro", "micro", "weighted", "binary")
_Report: TypeAlias = Literal["matrix", "precision", "recall", "f1"]


class Confusion(Statistic):
    """Each example's (or each of its tokens') cell of the confusion matrix
    (true class, predicted class); the total is the (weighted) matrix, rows
    true and columns predicted, as scikit-learn's."""

    true: Int[Array, " batch *tokens"]
    predicted: Int[Array, " batch *tokens"]
    num_classes: int = eqx.field(static=True)
    report: _Report = eqx.field(static=True)
    average: Average = eqx.field(static=True)
    zero_division: float = eqx.field(static=True)

    def total(self, weight: Float[Array, " batch"]) -> Float[Array, "true predicted"]:
        n = self.num_classes
        # A sum into cells, exact (a matmul of one-hots may run in reduced
        # precision on accelerators); labels outside [0, n) count nowhere
        # (a token's ignore index, e.g. -100, among them).
        cell = jnp.where(
            (self.true >= 0) & (self.true < n), self.true * n + self.predicted, -1
        )
        # Each token weighs as its example.
        tokens = weight.reshape(weight.shape + (1,) * (cell.ndim - 1))
        weights = jnp.broadcast_to(tokens, cell.shape).ravel()
        counts = jax.ops.segment_sum(weights, cell.ravel(), num_segments=n * n)
        return counts.reshape(n, n)

    def read(self, total: np.ndarray) -> float | np.ndarray:
        if self.report == "matrix":
            return total
        return float(_score(total, self.report, self.average, self.zero_division))


# A count per class, or one over all of them.
_Counts: TypeAlias = np.ndarray | np.floating


def _divide(top: _Counts, bottom: _Counts, zero_division: float) -> np.ndarray:
    """top / bottom, `zero_division` where bottom is 0 (scikit-learn's rule)."""
    safe = np.where(bottom == 0, 1.0, bottom)
    return np.asarray(np.where(bottom == 0, zero_division, top / safe))


def _score(
    matrix: np.ndarray, report: _Report, average: Average, zero_division: float
) -> np.ndarray:
    """Precision, recall or F1 of a confusion matrix, averaged as
    scikit-learn's ``average=`` (``"binary"``: of class 1)."""
    hits, true, predicted = np.diag(matrix), matrix.sum(1), matrix.sum(0)
    if average == "micro":
        hits, true, predicted = hits.sum(), true.sum(), predicted.sum()
    elif average == "binary":
        hits, true, predicted = hits[1], true[1], predicted[1]
    top, bottom = {
        "precision": (hits, predicted),
        "recall": (hits, true),
        "f1": (2 * hits, true + predicted),
    }[report]
    score = _divide(top, bottom, zero_division)
    if average in ("micro", "binary"):
        return score
    # Classes that occur in neither the targets nor the predictions are not
    # averaged over, as in scikit-learn (which only knows the labels it saw).
    seen = (true + predicted) > 0
    if average == "weighted":
        return _divide((score * true).sum(), true.sum(), zero_division)
    return np.asarray(score[seen].mean() if seen.any() else zero_division)


def _confusion(
    report: _Report,
    outputs: Array,
    targets: Array,
    *,
    num_classes: int | None = None,
    average: str = "macro",
    zero_division: float = 0.0,
    from_logits: bool = True,
) -> Confusion:
    metric = "confusion_matrix" if report == "matrix" else report
    true = true_labels(outputs, targets, f"px.metrics.{metric}")
    num_classes = check_classes(outputs, num_classes, metric)
    if average not in _AVERAGES:
        raise MetricArgumentError(
            f"px.metrics.{metric}: average={average!r}; pass one of "
            f"{', '.join(map(repr, _AVERAGES))}"
        )
    if average == "binary" and num_classes != 2:
        raise MetricArgumentError(
            f"px.metrics.{metric}: average='binary' scores class 1 of a binary "
            f"task, but num_classes={num_classes}; pass average='macro', "
            "'micro' or 'weighted' for several classes"
        )
    return Confusion(
        true,
        predicted_labels(outputs, from_logits=from_logits),
        num_classes,
        report,
        typing.cast(Average, average),
        float(zero_division),
    )


@validates_own_arguments
def confusion_matrix(
    outputs: Float[Array, " batch *classes"],
    targets: Int[Array, " batch *tokens"] | Float[Array, "batch *tokens classes"],
    *,
    num_classes: int | None = None,
    from_logits: bool = True,
) -> Statistic:
    """The confusion matrix of a classifier: rows the true class, columns
    the predicted one (the most likely), each cell the weighted count of its
    examples, as ``sklearn.metrics.confusion_matrix(..., sample_weight=)``.
    It is logged as a ``(num_classes, num_classes)`` array. The arguments
    are `f1`'s (the matrix is what `f1`, `precision` and `recall` are read
    from), less the score's `average` and `zero_division`."""
    return _confusion(
        "matrix", outputs, targets, num_classes=num_classes, from_logits=from_logits
    )


@validates_own_arguments
def f1(
    outputs: Float[Array, " batch *classes"],
    targets: Int[Array, " batch *tokens"] | Float[Array, "batch *tokens classes"],
    *,
    num_classes: int | None = None,
    average: Average = "macro",
    zero_division: float = 0.0,
    from_logits: bool = True,
) -> Statistic:
    """The F1 score (the harmonic mean of precision and recall) of a
    classifier over every example of an epoch or evaluation, as
    ``sklearn.metrics.f1_score(..., sample_weight=)``.

    Args:
        outputs: the model's scores per class (logits or probabilities), or
            one score per example for a binary task; the most likely class
            is the prediction.
        targets: class labels, or one-hot targets; per token (outputs of
            shape (batch, *tokens, classes)), labels of shape (batch,
            *tokens), each token counted as an example (of its example's
            weight) and negative labels (an ignore index, e.g. -100) left
            out, or one-hot targets of the outputs' shape.
        num_classes: the number of classes; None: counted on the outputs
            (their last axis, or 2 for one score per example).
        average: ``"macro"``: the mean over classes, leaving out those that
            occur in neither the targets nor the predictions; ``"micro"``:
            of every example's counts together (for one label per example,
            the accuracy); ``"weighted"``: over classes, weighted by their
            examples; ``"binary"``: of class 1, with ``num_classes=2``.
        zero_division: the score where it divides by zero (a class never
            present and never predicted).
        from_logits: whether one score per example is a logit (class 1
            above 0) rather than a probability (above 0.5).

    Example:
        ```python
        def metrics(self, outputs, targets):
            # 10 classes, as the outputs' last axis says (num_classes=10)
            return {"f1": px.metrics.f1(outputs, targets)}
        ```
    """
    return _confusion(
        "f1",
        outputs,
        targets,
        num_classes=num_classes,
        average=average,
        zero_division=zero_division,
        from_logits=from_logits,
    )


class ScoreOptions(TypedDict, total=False):
    """The keywords of `precision` and `recall`: `f1`'s."""

    num_classes: int | None
    average: Average
    zero_division: float
    from_logits: bool


@validates_own_arguments
def precision(
    outputs: Float[Array, " batch *classes"],
    targets: Int[Array, " batch *tokens"] | Float[Array, "batch *tokens classes"],
    **options: Unpack[ScoreOptions],
) -> Statistic:
    """The precision (of the examples predicted as a class, the share that
    are of it) of a classifier over every example of an epoch or
    evaluation, as ``sklearn.metrics.precision_score(..., sample_weight=)``.
    The arguments are `f1`'s."""
    return _confusion("precision", outputs, targets, **options)


@validates_own_arguments
def recall(
    outputs: Float[Array, " batch *classes"],
    targets: Int[Array, " batch *tokens"] | Float[Array, "batch *tokens classes"],
    **options: Unpack[ScoreOptions],
) -> Statistic:
    """The recall (of a class's examples, the share predicted as it) of a
    classifier over every example of an epoch or evaluation, as
    ``sklearn.metrics.recall_score(..., sample_weight=)``. The arguments
    are `f1`'s."""
    return _confusion("recall", outputs, targets, **options)
