"""What `GrainLoader` takes as examples, checked: a dataset of examples,
not of batches grain already made (`unbatched`, when the loader is built),
and examples of one structure and shape (`OneShape`, as they are read,
in grain's worker processes too: a loader stacks them into batches).

The checks only read what the loader reads anyway: nothing here decodes an
example of its own. grain is imported only by `unbatched`, which the
loader calls once it has imported grain itself.
"""

from collections.abc import Mapping
from typing import Any, final

import numpy as np


Leaves = tuple[tuple[str, tuple[int, ...]], ...]

_FIX = (
    "GrainLoader stacks examples of one shape: pad them to one shape (in the "
    "source's .map, or augment), or bucket them by shape, a loader for each"
)


def unbatched(source: Any) -> None:
    """Refuse `source`, a `grain.MapDataset`, where grain's ``.batch`` made
    it or a dataset it reads: its elements are batches, which the loader
    would stack into batches of batches.

    Raises:
        ValueError: `source` is batched (the message names the batching).
    """
    import grain

    # grain's batched MapDataset type, which grain does not export: the type
    # of what its public .batch returns.
    batched = type(grain.MapDataset.range(1).batch(1))
    datasets = [source]
    while datasets:
        dataset = datasets.pop()
        if isinstance(dataset, batched):
            raise ValueError(
                f"source is batched ({dataset}): GrainLoader makes the batches "
                "from a dataset of single examples; pass the dataset before "
                ".batch(), and the batch size as GrainLoader(..., batch_size=)"
            )
        if isinstance(dataset, grain.MapDataset | grain.IterDataset):
            datasets.extend(dataset.parents)


def leaves(example: Any) -> Leaves:
    """Each part of `example` (a tuple or dict of arrays), named as it is
    indexed (``[0]``, ``['x']``), with its shape."""
    if isinstance(example, Mapping):
        parts = example.items()
    elif isinstance(example, tuple | list):
        parts = enumerate(example)
    else:  # the batching refuses it, naming its type
        return ()
    return tuple((f"[{key!r}]", np.shape(value)) for key, value in parts)


@final
class OneShape:
    """The first example read (its index in the source and its leaves);
    each one read after it must have the same parts, of the same shapes."""

    def __init__(self):
        self.first: tuple[int, Leaves] | None = None

    def check(self, examples: list[Any], indices: list[int]) -> None:
        """Check `examples`, the source's `indices`, against the first.

        Raises:
            ValueError: an example differs from the first (the message names
                both by their index, and the part's two shapes).
        """
        for example, index in zip(examples, indices, strict=True):
            got = leaves(example)
            if self.first is None:
                self.first = (index, got)
            elif got != self.first[1]:
                raise ValueError(_differ(index, got, *self.first))


def _differ(index: int, got: Leaves, first: int, expected: Leaves) -> str:
    """The line that says how example `index` differs from example `first`."""
    names = [name for name, _ in got]
    if names != [name for name, _ in expected]:
        was = [name for name, _ in expected]
        return (
            f"example {index} has {len(names)} parts ({', '.join(names)}), example "
            f"{first} has {len(was)} ({', '.join(was)}): every example needs the "
            "same parts; map the source to one structure"
        )
    name, shape, was = next(
        (name, shape, was)
        for (name, shape), (_, was) in zip(got, expected, strict=True)
        if shape != was
    )
    return (
        f"example {index}'s {name} has shape {shape}, example {first}'s {was}: {_FIX}"
    )
