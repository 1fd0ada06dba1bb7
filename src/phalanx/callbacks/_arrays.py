"""What a logger that writes numbers only (CSV, TensorBoard, MLflow, W&B)
does with a metric that is an array (a confusion matrix): leaves it out,
and says so once between all of them.

A run with three such loggers and a confusion matrix, trained and
evaluated, would otherwise say the same thing six times (each logger, the
metric and its ``eval_`` twin). The metrics already said are kept for the
process: one line names each array metric, with its evaluations', the
first time any of these loggers leaves it out.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._log import logger


# The array metrics said to be left out, by any logger, in this process.
_SAID: set[str] = set()


def numbers_only(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`metrics` without its arrays; the first time an array metric is left
    out by any logger (its ``eval_`` forms counted as said with it), one
    log line names it and where to find it."""
    kept = {k: v for k, v in metrics.items() if not isinstance(v, np.ndarray)}
    arrays = [(k, v) for k, v in metrics.items() if isinstance(v, np.ndarray)]
    new = {}
    # The training metrics first: an eval_ twin in the same row is said
    # with its metric.
    for name, value in sorted(arrays, key=lambda item: item[0].startswith("eval_")):
        if not _said(name):
            _SAID.add(name)
            new[name] = value
    if new:
        named = ", ".join(_named(name, value) for name, value in new.items())
        logger.info(
            "loggers that write numbers only (CSV, TensorBoard, MLflow, W&B) "
            f"leave out {named}; {'they are' if len(new) > 1 else 'it is'} in "
            f"trainer.history, and a JSONLogger writes {_them(len(new))}"
        )
    return kept


def _said(name: str) -> bool:
    """Whether `name` was said, as itself or as the metric it evaluates
    (``eval_f1``, ``eval_val_f1`` of ``f1``)."""
    return name in _SAID or (
        name.startswith("eval_") and any(name.endswith(f"_{said}") for said in _SAID)
    )


def _named(name: str, value: np.ndarray) -> str:
    """E.g. "'confusion' (an array of shape (3, 3)) and its evaluations'"."""
    twin = "" if name.startswith("eval_") else " and its evaluations' (eval_...)"
    return f"{name!r} (an array of shape {value.shape}){twin}"


def _them(count: int) -> str:
    return "them" if count > 1 else "it"
