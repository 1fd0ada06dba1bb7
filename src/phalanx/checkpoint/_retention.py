"""Which checkpoints `Checkpoint` keeps, as an orbax preservation policy.

Without a monitor, the newest `keep`. With one, the best `keep` of the saves
ranked by it, and the newest save of any kind (to resume from). A save is
ranked when its metrics name the monitor; the others (a mid-epoch save, an
epoch end between two evaluations of ``eval_every``) carry empty metrics,
because orbax logs a warning at every save without metrics once it tracks a
best one. This module only decides what stays; orbax deletes the rest.
"""

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import orbax.checkpoint as ocp


_policies = ocp.checkpoint_managers


def ranked(metrics: Any, monitor: str) -> bool:
    """Whether a save's metrics (as orbax holds them) rank it by `monitor`:
    False for empty ones, and for None (saves of earlier versions)."""
    return isinstance(metrics, dict) and monitor in metrics


def metric_fn(monitor: str, mode: str) -> Callable[[Any], float]:
    """orbax's ``best_fn``: a save's value of `monitor`; the worst value for
    an unranked save, so that orbax's own sort never picks one as best."""
    worst = math.inf if mode == "min" else -math.inf

    def value(metrics: Any) -> float:
        return float(metrics[monitor]) if ranked(metrics, monitor) else worst

    return value


@dataclasses.dataclass
class _BestRanked:
    """orbax's `BestN` over the ranked saves only: an unranked one never
    takes the place of a ranked one, however few of those there are yet."""

    best: _policies.BestN
    monitor: str

    # `checkpoints` are orbax's `PolicyCheckpointInfo`s, a Protocol that is
    # not runtime-checkable: named here, the runtime checker would refuse it.
    def should_preserve(
        self,
        checkpoints: Sequence[Any],
        *,
        context: _policies.PreservationContext,
    ) -> list[bool]:
        indices = [
            i
            for i, info in enumerate(checkpoints)
            if ranked(info.metrics, self.monitor)
        ]
        kept = self.best.should_preserve(
            [checkpoints[i] for i in indices], context=context
        )
        flags = [False] * len(checkpoints)
        for i, keep in zip(indices, kept, strict=True):
            flags[i] = bool(keep)
        return flags


def retention(
    keep: int, monitor: str | None, mode: str
) -> _policies.LatestN | _policies.AnyPreservationPolicy:
    """The preservation policy of a `Checkpoint(keep=, monitor=, mode=)`."""
    if monitor is None:
        return _policies.LatestN(n=keep)
    best = _policies.BestN(
        get_metric_fn=metric_fn(monitor, mode),
        reverse=mode == "min",  # the best sort last
        n=keep,
        keep_checkpoints_without_metrics=False,
    )
    return _policies.AnyPreservationPolicy(
        [_BestRanked(best, monitor), _policies.LatestN(n=1)]
    )
