"""`GrainLoader` takes single examples of one shape (issue 54, item 1): a
dataset grain already batched is refused when the loader is built, and an
example whose parts differ from the first example read is refused as it is
read, each in one line naming what differs and the fix; examples that
`augment` brings to one shape are taken."""

import re

import grain
import numpy as np
import pytest

import phalanx as px


FIX = (
    "GrainLoader stacks examples of one shape: pad them to one shape (in the "
    "source's .map, or augment), or bucket them by shape, a loader for each"
)


def _examples(length=lambda i: 4) -> list[tuple[np.ndarray, np.int32]]:
    """20 examples: features of `length(i)` values, all ``i``; label ``i % 2``."""
    return [(np.full(length(i), i, np.float32), np.int32(i % 2)) for i in range(20)]


def _read(source, **options) -> list:
    """Every batch of an epoch, read in order by one thread."""
    loader = px.data.GrainLoader(source, 4, shuffle=False, read_threads=1, **options)
    try:
        return list(loader)
    finally:
        loader.close()


def _unbatched(batches):
    return batches.map(lambda batch: batch)


@pytest.mark.parametrize("batched", [lambda d: d, _unbatched], ids=["batch", "map"])
def test_a_batched_dataset_is_refused(batched):
    source = batched(grain.MapDataset.source(_examples()).batch(4))
    with pytest.raises(ValueError) as raised:
        px.data.GrainLoader(source, 8)
    assert str(raised.value) == (
        "source is batched (BatchMapDataset(batch_size=4, drop_remainder=False)): "
        "GrainLoader makes the batches from a dataset of single examples; pass "
        "the dataset before .batch(), and the batch size as "
        "GrainLoader(..., batch_size=)"
    )


def test_an_example_of_another_shape_is_refused():
    source = grain.MapDataset.source(_examples(lambda i: 5 if i == 6 else 4))
    with pytest.raises(ValueError, match=re.escape(FIX)) as raised:
        _read(source)
    assert (
        str(raised.value) == f"example 6's [0] has shape (5,), example 0's (4,): {FIX}"
    )


def test_an_example_of_other_parts_is_refused():
    examples = [{"x": x, "y": y} for x, y in _examples()]
    examples[9] = {"x": examples[9]["x"], "label": examples[9]["y"]}
    with pytest.raises(ValueError) as raised:
        _read(grain.MapDataset.source(examples))
    assert str(raised.value) == (
        "example 9 has 2 parts (['x'], ['label']), example 0 has 2 (['x'], "
        "['y']): every example needs the same parts; map the source to one "
        "structure"
    )


def _crop(example, rng):
    del rng
    x, y = example
    return x[:3], y


def test_examples_that_augment_brings_to_one_shape_are_taken():
    source = grain.MapDataset.source(_examples(lambda i: 3 + i % 2))
    batches = _read(source, augment=_crop)
    assert [x.shape for x, _, _ in batches] == [(4, 3)] * 5
