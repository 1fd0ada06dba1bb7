"""The JSON record of a run's timeline across its fits: reading one back
from a file, choosing the fits a resumed fit continues, and their sums.

A fit's record is a plain dict (what `px.callbacks.Timeline.record` gives
without ``earlier`` and ``total``); its ``"started"`` (wall-clock seconds at
its start) tells one fit apart from another wherever its record was kept (a
checkpoint, the file). Nothing here reads a clock or a device.
"""

import itertools
import json
import pathlib
import time
from typing import Any

from .._log import logger
from ._clock import PHASE_MEANINGS, PHASES, PhaseClock
from ._files import replace_atomically


Fit = dict[str, Any]


def earlier_fits(path: pathlib.Path) -> list[Fit]:
    """The fits a timeline file at `path` records, earliest first (none if
    there is no file; a file that is not a timeline is said once and left
    to be overwritten)."""
    if not path.exists():
        return []
    try:
        record = json.loads(path.read_text())
        fits = [*record.get("earlier", []), record]
        for fit in fits:
            fit.pop("earlier", None)
            fit.pop("total", None)
            check_fit(fit)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logger.warning(
            f"Timeline: {path} holds no timeline ({error!r}); it is replaced "
            "by this fit's, keeping nothing earlier"
        )
        return []
    return fits


def check_fit(fit: Fit) -> None:
    """Raises if `fit` is not one fit's record (`total` reads these)."""
    if not isinstance(fit["wall_s"], int | float) or not all(
        isinstance(fit["phases"].get(p, 0.0), int | float) for p in PHASES
    ):
        raise TypeError("a fit's wall_s and phases must be numbers")


def continued(kept: list[Fit], found: list[Fit]) -> list[Fit]:
    """The fits before a resumed fit: those `kept` in the checkpoint it
    resumes from (each up to that checkpoint's step), and those `found` in
    the timeline file (each as far as it was last written, which may be past
    the checkpoint: work a kill lost).

    Where the file's fits begin with the checkpoint's (the same fits, by
    ``"started"``), the file's are taken, the later fits that resumed from
    the same or another checkpoint included; else the checkpoint's alone.
    Of the two records of one fit, the one that got further is kept.
    """
    if not kept:
        return found
    ids = [fit.get("started") for fit in kept]
    same = None not in ids and [fit.get("started") for fit in found[: len(ids)]] == ids
    by_id = {fit.get("started"): fit for fit in kept}
    if not same:
        return kept
    return [_further(fit, by_id.get(fit.get("started"))) for fit in found]


def _further(fit: Fit, other: Fit | None) -> Fit:
    """Of two records of one fit, the one written later."""
    if other is None:
        return fit

    def reach(record: Fit) -> tuple[int, float]:
        return (record.get("last_step") or -1, record["wall_s"])

    return other if reach(other) > reach(fit) else fit


def total(earlier: list[Fit], this: Fit) -> dict[str, Any]:
    """The sums over `earlier` fits and `this` one: their wall time, goodput,
    phases and callbacks' seconds, and the steps computed again after a
    resume (those a fit reached past where the next one started: work lost
    with a stop or a kill)."""
    fits = [*earlier, this]
    wall = sum(fit["wall_s"] for fit in fits)
    phases = {p: sum(fit["phases"].get(p, 0.0) for fit in fits) for p in PHASES}
    callbacks: dict[str, float] = {}
    for fit in fits:
        for name, seconds in fit.get("callbacks", {}).items():
            callbacks[name] = callbacks.get(name, 0.0) + seconds
    again = 0
    for before, after in itertools.pairwise(fits):
        reached, start = before.get("last_step"), after.get("first_step")
        if reached is not None and start is not None:
            again += max(0, reached - start)
    return {
        "fits": len(fits),
        "wall_s": wall,
        "goodput": phases["step"] / wall if wall > 0 else 0.0,
        "steps_again": again,
        "phases": phases,
        "callbacks": dict(sorted(callbacks.items(), key=lambda kv: -kv[1])),
    }


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON, all or nothing (a kill while it
    is written leaves the previous file; not synced to the disk: ~0.3 ms,
    where syncing took ~5)."""
    text = json.dumps(data).encode()
    replace_atomically(path, lambda file: file.write(text), sync=False)


def fit_record(
    clock: PhaseClock,
    *,
    started: float,
    ended: str | None,
    steps: tuple[int, int],
    epochs: list[dict[str, Any]],
) -> Fit:
    """The record of a fit as its `clock` has it now: wall time, goodput,
    the phases, each callback's seconds, every compile, the `epochs`' rows;
    `started` (wall-clock seconds), how it `ended` (None: it runs), its
    first and last `steps`."""
    now = time.perf_counter()  # both read at one time: they agree
    totals = clock.totals(now)
    wall = totals["wall"]
    by_callback = clock.callback_totals(now)
    return {
        "started": started,
        "ended": ended,
        "wall_s": wall,
        "goodput": totals["step"] / wall if wall > 0 else 0.0,
        "first_step": steps[0],
        "last_step": steps[1],
        "phases": {phase: totals[phase] for phase in PHASES},
        "callbacks": dict(sorted(by_callback.items(), key=lambda kv: -kv[1])),
        "meanings": PHASE_MEANINGS,
        "compiles": [
            {
                "name": c.name,
                "function": c.function,
                "phase": c.phase,
                "seconds": c.seconds,
                "at_s": c.at,
            }
            for c in clock.compiles
        ],
        "epochs": epochs,
    }


def epoch_row(totals: dict[str, float], last: dict[str, float]) -> dict[str, float]:
    """Each phase's seconds (and the wall's) between the clock's `last`
    totals and these `totals`."""
    return {p: totals[p] - last.get(p, 0.0) for p in (*PHASES, "wall")}


def goodput(row: dict[str, float]) -> float:
    """The share of a stretch's wall time the device was stepping."""
    return row["step"] / row["wall"] if row["wall"] > 0 else 0.0
