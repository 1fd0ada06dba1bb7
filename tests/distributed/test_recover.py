"""Runs that notice a hang and recover (issue 45, acceptance 4 and 5): 2
processes × 2 fake CPU devices under ``phalanx launch``, going wrong on
purpose as ``recover_run.py`` says: a rank hung in a callback; and a run
restarted twice, after a rank's SIGKILL and after a rank hung in a
checkpoint write."""

import os
import pathlib
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from multiprocess_run import STRATEGIES, parameters, train
from recover_run import HANG_TIMEOUT


RUN = pathlib.Path(__file__).with_name("recover_run.py")


def launch(
    out: pathlib.Path, mode: str, *options: str
) -> tuple[subprocess.CompletedProcess, float]:
    """`recover_run.py OUT MODE` in 2 processes × 2 devices, in folder `out`;
    the launch and when it ended (`time.time`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA"))}
    env.pop("NPROC", None)  # launch sets it for the devices per process
    # The tests' compiler flags (conftest.py): the in-process reference is
    # compiled with them too, and bitwise comparisons need the same code.
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--nproc", "2"]
        + ["--devices-per-process", "2", *options, "--"]
        + [sys.executable, str(RUN), str(out), mode],
        env=env | {"JAX_PLATFORMS": "cpu"},
        cwd=out,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, time.time()


def times(output: str, what: str) -> list[float]:
    """The times of the lines ``[r] WHAT at T`` (`what` a regex)."""
    return [float(t) for t in re.findall(rf"^\[\d\] {what} at ([\d.]+)$", output, re.M)]


def assert_no_rank_left(output: str) -> None:
    pids = [int(pid) for pid in re.findall(r"^\[\d\] pid (\d+)$", output, re.M)]
    assert pids
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def assert_dumps(folder: pathlib.Path, hung: int, phase: str) -> None:
    """Both ranks' dumps are in `folder`, rank `hung`'s naming its phase and
    its stack in the script's hanging function. (Which rank's deadline
    passed first is a race: the other's silence began as it waited for it.)"""
    causes = []
    for rank in (0, 1):
        dump = (folder / f"hang-rank{rank}.txt").read_text()
        assert f"rank: {rank} of 2" in dump
        assert "Thread 0x" in dump and "most recent call first" in dump
        causes.append(dump.splitlines()[0])
        if rank == hung:
            assert f"\nphase: {phase}\n" in dump, dump
            assert "recover_run.py" in dump  # the hung function's own frame
    # One passed its deadline; the other saw its dump and wrote its own.
    assert sorted("no progress for" in cause for cause in causes) == [False, True]
    assert any("was written: another process hung" in cause for cause in causes)


@pytest.mark.slow
def test_a_rank_hung_in_a_callback_ends_every_rank_with_a_dump(tmp_path):
    # (One hung in a checkpoint write: the restart test below.)
    done, ended = launch(tmp_path, "callback")
    output = done.stdout + done.stderr
    assert done.returncode == 75, output
    (hung,) = times(done.stdout, "hang")
    assert ended - hung < HANG_TIMEOUT + 30
    assert re.search(r"phalanx launch: rank \d was ended by its hang watchdog", output)
    assert_dumps(tmp_path / "phalanx-hang", 1, "callbacks (Trouble)")
    assert_no_rank_left(done.stdout)


@pytest.mark.slow
def test_a_run_restarts_after_a_kill_and_a_hang_and_ends_bitwise(tmp_path):
    done, _ = launch(tmp_path, "restart", "--max-restarts", "2")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = [line for line in done.stderr.splitlines() if "restart " in line]
    assert len(lines) == 2, output
    assert "rank 1 was killed by SIGKILL" in lines[0] and "restart 1/2" in lines[0]
    assert "ended by its hang watchdog" in lines[1] and "restart 2/2" in lines[1]
    # Each restart resumed from a checkpoint of the start before.
    assert len(re.findall(r"^\[0\] phalanx: resumed from step", output, re.M)) == 2
    assert_dumps(tmp_path / "checkpoints", 0, "checkpoint (Checkpoint)")
    assert_no_rank_left(done.stdout)
    straight = parameters(train(STRATEGIES["sharding-deterministic"](4)))
    for rank in (0, 1):
        saved = np.load(tmp_path / f"rank{rank}.npz")
        for i, expected in enumerate(straight):
            np.testing.assert_array_equal(saved[f"arr_{i}"], expected)
    # From a failure to the first step after the restart (the hang's failure
    # is its watchdog's exit, HANG_TIMEOUT after it began).
    (killed,) = times(done.stdout, "kill")
    (hung,) = times(done.stdout, "hang")
    first = [min(times(done.stdout, f"step \\d+ of restart {r}")) for r in (1, 2)]
    # Every rank of the hung start had ended by then: in the deadline and 30 s.
    assert first[1] - hung < HANG_TIMEOUT + 30
    waits = (first[0] - killed, first[1] - hung - HANG_TIMEOUT)
    print(f"failure to the first step after the restart: {waits[0]:.1f} s "
          f"(SIGKILL), {waits[1]:.1f} s (hang)")  # fmt: skip
    assert max(waits) < 60
