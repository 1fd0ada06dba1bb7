"""How a `TrainState` travels as a flat list of arrays, and where each lives."""

from typing import Any, NamedTuple

import equinox as eqx
import jax

from ..._state._train_state import DynamicScale, TrainState
from ...strategies import Strategy


PRNG_KEY = jax.dtypes.prng_key


class StateLayout(NamedTuple):
    """How a `TrainState` travels as a flat list of arrays.

    A PRNG key travels as its raw data (`jax.random.key_data`): a compiled
    step returning a typed key array makes Python build it on every call
    (~8 µs a step, the most of a small step's host work after the call).

    Attributes:
        treedef: the structure of the state's arrays.
        static: everything of the state that is not an array.
        shardings: where each array lives (the strategy's `state_shardings`).
        structs: each array's shape and dtype, as it travels.
        keys: each array's PRNG key implementation, if it is a key.
    """

    treedef: Any
    static: Any
    shardings: list[Any]
    structs: list[jax.ShapeDtypeStruct]
    keys: tuple[Any, ...]

    def flatten(self, state: TrainState) -> list[Any]:
        """The arrays of `state` (of this layout's structure) as they travel."""
        leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
        return [
            x if impl is None else jax.random.key_data(x)
            for x, impl in zip(leaves, self.keys, strict=True)
        ]

    def loss_scale(self, leaves: list[Any]) -> DynamicScale | None:
        """The dynamic loss scale of the state of `leaves` (None: its state
        keeps none), without building the state where it keeps none (an
        epoch's end asks: the whole state took ~60 µs to build)."""
        if self.static.loss_scale is None:
            return None
        return self.unflatten(leaves).loss_scale

    def unflatten(self, leaves: list[Any]) -> TrainState:
        """The `TrainState` of arrays as they travel."""
        arrays = [
            x if impl is None else jax.random.wrap_key_data(x, impl=impl)
            for x, impl in zip(leaves, self.keys, strict=True)
        ]
        return eqx.combine(jax.tree.unflatten(self.treedef, arrays), self.static)


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
    if state.ema is not None:  # the average lies where its parameters do
        params = jax.tree.map(eqx.is_inexact_array, dynamic.model)
        shardings = eqx.tree_at(
            lambda s: s.ema, shardings, eqx.filter(shardings.model, params)
        )
        flat = treedef.flatten_up_to(shardings)
    keys = tuple(
        jax.random.key_impl(x) if jax.dtypes.issubdtype(x.dtype, PRNG_KEY) else None
        for x in leaves
    )
    travel = [
        struct if impl is None else jax.eval_shape(jax.random.key_data, struct)
        for struct, impl in zip(structs, keys, strict=True)
    ]
    return StateLayout(treedef, static, flat, travel, keys)


def leaf_names(treedef: Any) -> list[str]:
    """The path of each leaf of a state's structure, e.g.
    ``state.opt_state[0].hyperparams['learning_rate']``."""
    numbered = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    paths = jax.tree_util.tree_flatten_with_path(numbered)[0]
    return [f"state{jax.tree_util.keystr(path)}" for path, _ in paths]
