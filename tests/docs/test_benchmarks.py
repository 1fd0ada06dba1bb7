"""The benchmark harness keeps working: a tiny run of `benchmarks/run.py`.

It asserts that every case ran and produced numbers, nothing about speed
(CI machines are too noisy for that, and the tiny run too short).
"""

import json
import math
import os
import pathlib
import runpy
import sys
from typing import Any

import pytest

import forkserver


ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
VERSUS = ("sharding", "pmap", "accum-sharding", "accum-pmap", "steps-per-call")
RUN = [sys.executable, str(ROOT / "benchmarks" / "run.py")]
# Each script is started by the fork server (forkserver.py), as a fresh
# interpreter would start it, less the ~3.5 s of imports; the processes a
# script starts for its device counts are fresh interpreters.
SUBPROCESS = {
    # CPU even on a host with accelerators: the harness fakes CPU devices.
    # No NPROC of the test process's: each run sets its own. The session's
    # compilation cache (conftest.py, in os.environ): the runs compile the
    # same programs (each case's first-step measurement, each device count's
    # process) once; the smoke tests check that the harness works, not its
    # times.
    "env": {
        **{k: v for k, v in os.environ.items() if k != "NPROC"},
        "JAX_PLATFORMS": "cpu",
    },
    "timeout": 300,
}


@pytest.mark.slow
def test_tiny_benchmark_run(tmp_path):
    out = tmp_path / "results.json"
    # Data on the devices for the strategy pairs (the host feeds run in the
    # checks, timeline, host-vs-device and jit-host-vs-device cases): half the time.
    command = [*RUN, "--tiny", "--data", "device", "--out", out]
    result = forkserver.run(command, **SUBPROCESS, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())

    ran = {(case["case"], case["data"]) for case in results["cases"]}
    expected = {(name, "device") for name in VERSUS}
    expected |= {
        ("checks", "host"),
        ("nan-guard", "device"),
        ("timeline", "host"),
        ("guard-vs-optax", "device"),
        ("host-vs-device", "both"),
        ("jit-host-vs-device", "both"),
    }
    assert ran == expected
    for case in results["cases"]:
        for side in (case["a"], case["b"]):
            assert len(side["seconds"]) == results["config"]["repeats"]
            assert len(side["cpu_seconds"]) == results["config"]["repeats"]
            assert min(side["seconds"]) > 0 and min(side["cpu_seconds"]) > 0
            speeds = ("steps_per_s", "examples_per_s")
            for key in ("first_step_s", *speeds, "lower_s", "compile_s"):
                assert side[key] > 0, (case["case"], key)
            assert side["memory"]["temp_bytes"] > 0
        assert case["ratio"] > 0 and case["first_step_ratio"] > 0
        assert case["cpu_ratio"] > 0

    memory = results["accumulation_memory"]
    for side in ("ShardingStrategy", "PmapStrategy", "shard_map scan"):
        rows = [row for row in memory if row["side"] == side]
        assert [row["microbatches"] for row in rows] == [1, 4, 16]
        assert all(row["memory"]["temp_bytes"] > 0 for row in rows)
    assert results["max_rss_mib"] > 0
    assert results["config"]["jax"] and results["config"]["cpu_count"]


@pytest.mark.slow
def test_each_device_count_runs_in_its_own_process(tmp_path):
    # Each count gets its own fake devices and NPROC (2 per device), as a
    # user of that many devices would; the parent merges their results.
    out = tmp_path / "results.json"
    command = [*RUN, "--tiny", "--devices", "1,2", "--cases", "sharding"]
    result = forkserver.run(
        [*command, "--data", "device", "--out", out], **SUBPROCESS, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())

    assert [case["devices"] for case in results["cases"]] == [1, 2]
    assert results["config"]["device_count"] == "1/2"
    assert results["config"]["NPROC"] == "2/4"
    assert "sharding" in result.stdout  # the merged table


def tiny_run(
    script: str, tmp_path: pathlib.Path, options: tuple[str, ...] = ("--devices", "2")
) -> Any:
    """The results of ``benchmarks/SCRIPT --tiny`` (on 2 devices)."""
    out = tmp_path / "results.json"
    command = [sys.executable, str(ROOT / "benchmarks" / script), "--tiny"]
    command += [*options, "--out", str(out)]
    result = forkserver.run(command, **SUBPROCESS, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tiny_mfu_benchmark_run(tmp_path):
    rows = tiny_run("mfu.py", tmp_path, options=())
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]
    # 2·64·(16·32 + 32·32 + 32·10) forward, twice that backward but the
    # first layer's input gradient.
    forward = 2 * 64 * (16 * 32 + 32 * 32 + 32 * 10)
    for row in rows:
        assert row["flops_per_step"] == 3 * forward - 2 * 64 * 16 * 32
        assert row["steps_per_sec"] > 0
        assert row["mfu"] == pytest.approx(row["tflops_per_sec"] * 1e12 / 1e11)


@pytest.mark.slow
def test_tiny_fsdp_benchmark_run(tmp_path):
    results = tiny_run("fsdp.py", tmp_path)
    rows = {(row["devices"], row["side"]): row for row in results["memory"]}
    assert set(rows) == {(2, side) for side in ("sharding", "fsdp", "fsdp-optimizer")}
    for row in rows.values():
        assert row["argument_bytes"] > 0 and row["temp_bytes"] > 0
    held = {key: row["state_bytes_per_device"] for key, row in rows.items()}
    assert held[(2, "fsdp")] < held[(2, "fsdp-optimizer")] < held[(2, "sharding")]
    assert results["timing"]["ratio"] > 0


@pytest.mark.slow
def test_tiny_precision_benchmark_run(tmp_path):
    rows = tiny_run("precision.py", tmp_path)
    assert [(row["devices"], row["precision"]) for row in rows] == [
        (2, policy) for policy in ("fp32", "bf16", "fp16")
    ]
    for row in rows:
        assert row["step_s"] > 0 and row["temp_bytes"] > 0
        assert (
            row["vs_fp32"] == 1.0 if row["precision"] == "fp32" else row["vs_fp32"] > 0
        )


@pytest.mark.slow
def test_tiny_mesh_benchmark_run(tmp_path):
    out = tmp_path / "mesh.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "mesh.py"), "--tiny"]
    result = forkserver.run([*command, "--out", str(out)], **SUBPROCESS, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads(out.read_text())
    layouts = {row["side"]: row for row in results["layouts"]}
    assert len(layouts) == 6 and "Mesh fsdp=8, Stacked" in layouts
    for row in layouts.values():
        assert row["temp_bytes"] > 0 and "step_s" not in row  # tiny: no timing
        assert row["peak_bytes"] >= row["state_bytes_per_device"] + row["temp_bytes"]
    # Split eight ways, the state on a device is below the replicated one's.
    assert (
        layouts["Mesh fsdp=8, Stacked"]["state_bytes_per_device"]
        < layouts["ShardingStrategy"]["state_bytes_per_device"]
    )
    assert [row["remat"] for row in results["remat"]] == [False, True]
    assert [(row["layers"], row["stacked"]) for row in results["compile"]] == [
        (2, True),
        (2, False),
        (4, True),
        (4, False),
    ]
    assert "peak/dev" in result.stdout


@pytest.mark.slow
def test_tpu_benchmark_parts_run_without_a_tpu(tmp_path):
    # Issue 53: benchmarks/tpu.py's parts work on any device (here the CPU);
    # the planted NaN behaves as the chip's run must.
    script = str(ROOT / "benchmarks" / "tpu.py")
    for part in ("nan", "steps"):
        command = [sys.executable, script, part, "--out", str(tmp_path)]
        result = forkserver.run(command, **SUBPROCESS, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
    nan = json.loads((tmp_path / "nan.json").read_text())
    assert nan["raise_names_step_3"] and nan["raise_state_equals_3_clean_steps"]
    assert nan["raise_state_step"] == 3 and nan["skip_skipped_steps"] == 1
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert set(steps) >= {"1", "8", "32", "device", "jax"}
    assert steps["32"]["speedup"] > 0 and steps["32"]["temporary_bytes"] >= 0


def test_the_speed_guide_shows_the_committed_tpu_results():
    # `python scripts/tpu_results.py` writes the table from the JSON file.
    script = runpy.run_path(str(ROOT / "scripts" / "tpu_results.py"))
    record = json.loads(script["RESULTS"].read_text())
    assert len(record["commit"]) == 40 and record["device"].startswith("TPU")
    assert script["table"](record) in script["GUIDE"].read_text()


@pytest.mark.slow
def test_the_plan_accuracy_harness_runs_without_a_tpu(tmp_path):
    # Issue 57, acceptance 1's harness (the chip's run: benchmarks/tpu.sh
    # plan, plan125), on the tiny MLP: each configuration planned and
    # trained in a process of its own, then the plan of its whole grid.
    script = str(ROOT / "benchmarks" / "plan_accuracy.py")
    command = [sys.executable, script, "--models", "mlp", "--tiny", "--steps", "1"]
    # Its calibration (a process of its own, first) cached in tmp_path.
    env = SUBPROCESS["env"] | {"PHALANX_CACHE": str(tmp_path / "cache")}
    result = forkserver.run(
        [*command, "--out", str(tmp_path)], **(SUBPROCESS | {"env": env}), cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((tmp_path / "plan_accuracy_mlp.json").read_text())
    rows = record["rows"]
    assert [(r["precision"], r["microbatches"]) for r in rows] == [
        ("fp32", 1),
        ("bf16", 1),
        ("fp32", 2),
    ]
    for row in rows:
        assert row["status"] == "fits", row
        # A slope of fit times: on a loaded CPU, for the tiny MLP's 0.3 ms
        # step, within the noise of a fit's fixed cost (even below 0).
        assert row["predicted"]["peak"] > 0 and math.isfinite(row["measured_seconds"])
        # No device memory statistics on a CPU: no footprint to compare.
        assert row["device_peak"] is None
    assert record["summary"]["configurations"] == 3
    assert "calibrated=True" in record["calibration"]["device"]
    assert record["whole_plan"]["chosen"]["microbatches"] in (1, 2)
