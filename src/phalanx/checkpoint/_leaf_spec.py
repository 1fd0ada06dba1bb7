"""The [path, shape, dtype] of every array in a pytree, stored beside saved
arrays so that loading into another architecture names the first leaf that
differs (shared by model files and training snapshots)."""

from typing import Any

import equinox as eqx
import jax


# One array leaf: [keystr path, shape, dtype name] (JSON-friendly).
LeafSpec = list[Any]


def leaf_specs(tree: Any) -> tuple[list[Any], list[LeafSpec]]:
    """The array leaves of `tree` and their specs, in flattening order."""
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    specs = [
        [jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)]
        for path, leaf in leaves
    ]
    return [leaf for _, leaf in leaves], specs


# The specs of the trees seen, by structure, shapes and dtypes: a checkpoint
# save reads its state's from here, not from the paths again (~0.1 ms a save
# of a small model).
_SPECS: dict[Any, list[LeafSpec]] = {}


def array_specs(tree: Any) -> tuple[list[Any], list[LeafSpec]]:
    """As `leaf_specs`, the specs made once per structure, shapes and
    dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [x for x in leaves if eqx.is_array(x)]
    try:
        key = (treedef, tuple((x.shape, x.dtype) for x in arrays))
        spec = _SPECS.get(key)
    except TypeError:  # a static field that cannot be hashed
        return arrays, leaf_specs(tree)[1]
    if spec is None:
        if len(_SPECS) >= 16:  # many trainers in one process: bounded
            _SPECS.clear()
        spec = _SPECS[key] = leaf_specs(tree)[1]
    return arrays, spec


def check_same_specs(
    ours: list[LeafSpec],
    saved: list[LeafSpec],
    *,
    stored: str,
    kind: str,
    mine: str,
    fix: str,
) -> None:
    """Raise ValueError at the first leaf where `saved` differs from `ours`.

    Args:
        stored: what holds `saved`, e.g. ``"checkpoint runs/a/7"``.
        kind: what differs, e.g. ``"model or optimizer"``.
        mine: what holds `ours`, e.g. ``"this trainer"``.
        fix: how to fix it, e.g. ``"build the trainer as for that run"``.
    """
    for have, got in zip(ours, saved, strict=False):
        if list(have) != list(got):
            raise ValueError(
                f"{stored} is from another {kind}: at {got[0]} it holds "
                f"{got[2]}{got[1]} but {mine} has {have[0]} {have[2]}{have[1]}; {fix}"
            )
    if len(ours) != len(saved):
        # The first array one has and the other lacks (e.g. ".ema...": a
        # trainer with ema= where the run had none) says what differs.
        extra = ours[len(saved)] if len(ours) > len(saved) else saved[len(ours)]
        who = mine if len(ours) > len(saved) else stored
        raise ValueError(
            f"{stored} is from another {kind}: it holds {len(saved)} arrays but "
            f"{mine} has {len(ours)}, the first that only {who} has at "
            f"{extra[0]}; {fix}"
        )
