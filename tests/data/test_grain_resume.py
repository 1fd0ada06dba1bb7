"""`px.data.GrainLoader` resumed exactly (issue 45, acceptance 1): a run
SIGKILLed mid-epoch while 2 grain worker processes decode ahead, resumed,
ends bitwise where a straight run ends, and the resumed run reads no
example it had trained on; the same stopping on 1 process and resuming on
2 (× 4 fake devices), and the reverse.

Each run is its own process (`grain_run.py`): the kill is real, and the
processes read through grain's worker processes as a user's would.
"""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from grain_run import loader


RUN = pathlib.Path(__file__).with_name("grain_run.py")
KILL_AT = 5  # the run resumes from step 4's checkpoint
STEPS = 8


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_LOG_COMPILES"] = "1"  # each compile on stderr: counted below
    env["NPROC"] = str(2 * devices)
    env["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "").replace(
            "--xla_force_host_platform_device_count=8", ""
        )
        + f" --xla_force_host_platform_device_count={devices}"
    )
    return env


def _run(out: pathlib.Path, *args: str, processes: int = 1, ok: bool = True) -> str:
    """`grain_run.py OUT ARGS`, in one process × 8 devices or under
    ``phalanx launch`` in `processes` × 8/processes; its output."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(RUN), str(out), *args]
    env = _env(8)
    if processes > 1:
        devices = 8 // processes
        command = [
            sys.executable, "-m", "phalanx", "launch", "--nproc", str(processes),
            "--devices-per-process", str(devices), "--", *command,
        ]  # fmt: skip
        # launch sets the device count and NPROC; the compiler flags stay the
        # tests' (conftest.py), as the straight run's: bitwise needs the same code.
        env.pop("NPROC")
        env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def _reads(out: pathlib.Path) -> list[int]:
    """Every example read in the run writing to `out`, by any process."""
    return [
        int(line) for log in out.glob("reads-*.txt") for line in log.read_text().split()
    ]


def _trained(steps: int) -> set[int]:
    """The examples of the first `steps` global batches of epoch 0."""
    batches = iter(loader(process_index=0, process_count=1))
    return {int(i) for _ in range(steps) for i in next(batches)[0][:, 0]}


def _same(a: pathlib.Path, b: pathlib.Path, ranks: int = 1) -> None:
    expected = np.load(b / "rank0.npz")
    for rank in range(ranks):
        got = np.load(a / f"rank{rank}.npz")
        for key in expected:
            np.testing.assert_array_equal(got[key], expected[key])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> pathlib.Path:
    """A run of `STEPS` steps, never stopped."""
    out = tmp_path_factory.mktemp("straight")
    _run(out, str(STEPS))
    return out


@pytest.mark.slow
def test_killed_mid_epoch_with_workers_resumes_bitwise_reading_nothing_twice(
    straight, tmp_path
):
    checkpoints = str(tmp_path / "checkpoints")
    common = ("--workers", "2", "--checkpoints", checkpoints)
    _run(tmp_path / "killed", str(STEPS), *common, "--kill-at", str(KILL_AT), ok=False)
    said = _run(tmp_path / "resumed", str(STEPS), *common, "--resume")
    assert f"resumed from step {KILL_AT - 1}" in said
    _same(tmp_path / "resumed", straight)
    reads = _reads(tmp_path / "resumed")
    assert not set(reads) & _trained(KILL_AT - 1)
    # It read the batches it trained on (and some ahead, in the workers).
    assert set(reads) >= _trained(STEPS) - _trained(KILL_AT - 1)


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)])
def test_stopped_on_one_process_count_resumes_on_another(
    straight, tmp_path, before, after
):
    checkpoints = str(tmp_path / "checkpoints")
    _run(tmp_path / "stopped", "4", "--checkpoints", checkpoints, processes=before)
    resumed = tmp_path / "resumed"
    said = _run(
        resumed, str(STEPS), "--checkpoints", checkpoints, "--resume", processes=after
    )
    # The train step compiles once, for the global batch (it used to compile
    # again for one process's slice taken as global, then once more).
    assert said.count("Compiling jit(call)") == after, said
    # The deterministic reduction sums in one order on any process count.
    _same(resumed, straight, ranks=after)
    reads = _reads(resumed)
    assert not set(reads) & _trained(4)
    # Each example of the remaining steps read once, by one of the processes.
    remaining = _trained(STEPS) - _trained(4)
    assert sorted(r for r in reads if r in remaining) == sorted(remaining)
