"""The names of the built-in metrics: what ``DataParallelTrainer(metrics=)``
takes and ``phalanx train --metric`` offers, listed once.

Plain Python, without JAX: the CLI's parser reads them to answer ``--help``
before JAX is imported. `phalanx.metrics` (``_named.py``) makes each name
into the function a step calls.
"""

import typing
from typing import Literal, TypeAlias


MetricName: TypeAlias = Literal[
    "accuracy", "f1", "precision", "recall", "auc", "confusion_matrix"
]
METRIC_NAMES: tuple[MetricName, ...] = typing.get_args(MetricName)
