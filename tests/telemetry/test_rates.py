"""Telemetry's own logic, without a callback or a fit: rates counted on the
host, FLOPs per second and MFU, a timeline's rows and record."""

import time

import jax.numpy as jnp
import pytest

from phalanx._telemetry._clock import PHASES, PhaseClock
from phalanx._telemetry._flops import StepFlops
from phalanx._telemetry._rates import RateMeter, check_peak, flops_rates
from phalanx._telemetry._timeline_record import epoch_row, fit_record, goodput


def test_a_meter_counts_and_leaves_a_pause_out():
    meter = RateMeter()
    for _ in range(4):
        meter.add(32)
    meter.pause(jnp.zeros(3))
    time.sleep(0.2)
    meter.resume()
    examples, steps = meter.rates()
    assert (meter.examples, meter.steps) == (128, 4)
    assert meter.seconds() < 0.15  # the pause is not counted
    assert examples == pytest.approx(32 * steps)
    meter.restart()
    assert (meter.examples, meter.steps) == (0, 0)


def test_flops_rates_and_mfu():
    flops = StepFlops(total=2e12, devices=4, size=64)
    assert flops_rates(flops, 3.0, None) == {"tflops_per_sec": 6.0}
    rates = flops_rates(flops, 3.0, 1e12)
    assert rates["mfu"] == pytest.approx(6e12 / 4e12)


def test_a_peak_in_tflops_is_refused():
    assert check_peak(989e12, 989e12) == 989e12
    with pytest.raises(ValueError, match=r"peak_flops=989 is under 1e9.*989e12"):
        check_peak(989.0, 989)


def test_a_timeline_row_and_record():
    last = {phase: 1.0 for phase in (*PHASES, "wall")}
    totals = {**last, "step": 3.0, "wall": 5.0}
    row = epoch_row(totals, last)
    assert row["step"] == 2.0 and row["wall"] == 4.0 and row["data"] == 0.0
    assert goodput(row) == 0.5 and goodput({"step": 1.0, "wall": 0.0}) == 0.0
    clock = PhaseClock()
    with clock.running():
        clock.switch("step")
        time.sleep(0.01)
    record = fit_record(clock, started=1.0, ended=None, steps=(3, 9), epochs=[])
    assert record["first_step"] == 3 and record["last_step"] == 9
    assert record["phases"]["step"] > 0 and record["ended"] is None
    assert sum(record["phases"].values()) == pytest.approx(record["wall_s"])
