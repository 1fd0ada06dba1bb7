"""``phalanx train`` and ``phalanx find-lr``: what is checked up front, the
data loaded (`_datasets.py`) and the devices started, before the run folder
is made."""

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from .._env import COORDINATOR, NUM_PROCESSES
from .._telemetry._compile_cache import use_compile_cache
from ._args import TrainArgs, UsageError
from ._datasets import Split, load_dataset
from ._folder import RUN_FILES


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
