"""Layout lint (issue 43, item 3): what in a state's layout a user most
likely did not mean, each said in one line with its fix. Read from the
layout alone (the leaves' shapes and shardings): nothing is placed,
compiled or run.

- A large floating leaf left whole on every device while the layout splits
  others (no dimension the split divides evenly, or no rule for it): it
  costs its full bytes on each device.
- A dimension split unevenly: JAX pads each shard to the largest, and the
  padding is memory every device holds for nothing.
- A `Stacked` array split along its layer axis: each layer travels whole
  to every device at its turn.
- Devices holding unequal parts of the state.
"""

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..._contracts import AbstractStacked
from ._summary import format_bytes as human_bytes


def layout_warnings(
    paths: Sequence[str],
    structs: Sequence[jax.ShapeDtypeStruct],
    shardings: Sequence[Any],
    min_size: int | None,
    stacked: Sequence[bool] = (),
) -> list[str]:
    """One line per leaf (by its path in `paths`) whose layout is likely a
    mistake (see the module), for leaves of these `structs` laid out as
    `shardings`; `min_size`: the strategy's (leaves of fewer elements are
    meant to stay whole; None: the strategy splits no state by size);
    `stacked`: whether each leaf is an array of a `Stacked` stack (its
    first axis the layers'); then one line if the devices hold unequal
    bytes of the state."""
    split = [not _whole(s, x) for s, x in zip(shardings, structs, strict=True)]
    layers = list(stacked) or [False] * len(paths)
    found = []
    for path, struct, sharding, is_split, is_stacked in zip(
        paths, structs, shardings, split, layers, strict=True
    ):
        if is_stacked and _factors(sharding, len(struct.shape))[0] > 1:
            found.append(
                f"{path} {_shape(struct)} is split along its layer axis (the "
                "first, a Stacked stack's layers): each layer lies on some "
                "devices and is sent whole to all at its turn in the loop; "
                "give the layer axis None in its rule and split a dimension of "
                "the layer"
            )
        size = math.prod(struct.shape)
        floating = jax.dtypes.issubdtype(struct.dtype, np.inexact)
        if (
            min_size is not None
            and any(split)
            and not is_split
            and floating
            and size >= min_size
            and _devices(sharding) > 1
        ):
            found.append(_replicated(path, struct, _devices(sharding)))
        waste = _padding(struct, sharding)
        if waste:
            found.append(
                f"{path} {_shape(struct)} is split unevenly: each device pads its "
                f"shard to the largest, {human_bytes(waste)} of padding in all; "
                "split a dimension its number of shards divides (or pad the "
                "dimension to a multiple of it)"
            )
    imbalance = _imbalance(paths, structs, shardings)
    if imbalance:
        found.append(imbalance)
    return found


def stacked_leaves(treedef: Any) -> list[bool]:
    """Whether each leaf of a state's structure `treedef` is an array of a
    `Stacked` stack (in the model, or in optimizer state shaped like it)."""
    numbered = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    inside: set[int] = set()
    for node in jax.tree.leaves(
        numbered, is_leaf=lambda x: isinstance(x, AbstractStacked)
    ):
        if isinstance(node, AbstractStacked):
            inside.update(jax.tree.leaves(node))
    return [i in inside for i in range(treedef.num_leaves)]


def held_bytes(
    structs: Sequence[jax.ShapeDtypeStruct], shardings: Sequence[Any]
) -> dict[Any, int]:
    """The bytes of leaves of these `structs` laid out as `shardings` that
    each device holds (leaves split unevenly, which JAX does not place, are
    left out: the lint names them)."""
    held: dict[Any, int] = {}
    for struct, sharding in zip(structs, shardings, strict=True):
        size = np.dtype(struct.dtype).itemsize
        if _padding(struct, sharding):
            continue
        indices = sharding.devices_indices_map(tuple(struct.shape))
        for device, index in indices.items():
            shape = [
                len(range(*part.indices(whole)))
                for part, whole in zip(index, struct.shape, strict=True)
            ]
            held[device] = held.get(device, 0) + math.prod(shape) * size
    return held


def _imbalance(
    paths: Sequence[str],
    structs: Sequence[jax.ShapeDtypeStruct],
    shardings: Sequence[Any],
) -> str | None:
    """One line if the fullest device holds over 5% more of the state than
    the emptiest (uneven splits leave some devices smaller shards), naming
    the leaf that tips it most (its bytes on the fullest less those on the
    emptiest)."""
    held = held_bytes(structs, shardings)
    if len(held) < 2:
        return None
    fullest, emptiest = max(held, key=held.__getitem__), min(held, key=held.__getitem__)
    most, least = held[fullest], held[emptiest]
    if most <= least * 1.05:
        return None
    tips = []
    for path, struct, sharding in zip(paths, structs, shardings, strict=True):
        one = held_bytes([struct], [sharding])
        tips.append((one.get(fullest, 0) - one.get(emptiest, 0), path))
    _, path = max(tips)
    return (
        f"the devices hold unequal parts of the state: {human_bytes(least)} to "
        f"{human_bytes(most)} ({most / least - 1:.0%} more on the fullest, most "
        f"of it {path}), and a step needs the fullest's memory on every device; "
        "lay every leaf out over all of the strategy's devices"
    )


def _factors(sharding: Any, ndim: int) -> list[int]:
    """How many shards each dimension is cut into (1: whole)."""
    if not isinstance(sharding, NamedSharding):
        return [1] * ndim
    sizes = dict(sharding.mesh.shape)
    factors = []
    for entry in (*sharding.spec, *([None] * (ndim - len(sharding.spec)))):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        factors.append(math.prod(sizes[name] for name in names))
    return factors


def _whole(sharding: Any, struct: jax.ShapeDtypeStruct) -> bool:
    """Whether every device holds the whole leaf."""
    return all(f == 1 for f in _factors(sharding, len(struct.shape)))


def _devices(sharding: Any) -> int:
    return sharding.mesh.size if isinstance(sharding, NamedSharding) else 1


def _replicated(path: str, struct: jax.ShapeDtypeStruct, devices: int) -> str:
    nbytes = math.prod(struct.shape) * np.dtype(struct.dtype).itemsize
    return (
        f"{path} {_shape(struct)} ({human_bytes(nbytes)}) is whole on each of "
        f"the {devices} devices while the layout splits other leaves: no "
        f"dimension of it is split (none divisible by the shard count, or no "
        "rule for it); add a rule that splits a dimension the axis divides, "
        "or pad a dimension to a multiple of it"
    )


def _padding(struct: jax.ShapeDtypeStruct, sharding: Any) -> int:
    """The bytes of padding all devices together hold for `struct` under
    `sharding`: each shard padded to the largest (0 for an even split)."""
    factors = _factors(sharding, len(struct.shape))
    shape = tuple(struct.shape)
    if all(whole % f == 0 for whole, f in zip(shape, factors, strict=True)):
        return 0
    shard = [-(-whole // f) for whole, f in zip(shape, factors, strict=True)]
    padded = math.prod(part * f for part, f in zip(shard, factors, strict=True))
    copies = _devices(sharding) // math.prod(factors)  # replicas of each shard
    extra = padded - math.prod(shape)
    return extra * copies * np.dtype(struct.dtype).itemsize


def _shape(struct: jax.ShapeDtypeStruct) -> str:
    return f"{np.dtype(struct.dtype).name}{list(struct.shape)}"
