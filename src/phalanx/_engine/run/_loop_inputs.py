"""What a fit's loop is given: how it runs (`LoopSettings`), the parts it
works with (`LoopParts`) and what it trains and evaluates on (`FitData`),
each a frozen value the trainer assembles."""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from ..._state._history import History
from ..._typing import EvalSets, HostMetrics, NanPolicy
from ..feed._pipeline import BatchPipeline
from ..program._programs import Programs
from ..step._layout import StateLayout


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """How a fit's loop runs (the trainer's settings).

    Attributes:
        prefetch: batches prepared ahead (see the trainer).
        sync_every: how often the host waits for the device (see the trainer).
        nan_policy: what a non-finite gradient does.
    """

    prefetch: int
    sync_every: int
    nan_policy: NanPolicy


class LoopParts(NamedTuple):
    """What a fit's loop works with (the trainer's parts).

    Attributes:
        pipeline: host batches to device batches.
        programs: the programs built so far (the loop builds and adds
            those it needs), and the zeroed sums an epoch starts from.
        layout: how the state travels (to name and read its leaves).
        history: where each epoch's logs and evaluation go.
        evaluate: ``evaluate(sets) -> metrics`` of the current state.
    """

    pipeline: BatchPipeline
    programs: Programs
    layout: StateLayout
    history: History
    evaluate: Callable[[EvalSets], HostMetrics]


class FitData(NamedTuple):
    """What a fit trains and evaluates on.

    Attributes:
        data: the training data (re-iterated each epoch).
        eval_sets: the sets to evaluate (`fit`'s `eval_data`), or None.
        eval_every: evaluate after every this many steps; None: at epoch
            ends.
        check_metrics: called once with a step's and an evaluation's sum
            names before the first step, where they were not known before
            the first batch (None: known).
    """

    data: Iterable[Any]
    eval_sets: EvalSets | None = None
    eval_every: int | None = None
    check_metrics: Callable[[tuple[str, ...], tuple[str, ...]], None] | None = None
