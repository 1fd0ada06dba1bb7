"""The gradient of a train step: each slice differentiates its own weighted
loss (divided by the global batch's total weight, so the division happens
once, on the loss's cotangent), and the strategy adds up the slices' gradients
and sums in its one reduction.

Runs inside `jax.jit`; `reduce` is the plan's (the strategy's `reduce`, or
its per-device program), the only place gradients cross devices.
"""

import functools as ft
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ..._checks._hooks import check_gradients
from ..._precision import Precision
from ..._state._train_state import DynamicScale, TrainState
from ..._typing import PerExample
from ._groups import group_gradients, own_loss
from ._slice import examples_of, packed, run_slice, split_model
from ._step_parts import Examples, StepPlan
from ._use import constrained


class Gradient(NamedTuple):
    """A train step's gradient, as the optimizer gets it.

    Attributes:
        grads: reduced over every example, laid out as the strategy says,
            unscaled, after the `gradients` hook.
        sums: the step's packed sums (loss, weight, metrics).
        model_state: the model state after the step.
        next_key: the state's key after the step.
    """

    grads: PyTree
    sums: Float[Array, " sums"]
    model_state: Any
    next_key: PRNGKeyArray


# What each slice gets in full: its parameters, the model's other arrays and
# the step's key, the batch's total weight, and the loss scale (or None).
Replicated = tuple[PyTree, tuple[Any, PRNGKeyArray], Float[Array, ""], Any]


def gradient(
    plan: StepPlan,
    state: TrainState,
    batch_leaves: list[jax.Array],
    weight: PerExample,
    total: Float[Array, ""],
) -> Gradient:
    """The step's reduced gradient, as the optimizer gets it, its packed
    sums, the new model state and the next key."""
    parts = plan.parts
    params, arrays, static = split_model(state.model)
    if parts.pass_key:
        step_key, next_key = jr.split(state.key)
    else:  # nothing draws random numbers: spare every device the hashing
        step_key = next_key = state.key
    # The loss is multiplied by this before differentiation (None: 1).
    scale = _loss_scale(parts.precision, state.loss_scale)
    (grads, sums), model_state = plan.reduce(
        ft.partial(_slice_gradient, plan, static),
        (params, (arrays, step_key), total, scale),
        state.model_state,
        examples_of(plan, batch_leaves, weight),
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    if plan.grad_shardings is not None:  # where the strategy lays them out
        grads = constrained(grads, plan.grad_shardings)
    if scale is not None:
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
    grads = parts.gradients(grads, state)
    check_gradients(grads, params)
    return Gradient(grads, sums, model_state, next_key)


def _slice_gradient(
    plan: StepPlan,
    static: Any,
    replicated: Replicated,
    model_state: Any,
    examples: Examples,
) -> tuple[tuple[PyTree, Float[Array, " sums"]], Any]:
    """One slice's gradient of its share of the loss (in the policy's
    `reduce` dtype, for the reduction) and its packed sums; the model state
    after it."""
    parts = plan.parts
    params, rest, total, scale = replicated
    objective = ft.partial(
        _objective, plan, static, rest, model_state, examples, total, scale
    )
    if parts.groups is None:
        grads, (sums, model_state) = jax.grad(objective, has_aux=True)(params)
    else:
        grads, (sums, model_state) = group_gradients(objective, params, parts.groups)
    return (parts.precision.cast(grads, parts.precision.reduce), sums), model_state


def _objective(
    plan: StepPlan,
    static: Any,
    rest: tuple[Any, PRNGKeyArray],
    model_state: Any,
    examples: Examples,
    total: Float[Array, ""],
    scale: Float[Array, ""] | None,
    params: PyTree,
) -> tuple[Float[Array, "*groups"], tuple[Float[Array, " sums"], Any]]:
    """A slice's share of the loss (Σ weight · loss / the global total
    weight, times the loss scale), with its packed sums and new model state
    as auxiliary outputs."""
    sums, _, new_state = run_slice(plan, static, params, rest, model_state, examples)
    loss = own_loss(sums, plan.parts.groups) / total
    return (loss if scale is None else loss * scale), (packed(sums), new_state)


def _loss_scale(
    precision: Precision, dynamic: DynamicScale | None
) -> Float[Array, ""] | None:
    """The factor a step multiplies the loss by (None: no scaling)."""
    if precision.loss_scale is None:
        return None
    if precision.loss_scale == "dynamic":
        assert dynamic is not None, "a dynamic loss scale lives in the state"
        return dynamic.scale
    return jnp.asarray(precision.loss_scale, jnp.float32)
