"""What a logger that writes numbers only does with a metric that is an
array (a confusion matrix): leaves it out, and says so once."""

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._log import logger


def numbers_only(
    metrics: Mapping[str, Any], said: set[str], writer: str
) -> dict[str, Any]:
    """`metrics` without its arrays; the first time an array is left out,
    one log line names it and where to find it (`said` remembers)."""
    kept = {}
    for name, value in metrics.items():
        if not isinstance(value, np.ndarray):
            kept[name] = value
        elif name not in said:
            said.add(name)
            logger.info(
                f"{writer} writes numbers only: it leaves out {name!r}, an array "
                f"of shape {value.shape}; it is in trainer.history (and a "
                "JSONLogger writes it)"
            )
    return kept
