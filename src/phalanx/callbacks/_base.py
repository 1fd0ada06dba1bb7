"""Callbacks: the base class, what a hook is told (`StepInfo`), and the
part of the trainer a hook may use (`TrainerLike`)."""

import dataclasses
import functools
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import equinox as eqx
import jax
import optax

from .._precision import Precision
from .._state._history import History
from .._state._snapshot import Snapshot
from .._state._sums import StepSums
from .._state._train_state import TrainState
from .._telemetry._clock import PhaseClock, TimePhase
from .._telemetry._flops import StepFlops
from .._typing import HostMetrics, NanPolicy
from ..strategies import Strategy


# The model class of a run: `DataParallelTrainer[M]` is a `TrainerLike[M]`,
# whose callbacks may be `Callback[M]`, told `StepInfo[M]`.
_Model = TypeVar("_Model", bound=eqx.Module)


@runtime_checkable
class TrainerLike(Protocol[_Model]):
    """What a callback may use of the trainer that runs it
    (`phalanx.DataParallelTrainer` is one), typed by its model class."""

    history: History
    # Set to True to end `fit` after the current step (Keras' idiom).
    stop_training: bool
    # The decay of the parameters' moving average, which evaluations use
    # (None: none kept).
    ema: float | None
    # The dtypes a step computes in.
    precision: Precision
    # The optax transformation the step applies (read, with the state, for
    # the learning rate it uses).
    optimizer: optax.GradientTransformation
    # How the run is laid out and stepped, as built (an experiment tracker
    # records them as the run's config: `callbacks/_hparams.py`).
    strategy: Strategy
    steps_per_call: int
    nan_policy: NanPolicy
    sync_every: int

    @property
    def state(self) -> TrainState[_Model]:
        """The current `TrainState`."""
        ...

    @state.setter
    def state(self, state: TrainState[_Model]) -> None: ...

    @property
    def model(self) -> _Model:
        """The current model."""
        ...

    def snapshot(self) -> Snapshot:
        """Everything needed to continue the run exactly, as it is now."""
        ...

    def flops_per_step(self, batch: Any = None) -> StepFlops | None:
        """The floating-point operations of one train step, for batches like
        `batch` or those last trained on (None before any)."""
        ...

    def restore(self, snapshot: Snapshot) -> None:
        """Continue from `snapshot` (state, progress, history, callbacks)."""
        ...


@dataclasses.dataclass(frozen=True)
class StepInfo(Generic[_Model]):
    """What a callback hook is told about the run.

    Attributes:
        trainer: the trainer that is running.
        step: optimizer updates made so far (counted on the host: no sync).
        epoch: the current epoch, from 0.
        examples: at `on_step_end`, the examples in the step's batch (all
            processes'); at `on_epoch_end`, those the fit trained on in the
            epoch (after a resume, in its part of the epoch).
        max_epochs: the epochs `fit` was asked for, if given.
        start_epoch: the epoch the run began at (kept across a resume), from
            which `max_epochs` count.
        start_step: the step the run began at (kept across a resume), from
            which `total_steps` count.
        total_steps: the steps the run makes from `start_step`, if known up
            front (``steps=``, or ``epochs=`` over data with a length).
        last_in_call: at `on_step_end`, whether this step is the last of
            its compiled call (always, with ``steps_per_call=1``). The hooks
            of a call's steps run after the whole call: `state` and
            `snapshot()` are those after its last step, and `stop()` ends
            `fit` there. (`Checkpoint` saves only there.)
        eval_every: in `fit`, its ``eval_every=``: `eval_data` is evaluated
            after every this many steps (each evaluation's `on_eval_end`
            comes before its step's `on_step_end`), not at epoch ends. None
            where it is evaluated at epoch ends (the evaluation's metrics
            then join the epoch's), and at the hooks of `trainer.evaluate`:
            loggers write an evaluation of their own only where it is set.
        clock: in `fit`, its `PhaseClock`: the seconds spent so far in each
            phase of the fit (``clock.totals()``), in each callback's hooks
            (``clock.callback_totals()``) and its compiles
            (``clock.compiles``), read by `px.callbacks.Timeline`. None
            outside a fit.
        steps_per_call: in `fit`, the trainer's ``steps_per_call``: the
            steps one compiled call makes at most (fewer where a pass, the
            plan or an ``eval_every`` evaluation ends sooner). 1 outside.
    """

    trainer: TrainerLike[_Model]
    step: int
    epoch: int
    device_metrics: StepSums | HostMetrics = dataclasses.field(
        default_factory=dict, repr=False
    )
    examples: int = 0
    max_epochs: int | None = None
    total_steps: int | None = None
    start_epoch: int = 0
    start_step: int = 0
    last_in_call: bool = True
    eval_every: int | None = None
    clock: PhaseClock | None = dataclasses.field(default=None, repr=False)
    steps_per_call: int = 1

    @functools.cached_property
    def metrics(self) -> HostMetrics:
        """The metrics of this point as floats: fetched from device on first read.

        At `on_step_end` these are the step's own; at `on_epoch_end` the
        epoch's (with `fit`'s evaluation at epoch ends, its metrics
        prefixed ``eval_``); at `on_eval_end` the evaluation's: in `fit`,
        every set's, prefixed as named there (``eval_loss``, or
        ``eval_<set>_loss`` for named sets); from `trainer.evaluate`, its
        results as it returns them. A callback that reads them only every n
        steps makes the device wait only every n steps. Callbacks may add
        host values (e.g. ``"lr"``); callbacks later in the list see them.
        """
        metrics = self.device_metrics
        if isinstance(metrics, StepSums):
            clock = self.clock
            if clock is None or clock.stopped is not None:
                return metrics.means()
            # The read waits for the device to finish the step: the fit's
            # "step" time (the device's, as the host sees it), not the time
            # of the callback that happened to read first.
            with clock.within("step"):
                return metrics.means()
        # Already on the host (epoch end): the very dict the history keeps,
        # so entries a callback adds (e.g. "lr") reach later callbacks too.
        return metrics

    @property
    def state(self) -> TrainState[_Model]:
        """The trainer's current `TrainState`."""
        return self.trainer.state

    @property
    def history(self) -> History:
        """The trainer's `History` of epoch metrics."""
        return self.trainer.history

    def stop(self) -> None:
        """Ask `fit` to end after the current step (or epoch end; with
        ``steps_per_call > 1``, after the current compiled call)."""
        self.trainer.stop_training = True

    def snapshot(self) -> Snapshot:
        """Everything needed to continue the run exactly, as it is now (its
        arrays valid until the next step: see `Snapshot`)."""
        return self.trainer.snapshot()


class Callback(Generic[_Model]):
    """Host-side hooks into `DataParallelTrainer.fit`; each does nothing by default.

    Subclass and override the hooks you need (mark them
    `@typing_extensions.override`). Within `fit` they fire in this order:

    ```
    on_fit_start
      on_epoch_start
        on_eval_start, on_eval_end   (eval_every=N: after every N-th step)
        on_step_end            (after every optimizer update)
        on_eval_start, on_eval_end   (eval_data at epoch ends: the default)
      on_epoch_end
      ...                      (every `evaluate` fires on_eval_start/end)
    on_fit_end
    on_exception               (instead of the rest, if fit raises)
    ```

    An evaluation in `fit` calls `on_eval_start` and `on_eval_end` once,
    for all of `eval_data`'s sets.

    A callback with state to keep across a resume (counters, best values)
    overrides `state_dict` and `load_state_dict`; checkpoints store it under
    its `state_key`: its class name, or ``ClassName:<state_name>`` where
    `state_name` is set (needed where a fit has two stateful callbacks of one
    class).

    What a callback needs of a fit is declared here, never probed: which
    processes run it (`main_process_only`), whether it is called after each
    step (`needs_steps`), the metrics it reads (`monitors`) and those it adds
    (`added_metrics`), the phase of the fit's time its hooks count as
    (`time_phase`), and whether its `on_fit_end` comes after all others'
    (`ends_last`).

    ``Callback[M]`` (M the model class) types its hooks' `StepInfo`:
    ``info.trainer.model`` and ``info.state.model`` are then an ``M``.

    Example:
        ```python
        class PrintLoss(px.Callback):
            @override
            def on_epoch_end(self, info: px.StepInfo) -> None:
                print(info.epoch, info.metrics["loss"])
        ```
    """

    # In a multi-process run, whether only process 0 runs this callback (for
    # side effects that must happen once: logs, displays, plots). Callbacks
    # that decide something (early stopping) or that every process must join
    # (checkpoints) run everywhere; their inputs are the same global values.
    main_process_only: ClassVar[bool] = False

    # The phase of the fit's time its hooks are charged to (see
    # `px.callbacks.Timeline`): "callbacks", or e.g. "checkpoint" for the
    # blocking part of a checkpoint save.
    time_phase: ClassVar[TimePhase] = "callbacks"

    # Whether its `on_fit_end` runs after every other callback's (checkpoint
    # stores' included), to see the whole fit (`px.callbacks.Timeline`).
    ends_last: ClassVar[bool] = False

    # Tells this callback's state in a checkpoint apart from that of another
    # callback of its class in the same fit (see `state_key`); None: the
    # class name alone is the key.
    state_name: str | None = None

    @property
    def state_key(self) -> str:
        """The key of this callback's `state_dict` in a checkpoint: the class
        name, or ``ClassName:<state_name>``. It does not depend on the
        callback's place in the list, so a resumed fit may add, drop or
        reorder callbacks."""
        name = type(self).__name__
        return name if self.state_name is None else f"{name}:{self.state_name}"

    @property
    def needs_steps(self) -> bool:
        """Whether `fit` calls `on_step_end` after each step (read once
        `on_fit_start` has run): by default, where the class overrides it; a
        callback with nothing to do after a step costs the loop nothing."""
        return type(self).on_step_end is not Callback.on_step_end

    def monitors(self) -> tuple[str, ...]:
        """The metrics this callback reads at epoch ends (an ``eval_`` one
        under ``fit(eval_every=)``: after each of those evaluations); `fit`
        checks before its first step that the run produces each. None by
        default (the empty tuple)."""
        return ()

    def added_metrics(self) -> tuple[str, ...] | None:
        """The names this callback adds to the metrics of epoch ends and
        evaluations (``()``: none). None, the default, declares nothing: a
        monitor of a callback after this one, where this one overrides
        `on_epoch_end` or `on_eval_end`, is then taken on trust, as this one
        may add it. Callbacks declaring ``()`` (loggers, displays) run after
        all the others, so every value added reaches them whatever the
        order of the list."""
        return None

    def on_fit_start(self, info: StepInfo[_Model]) -> None:
        """Called once when `fit` begins, before the first batch is read."""

    def on_fit_end(self, info: StepInfo[_Model]) -> None:
        """Called once when `fit` returns."""

    def on_epoch_start(self, info: StepInfo[_Model]) -> None:
        """Called before the first batch of each epoch."""

    def on_epoch_end(self, info: StepInfo[_Model]) -> None:
        """Called after each epoch (and its evaluation); metrics are the epoch's."""

    def on_step_end(self, info: StepInfo[_Model]) -> None:
        """Called after each optimizer update has been dispatched."""

    def on_eval_start(self, info: StepInfo[_Model]) -> None:
        """Called when an evaluation begins (in `fit`: after the epoch's
        steps, or with ``eval_every=N`` after every N-th step)."""

    def on_eval_end(self, info: StepInfo[_Model]) -> None:
        """Called when an evaluation finishes; metrics are its results (in
        `fit`, every set's, prefixed ``eval_``; ``info.eval_every`` says
        whether it is one of ``fit(eval_every=)``'s)."""

    def on_exception(self, info: StepInfo[_Model], error: BaseException) -> None:
        """Called when `fit` raises, before the error propagates."""

    def state_dict(self) -> dict[str, Any] | None:
        """This callback's state as plain (JSON) data, for checkpoints; None
        (the default) for a callback without state."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (on resume)."""
        del state


def runs_here(callback: Callback) -> bool:
    """Whether this process runs `callback` (see `main_process_only`)."""
    return not callback.main_process_only or jax.process_index() == 0


def has_state(callback: Callback) -> bool:
    """Whether `callback` declares state for checkpoints (its class
    overrides `state_dict`)."""
    return type(callback).state_dict is not Callback.state_dict
