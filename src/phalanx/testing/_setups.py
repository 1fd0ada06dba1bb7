"""The set-ups `assert_equivalent` compares with one device, and the batches
it replays to each: checked arguments, and default set-ups that exercise
the user's own model (the fully sharded one splits its leaves for real)."""

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import strategies as st
from ..strategies import Strategy
from ..strategies._names import strategy_name


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
    """`ShardingStrategy`, `PmapStrategy`, two microbatches of a
    `ShardingStrategy`, a `FullyShardedStrategy` whose `min_size` splits
    about half of this model's parameter leaves, on all local devices; and,
    on an even count of at least 4, hybrid sharding: a `MeshStrategy`
    replicating over 2 and splitting the same way over the rest."""
    n = jax.device_count()
    min_size = fsdp_min_size(params, n)
    named = [
        (f"ShardingStrategy on {n} devices", st.ShardingStrategy()),
        (f"PmapStrategy on {n} devices", st.PmapStrategy()),
        (
            f"AccumulatingStrategy(ShardingStrategy, microbatches=2) on {n} devices",
            st.AccumulatingStrategy(st.ShardingStrategy(), 2),
        ),
        (
            f"FullyShardedStrategy(min_size={min_size}) on {n} devices",
            st.FullyShardedStrategy(min_size=min_size),
        ),
    ]
    if n >= 4 and n % 2 == 0:
        within = fsdp_min_size(params, n // 2)
        named.append(
            (
                f"MeshStrategy(data=2, fsdp={n // 2}, min_size={within}) on {n} "
                "devices",
                st.MeshStrategy(data=2, fsdp=n // 2, min_size=within),
            )
        )
    return named


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
