"""Checks of what the trainer's hooks return, and the errors they raise.

They run at trace time (inside the compiled step) or once per batch on the
host, and name the hook, what it returned and what it must return: a hook's
mistake is never reported as the batch's.
"""

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jaxtyping import Array, PyTree


class HookError(Exception):
    """A trainer hook returned what it must not. Its message names the hook,
    what it returned and what it must return; not the batch's fault."""


class HookTypeError(HookError, TypeError):
    """A hook returned a value of the wrong kind (None, a float, a list...)."""


class HookValueError(HookError, ValueError):
    """A hook returned a value of the wrong shape or name."""


def returned(value: Any) -> str:
    """What a hook returned, in a few words, e.g. ``float 0.5``."""
    if value is None:
        return "None"
    if isinstance(value, jax.Array | np.ndarray):
        return f"an array of dtype {value.dtype} and shape {tuple(value.shape)}"
    if isinstance(value, tuple | list | dict):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def check_per_example(values: Any, weight: Array, hook: str) -> None:
    """At trace time: a loss or metric must give one value per example."""
    if not isinstance(values, jax.Array | np.ndarray):
        example = (
            "optax.softmax_cross_entropy_with_integer_labels(outputs, targets)"
            if hook == "loss"
            else "(jnp.argmax(outputs, -1) == targets).astype(jnp.float32)"
        )
        raise HookTypeError(
            f"{hook} returned {returned(values)}; it must return one value per "
            f"example, an array of shape {tuple(weight.shape)} (e.g. {example}, "
            "without a final mean)"
        )
    if values.shape != weight.shape:
        raise HookValueError(
            f"{hook} returned shape {tuple(values.shape)}, expected one value per "
            f"example, shape {tuple(weight.shape)}; return per-example values "
            "(e.g. without a final jnp.mean): the trainer weights, sums and "
            "divides once by the global number of examples"
        )


def check_metrics(metrics: Any, hook: str = "metrics") -> None:
    """At trace time: `metrics()` (or `eval_metrics()`, `hook`) must return
    a dict of names to values."""
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise HookTypeError(
            f"{hook}() returned {returned(metrics)}; it must return a dict of "
            "names to per-example values, e.g. {'mae': "
            "jnp.mean(jnp.abs(outputs - targets), axis=-1)} ({} for none)"
        )


def loss_values(result: Any) -> tuple[Any, Mapping[str, Any]]:
    """At trace time: the `loss` hook's per-example losses, and the values
    it returned beside them ({} if none)."""
    if not isinstance(result, tuple | list):
        return result, {}
    if len(result) != 2 or not isinstance(result[1], Mapping):
        raise HookTypeError(
            f"loss returned {returned(result)}; it must return per-example losses, "
            "or a pair (per-example losses, {name: per-example values}) to log "
            "values beside the loss, e.g. (losses, {'kl': kl})"
        )
    check_metrics(result[1], "loss")
    return result[0], result[1]


def check_statistic(statistic: Any, weight: Array, where: str) -> None:
    """At trace time: a statistic's arrays must hold one row per example."""
    for leaf in jax.tree.leaves(statistic):
        if not leaf.shape or leaf.shape[0] != weight.shape[0]:
            raise HookValueError(
                f"{where} is a statistic with an array of shape "
                f"{tuple(leaf.shape)}, expected one row per example, shape "
                f"({weight.shape[0]}, ...); build it from this batch's outputs "
                "and targets"
            )


def check_split(parts: Any) -> tuple[Any, Any]:
    """`split_batch()`'s result, if it is an (inputs, targets) pair."""
    if not isinstance(parts, tuple | list) or len(parts) != 2:
        raise HookTypeError(
            f"split_batch() returned {returned(parts)}; it must return a pair "
            "(inputs, targets) (sample weights come from the sample_weight() "
            "hook)"
        )
    return parts[0], parts[1]


def check_gradients(grads: PyTree, params: PyTree) -> None:
    """Raise at trace time if gradients do not match the parameters leaf by leaf."""
    grad_leaves, grad_def = jax.tree.flatten(grads)
    param_leaves, param_def = jax.tree_util.tree_flatten_with_path(params)
    if grad_def != param_def:
        raise TypeError(
            f"gradients: the hook returned a tree of structure {grad_def} but the "
            f"parameters have {param_def}; return one gradient per parameter, in "
            "the parameters' tree (e.g. jax.tree.map(fn, grads))"
        )
    for g, (path, p) in zip(grad_leaves, param_leaves, strict=True):
        if g.shape != p.shape or g.dtype != p.dtype:
            name = "model" + jax.tree_util.keystr(path)
            fix = (
                f"cast it back, e.g. g.astype(jnp.{p.dtype})"
                if g.shape == p.shape
                else f"keep the shape {tuple(p.shape)}, e.g. transform elementwise"
            )
            raise TypeError(
                f"gradients: the gradient of {name} is {g.dtype}{list(g.shape)} but "
                f"the parameter is {p.dtype}{list(p.shape)}; gradients must keep "
                f"each parameter's shape and dtype: {fix}"
            )
