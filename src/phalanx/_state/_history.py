"""`History`: the metrics of a trainer's fits, per epoch and per evaluation.

Plain host data (floats keyed by metric name, and the step each was
recorded at) that a checkpoint saves as JSON through `state_dict`. It never
touches JAX or the devices: it is given metrics already on the host."""

from collections.abc import Iterator, Mapping
from typing import Any, overload

import numpy as np

from .._typing import HostMetrics, MetricValue
from .._validate import int_at_least, optional_int_at_least


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

    def load_state_dict(self, state: Any) -> None:
        """Restore from `state_dict` (of this or an earlier version).

        Raises:
            ValueError: `state` is not what a `state_dict` writes (a record
                edited or damaged), named in one line; nothing changes then.
        """
        if not isinstance(state, Mapping) or not isinstance(state.get("epochs"), list):
            raise ValueError(
                f"history={_short(state)} must be a dict whose 'epochs' is a list of "
                "each epoch's metrics, as History.state_dict() writes"
            )
        epochs = [
            _metrics(epoch, f"history['epochs'][{i}]")
            for i, epoch in enumerate(state["epochs"])
        ]
        steps = state.get("steps", [None] * len(epochs))
        if not isinstance(steps, list) or len(steps) != len(epochs):
            raise ValueError(
                f"history['steps']={_short(steps)} must be a list of the step each "
                f"of the {len(epochs)} epochs ended at"
            )
        for i, step in enumerate(steps):
            optional_int_at_least(f"history['steps'][{i}]", step, 0)
        rows = state.get("evaluations", [])
        if not isinstance(rows, list):
            raise ValueError(
                f"history['evaluations']={_short(rows)} must be a list of evaluations"
            )
        evaluations = []
        for i, row in enumerate(rows):
            where = f"history['evaluations'][{i}]"
            if not isinstance(row, Mapping):
                raise ValueError(f"{where}={_short(row)} must be a dict of metrics")
            step = int_at_least(f"{where}['step']", row.get("step"), 0)
            epoch = int_at_least(f"{where}['epoch']", row.get("epoch"), 0)
            rest = {k: v for k, v in row.items() if k not in ("step", "epoch")}
            evaluations.append((step, epoch, _metrics(rest, where)))
        self.epochs, self.steps, self._evaluations = epochs, list(steps), evaluations


def _plain(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as JSON can hold them: an array as ``{"array": nested lists}``."""
    return {
        k: {"array": v.tolist()} if isinstance(v, np.ndarray) else v
        for k, v in metrics.items()
    }


def _metrics(plain: Any, where: str) -> HostMetrics:
    """The metrics `_plain` wrote (`where` names them in an error)."""
    if not isinstance(plain, Mapping) or not all(isinstance(k, str) for k in plain):
        raise ValueError(f"{where}={_short(plain)} must be a dict of metrics by name")
    metrics = {}
    for name, value in plain.items():
        if isinstance(value, Mapping):  # an array (`_plain`)
            try:
                value = np.asarray(value["array"])
            except (KeyError, ValueError):  # (ragged lists: ValueError)
                raise ValueError(
                    f"{where}[{name!r}]={_short(value)} must be a number or "
                    "{'array': nested lists of one shape}"
                ) from None
        metrics[name] = value
    return metrics


def _short(value: Any) -> str:
    """`value` as a message shows it: its repr, cut at 60 characters."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
