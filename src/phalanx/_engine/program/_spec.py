"""What a batch looks like to a program: the structure, shapes and
dtypes of its leaves per example (`BatchSpec`, fixed by the first batch and
checked inside the step too), each leaf's name as strategies match it, and
the signature a batch is checked by once. The host checks of a batch are
the feed's (`feed/_batch_checks.py`).
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jaxtyping
import numpy as np
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped


Leaf = np.ndarray | jax.Array  # a batch leaf: on the host, or already on devices


Shaped = Leaf | jax.ShapeDtypeStruct  # or its shape (a plan's batch)


def _dtype_class(dtype: np.dtype) -> Any:
    """The jaxtyping class pinning `dtype` as it lives on device (e.g. Int32)."""
    name = np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name
    if name == "bool":
        return jaxtyping.Bool
    kind, bits = name.rstrip("0123456789"), name[len(name.rstrip("0123456789")) :]
    prefix = {"float": "Float", "int": "Int", "uint": "UInt", "bfloat": "BFloat"}
    return getattr(jaxtyping, prefix[kind] + bits)


Signature = tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]


def _paths(treedef: Any) -> list[Any]:
    """The path of each leaf of a structure, in order."""
    placeholders = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(placeholders)[0]]


def path_names(treedef: Any) -> list[str]:
    return ["batch" + jax.tree_util.keystr(path) for path in _paths(treedef)]


def leaf_names(treedef: Any) -> list[str]:
    """Each leaf's name in ``(x, y)`` (the structure of ``(inputs,
    targets)``), as a strategy's per-leaf settings match it: ``"x"``,
    ``"y"``, ``"x.tokens"``, ``"y.1"`` (the path from the inputs or the
    targets, keys joined by dots)."""
    names = []
    for path in _paths(treedef):
        part = "y" if path[0] == jax.tree_util.SequenceKey(1) else "x"
        rest = jax.tree_util.keystr(tuple(path[1:]), simple=True, separator=".")
        names.append(f"{part}.{rest}" if rest else part)
    return names


def input_names(treedef: Any) -> list[str]:
    """Each leaf's name (`leaf_names`) in inputs of structure `treedef`."""
    inputs = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return leaf_names(jax.tree.structure((inputs, None)))


def signature(leaves: Sequence[Leaf], treedef: Any) -> Signature:
    """The cache key of a batch's checks: structure, shapes and dtypes."""
    return treedef, tuple([(leaf.shape, leaf.dtype) for leaf in leaves])


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What every batch must look like: fixed by the first batch seen."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]  # per example, without the leading axis
    dtypes: tuple[np.dtype, ...]
    # The first batch's number of examples, for the fixes that messages suggest.
    examples: int = dataclasses.field(default=0, compare=False)
    # Each strategy's layout of the leaves, worked out once: the pipeline
    # checks the first batch by it and every program of the spec is built
    # with it (a sequence's split included). By the strategy's id, with the
    # strategy (an id outlives no object it is kept with).
    _layouts: dict[int, tuple[Any, list[Any]]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, leaves: Sequence[Leaf], treedef: Any) -> "BatchSpec":
        return cls(
            treedef,
            tuple(leaf.shape[1:] for leaf in leaves),
            tuple(leaf.dtype for leaf in leaves),
            leaves[0].shape[0],
        )

    def shardings(self, strategy: Any) -> list[Any]:
        """Where `strategy` lays out each leaf (`batch_leaf_shardings`), once
        per strategy."""
        known = self._layouts.get(id(strategy))
        if known is None or known[0] is not strategy:
            splits = strategy.batch_leaf_shardings(
                leaf_names(self.treedef), self.shapes
            )
            known = self._layouts[id(strategy)] = (strategy, splits)
        return list(known[1])

    def describe(self) -> str:
        parts = [
            f"{name}: {dtype}{list(shape)}"
            for name, shape, dtype in zip(
                path_names(self.treedef), self.shapes, self.dtypes, strict=True
            )
        ]
        return "{" + ", ".join(parts) + "}"

    def check(self, leaves: Sequence[Leaf], treedef: Any, where: str) -> None:
        """Raise if a batch differs from the spec in structure, shape or dtype."""
        if treedef != self.treedef:
            raise ValueError(
                f"data: {where} has structure {treedef} but the first batch had "
                f"{self.treedef}; every batch must be the same pytree, e.g. "
                "always (x, y)"
            )
        names = path_names(treedef)
        for name, leaf, shape, dtype in zip(
            names, leaves, self.shapes, self.dtypes, strict=True
        ):
            if leaf.shape[1:] != shape:
                raise ValueError(
                    f"data: {where} leaf {name} has shape {leaf.shape}, i.e. "
                    f"{leaf.ndim - 1}-d examples of shape {leaf.shape[1:]}, but the "
                    f"first batch fixed examples of shape {shape}; only the number "
                    "of examples (the leading axis) may change between batches"
                )
            if leaf.dtype != dtype:
                raise TypeError(
                    f"data: {where} leaf {name} has dtype {leaf.dtype} but the first "
                    f"batch had {dtype}; cast it, e.g. {name}.astype(np.{dtype})"
                )

    def traced_check(self) -> Callable[[tuple[Array, ...], Array], None]:
        """A jaxtyping + beartype check of a device batch, for use under jit.

        Every leaf must have the spec's per-example shape and dtype, and share
        the leading ``batch`` axis with the weights. Runs at trace time only.
        """
        annotations = tuple(
            _dtype_class(dtype)[Array, f"batch {' '.join(map(str, shape))}".strip()]
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )

        # A lambda, not a def: the jaxtyping import hook decorates every def at
        # import time, before these annotations exist, and beartype would then
        # check the bare original instead of this signature.
        check = lambda leaves, weight: None  # noqa: E731
        check.__name__ = check.__qualname__ = "check_batch"
        check.__annotations__ = {
            "leaves": tuple[annotations],  # pyright: ignore[reportInvalidTypeArguments]
            "weight": Float[Array, " batch"],
            "return": None,
        }
        return jaxtyped(typechecker=beartype)(check)
