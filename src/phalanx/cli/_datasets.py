"""``--dataset``'s data for ``phalanx train``, ``find-lr`` and ``plan``:
the bundled digits, MNIST files, an .npz, ArrayRecord splits (opened, read
from disk as the run goes) or a user's function, each split checked (ints
for labels, one class range, finite features) before anything starts."""

from pathlib import Path

import numpy as np

from ._args import UsageError
from ._model import is_reference, user_dataset


Split = tuple[np.ndarray, np.ndarray]


def load_dataset(spec: str, *, flatten: bool = True) -> tuple[Split, Split]:
    """``digits``, ``mnist:PATH``, ``npz:PATH`` or ``MODULE:FUNCTION`` as
    standardised float32 examples (one row each with `flatten`, else in
    their own shape) and int labels.

    Raises:
        UsageError: unknown dataset, unreadable file, bad arrays or labels.
    """
    from ..data import load_digits, load_mnist

    kind, _, path = spec.partition(":")
    if kind == "digits" and not path:
        train, test = load_digits()
    elif kind == "mnist" and path:
        try:
            train, test = load_mnist(path)
        except (OSError, ValueError) as error:
            raise UsageError(f"--dataset {spec}: {error}") from None
    elif kind == "npz" and path:
        train, test = _load_npz(spec, Path(path))
    elif kind == "records" and path:
        return _open_records(spec, Path(path), flatten)
    elif kind not in ("digits", "mnist", "npz", "records") and is_reference(spec):
        x_train, y_train, x_test, y_test = user_dataset(spec)
        train, test = (x_train, y_train), (x_test, y_test)
    else:
        raise UsageError(
            f"--dataset {spec!r} is not one of digits, mnist:PATH, npz:PATH, "
            "records:DIR, MODULE:FUNCTION"
        )
    return _check_split(spec, train, test, flatten)


def _open_records(spec: str, folder: Path, flatten: bool) -> tuple[Split, Split]:
    """The train and test splits of `folder` (`px.data.write_records`),
    opened, not read: features are read from disk as the run goes, as they
    were written (not standardised)."""
    from ..data import Records

    try:
        import grain  # noqa: F401 - only to say it is missing now

        train, test = Records(folder, "train"), Records(folder, "test")
    except ImportError:
        raise UsageError(
            f"--dataset {spec}: reading ArrayRecord files needs grain; install "
            "phalanx's grain extra: pip install 'phalanx[grain]'"
        ) from None
    except (OSError, ValueError) as error:
        raise UsageError(f"--dataset {spec}: {error}") from None
    if train.example_shape != test.example_shape:
        raise UsageError(
            f"--dataset {spec}: train's examples have shape {train.example_shape}, "
            f"test's {test.example_shape}; write both splits alike"
        )
    if flatten and len(train.example_shape) != 1:
        raise UsageError(
            f"--dataset {spec}: examples of shape {train.example_shape}; the "
            "built-in models take rows: write flat features, or pass --model "
            "MODULE:FACTORY"
        )
    for name, split in (("train", train), ("test", test)):
        if split.label_shape:  # per-token targets: not a classifier's labels
            raise UsageError(
                f"--dataset {spec}: {name}'s labels have shape "
                f"{list(split.label_shape)} per example; phalanx train fits a "
                "classifier, one int label per example: train on these from "
                "Python, with px.data.GrainLoader over px.data.Records(folder, "
                f"{name!r}).dataset()"
            )
    _check_classes(spec, {"train": train.labels, "test": test.labels})
    return (train, train.labels), (test, test.labels)  # pyright: ignore[reportReturnType]


def _load_npz(spec: str, path: Path) -> tuple[Split, Split]:
    try:
        # Our own file handle: np.load leaks its own when the file is corrupt.
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as npz:
            missing = [
                k for k in ("x_train", "y_train", "x_test", "y_test") if k not in npz
            ]
            if missing:
                raise UsageError(
                    f"--dataset {spec}: {path} has no {', '.join(missing)}; it needs "
                    f"x_train, y_train, x_test, y_test (it has {', '.join(npz.files)})"
                )
            arrays = [npz[k] for k in ("x_train", "y_train", "x_test", "y_test")]
    except OSError as error:
        raise UsageError(f"--dataset {spec}: cannot read {path} ({error})") from None
    except (ValueError, TypeError):  # TypeError: an .npy array, not an archive
        raise UsageError(
            f"--dataset {spec}: {path} is not an .npz archive of plain arrays "
            "(np.savez with x_train, y_train, x_test, y_test)"
        ) from None
    return (arrays[0], arrays[1]), (arrays[2], arrays[3])


def _check_classes(spec: str, labels: dict[str, np.ndarray]) -> None:
    """The labels of each split (the training split's first) must be class
    indices 0..C-1, C one more than the training split's largest."""
    first, *_ = labels
    classes = int(labels[first].max()) + 1
    for name, y in labels.items():
        if y.min() < 0:
            raise UsageError(
                f"--dataset {spec}: {name} has a label of {y.min()} (first at "
                f"example {int(np.argmax(y < 0))}); labels are class indices "
                "from 0: map them so, e.g. np.unique(y, return_inverse=True)[1]"
            )
        if y.max() >= classes:
            raise UsageError(
                f"--dataset {spec}: {name} has labels from {y.min()} to {y.max()}, "
                f"outside the classes 0..{classes - 1} seen in {first}"
            )


def _check_split(
    spec: str, train: Split, test: Split, flatten: bool
) -> tuple[Split, Split]:
    """Standardise features to float32 (flattened to rows with `flatten`);
    labels must be ints in one class range."""
    out = []
    for name, (x, y) in (("train", train), ("test", test)):
        if len(x) != len(y):
            raise UsageError(
                f"--dataset {spec}: x_{name} has {len(x)} rows but y_{name} has "
                f"{len(y)}; every example needs one label"
            )
        if len(x) == 0:
            raise UsageError(f"--dataset {spec}: x_{name} is empty")
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise UsageError(
                f"--dataset {spec}: y_{name} must be a 1-d array of integer class "
                f"labels, got {y.dtype} of shape {y.shape}"
            )
        if x.dtype.kind not in "biuf":
            raise UsageError(f"--dataset {spec}: x_{name} is not numeric ({x.dtype})")
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            row = int(np.argwhere(~np.isfinite(x.reshape(len(x), -1)))[0][0])
            raise UsageError(
                f"--dataset {spec}: x_{name} holds NaN or inf (first at row {row}); "
                "clean or impute the data"
            )
        if x.ndim < 2:
            raise UsageError(
                f"--dataset {spec}: x_{name} has shape {x.shape}; it needs one "
                "row per example, with that example's features after it"
            )
        out.append((x.astype(np.float32), y.astype(np.int32)))
    (x_train, y_train), (x_test, y_test) = out
    _check_classes(spec, {"y_train": y_train, "y_test": y_test})
    if x_train.shape[1:] != x_test.shape[1:]:
        raise UsageError(
            f"--dataset {spec}: x_train's examples have shape {x_train.shape[1:]} "
            f"but x_test's have {x_test.shape[1:]}"
        )
    # Standardise each feature with the training set's statistics.
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std = np.where(std > 0, std, 1.0).astype(np.float32)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    if flatten:
        x_train, x_test = (x.reshape(len(x), -1) for x in (x_train, x_test))
    return (x_train, y_train), (x_test, y_test)
