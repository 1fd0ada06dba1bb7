"""A compiled call's arguments named for the recompile alarm: each leaf by
its path (the state's ``state.opt_state[0]...``, the user's batch's
``batch['x']``), with its type and sharding, read without a device value
(after donation too)."""

from typing import Any

import jax

from ..._state._sums import EpochSums
from ..step._layout import leaf_names


def named_arguments(
    args: tuple[Any, ...], treedef: Any, batch_names: list[str] | None
) -> tuple[str, list[tuple[str, str, Any]]]:
    """The batch's types in short (``f32[64,784] i32[64]``) and each leaf's
    ``(name, type, sharding)`` of a train call's `args` (its arguments, or
    the abstract ones a program was built for), the state's structure being
    `treedef` and the batch's leaves named `batch_names` (None: by index)."""
    leaves, sums, weight, total = args[0], args[1:-3], args[-2], args[-1]
    batch = jax.tree.leaves(args[-3])
    named = [*zip(leaf_names(treedef), leaves, strict=True)]
    named += [
        (f"the epoch's {f}", x) for f, x in zip(EpochSums._fields, sums, strict=True)
    ]
    if batch_names is None or len(batch_names) != len(batch):
        batch_names = [f"the batch's leaf {i}" for i in range(len(batch))]
    named += [*zip(batch_names, batch, strict=True)]
    named += [("the batch's example weights", weight)]
    named += [("the batch's total weight", total)]
    spec = " ".join(_short(x) for x in batch)
    return spec, [(name, _typed(x), _sharding(x)) for name, x in named]


def _typed(x: Any) -> str:
    """An argument leaf's type as JAX keys a compile by it, written the same
    for a NumPy and a JAX array: ``~`` marks a weak type (``~float32[]``)."""
    return str(jax.typeof(x))


def _short(x: Any) -> str:
    """A batch leaf's type in short, as JAX writes it: ``f32[64,784]``."""
    return jax.typeof(x).str_short(short_dtypes=True)


def _sharding(x: Any) -> Any:
    return x.sharding if isinstance(x, jax.Array | jax.ShapeDtypeStruct) else None
