"""The set-ups `assert_equivalent` compares with one device, and the batches
it replays to each: checked arguments, and default set-ups that exercise
the user's own model (the fully sharded one splits its leaves for real)."""

import functools as ft
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import strategies as st
from ..strategies import Strategy
from ..strategies._names import strategy_name
from ..strategies._registry import Options, registered


def replayable(batches: object) -> list[Any]:
    """The batches, read once: a shuffling loader re-iterated per set-up
    could feed each a different order."""
    if not isinstance(batches, Iterable) or isinstance(batches, str | bytes):
        raise TypeError(
            f"batches={type(batches).__name__} is not an iterable of batches; "
            "pass e.g. [(x, y)]"
        )
    data = list(batches)
    if not data:
        raise ValueError("batches is empty; pass at least one batch, e.g. [(x, y)]")
    return data


def setups(strategies: object, params: list[jax.Array]) -> list[tuple[str, Strategy]]:
    """The named set-ups: `strategies` checked (an `object`, so that the
    messages name the fix), or the defaults for a model of these parameters."""
    if strategies is None:
        return default_setups(params)
    if isinstance(strategies, Strategy) or not isinstance(strategies, Sequence):
        raise TypeError(
            f"strategies={strategies!r} must be a list of strategies or of "
            "(name, strategy) pairs, e.g. [px.PmapStrategy()]"
        )
    named = []
    for item in strategies:
        if isinstance(item, Strategy):
            name = f"{strategy_name(item)} on {item.num_devices} devices"
            if any(name == seen for seen, _ in named):
                name = f"{name} (#{len(named) + 1})"
            named.append((name, item))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Strategy)
        ):
            named.append(item)
        else:
            raise TypeError(
                f"strategies: {item!r} is neither a strategy nor a (name, "
                "strategy) pair"
            )
    if not named:
        raise ValueError("strategies is empty; pass at least one, or None")
    return named


def default_setups(params: list[jax.Array]) -> list[tuple[str, Strategy]]:
    """One set-up of each registered strategy that fits the local device
    count (`phalanx.strategies` registry, read now: a strategy registered
    there is compared too), on all local devices, and two microbatches of
    the first that accumulates. A strategy that splits the state gets a
    `min_size` that splits about half of this model's parameter leaves over
    the devices it splits them over: with the built-in registry,
    `ShardingStrategy`, `PmapStrategy`, `FullyShardedStrategy` and, on an
    even count of at least 4, hybrid sharding (a `MeshStrategy` replicating
    over 2 and splitting over the rest), then
    `AccumulatingStrategy(ShardingStrategy, microbatches=2)`."""
    n = jax.device_count()
    named: list[tuple[str, Strategy]] = []
    accumulated = None
    for entry in registered():
        if not entry.fits(n):
            continue
        sizes: list[int] = []
        options = Options()
        if entry.splits_state:
            options = Options(min_size=ft.partial(_min_size, params, sizes))
        strategy = entry.build(None, options)
        named.append((_setup_name(strategy, sizes[-1] if sizes else None, n), strategy))
        if accumulated is None and entry.accumulates:
            accumulated = st.AccumulatingStrategy(strategy, 2)
    if accumulated is not None:
        named.append((_setup_name(accumulated, None, n), accumulated))
    return named


def _min_size(params: list[jax.Array], given: list[int], devices: int) -> int:
    """`fsdp_min_size` for state split over `devices`, recorded in `given`
    (the set-up's name shows it)."""
    given.append(fsdp_min_size(params, devices))
    return given[-1]


def _setup_name(strategy: Strategy, min_size: int | None, n: int) -> str:
    """``"<strategy_name> on n devices"``, with the `min_size` it was given."""
    name = strategy_name(strategy)
    if min_size is not None:
        shown = f"min_size={min_size}"
        name = f"{name[:-1]}, {shown})" if name.endswith(")") else f"{name}({shown})"
    return f"{name} on {n} devices"


def fsdp_min_size(params: list[jax.Array], devices: int) -> int:
    """A `min_size` that splits the larger half of the parameter leaves a
    fully sharded strategy can split (floating, with an axis `devices`
    divides), and keeps the rest whole: both paths are checked. The default
    4096 would leave a test-sized model whole, checking nothing."""
    sizes = sorted(
        leaf.size
        for leaf in params
        if jnp.issubdtype(leaf.dtype, jnp.inexact)
        and any(length and length % devices == 0 for length in leaf.shape)
    )
    return sizes[len(sizes) // 2] if sizes else 1


def split_leaves(model_leaves: list[tuple[str, jax.Array]]) -> tuple[str, ...]:
    """The paths of the leaves not held whole on every device."""
    return tuple(
        path
        for path, leaf in model_leaves
        if not leaf.sharding.is_fully_replicated and leaf.size > 1
    )
