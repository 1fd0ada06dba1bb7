"""Batch checks, and the messages they raise.

Host checks of structure and shapes run once per new shape/dtype signature
(cached), before any device work; value checks (finite inputs, labels in
range) run on every batch while ``checks="on"``. Checks inside the compiled
step run at trace time only, so they cost nothing in steady state
(`program/_spec.py`). Class labels' checks live in `_labels`; the errors of
a run past these checks (no batches, no weight, a non-finite gradient) in
`_checks/_run_errors.py`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..program._spec import Leaf, Shaped, path_names


def check_batch_layout(
    leaves: Sequence[Any], treedef: Any, splits: Sequence[Any], where: str
) -> None:
    """A batch's device leaves must lie as the strategy splits batches
    (`splits`: each leaf's layout) where the user placed them (a committed
    `jax.Array`: on the strategy's devices in another layout, or on one
    device): each step would move them. Host leaves, and uncommitted arrays
    as `jnp` makes them, are the pipeline's to place. Read for the first
    batch, then for each batch that must move (`put_batch`'s
    `before_move`).

    Raises:
        ValueError: a leaf the user placed lies otherwise.
    """
    for i, (leaf, split) in enumerate(zip(leaves, splits, strict=True)):
        if not isinstance(leaf, jax.Array) or not leaf.committed:
            continue
        sharding = leaf.sharding
        if sharding == split or sharding.is_equivalent_to(split, leaf.ndim):
            continue
        name = path_names(treedef)[i]
        have = sharding.spec if isinstance(sharding, NamedSharding) else sharding
        want = split.spec if isinstance(split, NamedSharding) else split
        raise ValueError(
            f"data: {where} leaf {name} is placed as {have}, and the strategy "
            f"splits batches as {want}: every step would reshard it; pass NumPy "
            "arrays (the trainer places them), or place them as "
            "trainer.strategy.batch_leaf_shardings says"
        )


def layout_check(
    treedef: Any, splits: Sequence[Any], where: str | None
) -> Callable[[Sequence[Any]], None] | None:
    """`check_batch_layout` of a batch's leaves (of `treedef`, called `where`),
    for `put_batch`'s `before_move`; None where there is nothing to check (a
    batch padded by the pipeline: a new array, no layout of the user's)."""
    if where is None:
        return None
    return functools.partial(
        check_batch_layout, treedef=treedef, splits=splits, where=where
    )


def batch_leaf_names(batch: Any, inputs: Any, targets: Any) -> list[str]:
    """The name of each leaf of ``(inputs, targets)``, as split from the
    user's `batch`: its path there (``batch['x']``, ``batch[0]``) where it is
    one of the batch's own leaves, else its place in the split (``x[0]``,
    ``y``: a `split_batch` that computes its parts)."""
    paths: dict[int, list[str]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        paths.setdefault(id(leaf), []).append("batch" + jax.tree_util.keystr(path))
    names = []
    for part, tree in (("x", inputs), ("y", targets)):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            # The same array twice (an autoencoder's (x, x)): each place once.
            found = paths.get(id(leaf))
            names.append(found.pop(0) if found else part + jax.tree_util.keystr(path))
    return names


def flatten_batch(batch: Any, where: str) -> tuple[list[Leaf], Any]:
    """The leaves of a batch as NumPy arrays (`jax.Array` leaves, already on
    devices, are kept as they are), and its structure.

    Raises:
        TypeError: a leaf is not convertible to a numeric NumPy array.
    """
    leaves, treedef = jax.tree.flatten(batch)
    if not leaves:
        raise TypeError(
            f"data: {where} is {batch!r}, which holds no arrays; yield pytrees of "
            "arrays such as (x, y)"
        )
    arrays = []
    for i, leaf in enumerate(leaves):
        array = leaf if isinstance(leaf, Leaf) else np.asarray(leaf)
        if array.dtype.kind not in "biuf":
            name = path_names(treedef)[i]
            raise TypeError(
                f"data: {where} leaf {name} has dtype {array.dtype} "
                f"(from {type(leaf).__name__}); every leaf must be a numeric array, "
                "e.g. np.float32 features and np.int32 labels"
            )
        arrays.append(array)
    return arrays, treedef


def num_examples(leaves: Sequence[Shaped], treedef: Any, where: str) -> int:
    """The shared leading (examples) axis of every leaf.

    Raises:
        ValueError: a leaf is a scalar, the leaves disagree, or it is zero.
    """
    names = path_names(treedef)
    for name, leaf in zip(names, leaves, strict=True):
        if leaf.ndim == 0:
            raise ValueError(
                f"data: {where} leaf {name} is a scalar; every leaf needs a "
                "leading examples axis, e.g. y of shape (batch,)"
            )
    sizes = [f"{n} has {leaf.shape[0]}" for n, leaf in zip(names, leaves, strict=True)]
    if len({leaf.shape[0] for leaf in leaves}) > 1:
        raise ValueError(
            f"data: {where} leaves disagree on the leading (examples) axis: "
            f"{', '.join(sizes)}; give every leaf the same number of examples, "
            "slicing them together (e.g. x[i:j], y[i:j], one row of each per example)"
        )
    n = leaves[0].shape[0]
    if n == 0:
        raise ValueError(
            f"data: {where} holds 0 examples; drop empty batches from the data"
        )
    return n


def check_finite(leaves: Sequence[np.ndarray], treedef: Any, where: str) -> None:
    """Raise if a floating leaf holds NaN or infinity (the leaves' names are
    made only then: every host batch is checked)."""
    for i, leaf in enumerate(leaves):
        if leaf.dtype.kind == "f" and not np.isfinite(leaf).all():
            bad = int(np.argwhere(~np.isfinite(leaf))[0][0])
            name = path_names(treedef)[i]
            raise ValueError(
                f"data: {where} leaf {name} holds a non-finite value (NaN or inf) "
                f"at example {bad}; clean or impute the data, or pass "
                "checks='off' to skip value checks"
            )


def check_sample_weight(weight: Any, n: int, where: str) -> np.ndarray:
    """Sample weights as float32 of shape (n,): finite and non-negative."""
    array = np.asarray(weight)
    if array.dtype.kind not in "biuf" or array.shape != (n,):
        raise ValueError(
            f"data: {where} has sample_weight of dtype {array.dtype} and shape "
            f"{array.shape}; it must be one number per example, shape ({n},)"
        )
    array = array.astype(np.float32, copy=False)
    if not np.isfinite(array).all() or (array < 0).any():
        raise ValueError(
            f"data: {where} has sample_weight values outside [0, inf) (min "
            f"{np.nanmin(array)}); weights must be finite and non-negative"
        )
    return array
