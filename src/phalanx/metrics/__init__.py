"""Dataset-level metrics, exact under every strategy: `f1`, `precision`,
`recall`, `confusion_matrix` and `auc`, returned from the trainer's
`metrics` hook (or the loss's values) as per-example sufficient statistics
that the step sums like the loss, and `Statistic`, to write your own."""

from ._auc import auc as auc
from ._confusion import (
    confusion_matrix as confusion_matrix,
    f1 as f1,
    precision as precision,
    recall as recall,
)
from ._statistic import Statistic as Statistic
