"""Sequence dimensions: which dimension of which batch leaf `MeshStrategy`
splits over its ``context`` axis.

`sequence_dims` names them as sharding rules name parameters: a regular
expression `re.fullmatch`ed against a leaf's name in ``(x, y)`` (``"x"``,
``"y"``, ``"x.tokens"``, ``"x.1"``: the path from the inputs or the
targets, keys joined by dots), and the dimension of the batch array (1 is
the first after the examples axis). An int alone names that dimension of
every leaf that has it. This module checks the setting as written
(`check_sequence_dims`, at construction) and against a batch
(`sequence_specs`, at the first batch, before anything is placed).
"""

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .._contracts import SequenceSplit, splitting_sequences
from .._validate import is_int
from ._mesh_leaves import warn_once
from ._per_device import axis_name_of
from ._strategy import ExampleShapes


_EXAMPLE = 'sequence_dims={"x": 1, "y": 1}'


@dataclasses.dataclass(frozen=True)
class SequenceDims:
    """`sequence_dims` as written, checked: ``(pattern, dim)`` pairs in order
    (the first that matches a leaf says its dimension), or one dimension
    for every leaf that has it (`every`)."""

    pairs: tuple[tuple[str, int], ...] = ()
    every: int | None = None

    def __bool__(self) -> bool:
        return bool(self.pairs) or self.every is not None

    def __repr__(self) -> str:
        return repr(self.every) if self.every is not None else repr(dict(self.pairs))


def check_sequence_dims(value: object) -> SequenceDims:
    """`sequence_dims` as `MeshStrategy` takes it, checked as written.

    Raises:
        TypeError: it is neither None, an int nor a mapping.
        ValueError: a pattern is not a regular expression, or a dimension
            is not an int >= 1.
    """
    if value is None:
        return SequenceDims()
    if is_int(value):
        _check_dim(value, "sequence_dims")
        return SequenceDims(every=int(value))
    if not isinstance(value, Mapping):
        raise TypeError(
            f"sequence_dims={value!r} must be a mapping of batch leaf names to "
            f"dimensions, e.g. {_EXAMPLE}, or one int (that dimension of every "
            "leaf that has it)"
        )
    pairs = []
    for pattern, dim in value.items():
        if not isinstance(pattern, str):
            raise TypeError(
                f"sequence_dims: the key {pattern!r} must be a str, a regular "
                f"expression fullmatched against a batch leaf's name; e.g. {_EXAMPLE}"
            )
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"sequence_dims: {pattern!r} is not a regular expression ({error})"
            ) from None
        _check_dim(dim, f"sequence_dims[{pattern!r}]")
        pairs.append((pattern, int(dim)))
    return SequenceDims(tuple(pairs))


def _check_dim(dim: object, name: str) -> None:
    if not is_int(dim) or int(dim) < 1:  # pyright: ignore[reportArgumentType]
        raise ValueError(
            f"{name}={dim!r} must be an int >= 1: a dimension of the batch "
            "array after its examples axis (0), e.g. 1 for (examples, sequence)"
        )


def sequence_specs(
    dims: SequenceDims,
    names: Sequence[str],
    shapes: ExampleShapes,
    batch_axes: tuple[str, ...],
    mesh: Mesh,
    whole: bool = True,
) -> list[P]:
    """Each batch leaf's layout: the examples axis over `batch_axes`, and the
    sequence dimension `dims` names for it over ``"context"``.

    Args:
        names: the leaves' names in ``(x, y)``.
        shapes: their shapes per example (without the examples axis).
        mesh: the mesh, with a ``context`` axis (each sequence dimension
            must be a multiple of its size).
        whole: the names are a whole training batch's, so that each pattern
            must match one of them (False: `predict`'s inputs alone).

    Raises:
        ValueError: a pattern matches no leaf, a dimension is past a leaf's
            last (an int: past every leaf's), or `context` does not divide a
            sequence's length.
    """
    if not dims:
        return [P(axis_name_of(batch_axes))] * len(names)
    batch, context = axis_name_of(batch_axes), mesh.shape["context"]
    pairs = zip(names, shapes, strict=True)
    found = [_dim(dims, name, len(shape)) for name, shape in pairs]
    if whole and dims.every is not None and all(dim is None for dim in found):
        ranks = ", ".join(
            f"{name} {len(shape) + 1}"
            for name, shape in zip(names, shapes, strict=True)
        )
        longest = max(len(shape) for shape in shapes)
        raise ValueError(
            f"sequence_dims={dims.every}: no leaf of the batch has dimension "
            f"{dims.every} (their dimensions, examples first: {ranks}), so "
            "nothing would be split over context; "
            + (
                f"name a dimension from 1 to {longest}"
                if longest
                else "the leaves hold no sequences"
            )
        )
    for pattern, _ in dims.pairs if whole else ():
        if not any(re.fullmatch(pattern, name) for name in names):
            raise ValueError(
                f"sequence_dims: {pattern!r} matches no leaf of the batch, whose "
                f"leaves are {', '.join(names)}; name one of them (a regular "
                "expression fullmatched against the name)"
            )
    specs = []
    for name, shape, dim in zip(names, shapes, found, strict=True):
        if dim is None:
            specs.append(P(batch))
            continue
        if dim > len(shape):
            raise ValueError(
                f"sequence_dims: {name} has {len(shape) + 1} dimensions (examples "
                f"first), so it has no dimension {dim}; name one from 1 to "
                f"{len(shape)}"
            )
        length = shape[dim - 1]
        if length % context:
            raise ValueError(
                f"sequence_dims: {name}'s dimension {dim} has {length} positions, "
                f"which context={context} does not divide: pad the sequences to "
                f"a multiple of {context} (with a padding mask), or choose a "
                "context size that divides them"
            )
        specs.append(P(batch, *[None] * (dim - 1), "context"))
    return specs


def check_within_processes(mesh: Mesh) -> None:
    """Each sequence's devices (a line along ``context``) must be one
    process's: each process reads whole sequences of its own examples.

    Raises:
        ValueError: a line along ``context`` holds devices of two processes.
    """
    lines = np.moveaxis(mesh.devices, mesh.axis_names.index("context"), -1)
    for line in lines.reshape(-1, lines.shape[-1]):
        if len({device.process_index for device in line}) > 1:
            raise ValueError(
                f"context={line.size} splits each sequence over devices of "
                "several processes; each process reads whole sequences, so "
                "keep context x tensor within one process's devices "
                f"({jax.local_device_count()} here), and let data or fsdp span "
                "the processes"
            )


def _dim(dims: SequenceDims, name: str, ndim: int) -> int | None:
    """The sequence dimension `dims` names for leaf `name` (None: none)."""
    if dims.every is not None:
        return dims.every if dims.every <= ndim else None
    for pattern, dim in dims.pairs:
        if re.fullmatch(pattern, name):
            return dim
    return None


def traced_with_split(
    fn: Callable[..., Any], split: SequenceSplit
) -> Callable[..., Any]:
    """`fn`, traced with `split` as the sequence split (attention asks for
    it), and a warning, once, where nothing in the model asked."""

    @functools.wraps(fn)
    def traced(*args: Any) -> Any:
        with splitting_sequences(split) as asked:
            out = fn(*args)
        if not asked[0]:
            warn_once(
                f"MeshStrategy(context={split.size}): nothing in the model asked "
                "for the sequence split (phalanx.models.dot_product_attention "
                "does): where positions mix, XLA gathers each whole sequence "
                "(exact, but the activations there are not split); compute "
                "attention with px.models.dot_product_attention"
            )
        return out

    return traced
