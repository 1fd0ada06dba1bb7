"""Running the per-example model over a batch: in training (a key per
example, model state threaded) and at inference (no randomness at all)."""

import functools as ft
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Key, PRNGKeyArray, PyTree

from ..._contracts import sequence_split
from ..._typing import ExampleIndex


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
    return _per_example(model, inputs, state, keys, 0, pass_key)


def _per_example(
    call: Callable[..., Any],
    inputs: PyTree[Array],
    state: eqx.nn.State | None,
    keys: Key[Array, " batch"] | PRNGKeyArray | None,
    keys_axis: int | None,
    pass_key: bool,
) -> tuple[PyTree[Array], eqx.nn.State | None]:
    """`call` on each example of a batch (the axis named ``"batch"``),
    threading model state: with ``key=`` its row of `keys` (`keys_axis` 0)
    or `keys` itself (None) where `pass_key`."""

    def one(
        x: PyTree[Array], key: PRNGKeyArray | None, state: eqx.nn.State | None
    ) -> tuple[Any, eqx.nn.State | None]:
        kwargs = {"key": key} if pass_key else {}
        if state is None:
            return call(x, **kwargs), None
        return call(x, state, **kwargs)

    return jax.vmap(
        one,
        in_axes=(0, keys_axis, None),
        out_axes=(0, None),
        axis_name="batch",
        spmd_axis_name=_examples_split(),
    )(inputs, keys, state)


def _examples_split() -> tuple[str, ...] | None:
    """The mesh axes the examples are split over where a sequence split's
    attention needs to know (its `jax.shard_map`, under this `jax.vmap`,
    then keeps them split instead of gathering them); None elsewhere."""
    split = sequence_split(record=False)
    return split.batch_axes if split is not None and split.batch_axes else None


class InferenceKeyError(RuntimeError):
    """The model draws random numbers at inference, where it gets no key."""


def infer(
    call: Callable[..., Any],
    inputs: PyTree[Array],
    *,
    state: eqx.nn.State | None,
) -> tuple[PyTree[Array], eqx.nn.State | None]:
    """Run `call`, the model as called at inference, over a batch without
    randomness: ``key=None`` where it takes a ``key``, so that evaluation and
    prediction are deterministic.

    Raises:
        InferenceKeyError: the call fails without a key and runs with one (a
            flag of the model's own keeps dropout on, whatever the inference
            mode). Raised at trace time, before anything runs.
    """
    pass_key = takes_key(call)

    def over_batch(key: PRNGKeyArray | None) -> Any:
        return _per_example(call, inputs, state, key, None, pass_key)

    try:
        return over_batch(None)
    except Exception as error:
        if not pass_key or not _runs(over_batch, jr.key(0)):
            raise
        raise InferenceKeyError(
            "evaluate and predict call the model without randomness (key=None), "
            "so that their results are deterministic, but it draws random "
            f"numbers there ({type(error).__name__}: {error}): a flag of its "
            "own keeps dropout (or other noise) on, whatever eqx.nn.inference_mode "
            "says. Override DataParallelTrainer.inference_model to call it "
            "without, e.g. `return functools.partial(model, enable_dropout=False)`"
        ) from error


def _runs(fn: Callable[[Any], Any], key: PRNGKeyArray) -> bool:
    """Whether `fn(key)` traces without an error (at trace time: nothing runs)."""
    try:
        fn(key)
    except Exception:
        return False
    return True
