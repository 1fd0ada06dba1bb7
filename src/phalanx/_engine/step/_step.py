"""The compiled train, eval and predict steps: split, compute, reduce once, update.

Each step is a `jax.jit` function of flat lists of arrays (not `eqx.filter_jit`,
which waits on every call, so host work would never overlap device work):
the state's leaves, an on-device accumulator of the epoch's sums, and the
batch's leaves with per-example weights (0 for padding). The train step also
takes the batch's total weight, known before the step runs: the gradient is
of Σ weight · loss / total, so the division happens once, on the loss's
cotangent, instead of on every gradient leaf after the reduction. The train
steps here take those five as one `TrainInputs`, bundled when traced.

A train step reads top to bottom: `gradient` (each slice's work, one
reduction; ``_gradient.py``), then `guard` (the non-finite policy and the
loss scale; ``_guard.py``) around the optimizer's update. Each step here is
a named function of the `StepPlan` decided once when the steps are built.
"""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..._state._sums import EpochSums
from ..._state._train_state import DynamicScale, TrainState
from ..._typing import PerExample
from ...strategies._placement import in_device_memory, in_stored_memory
from ._forward import infer
from ._gradient import gradient
from ._guard import Update, guard
from ._held import held_train_step
from ._layout import StateLayout
from ._slice import examples_of, inference_call, packed, run_slice, split_model
from ._step_parts import (
    BatchCheck,
    Examples,
    StepParts,
    StepPlan,
    TrainInputs,
    plan_steps,
)


# `StepParts` is built by the trainer from this module's name.
__all__ = [
    "StepFunctions",
    "StepParts",
    "build_predict_step",
    "build_steps",
    "several_steps",
]

# The outputs of a train step: the state's new leaves, the epoch's sums, and
# the step's packed sums.
TrainOutputs = tuple[list[jax.Array], EpochSums, Float[Array, " reported"]]


class StepFunctions(NamedTuple):
    """The step functions for one batch structure (not yet jitted).

    Attributes:
        train: ``train(inputs) -> (leaves, epoch_sums, sums)``: one update
            (`inputs` a `TrainInputs`).
        evaluate: ``evaluate(leaves, epoch_sums, batch_leaves, weight) -> epoch_sums``.
        probe: ``probe(leaves, batch_leaves, weight, inference=False) ->
            (outputs, sums)``: the model and loss mapped over a batch through
            the strategy (as the eval step runs them, with `inference`),
            per-example outputs and per-device sums; `jax.eval_shape` of it
            validates a batch against the model before anything is compiled,
            and names the sums.
        inspect: ``inspect(inputs) -> (leaves, grads, sums)``: `train`
            with the gradient it applied
            (reduced, after the `gradients` hook) as an output, for
            `DataParallelTrainer.compute_step`.
        held: ``held(inputs, spare) -> (leaves, epoch_sums, sums)``:
            `train` under the held guard (``_held.py``), `spare` the state
            the previous call read.
    """

    train: Callable[..., TrainOutputs]
    evaluate: Callable[..., Float[Array, " sums"]]
    probe: Callable[..., tuple[Any, Any]]
    inspect: Callable[..., tuple[list[jax.Array], PyTree, Float[Array, " reported"]]]
    held: Callable[..., TrainOutputs]


def build_steps(
    parts: StepParts,
    layout: StateLayout,
    batch_treedef: Any,
    batch_check: BatchCheck | None,
) -> StepFunctions:
    """The step functions for one batch structure."""
    plan = plan_steps(parts, layout, batch_treedef, batch_check)
    return StepFunctions(
        ft.partial(train_step, plan),
        ft.partial(eval_step, plan),
        ft.partial(probe_step, plan),
        ft.partial(inspect_step, plan),
        ft.partial(held_train_step, ft.partial(train_step, plan, held=True), plan),
    )


def train_step(plan: StepPlan, inputs: TrainInputs, held: bool = False) -> TrainOutputs:
    """One update: the state's new leaves, the epoch's sums, the step's sums
    (`held`: the update lands whatever its gradient, see ``_held.py``)."""
    return _update(plan, inputs, held)[:3]


def inspect_step(
    plan: StepPlan, inputs: TrainInputs
) -> tuple[list[jax.Array], PyTree, Float[Array, " reported"]]:
    """`train_step`, with the gradient it applied in place of the epoch's sums."""
    leaves, _, sums, grads = _update(plan, inputs)
    return leaves, grads, sums


def _update(
    plan: StepPlan, inputs: TrainInputs, held: bool = False
) -> tuple[list[jax.Array], EpochSums, Float[Array, " reported"], PyTree]:
    """One update: the train step's outputs, and the gradient it applied.
    State kept in host memory (`MeshStrategy(offload=True)`) is brought to
    the devices for the update and returned to the host after it."""
    stored = plan.layout.shardings
    leaves = in_device_memory(inputs.leaves, stored)
    state = plan.layout.unflatten(leaves)
    total = inputs.total
    step = gradient(plan, state, inputs.batch_leaves, inputs.weight, total)
    update = Update(
        state.step,
        leaves,
        step.grads,
        state.loss_scale,
        ft.partial(_applied, plan, state, step.grads, step.next_key, step.model_state),
        ft.partial(_kept, plan, state),
    )
    leaves, epoch_sums, sums = guard(
        plan.parts.nan_policy, update, step.sums, inputs.epoch_sums, total, held
    )
    return in_stored_memory(leaves, stored), epoch_sums, sums, step.grads


def _applied(
    plan: StepPlan,
    state: TrainState,
    grads: PyTree,
    next_key: PRNGKeyArray,
    model_state: Any,
    loss_scale: DynamicScale | None,
) -> list[jax.Array]:
    """The state's leaves after the optimizer applies `grads`, keeping
    `loss_scale`."""
    parts = plan.parts
    params = eqx.filter(state.model, eqx.is_inexact_array)
    updates, opt_state = parts.optimizer.update(grads, state.opt_state, params)
    # The rate multiplier (`TrainState.lr_scale`), on the final update: the
    # rate of optax's optimizers, exactly. At 1.0 it changes no value
    # (x * 1 == x), though XLA:CPU's LLVM then rounds a traced rate's product
    # before adding it to the parameter instead of fusing the two: an
    # injected or scheduled rate's update can differ by an ulp from phalanx
    # before the multiplier (a constant rate's is bitwise the same; measured,
    # 12 adam steps).
    updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
    new = dataclasses.replace(
        state,
        step=state.step + 1,
        model=eqx.apply_updates(state.model, updates),
        opt_state=opt_state,
        key=next_key,
        model_state=model_state,
        loss_scale=loss_scale,
    )
    if parts.ema is not None:
        new = new.averaged(parts.ema)
    return plan.layout.flatten(new)


def _kept(
    plan: StepPlan, state: TrainState, loss_scale: DynamicScale | None
) -> list[jax.Array]:
    """The state's leaves as they were, keeping `loss_scale`."""
    return plan.layout.flatten(dataclasses.replace(state, loss_scale=loss_scale))


def eval_step(
    plan: StepPlan,
    leaves: list[jax.Array],
    epoch_sums: Float[Array, " sums"],
    batch_leaves: list[jax.Array],
    weight: PerExample,
) -> Float[Array, " sums"]:
    """The evaluation's sums with this batch's added (the model in inference
    mode, its moving average where the state keeps one)."""
    state = plan.layout.unflatten(leaves)
    model = eqx.nn.inference_mode(state.averaged_model)
    params, arrays, static = split_model(model)
    sums, _ = plan.strategy.reduce(
        ft.partial(_slice_sums, plan, static),
        (params, (arrays, state.key)),
        state.model_state,
        examples_of(plan, batch_leaves, weight),
    )
    return epoch_sums + sums


def _slice_sums(
    plan: StepPlan,
    static: Any,
    replicated: tuple[PyTree, tuple[Any, PRNGKeyArray]],
    model_state: Any,
    examples: Examples,
) -> tuple[Float[Array, " sums"], Any]:
    """One slice's packed sums at inference; the model state unchanged."""
    params, rest = replicated
    sums = run_slice(plan, static, params, rest, model_state, examples, True)[0]
    return packed(sums), model_state


def probe_step(
    plan: StepPlan,
    leaves: list[jax.Array],
    batch_leaves: list[jax.Array],
    weight: PerExample,
    inference: bool = False,
) -> tuple[Any, Any]:
    """Per-example outputs and per-device sums of the model and loss mapped
    over a batch through the strategy (as the eval step runs them, with
    `inference`)."""
    state = plan.layout.unflatten(leaves)
    model = eqx.nn.inference_mode(state.averaged_model) if inference else state.model
    params, arrays, static = split_model(model)
    replicated = (params, (arrays, state.key), state.model_state)
    return plan.strategy.map(
        ft.partial(_slice_outputs, plan, static, inference),
        replicated,
        examples_of(plan, batch_leaves, weight),
    )


def _slice_outputs(
    plan: StepPlan,
    static: Any,
    inference: bool,
    replicated: tuple[PyTree, tuple[Any, PRNGKeyArray], Any],
    examples: Examples,
) -> tuple[Any, Any]:
    """One slice's outputs, and its sums with a leading axis of one (the
    device's row)."""
    params, rest, model_state = replicated
    sums, outputs, _ = run_slice(
        plan, static, params, rest, model_state, examples, inference
    )
    return outputs, jax.tree.map(lambda s: s[None], sums)


def several_steps(train_step: Callable[..., TrainOutputs]) -> Callable[..., Any]:
    """`train_step` over a leading steps axis of its batch leaves, weights
    and totals: several steps in one compiled call (`jax.lax.scan`), the
    state and the epoch's sums carried from step to step, each step's sums
    stacked (a row each)."""
    return ft.partial(_scanned_steps, train_step)


def _scanned_steps(
    train_step: Callable[[TrainInputs], TrainOutputs], inputs: TrainInputs
) -> tuple[list[jax.Array], EpochSums, Float[Array, "steps reported"]]:
    """`train_step` once per row of the stacked batches (`inputs`' batch
    leaves, weights and totals, a leading steps axis each), in a
    `lax.scan`."""

    def step(
        carry: tuple[list[jax.Array], EpochSums], batch: tuple[Any, ...]
    ) -> tuple[tuple[list[jax.Array], EpochSums], jax.Array]:
        leaves, epoch_sums, sums = train_step(TrainInputs(*carry, *batch))
        return (leaves, epoch_sums), sums

    (leaves, epoch_sums), sums = jax.lax.scan(step, inputs[:2], inputs[2:])
    return leaves, epoch_sums, sums


def build_predict_step(
    parts: StepParts, layout: StateLayout, inputs_treedef: Any
) -> Callable[[list[jax.Array], list[jax.Array]], Any]:
    """A predict step: per-example outputs of the model in inference mode,
    called as `inference_model` says and without randomness, computed in the
    precision policy's dtypes."""
    return ft.partial(_predict_step, parts, layout, inputs_treedef)


def _predict_step(
    parts: StepParts,
    layout: StateLayout,
    inputs_treedef: Any,
    leaves: list[jax.Array],
    input_leaves: list[jax.Array],
) -> Any:
    """The model's outputs for a batch of inputs, split as the batch is."""
    state = layout.unflatten(leaves)
    model = eqx.nn.inference_mode(state.averaged_model)
    arrays, static = eqx.partition(model, eqx.is_array)
    inputs = jax.tree.unflatten(inputs_treedef, input_leaves)
    return parts.strategy.map(
        ft.partial(_predict_slice, parts, static),
        (arrays, state.model_state),
        inputs,
    )


def _predict_slice(
    parts: StepParts, static: Any, replicated: tuple[Any, Any], inputs: Any
) -> Any:
    """One slice's outputs, computed as the train step runs the model."""
    arrays, model_state = replicated
    precision = parts.precision
    compute = precision.compute
    outputs = infer(
        inference_call(parts, eqx.combine(precision.cast(arrays, compute), static)),
        precision.cast(inputs, compute),
        state=precision.cast(model_state, compute),
    )[0]
    return precision.cast(outputs, precision.output)
