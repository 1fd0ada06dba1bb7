"""The cost model's calibration (issue 57, item 2 and acceptance 2): its
figures measured on the devices are positive and finite, cached per device
kind, count and JAX version, written whole, measured again where the cache
is damaged; a plan prices each candidate by the table it is given, and its
choice is the one that table implies. The model, loss and batch are
test_plan.py's."""

import json
import math
import os
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

import phalanx as px
from phalanx._plan import _calibration
from phalanx._plan._calibration import (
    Calibration,
    cache_file,
    calibrated,
    calibration_key,
)
from phalanx._plan._devices import CPU, device_spec
from phalanx._plan._measure import Measured
from phalanx._plan._space import PlanSpace
from stacked_transformer import RULES
from test_plan import BATCH, loss, make


F32, BF16 = np.dtype("float32"), np.dtype(jax.numpy.bfloat16)
TPU = SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
FIGURES = Calibration({"bfloat16": 2e14, "float32": 1e14}, 8e11, 4e10, 1e-5, 0.1)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder, and a count of the calibrations measured (each
    returns FIGURES at once)."""
    monkeypatch.setenv("PHALANX_CACHE", str(tmp_path))
    measured = []

    def measure(devices):
        measured.append(len(devices))
        return FIGURES

    monkeypatch.setattr(_calibration, "measure_devices", measure)
    return SimpleNamespace(folder=tmp_path / "calibration", measured=measured)


def test_eight_cpu_devices_measure_positive_finite_figures():
    found = _calibration.measure_devices(jax.devices())
    assert set(found.flops) == {"bfloat16", "float32"}
    assert found.link_bandwidth is not None and found.link_latency is not None
    rates = [*found.flops.values(), found.memory_bandwidth, found.link_bandwidth]
    assert all(math.isfinite(x) and x > 0 for x in rates), found
    assert math.isfinite(found.link_latency) and found.link_latency >= 0, found
    one = _calibration.measure_devices(jax.devices()[:1])
    assert one.link_bandwidth is None and one.link_latency is None


def test_the_cache_is_kept_per_device_kind_and_count(cache):
    assert calibrated([TPU]) == FIGURES
    assert calibrated([TPU]) == FIGURES
    assert cache.measured == [1]  # the second read the cache
    calibrated([SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")])
    calibrated([TPU, TPU])
    assert cache.measured == [1, 1, 2]
    names = sorted(p.name for p in cache.folder.iterdir())
    assert len(names) == 3 and all(n.endswith(".json") for n in names), names
    path = cache_file(calibration_key([TPU]))
    assert path.name.startswith("tpu-TPU_v5_lite-x1-jax")
    held = json.loads(path.read_text())
    assert held["key"]["kind"] == "TPU v5 lite" and held["flops"] == FIGURES.flops


def test_a_jax_upgrade_measures_again(cache, monkeypatch):
    calibrated([TPU])
    monkeypatch.setattr(jax, "__version__", "99.0.0")
    calibrated([TPU])
    calibrated([TPU])
    assert cache.measured == [1, 1]
    assert len(list(cache.folder.iterdir())) == 2
    assert "jax99.0.0" in cache_file(calibration_key([TPU])).name


def test_a_damaged_cache_is_measured_again_in_one_line(cache, capsys):
    calibrated([TPU])
    path = cache_file(calibration_key([TPU]))
    held = json.loads(path.read_text())
    negative = json.dumps({**held, "memory_bandwidth": -1.0})
    for damage in ('{"key": {', json.dumps({**held, "key": "another"}), "[]", negative):
        path.write_text(damage)
        capsys.readouterr()
        assert calibrated([TPU]) == FIGURES
        said = capsys.readouterr().err.splitlines()
        assert len(said) == 2, said  # the damage, and what was measured
        assert str(path) in said[0] and "measuring the devices again" in said[0]
        assert json.loads(path.read_text()) == held  # rewritten whole
    assert "-1.0 is not a positive number" in said[0]
    assert cache.measured == [1] * 5


def test_the_cache_is_written_whole_or_not_at_all(cache, monkeypatch, capsys):
    calibrated([TPU])
    key = calibration_key([TPU])
    path = cache_file(key)
    before = path.read_text()
    assert [p.name for p in cache.folder.iterdir()] == [path.name]  # no temporary

    def crash(descriptor: int) -> None:
        del descriptor
        raise OSError("disk full")

    # A write that fails half-way leaves the file that was there, and no
    # temporary one beside it.
    monkeypatch.setattr(os, "fsync", crash)
    _calibration._save(path, key, FIGURES._replace(seconds=2.0))
    assert path.read_text() == before
    assert [p.name for p in cache.folder.iterdir()] == [path.name]
    said = capsys.readouterr().err
    assert (
        "could not cache the cost model's calibration" in said and "disk full" in said
    )


def test_a_plan_on_an_accelerator_calibrates_and_one_on_a_cpu_does_not(
    cache, monkeypatch
):
    spec = device_spec(None, "TPU v5 lite", BF16, devices=[TPU])
    assert spec.calibrated and not spec.relative and spec.flops == 2e14
    assert (spec.memory_bandwidth, spec.link_bandwidth) == (8e11, 4e10)
    assert device_spec(None, "TPU v5 lite", F32, devices=[TPU]).flops == 1e14
    assert cache.measured == [1]
    assert device_spec(None, "cpu", F32, devices=jax.devices()) == CPU
    assert not device_spec(None, "TPU v5 lite", F32).calibrated  # no devices given
    assert cache.measured == [1]
    # One device measures no link: the data sheet's (TPU v6e: 448 GB/s).
    alone = Calibration(FIGURES.flops, 8e11, None, None, 0.1)
    monkeypatch.setattr(_calibration, "measure_devices", lambda devices: alone)
    v6 = SimpleNamespace(platform="tpu", device_kind="TPU v6 lite")
    spec = device_spec(None, "TPU v6 lite", F32, devices=[v6])
    assert (spec.link_bandwidth, spec.link_latency) == (448e9, 0.0)
    # An injected table is priced in the step's dtype where it says one.
    table = px.DeviceSpec("x", 1.0, 1.0, 1.0, flops_by_dtype=(("bfloat16", 2.0),))
    assert device_spec(table, "cpu", np.dtype(np.float16), devices=[TPU]).flops == 2.0
    assert device_spec(table, "cpu", F32).flops == 1.0


def test_px_calibrate_is_a_device_spec_of_this_host(cache):
    spec = px.calibrate(2)
    assert isinstance(spec, px.DeviceSpec) and spec.calibrated and not spec.relative
    assert spec.name == "cpu" and spec.link_latency == 1e-5
    assert dict(spec.flops_by_dtype) == FIGURES.flops and cache.measured == [2]
    with pytest.raises(ValueError, match="devices=99: this process has 8"):
        px.calibrate(99)
    with pytest.raises(ValueError, match="DeviceSpec link_bandwidth=0.0 must be"):
        px.DeviceSpec("x", 1e12, 1e11, 0.0)


# --- an injected cost table ---------------------------------------------------------

# Data parallelism reads and writes the whole optimizer state on every device
# (one all-reduce of the gradients); fully sharded, each device its eighth
# (and an all-gather of each layer's weights, forward and backward): more
# bytes over the links, fewer to and from memory. Measured here: 3.4 against
# 2.5 MB of memory traffic, 0.19 against 0.37 MB sent, in 1 against 57
# collectives.
SPACE = PlanSpace(
    meshes=[(8, 1, 1), (1, 8, 1)], microbatches=(1,), remat=(False,), rules=RULES
)
TABLES = {
    "slow memory": (px.DeviceSpec("slow memory", 1e18, 1e8, 1e18), "data=1 fsdp=8"),
    "slow links": (px.DeviceSpec("slow links", 1e18, 1e18, 1e6), "data=8 fsdp=1"),
    "slow to start a collective": (
        px.DeviceSpec("latency", 1e18, 1e18, 1e18, link_latency=1.0),
        "data=8 fsdp=1",
    ),
}


@pytest.mark.parametrize("table", TABLES)
def test_a_plan_chooses_what_its_cost_table_implies(table):
    device, expected = TABLES[table]
    plan = px.plan(
        make,
        optax.adam(1e-3),
        BATCH,
        budget="1GiB",
        space=SPACE,
        loss=loss,
        device=device,
    )
    assert plan.device == device and plan.choice is not None
    assert plan.choice.candidate.describe().startswith(expected)

    def implied(m: Measured) -> float:
        work = max(m.flops / device.flops, m.accessed / device.memory_bandwidth)
        links = (
            m.collectives / device.link_bandwidth
            + m.collective_ops * device.link_latency
        )
        return work + links

    best = min(implied(r.measured) for r in plan.rows if r.measured is not None)
    for row in plan.rows:  # each costed by the table; none bounded out wrongly
        if row.measured is not None:
            assert row.measured.seconds == pytest.approx(implied(row.measured))
        else:
            assert row.status == "bounded" and row.bounds is not None
            assert row.bounds.seconds >= best
    assert plan.choice.measured is not None
    assert implied(plan.choice.measured) == best
