"""Labelled examples in ArrayRecord files, larger than memory: written in
chunks (`write_records`), read back one example at a time by random access
(`Records`), through `GrainLoader`.

A split ``NAME`` of a folder is three files: ``NAME.array_record`` (one
record per example: its features' bytes, then its int32 label),
``NAME.json`` (the features' shape and dtype, the count) and
``NAME-labels.npy`` (every label, 4 bytes an example: what a trainer reads
whole to count the classes). ArrayRecord reads with ``pread``, so what a
run reads lands in the page cache, not in its resident memory.
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, final

import numpy as np


def write_records(
    folder: str | Path, split: str, chunks: Iterable[tuple[np.ndarray, np.ndarray]]
) -> "Records":
    """Write `chunks` of ``(x, y)`` (features with a leading examples axis,
    int labels) as the split `split` of `folder`, one chunk in memory at a
    time; the split, opened.

    Raises:
        ValueError: chunks disagree on the features' shape or dtype, or
            labels are not ints, one per example.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    labels, spec = [], None
    writer = ArrayRecordWriter(
        str(folder / f"{split}.array_record"), "group_size:1,uncompressed"
    )
    try:
        for x, y in chunks:
            x, y = np.ascontiguousarray(x), np.asarray(y)
            this = (x.shape[1:], x.dtype)
            if spec is not None and this != spec:
                raise ValueError(
                    f"a chunk of features {x.dtype}{list(x.shape[1:])} after "
                    f"{spec[1]}{list(spec[0])}: every example needs one shape and dtype"
                )
            if y.dtype.kind not in "iu" or y.shape != x.shape[:1]:
                raise ValueError(
                    f"labels {y.dtype}{list(y.shape)} for {len(x)} examples: pass "
                    "one int label per example"
                )
            spec = this
            for row, label in zip(x, y.astype(np.int32), strict=True):
                writer.write(row.tobytes() + label.tobytes())
            labels.append(y.astype(np.int32))
    finally:
        writer.close()
    if spec is None:
        raise ValueError(f"no chunks to write as {split!r}; pass at least one")
    np.save(folder / f"{split}-labels.npy", np.concatenate(labels))
    meta = {
        "shape": list(spec[0]),
        "dtype": spec[1].str,
        "count": sum(map(len, labels)),
    }
    (folder / f"{split}.json").write_text(json.dumps(meta) + "\n")
    return Records(folder, split)


@final
class Decode:
    """A record's bytes as ``(features, label)`` (picklable: grain's
    workers run it)."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape, self.dtype = shape, dtype

    def __call__(self, record: bytes) -> tuple[np.ndarray, np.int32]:
        features = np.frombuffer(record[:-4], self.dtype).reshape(self.shape)
        return features, np.frombuffer(record[-4:], np.int32)[0]


@final
class Records:
    """A split written by `write_records`: its shape, labels, and its
    examples as a `grain.MapDataset` of ``(features, label)``.

    Only the labels are read whole; features are read when indexed (``[i]``
    or a slice, for a first batch) or by the dataset.
    """

    def __init__(self, folder: str | Path, split: str):
        """
        Raises:
            FileNotFoundError: the split's files are not in `folder`.
            ValueError: they do not agree.
        """
        folder = Path(folder)
        self.path = folder / f"{split}.array_record"
        files = [self.path, folder / f"{split}.json", folder / f"{split}-labels.npy"]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(
                f"split {split!r} of {folder} lacks {', '.join(missing)}; write "
                "it with px.data.write_records"
            )
        meta = json.loads(files[1].read_text())
        self.labels = np.load(files[2])
        self.example_shape = tuple(meta["shape"])
        self.dtype = np.dtype(meta["dtype"])
        if len(self.labels) != meta["count"]:
            raise ValueError(
                f"{files[2]} holds {len(self.labels)} labels for {meta['count']} "
                f"examples in {self.path}; write the split again"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """``(examples, *features' shape)``, as an array's."""
        return (len(self.labels), *self.example_shape)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int | slice) -> np.ndarray:
        """Features of example `index`, or of a slice's examples, stacked."""
        dataset = self.dataset()
        if isinstance(index, slice):
            rows = range(*index.indices(len(self)))
            return np.stack([dataset[i][0] for i in rows])
        return dataset[index][0]

    def dataset(self) -> Any:
        """The examples as a `grain.MapDataset` of ``(features, label)``."""
        import grain

        source = grain.sources.ArrayRecordDataSource(str(self.path))
        # ArrayRecordDataSource is random access; its annotations do not
        # match grain's protocol for one (record_key: SupportsIndex).
        return grain.MapDataset.source(source).map(  # pyright: ignore[reportArgumentType]
            Decode(self.example_shape, self.dtype)
        )
