"""The plan's search: every (mesh split, remat, offload) pair of the space,
bounded before it is compiled, then its fewest microbatches that fit found
by bisection, cheapest time bound first, until no bound left can beat the
predictions found (branch and bound: the choice is the best of the space by
the cost model, and no candidate that fits is pruned on memory). Once a
candidate is too big, the floor of its kind (`_floor.py`) is compiled: where
even it does not fit, its whole kind is bounded out uncompiled. With
``measure=N``, the N fastest predicted that fit are then run and timed
(`_timing.py`), each on the program already compiled.
"""

import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from .._engine.program._program import Program
from .._engine.program._summary import format_bytes
from .._log import logger
from ..strategies._names import strategy_name
from ..strategies._placement import has_host_memory
from ._choice import TIE, simplicity
from ._compiles import Compiles
from ._floor import SLACK, Floors, Pair
from ._measure import Builder, bounds, lint, measure
from ._options import Settings
from ._progress import MARK, PlanProgress
from ._result import Plan, PlanRow
from ._space import Candidate, PlanSpace, mesh_splits, microbatch_counts
from ._timing import STEPS, step_seconds


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return bool(getattr(record, MARK, False))  # the plan's own progress


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """phalanx's log lines dropped while candidates are built (a strategy
    says what it leaves whole as it is made, and the plan's own lint says
    it of the choice), but for the plan's progress."""
    drop = _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@_quiet()
def search(builder: Builder, remats: Sequence[Any], settings: Settings) -> Plan:
    """The plan of `builder`'s step over the settings' space on their
    devices (see module); phalanx's log lines dropped meanwhile (`_quiet`)
    but for the search's progress."""
    began = time.perf_counter()
    with PlanProgress(settings.progress) as progress:
        run = _Search(builder, settings, progress)
        pairs = run.pairs(remats)
        run.floors = Floors(pairs, remats)
        for pair in sorted(pairs, key=lambda pair: pair.bound.seconds):
            run.weigh(pair)
        timed = run.time_fastest()
    plan = Plan.of(
        run.rows,
        budget=settings.budget,
        margin=settings.margin,
        device=settings.device,
        devices=len(settings.devices),
        size=builder.size,
        compiled=run.compiles.fresh,
        seconds=time.perf_counter() - began,
        space=settings.space,
        reused=run.compiles.reused,
        from_cache=run.compiles.from_cache,
        timed_steps=STEPS if timed else 0,
    )
    run.keep_only(plan.choice)
    return plan


class _Search:
    """One plan's search: the rows found, in the order weighed, and what
    each compiled candidate compiled to."""

    def __init__(self, builder: Builder, settings: Settings, progress: PlanProgress):
        self.builder = builder
        self.settings = settings
        self.progress = progress
        self.compiles = Compiles()
        self.rows: list[PlanRow] = []
        self.floors = Floors([], ())
        # Each candidate costed: its row, its program and its compile's key
        # in the store (None: XLA refused it).
        self._costed: dict[Candidate, tuple[PlanRow, Program, Any]] = {}

    def pairs(self, remats: Sequence[Any]) -> list[Pair]:
        """The space's pairs traced and bounded: rows for those skipped
        (the batch does not split over them) or pruned (their state alone
        is over the budget, or with the held guard's spare), the others
        returned."""
        settings, n = self.settings, self.builder.size
        devices, space = settings.devices, settings.space
        offloads = space.offload
        if space.strategy is not None:  # it offloads as it does
            offloads = (False,)
        elif offloads is None:  # on a CPU host memory is the devices' own
            apart = devices[0].platform != "cpu" and has_host_memory(devices[0])
            offloads = (False, True) if apart else (False,)
        named = "" if space.strategy is None else strategy_name(space.strategy)
        grid = list(
            itertools.product(mesh_splits(len(devices), space), remats, offloads)
        )
        # Each device's examples (0: the batch does not split over it).
        shares = [n // (d * f) if n % (d * f) == 0 else 0 for (d, f, _), _, _ in grid]
        counts = [microbatch_counts(share, space) if share else [] for share in shares]
        self.progress.start(sum(max(1, len(c)) for c in counts), len(devices))
        pairs = []
        for ((data, fsdp, tensor), remat, offload), share, each in zip(
            grid, shares, counts, strict=True
        ):
            first = Candidate(
                data, fsdp, tensor, 1, remat, offload, space.context, named
            )
            if not share:
                over = named or "data x fsdp"
                why = f"{n} examples do not split over {over} = {data * fsdp}"
                self._settle([first], PlanRow(first, "skipped", why))
                continue
            self.progress.tracing(first)
            strategy = first.strategy(space, devices)
            layout = self.builder.layout(strategy, remat)
            program, flops = self.builder.program(strategy, layout)
            bound = bounds(layout, flops, settings.device)
            pair = Pair(first, each, bound, layout, program, flops)
            # Under the held guard a fit keeps a spare state beside it.
            held = program.spare is not None
            if bound.state * (2 if held else 1) > settings.usable:
                why = (
                    "the state and the spare the held guard keeps exceed the budget"
                    if held
                    else "the state alone exceeds the budget"
                )
                self._settle(_every(pair), PlanRow(first, "pruned", why, bound))
                continue
            pairs.append(pair)
        return pairs

    def weigh(self, pair: Pair) -> None:
        """Bound `pair` out, or compile its fewest microbatches that fit:
        one microbatch first, then (too big, and its kind's floor fits)
        a bisection of the other counts (a step's peak falls as its
        microbatches grow)."""
        if not pair.counts:
            why = "no microbatch count divides the batch"
            self._settle([pair.first], PlanRow(pair.first, "skipped", why))
            return
        if self._bounded(pair):
            return
        if self.floors.tight:  # a floor was over the budget: this kind's?
            self._floor(pair)
            if self._bounded(pair):
                return
        counts = pair.counts
        if not self._fits(pair, counts[0]):
            self._floor(pair)
            lo, hi = 1, len(counts) - 1
            while lo <= hi and self.floors.bounding(pair, self.settings.usable) is None:
                mid = (lo + hi) // 2
                if self._fits(pair, counts[mid]):
                    hi = mid - 1
                else:
                    lo = mid + 1
        self.progress.settled(_every(pair), "settled", "")

    def time_fastest(self) -> bool:
        """Run and time the ``measure`` fastest predicted that fit (their
        rows then hold their median step time); whether any was."""
        fitting = _fitting(self.rows)
        for _, row in fitting[: self.settings.measure]:
            _, program, key = self._costed[row.candidate]
            self.progress.timing(row.candidate)
            try:
                compiled = self.compiles.executable(key, program.lower_first)
                seconds = step_seconds(
                    compiled, program.first_arguments, STEPS, held=program.held
                )
            except jax.errors.JaxRuntimeError as error:
                said = _first_line(error)
                status = "too big" if "RESOURCE_EXHAUSTED" in str(error) else "failed"
                timed = dataclasses.replace(
                    row, status=status, why=f"its step did not run: {said}"
                )
                self.progress.timed(row.candidate, None, timed.why)
            else:
                timed = dataclasses.replace(row, timed=seconds)
                self.progress.timed(row.candidate, seconds, "")
            self.rows[next(i for i, r in enumerate(self.rows) if r is row)] = timed
        return bool(fitting) and self.settings.measure > 0

    def keep_only(self, choice: PlanRow | None) -> None:
        """The executables of the candidates compiled dropped but the
        choice's, which its fit then runs (see `_executables.py`)."""
        chosen = None if choice is None else self._costed[choice.candidate][2]
        self.compiles.keep_only(chosen)

    # --------------------------------------------------------------- private

    def _bounded(self, pair: Pair) -> bool:
        """Whether `pair` is bounded out (its row added): its kind's floor
        is over the budget, or its time bound cannot beat what fits."""
        usable = self.settings.usable
        floor = self.floors.bounding(pair, usable)
        if floor is not None:
            peak = self.floors.peak(pair)
            assert peak is not None
            scope = "the space" if self.floors.kinds == 1 else "its kind"
            why = (
                f"the least peak of {scope} does not fit: {format_bytes(peak)} "
                f"({floor.describe()})"
            )
            least = int(peak * (1 - SLACK))
            self._settle(
                _every(pair),
                PlanRow(pair.first, "bounded", why, pair.bound, least_peak=least),
            )
            return True
        fitting = _fitting(self.rows)
        wanted = max(self.settings.measure, 1)
        if len(fitting) < wanted:
            return False
        limit = fitting[wanted - 1][0]
        # A tie within TIE goes to the simpler layout (`_choice`): one that
        # may be simpler than the fastest is compiled while it may tie.
        simpler = simplicity(pair.first) < simplicity(fitting[0][1].candidate)
        if pair.bound.seconds < limit * (1 + (TIE if simpler else 0)):
            return False
        why = "its time bound is no faster than the best" + (
            "" if wanted == 1 else f" {wanted} that fit"
        )
        self._settle(_every(pair), PlanRow(pair.first, "bounded", why, pair.bound))
        return True

    def _floor(self, pair: Pair) -> None:
        """Compile the floor of `pair`'s kind, where it is not known yet."""
        found = self.floors.floor(pair)
        if found is None:
            return
        of, floor = found
        row = self._cost(of, floor)
        peak = row.measured.peak if row.measured is not None else None
        self.floors.found(pair, peak, self.settings.usable)

    def _fits(self, pair: Pair, k: int) -> bool:
        return self._cost(pair, pair.first._replace(microbatches=k)).status == "fits"

    def _cost(self, pair: Pair, candidate: Candidate) -> PlanRow:
        """`candidate` (of `pair`) compiled and costed, its row added; once
        in a plan, through the process' compiled programs."""
        if candidate in self._costed:
            return self._costed[candidate][0]
        settings = self.settings
        devices, space, device = settings.devices, settings.space, settings.device
        self.progress.compiling(candidate)
        program, own = pair.program, pair.bound  # its own FLOPs: a scan's may differ
        if candidate.microbatches > 1:
            strategy = candidate.strategy(space, devices)
            program, flops = self.builder.program(strategy, pair.layout)
            own = bounds(pair.layout, flops, device)
        self.compiles.last_key = key = None
        try:
            measured = measure(
                program, candidate, own, devices, device, compile=self.compiles.compile
            )
        except jax.errors.JaxRuntimeError as error:  # XLA refused the program
            row = PlanRow(
                candidate, "failed", f"XLA refused it: {_first_line(error)}", own
            )
        else:
            key = self.compiles.last_key
            ok = measured.peak <= settings.usable
            why = "" if ok else "its peak exceeds the budget"
            warnings = lint(pair.layout, _min_size(space))
            row = PlanRow(
                candidate, "fits" if ok else "too big", why, own, measured, warnings
            )
        self._costed[candidate] = (row, program, key)
        self.rows.append(row)
        self.progress.costed(row, key is not None and self.compiles.last_reused)
        return row

    def _settle(self, candidates: list[Candidate], row: PlanRow) -> None:
        """`row` added for `candidates`, settled without compiling."""
        self.rows.append(row)
        self.progress.settled(candidates, row.status, row.why)


def _fitting(rows: Sequence[PlanRow]) -> list[tuple[float, PlanRow]]:
    """The rows that fit with their predicted step times, the fastest (then
    the simplest) first."""
    found = [(r.measured.seconds, r) for r in rows if r.status == "fits" and r.measured]
    return sorted(found, key=lambda pair: (pair[0], simplicity(pair[1].candidate)))


def _every(pair: Pair) -> list[Candidate]:
    """Every candidate of `pair` (each microbatch count)."""
    return [pair.first._replace(microbatches=k) for k in pair.counts] or [pair.first]


def _min_size(space: PlanSpace) -> int:
    """The ``min_size`` the layout lint reads: a strategy planned as it is
    splits by its own (where it splits state by size)."""
    own = None if space.strategy is None else space.strategy.split_min_size()
    return space.min_size if own is None else own


def _first_line(error: BaseException) -> str:
    said = str(error).strip().splitlines()[0]
    return said if len(said) <= 100 else said[:99] + "…"
