"""A loader's state names the batch size its position counts in (issue 54,
item 2): `px.data.GrainLoader` and `px.data.ArrayLoader` of another
`batch_size` refuse it in one line naming both sizes and the fix, as
``phalanx train --resume`` refuses another ``--batch-size``, instead of
skipping (or repeating) examples, and are left where they stood; a state
saved before the batch size was kept still loads."""

import grain
import numpy as np
import pytest

import phalanx as px


EXAMPLES = [(np.full(4, i, np.float32), np.int32(i % 2)) for i in range(40)]
SOURCE = grain.MapDataset.source(EXAMPLES)
X, Y = (np.stack(column) for column in zip(*EXAMPLES, strict=True))


def grain_loader(batch_size: int) -> px.data.GrainLoader:
    return px.data.GrainLoader(SOURCE, batch_size, process_count=1, process_index=0)


def array_loader(batch_size: int) -> px.data.ArrayLoader:
    return px.data.ArrayLoader((X, Y), batch_size, process_count=1, process_index=0)


@pytest.mark.parametrize(
    ("make", "name"), [(grain_loader, "GrainLoader"), (array_loader, "ArrayLoader")]
)
def test_another_batch_size_is_refused(make, name):
    run = make(4)
    run.load_state_dict({"epoch": 1, "position": 3})  # 12 examples read
    state = run.state_dict()
    assert state == {"epoch": 1, "position": 3, "batch_size": 4}
    resumed = make(8)
    with pytest.raises(ValueError) as refused:
        resumed.load_state_dict(state)
    assert str(refused.value) == (
        f"{name}'s batch_size=8 differs from the batch_size=4 its state was saved "
        "with (position 3 of epoch 1, in batches of 4): resumed, it would skip or "
        f"repeat examples of the epoch; build the {name} with batch_size=4 to "
        "continue the run, or start a new run without resume"
    )
    assert resumed.state_dict() == {"epoch": 0, "position": 0, "batch_size": 8}
    same = make(4)
    same.load_state_dict(state)
    assert same.state_dict() == state


def test_a_state_saved_before_the_batch_size_was_kept_loads():
    loader = grain_loader(8)
    loader.load_state_dict({"epoch": 2, "position": 1})
    assert loader.state_dict() == {"epoch": 2, "position": 1, "batch_size": 8}
    first = next(iter(loader))
    straight = grain_loader(8)
    for _ in range(2):
        list(straight)
    np.testing.assert_array_equal(first[0], list(straight)[1][0])
