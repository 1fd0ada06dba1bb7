"""Labelled examples in ArrayRecord files, larger than memory: written in
chunks (`write_records`), read back one example at a time by random access
(`Records`), through `GrainLoader`.

A split ``NAME`` of a folder is three files: ``NAME.array_record`` (one
record per example: its features' bytes, then its int32 labels' bytes),
``NAME.json`` (the features' shape and dtype, the labels' shape per
example, the count) and ``NAME-labels.npy`` (every label as int32: what a
trainer reads whole to count the classes). An example's labels are one int
(a class) or an array of ints of one shape for every example (per-token
targets). ArrayRecord reads with ``pread``, so what a
run reads lands in the page cache, not in its resident memory.

A split is written whole or not at all: every file goes under a temporary
name beside its own and is renamed into place once every chunk is checked
and written, ``NAME.json`` last. `Records` checks the three agree before
the first read.
"""

import json
import math
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, final

import numpy as np


def _files(folder: Path, split: str) -> tuple[Path, Path, Path]:
    """The split's records, labels and description, in the order they are
    renamed into place (the description last)."""
    return (
        folder / f"{split}.array_record",
        folder / f"{split}-labels.npy",
        folder / f"{split}.json",
    )


def _again(split: str) -> str:
    """The fix for a split whose files do not agree."""
    return (
        f"write the split again with px.data.write_records(folder, {split!r}, "
        "chunks, overwrite=True)"
    )


def _sync(path: Path) -> None:
    """Flush `path` (a file, or a folder's renames) to disk, so that a
    rename never lands before the bytes it names."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _int32_labels(
    y: np.ndarray, examples: int, label_shape: tuple[int, ...] | None
) -> np.ndarray:
    """A chunk's labels `y` for its `examples` as int32, checked: ints, the
    examples' axis first, each example's of `label_shape` (the earlier
    chunks'; None for the first chunk), within int32."""
    if y.dtype.kind not in "iu" or y.shape[:1] != (examples,):
        raise ValueError(
            f"labels {y.dtype}{list(y.shape)} for {examples} examples: pass int "
            f"labels, one per example (shape ({examples},)) or an array of one "
            f"shape per example (e.g. ({examples}, T) per-token targets)"
        )
    if label_shape is not None and y.shape[1:] != label_shape:
        raise ValueError(
            f"a chunk of labels {list(y.shape[1:])} per example after "
            f"{list(label_shape)}: every example's labels need one shape; pad or "
            "cut them to one length"
        )
    if y.size and not np.can_cast(y.dtype, np.int32):
        info = np.iinfo(np.int32)
        outside = y[(y < info.min) | (y > info.max)]
        if outside.size:
            raise ValueError(
                f"labels {y.dtype}{list(y.shape)} hold {outside[0]}, outside int32 "
                f"(they are stored as int32); pass labels in [{info.min}, "
                f"{info.max}]"
            )
    return y.astype(np.int32)


def write_records(
    folder: str | Path,
    split: str,
    chunks: Iterable[tuple[np.ndarray, np.ndarray]],
    *,
    overwrite: bool = False,
) -> "Records":
    """Write `chunks` of ``(x, y)`` as the split `split` of `folder`, one
    chunk in memory at a time; the split, opened.

    ``x`` is the chunk's features and ``y`` its int labels, both with the
    examples' axis first: ``y`` of shape ``(n,)`` holds one label per
    example (a class), ``(n, T)`` (or any fixed shape after ``n``) an array
    of labels per example, such as a language model's per-token targets.
    Every chunk's examples have one features' shape and dtype, and one
    labels' shape. Labels are stored as int32.

    Whole or not at all: the files are written under temporary names in
    `folder` and renamed into place (``NAME.json`` last) only once every
    chunk has been checked and written. A refused chunk, or an error from
    `chunks` itself, removes the temporaries and leaves `folder` as it was.

    Args:
        folder: where the split's files go (made if missing).
        split: the split's name, ``NAME`` of its files.
        chunks: ``(x, y)`` pairs of arrays, read one at a time.
        overwrite: replace a split of this name already in `folder`.

    Raises:
        FileExistsError: `folder` holds the split and `overwrite` is False
            (raised before anything is written).
        ValueError: chunks disagree on the features' shape or dtype or on
            the labels' shape, labels are not ints with the examples' axis
            first or do not fit in int32, or there are no chunks.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    folder = Path(folder)
    paths = _files(folder, split)
    existing = [path for path in paths if path.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{existing[0]} exists: split {split!r} is already in {folder}; pass "
            "overwrite=True to replace it, or write another split name"
        )
    folder.mkdir(parents=True, exist_ok=True)
    temporaries: list[Path] = []
    try:
        for path in paths:
            # A fresh name beside the file, made with the umask's mode (as the
            # file itself would be; mkstemp's are the owner's alone).
            temporary = folder / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"
            temporary.touch(exist_ok=False)
            temporaries.append(temporary)
        records, labels_file, description = temporaries
        labels, spec, label_shape = [], None, None
        writer = ArrayRecordWriter(str(records), "group_size:1,uncompressed")
        try:
            for x, y in chunks:
                x, y = np.ascontiguousarray(x), np.asarray(y)
                this = (x.shape[1:], x.dtype)
                if spec is not None and this != spec:
                    raise ValueError(
                        f"a chunk of features {x.dtype}{list(x.shape[1:])} after "
                        f"{spec[1]}{list(spec[0])}: every example needs one shape "
                        "and dtype"
                    )
                y = _int32_labels(y, len(x), label_shape)
                spec, label_shape = this, y.shape[1:]
                for row, label in zip(x, y, strict=True):
                    writer.write(row.tobytes() + label.tobytes())
                labels.append(y)
        finally:
            writer.close()
        if spec is None:
            raise ValueError(f"no chunks to write as {split!r}; pass at least one")
        with open(labels_file, "wb") as file:
            np.save(file, np.concatenate(labels))
        meta = {
            "shape": list(spec[0]),
            "dtype": spec[1].str,
            "label_shape": list(label_shape or ()),
            "count": sum(map(len, labels)),
        }
        description.write_text(json.dumps(meta) + "\n")
        for path in temporaries:
            _sync(path)
    except BaseException:
        for path in temporaries:
            path.unlink(missing_ok=True)
        raise
    # The old description goes first: until the new one lands, a reader
    # finds the split missing, never old labels beside new records.
    paths[-1].unlink(missing_ok=True)
    for temporary, path in zip(temporaries, paths, strict=True):
        os.replace(temporary, path)
    try:
        _sync(folder)
    except OSError:  # a filesystem that cannot sync a folder keeps renames its way
        pass
    return Records(folder, split)


def _describe(
    path: Path, split: str
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], int]:
    """The features' shape and dtype, the labels' shape per example and the
    count that `path` (a split's ``NAME.json``) describes (a split written
    before labels had a shape has scalar labels)."""
    try:
        meta = json.loads(path.read_text())
        shape, label_shape = tuple(meta["shape"]), tuple(meta.get("label_shape", ()))
        dtype, count = np.dtype(meta["dtype"]), meta["count"]
        sizes = (*shape, *label_shape, count)
        if not all(type(n) is int and n >= 0 for n in sizes):
            raise ValueError(
                f"shape {meta['shape']}, label_shape {list(label_shape)}, "
                f"count {count!r}"
            )
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not a split's description ({type(error).__name__}: "
            f"{' '.join(str(error).split())}), expected JSON with shape, dtype "
            f"and count; {_again(split)}"
        ) from None
    return shape, dtype, label_shape, count


def _count(path: Path, split: str, count: int) -> int:
    """The number of records in `path`, read from its index by ArrayRecord's
    own reader."""
    from array_record.python.array_record_module import ArrayRecordReader

    found, reason = None, "truncated, or not an ArrayRecord file"
    try:
        reader = ArrayRecordReader(str(path))
        found = reader.num_records() if reader.ok() else None
        reader.close()  # raises the reader's failure, if it had one
    except (RuntimeError, OSError) as error:
        found, reason = None, " ".join(str(error).split()) or reason
    if found is None:
        raise ValueError(
            f"{path} is unreadable ({reason}), expected {count} records; "
            f"{_again(split)}"
        )
    return found


@final
class Records:
    """A split written by `write_records`: its shape, labels, and its
    examples as a `grain.MapDataset` of ``(features, labels)``.

    ``labels`` holds every example's labels, shape ``(examples,
    *label_shape)``: one int per example where ``label_shape`` is ``()``.

    Only the labels are read whole; features are read when indexed (``[i]``
    or a slice, for a first batch) or by the dataset.
    """

    def __init__(self, folder: str | Path, split: str):
        """Open the split `split` of `folder`, checking before any read that
        its records, labels and description agree.

        Raises:
            FileNotFoundError: the split's files are not in `folder`.
            ValueError: a file is unreadable (truncated, corrupt), or the
                records or labels are not as many as ``NAME.json`` says.
        """
        folder = Path(folder)
        self.path, labels, description = _files(folder, split)
        files = [self.path, description, labels]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(
                f"split {split!r} of {folder} lacks {', '.join(missing)}; write "
                "it with px.data.write_records"
            )
        self.example_shape, self.dtype, self.label_shape, count = _describe(
            description, split
        )
        said = f"{count} int labels" + (
            f" of shape {list(self.label_shape)}" if self.label_shape else ""
        )
        try:
            self.labels = np.load(labels)
        except (ValueError, OSError, EOFError) as error:
            raise ValueError(
                f"{labels} is unreadable ({' '.join(str(error).split())}), "
                f"expected {said}; {_again(split)}"
            ) from None
        expected = (count, *self.label_shape)
        if self.labels.dtype.kind not in "iu" or self.labels.shape != expected:
            raise ValueError(
                f"{labels} holds labels {self.labels.dtype}{list(self.labels.shape)}"
                f", {description} says {said}; {_again(split)}"
            )
        found = _count(self.path, split, count)
        if found != count:
            raise ValueError(
                f"{self.path} holds {found} records, {description} says "
                f"{count}; {_again(split)}"
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
        """The examples as a `grain.MapDataset` of ``(features, labels)``."""
        import grain

        source = grain.sources.ArrayRecordDataSource(str(self.path))
        # ArrayRecordDataSource is random access; its annotations do not
        # match grain's protocol for one (record_key: SupportsIndex).
        return grain.MapDataset.source(source).map(  # pyright: ignore[reportArgumentType]
            Decode(self)
        )


@final
class Decode:
    """A record's bytes as ``(features, labels)``, the labels an int32
    scalar or an array of the split's label shape (picklable: grain's
    workers run it)."""

    def __init__(self, records: Records):
        self.shape, self.dtype = records.example_shape, records.dtype
        self.label_shape, self.path = records.label_shape, records.path
        self._cut = math.prod(self.shape) * self.dtype.itemsize
        self._size = self._cut + 4 * math.prod(self.label_shape)

    def __call__(self, record: bytes) -> tuple[np.ndarray, Any]:
        if len(record) != self._size:
            description = self.path.with_suffix(".json")
            raise ValueError(
                f"{self.path} holds a record of {len(record)} bytes, {description} "
                f"describes {self._size} ({self.dtype}{list(self.shape)} features, "
                f"int32{list(self.label_shape)} labels); "
                f"{_again(self.path.stem)}"
            )
        features = np.frombuffer(record, self.dtype, math.prod(self.shape))
        labels = np.frombuffer(record, np.int32, offset=self._cut)
        return features.reshape(self.shape), labels.reshape(self.label_shape)[()]
