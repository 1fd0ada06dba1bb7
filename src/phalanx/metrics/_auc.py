"""The area under the ROC curve, from histograms of the scores."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._typing import validates_own_arguments
from ._labels import MetricArgumentError, check_classes, log_odds, true_labels
from ._statistic import Statistic


class Ranking(Statistic):
    """Each example's score bin per class, as a positive or a negative of
    that class; the total is, for each class, the weighted histogram of its
    negatives' and its positives' scores."""

    odds: Float[Array, "batch classes"]
    true: Int[Array, " batch"]
    num_thresholds: int = eqx.field(static=True)
    binary: bool = eqx.field(static=True)

    def total(self, weight: Float[Array, " batch"]) -> Float[Array, "classes 2 bins"]:
        bins = self.num_thresholds
        classes = self.odds.shape[-1]
        # Even in sigmoid(log-odds / 2) = √p / (√p + √(1 - p)): finer than
        # even in p where classifiers' scores crowd (near 0 and 1), and
        # covering every score, however confident.
        where = jax.nn.sigmoid(self.odds / 2) * bins
        score_bin = jnp.clip(jnp.floor(where), 0, bins - 1).astype(jnp.int32)
        each = jnp.arange(classes)[None, :]
        positive = self.true[:, None] == each
        cell = (each * 2 + positive) * bins + score_bin
        counts = jax.ops.segment_sum(
            jnp.broadcast_to(weight[:, None], cell.shape).ravel(),
            cell.ravel(),
            num_segments=classes * 2 * bins,
        )
        return counts.reshape(classes, 2, bins)

    def read(self, total: np.ndarray) -> float:
        if self.binary:
            return _area(total[1])
        areas = [_area(h) for h in total if h[0].sum() > 0 and h[1].sum() > 0]
        return float(np.mean(areas)) if areas else float("nan")


def _area(histograms: np.ndarray) -> float:
    """The area under the ROC curve of one class from its negatives' and
    positives' score histograms; examples in one bin are ties (half
    credit), as the trapezoidal rule counts them."""
    negatives, positives = histograms[0][::-1], histograms[1][::-1]
    if negatives.sum() == 0 or positives.sum() == 0:
        return float("nan")
    tpr = np.concatenate([[0.0], np.cumsum(positives)]) / positives.sum()
    fpr = np.concatenate([[0.0], np.cumsum(negatives)]) / negatives.sum()
    return float(np.trapezoid(tpr, fpr))


@validates_own_arguments
def auc(
    outputs: Float[Array, " batch *classes"],
    targets: Int[Array, " batch"] | Float[Array, "batch classes"],
    *,
    num_classes: int | None = None,
    num_thresholds: int = 200,
    from_logits: bool = True,
) -> Statistic:
    """The area under the ROC curve over every example of an epoch or
    evaluation: binary for two classes (class 1 the positive one), else
    the mean over classes of each class against the rest, as
    ``sklearn.metrics.roc_auc_score(..., multi_class="ovr",
    average="macro", sample_weight=)``.

    The exact area needs every score, sorted; to be summed over devices and
    batches, scores are binned instead, into `num_thresholds` bins even in
    √p / (√p + √(1 - p)) (a probability p of 1e-4 is in the second of 200
    bins, 0.5 in the middle one), and a positive and a negative in one bin
    count as a tie (half a correct ranking). The error against the exact
    area is at most half the (weighted) share of positive-negative pairs
    that share a bin: on a digits classifier trained for a few epochs, under
    1e-5 at 200 bins, but up to 1e-2 on one barely trained, whose scores all
    crowd into a few bins; raise `num_thresholds` there. A class missing
    from the targets (no positives, or no negatives) is left out of the
    mean.

    Args:
        outputs: the model's scores per class (logits or probabilities), or
            one score per example for a binary task.
        targets: class labels, or one-hot targets (not per token: refused
            for outputs of shape (batch, *tokens, classes)).
        num_classes: the number of classes; None: counted on the outputs
            (their last axis, or 2 for one score per example).
        num_thresholds: the number of score bins.
        from_logits: whether `outputs` are logits rather than probabilities.

    Example:
        ```python
        def metrics(self, outputs, targets):
            return {"auc": px.metrics.auc(outputs, targets)}  # 10 classes
        ```
    """
    true = true_labels(outputs, targets, "px.metrics.auc")
    if true.ndim > 1:
        raise MetricArgumentError(
            f"px.metrics.auc: targets of shape {tuple(targets.shape)} label each "
            f"token of outputs {tuple(outputs.shape)}, but the AUC ranks one "
            "score per example (a token's would need a histogram per class of "
            "the vocabulary); leave 'auc' out for per-token targets and score "
            "tokens with accuracy, f1, precision, recall or confusion_matrix"
        )
    num_classes = check_classes(outputs, num_classes, "auc")
    if not isinstance(num_thresholds, int) or num_thresholds < 2:
        raise MetricArgumentError(
            f"px.metrics.auc: num_thresholds={num_thresholds!r}; pass an int >= 2 "
            "(e.g. the default 200)"
        )
    return Ranking(
        log_odds(outputs, from_logits=from_logits),
        true,
        num_thresholds,
        num_classes == 2,
    )
