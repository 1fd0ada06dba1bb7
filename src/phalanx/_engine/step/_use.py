"""Where the step computes with the parameters: laid out as the strategy's
`use_shardings` says, a stacked array one layer at a time inside its loop
(so that each layer is gathered on its turn, and gathered again in the
backward pass rather than kept: never the whole stack at once). This module
constrains layouts inside a traced step; it places nothing."""

from typing import Any

import jax
import jax.extend.core as jex
from jax.lax import with_sharding_constraint
from jax.sharding import NamedSharding, PartitionSpec as P

from ..._contracts import AbstractStacked


CONSTRAINT = jex.primitives.sharding_constraint_p


def _is_stacked(x: Any) -> bool:
    return isinstance(x, AbstractStacked)


def used_as(model: Any, shardings: Any) -> Any:
    """`model` (inside a traced step) with each array laid out as
    `shardings` (the model with a `NamedSharding` in place of each array,
    None elsewhere) says; the layers of a stacked module each inside its
    loop, as their shardings without the layer axis say."""

    def use(node: Any, where: Any) -> Any:
        if not _is_stacked(node):
            return constrained(node, where)
        per_layer = jax.tree.map(_one_layer, where.layers)
        laid = set(jax.tree.leaves(per_layer))

        def again(primitive: Any, *avals: Any, **params: Any) -> bool:
            del avals  # a layer laid out for use: laid out again, not kept
            return primitive is CONSTRAINT and params.get("sharding") in laid

        return node.each_layer(lambda arrays: constrained(arrays, per_layer), again)

    return jax.tree.map(use, model, shardings, is_leaf=_is_stacked)


def constrained(tree: Any, shardings: Any) -> Any:
    """`tree`'s arrays constrained to lie as `shardings` (of `tree`'s
    structure, or one it is a prefix of; None: anywhere) says."""
    return jax.tree.map(
        lambda x, where: (
            x
            if where is None or not isinstance(x, jax.Array)
            else with_sharding_constraint(x, where)
        ),
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def _one_layer(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer of a stacked array laid out as `sharding`."""
    return NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
