"""Several steps' batches stacked for one compiled call of several steps.

With ``steps_per_call > 1`` the loop runs a group of prepared batches (of one
step size) in one call: each leaf, the weights and the totals stacked along
a new leading (steps) axis. Host leaves of one process are stacked on the
host (one transfer each), anything else on the devices; the weights and
totals of batches without sample weights are cached. It only stacks batches
the `BatchPipeline` prepared; it checks and pads nothing.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, Sharding

from ...strategies._placement import (
    replicated,
    replicated_float32,
    single_process,
    stacked,
)
from ._device_batch import DeviceBatch
from ._memo import Memo


class BatchStacker:
    """Stacks the prepared batches of several steps (`stack`).

    Args:
        mesh: the strategy's mesh (totals are replicated over it).
        split: the weights' layout (the strategy's batch sharding).
        weights: the pipeline's cached weights (by examples and step size),
            read to know a group's weights are the cached ones.
    """

    def __init__(
        self, mesh: Mesh, split: Sharding, weights: Memo[tuple[int, int], jax.Array]
    ):
        self._mesh = mesh
        self._split = split
        self._weights = weights
        self._replicated = replicated(mesh)
        # Stacked weights (by batch count, size and steps) and totals (by
        # value), for several steps' batches.
        self._stacked_weights: Memo[tuple[int, int, int], jax.Array] = Memo()
        self._stacked_totals: Memo[tuple[float, ...], jax.Array] = Memo()
        self._stackers: Memo[tuple[Any, ...], Any] = Memo()

    def _stack_on_devices(self, columns: list[list[Any]], splits: list[Any]) -> Any:
        """Each list of arrays stacked along a new leading (steps) axis, on
        the devices, split as a stacked batch (`splits`: each one's layout)."""
        stack = self._stackers.get_or_make(
            tuple(splits),
            lambda: jax.jit(
                lambda xs: [jnp.stack(x) for x in xs],
                out_shardings=[stacked(split) for split in splits],
            ),
        )
        return stack(columns)

    @functools.cached_property
    def _stack_totals(self) -> Any:
        return jax.jit(jnp.stack, out_shardings=self._replicated)

    def _stack_leaves(self, columns: list[list[Any]], splits: list[Any]) -> list[Any]:
        """Each column of arrays stacked along a new leading (steps) axis: on
        the host where all are host arrays of one process, else on the
        devices (laid out as `splits` says, a stacked axis first)."""
        if single_process() and all(
            isinstance(x, np.ndarray) for column in columns for x in column
        ):
            return [np.stack(column) for column in columns]
        return self._stack_on_devices(columns, splits)

    def stack(
        self, group: list[DeviceBatch], splits: list[Any]
    ) -> tuple[list[Any], Any, jax.Array]:
        """The leaves, weights and totals of several steps' batches (of one
        step size), each stacked along a new leading (steps) axis: the
        arguments of one compiled call of several steps (`splits`: each
        leaf's layout, the pipeline's). Host leaves are stacked on the host
        (one transfer each), device leaves on the devices; the weights and
        totals of batches without sample weights are cached."""
        first = group[0]
        leaves = self._stack_leaves(
            [[batch.leaves[i] for batch in group] for i in range(len(first.leaves))],
            splits,
        )
        weights = [batch.weight for batch in group]
        cached = self._weights.get((first.n, first.size))
        if all(w is cached for w in weights):  # the cached ones
            weight = self._stacked_weights.get_or_make(
                (first.n, first.size, len(group)),
                lambda: self._stack_leaves([weights], [self._split])[0],
            )
        else:
            weight = self._stack_leaves([weights], [self._split])[0]
        values = [batch.total_value for batch in group]
        known = [value for value in values if value is not None]
        if len(known) < len(values):
            total = self._stack_totals([batch.total for batch in group])
        else:
            total = self._stacked_totals.get_or_make(
                tuple(known),
                lambda: replicated_float32(known, self._mesh),
            )
        return leaves, weight, total
