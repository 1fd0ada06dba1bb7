"""`History`: the metrics of a trainer's fits, per epoch and per evaluation.

Plain host data (floats keyed by metric name, and the step each was
recorded at) that a checkpoint saves as JSON through `state_dict`. It never
touches JAX or the devices: it is given metrics already on the host."""

from collections.abc import Iterator
from typing import Any, overload

import numpy as np

from .._typing import HostMetrics, MetricValue


class History:
    """Per-epoch metrics of a trainer's fits: train metrics, plus ``eval_*``;
    and every evaluation `fit` made, by step.

    Index by position for one epoch's metrics, or by name for one metric over
    all epochs (NaN where an epoch lacks it, e.g. no evaluation that epoch).
    `evaluations` lists each evaluation of ``fit(eval_data=...)`` with its
    step: at epoch ends (whose metrics also hold them) or, with
    ``eval_every=``, every that many steps (then only there). `steps` holds
    the step each epoch ended at.

    Example:
        ```python
        trainer.fit(data, epochs=3, eval_data=test)
        trainer.history[-1]        # {"loss": ..., "accuracy": ..., "eval_loss": ...}
        trainer.history["loss"]    # [epoch 0, epoch 1, epoch 2]
        trainer.history.evaluations[-1]  # {"step": ..., "epoch": 2, "eval_loss": ...}
        ```
    """

    def __init__(self, epochs: list[HostMetrics] | None = None):
        self.epochs: list[HostMetrics] = list(epochs or [])
        # The step each epoch ended at (None: recorded by an earlier version).
        self.steps: list[int | None] = [None] * len(self.epochs)
        # (step, epoch, metrics): the metrics are the dict callbacks see.
        self._evaluations: list[tuple[int, int, HostMetrics]] = []

    def append(self, metrics: HostMetrics, step: int | None = None) -> None:
        """Record one epoch's metrics (the same dict callbacks see at epoch end,
        so a callback may add entries to it, e.g. the learning rate), and the
        step it ended at."""
        self.epochs.append(metrics)
        self.steps.append(step)

    def append_evaluation(self, step: int, epoch: int, metrics: HostMetrics) -> None:
        """Record one evaluation of `fit` at `step` (its metrics the same dict
        callbacks see at `on_eval_end`)."""
        self._evaluations.append((step, epoch, metrics))

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """Each evaluation `fit` made: ``{"step", "epoch", "eval_...": ...}``."""
        return [
            {"step": step, "epoch": epoch, **metrics}
            for step, epoch, metrics in self._evaluations
        ]

    @property
    def names(self) -> list[str]:
        """Every metric name seen, in order of first appearance."""
        return list(dict.fromkeys(name for epoch in self.epochs for name in epoch))

    @property
    def scalar_names(self) -> list[str]:
        """The names of the metrics that are numbers (not arrays, such as a
        confusion matrix), in order of first appearance."""
        arrays = {
            name
            for epoch in self.epochs
            for name, value in epoch.items()
            if isinstance(value, np.ndarray)
        }
        return [name for name in self.names if name not in arrays]

    @overload
    def __getitem__(self, key: int) -> HostMetrics: ...
    @overload
    def __getitem__(self, key: str) -> list[MetricValue]: ...
    def __getitem__(self, key: int | str) -> HostMetrics | list[MetricValue]:
        if isinstance(key, str):
            if key not in self.names:
                where = (
                    "; it is in history.evaluations (fit evaluated every "
                    "eval_every steps, not at epoch ends)"
                    if any(key in metrics for _, _, metrics in self._evaluations)
                    else ""
                )
                raise KeyError(
                    f"no metric {key!r} in the epochs' metrics {self.names}{where}"
                )
            return [epoch.get(key, float("nan")) for epoch in self.epochs]
        return self.epochs[key]

    def __len__(self) -> int:
        return len(self.epochs)

    def __iter__(self) -> Iterator[HostMetrics]:
        return iter(self.epochs)

    def __repr__(self) -> str:
        evaluations = (
            f", {len(self._evaluations)} evaluations" if self._evaluations else ""
        )
        return f"History({len(self)} epochs: {self.names}{evaluations})"

    def state_dict(self) -> dict[str, list[Any]]:
        """Plain data for checkpoints."""
        return {
            "epochs": [_plain(epoch) for epoch in self.epochs],
            "steps": list(self.steps),
            "evaluations": [_plain(row) for row in self.evaluations],
        }

    def load_state_dict(self, state: dict[str, list[Any]]) -> None:
        """Restore from `state_dict` (of this or an earlier version)."""
        self.epochs = [_metrics(epoch) for epoch in state["epochs"]]
        self.steps = list(state.get("steps", [None] * len(self.epochs)))
        self._evaluations = [
            (
                int(row["step"]),
                int(row["epoch"]),
                _metrics({k: v for k, v in row.items() if k not in ("step", "epoch")}),
            )
            for row in state.get("evaluations", [])
        ]


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as JSON can hold them: an array as ``{"array": nested lists}``."""
    return {
        k: {"array": v.tolist()} if isinstance(v, np.ndarray) else v
        for k, v in metrics.items()
    }


def _metrics(plain: dict[str, Any]) -> HostMetrics:
    """The metrics `_plain` wrote."""
    return {
        k: np.asarray(v["array"]) if isinstance(v, dict) else v
        for k, v in plain.items()
    }
