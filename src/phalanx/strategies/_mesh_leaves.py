"""What `MeshStrategy` asks of the model's leaves (floating, stacked) and
says of them: the large leaves its layout leaves whole, each line once a
process."""

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import PyTree

from .._contracts import AbstractStacked
from .._log import logger
from ._per_device import spec_axes
from ._rules import path_name


# Lines already logged (leaves left whole, attention that splits nothing):
# each is said once a process.
_WARNED: set[str] = set()


def warn_once(line: str) -> None:
    """Log `line` as a warning, once a process."""
    if line not in _WARNED:
        _WARNED.add(line)
        logger.warning(line)


def warn_whole(mesh: Mesh, min_size: int, model: PyTree[Any], specs: PyTree[P]) -> None:
    """One line naming the large floating leaves (`min_size` elements or
    more) that `specs` leave whole on every device while the mesh could
    split them."""
    sizes = mesh.shape
    if sizes["fsdp"] == 1 and sizes["tensor"] == 1:
        return
    whole = []
    pairs = jax.tree_util.tree_leaves_with_path(model)
    for (path, leaf), spec in zip(
        pairs, jax.tree.leaves(specs, is_leaf=is_spec), strict=True
    ):
        split = any(spec_axes(entry) for entry in spec)
        if floating(leaf) and leaf.size >= min_size and not split:
            nbytes = leaf.size * jnp.dtype(leaf.dtype).itemsize
            whole.append(
                f"{path_name(path)} {leaf.dtype}{list(leaf.shape)} ({nbytes:,} bytes)"
            )
    if whole:
        warn_once(
            f"MeshStrategy({dict(sizes)}): kept whole on every device: "
            f"{'; '.join(whole)}; add a rule for it, or make a dimension "
            "divisible by fsdp"
        )


def floating(leaf: Any) -> bool:
    """Whether `leaf` is a floating array of at least one dimension."""
    return trainable(leaf) and bool(leaf.shape)


def trainable(leaf: Any) -> bool:
    """Whether `leaf` is an array optax initialises its state on (the
    model's floating arrays, scalars included)."""
    return isinstance(leaf, jax.ShapeDtypeStruct | jax.Array) and jnp.issubdtype(
        leaf.dtype, jnp.inexact
    )


def stacked_leaves(model: PyTree[Any]) -> set[int]:
    """The ids of the arrays of `model` stored stacked (a layer axis first)."""
    found = set()
    nodes = jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, AbstractStacked))
    for node in nodes:
        if isinstance(node, AbstractStacked):
            found.update(id(leaf) for leaf in jax.tree.leaves(node.layers))
    return found


def is_spec(x: Any) -> bool:
    return isinstance(x, P)
