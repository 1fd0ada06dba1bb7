"""Training across processes: 2 processes × 2 fake CPU devices, started by
``phalanx launch``, end where 1 process × 4 devices ends (issue 6)."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from multiprocess_run import STRATEGIES, parameters, train


RUN = pathlib.Path(__file__).with_name("multiprocess_run.py")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_processes_equal_one_process(tmp_path, name):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA"))}
    env.pop("NPROC", None)  # launch sets it for 2 devices per process
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--nproc", "2"]
        + ["--devices-per-process", "2", "--"]
        + [sys.executable, str(RUN), name, str(tmp_path)],
        env=env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    one = train(STRATEGIES[name](4))
    expected = parameters(one)
    for rank in (0, 1):
        saved = np.load(tmp_path / f"rank{rank}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(expected))]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # Both processes report the same global history as the one process.
    reports = [line for line in done.stdout.splitlines() if " history " in line]
    assert sorted(line[:4] for line in reports) == ["[0] ", "[1] "]
    assert reports[0][4:] == reports[1][4:]
    assert f"'accuracy': {one.history[-1]['accuracy']}" in reports[0]
    # Logs and progress are written once, by process 0.
    lines = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    rows = [line.split(",")[:2] for line in lines]
    assert [step for kind, step in rows if kind == "step"] == ["5", "10", "15", "20"]
    assert [step for kind, step in rows if kind == "epoch"] == ["10", "20"]
    progress = [line for line in done.stdout.splitlines() if "  step " in line]
    assert progress and all(line.startswith("[0] ") for line in progress)
