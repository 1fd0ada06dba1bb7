"""A `TrainState` built from the flat arrays a run keeps, in one unflatten.

The trainer keeps the state as a flat list of arrays (PRNG keys as their
data) and builds a `TrainState` whenever one is read (``trainer.state``,
``snapshot()``: the learning-rate monitor at every log point, a checkpoint
at every save). Putting the arrays back into the structure's non-array parts
with `eqx.combine` costs ~40 us (~0.2 ms in a fit, where the run's other
threads share the GIL); `StateBuilder` keeps the whole structure and its
non-array leaves once, and fills in the arrays: ~12 us, the same state.
"""

from typing import Any, final

import equinox as eqx
import jax

from ._train_state import TrainState


def _is_none(x: Any) -> bool:
    return x is None


@final
class StateBuilder:
    """Builds states of one structure from their arrays in flattening order."""

    def __init__(self, state: TrainState, keys: tuple[Any, ...]):
        """
        Args:
            state: a state of the structure (its arrays are not kept).
            keys: for each array, its PRNG key implementation where it is a
                key's data, else None.
        """
        leaves, self._treedef = jax.tree.flatten(state, is_leaf=_is_none)
        self._at = tuple(i for i, x in enumerate(leaves) if eqx.is_array(x))
        # The non-array leaves, with a hole where each array goes.
        self._leaves = [None if eqx.is_array(x) else x for x in leaves]
        if len(self._at) != len(keys):
            raise ValueError(f"{len(keys)} key entries for {len(self._at)} arrays")
        self._keys = keys

    def build(self, arrays: list[jax.Array]) -> TrainState:
        """The state of `arrays` (keys as their data)."""
        leaves = list(self._leaves)
        for i, x, impl in zip(self._at, arrays, self._keys, strict=True):
            leaves[i] = x if impl is None else jax.random.wrap_key_data(x, impl=impl)
        return jax.tree.unflatten(self._treedef, leaves)
