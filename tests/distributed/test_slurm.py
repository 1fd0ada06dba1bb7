"""The SLURM path the processes guide documents (issue 45, acceptance 7):
two local processes given the environment ``srun`` gives the tasks of a
one-node, two-task job step, and no other description of the run, call
``px.distributed.initialize()``; JAX's cluster auto-detection finds the
coordinator (the step's first node, at a port derived from the job id),
the process count and each process's id, and 2 processes × 4 fake CPU
devices train to where 1 process × 8 devices ends."""

import os
import pathlib
import random
import socket
import subprocess
import sys

import numpy as np
import pytest

from multiprocess_run import PREDICT, STRATEGIES, parameters, train
from test_multiprocess import assert_ranks_hold


RUN = pathlib.Path(__file__).with_name("multiprocess_run.py")
# JAX's SLURM detection puts the coordinator at this port plus the job id
# modulo 4096 (jax/_src/clusters/slurm_cluster.py).
FIRST_PORT = 65535 - 2**12 + 1


def free_job_id() -> int:
    """A job id whose coordinator port nothing listens on now."""
    while True:
        job = random.randrange(10_000, 1_000_000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", FIRST_PORT + job % 2**12))
            except OSError:
                continue
        return job


def slurm_environment(job: int, task: int, tasks: int = 2) -> dict[str, str]:
    """What ``srun`` sets for task `task` of a one-node step of `tasks`
    tasks (those JAX reads, and their usual companions)."""
    return {
        "SLURM_JOB_ID": str(job),
        "SLURM_JOBID": str(job),
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": str(tasks),
        "SLURM_NTASKS": str(tasks),
        "SLURM_NPROCS": str(tasks),
        "SLURM_TASKS_PER_NODE": str(tasks),
        "SLURM_NODEID": "0",
        "SLURM_PROCID": str(task),
        "SLURM_LOCALID": str(task),
    }


def srun(*args: str, devices: int = 4, timeout: int = 300) -> list[str]:
    """`multiprocess_run.py ARGS` in 2 processes × `devices` fake CPU
    devices, described only as SLURM describes them; each one's stdout."""
    # Nothing phalanx launch would set, nor the tests' own JAX settings.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA"))}
    env = env | {
        "JAX_PLATFORMS": "cpu",
        # The tests' compiler flags (conftest.py): the reference in this
        # process is compiled with them too.
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={devices}",
        "NPROC": str(2 * devices),  # (NOTES-jax-cpu.md, trap 1)
    }
    job = free_job_id()
    tasks = [
        subprocess.Popen(
            [sys.executable, str(RUN), *args],
            env=env | slurm_environment(job, task),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for task in range(2)
    ]
    try:
        done = [task.communicate(timeout=timeout) for task in tasks]
    finally:
        for task in tasks:  # (one failed: the other may wait in a collective)
            if task.poll() is None:
                task.kill()
                task.wait()
    for task, (stdout, stderr) in zip(tasks, done, strict=True):
        assert task.returncode == 0, stdout + stderr
    return [stdout for stdout, _ in done]


@pytest.mark.slow
def test_two_slurm_tasks_equal_one_process(tmp_path):
    outputs = srun(str(tmp_path), "sharding=sharding")
    one = train(STRATEGIES["sharding"](8))
    # Found by the detection: ranks 0 and 1 of 2, 4 of the 8 devices each.
    for rank, output in enumerate(outputs):
        assert f"process {rank} of 2, 4 of 8 devices" in output.splitlines()
    assert_ranks_hold(tmp_path / "sharding", parameters(one), atol=1e-6)
    histories = [
        [line for line in output.splitlines() if line.startswith("history ")]
        for output in outputs
    ]
    assert histories[0] == histories[1] != []
    assert f"'accuracy': {one.history[-1]['accuracy']}" in histories[0][0]
    # predict: each process passed its rows; each got everyone's outputs.
    expected = np.asarray(one.predict(PREDICT))
    for rank in (0, 1):
        predicted = np.load(tmp_path / "sharding" / f"predict{rank}.npz")["whole"]
        np.testing.assert_allclose(predicted, expected, rtol=0, atol=1e-5)
