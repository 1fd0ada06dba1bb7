"""Calling a run's callbacks: one typed method per hook."""

from collections.abc import Sequence
from typing import Any

from .._state._snapshot import SnapshotStore
from ._base import Callback, StepInfo, overrides, runs_here


class Callbacks:
    """A fit's callbacks, in the order they run, and the calls into them.

    Snapshot stores (e.g. `px.callbacks.Checkpoint`) run after every other
    callback (as in Lightning), so a snapshot holds what the others did for
    its step. In a multi-process run, callbacks marked `main_process_only`
    (loggers, displays) run on process 0 only; every callback's state is
    kept everywhere.

    A `display` the trainer adds (its default progress bar) runs after the
    user's callbacks and before the stores, but is not one of `all`: it
    keeps no state in snapshots, and the user's callbacks keep their
    indices whether it is shown or not. It is called after each step only
    in a fit where, once started, its ``needs_steps`` says so (a live bar:
    rows per epoch alone cost the loop nothing per step).
    """

    def __init__(self, callbacks: Sequence[Callback], display: Callback | None = None):
        self.all: tuple[Callback, ...] = tuple(
            sorted(callbacks, key=lambda c: isinstance(c, SnapshotStore))
        )
        ordered = self.all
        if display is not None:
            split = sum(not isinstance(c, SnapshotStore) for c in self.all)
            ordered = (*self.all[:split], display, *self.all[split:])
        self.here = tuple(c for c in ordered if runs_here(c))
        self.display = display
        # Only callbacks that do something after a step are called per step.
        self.step_hooks = tuple(c for c in self.here if overrides(c, "on_step_end"))
        self.stores: tuple[SnapshotStore, ...] = tuple(
            c for c in self.all if isinstance(c, SnapshotStore)
        )

    def fit_start(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_fit_start(info)
        display = self.display
        self.step_hooks = tuple(
            c
            for c in self.here
            if overrides(c, "on_step_end")
            and (c is not display or getattr(display, "needs_steps", True))
        )

    def fit_end(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_fit_end(info)

    def epoch_start(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_epoch_start(info)

    def epoch_end(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_epoch_end(info)

    def step_end(self, info: StepInfo) -> None:
        for callback in self.step_hooks:
            callback.on_step_end(info)

    def eval_start(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_eval_start(info)

    def eval_end(self, info: StepInfo) -> None:
        for callback in self.here:
            callback.on_eval_end(info)

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
        """Every stateful callback's `state_dict`, by ``"index:ClassName"``."""
        states = {_key(i, c): c.state_dict() for i, c in enumerate(self.all)}
        return {key: state for key, state in states.items() if state is not None}

    def load_state_dicts(self, states: dict[str, Any]) -> None:
        """Give each callback its state from `state_dicts` (where it has one)."""
        for i, callback in enumerate(self.all):
            state = states.get(_key(i, callback))
            if state is not None:
                callback.load_state_dict(state)


def _key(index: int, callback: Callback) -> str:
    return f"{index}:{type(callback).__name__}"
