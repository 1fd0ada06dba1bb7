"""MNIST from the four standard IDX files in a folder the user already has."""

import gzip
import os
import pathlib

import numpy as np

from .._typing import validates_own_arguments
from ._digits import Split


# (images, labels) file names of each split, as distributed by LeCun et al.
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# An IDX header: two zero bytes, the element type (0x08: unsigned byte), the
# number of dimensions, then each dimension as a big-endian uint32.
_UBYTE = 0x08
_FORMAT = (
    "an IDX file (magic 0x00000801 for labels, 0x00000803 for images, then "
    "big-endian uint32 sizes and uint8 data)"
)


@validates_own_arguments
def load_mnist(path: str | os.PathLike[str]) -> tuple[Split, Split]:
    """MNIST (or any data set in its format, e.g. Fashion-MNIST) from a folder.

    Reads ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` from `path`,
    each raw or gzipped (the same name plus ``.gz``). Nothing is downloaded.

    Args:
        path: the folder holding the four files.

    Returns:
        ``(x_train, y_train), (x_test, y_test)`` as in `load_digits`: images
        flattened to ``(n, rows · cols)`` (``(n, 784)`` for MNIST), float32 in
        [0, 1] (pixels divided by 255); labels int32, shape ``(n,)``.

    Raises:
        FileNotFoundError: `path` is not a folder, or a file is missing.
        ValueError: a file is not a valid IDX file of the expected kind
            (bad magic number, truncated, wrong size), or a split's images
            and labels differ in number.

    Example:
        <!-- skip: needs the MNIST files in ~/data/mnist -->
        ```python
        (x_train, y_train), (x_test, y_test) = px.data.load_mnist("~/data/mnist")
        x_train.shape  # (60000, 784)
        ```
    """
    folder = pathlib.Path(os.fspath(path)).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"path={os.fspath(path)!r} is not a folder; pass the folder holding "
            f"{', '.join(name for pair in _FILES.values() for name in pair)} "
            "(each raw or .gz)"
        )
    train, test = (_read_split(folder, *_FILES[split]) for split in ("train", "test"))
    return train, test


def _read_split(folder: pathlib.Path, images_name: str, labels_name: str) -> Split:
    images_file, labels_file = _find(folder, images_name), _find(folder, labels_name)
    images = _read_idx(images_file, ndim=3)
    labels = _read_idx(labels_file, ndim=1)
    if len(images) != len(labels):
        raise ValueError(
            f"{images_file} holds {len(images)} images but {labels_file} holds "
            f"{len(labels)} labels; the two files of a split must match (re-copy "
            "them from the same release)"
        )
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(255)
    return x, labels.astype(np.int32)


def _find(folder: pathlib.Path, name: str) -> pathlib.Path:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{folder / name} (or {name}.gz) not found; load_mnist needs the four "
        f"standard MNIST files in path={str(folder)!r}, each {_FORMAT}"
    )


def _read_idx(file: pathlib.Path, ndim: int) -> np.ndarray:
    """The uint8 array of an IDX file with `ndim` dimensions."""
    try:
        if file.suffix == ".gz":
            with gzip.open(file, "rb") as f:
                data = f.read()
        else:
            data = file.read_bytes()
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
        raise ValueError(
            f"{file} could not be decompressed ({error}); it should be a gzipped "
            f"{_FORMAT}. Re-download or re-copy it"
        ) from error
    kind = "labels" if ndim == 1 else "images"
    magic = _UBYTE << 8 | ndim
    header = 4 + 4 * ndim
    if len(data) < header or int.from_bytes(data[:4], "big") != magic:
        found = data[:4].hex() if len(data) >= 4 else f"{len(data)} bytes"
        raise ValueError(
            f"{file} does not start with the magic number 0x{magic:08x} of IDX "
            f"{kind} (found {found}); it should be {_FORMAT}"
        )
    shape = tuple(
        int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)
    )
    expected = header + int(np.prod(shape))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "longer than its header says"
        raise ValueError(
            f"{file} is {what}: its header gives shape {shape}, i.e. {expected} "
            f"bytes, but it has {len(data)}; it should be {_FORMAT}. Re-download "
            "or re-copy it"
        )
    return np.frombuffer(data, np.uint8, offset=header).reshape(shape)
