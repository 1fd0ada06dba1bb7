"""Labels of any fixed shape per example (issue 54, item 1): a language
model's per-token targets, shape ``(N, T)``, are written by
`write_records` and read back through `Records` and `GrainLoader` as they
were written; `Records` refuses labels of another shape than ``NAME.json``
says, and a record of another size than it describes, in one line naming
the file; a split written before labels had a shape reads as before."""

import json
import pathlib

import numpy as np
import pytest

import phalanx as px


AGAIN = (
    "write the split again with px.data.write_records(folder, 'train', chunks, "
    "overwrite=True)"
)
T = 5  # tokens an example


def _chunk(n: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` examples of `T` int32 tokens, the first ``start + i``; the targets
    are the tokens shifted by one, as a language model's."""
    tokens = (np.arange(start, start + n)[:, None] * 7 + np.arange(T + 1)) % 50
    tokens[:, 0] = np.arange(start, start + n)
    return tokens[:, :-1].astype(np.int32), tokens[:, 1:]


@pytest.fixture
def split(tmp_path) -> pathlib.Path:
    """Split ``train`` of 10 examples of `T` tokens, written in two chunks."""
    px.data.write_records(tmp_path, "train", [_chunk(6, 0), _chunk(4, 6)])
    return tmp_path


def test_per_token_labels_read_back_through_a_grain_loader(split):
    y = np.concatenate([_chunk(6, 0)[1], _chunk(4, 6)[1]])
    records = px.data.Records(split, "train")
    assert records.label_shape == (T,) and records.shape == (10, T)
    np.testing.assert_array_equal(records.labels, y)
    features, labels = records.dataset()[7]
    np.testing.assert_array_equal(labels, y[7])
    assert labels.dtype == np.int32 and features.dtype == np.int32
    loader = px.data.GrainLoader(records.dataset(), batch_size=4, seed=0)
    batches = list(loader)
    loader.close()
    assert [b[1].shape for b in batches] == [(4, T)] * 3
    for tokens, targets, weight in batches:
        real = weight == 1  # the last batch's 2 padding rows: weight 0
        np.testing.assert_array_equal(targets[real], y[tokens[real, 0]])
    assert sorted(i for b in batches for i in b[0][b[2] == 1, 0]) == list(range(10))


def test_labels_of_another_shape_than_described_are_refused(split):
    path = split / "train-labels.npy"
    np.save(path, np.zeros((10, T + 1), np.int32))
    with pytest.raises(ValueError) as raised:
        px.data.Records(split, "train")
    assert str(raised.value) == (
        f"{path} holds labels int32[10, 6], {split / 'train.json'} says 10 int "
        f"labels of shape [5]; {AGAIN}"
    )


def _describe(split: pathlib.Path, **changes) -> None:
    path = split / "train.json"
    meta = json.loads(path.read_text()) | changes
    path.write_text(json.dumps({k: v for k, v in meta.items() if v is not None}))


def test_a_record_of_another_size_than_described_is_refused(split):
    _describe(split, shape=[T - 1])
    dataset = px.data.Records(split, "train").dataset()
    with pytest.raises(ValueError) as raised:
        dataset[0]
    assert str(raised.value) == (
        f"{split / 'train.array_record'} holds a record of 40 bytes, "
        f"{split / 'train.json'} describes 36 (int32[4] features, int32[5] labels); "
        f"{AGAIN}"
    )


def test_a_split_written_before_labels_had_a_shape_reads_as_before(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    px.data.write_records(tmp_path, "train", [(x, np.array([3, 1, 4, 1]))])
    _describe(tmp_path, label_shape=None)  # NAME.json as it was written before
    records = px.data.Records(tmp_path, "train")
    features, label = records.dataset()[2]
    assert records.label_shape == () and type(label) is np.int32 and label == 4
    np.testing.assert_array_equal(features, x[2])
