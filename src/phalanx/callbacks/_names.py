from typing import Any


def tracker_names(metrics: dict[str, Any]) -> dict[str, Any]:
    """Epoch and evaluation metrics under a tracker's tags: ``eval_<name>``
    as ``eval/<name>``, the others as ``epoch/<name>``."""
    return {
        f"eval/{name.removeprefix('eval_')}"
        if name.startswith("eval_")
        else f"epoch/{name}": value
        for name, value in metrics.items()
    }
