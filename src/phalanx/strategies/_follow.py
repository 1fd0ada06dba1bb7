"""The optimizer state laid out as the parameters it holds a copy of, found by
the state's tree structure (never by field names).

An optimizer keeps parameter-shaped trees in its state: adam's moments, an
average (`optax.ema`), accumulated gradients (`optax.MultiSteps`), the
inner state of `optax.inject_hyperparams`. Under a mask (`optax.masked`,
and so each group of `optax.multi_transform`) such a tree has an
`optax.MaskedNode` in place of each parameter, or subtree of parameters,
the transformation does not train. Any subtree of the state that is the
model's tree of arrays, up to those masked places, with each array of its
parameter's shape, takes its parameters' layout, leaf for leaf. This module
computes layouts (`PartitionSpec`s); it places nothing.
"""

from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree


class _Slot:
    """One array of the model as an optimizer state's tree is matched against
    it: its shape and layout (a plain object: a leaf to `jax.tree`)."""

    __slots__ = ("shape", "spec")

    def __init__(self, shape: tuple[int, ...], spec: P):
        self.shape = shape
        self.spec = spec


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct | jax.Array)


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def follow_parameters(
    model: PyTree[Any],
    model_specs: PyTree[P],
    opt_state: PyTree[Any],
    floating: Callable[[Any], bool],
    otherwise: Callable[[Any], P],
) -> PyTree[P]:
    """The layout of each array of `opt_state`: as its parameter's where it
    lies in a parameter-shaped subtree, `otherwise(array)` elsewhere.

    Args:
        model: the model's arrays (or shapes), other leaves None.
        model_specs: `model` with each array's layout in its place.
        opt_state: the optimizer state's arrays (or shapes), other leaves None.
        floating: whether an array of `model` is one the optimizer state was
            initialised on (optax states are initialised on the model's
            floating arrays, the others None): the state is matched against
            the model with and without its other arrays.
        otherwise: the layout of an array in no parameter-shaped subtree.

    Returns:
        `opt_state` with a `PartitionSpec` in place of each array.
    """
    slots = jax.tree.map(
        lambda x, spec: _Slot(tuple(x.shape), spec),
        model,
        model_specs,
        is_leaf=_is_spec,
    )
    trainable = jax.tree.map(
        lambda x, slot: slot if floating(x) else None, model, slots
    )
    models = (slots, trainable)

    def twin(node: Any) -> list[P | None] | None:
        """The layouts of `node`'s leaves (None for a masked place) if it is
        shaped as one of `models` up to masked places, else None."""
        if node is None or _is_array(node) or _is_masked(node):
            return None
        leaves, structure = jax.tree.flatten(node, is_leaf=_is_masked)
        for tree in models:
            try:
                # Each of node's leaves with the model's subtree in its place:
                # one array where node has an array, anything under a mask.
                places = structure.flatten_up_to(tree)
            except (TypeError, ValueError):
                continue
            specs: list[P | None] = []
            for leaf, place in zip(leaves, places, strict=True):
                if _is_masked(leaf):
                    specs.append(None)
                elif (
                    _is_array(leaf)
                    and isinstance(place, _Slot)
                    and tuple(leaf.shape) == place.shape
                ):
                    specs.append(place.spec)
                else:
                    break
            else:
                return specs
        return None

    def layout(node: Any) -> Any:
        specs = twin(node)
        if specs is None:
            return otherwise(node)
        leaves, structure = jax.tree.flatten(node, is_leaf=_is_masked)
        return jax.tree.unflatten(
            structure,
            [
                leaf if spec is None else spec
                for leaf, spec in zip(leaves, specs, strict=True)
            ],
        )

    return jax.tree.map(layout, opt_state, is_leaf=lambda n: twin(n) is not None)
