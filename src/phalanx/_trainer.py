"""`DataParallelTrainer`: the one class a user subclasses, and the public
face of a run.

It holds the run's settings, its hooks and its current `Run` (one
`RunSlot`), and puts the machine of `_engine/` together for each call:
`fit` hands the run to `fit_loop` and keeps what it returns; `evaluate`,
`predict`, `compute_step` and `lower` use the same `Preparer` and compiled
`Steps`. It computes nothing itself, and nothing below it reads or writes
its private fields.
"""

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeAlias, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jaxtyping import Array, PyTree, Shaped

from . import _losses
from ._checks._arguments import (
    check_callbacks,
    check_config,
    check_duration,
    check_eval_every,
    check_iterable,
    check_one_shot,
    eval_sets,
)
from ._checks._batch import (
    Leaf,
    flatten_batch,
    num_examples,
)
from ._checks._device_note import note_single_cpu_device
from ._checks._keras_habits import binds_or_advises
from ._engine._compiled import StepCompiler, StepValues
from ._engine._evaluate import evaluate, evaluate_sets
from ._engine._events import FitEvents
from ._engine._feed import default_depth
from ._engine._forward import takes_key
from ._engine._groups import group_labels, grouped
from ._engine._layout import state_layout
from ._engine._loop import fit_loop
from ._engine._loop_inputs import FitData, LoopParts, LoopSettings
from ._engine._lr_finder import LRFinderResult, base_rate, sweep
from ._engine._pipeline import BatchPipeline
from ._engine._predict import predict_rows
from ._engine._prepare import HostHooks, Preparer
from ._engine._program import Program, Programs
from ._engine._step import StepParts
from ._engine._summary import ModelSummary, StepMemory, summarize
from ._metric_names import MetricName
from ._precision import Precision, PrecisionName, cast_floating, precision_of
from ._preemption import Preempted, preemption
from ._state._builder import StateBuilder
from ._state._history import History
from ._state._learning_rate import next_rate
from ._state._progress import RunPlan, RunProgress, fit_totals
from ._state._run import Run, RunSlot
from ._state._snapshot import Snapshot
from ._state._sums import EpochSums, StepSums
from ._state._train_state import DynamicScale, TrainState
from ._telemetry._clock import PhaseClock
from ._telemetry._flops import StepFlops
from ._telemetry._observer import FitTelemetry
from ._typing import (
    ChecksMode,
    EvalSets,
    GCMode,
    HostMetrics,
    LossFn,
    LossName,
    NanPolicy,
    validates_own_arguments,
)
from ._validate import int_at_least, is_real, optional_positive_int
from .callbacks import ProgressBar
from .callbacks._base import Callback, StepInfo
from .callbacks._dispatch import Callbacks
from .callbacks._monitors import check_monitors
from .checkpoint._resume import eval_positions, find_snapshot, resume_data
from .checkpoint._settings import check_same_settings, run_settings
from .metrics._named import MetricFn, metric_functions
from .metrics._statistic import LossResult, Metrics
from .strategies import ShardingStrategy, Strategy
from .strategies._placement import put_state


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

    The trainer is the loop: it checks and pads each host batch, runs the
    strategy's compiled step (state buffers donated, at most `sync_every`
    steps in flight), and calls the callbacks. Every update equals one
    device's update on the whole batch.

    This is the one class meant for subclassing. Override these hooks. The
    first two run on the host, on each NumPy batch; the others inside the
    compiled step (at trace time), so keep them pure:

    - `split_batch(batch) -> (inputs, targets)`: default takes ``(x, y)``,
      ``(x, y, sample_weight)`` or a dict with keys x, y[, sample_weight].
    - `sample_weight(batch) -> per-example weights | None`.
    - `loss(model, outputs, targets) -> Float[Array, "batch"]`: one value per
      example; default from ``loss=``. Add regularisers here.
    - `metrics(outputs, targets) -> dict[str, Float[Array, "batch"]]`:
      per-example values averaged with the same weights as the loss, or
      `px.metrics` statistics; default those ``metrics=`` names (accuracy
      for cross-entropy without it). Built-in metrics and functions of
      ``(outputs, targets)`` need no subclass: pass ``metrics=``.
    - `gradients(grads, state) -> grads`: the reduced, averaged gradients
      before the optimizer; default unchanged.
    - `inference_model(model) -> callable`: how `evaluate` and `predict` call
      the model, which arrives in inference mode and gets no randomness
      (``key=None``); default the model as it is. Override it where a flag of
      the model's own keeps dropout on: ``functools.partial(model,
      enable_dropout=False)``.

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
    ):
        """
        Args:
            model: a per-example Equinox model; it may take a ``key`` keyword
                (the trainer passes a fresh one per example and training step,
                and ``key=None`` at inference) and, with ``model_state``, be
                called as ``model(x, state) -> (y, state)``.
            optimizer: any optax gradient transformation; or, to train
                parameter groups with optimizers of their own (a GAN's
                generator and discriminator, a backbone and a head), a
                mapping of group names to transformations, with
                `param_groups` saying which parameters each group trains
                (each then takes the gradient of its own loss, where `loss`
                returns one per group, else of the one loss).
            strategy: how steps run across devices; default
                `ShardingStrategy()` over all local devices.
            loss: ``"cross_entropy"`` (integer class labels; reports
                accuracy), ``"categorical_cross_entropy"`` (one-hot or soft
                labels, a probability per class, as Keras'
                ``categorical_crossentropy``; reports accuracy by arg-max),
                ``"mse"``, or ``fn(outputs, targets) -> per-example losses``.
            metrics: what a step logs beside the loss, in training and in
                evaluations (Keras' ``compile(metrics=)``): names of
                built-in metrics, ``("accuracy", "f1", "precision",
                "recall", "auc", "confusion_matrix")`` (``phalanx train
                --metric``'s), for a classifier (per-class scores; the
                classes are counted on them; F1, precision and recall
                macro-averaged); or a mapping of names to ``fn(outputs,
                targets)`` returning per-example values (averaged like the
                loss) or a `px.metrics` statistic (or to a built-in name).
                ``()``: the loss alone. None (the default): accuracy for the
                cross-entropies, nothing for the others. Checked here; a
                subclass that overrides the `metrics` hook says its metrics
                there, and is refused this argument.
            callbacks: host-side `Callback`s, called in order.
            seed: seeds the PRNG key of the run (dropout, ...).
            model_state: the `eqx.nn.State` of stateful layers, from
                `eqx.nn.make_with_state`.
            checks: ``"on"`` checks every batch on the host (structure and
                shapes once per signature, values every batch); ``"off"`` skips
                the value checks. Batches of `jax.Array`s (already on devices)
                get the structure and shape checks only: reading their values
                would copy them back to the host every step.
            nan_policy: on a non-finite gradient, ``"raise"`` (naming the leaf and
                step; state kept as before that step), ``"skip"`` the update
                (counted in the ``skipped_steps`` metric), or ``"off"``.
            sync_every: at every multiple of this many steps the host waits for
                the device to finish the steps up to the previous multiple (and
                raises there for a non-finite gradient under ``"raise"``): at
                most twice this many steps are in flight, bounding memory and
                error latency, and the device never runs dry while it waits.
            prefetch: batches checked and padded this many ahead in `fit` and
                `evaluate`, on a background thread of the lowest priority (it
                runs on cores XLA leaves idle; `split_batch` and `sample_weight`
                run there too); 0 prepares each batch on the calling thread.
                None (the default) is 2, or 0 where the strategy runs on a
                single CPU device, whose step XLA spreads over every core: no
                core is left for the thread, and preparing on the calling thread
                costs less there. Data is read ahead only where nothing is lost:
                a loader with `state_dict` and `load_state_dict` is rewound to
                the batch last used when a pass stops early; a one-shot iterator
                (a generator) and every multi-process run are not read ahead.
            steps_per_call: consecutive steps run by one compiled call (Keras'
                ``steps_per_execution``): their batches are stacked (host
                batches on the host, in one transfer) and a `jax.lax.scan` makes
                the steps, so the host's fixed cost per call is paid once per
                this many steps. The update is the same as one step per call;
                `on_step_end` still fires for every step, with that step's
                metrics, but only after the call, so the state, a checkpoint,
                a preemption and a stop act where a call ends (see
                `StepInfo.last_in_call`). Where fewer steps are left in a pass
                or the plan, or the step size changes (a short last batch),
                those steps run one per call (compiled once more). Raise it
                when a step takes well under a millisecond (small models on an
                accelerator); 1 (the default) otherwise.
            precision: the dtypes a step computes in: ``"fp32"`` (the default:
                everything in the model's own dtype); ``"bf16"``: float32
                parameters and optimizer state, the forward and backward pass in
                bfloat16, the loss and the gradient reduction in float32;
                ``"fp16"``: as ``"bf16"`` with float16 and a dynamic loss scale
                (logged as ``loss_scale``; a step whose scaled gradient
                overflows is skipped, counted in ``skipped_steps``, and halves
                the scale); or a `px.Precision` naming each dtype.
            ema: keep an exponential moving average of the parameters with
                this decay (e.g. 0.999; Keras' ``use_ema``, Lightning's
                ``WeightAveraging``): after each update, ``ema ← ema · decay +
                parameters · (1 - decay)``, starting from the initial
                parameters, on the devices and laid out as the parameters
                are. Evaluations (`evaluate`, and those in `fit`) and
                `predict` then use the averaged parameters; training does
                not. It is checkpointed with the state; `ema_model` is the
                model with it. None (the default): no average.
            gc: Python's garbage collector during `fit`: ``"auto"`` (the
                default) turns its automatic collections off while the loop
                runs, collects where the host waits for the device anyway
                (the young generations at each sync point, everything at
                epoch ends), and freezes the objects alive at the first sync
                point (`gc.freeze`) so that no collection walks them again;
                ``"off"``: no collection at all during the loop; ``"python"``:
                Python's own collector, untouched. The collector's settings
                (enabled, thresholds) are restored when `fit` returns or
                raises.
            slow_steps: warn (one ``phalanx:`` line, at most 5 a fit) when
                the steps between two sync points take more than this many
                times the median such stretch, per step (and at least 0.1 s
                more), naming the steps, the slowest one and the phase that
                grew (data, host, callbacks, gc, the device). Compiles,
                evaluations and checkpoint saves are left out; the first 8
                stretches of a fit are its warm-up. None: no warning.

        Raises:
            TypeError, ValueError: an argument is invalid (the message names it).
        """
        check_config(
            model=model,
            optimizer=optimizer,
            strategy=strategy,
            loss=loss,
            callbacks=callbacks,
            seed=seed,
            model_state=model_state,
            checks=checks,
            nan_policy=nan_policy,
            sync_every=sync_every,
            prefetch=prefetch,
            steps_per_call=steps_per_call,
            precision=precision,
            progress=progress,
            ema=ema,
            gc=gc,
            slow_steps=slow_steps,
        )
        overridden = type(self).metrics is not DataParallelTrainer.metrics
        if metrics is not None and overridden:
            raise TypeError(
                f"metrics={metrics!r} and {type(self).__name__}.metrics, its own "
                "metrics hook, both say what a step logs; pass one: drop "
                "metrics=, or return those from the hook (px.metrics.f1(outputs, "
                "targets), ...)"
            )
        self.show_progress = progress
        self.gc: GCMode = gc
        """The garbage-collection policy of `fit` (see the argument)."""
        self.slow_steps: float | None = (
            None if slow_steps is None else float(slow_steps)
        )
        """The slow-step alarm's factor (None: off)."""
        self.ema: float | None = None if ema is None else float(ema)
        """The decay of the parameters' moving average (None: none kept)."""
        self.precision = precision_of(precision)
        if self.precision.mixed:  # the master weights' dtype
            model = cast_floating(model, self.precision.params)
        self.strategy: Strategy = ShardingStrategy() if strategy is None else strategy
        """How steps run across devices: the `strategy` argument, or the
        default `ShardingStrategy()`. Hooks read it, e.g.
        ``self.strategy.axis_name`` for collectives in `loss` and
        ``self.strategy.num_devices``."""
        if isinstance(optimizer, Mapping):
            labels = self.param_groups(model)
            if labels is None:
                raise ValueError(
                    f"optimizer is a mapping of parameter groups {list(optimizer)}; "
                    "override param_groups(self, model) to say which parameters "
                    "each trains, e.g. return eqx.tree_at(lambda m: (m.generator, "
                    "m.discriminator), model, ('generator', 'discriminator'))"
                )
            groups = grouped(optimizer, labels, model)
            transform = groups.optimizer
        else:
            groups, transform = None, optimizer
        self.optimizer: optax.GradientTransformation = transform
        """The optax transformation the step applies (a mapping of groups'
        as one `optax.multi_transform`)."""
        self._callbacks = self._dispatch(callbacks)
        self.checks = checks
        self.nan_policy: NanPolicy = nan_policy
        self.sync_every = sync_every
        self.steps_per_call = steps_per_call
        self.prefetch = default_depth(self.strategy) if prefetch is None else prefetch
        self.history = History()
        """Every epoch's metrics (``history[-1]``, ``history["eval_loss"]``)
        and every evaluation of ``fit(eval_every=)``
        (``history.evaluations``), over all fits; restored by a resume."""
        self.stop_training = False
        """Set to True (from a callback, as in Keras) to end `fit` after the
        current step (with ``steps_per_call > 1``, the current compiled call),
        or after the epoch end that set it; ``info.stop()`` does the same.
        Each `fit` starts with it False."""
        self._loss_name: LossName | None = None if callable(loss) else loss
        self._loss_fn: LossFn = loss if callable(loss) else _losses.LOSSES[loss]
        # What the default `metrics` hook computes, by name.
        self._metrics = metric_functions(
            metrics,
            self._loss_name,
            default=_losses.default_metric_names(self._loss_name),
        )
        state = TrainState(
            step=jnp.asarray(0, jnp.int32),
            model=model,
            opt_state=self.optimizer.init(eqx.filter(model, eqx.is_inexact_array)),
            key=jr.key(seed),
            model_state=model_state,
            loss_scale=(
                DynamicScale.initial()
                if self.precision.loss_scale == "dynamic"
                else None
            ),
            # A copy: the state's leaves are donated, each buffer once.
            ema=None
            if ema is None
            else jax.tree.map(jnp.copy, eqx.filter(model, eqx.is_inexact_array)),
        )
        # The settings that shape every update: a resume must have these.
        self._settings = run_settings(
            ema=self.ema,
            precision=self.precision.describe(),
            loss=self._loss_name,
            groups=None if groups is None else group_labels(groups),
            learning_rate=next_rate(self.optimizer, state.opt_state).value,
        )
        self._layout = state_layout(self.strategy, state)
        shardings = self._layout.shardings
        # The run (state and progress): its one home, in and between fits.
        self._slot = RunSlot(
            Run(put_state(self._layout.flatten(state), shardings), RunProgress())
        )
        # Builds `trainer.state` and snapshots' states from the run's arrays.
        self._builder = StateBuilder(
            self._layout.unflatten(self._slot.run.leaves), self._layout.keys
        )
        # Copies the state before a loop donates it, so states handed out stay valid
        # (device_put to a replicated sharding may share the user's own buffer,
        # and donating the result would delete it).
        self._copy = jax.jit(
            lambda xs: [jnp.copy(x) for x in xs], out_shardings=shardings
        )
        # Whether the next fit continues a restored snapshot's epoch.
        self._restored = False
        # The fit running now (what its callbacks are told comes from it).
        self._fit: FitEvents | None = None
        # The last fit's epochs and steps, for callbacks outside a fit.
        self._totals: tuple[int | None, int | None] = (None, None)
        # The last fit's phase clock (its hooks read it at on_fit_end).
        self._clock: PhaseClock | None = None
        parts = StepParts(
            loss=self.loss,
            metrics=self.metrics,
            gradients=self.gradients,
            optimizer=self.optimizer,
            strategy=self.strategy,
            nan_policy=nan_policy,
            pass_key=takes_key(model),
            precision=self.precision,
            inference_model=self.inference_model,
            eval_metrics=(
                None
                if type(self).eval_metrics is DataParallelTrainer.eval_metrics
                else self.eval_metrics
            ),
            ema=self.ema,
            groups=groups,
        )
        # Host batches to device batches, and the compiled train, eval and
        # predict steps (Keras' train_function), built for the first batch.
        self._preparer = Preparer(
            HostHooks(self.split_batch, self.sample_weight),
            BatchPipeline(
                self.strategy,
                value_checks=checks == "on",
                # Class labels are checked where the built-in loss or metrics
                # read them, not where a subclass has its own of both.
                class_labels=self._loss_name == "cross_entropy"
                and (
                    type(self).loss is DataParallelTrainer.loss
                    or type(self).metrics is DataParallelTrainer.metrics
                ),
            ),
            StepCompiler(
                parts,
                self._layout,
                model=model,
                model_state=model_state,
                traced_checks=checks == "on",
                steps_per_call=steps_per_call,
            ),
        )

        # The programs built for the trainer's batches (the first explicitly,
        # for the first batch any method is given).
        self._programs = Programs()

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
        the ``"sample_weight"`` entry of a dict batch).

        Losses and metrics are Σ weight · value / Σ weight; a weight of 0 drops
        an example (e.g. loader padding).
        """
        if isinstance(batch, tuple | list) and len(batch) == 3:
            return batch[2]
        if isinstance(batch, dict):
            return batch.get("sample_weight")
        return None

    def loss(self, model: _Model, outputs: PyTree, targets: PyTree) -> LossResult:
        """Per-example loss; ``model`` is there for regularisers.

        May also return values to log beside the loss, as a pair
        ``(losses, {name: values})``: per-example values (averaged like the
        loss) or `px.metrics` statistics, logged as metrics of training and
        of evaluations (a KL term, a regulariser, an auxiliary head's loss):

        ```python
        def loss(self, model, outputs, targets):
            fit = optax.softmax_cross_entropy_with_integer_labels(outputs, targets)
            penalty = 1e-4 * jnp.sum(jnp.abs(outputs), axis=-1)
            return fit + penalty, {"fit": fit, "penalty": penalty}
        ```
        """
        del model
        return self._loss_fn(outputs, targets)

    def metrics(self, outputs: PyTree, targets: PyTree) -> Metrics:
        """Metrics by name (default: those of the ``metrics=`` argument, or
        accuracy for the cross-entropies): per-example values, averaged like
        the loss, or dataset-level metrics from `px.metrics` (F1, AUC, a
        confusion matrix...), summed over every example exactly under every
        strategy. Override it for metrics that ``metrics=`` cannot say (then
        without that argument):

        ```python
        def metrics(self, outputs, targets):
            return {
                "accuracy": (jnp.argmax(outputs, -1) == targets).astype(float),
                "f1": px.metrics.f1(outputs, targets, num_classes=10),
            }
        ```
        """
        return {name: fn(outputs, targets) for name, fn in self._metrics.items()}

    def eval_metrics(self, outputs: PyTree, targets: PyTree) -> Metrics:
        """Metrics of evaluations (`evaluate`, and those inside `fit`), as
        `metrics` returns them; default: `metrics`, as in training.

        Override it for metrics worth computing on held-out data only (a
        top-5 accuracy, a costly score): they are logged prefixed as the
        evaluation's (``eval_top5``), and training computes none of them.
        """
        return self.metrics(outputs, targets)

    def param_groups(self, model: _Model) -> PyTree[str] | None:
        """Which parameters each optimizer trains, where ``optimizer=`` is a
        mapping of groups: the model with a group's name in place of each
        part that group trains (default: None, one optimizer for all).

        The `loss` may then return one per-example loss per group, a dict
        keyed by group: each group's gradient is of its own loss, the other
        groups' parameters held fixed (a GAN's generator on the generator
        loss, its discriminator on the discriminator loss), every group's
        in one reduction; ``loss`` logs their sum and ``<group>_loss`` each.
        A loss of one array trains every group on it.

        ```python
        class GanTrainer(px.DataParallelTrainer[Gan]):
            def param_groups(self, model):
                return eqx.tree_at(
                    lambda m: (m.generator, m.discriminator),
                    model,
                    ("generator", "discriminator"),
                )

        trainer = GanTrainer(
            gan,
            {"generator": optax.adam(2e-4), "discriminator": optax.adam(2e-4)},
        )
        ```
        """
        del model
        return None

    def gradients(self, grads: PyTree, state: TrainState[_Model]) -> PyTree:
        """Transform the global mean gradient before the optimizer (default: none)."""
        del state
        return grads

    def inference_model(self, model: _Model) -> _Model | Callable[..., Any]:
        """How `evaluate`, `predict` and `fit`'s evaluations call the model
        (default: as it is).

        `model` arrives in inference mode (`eqx.nn.inference_mode`: dropout
        off, BatchNorm on its running averages), and what this returns is
        called per example as the model is (``f(x)``, or ``f(x, state)``
        with model state), without randomness: ``key=None`` where it takes a
        ``key``, so that evaluation and prediction are deterministic. A model
        that still draws random numbers there is an error that says so.
        Override it where a flag of the model's own overrides inference mode.
        Runs inside the compiled eval and predict steps, at trace time.

        Example:
            Equinox's BERT classifier keeps dropout on unless called with
            ``enable_dropout=False``:

            ```python
            class BertTrainer(px.DataParallelTrainer[BertClassifier]):
                @override
                def inference_model(self, model):
                    return functools.partial(model, enable_dropout=False)
            ```
        """
        return model

    # ---------------------------------------------------------------- public

    @property
    def state(self) -> TrainState[_Model]:
        """The current `TrainState` (device arrays, laid out by the strategy)."""
        return self._state_of(self._slot.run.leaves)

    def _state_of(self, leaves: list[jax.Array]) -> TrainState[_Model]:
        """The `TrainState` of the run's arrays `leaves`."""
        return self._builder.build(leaves)

    @state.setter
    def state(self, state: TrainState[_Model]) -> None:
        """Replace the state, e.g. with restored weights (same structure)."""
        leaves = self._checked_leaves(state)
        step = int(jax.device_get(state.step))
        self._slot.run = Run(
            self._copy(put_state(leaves, self._layout.shardings)),
            dataclasses.replace(self.progress, step=step),
        )

    @property
    def callbacks(self) -> tuple[Callback, ...]:
        """The callbacks, in the order they run: snapshot stores (checkpoints)
        after all others."""
        return self._callbacks.all

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[Callback]) -> None:
        """Replace the callbacks (between fits)."""
        check_callbacks(callbacks)
        self._callbacks = self._dispatch(callbacks)

    @property
    def progress(self) -> RunProgress:
        """Where training is: step, epoch, the fit's plan (a `RunProgress`)."""
        return self._slot.run.progress

    def snapshot(self) -> Snapshot:
        """Everything needed to continue training exactly, as it is now: the
        state, the progress, the history, where the training data stands
        (during `fit`) and the callbacks' state. Checkpoints save these.

        During `fit` the state's arrays are the run's own buffers, valid
        until its next step: copy them (e.g. ``jax.tree.map(jnp.copy,
        snapshot.state)``) to keep them longer.
        """
        fit, run = self._fit, self._slot.run
        return Snapshot(
            state=self._state_of(run.leaves),
            progress=run.progress,
            history=self.history.state_dict(),
            data=None if fit is None else fit.data_state(),
            eval_data={} if fit is None else eval_positions(fit.eval_sets),
            settings=self._settings,
            callbacks=self._callbacks.state_dicts(),
            strategy=type(self.strategy).__name__,
            devices=self.strategy.num_devices,
        )

    def restore(self, snapshot: Snapshot) -> None:
        """Continue from `snapshot`: its state (laid out as this trainer's
        strategy says), progress, history and callbacks' state.

        The next `fit` continues the snapshot's run where it was, even
        mid-epoch: its `epochs` / `steps` count from that run's start, as
        with ``resume=``. (``resume=`` also puts a `Resumable` data loader
        back; here, call ``loader.load_state_dict(snapshot.data)``.)

        Raises:
            ValueError: the snapshot's state is of another model or optimizer,
                or of a run whose updates this trainer would make otherwise
                (another ``ema``, ``precision``, ``loss``, ``param_groups`` or
                learning rate of the optimizer's first update).
        """
        check_same_settings(self._settings, snapshot.settings, "snapshot")
        leaves = self._checked_leaves(snapshot.state)
        progress = snapshot.progress
        if progress.sums is not None:  # a fit donates them: keep the snapshot's
            copies = self._preparer.compiler.copy_replicated(list(progress.sums))
            progress = dataclasses.replace(progress, sums=EpochSums(*copies))
        self._slot.run = Run(put_state(leaves, self._layout.shardings), progress)
        self.history.load_state_dict(snapshot.history)
        self._callbacks.load_state_dicts(snapshot.callbacks)
        self._restored = True

    @property
    def model(self) -> _Model:
        """The current model."""
        return self.state.model

    @property
    def ema_model(self) -> _Model:
        """The current model with the moving average of its parameters (the
        trainer's ``ema=``) in place of them, as evaluations and `predict`
        use it; save it with ``px.save_model(path, trainer.ema_model)``.

        Raises:
            ValueError: the trainer keeps no average.
        """
        state = self.state
        if state.ema is None:
            raise ValueError(
                "ema_model: this trainer keeps no moving average of the weights; "
                "pass DataParallelTrainer(..., ema=0.999) to keep one"
            )
        return state.averaged_model

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
                examples axis, e.g. ``(x, y)``. The last may be shorter.
                Keras' ``fit(x, y, batch_size=...)`` is refused (by a type
                checker too) with a TypeError saying how to pass batches; so
                is each of its other keywords, with phalanx's way of it.
            epochs: passes over `data` (default 1 when `steps` is not given).
            steps: optimizer updates to make, re-iterating `data` as needed.
                With both, training stops at whichever comes first.
            eval_data: batches to evaluate during training (as `evaluate`
                does), their metrics prefixed ``eval_`` (``eval_loss``, ...);
                or a mapping of names to batches, for several sets, each
                set's metrics prefixed ``eval_<name>_`` (``eval_val_loss``,
                ``eval_test_loss``, ...). Each evaluation of every set is
                recorded in ``history.evaluations`` and reported once to the
                callbacks' `on_eval_end`.
            eval_every: evaluate `eval_data` after every this many steps
                (counted from the run's start, as ``info.step``: the steps
                that are multiples of it), not at epoch ends; the epochs'
                metrics then hold no ``eval_`` ones. None (the default):
                after every epoch, the results joining the epoch's metrics.
                With ``steps_per_call > 1``, a compiled call ends at each
                evaluation's step (choose a multiple of `steps_per_call`).
            resume: ``"latest"`` to continue from the newest readable
                checkpoint of the `callbacks.Checkpoint` in `callbacks` (with
                none yet, the fit starts fresh and says so; an unreadable one
                is skipped with a warning), or the path of a checkpoint folder
                (or of one step in it). The state, step, epoch, history, data
                order (of `data` and of each `eval_data` set, where they are
                `Resumable` loaders) and callbacks' state are restored, and
                `epochs`/`steps` count from the start of the checkpointed
                run, so the run continues as if never stopped, to the bit in
                everything it logs; one line says so (``phalanx: resumed from
                step N (epoch E) of PATH``, E counted from 1 as the progress
                bar counts). A trainer whose ``ema``, ``precision``,
                ``loss``, ``param_groups`` or optimizer's learning rate (at
                its first update, where phalanx can read it) differ from the
                run's would make other updates: it is refused, naming the
                setting.

        Returns:
            The final `TrainState`.

        Raises:
            ValueError, TypeError: bad arguments or batches, before any update
                they concern; the state is that of the last good step.
            FloatingPointError: a non-finite gradient under nan_policy="raise".
        """
        clock = PhaseClock()  # the fit's wall time starts here ("other")
        epochs, steps = check_duration(epochs, steps)
        default_split = self._splits_by_default
        check_iterable(data, "data", default_split=default_split)
        sets = eval_sets(eval_data, default_split=default_split)
        eval_every = check_eval_every(eval_every, sets)
        monitors = functools.partial(
            check_monitors,
            self.callbacks,
            sets,
            eval_every=eval_every,
            epoch_extras=self._epoch_extras(),
        )
        # None: known once the first batch is traced.
        step_metrics, eval_metrics = self._step_metrics(), self._eval_metric_names()
        monitors(step_metrics=step_metrics, eval_metrics=eval_metrics)
        note_single_cpu_device(self.strategy.num_devices)
        run = self._slot.run
        # A fit that ended early (an error, steps=) may have left a part-done
        # epoch behind: a new fit starts a new epoch, unless it continues a
        # restored snapshot (or resumes, which restores one).
        progress = run.progress
        if not self._restored:
            step, epoch = progress.step, progress.epoch
            progress = RunProgress(step, epoch, plan=RunPlan(step, epoch))
        # The loop donates the state's buffers: the ones handed out stay valid.
        self._slot.run = Run(self._copy(run.leaves), progress)
        if resume is not None:
            snapshot = find_snapshot(resume, self.snapshot(), self._callbacks.stores)
            if snapshot is not None:
                self.restore(snapshot)
                resume_data(snapshot, data, sets or ())
        self._restored = False  # this fit continues it; the next starts afresh
        # The run's start is the checkpoint's; how far it goes is this call's.
        run = self._slot.run
        plan = dataclasses.replace(run.progress.plan, epochs=epochs, steps=steps)
        self._slot.run = run.replace(
            progress=dataclasses.replace(run.progress, plan=plan)
        )
        self.stop_training = False
        progress = self._slot.progress
        totals = fit_totals(data, progress)
        check_one_shot(
            data, sets, progress, total_steps=totals[1], eval_every=eval_every
        )
        telemetry = FitTelemetry(clock, gc=self.gc, slow_steps=self.slow_steps)
        fit = FitEvents(
            self,
            self._callbacks,
            telemetry,
            data=data,
            eval_sets=sets,
            totals=totals,
            eval_every=eval_every,
            steps_per_call=self.steps_per_call,
        )
        parts = LoopParts(
            self._preparer,
            self._preparer.compiler,
            self._layout,
            self.history,
            self._evaluate_sets,
            self._programs,
        )
        settings = LoopSettings(
            self.prefetch, self.sync_every, self.nan_policy, self.steps_per_call
        )
        # Metric names unknown until the first batch: checked before its step.
        check = None
        if step_metrics is None or eval_metrics is None:
            check = lambda names, eval_names: monitors(  # noqa: E731
                step_metrics=names, eval_metrics=eval_names
            )
        inputs = FitData(data, sets, eval_every, check)
        self._fit, self._totals, self._clock = fit, totals, clock
        with clock.running():
            try:
                try:
                    # A callback failing to start (a tracker that cannot
                    # reach its server) lets the others that started close
                    # their files.
                    self._callbacks.fit_start(self._info())
                    with preemption(fit.preempt):
                        run = fit_loop(self._slot, inputs, fit, parts, settings)
                    signum = run.progress.preempted
                    if signum is not None:
                        clock.switch("checkpoint")
                        saved = [
                            store.save_snapshot(self.snapshot(), wait=True)
                            for store in self._callbacks.stores
                        ]
                        raise Preempted(signum, str(saved[0]) if saved else None)
                except BaseException as error:
                    self._callbacks.exception(self._info(), error)
                    raise
            finally:
                self._fit = None
            self._callbacks.fit_end(self._info())
        return self.state

    @validates_own_arguments
    @binds_or_advises
    def evaluate(self, data: Iterable[Any]) -> HostMetrics:
        """Loss and metrics over every example of `data`, weighted exactly.

        Returns:
            ``{"loss": ..., **metrics}`` as floats.
        """
        check_iterable(data, "data", default_split=self._splits_by_default)
        # Told apart from fit's own evaluations by eval_every=None.
        info = dataclasses.replace(self._info(), eval_every=None)
        self._callbacks.eval_start(info)
        results = evaluate(
            self._preparer,
            self._programs,
            self._slot.run.leaves,
            data,
            "data",
            depth=self.prefetch,
            sync_every=self.sync_every,
        )
        self._callbacks.eval_end(dataclasses.replace(info, device_metrics=results))
        return results

    def _evaluate_sets(self, sets: EvalSets) -> HostMetrics:
        """Every set's results, prefixed as its metrics are named in `fit`."""
        return evaluate_sets(
            self._preparer,
            self._programs,
            self._slot.run.leaves,
            sets,
            depth=self.prefetch,
            sync_every=self.sync_every,
        )

    @validates_own_arguments
    def predict(
        self, x: PyTree[Shaped[Leaf, "rows ..."]], *, batch_size: int | None = None
    ) -> Outputs:
        """Model outputs for every row of `x`, in order: the model in
        inference mode, without randomness, called as `inference_model` says.

        Rows are split across devices; any number works (padding is added
        and removed). With `batch_size`, rows go through in chunks of that
        size (one compilation for all chunks). In a multi-process run each
        process passes its own rows (any number) and every process gets the
        outputs for all of them, in process order.
        """
        if isinstance(x, Iterable) and not isinstance(
            x, np.ndarray | jax.Array | tuple | list | dict
        ):
            raise TypeError(
                f"x={type(x).__name__} is a loader or an iterable of batches; "
                "predict takes the inputs themselves: an array (or pytree of "
                "arrays) with one row per example, e.g. trainer.predict(x_test); "
                "for a loader, predict each batch's x and concatenate"
            )
        leaves, treedef = flatten_batch(x, "x")
        num_examples(leaves, treedef, "x")
        batch_size = optional_positive_int("batch_size", batch_size)
        return predict_rows(
            self._preparer.compiler.predict(treedef, leaves),
            self._slot.run.leaves,
            leaves,
            batch_size,
            lambda rows: self._preparer.pipeline.step_size(rows, None),
            self.strategy.batch_sharding,
        )

    def summary(self, batch: PyTree | None = None) -> ModelSummary:
        """The model's parameters and the memory the state takes per device.

        Each parameter leaf's path, shape, dtype, size and bytes (whole, and
        on each device under the strategy: `FullyShardedStrategy` shows its
        saving), the totals, and the optimizer state's and model state's
        bytes. Printed with rich (``rich.print(trainer.summary())``) it is a
        table; ``str()`` is the same table as plain text; ``.short()`` one
        line. Arrays at rest only: activations, gradients and the parameters
        a fully sharded step gathers come on top.

        Given a batch, the summary also compiles the train step for batches
        of its shape and says what a step takes on each device at its peak
        (``.step``: XLA's `memory_analysis`): before the first step, whether
        a model and batch fit. Nothing runs on the devices. The step's FLOPs
        (``.flops``, see `flops_per_step`) are those of batches like
        `batch`, or without one of those the trainer last trained on (None
        before any).

        Example:
            ```python
            print(trainer.summary((x[:256], y[:256])).short())
            # "...; step peak 41.2 MiB per device, MeshStrategy on 8 devices"
            ```
        """
        step = None if batch is None else StepMemory.of(self.lower(batch).compile())
        return summarize(
            self._layout,
            self.state,
            self.strategy,
            step,
            flops=self.flops_per_step(batch),
        )

    def flops_per_step(self, batch: PyTree | None = None) -> StepFlops | None:
        """The floating-point operations of one train step: its matrix
        multiplies and convolutions, forward and backward, on the global
        batch (`StepFlops`: ``.total`` and ``.per_device``).

        Counted on the step's program for batches like `batch` (or, without
        one, like those the trainer last trained on: the first batch of its
        latest pass; None before any), once per batch size, padding
        included. Nothing is compiled, placed or run. `Throughput`
        turns it into FLOPs per second and model FLOPs utilisation.

        Raises:
            TypeError, ValueError: `batch` does not fit the model, or not
                the spec of the trainer's first batch.

        Example:
            ```python
            trainer.flops_per_step((x[:256], y[:256])).total  # e.g. 2.58e8
            ```
        """
        if batch is None:
            size = self._preparer.size
        else:
            self._program(batch)
            size = self._preparer.size_of(batch, "batch")
        program = self._programs.first
        if program is None or size is None:
            return None
        return self._preparer.compiler.flops(program, size)

    def lower(self, batch: PyTree) -> jax.stages.Lowered:
        """The train step lowered for `batch`, to inspect what it compiles to.

        Example:
            ```python
            hlo = trainer.lower((x, y)).compile().as_text()
            ```
        """
        program = self._program(batch)
        placed = self._preparer.prepare(batch, "batch", None)
        return program.traced.lower(
            self._slot.run.leaves,
            *self._preparer.compiler.epoch_sums(program),
            placed.leaves,
            placed.weight,
            placed.total,
        )

    @validates_own_arguments
    def find_lr(
        self,
        data: Iterable[Any],
        *,
        start: float = 1e-7,
        end: float = 10.0,
        steps: int = 100,
    ) -> LRFinderResult:
        """The learning-rate range test (Lightning's ``Tuner.lr_find``):
        from the current state, one training step per rate, the rates rising
        geometrically from `start` to `end`, until the loss diverges (its
        smoothed value above 4 times its best); the rate where it falls
        fastest is the suggestion. Then the trainer's state is put back as
        it was, to the bit: the steps were computed, not applied; callbacks
        are not called and the history is left alone.

        It works on any optimizer whose learning rate phalanx can read: one
        of optax's (``optax.adam(1e-3)``), one built with
        `optax.inject_hyperparams` (a constant or a schedule), one in an
        `optax.chain` after clipping, or several (``param_groups``). Each
        step's rate is set through the run's rate multiplier
        (`TrainState.lr_scale`): the rate wanted over the optimizer's own for
        that update, so the rates are absolute whatever the optimizer's own
        is. With several groups they keep their ratio, and the rates swept
        are those of the first group in the mapping. A step whose own rate
        is 0 (a warmup from 0) is taken as training would, not as one of
        the sweep's (no multiplier gives it a rate).

        Example:
            ```python
            trainer = px.DataParallelTrainer(model, optax.adam(1e-3))
            found = trainer.find_lr(px.data.ArrayLoader((x, y), 128))
            found.suggestion, found.plot("lr.png")
            ```

        Args:
            data: the training batches, read again from the start when they
                run out before `steps` steps.
            start: the first rate (> 0).
            end: the last rate (> start).
            steps: steps (rates) at most; at least 2.

        Raises:
            TypeError: phalanx cannot read the optimizer's learning rate
                (e.g. a transform follows it; the message says which).
            ValueError: a bad argument, `data` has no batch, or the
                optimizer's rate stays 0 for `steps` steps.
        """
        if not (
            is_real(start) and is_real(end) and 0 < float(start) < float(end) < math.inf
        ):
            raise ValueError(
                f"start={start!r}, end={end!r} must be rates with 0 < start < "
                "end, e.g. start=1e-7, end=10.0"
            )
        steps = int_at_least("steps", steps, 2, example="100")
        saved = self.state
        base_rate(self.optimizer, saved)  # readable: checked before any step

        def step(batch: Any) -> tuple[float, TrainState[_Model]]:
            values = self.compute_step(batch)
            return float(values.metrics["loss"]), values.state

        def set_state(state: TrainState[_Model]) -> None:
            self.state = state

        try:
            return sweep(
                saved,
                data,
                np.geomspace(float(start), float(end), steps),  # even in log
                optimizer=self.optimizer,
                set_state=set_state,
                step=step,
            )
        finally:
            self.state = saved

    def compute_step(self, batch: PyTree) -> StepValues:
        """What a training step on `batch` computes from the current state,
        without applying it: the reduced gradient the optimizer gets (after
        the `gradients` hook), the step's loss and metrics, and the
        `TrainState` it leads to (``.state``; its ``model_state`` too). The
        trainer's own state does not change. `px.testing.assert_equivalent`
        compares these across strategies.

        Example:
            ```python
            values = trainer.compute_step((x, y))
            values.metrics  # {"loss": ..., "accuracy": ...}
            trainer.state = values.state  # to take the step after all
            ```
        """
        program = self._program(batch)
        placed = self._preparer.prepare(batch, "batch", None, train=True)
        return self._preparer.compiler.values(
            program,
            self._slot.run.leaves,
            placed.leaves,
            placed.weight,
            placed.total,
        )

    # --------------------------------------------------------------- private

    def _dispatch(self, callbacks: Sequence[Callback]) -> Callbacks:
        """The calls into `callbacks`, with the default progress bar where the
        trainer shows one and they hold none."""
        shown = self.show_progress and not any(
            isinstance(c, ProgressBar) for c in callbacks
        )
        return Callbacks(callbacks, ProgressBar(plain_steps=False) if shown else None)

    def _step_metrics(self) -> tuple[str, ...] | None:
        """A step's metrics' names, ``loss`` first: the default `metrics`
        hook's are known up front, an overriding one's once the first batch
        has been traced (None until then)."""
        program = self._programs.first
        if program is not None:
            return program.sums.metric_names
        if type(self).metrics is DataParallelTrainer.metrics:
            return ("loss", *self._metrics)
        return None

    def _eval_metric_names(self) -> tuple[str, ...] | None:
        """An evaluation's metrics' names, ``loss`` first: a step's, unless
        the trainer has its own `eval_metrics` (known once the first batch
        has been traced; None until then)."""
        program = self._programs.first
        if program is not None:
            return program.eval_sums.metric_names
        if type(self).eval_metrics is DataParallelTrainer.eval_metrics:
            return self._step_metrics()
        return None

    def _epoch_extras(self) -> tuple[str, ...]:
        """What the loop adds to every epoch's metrics."""
        dynamic = self.precision.loss_scale == "dynamic"
        skipped = ("skipped_steps",) if self.nan_policy == "skip" or dynamic else ()
        return (*skipped, "loss_scale") if dynamic else skipped

    def _checked_leaves(self, state: TrainState) -> list[Any]:
        """The arrays of `state`, which must be of this trainer's structure."""
        treedef = jax.tree.structure(eqx.filter(state, eqx.is_array))
        if treedef != self._layout.treedef:
            raise ValueError(
                f"state has structure {treedef}, which differs from the trainer's "
                f"{self._layout.treedef}; pass a TrainState of this trainer's model "
                "and optimizer (e.g. one returned by fit)"
            )
        leaves = self._layout.flatten(state)
        for new, old in zip(leaves, self._layout.structs, strict=True):
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(
                    f"state has a leaf {new.dtype}{list(new.shape)} where the trainer "
                    f"has {old.dtype}{list(old.shape)}; pass a TrainState of this "
                    "trainer's model and optimizer"
                )
        return leaves

    def _info(self, metrics: StepSums | HostMetrics | None = None) -> StepInfo:
        """What a callback is told outside the loop's steps."""
        if self._fit is not None:
            return self._fit.info(self._slot.progress, metrics)
        progress = self.progress
        max_epochs, total_steps = self._totals
        return StepInfo(
            self,
            progress.step,
            progress.epoch,
            metrics or {},
            max_epochs=max_epochs,
            total_steps=total_steps,
            start_epoch=progress.plan.start_epoch,
            start_step=progress.plan.start_step,
            clock=self._clock,
        )

    def _program(self, batch: PyTree, where: str = "batch") -> Program:
        """The trainer's program, built for `batch` if it has none yet (to
        trace, evaluate or inspect with: `fit` compiles its own)."""
        program = self._programs.first
        if program is None:
            built = self._preparer.build(batch, where, compile=False)
            program = self._programs.add(built)
        return program

    @property
    def _splits_by_default(self) -> bool:
        """Whether batches are split by the default `split_batch`."""
        return type(self).split_batch is DataParallelTrainer.split_batch
