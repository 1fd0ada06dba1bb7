"""The plan's search: every (mesh split, remat) pair of the space, bounded
before it is compiled, then its fewest microbatches that fit found by
bisection, cheapest bound first, until no bound left can beat the best
prediction found (branch and bound: the choice is the best of the space by
the cost model, and no candidate that fits is pruned on memory).
"""

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from .._log import logger
from ..strategies._placement import has_host_memory
from ._measure import Bounds, Builder, Measured, bounds, lint, measure
from ._options import Settings
from ._result import Plan, PlanRow
from ._space import Candidate, mesh_splits, microbatch_counts


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        del record
        return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """phalanx's log lines dropped while candidates are built: a strategy
    says what it leaves whole as it is made, and the plan's own lint says
    it of the choice."""
    drop = _Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@_quiet()
def search(builder: Builder, remats: Sequence[Any], settings: Settings) -> Plan:
    """The plan of `builder`'s step over the settings' space on their
    devices (see module); phalanx's log lines dropped meanwhile (`_quiet`)."""
    began = time.perf_counter()
    devices, space = settings.devices, settings.space
    rows: list[PlanRow] = []
    pairs: list[tuple[Bounds, Candidate, Any]] = []
    n = builder.size
    offloads = space.offload
    if offloads is None:  # on a CPU host memory is the devices' own
        apart = devices[0].platform != "cpu" and has_host_memory(devices[0])
        offloads = (False, True) if apart else (False,)
    for (data, fsdp, tensor), remat, offload in itertools.product(
        mesh_splits(len(devices), space), remats, offloads
    ):
        first = Candidate(data, fsdp, tensor, 1, remat, offload, space.context)
        if n % (data * fsdp):
            why = f"{n} examples do not split over data x fsdp = {data * fsdp}"
            rows.append(PlanRow(first, "skipped", why))
            continue
        strategy = first.strategy(space, devices)
        layout = builder.layout(strategy, remat)
        program, flops = builder.program(strategy, layout)
        bound = bounds(layout, flops, settings.device)
        if bound.state > settings.usable:
            rows.append(
                PlanRow(first, "pruned", "the state alone exceeds the budget", bound)
            )
            continue
        pairs.append((bound, first, (layout, program, flops)))
    best: Measured | None = None
    compiled = 0
    for bound, first, (layout, program, flops) in sorted(
        pairs, key=lambda pair: pair[0].seconds
    ):
        if best is not None and bound.seconds >= best.seconds:
            rows.append(
                PlanRow(first, "bounded", "its bound is no faster than the best", bound)
            )
            continue
        counts = microbatch_counts(n // (first.data * first.fsdp), space)
        found = _fewest_that_fit(
            builder, first, counts, layout, (program, flops), settings, bound
        )
        compiled += len(found)
        rows.extend(found)
        fits = [row for row in found if row.status == "fits"]
        if fits and fits[0].measured is not None:
            if best is None or fits[0].measured.seconds < best.seconds:
                best = fits[0].measured
    return Plan.of(
        rows,
        budget=settings.budget,
        margin=settings.margin,
        device=settings.device,
        devices=len(devices),
        size=n,
        compiled=compiled,
        seconds=time.perf_counter() - began,
        space=space,
    )


def _fewest_that_fit(
    builder: Builder,
    first: Candidate,
    counts: list[int],
    layout: Any,
    traced: tuple[Any, float],
    settings: Settings,
    bound: Bounds,
) -> list[PlanRow]:
    """The rows of the microbatch counts compiled for `first`'s mesh and
    remat: one microbatch first, then a bisection of the others for the
    fewest that fit (a step's peak falls as its microbatches grow)."""
    rows: dict[int, PlanRow] = {}
    devices, space, device = settings.devices, settings.space, settings.device

    def fits(k: int) -> bool:
        candidate = first._replace(microbatches=k)
        own = bound  # its own FLOPs: a microbatch scan's may differ
        if k == 1:
            program = traced[0]
        else:
            program, flops = builder.program(candidate.strategy(space, devices), layout)
            own = bounds(layout, flops, device)
        try:
            measured = measure(program, candidate, own, devices, device)
        except jax.errors.JaxRuntimeError as error:  # XLA refused the program
            said = str(error).strip().splitlines()[0]
            said = said if len(said) <= 100 else said[:99] + "…"
            rows[k] = PlanRow(candidate, "failed", f"XLA refused it: {said}", own)
            return False
        ok = measured.peak <= settings.usable
        rows[k] = PlanRow(
            candidate,
            "fits" if ok else "too big",
            "" if ok else "its peak exceeds the budget",
            own,
            measured,
            lint(layout, space.min_size),
        )
        return ok

    if not counts:
        return [PlanRow(first, "skipped", "no microbatch count divides the batch")]
    if not fits(counts[0]):
        lo, hi = 1, len(counts) - 1
        found = None
        while lo <= hi:
            mid = (lo + hi) // 2
            if fits(counts[mid]):
                found, hi = mid, mid - 1
            else:
                lo = mid + 1
        del found
    return [rows[k] for k in sorted(rows)]
