"""Which of the layouts that fit a plan chooses (`choose`): the fastest,
where a tie within `TIE` goes to the simpler layout (`simplicity`).

Times within a few per cent are not told apart: the cost model's own error
is larger than that (the guide "Planning a fit" says how much), and so is
the noise of a few steps timed. Between two layouts that close, the simpler
is the better answer: fewer mesh axes split (fewer collectives, a layout a
user can read), no remat (no recomputation), fewer microbatches, the
optimizer state on the device.
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

from ._space import Candidate


# Two step times within this share of the faster are a tie (predicted
# times, or measured ones where the plan timed steps).
TIE = 0.03

_Row = TypeVar("_Row")


def simplicity(candidate: Candidate) -> tuple[int, int, int, int]:
    """How complex `candidate` is, least first: its mesh axes split (data,
    fsdp and tensor of size above 1), whether it remats, its microbatches,
    whether it offloads the optimizer state."""
    axes = sum(size > 1 for size in (candidate.data, candidate.fsdp, candidate.tensor))
    remats = candidate.remat is not None and candidate.remat is not False
    return (axes, int(remats), candidate.microbatches, int(candidate.offload))


def choose(
    rows: Sequence[_Row],
    seconds: Callable[[_Row], float],
    candidate: Callable[[_Row], Candidate],
) -> _Row | None:
    """The simplest of `rows` whose `seconds` are within `TIE` of the
    least (None where there are none); of two as simple, the faster."""
    if not rows:
        return None
    fastest = min(seconds(row) for row in rows)
    tied = [row for row in rows if seconds(row) <= fastest * (1 + TIE)]
    return min(tied, key=lambda row: (simplicity(candidate(row)), seconds(row)))
