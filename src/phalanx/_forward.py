import functools as ft
import inspect
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Key, PRNGKeyArray, PyTree

from ._typing import ExampleIndex


def takes_key(model: Any) -> bool:
    """Whether the model's ``__call__`` accepts a ``key`` keyword (e.g. Dropout)."""
    try:
        parameters = inspect.signature(model).parameters
    except (TypeError, ValueError):
        return False
    return "key" in parameters


def example_keys(key: PRNGKeyArray, index: ExampleIndex) -> Key[Array, " batch"]:
    """One key per example, from its index in the global batch.

    Keys depend on (seed, step, example) only, so dropout masks are the same
    under every strategy, device count and microbatch count.
    """
    return jax.vmap(ft.partial(jr.fold_in, key))(index)


def forward(
    model: Any,  # an eqx.Module with a per-example __call__
    inputs: PyTree[Array],
    *,
    state: eqx.nn.State | None,
    keys: Key[Array, " batch"],
    pass_key: bool,
) -> tuple[PyTree[Array], eqx.nn.State | None]:
    """Run the per-example model over a batch, threading model state.

    The batch axis is named ``"batch"``, so ``BatchNorm(axis_name="batch")``
    normalises over it.
    """

    def one(x, key, state):
        kwargs = {"key": key} if pass_key else {}
        if state is None:
            return model(x, **kwargs), None
        return model(x, state, **kwargs)

    return jax.vmap(one, in_axes=(0, 0, None), out_axes=(0, None), axis_name="batch")(
        inputs, keys, state
    )
