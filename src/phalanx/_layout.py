"""How a `TrainState` travels as a flat list of arrays, and where each lives."""

from typing import Any, NamedTuple

import equinox as eqx
import jax

from ._state import TrainState
from .strategies import Strategy


class StateLayout(NamedTuple):
    """How a `TrainState` travels as a flat list of arrays.

    Attributes:
        treedef: the structure of the state's arrays.
        static: everything of the state that is not an array.
        shardings: where each array lives (the strategy's `state_shardings`).
        structs: each array's shape and dtype.
    """

    treedef: Any
    static: Any
    shardings: list[Any]
    structs: list[jax.ShapeDtypeStruct]

    def unflatten(self, leaves: list[Any]) -> TrainState:
        return eqx.combine(jax.tree.unflatten(self.treedef, leaves), self.static)


def state_layout(strategy: Strategy, state: TrainState) -> StateLayout:
    """How `state` travels and where the strategy puts each of its arrays.

    Raises:
        TypeError: the strategy's `state_shardings` is not one sharding per
            array of the state.
    """
    dynamic, static = eqx.partition(state, eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    name = f"{type(strategy).__name__}.state_shardings"
    shardings = strategy.state_shardings(jax.tree.unflatten(treedef, structs))
    try:
        flat = treedef.flatten_up_to(shardings)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"{name} returned {jax.tree.structure(shardings)}, not one sharding "
            f"per array of the state {treedef}; map over the state it is given, "
            "e.g. jax.tree.map(lambda _: sharding, state)"
        ) from error
    for sharding, struct in zip(flat, structs, strict=True):
        if not isinstance(sharding, jax.sharding.NamedSharding):
            raise TypeError(
                f"{name} returned {sharding!r} for an array {struct.dtype}"
                f"{list(struct.shape)}; return a jax.sharding.NamedSharding on "
                "the strategy's mesh for every array"
            )
    return StateLayout(treedef, static, flat, structs)
