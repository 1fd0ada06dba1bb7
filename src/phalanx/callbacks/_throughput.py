"""`px.callbacks.Throughput`: examples, steps and FLOPs per second and model
FLOPs utilisation added to the metrics, measured by telemetry's
`RateMeter` and `flops_rates` (`_telemetry/_rates.py`).

Rates are measured on the host between points where the device has caught
up (a read of the step's metrics), never by timing a dispatch; the FLOPs
per step are the trainer's count (`flops_per_step`), the peak the device
table's (`_telemetry/_peak_flops.py`) or the user's. It declares the metrics it adds
(`added_metrics`) and changes nothing else of the run.
"""

import time

import jax
import numpy as np
from typing_extensions import override

from .._log import logger
from .._telemetry._peak_flops import peak_flops as table_peak
from .._telemetry._rates import RateMeter, check_peak, flops_rates, warn_mfu_over_one
from .._typing import HostMetrics, validates_own_arguments
from .._validate import finite_at_least, positive_int
from ._base import Callback, StepInfo


# Where `Throughput` says that it has no peak for the device (a program that
# says so itself, as ``phalanx train`` does, quiets this logger).
NOTE = logger.getChild("throughput")


class Throughput(Callback):
    """Adds ``examples_per_sec``, ``steps_per_sec``, ``tflops_per_sec`` and,
    where the device's peak is known, ``mfu`` to the metrics.

    Every `log_every` steps it reads the step's metrics, which waits for the
    device, so the figures are the device's real pace over the steps since the
    previous log point (the first window of a run includes compilation). At
    each epoch's end it adds the same two figures over the whole epoch, from
    its first step to its end: evaluations, if any, are included (those of
    ``fit(eval_every=)`` are left out of the log points' figures). The epoch
    figures land in `trainer.history`.

    ``tflops_per_sec`` is the train step's FLOPs (`flops_per_step`: its
    matrix multiplies and convolutions, forward and backward, counted on the
    step's program, no input needed) times steps per second, over all
    devices. ``mfu`` (model FLOPs utilisation) is that over the devices'
    peak: `peak_flops` times the number of devices. The count is the step's
    own, not the ``6·params·tokens`` convention: it is exact for any model
    (attention's quadratic term, convolutions, embeddings that are lookups,
    a first layer with no input gradient), it includes work that the
    program repeats (activation recomputation under remat), and it leaves
    elementwise work out, as the convention and the matrix units' peaks do.
    Without `peak_flops`, the peak is looked up by the device
    (``jax.devices()[0].device_kind``: NVIDIA A100, H100, H200, B200, TPU
    v4, v5e, v5p, v6e; bf16/fp16 or fp32 by the trainer's precision); on
    any other device (a CPU) there is no ``mfu``, said once.

    It adds metrics, so it runs before the loggers (which declare they add
    none) wherever it is listed in ``callbacks=``.

    Args:
        log_every: steps between log points (each one a device sync).
        peak_flops: one device's peak FLOP/s, for ``mfu`` (e.g. ``989e12``
            for an H100's dense bf16, not ``989``: values under 1e9 are
            refused); None: from the device table. An ``mfu`` over 1 (a peak
            too low) is warned of once.
        quiet: no log line saying there is no ``mfu`` where the peak is
            unknown (where the caller says it itself).

    Raises:
        ValueError: `log_every` is not a positive int, or `peak_flops` not
            a number of at least 1e9 (FLOP/s).

    Example:
        ```python
        trainer = px.DataParallelTrainer(
            model, optax.adam(1e-3), callbacks=[Throughput(log_every=50), logger]
        )
        trainer.fit(data, epochs=3)
        trainer.history["examples_per_sec"]  # one figure per epoch
        ```
    """

    @validates_own_arguments
    def __init__(
        self,
        *,
        log_every: int = 10,
        peak_flops: float | None = None,
        quiet: bool = False,
    ) -> None:
        self.log_every = positive_int("log_every", log_every, example="log_every=10")
        self.peak_flops = None
        if peak_flops is not None:
            fix = "pass one device's FLOP/s, e.g. peak_flops=989e12, or None"
            value = finite_at_least("peak_flops", peak_flops, 0.0, hint=fix)
            self.peak_flops = check_peak(value, peak_flops)
        self._window = RateMeter()
        self._epoch = RateMeter()
        self._peak: float | None = None  # this fit's, per device
        self._said = quiet  # that there is no mfu
        self._warned = False  # of an mfu over 1

    @override
    def added_metrics(self) -> tuple[str, ...]:
        """The rates; ``mfu`` where a peak is given or the device's known."""
        kind = jax.devices()[0].device_kind
        known = self.peak_flops is not None or any(
            table_peak(kind, np.dtype(dtype)) is not None
            for dtype in ("bfloat16", "float32")
        )
        mfu = ("mfu",) if known else ()
        return ("examples_per_sec", "steps_per_sec", "tflops_per_sec", *mfu)

    @override
    def on_fit_start(self, info: StepInfo) -> None:
        self._peak = self.peak_flops
        if self._peak is None:
            kind = jax.devices()[0].device_kind
            compute = np.dtype(info.trainer.precision.compute)
            self._peak = table_peak(kind, compute)
            if self._peak is None and not self._said:
                self._said = True
                NOTE.info(
                    f"Throughput: no peak FLOP/s known for {kind!r} devices "
                    f"computing in {compute}, so no mfu; pass "
                    "Throughput(peak_flops=...) (one device's FLOP/s) to have it"
                )

    @override
    def on_epoch_start(self, info: StepInfo) -> None:
        del info
        # The device is idle here: the previous epoch ended with a fetch.
        self._window.restart()
        self._epoch.restart()

    @override
    def on_step_end(self, info: StepInfo) -> None:
        self._window.add(info.examples)
        self._epoch.add(info.examples)
        if info.step % self.log_every == 0:
            metrics = info.metrics  # waits for this step: the timing is real
            examples, steps = self._window.rates()
            metrics["examples_per_sec"] = examples
            metrics["steps_per_sec"] = steps
            self._add_flops(info, metrics, steps)
            self._window.restart()

    @override
    def on_eval_start(self, info: StepInfo) -> None:
        if info.eval_every is not None:  # between two steps
            self._window.pause(info.state)

    @override
    def on_eval_end(self, info: StepInfo) -> None:
        del info
        self._window.resume()

    @override
    def on_epoch_end(self, info: StepInfo) -> None:
        examples, steps = self._epoch.rates()
        info.metrics["examples_per_sec"] = examples
        info.metrics["steps_per_sec"] = steps
        self._add_flops(info, info.metrics, steps)

    def _add_flops(self, info: StepInfo, metrics: HostMetrics, steps: float) -> None:
        """``tflops_per_sec`` (and ``mfu``) at `steps` steps per second."""
        began = time.perf_counter()
        # Counted once per batch size (a trace, ~0.1 s for a small model),
        # then remembered: that time is not the epoch's steps'.
        flops = info.trainer.flops_per_step()
        self._epoch.start += time.perf_counter() - began
        if flops is None:
            return
        rates = flops_rates(flops, steps, self._peak)
        metrics.update(rates)
        mfu = rates.get("mfu")
        if mfu is not None and mfu > 1 and not self._warned:
            self._warned = True
            assert self._peak is not None
            achieved = rates["tflops_per_sec"] * 1e12
            given = self.peak_flops is not None
            warn_mfu_over_one(mfu, flops, achieved, self._peak, given)
