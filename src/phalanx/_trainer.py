"""`DataParallelTrainer`: the one class a user subclasses, and the public
face of a run: its settings, its hooks and its methods, each a table-of-
contents entry that hands the work to the module of its concept.

It is put together once (`_assembly/_parts.assemble`: the state, its layout, the
run's one home, the batch pipeline and the programs); `fit` is
`_assembly/_fit.run_fit` given those parts; `evaluate`, `predict`, `summary`,
`lower`, `compute_step` and `find_lr` use the same parts. Nothing below it
reads or writes its private fields.
"""

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeAlias, TypeVar

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import Array, PyTree, Shaped

from . import _losses
from ._assembly._fit import FitOptions, run_fit
from ._assembly._operations import (
    averaged_model,
    evaluate_data,
    flops_for,
    lower_for,
    predict_with,
    restore_into,
    set_state,
    snapshot_of,
    step_memory,
    step_values,
    summary_of,
)
from ._assembly._parts import TrainerHooks, assemble, dispatch, info_now
from ._checks._arguments import check_callbacks, check_config, check_iterable
from ._checks._keras_habits import binds_or_advises
from ._engine.feed._feed import default_depth
from ._engine.program._programs import StepValues
from ._engine.program._spec import Leaf
from ._engine.program._summary import ModelSummary
from ._engine.run._lr_finder import LRFinderResult, range_test
from ._metric_names import MetricName
from ._plan._entry import plan_trainer
from ._plan._result import Plan
from ._precision import Precision, PrecisionName, cast_floating, precision_of
from ._state._history import History
from ._state._progress import RunProgress
from ._state._snapshot import Snapshot
from ._state._train_state import TrainState
from ._telemetry._flops import StepFlops
from ._typing import (
    ChecksMode,
    GCMode,
    HostMetrics,
    LossFn,
    LossName,
    NanPolicy,
    validates_own_arguments,
)
from .callbacks._base import Callback, StepInfo
from .metrics._named import MetricFn, metric_functions
from .metrics._statistic import LossResult, Metrics
from .strategies import ShardingStrategy, Strategy


_Model = TypeVar("_Model", bound=eqx.Module)
if TYPE_CHECKING:
    # What `predict` returns, as an IDE shows it: the common case of a model
    # returning one array (a model returning a pytree gets that pytree).
    Outputs: TypeAlias = Array
else:  # what is checked at run time
    Outputs = PyTree[Shaped[Array, "rows ..."]]
_DICT_KEYS = {"x", "y", "sample_weight"}


class DataParallelTrainer(Generic[_Model]):
    """Trains an Equinox model with optax on every device a strategy holds.

    It checks and pads each host batch, runs the strategy's compiled step
    (at most `sync_every` steps in flight) and calls the callbacks; every
    update equals one device's update on the whole batch.

    This is the one class meant for subclassing. Override these hooks: the
    first two run on the host, on each NumPy batch; the others inside the
    compiled step (at trace time), so keep them pure: `split_batch`,
    `sample_weight`, `loss`, `metrics`, `eval_metrics`, `param_groups`,
    `gradients`, `inference_model`.

    Example:
        ```python
        model = px.models.MLP(64, 10, key=jax.random.key(0))
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3))
        trainer.fit([(x, y)], epochs=5)
        trainer.evaluate([(x_test, y_test)])  # {"loss": ..., "accuracy": ...}
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        model: _Model,
        optimizer: optax.GradientTransformation
        | Mapping[str, optax.GradientTransformation],
        *,
        strategy: Strategy | None = None,
        loss: LossName | LossFn = "cross_entropy",
        metrics: Sequence[MetricName]
        | Mapping[str, MetricFn | MetricName]
        | None = None,
        callbacks: Sequence[Callback] = (),
        seed: int = 0,
        model_state: eqx.nn.State | None = None,
        checks: ChecksMode = "on",
        nan_policy: NanPolicy = "raise",
        sync_every: int = 16,
        prefetch: int | None = None,
        steps_per_call: int = 1,
        precision: PrecisionName | Precision = "fp32",
        progress: bool = True,
        ema: float | None = None,
        gc: GCMode = "auto",
        slow_steps: float | None = 3.0,
        hang_timeout: float | Literal["auto"] | None = "auto",
    ):
        """Each argument in short (the guide "Every trainer argument" says all).

        Args:
            model: a per-example Equinox model (it may take ``key=``; with
                ``model_state``, called as ``model(x, state)``).
            optimizer: an optax transformation, or a mapping of parameter
                groups to transformations (with `param_groups`).
            strategy: how steps run across devices (`ShardingStrategy()`).
            loss: ``"cross_entropy"``, ``"categorical_cross_entropy"``,
                ``"mse"``, or ``fn(outputs, targets) -> per-example losses``.
            metrics: built-in metric names (``"accuracy"``, ``"f1"``, ...) or
                a mapping of names to functions or names; None: accuracy for
                the cross-entropies; ``()``: the loss alone.
            callbacks: host-side `Callback`s, called in order.
            seed: seeds the run's PRNG key (dropout, ...).
            model_state: the `eqx.nn.State` of stateful layers.
            checks: ``"on"``: batches' values checked too; ``"off"``: shapes.
            nan_policy: ``"raise"`` (on a TPU: one more copy of the state
                held), ``"skip"`` (the update) or ``"off"``.
            sync_every: the host waits for the device every this many steps.
            prefetch: batches prepared ahead on a background thread (None: 2,
                or 0 on a single CPU device).
            steps_per_call: steps per compiled call (``steps_per_execution``).
            precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or a `px.Precision`.
            progress: show the default progress bar.
            ema: keep a moving average of the parameters (evaluations use it).
            gc: the garbage collector in `fit`: ``"auto"``, ``"off"``, ``"python"``.
            slow_steps: warn when steps take this many times the median
                (None: never).
            hang_timeout: seconds without progress before `fit` exits (75).

        Raises:
            TypeError, ValueError: an argument is invalid (the message names it).
        """
        check_config(**{k: v for k, v in locals().items() if k not in _NOT_CHECKED})
        own_metrics = type(self).metrics is not DataParallelTrainer.metrics
        if metrics is not None and own_metrics:
            raise TypeError(
                f"metrics={metrics!r} and {type(self).__name__}.metrics, its own "
                "metrics hook, both say what a step logs; pass one: drop "
                "metrics=, or return those from the hook (px.metrics.f1(outputs, "
                "targets), ...)"
            )
        self.show_progress = progress
        self.gc: GCMode = gc
        """The garbage-collection policy of `fit` (see the argument)."""
        self.slow_steps = None if slow_steps is None else float(slow_steps)
        """The slow-step alarm's factor (None: off)."""
        self.hang_timeout: float | Literal["auto"] | None = hang_timeout
        self.ema = None if ema is None else float(ema)
        """The decay of the parameters' moving average (None: none kept)."""
        self.precision = precision_of(precision)
        if self.precision.mixed:  # the master weights' dtype
            model = cast_floating(model, self.precision.params)
        self.strategy: Strategy = ShardingStrategy() if strategy is None else strategy
        """How steps run across devices (hooks read it, e.g.
        ``self.strategy.axis_name`` for collectives in `loss`)."""
        self._callbacks = dispatch(callbacks, progress)
        self.checks = checks
        self.nan_policy: NanPolicy = nan_policy
        self.sync_every = sync_every
        self.steps_per_call = steps_per_call
        self.prefetch = default_depth(self.strategy) if prefetch is None else prefetch
        self.history = History()
        """Every epoch's metrics (``history[-1]``, ``history["eval_loss"]``)
        and every evaluation (``history.evaluations``), over all fits."""
        self.stop_training = False
        """Set to True (from a callback, as in Keras) to end `fit` after the
        current step (or compiled call), or after the epoch end that set it."""
        self._loss_name: LossName | None = None if callable(loss) else loss
        self._loss_fn: LossFn = loss if callable(loss) else _losses.LOSSES[loss]
        names = _losses.default_metric_names(self._loss_name)
        self._metrics = metric_functions(metrics, self._loss_name, default=names)
        own, default = type(self), DataParallelTrainer
        self._parts = parts = assemble(
            model,
            optimizer,
            TrainerHooks.of(self, own.eval_metrics is not default.eval_metrics),
            self,
            seed=seed,
            model_state=model_state,
            checks=checks,
            loss_name=self._loss_name,
            # Class labels are checked where the built-in loss or metrics read
            # them, not where a subclass has its own of both.
            class_labels=self._loss_name == "cross_entropy"
            and (own.loss is default.loss or not own_metrics),
            step_names=None if own_metrics else ("loss", *self._metrics),
        )
        self.optimizer: optax.GradientTransformation = parts.optimizer
        """The optax transformation the step applies (a mapping of groups'
        as one `optax.multi_transform`)."""

    # ----------------------------------------------------------------- hooks

    def split_batch(self, batch: PyTree) -> tuple[PyTree, PyTree]:
        """Split a batch into model inputs and loss targets.

        Default: ``(x, y)``, ``(x, y, sample_weight)`` (as in Keras), or a dict
        with keys ``"x"``, ``"y"`` and optionally ``"sample_weight"``.
        """
        if isinstance(batch, tuple | list) and len(batch) in (2, 3):
            return batch[0], batch[1]
        if isinstance(batch, dict) and {"x", "y"} <= set(batch) <= _DICT_KEYS:
            return batch["x"], batch["y"]
        raise TypeError(
            f"data: a batch must be an (x, y) pair, an (x, y, sample_weight) triple "
            f"or a dict with keys x, y[, sample_weight]; got {type(batch).__name__} "
            f"of structure {jax.tree.structure(batch)}; yield those or override "
            "DataParallelTrainer.split_batch"
        )

    def sample_weight(self, batch: PyTree) -> Shaped[np.ndarray, " batch"] | None:
        """Per-example weights of a batch, or None (default: a third element, or
        the ``"sample_weight"`` entry of a dict batch); 0 drops an example."""
        if isinstance(batch, tuple | list) and len(batch) == 3:
            return batch[2]
        if isinstance(batch, dict):
            return batch.get("sample_weight")
        return None

    def loss(self, model: _Model, outputs: PyTree, targets: PyTree) -> LossResult:
        """Per-example loss (default: ``loss=``'s); ``model`` is there for
        regularisers. May return ``(losses, {name: values})`` to log values
        beside it, or per-group losses (see the models guide)."""
        del model
        return self._loss_fn(outputs, targets)

    def metrics(self, outputs: PyTree, targets: PyTree) -> Metrics:
        """Metrics by name (default: those of ``metrics=``, or accuracy for
        the cross-entropies): per-example values, averaged like the loss, or
        `px.metrics` statistics (F1, AUC, ...), exact under every strategy."""
        return {name: fn(outputs, targets) for name, fn in self._metrics.items()}

    def eval_metrics(self, outputs: PyTree, targets: PyTree) -> Metrics:
        """Metrics of evaluations (default: `metrics`); override it for
        metrics worth computing on held-out data only (``eval_top5``)."""
        return self.metrics(outputs, targets)

    def param_groups(self, model: _Model) -> PyTree[str] | None:
        """Which parameters each optimizer trains, where ``optimizer=`` is a
        mapping of groups: the model with a group's name in place of each
        part it trains (default: None; see the several-optimizers guide)."""
        del model
        return None

    def gradients(self, grads: PyTree, state: TrainState[_Model]) -> PyTree:
        """Transform the global mean gradient before the optimizer (default: none)."""
        del state
        return grads

    def inference_model(self, model: _Model) -> _Model | Callable[..., Any]:
        """How evaluations and `predict` call the model (default: as it is),
        which arrives in inference mode and gets ``key=None``; override it
        where a flag of the model's own keeps dropout on, e.g.
        ``functools.partial(model, enable_dropout=False)``."""
        return model

    # ---------------------------------------------------------------- public

    @property
    def state(self) -> TrainState[_Model]:
        """The current `TrainState` (device arrays, laid out by the strategy)."""
        return self._parts.builder.build(self._parts.slot.run.leaves)

    @state.setter
    def state(self, state: TrainState[_Model]) -> None:
        """Replace the state, e.g. with restored weights (same structure)."""
        set_state(self._parts, state)

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The callbacks, in the order they run (snapshot stores last)."""
        return self._callbacks.all

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[Callback]) -> None:
        """Replace the callbacks (between fits)."""
        check_callbacks(callbacks)
        self._callbacks = dispatch(callbacks, self.show_progress)

    @property
    def progress(self) -> RunProgress:
        """Where training is: step, epoch, the fit's plan (a `RunProgress`)."""
        return self._parts.slot.progress

    def snapshot(self) -> Snapshot:
        """All that continues training exactly, as it is now: state, progress,
        history, callbacks' state, the data's position (in `fit`, whose next
        step donates the state's arrays: `copy` the snapshot to keep them)."""
        return snapshot_of(self._parts, self.history, self._callbacks)

    def restore(self, snapshot: Snapshot) -> None:
        """Continue from `snapshot`: its state, progress, history and
        callbacks' state; the next `fit` continues its run where it was.

        Raises:
            ValueError: the snapshot is of another model or optimizer, or of
                a run whose updates this trainer would make otherwise.
        """
        restore_into(self._parts, snapshot, self.history, self._callbacks)

    @property
    def model(self) -> _Model:
        """The current model."""
        return self.state.model

    @property
    def ema_model(self) -> _Model:
        """The current model with the moving average of its parameters in
        their place, as evaluations and `predict` use it (ValueError: none
        kept)."""
        return averaged_model(self.state)

    @validates_own_arguments
    @binds_or_advises
    def fit(
        self,
        data: Iterable[Any],
        *,
        epochs: int | None = None,
        steps: int | None = None,
        eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
        eval_every: int | None = None,
        resume: str | os.PathLike[str] | None = None,
    ) -> TrainState[_Model]:
        """Train on `data`, a re-iterable of host batches, in the order given.

        Args:
            data: batches, each a pytree of arrays with a shared leading
                examples axis, e.g. ``(x, y)``; the last may be shorter.
            epochs: passes over `data` (default 1 when `steps` is not given).
            steps: optimizer updates to make (with both, the first reached).
            eval_data: batches to evaluate (metrics ``eval_loss``, ...), or a
                mapping of names to batches (``eval_<name>_loss``, ...).
            eval_every: evaluate after every this many steps instead of at
                epoch ends.
            resume: ``"latest"`` (the newest checkpoint of the `Checkpoint`
                callback) or a checkpoint's path: the run continues as if
                never stopped, to the bit (see the checkpoints guide).

        Returns:
            The final `TrainState`.

        Raises:
            ValueError, TypeError: bad arguments or batches, before any update
                they concern; the state is that of the last good step.
            FloatingPointError: a non-finite gradient under nan_policy="raise".
        """
        alarms = (self.slow_steps, self.hang_timeout)
        options = FitOptions(self.prefetch, self.gc, *alarms, self._splits_by_default)
        run_fit(
            self,
            self._parts,
            self._callbacks,
            options,
            data,
            epochs=epochs,
            steps=steps,
            eval_data=eval_data,
            eval_every=eval_every,
            resume=resume,
        )
        return self.state

    @validates_own_arguments
    @binds_or_advises
    def evaluate(self, data: Iterable[Any]) -> HostMetrics:
        """Loss and metrics over every example of `data`, weighted exactly:
        ``{"loss": ..., **metrics}`` as floats."""
        check_iterable(data, "data", default_split=self._splits_by_default)
        # Told apart from fit's own evaluations by eval_every=None.
        info = dataclasses.replace(self._info(), eval_every=None)
        self._callbacks.eval_start(info)
        results = evaluate_data(
            self._parts, data, depth=self.prefetch, sync_every=self.sync_every
        )
        self._callbacks.eval_end(dataclasses.replace(info, device_metrics=results))
        return results

    @validates_own_arguments
    def predict(
        self, x: PyTree[Shaped[Leaf, "rows ..."]], *, batch_size: int | None = None
    ) -> Outputs:
        """Model outputs for every row of `x`, in order: the model in
        inference mode, without randomness, rows split across devices (any
        number), in chunks of `batch_size` where given. In a multi-process
        run each process passes its own rows and gets every process's."""
        return predict_with(self._parts, x, batch_size)

    def summary(self, batch: PyTree | None = None) -> ModelSummary:
        """The model's parameters and the memory the state takes per device
        (print it with rich for a table; ``.short()``: one line). Given a
        batch, also what a step takes on each device at its peak (``.step``,
        the train step compiled for such batches; nothing runs) and its
        FLOPs (``.flops``, see `flops_per_step`); ``.warnings``: the layout
        lint's (a large leaf left whole, an uneven split), each with its fix."""
        step = None if batch is None else step_memory(self._parts, batch)
        return summary_of(self._parts, self.state, step, self.flops_per_step(batch))

    def flops_per_step(self, batch: PyTree | None = None) -> StepFlops | None:
        """The floating-point operations of one train step on the global batch
        (`StepFlops`: ``.total``, ``.per_device``), counted on the program
        for batches like `batch` (or those last trained on; None before any),
        padding included. Nothing is placed or run.

        Raises:
            TypeError, ValueError: `batch` does not fit the model, or not
                the spec of the trainer's first batch.
        """
        return flops_for(self._parts, batch)

    def plan(self, batch: PyTree, **options: Any) -> Plan:
        """The fastest layout that fits (a `px.Plan`): this step compiled for
        batches like `batch` under each of its strategy's candidates."""
        return plan_trainer(self._parts, batch, **options)

    def lower(self, batch: PyTree) -> jax.stages.Lowered:
        """The train step lowered for `batch`, to inspect what it compiles to
        (``trainer.lower((x, y)).compile().as_text()``)."""
        return lower_for(self._parts, batch)

    @validates_own_arguments
    def find_lr(
        self,
        data: Iterable[Any],
        *,
        start: float = 1e-7,
        end: float = 10.0,
        steps: int = 100,
    ) -> LRFinderResult:
        """The learning-rate range test (Lightning's ``Tuner.lr_find``): one step
        per rate, from `start` to `end` geometrically until the loss diverges;
        the suggestion is where it falls fastest (``found.suggestion``,
        ``found.plot("lr.png")``); the state is then put back, to the bit.

        Raises:
            TypeError: phalanx cannot read the optimizer's learning rate.
            ValueError: a bad argument, `data` has no batch, or the
                optimizer's rate stays 0 for `steps` steps.
        """
        return range_test(
            self.state,
            data,
            (start, end, steps),
            optimizer=self.optimizer,
            compute_step=self.compute_step,
            set_state=lambda state: setattr(self, "state", state),
        )

    def compute_step(self, batch: PyTree) -> StepValues:
        """What a training step on `batch` computes from the current state,
        without applying it: the reduced gradient the optimizer gets, the
        step's loss and metrics, and the `TrainState` it leads to
        (``trainer.state = values.state`` takes it after all)."""
        return step_values(self._parts, batch)

    # --------------------------------------------------------------- private

    def _info(self, metrics: HostMetrics | None = None) -> StepInfo:
        """What a callback is told outside the loop's steps."""
        return info_now(self, self._parts, metrics)

    @property
    def _splits_by_default(self) -> bool:
        """Whether batches are split by the default `split_batch`."""
        return type(self).split_batch is DataParallelTrainer.split_batch


# What `check_config` does not take of the constructor's locals (its first
# statement's: the arguments alone).
_NOT_CHECKED = {"self", "metrics", "__class__"}
