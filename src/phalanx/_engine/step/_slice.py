"""One slice's work inside a step: the model on its examples, the loss and
the metrics as weighted sums (additive over examples, devices and
microbatches), packed into one vector for the one reduction.

Everything here runs inside `jax.jit`, on whatever slice the strategy
hands it; nothing reduces across devices (the strategy does, once).
"""

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree

from ..._checks._calls import call_mistake
from ..._checks._hooks import (
    HookTypeError,
    HookValueError,
    check_metrics,
    check_per_example,
    check_statistic,
    loss_values,
    returned,
)
from ..._state._sums import sum_order
from ..._typing import PerExample
from ...metrics._labels import MetricArgumentError
from ...metrics._named import RESERVED_NAMES
from ...metrics._statistic import Statistic, Summed
from ._forward import example_keys, forward, infer
from ._groups import check_group_losses
from ._step_parts import Examples, StepParts, StepPlan
from ._use import used_as


# What a slice's work returns: its weighted sums, per-example outputs, and
# the model state after it.
SliceResult = tuple[dict[str, Any], Any, Any]


def split_model(model: eqx.Module) -> tuple[Any, Any, Any]:
    """Trainable parameters, other arrays, and the static rest of a model."""
    params, others = eqx.partition(model, eqx.is_inexact_array)
    arrays, static = eqx.partition(others, eqx.is_array)
    return params, arrays, static


def examples_of(
    plan: StepPlan, batch_leaves: list[jax.Array], weight: PerExample
) -> Examples:
    """A step's batch leaves as `Examples`, checked (at trace time) where
    the plan has checks."""
    if plan.batch_check is not None:
        plan.batch_check(tuple(batch_leaves), weight)
    batch = jax.tree.unflatten(plan.batch_treedef, batch_leaves)
    return Examples(batch, weight, jnp.arange(weight.shape[0]))


def run_slice(
    plan: StepPlan,
    static: Any,
    params: PyTree,
    replicated: tuple[Any, jax.Array],
    model_state: Any,
    examples: Examples,
    inference: bool = False,
) -> SliceResult:
    """Model, loss and metrics on a slice: (weighted sums, outputs, state).

    `replicated` is the model's other arrays and the step's key. With
    `inference`, the model is called as `inference_model` says, without
    randomness."""
    parts = plan.parts
    precision = parts.precision
    cast = precision.cast
    arrays, key = replicated
    inputs, targets = examples.batch
    model = eqx.combine(params, arrays, static)
    computing = eqx.combine(cast(params, precision.compute), arrays, static)
    if plan.use_shardings is not None and not inference:
        computing = used_as(computing, plan.use_shardings)
    # Model state (BatchNorm statistics) is kept in its own dtype and used in
    # the compute dtype, as the layers it feeds.
    compute_state = cast(model_state, precision.compute)
    if inference:
        new_state = infer(
            inference_call(parts, computing),
            cast(inputs, precision.compute),
            state=compute_state,
        )
    else:
        new_state = forward(
            computing,
            cast(inputs, precision.compute),
            state=compute_state,
            keys=example_keys(key, examples.positions),
            pass_key=parts.pass_key,
        )
    outputs = cast(new_state[0], precision.output)
    model_state = jax.tree.map(_in_dtype_of, new_state[1], model_state)
    sums = weighted_sums(
        parts, model, outputs, targets, examples.weight, evaluating=inference
    )
    return sums, outputs, model_state


def _in_dtype_of(new: Any, old: Any) -> Any:
    """`new` (a leaf of the model state after a step) in `old`'s dtype."""
    return new.astype(old.dtype) if eqx.is_array(new) else new


def weighted_sums(
    parts: StepParts,
    model: Any,
    outputs: Any,
    targets: Any,
    weight: PerExample,
    *,
    evaluating: bool = False,
) -> dict[str, Any]:
    """Σ weight · loss, Σ weight, and each metric's sum over this slice:
    Σ weight · value for per-example values, a `Summed` total for a
    statistic. The metrics are the loss's own values, then those of the
    `metrics` hook (`evaluating`: of `eval_metrics`, where the trainer has
    its own)."""
    losses, values = loss_values(
        _call_hook("loss", parts.loss, model, outputs, targets)
    )
    sums: dict[str, Any] = {"weight": jnp.sum(weight)}
    if isinstance(losses, Mapping):  # one per group
        own = check_group_losses(losses, parts.groups)
        for group, name in own:
            check_per_example(losses[group], weight, f"loss[{group!r}]")
            sums[name] = jnp.sum(weight * losses[group])
        sums["loss"] = sum(sums[name] for _, name in own)
    else:
        check_per_example(losses, weight, "loss")
        sums["loss"] = jnp.sum(weight * losses)
    hook, metrics_of = "metrics", parts.metrics
    if evaluating and parts.eval_metrics is not None:
        hook, metrics_of = "eval_metrics", parts.eval_metrics
    metrics = _call_hook(hook, metrics_of, outputs, targets)
    check_metrics(metrics, hook)
    for source, named in (("loss", values), (f"{hook}()", metrics)):
        for name, value in named.items():
            _check_name(name, source, sums)
            if isinstance(value, Statistic):
                check_statistic(value, weight, f"{source}[{name!r}]")
                sums[name] = Summed.of(value, weight.astype(jnp.float32))
            else:
                check_per_example(value, weight, f"{source}[{name!r}]")
                sums[name] = jnp.sum(weight * value.astype(weight.dtype))
    return sums


def _call_hook(hook: str, function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)`, the trainer's `hook`, with its mistakes told as
    the hook's (not the batch's): a `px.metrics` function's complaint about
    its arguments, and a call (of the hook, or made by it) whose arguments
    do not fit the callee's signature."""
    try:
        return function(*args)
    except MetricArgumentError as error:
        raise HookValueError(f"{hook}(): {error}") from error
    except TypeError as error:
        # The traceback starts at this frame, so the hook's own signature is
        # told from the calls it makes.
        mistake = call_mistake(error, hook)
        if mistake is None:
            raise
        raise mistake from error


def _check_name(name: str, source: str, sums: dict[str, Any]) -> None:
    """A metric's name must be free: not the trainer's, not one the loss's
    values already gave."""
    if name in RESERVED_NAMES:
        raise HookValueError(
            f"{source} returned a metric named {name!r}, a name the trainer "
            f"reports itself ({', '.join(RESERVED_NAMES)}); rename it, e.g. "
            f"{name + '_metric'!r}"
        )
    if name in sums:
        raise HookValueError(
            f"{source} returned a metric named {name!r}, which the loss's values "
            "already hold; rename one of them"
        )


def inference_call(parts: StepParts, model: Any) -> Callable[..., Any]:
    """How the eval and predict steps call `model` (in inference mode), as
    the trainer's `inference_model` hook says, checked at trace time."""
    call = parts.inference_model(model)
    if not callable(call):
        raise HookTypeError(
            f"inference_model returned {returned(call)}; it must return how to "
            "call the model at inference: the model itself, or e.g. "
            "functools.partial(model, enable_dropout=False)"
        )
    return call


def packed(sums: dict[str, Any]) -> Float[Array, " sums"]:
    """A slice's sums as one vector (one operand of the reduction)."""
    return jnp.concatenate(
        [
            jnp.ravel(s.total if isinstance(s, Summed) else s)
            for s in (sums[name] for name in sum_order(sums))
        ]
    )
