"""Rates measured on the host: examples and steps per second
(`RateMeter`), and the FLOPs per second and model FLOPs utilisation they
make with a step's FLOPs and a device's peak (`flops_rates`).

Rates are only real once the device has caught up: they are read after a
sync, never by timing a dispatch. `px.callbacks.Throughput` and the
progress bar report them.
"""

import time
from typing import Any

import jax

from .._log import logger
from ._flops import StepFlops


# The least peak taken: 1 GFLOP/s (a peak given in TFLOP/s is below).
MIN_PEAK = 1e9


class RateMeter:
    """Examples and steps counted on the host since a start time.

    The rates are only real once the device has caught up: read them after a
    sync (e.g. after reading `StepInfo.metrics`), and restart when the device
    is idle (an epoch's start follows the previous epoch's fetched sums).
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.examples = 0
        self.steps = 0
        self._paused: float | None = None

    def restart(self) -> None:
        """Count from zero, from now."""
        self.start = time.perf_counter()
        self.examples = 0
        self.steps = 0
        self._paused = None

    def pause(self, state: Any) -> None:
        """Stop the clock once the device has finished the steps so far
        (`state`, their result, is ready): `fit` evaluates between steps,
        which is not the steps' pace."""
        jax.block_until_ready(state)
        self._paused = time.perf_counter()

    def resume(self) -> None:
        """Restart the clock `pause` stopped, the time between left out."""
        if self._paused is not None:
            self.start += time.perf_counter() - self._paused
            self._paused = None

    def add(self, examples: int) -> None:
        """Count one step of `examples` examples."""
        self.examples += examples
        self.steps += 1

    def seconds(self) -> float:
        """Seconds since the start."""
        return time.perf_counter() - self.start

    def rates(self) -> tuple[float, float]:
        """``(examples per second, steps per second)`` since the start."""
        seconds = max(self.seconds(), 1e-9)
        return self.examples / seconds, self.steps / seconds


def check_peak(peak_flops: float, given: object) -> float:
    """`peak_flops` (the user's `given` value, as a float) if it is one
    device's peak in FLOP/s.

    Raises:
        ValueError: it is under 1e9: a peak in TFLOP/s, or no peak.
    """
    if peak_flops < MIN_PEAK:
        # 989 for an H100's 989 TFLOP/s would make every mfu 1e12 times too
        # large: no accelerator peaks below a GFLOP/s.
        raise ValueError(
            f"peak_flops={given!r} is under 1e9: it is one device's "
            "peak in FLOP/s, not TFLOP/s; pass it in FLOP/s, e.g. 989e12 "
            "for an H100's dense bf16 (989 TFLOP/s), or None"
        )
    return peak_flops


def flops_rates(
    flops: StepFlops, steps_per_sec: float, peak: float | None
) -> dict[str, float]:
    """``tflops_per_sec`` of `flops` a step at `steps_per_sec`, and ``mfu``
    over the devices' `peak` (one device's FLOP/s; None: no ``mfu``)."""
    achieved = flops.total * steps_per_sec
    rates = {"tflops_per_sec": achieved / 1e12}
    if peak is not None:
        rates["mfu"] = achieved / (peak * flops.devices)
    return rates


def warn_mfu_over_one(
    mfu: float, flops: StepFlops, achieved: float, peak: float, given: bool
) -> None:
    """Say (as a warning) that an ``mfu`` over 1 means the peak is too low
    (`given`: the user's ``peak_flops``, else the device table's)."""
    source = "peak_flops" if given else "the peak"
    logger.warning(
        f"Throughput: mfu {mfu:.3g} is over 1: {achieved:.3g} FLOP/s on "
        f"{flops.devices} device(s), more than {source} "
        f"{peak:.3g} FLOP/s per device allows; the peak is too "
        "low: pass one device's peak in FLOP/s, e.g. "
        "Throughput(peak_flops=989e12) (said once)"
    )
