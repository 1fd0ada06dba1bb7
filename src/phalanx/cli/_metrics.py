"""``phalanx train --metric``: the dataset-level metrics a run logs beside
its loss and accuracy, and the trainer whose `metrics` hook returns them.
The names are checked by the parser (`cli/_parser.METRICS`) and the classes
by `cli/_start.checked_start`; here each is built, as a `px.metrics`
statistic the step sums exactly like the loss."""

from collections.abc import Callable
from typing import Any

from typing_extensions import override

from .._trainer import DataParallelTrainer
from ..metrics import Statistic, auc, confusion_matrix, f1, precision, recall


# Each --metric but accuracy (the cross-entropy's own, always logged), made
# for `num_classes` classes: F1, precision and recall macro-averaged (the
# mean over classes, scikit-learn's average="macro"); the AUC binary for two
# classes, else the mean of each class's against the rest.
MAKERS: dict[str, Callable[..., Statistic]] = {
    "f1": f1,
    "precision": precision,
    "recall": recall,
    "auc": auc,
    "confusion_matrix": confusion_matrix,
}


class ClassifierTrainer(DataParallelTrainer[Any]):
    """``phalanx train``'s trainer: the cross-entropy and its accuracy, and
    the metrics --metric names, in training and in evaluations."""

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        *,
        metric_names: tuple[str, ...],
        num_classes: int,
        **options: Any,
    ):
        """
        Args:
            model: the classifier, one logit per class.
            optimizer: as `DataParallelTrainer`'s.
            metric_names: the --metric names as given; accuracy (which the
                cross-entropy logs anyway) and repeats are dropped.
            num_classes: the number of classes of the labels.
            **options: `DataParallelTrainer`'s other arguments.
        """
        self.metric_names = tuple(n for n in dict.fromkeys(metric_names) if n in MAKERS)
        self.num_classes = num_classes
        super().__init__(model, optimizer, **options)

    @override
    def metrics(self, outputs, targets):
        n = self.num_classes
        chosen = {
            name: MAKERS[name](outputs, targets, num_classes=n)
            for name in self.metric_names
        }
        return {**super().metrics(outputs, targets), **chosen}
