"""The least peak of a kind of candidate (`Floors`): one compile that can
prove that none of them fits.

A plan's candidates fall into kinds that differ in what a device holds
besides its share of the state: the tensor split (how much of each
activation a device keeps), whether the optimizer state is offloaded, and,
where the space has no plain ``remat=True``, the remat setting. Within a
kind every candidate has the same examples per device (data × fsdp is the
same), and one of them is the floor: the most microbatches (the fewest
examples in flight), ``remat=True`` (the fewest activations saved), the
most fsdp (the least state, and the least of the gradients and optimizer
update held whole).

What the plan relies on, **the floor's monotonicity**: no candidate of a
kind has a peak below `SLACK` under its floor's. A step's peak falls as its
microbatches grow (the bisection relies on it too), remat saves no more
than not, and splitting the state over fsdp instead of data takes off more
state than the gathered parameters it adds. None is exact in XLA: measured
(tests/plan/test_plan_floor.py, a `Stacked` transformer, every candidate of
8 devices), remat held 0.5% more than no remat where activations are small,
and fsdp 3% more than data under SGD (little state to take off); the slack
covers such. So where the floor's peak exceeds the budget, less the margin,
by more than `SLACK`, every candidate of its kind is bounded out without
being compiled: a plan nothing can meet answers in a compile or two.
"""

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

from ._space import Candidate


# The share by which a candidate's peak may be under its floor's (see module).
SLACK = 0.1


class Pair(NamedTuple):
    """A (mesh, remat, offload) of the space, traced and bounded: its
    first candidate (one microbatch), the microbatch counts it may take, and
    what the search compiles it from."""

    first: Candidate
    counts: list[int]
    bound: Any  # `_measure.Bounds`
    layout: Any
    program: Any
    flops: float


def kind(candidate: Candidate, remats: Sequence[Any]) -> Hashable:
    """The kind of `candidate` (see module): its tensor split and offload,
    and its remat where the space has no ``remat=True`` to stand for all."""
    shared = any(r is True for r in remats)
    return (candidate.tensor, candidate.offload, None if shared else candidate.remat)


class Floors:
    """The floor of each kind among a plan's pairs, and what it found.

    Attributes:
        tight: whether some floor was found over the budget (a sign that
            others may be: the search then weighs a kind's floor before its
            first candidate).
    """

    def __init__(self, pairs: Sequence[Pair], remats: Sequence[Any]):
        self._remats = remats
        self._floors: dict[Hashable, tuple[Pair, Candidate]] = {}
        for pair in pairs:
            if not pair.counts:  # no count of the space divides its share
                continue
            key = kind(pair.first, remats)
            known = self._floors.get(key)
            if known is None or _lower(pair, known[0]):
                floor = pair.first._replace(microbatches=max(pair.counts))
                self._floors[key] = (pair, floor)
        self._peaks: dict[Hashable, int | None] = {}
        self.tight = False

    def floor(self, pair: Pair) -> tuple[Pair, Candidate] | None:
        """The floor of `pair`'s kind, and its pair (None: its pair has no
        microbatch count, or its peak is known)."""
        key = kind(pair.first, self._remats)
        if key in self._peaks or not pair.counts:
            return None
        return self._floors.get(key)

    def found(self, pair: Pair, peak: int | None, usable: float) -> None:
        """Record the peak of `pair`'s kind's floor (None: XLA refused it)."""
        self._peaks[kind(pair.first, self._remats)] = peak
        self.tight |= peak is not None and peak * (1 - SLACK) > usable

    def bounding(self, pair: Pair, usable: float) -> Candidate | None:
        """The floor that bounds `pair` out (its peak less `SLACK` over
        `usable`); None: none does, or none is known yet."""
        key = kind(pair.first, self._remats)
        peak = self._peaks.get(key)
        if peak is None or peak * (1 - SLACK) <= usable:
            return None
        return self._floors[key][1]

    def peak(self, pair: Pair) -> int | None:
        """The peak found of `pair`'s kind's floor (None: not known)."""
        return self._peaks.get(kind(pair.first, self._remats))

    @property
    def kinds(self) -> int:
        """How many kinds the pairs fall into."""
        return len(self._floors)


def _lower(pair: Pair, than: Pair) -> bool:
    """Whether `pair` is more of a floor than `than` (remat on, then the
    most fsdp, then the least state)."""

    def order(p: Pair) -> tuple[int, int, int]:
        return (int(p.first.remat is not True), -p.first.fsdp, p.bound.state)

    return order(pair) < order(than)
