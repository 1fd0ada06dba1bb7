"""`px.callbacks.Profiler`: a `jax.profiler` trace of a range of training
steps, for TensorBoard's profile plugin and Perfetto.

It waits for the device only at the range's two ends (so the trace holds
exactly its steps), traces on every process (each its own devices), and
changes nothing of the run.
"""

import os
import pathlib
import warnings
from collections.abc import Sequence
from typing import Literal

import jax
from typing_extensions import override

from .._typing import validates_own_arguments
from .._validate import is_int
from ._base import Callback, StepInfo
from ._files import check_file_path


class Profiler(Callback):
    """Records a `jax.profiler` trace of a range of training steps.

    The trace covers steps ``start`` to ``end``, both included, counted as
    `StepInfo.step` counts them: step 1 is the run's first update, and a
    resumed run goes on counting. The default ``(10, 20)`` skips the first
    steps' compilation, as Keras' ``profile_batch`` does. Steps run
    asynchronously, so the host waits for the device twice: before the
    trace begins (the steps before ``start`` stay out of it) and before it
    ends (the device work of step ``end`` is in it). An evaluation at an
    epoch end inside the range is traced too.

    With ``steps_per_call > 1`` steps finish a compiled call at a time, and
    the trace covers whole calls: it begins at the end of the call before
    the one that may make step ``start`` (calls make ``steps_per_call``
    steps, fewer at a pass's end) and ends with the call that makes step
    ``end``. A range in a fit's first call (e.g. ``steps=(2, 3)`` under
    ``steps_per_call=4``) is traced from the fit's start, that call's
    compilation included.

    A fit that ends or raises inside the range still writes its trace (of
    the steps made); a run resumed inside the range is traced from its
    first step (compilation included); each fit that makes steps of the
    range writes a trace of its own. JAX records one trace at a time per
    process: if another is running (a second `Profiler`, or
    `jax.profiler.trace` around the fit), this one warns and records none.
    In a multi-process run every process traces its own devices, into
    ``logdir/process_<i>``.

    Each trace is a folder ``<logdir>/plugins/profile/<date_time>/`` holding
    ``<host>.xplane.pb`` (for TensorBoard's profile plugin),
    ``<host>.trace.json.gz`` and ``perfetto_trace.json.gz`` (for Perfetto).

    Example:
        ```python
        profiler = px.callbacks.Profiler("runs/profile", steps=(10, 20))
        trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[profiler])
        trainer.fit(data, epochs=1)
        # pip install tensorboard tensorboard-plugin-profile
        # tensorboard --logdir runs/profile   (the "Profile" tab)
        # or open runs/profile/plugins/profile/*/perfetto_trace.json.gz
        # at https://ui.perfetto.dev
        ```
    """

    main_process_only = False  # each process traces its own devices

    @validates_own_arguments
    def __init__(
        self, logdir: str | os.PathLike[str], *, steps: tuple[int, int] = (10, 20)
    ):
        """
        Args:
            logdir: the folder the traces are written under; created (with the
                folders above it) when the first trace is written.
            steps: ``(start, end)``, the first and last step traced (both
                included, ``1 <= start <= end``; ``(n, n)`` traces step n).

        Raises:
            TypeError: `logdir` is not a str or path, or `steps` is not a
                pair of ints.
            ValueError: `steps` is not ``1 <= start <= end``.
            NotADirectoryError, PermissionError: `logdir` cannot be written.
        """
        self.logdir = check_file_path(logdir, "logdir", directory=True)
        self.start, self.end = _step_range(steps)
        # This fit's trace: not begun, running, or over (or refused).
        self._trace: Literal["waiting", "tracing", "done"] = "waiting"
        # The most steps one compiled call of this fit makes.
        self._widest = 1

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._trace, self._widest = "waiting", info.steps_per_call
        # The first call makes steps info.step + 1 to info.step + widest at
        # most (or a resumed run is inside the range already).
        if info.step < self.end and self.start <= info.step + self._widest:
            self._start(info)

    @override
    def on_step_end(self, info: StepInfo) -> None:
        if not info.last_in_call:
            return
        if self._trace == "tracing" and info.step >= self.end:
            self._stop(info)
        # The next call makes steps info.step + 1 to info.step + widest at most.
        elif self._trace == "waiting" and info.step < self.end:
            if self.start <= info.step + self._widest:
                self._start(info)

    @override
    def on_fit_end(self, info: StepInfo) -> None:
        if self._trace == "tracing":
            self._stop(info)

    @override
    def on_exception(self, info: StepInfo, error: BaseException) -> None:
        del info, error
        # No wait for the device: a failed step may never finish cleanly,
        # and the trace holds what did run.
        if self._trace == "tracing":
            self._stop(None)

    # ----------------------------------------------------------- internals

    def _folder(self) -> pathlib.Path:
        """Where this process writes: `logdir`, or with several processes
        its own subfolder (the trace files are named after the host, which
        processes on one machine share)."""
        if jax.process_count() == 1:
            return self.logdir
        return self.logdir / f"process_{jax.process_index()}"

    def _start(self, info: StepInfo) -> None:
        """Begin the trace, once the device has finished the steps
        dispatched so far."""
        self._trace = "done"  # tried once a fit, even if refused
        jax.block_until_ready(info.state)
        try:
            jax.profiler.start_trace(self._folder(), create_perfetto_trace=True)
        except RuntimeError as error:  # another trace is running in this process
            warnings.warn(
                f"Profiler(logdir={str(self.logdir)!r}, steps=({self.start}, "
                f"{self.end})) records no trace: {error} Stop the other trace "
                "(another Profiler, or jax.profiler.trace around fit) or drop "
                "this callback.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self._trace = "tracing"

    def _stop(self, info: StepInfo | None) -> None:
        """End the trace and write it; with `info`, after the device has
        finished the steps dispatched so far."""
        self._trace = "done"
        try:
            if info is not None:
                jax.block_until_ready(info.state)
        finally:  # the process's one trace must not stay open
            jax.profiler.stop_trace()


def _step_range(steps: object) -> tuple[int, int]:
    """`steps` as ``(start, end)``, if it is a pair of ints with
    ``1 <= start <= end``."""
    fix = "e.g. steps=(10, 20) to trace steps 10 to 20, both included"
    if (
        not isinstance(steps, Sequence)
        or isinstance(steps, str)
        or len(steps) != 2
        or not all(is_int(step) for step in steps)
    ):
        raise TypeError(f"steps={steps!r} must be a pair of ints (start, end); {fix}")
    start, end = steps
    if not 1 <= start <= end:
        raise ValueError(
            f"steps={steps!r} must have 1 <= start <= end (step 1 is the first "
            f"update; (n, n) traces step n alone); {fix}"
        )
    return start, end
