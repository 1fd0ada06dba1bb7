from collections.abc import Iterator
from typing import overload

from ._typing import HostMetrics


class History:
    """Per-epoch metrics of a trainer's fits: train metrics, plus ``eval_*``.

    Index by position for one epoch's metrics, or by name for one metric over
    all epochs (NaN where an epoch lacks it, e.g. no evaluation that epoch).

    Example:
        ```python
        trainer.fit(data, epochs=3, eval_data=test)
        trainer.history[-1]        # {"loss": ..., "accuracy": ..., "eval_loss": ...}
        trainer.history["loss"]    # [epoch 0, epoch 1, epoch 2]
        ```
    """

    def __init__(self, epochs: list[HostMetrics] | None = None):
        self.epochs: list[HostMetrics] = list(epochs or [])

    def append(self, metrics: HostMetrics) -> None:
        """Record one epoch's metrics (the same dict callbacks see at epoch end,
        so a callback may add entries to it, e.g. the learning rate)."""
        self.epochs.append(metrics)

    @property
    def names(self) -> list[str]:
        """Every metric name seen, in order of first appearance."""
        return list(dict.fromkeys(name for epoch in self.epochs for name in epoch))

    @overload
    def __getitem__(self, key: int) -> HostMetrics: ...
    @overload
    def __getitem__(self, key: str) -> list[float]: ...
    def __getitem__(self, key: int | str) -> HostMetrics | list[float]:
        if isinstance(key, str):
            if key not in self.names:
                raise KeyError(f"no metric {key!r}; the history has {self.names}")
            return [epoch.get(key, float("nan")) for epoch in self.epochs]
        return self.epochs[key]

    def __len__(self) -> int:
        return len(self.epochs)

    def __iter__(self) -> Iterator[HostMetrics]:
        return iter(self.epochs)

    def __repr__(self) -> str:
        return f"History({len(self)} epochs: {self.names})"

    def state_dict(self) -> dict[str, list[HostMetrics]]:
        """Plain data for checkpoints."""
        return {"epochs": [dict(epoch) for epoch in self.epochs]}

    def load_state_dict(self, state: dict[str, list[HostMetrics]]) -> None:
        """Restore from `state_dict`."""
        self.epochs = [dict(epoch) for epoch in state["epochs"]]
