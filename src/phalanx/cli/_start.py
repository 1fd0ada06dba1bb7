"""``phalanx train`` and ``phalanx find-lr``: what is checked up front, the
data loaded and the devices started, before the run folder is made."""

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .._env import COORDINATOR, NUM_PROCESSES
from .._telemetry._compile_cache import use_compile_cache
from ._args import TrainArgs, UsageError
from ._folder import RUN_FILES
from ._model import is_reference, user_dataset


Split = tuple[np.ndarray, np.ndarray]


def checked_start(
    args: TrainArgs, files: tuple[str, ...] = RUN_FILES
) -> tuple[Split, Split, list, bool]:
    """The data loaded and checked, the run folder checked (for a command
    that writes `files` there), JAX's compilation cache chosen, then JAX
    started on the devices and the batch checked against them.

    Returns:
        The train and test splits, the devices, and whether 8 fake CPU
        devices were chosen by default.

    Raises:
        UsageError: any of them is refused.
    """
    train, test = load_dataset(args.dataset, flatten=not args.user_model)
    check_metrics(args, train[1])
    check_run_dir(args.run_dir, args.overwrite, args.resume, files=files)
    # Before anything compiles: JAX opens its cache at the first compile.
    use_compile_cache(args.compile_cache, args.no_compile_cache)
    devices, defaulted = select_devices(args.devices, args.distributed)
    check_batch_size(args.batch_size, len(devices), args.microbatches)
    return train, test, devices, defaulted


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


def check_metrics(args: TrainArgs, labels: np.ndarray) -> None:
    """Refuse a --metric of a classifier for labels of one class."""
    chosen = [name for name in args.metrics if name != "accuracy"]
    if chosen and labels.max() < 1:
        raise UsageError(
            f"--metric {chosen[0]} scores a classifier of two classes or more, but "
            f"every label of --dataset {args.dataset} is 0; drop --metric, or "
            "pass labels of two classes or more"
        )


def check_run_dir(
    run_dir: Path,
    overwrite: bool,
    resume: bool = False,
    *,
    files: tuple[str, ...] = RUN_FILES,
) -> None:
    """A run folder must be new or empty, unless --overwrite (which replaces
    the command's `files`); with --resume it must hold a checkpoint."""
    if resume:
        checkpoints = run_dir / "checkpoints"
        if not any(p.name.isdigit() for p in _children(checkpoints)):
            raise UsageError(
                f"--resume: no checkpoint in {checkpoints}; pass the --run-dir of "
                "an earlier run, or start without --resume"
            )
    elif run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir} exists and is not a folder")
    elif run_dir.is_dir() and any(run_dir.iterdir()) and not overwrite:
        raise UsageError(
            f"--run-dir {run_dir} exists and is not empty; choose a new folder or "
            "pass --overwrite (phalanx then replaces only its own files: "
            f"{', '.join(files)})"
        )
    _check_writable(run_dir)


def _check_writable(run_dir: Path) -> None:
    """Refuse a run folder that cannot be made or written to, leaving
    nothing behind: a file is made and removed in it, or in the nearest
    folder above it that exists."""
    folder = run_dir.absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"--run-dir {run_dir}: {folder} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise UsageError(
            f"--run-dir {run_dir}: cannot write in {folder} ({error.strerror}); "
            "choose a folder you can write to"
        ) from None


def _children(folder: Path) -> list[Path]:
    return list(folder.iterdir()) if folder.is_dir() else []


def select_devices(
    requested: int | None, distributed: bool = False
) -> tuple[list, bool]:
    """Start JAX with the requested devices (faking CPU devices on a CPU host).

    If JAX has already started in this process (a notebook, a test), the
    devices it has are used. A distributed run joins the other processes
    first and trains on every process's devices (the launcher chose how many
    each process fakes).

    Returns:
        The devices, and whether 8 fake CPU devices were chosen by default.
    """
    from ..distributed._fake_devices import fake_cpu_devices

    if distributed:
        if requested is not None:
            raise UsageError(
                "--devices chooses one process's devices; in a multi-process run "
                "every process's devices train (phalanx launch "
                "--devices-per-process M sets how many each fakes)"
            )
        from .. import distributed as dist

        try:
            dist.initialize()
        except (ValueError, RuntimeError) as error:
            raise UsageError(f"--distributed: {error}") from None
        import jax
        from jax.experimental import multihost_utils

        if jax.process_count() == 1 and not os.environ.get(NUM_PROCESSES):
            print(
                "phalanx: --distributed, but no multi-process run was found "
                f"({COORDINATOR} unset, no cluster detected); training in this "
                "process only",
                file=sys.stderr,
            )
        # Every process has checked its arguments before any writes files.
        multihost_utils.sync_global_devices("phalanx train: arguments checked")
        return jax.devices(), False

    try:
        fake_cpu_devices(requested or 8)
    except RuntimeError:
        pass
    import jax

    devices = jax.local_devices()
    if requested is not None and requested > len(devices):
        raise UsageError(
            f"--devices {requested} but this process has {len(devices)} "
            f"{devices[0].platform} device(s); pass at most {len(devices)}"
        )
    if devices[0].platform == "cpu" and requested is None:
        return devices[:8], True
    return devices[: requested or len(devices)], False


def check_batch_size(batch_size: int, devices: int, microbatches: int) -> None:
    """Refuse a global batch the processes cannot share equally; say once on
    stderr (process 0) when the trainer will pad each step with weight-0
    examples, as `fit` does any batch, since they cost compute for nothing.
    (JAX has started: `select_devices` ran.)"""
    import jax

    processes = jax.process_count()
    if batch_size % processes:
        lower, upper = _multiples_around(batch_size, processes)
        options = f"{lower} or {upper}" if lower else f"{upper}"
        raise UsageError(
            f"--batch-size {batch_size} is not divisible by the {processes} "
            f"processes, each of which takes an equal slice; use e.g. {options}"
        )
    multiple = devices * microbatches
    if batch_size % multiple and jax.process_index() == 0:
        lower, upper = _multiples_around(batch_size, multiple)
        print(
            f"phalanx: --batch-size {batch_size} is padded to {upper} examples "
            f"per step with weight-0 examples (no effect on the update), for "
            f"{devices} device(s) x {microbatches} microbatch(es); a multiple of "
            f"{multiple} wastes nothing (e.g. "
            + (f"{lower} or {upper})" if lower else f"{upper})"),
            file=sys.stderr,
        )


def _multiples_around(n: int, multiple: int) -> tuple[int, int]:
    """The multiples of `multiple` just below and just above `n`."""
    lower = n // multiple * multiple
    return lower, lower + multiple
