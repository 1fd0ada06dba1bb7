"""What the compiled steps are built from: the trainer's hooks and settings
(`StepParts`), and what the strategy decides for one state layout and batch
structure (`StepPlan`); what a train step takes (`TrainInputs`). Values
only: nothing here traces or compiles."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jaxtyping import Array, Float, PyTree

from ..._precision import Precision
from ..._state._sums import EpochSums
from ..._state._train_state import TrainState
from ..._typing import NanPolicy, PerExample
from ...metrics._statistic import LossResult, Metrics
from ...strategies import Strategy
from ...strategies._strategy import Reduce
from ._groups import Groups
from ._layout import StateLayout


# ``check(batch_leaves, weight)``: a batch's checks inside the step (at trace
# time), or None.
BatchCheck = Callable[[tuple[jax.Array, ...], jax.Array], None]


def _as_is(model: Any) -> Any:
    """The model, called as it is at inference (`StepParts`' default)."""
    return model


class StepParts(NamedTuple):
    """What the compiled steps are built from.

    Attributes:
        loss: ``loss(model, outputs, targets) -> per-example losses``, or
            ``(per-example losses, {name: per-example values or statistic})``.
        metrics: ``metrics(outputs, targets) -> {name: per-example values or
            statistic}``.
        gradients: ``gradients(grads, state) -> grads``, before the optimizer.
        optimizer: the optax transformation.
        strategy: how the step runs across devices.
        nan_policy: what a non-finite gradient does (see the trainer).
        pass_key: whether the model takes a ``key``.
        precision: the dtypes the step computes in.
        inference_model: ``inference_model(model) -> callable``: how the eval
            and predict steps call the model (already in inference mode).
        eval_metrics: ``eval_metrics(outputs, targets) -> {name: per-example
            values}`` in the eval step; None: `metrics`, as in training.
        ema: the decay of the parameters' moving average, which the state
            keeps and the eval and predict steps use; None: none.
        groups: the parameter groups, where the optimizer has several
            (`Groups`); None: one optimizer for every parameter.
    """

    loss: Callable[[Any, Any, Any], LossResult]
    metrics: Callable[[Any, Any], Metrics]
    gradients: Callable[[PyTree, TrainState], PyTree]
    optimizer: optax.GradientTransformation
    strategy: Strategy
    nan_policy: NanPolicy
    pass_key: bool
    precision: Precision = Precision()
    inference_model: Callable[[Any], Any] = _as_is
    eval_metrics: Callable[[Any, Any], Metrics] | None = None
    ema: float | None = None
    groups: Groups | None = None


class StepPlan(NamedTuple):
    """The steps of one state layout and batch structure, as decided once
    when they are built.

    Attributes:
        parts: the hooks and settings.
        layout: how the state travels as a flat list of arrays.
        batch_treedef: the batch's structure.
        batch_check: the batch's checks inside the step (None: none).
        reduce: how the train step's slices become the global gradient:
            the strategy's `reduce`, or its per-device program under a
            mixed precision policy.
        grad_shardings: where the reduced gradient is laid out (None: as
            `reduce` leaves it).
        use_shardings: where the train step computes with each parameter
            (None: where it lies, or where `reduce` gathers it).
    """

    parts: StepParts
    layout: StateLayout
    batch_treedef: Any
    batch_check: BatchCheck | None
    reduce: Reduce
    grad_shardings: PyTree | None
    use_shardings: PyTree | None

    @property
    def strategy(self) -> Strategy:
        """The strategy the steps run under."""
        return self.parts.strategy


def plan_steps(
    parts: StepParts,
    layout: StateLayout,
    batch_treedef: Any,
    batch_check: BatchCheck | None,
) -> StepPlan:
    """What the strategy decides for this layout: how the gradient is
    reduced, where it is laid out, where parameters are used."""
    strategy, precision = parts.strategy, parts.precision
    # Under a mixed policy the gradients cross devices as the policy says:
    # per device (one explicit reduction of each device's gradient, in
    # `precision.reduce`), not where a compiler puts it in a global view,
    # where the strategy declares a per-device program. (One device has
    # nothing to reduce: its global view is its own.)
    per_device = (
        strategy.per_device_reduce()
        if precision.mixed and strategy.num_devices > 1
        else None
    )
    # Where each of the model's arrays lives, as the strategy's questions
    # take it.
    stored = jax.tree.unflatten(layout.treedef, layout.shardings).model
    return StepPlan(
        parts=parts,
        layout=layout,
        batch_treedef=batch_treedef,
        batch_check=batch_check,
        reduce=strategy.reduce if per_device is None else per_device,
        grad_shardings=strategy.gradient_shardings(stored),
        # A per-device program gathers each parameter whole itself.
        use_shardings=strategy.use_shardings(stored) if per_device is None else None,
    )


class Examples(NamedTuple):
    """A slice of examples as the strategy splits them: the batch, each
    example's weight (0 for padding) and its position in the global batch (its
    dropout key is folded from it)."""

    batch: Any
    weight: PerExample
    positions: jax.Array


class TrainInputs(NamedTuple):
    """What a train step takes, bundled when it is traced (the compiled
    call takes them as flat arguments).

    Attributes:
        leaves: the state's leaves.
        epoch_sums: the epoch's sums so far.
        batch_leaves: the batch's leaves.
        weight: each example's weight (0 for padding).
        total: the global batch's total weight, known before the step runs.

    Several steps in one call take their batches' leaves, weights and totals
    stacked along a leading ``steps`` axis.
    """

    leaves: list[jax.Array]
    epoch_sums: EpochSums
    batch_leaves: list[jax.Array]
    weight: Float[Array, "*steps batch"]
    total: Float[Array, "*steps"]
