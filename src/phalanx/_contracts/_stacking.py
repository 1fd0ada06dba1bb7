"""`AbstractStacked`: what a strategy knows of layers stored stacked.

A module of this kind holds layers of one structure as one module whose
arrays have a leading layer axis (`phalanx.models.Stacked`). A strategy that
splits arrays by size (`MeshStrategy`) never splits that axis: the layers
are applied one after another, and each is gathered whole on its turn.
A step may also ask that each layer's arrays be laid out anew where it is
used (`each_layer`). Here, at the bottom of the layers, so that strategies,
the engine and models all see it without importing each other.
"""

import abc
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx


class AbstractStacked(eqx.Module):
    """Layers stored stacked: `layers` is one module whose arrays each have
    a leading axis of one entry per layer."""

    layers: eqx.AbstractVar[Any]

    @abc.abstractmethod
    def each_layer(
        self, use: Callable[[Any], Any], again: Callable[..., bool]
    ) -> "AbstractStacked":
        """A copy that applies each layer with its arrays passed through
        `use` first, inside the loop over layers: how a strategy lays out
        one layer's parameters where the step computes with them (e.g.
        `jax.lax.with_sharding_constraint`), one layer at a time.

        `again(primitive, *avals, **params)` (a `jax.checkpoint` policy
        turned round) says which of `use`'s operations the backward pass
        computes again instead of keeping their outputs for every layer
        (a gathered layer, kept, would keep the whole stack gathered)."""


_M = TypeVar("_M", bound=eqx.Module)


def with_static(module: _M, **fields: Any) -> _M:
    """A copy of `module` with its static `fields` set, its `__init__` not
    run. Not `copy.copy`: it calls equinox's `Module.__new__`, which holds
    each new module (a strong reference, in ``_currently_initialising``)
    until its `__init__` ends, so that a copy, never initialised, is held
    for the process's life with its arrays (343 MB of GPT-2 small's, a copy
    of its parameters beside the trainer's, on a TPU v5e)."""
    changed = object.__new__(type(module))
    vars(changed).update(vars(module), **fields)
    return changed
