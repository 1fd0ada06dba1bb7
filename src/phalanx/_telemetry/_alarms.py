"""The loop's two alarms: slow steps, and a train step that keeps compiling.

Both read only the fit's `PhaseClock` and the host's view of the arrays
(shapes, dtypes, shardings: no device value), and each speaks in one
``phalanx:`` log line. Steps are dispatched without waiting, so one step's
time is only known over a *window*: from one point where the host waited
for the device to the next (a sync point, an epoch's end), during which a
known number of steps finished. A window's time per step, leaving out what
is planned to be slow (compiles, evaluations, checkpoint saves), is judged
against the median of the windows before it.
"""

import bisect
import collections
import os
import statistics
from typing import Any

from .._log import logger
from ._clock import PhaseClock


# The phases a window is judged on: the rest are slow by plan.
JUDGED = ("step", "data", "host", "callbacks", "gc", "other")
WARMUP = 8  # windows measured before the alarm may fire
FLOOR_S = 0.1  # a slow window is also at least this much over the median
LIMIT = 5  # warnings per fit
WINDOWS = 64  # the latest windows, whose median is the norm
_NAMES = {"step": "step (the device, as the host waits for it)"}


class SlowSteps:
    """Warns of a window of steps slower than `factor` × the median window
    (per step), naming its longest step and the phase that grew.

    The loop calls `began` as each call's batches are taken, `waited` each
    time the host has waited for the device (with the steps now known to be
    done), and `restart` after work that is slow by plan and outside the
    steps (an epoch's end, its evaluation and callbacks).
    """

    def __init__(self, clock: PhaseClock, factor: float | None):
        self.clock = clock
        self.factor = factor
        self.warned = 0
        self._windows: collections.deque[dict[str, float]] = collections.deque(
            maxlen=WINDOWS
        )
        # The windows' totals per step, sorted: their median is read at each
        # sync point (one insertion, not a sort of every window).
        self._totals: list[float] = []
        self._base = clock.totals()
        self._done = 0  # steps known finished at the window's start
        self._step = 0  # steps dispatched at the window's start
        self._longest = (0.0, 0)  # the window's longest call: seconds, step
        self._last = 0.0  # when the last call began

    def began(self, now: float, step: int) -> None:
        """A call begins at `now` (`perf_counter`) after `step` steps."""
        seconds = now - self._last
        if self._last and seconds > self._longest[0]:
            self._longest = (seconds, step)
        self._last = now

    def restart(
        self, done: int, step: int | None = None, totals: dict[str, float] | None = None
    ) -> None:
        """Start a new window here, `done` steps finished and `step` made
        (default `done`), the clock's `totals` read now (default: read)."""
        self._base = self.clock.totals() if totals is None else totals
        self._done = done
        self._step = done if step is None else step
        self._longest, self._last = (0.0, 0), 0.0

    def waited(self, done: int, step: int | None = None) -> None:
        """The host has waited for the device: `done` steps are finished, of
        `step` made (default `done`)."""
        step = done if step is None else step
        if self.factor is None or done <= self._done:
            return
        totals = self.clock.totals()
        # The window's time went to the steps it dispatched as well as those
        # it saw finish: after a restart (an epoch's start) the first sync
        # point finds few finished but a whole window dispatched, which,
        # per finished step, looked many times slower than it was.
        steps = max(done - self._done, step - self._step)
        base = self._base
        spent = {p: (totals[p] - base[p]) / steps for p in JUDGED}
        compiled = totals["compile"] > base["compile"]
        first, longest = self._step + 1, self._longest
        self.restart(done, step, totals)
        if compiled:  # a warm-up window
            return
        spent["total"] = total = sum(spent.values())
        windows, totals_sorted = self._windows, self._totals
        if len(windows) >= WARMUP and self.warned < LIMIT:
            # Each phase's median only for a window found slow: a tiny
            # model's loop reaches a sync point every few milliseconds.
            typical = _median(totals_sorted)
            extra = (total - typical) * steps
            if total > self.factor * typical and extra > FLOOR_S:
                median = {p: statistics.median(w[p] for w in windows) for p in JUDGED}
                median["total"] = typical
                self._warn(first, step, steps, spent, median, longest)
                return  # kept out of the median
        if len(windows) == windows.maxlen:  # the oldest leaves the median
            del totals_sorted[bisect.bisect_left(totals_sorted, windows[0]["total"])]
        windows.append(spent)
        bisect.insort(totals_sorted, total)

    def _warn(
        self,
        first: int,
        last: int,
        steps: int,
        spent: dict[str, float],
        median: dict[str, float],
        longest: tuple[float, int],
    ) -> None:
        grown = max(JUDGED, key=lambda p: spent[p] - median[p])
        growth = (spent[grown] - median[grown]) * steps
        where = f"step {last}" if first >= last else f"steps {first}-{last}"
        seconds, step = longest
        slowest = (
            f"; the slowest was step {step}'s ({seconds:.3g} s)"
            if seconds and grown != "step"
            else ""
        )
        self.warned += 1
        more = (
            " (no more slow-step warnings in this fit)" if self.warned == LIMIT else ""
        )
        assert self.factor is not None
        logger.warning(
            f"slow steps: {where} took {spent['total'] * steps:.3g} s "
            f"(over {steps} steps the device finished), "
            f"{_ms(spent['total'])} a step, {spent['total'] / median['total']:.1f}x "
            f"the median {_ms(median['total'])}{slowest}; the time grew in "
            f"{_NAMES.get(grown, grown)} (+{growth:.3g} s){busy_machine()}. Set "
            f"DataParallelTrainer(slow_steps=...) (phalanx train: --slow-steps) "
            f"to another factor (now {self.factor:g}), or None (off) to silence "
            f"this{more}"
        )


def busy_machine() -> str:
    """Where the machine's run queue holds more than its cores (other
    programs, or this one's own threads, waiting for a CPU), a note saying
    so; else nothing."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on this platform
        return ""
    if load <= cores:
        return ""
    return (
        f", while the machine was busy (load average {load:.1f} on {cores} "
        "CPUs: other programs may have taken the time)"
    )


def _median(ordered: list[float]) -> float:
    """The median of sorted numbers (as `statistics.median` gives it)."""
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


class Recompiles:
    """Counts the compiles of each compiled train function in a fit, keeps
    the signature of the arguments each compiled for, and warns once when
    one compiles a third time, naming what changed."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._signatures: dict[str, list[tuple[str, str, Any]]] = {}
        self.warned = False

    def compiled(self, kind: str, signature: list[tuple[str, str, Any]]) -> None:
        """`kind` (e.g. ``"train step"``) compiled for `signature`: each
        argument leaf's name, its type (``~`` marks a weak type) and its
        sharding."""
        self.counts[kind] += 1
        before = self._signatures.get(kind)
        self._signatures[kind] = signature
        if self.counts[kind] != 3 or self.warned or before is None:
            return
        self.warned = True
        logger.warning(recompile_message(kind, before, signature))


def recompile_message(
    kind: str, before: list[tuple[str, str, Any]], now: list[tuple[str, str, Any]]
) -> str:
    """What changed between two compiles' arguments, and how to avoid it."""
    changes = [
        (name, f"{old} -> {new}" if old != new else "sharding changed")
        for (name, old, old_sharding), (_, new, new_sharding) in zip(
            before, now, strict=False
        )
        if old != new or old_sharding != new_sharding
    ]
    if len(before) != len(now):
        changes.append(("arguments", f"{len(before)} leaves -> {len(now)}"))
    if not changes:
        what = (
            "no argument's shape, dtype or sharding changed (JAX's caches were "
            "cleared, or a static value changed)"
        )
    else:
        shown = "; ".join(f"{name}: {change}" for name, change in changes[:3])
        extra = f" and {len(changes) - 3} more" if len(changes) > 3 else ""
        what = f"{shown}{extra}"
    return (
        f"the {kind} compiled a third time in this fit: {what}. Each new "
        "shape, dtype, weak type (~) or sharding of an argument compiles the "
        "step again; keep them fixed, e.g. replace a state leaf with "
        "jnp.full_like(old, value), which keeps its shape, dtype and weak type "
        "(jnp.asarray(0.1) is weakly typed, jnp.asarray(0.1, jnp.float32) "
        "is not), and keep batches of one shape and dtype"
    )
