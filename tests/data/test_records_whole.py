"""A split is written whole or not at all, and read only when its files
agree (issue 54, item 1): a write refused mid-way leaves an existing split
bitwise as it was and no temporaries; writing over a split needs
``overwrite=True``; `Records` refuses, in one line naming the file, records
or labels that are not as many as ``NAME.json`` says, a truncated file and a
corrupt description."""

import json
import pathlib
import re

import numpy as np
import pytest

import phalanx as px


AGAIN = (
    "write the split again with px.data.write_records(folder, 'train', chunks, "
    "overwrite=True)"
)
INT_LABELS = (
    "pass int labels, one per example (shape (5,)) or an array of one shape per "
    "example (e.g. (5, T) per-token targets)"
)


def _chunk(n: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`n` examples of 3 float32 features, the first ``start + i``."""
    x = np.zeros((n, 3), np.float32)
    x[:, 0] = np.arange(start, start + n)
    return x, np.arange(start, start + n, dtype=np.int32) % 4


def _snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    """Every file of `folder`, by name: its bytes."""
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _rows(folder: pathlib.Path) -> list[tuple[list[float], int]]:
    """Every example of split ``train``, read back through `Records`."""
    dataset = px.data.Records(folder, "train").dataset()
    return [(x.tolist(), int(y)) for x, y in (dataset[i] for i in range(len(dataset)))]


@pytest.fixture
def split(tmp_path) -> pathlib.Path:
    """A folder holding split ``train`` of 10 examples."""
    px.data.write_records(tmp_path, "train", [_chunk(6), _chunk(4, 6)])
    return tmp_path


def test_a_split_reads_back_as_written(split):
    records = px.data.Records(split, "train")
    assert records.shape == (10, 3) and records.labels.tolist() == [
        i % 4 for i in range(10)
    ]
    assert [x[0] for x, _ in _rows(split)] == list(range(10))
    assert sorted(p.name for p in split.iterdir()) == [
        "train-labels.npy",
        "train.array_record",
        "train.json",
    ]


def _chunks_then(bad: tuple[np.ndarray, np.ndarray]):
    """A good chunk of 5 examples, then `bad`."""
    yield _chunk(5, 100)
    yield bad


def _broken():
    yield _chunk(5, 100)
    raise OSError("the source went away")


@pytest.mark.parametrize(
    "chunks, error, message",
    [
        (
            lambda: _chunks_then((np.zeros((5, 2), np.float32), np.zeros(5, np.int32))),
            ValueError,
            "a chunk of features float32[2] after float32[3]: every example needs "
            "one shape and dtype",
        ),
        (
            lambda: _chunks_then((np.zeros((5, 3), np.float32), np.zeros(4, np.int32))),
            ValueError,
            f"labels int32[4] for 5 examples: {INT_LABELS}",
        ),
        (
            lambda: _chunks_then(
                (np.zeros((5, 3), np.float32), np.zeros(5, np.float32))
            ),
            ValueError,
            f"labels float32[5] for 5 examples: {INT_LABELS}",
        ),
        (
            lambda: _chunks_then((np.zeros((5, 3), np.float32), np.zeros((5, 2), int))),
            ValueError,
            "a chunk of labels [2] per example after []: every example's labels "
            "need one shape; pad or cut them to one length",
        ),
        (
            lambda: _chunks_then((np.zeros((5, 3), np.float32), np.full(5, 2**31))),
            ValueError,
            "labels int64[5] hold 2147483648, outside int32 (they are stored as "
            "int32); pass labels in [-2147483648, 2147483647]",
        ),
        (_broken, OSError, "the source went away"),
    ],
    ids=[
        "shape",
        "label-count",
        "float-labels",
        "label-shape",
        "int32",
        "source-error",
    ],
)
def test_a_refused_overwrite_leaves_the_split_as_it_was(split, chunks, error, message):
    files, rows = _snapshot(split), _rows(split)
    with pytest.raises(error) as raised:
        px.data.write_records(split, "train", chunks(), overwrite=True)
    assert str(raised.value) == message
    assert _snapshot(split) == files  # bitwise, and no temporaries left
    assert _rows(split) == rows


def test_a_refused_first_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match=re.escape(INT_LABELS)):
        px.data.write_records(
            tmp_path, "train", _chunks_then((np.zeros((5, 3), np.float32), np.zeros(5)))
        )
    assert list(tmp_path.iterdir()) == []


def test_writing_over_a_split_needs_overwrite(split):
    files, started = _snapshot(split), []

    def chunks():
        started.append(True)
        yield _chunk(3)

    with pytest.raises(FileExistsError) as raised:
        px.data.write_records(split, "train", chunks())
    assert str(raised.value) == (
        f"{split / 'train.array_record'} exists: split 'train' is already in "
        f"{split}; pass overwrite=True to replace it, or write another split name"
    )
    assert started == [] and _snapshot(split) == files
    # Another name is a new split beside it.
    assert len(px.data.write_records(split, "more", chunks())) == 3


def test_overwrite_replaces_the_split(split):
    records = px.data.write_records(split, "train", [_chunk(3, 50)], overwrite=True)
    assert len(records) == 3 and [x[0] for x, _ in _rows(split)] == [50, 51, 52]
    assert len(list(split.iterdir())) == 3


def _says(split: pathlib.Path, **changes) -> None:
    """Rewrite split ``train``'s description with `changes`."""
    path = split / "train.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _refused(split: pathlib.Path) -> str:
    with pytest.raises(ValueError) as raised:
        px.data.Records(split, "train")
    assert "\n" not in str(raised.value)
    return str(raised.value)


def test_fewer_records_than_described_are_refused(split):
    _says(split, count=40)
    np.save(split / "train-labels.npy", np.zeros(40, np.int32))
    assert _refused(split) == (
        f"{split / 'train.array_record'} holds 10 records, {split / 'train.json'} "
        f"says 40; {AGAIN}"
    )


def test_fewer_labels_than_described_are_refused(split):
    _says(split, count=40)
    assert _refused(split) == (
        f"{split / 'train-labels.npy'} holds labels int32[10], "
        f"{split / 'train.json'} says 40 int labels; {AGAIN}"
    )


def test_a_truncated_file_is_refused(split):
    path = split / "train.array_record"
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    assert _refused(split) == (
        f"{path} is unreadable (truncated, or not an ArrayRecord file), expected "
        f"10 records; {AGAIN}"
    )
    path.write_bytes(whole[:-1])  # ArrayRecord says why, in its words
    line = _refused(split)
    assert line.startswith(f"{path} is unreadable (") and line.endswith(
        f"), expected 10 records; {AGAIN}"
    )


def test_a_corrupt_description_is_refused(split):
    path = split / "train.json"
    path.write_text('{"shape": [3], "dtype": "<f4", "cou')
    assert _refused(split) == (
        f"{path} is not a split's description (JSONDecodeError: Unterminated string "
        "starting at: line 1 column 32 (char 31)), expected JSON with shape, dtype "
        f"and count; {AGAIN}"
    )
    path.write_text('{"shape": [3], "dtype": "<f4"}')
    assert _refused(split) == (
        f"{path} is not a split's description (KeyError: 'count'), expected JSON "
        f"with shape, dtype and count; {AGAIN}"
    )


def test_corrupt_labels_are_refused(split):
    path = split / "train-labels.npy"
    path.write_bytes(b"not labels")
    line = _refused(split)
    assert line.startswith(f"{path} is unreadable (") and line.endswith(
        f"), expected 10 int labels; {AGAIN}"
    )
