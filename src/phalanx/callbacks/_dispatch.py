"""Calling a run's callbacks: one typed method per hook, and their state
for checkpoints, keyed by each callback's `state_key`.

It decides the order callbacks run in, which of them run on this process and
after each step, whose state a checkpoint's entry is, and which phase of the
fit's time (`StepInfo.clock`) each one's hooks count as, from what each
callback declares on `Callback` (never by probing an object for a member);
it names each callback on the clock, so the fit's time is told per callback
too. It runs no step and touches no device.
"""

import collections
import re
from collections.abc import Callable, Sequence
from typing import Any

from .._log import logger
from .._telemetry._clock import PHASES
from ..checkpoint._store import SnapshotStore
from ._base import Callback, StepInfo, has_state, runs_here


class Callbacks:
    """A fit's callbacks, in the order they run, and the calls into them.

    Callbacks that declare they add no metrics (``added_metrics() == ()``:
    loggers, displays, plots, `EarlyStopping`) run after the others (those
    that add some, as `Throughput`, `LearningRateMonitor`, `Timeline`, or
    declare nothing), each group in the order given, so what is added
    reaches every logger, whatever the order of the list. Snapshot stores (e.g.
    `px.callbacks.Checkpoint`) run after every other callback (as in
    Lightning), so a snapshot holds what the others did for its step. In a
    multi-process run, callbacks marked `main_process_only` (loggers,
    displays) run on process 0 only; every callback's state is kept
    everywhere.

    A `display` the trainer adds (its default progress bar) runs after the
    user's callbacks and before the stores, but is not one of `all`: it
    keeps no state in snapshots. A callback is called after each step only
    in a fit where, once started, its ``needs_steps`` says so (the default
    bar showing rows per epoch alone costs the loop nothing per step).

    Each stateful callback's state is saved under its `state_key`, so the
    list may be reordered, or callbacks added, between a save and a resume.

    Raises:
        ValueError: two stateful callbacks share a `state_key` (or the same
            stateful callback is listed twice).
        TypeError: a callback's `state_name` is not a str or None.
    """

    def __init__(self, callbacks: Sequence[Callback], display: Callback | None = None):
        _check_declarations(callbacks)
        self.all: tuple[Callback, ...] = tuple(sorted(callbacks, key=_rank))
        ordered = self.all
        if display is not None:
            split = sum(not isinstance(c, SnapshotStore) for c in self.all)
            ordered = (*self.all[:split], display, *self.all[split:])
        self.here = tuple(c for c in ordered if runs_here(c))
        self.display = display
        # Only callbacks that do something after a step are called per step.
        self.step_hooks = tuple(c for c in self.here if c.needs_steps)
        # At fit's end, those that see the whole fit come last.
        self.ending = tuple(sorted(self.here, key=lambda c: c.ends_last))
        self.stores: tuple[SnapshotStore, ...] = tuple(
            c for c in self.all if isinstance(c, SnapshotStore)
        )
        # How the fit's clock names each one's time (`PhaseClock.by_callback`).
        self.names: dict[int, str] = _names(ordered)

    def fit_start(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_fit_start(info), info)
        # A display knows whether it draws from steps once it has started.
        self.step_hooks = tuple(c for c in self.here if c.needs_steps)

    def fit_end(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_fit_end(info), info, self.ending)

    def epoch_start(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_epoch_start(info), info)

    def epoch_end(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_epoch_end(info), info)

    def step_end(self, info: StepInfo) -> None:
        clock = info.clock
        if clock is None:
            for callback in self.step_hooks:  # per step: no call in between
                callback.on_step_end(info)
            return
        # Per step: one clock change per callback, each charged to its name.
        names, entered = self.names, False
        for callback in self.step_hooks:
            if entered:
                clock.switch(callback.time_phase, names[id(callback)])
            else:
                clock.enter(callback.time_phase, names[id(callback)])
                entered = True
            callback.on_step_end(info)
        if entered:
            clock.leave()

    def eval_start(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_eval_start(info), info)

    def eval_end(self, info: StepInfo) -> None:
        self._each(lambda callback: callback.on_eval_end(info), info)

    def _each(
        self,
        hook: Callable[[Callback], None],
        info: StepInfo,
        order: tuple[Callback, ...] | None = None,
    ) -> None:
        """Call `hook` on every callback this process runs, in order (or in
        `order`), each charged to its phase on `info`'s clock."""
        clock = info.clock
        order = self.here if order is None else order
        if clock is None or clock.stopped is not None:  # outside a fit's loop
            for callback in order:
                hook(callback)
            return
        names = self.names
        for callback in order:
            with clock.within(callback.time_phase, names[id(callback)]):
                hook(callback)

    def exception(self, info: StepInfo, error: BaseException) -> None:
        """Every callback gets to clean up (close files, stop displays), even
        if another one's `on_exception` fails: that failure becomes a note on
        `error`."""
        for callback in self.here:
            try:
                callback.on_exception(info, error)
            except Exception as hook_error:
                error.add_note(
                    f"{type(callback).__name__}.on_exception also failed: "
                    f"{hook_error!r}"
                )

    def state_dicts(self) -> dict[str, Any]:
        """Every stateful callback's `state_dict`, by its `state_key`."""
        states = {c.state_key: c.state_dict() for c in self.all if has_state(c)}
        return {key: state for key, state in states.items() if state is not None}

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Give each callback its state from `state_dicts` (where it has one).

        A checkpoint written before states were keyed by `state_key` keys
        them ``"<index>:<ClassName>"``: such a state goes to the one
        stateful callback of its class where the class names one state and
        one callback, else (as it was written) to the callback at that index
        of `all`. A state no callback takes is reported, not an error (as
        Lightning does): the run goes on without it, as it would had that
        callback been removed; a callback given no state keeps its own.
        """
        unclaimed = dict(states)
        for callback, key in self._owners(states):
            callback.load_state_dict(unclaimed.pop(key))
        if unclaimed:
            logger.warning(
                f"the checkpoint holds the state of callbacks this trainer "
                f"lacks, keyed {', '.join(map(repr, unclaimed))}; they are "
                "left out. Pass those callbacks (with the same state_name, if "
                "any) to resume them too"
            )

    def _owners(self, states: dict[str, Any]) -> list[tuple[Callback, str]]:
        """Each callback with a state in `states`, and that state's key."""
        legacy = {key: key.partition(":")[2] for key in states if _LEGACY.match(key)}
        saved = collections.Counter(legacy.values())
        stateful = collections.Counter(
            type(c).__name__ for c in self.all if has_state(c)
        )
        owners = []
        for i, callback in enumerate(self.all):
            kind = type(callback).__name__
            if not has_state(callback):
                continue
            if states.get(callback.state_key) is not None:
                owners.append((callback, callback.state_key))
            elif saved[kind] == 1 and stateful[kind] == 1:
                owners.append((callback, next(k for k in legacy if legacy[k] == kind)))
            elif states.get(f"{i}:{kind}") is not None:
                owners.append((callback, f"{i}:{kind}"))
        return owners


# A key of a checkpoint written before `state_key`: "<index>:<ClassName>".
_LEGACY = re.compile(r"\d+:")


def _rank(callback: Callback) -> int:
    """Where `callback` runs: those that may add metrics first (0), then
    those declaring they add none (1), snapshot stores last (2); `sorted`
    keeps the given order within each."""
    if isinstance(callback, SnapshotStore):
        return 2
    return 1 if callback.added_metrics() == () else 0


def _names(callbacks: Sequence[Callback]) -> dict[int, str]:
    """Each callback's name on the fit's clock, by `id`: its `state_key`
    (the class name, or ``Class:state_name``), numbered ``#2``, ``#3``...
    where several share one."""
    names: dict[int, str] = {}
    seen: collections.Counter[str] = collections.Counter()
    for callback in callbacks:
        key = callback.state_key
        seen[key] += 1
        names[id(callback)] = key if seen[key] == 1 else f"{key} #{seen[key]}"
    return names


def _check_declarations(callbacks: Sequence[Callback]) -> None:
    """Raise unless what each callback declares holds: a `time_phase` the
    clock knows, and, where it has state, a `state_key` of its own."""
    for i, callback in enumerate(callbacks):
        if callback.time_phase not in PHASES:
            raise ValueError(
                f"callbacks[{i}].time_phase={callback.time_phase!r} is not a "
                f"phase of the fit's time; use one of {', '.join(PHASES)}"
            )
        name = callback.state_name
        if name is not None and not isinstance(name, str):
            raise TypeError(
                f"callbacks[{i}].state_name={name!r} must be a str or None, "
                "e.g. state_name='val'"
            )
    by_key = collections.defaultdict(list)
    for i, callback in enumerate(callbacks):
        if has_state(callback):
            by_key[callback.state_key].append(i)
    for key, places in by_key.items():
        if len(places) < 2:
            continue
        first, second = places[:2]
        if callbacks[first] is callbacks[second]:
            raise ValueError(
                f"callbacks[{first}] and callbacks[{second}] are the same "
                f"{type(callbacks[first]).__name__}; pass it once"
            )
        raise ValueError(
            f"callbacks[{first}] and callbacks[{second}] are both stateful "
            f"callbacks with state_key={key!r}, so a checkpoint could keep "
            "the state of only one; give the second a name of its own, e.g. "
            f"callbacks[{second}].state_name = 'second' (its key is then "
            f"{key + ':second'!r})"
        )
