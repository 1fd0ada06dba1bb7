"""Training across processes: 2 processes × 2 fake CPU devices, started by
``phalanx launch``, end where 1 process × 4 devices ends (issue 6)."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import phalanx as px
from helpers import is_gloo_note
from multiprocess_run import PREDICT, STRATEGIES, parameters, train


RUN = pathlib.Path(__file__).with_name("multiprocess_run.py")


def launch(
    *args: str, ok: bool = True, timeout: int = 300, devices: int = 2
) -> subprocess.CompletedProcess:
    """`multiprocess_run.py ARGS` (or `python ARGS`, e.g. ``-c SCRIPT``, when
    the first one starts with -) in 2 processes × `devices` fake CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA"))}
    env.pop("NPROC", None)  # launch sets it for the devices per process
    # The compiler flags of the tests (conftest.py), which the in-process
    # reference is compiled with too: bitwise comparisons need the same code.
    env["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "launch", "--nproc", "2"]
        + ["--devices-per-process", str(devices), "--", sys.executable]
        + ([] if args[0].startswith("-") else [str(RUN)])
        + list(args),
        env=env | {"JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def assert_ranks_hold(
    folder: pathlib.Path, expected: list[np.ndarray], atol: float = 1e-6
) -> None:
    """Each process's saved parameters equal `expected` to `atol` (1e-6:
    summation order aside; 0: bitwise)."""
    for rank in (0, 1):
        saved = np.load(folder / f"rank{rank}.npz")
        got = [saved[f"arr_{i}"] for i in range(len(expected))]
        for a, b in zip(got, expected, strict=True):
            if atol:
                np.testing.assert_allclose(a, b, rtol=0, atol=atol)
            else:
                np.testing.assert_array_equal(a, b)


# Checkpoints crossing between process counts: saved by one strategy, resumed
# by another, and the tolerance of the comparison.
CROSSINGS = [
    ("sharding", "pmap", 1e-6),
    # Split over the devices: each process writes and reads its own parts.
    ("fsdp", "fsdp", 1e-6),
    # With the deterministic reduction the resumed runs are bitwise exact.
    ("sharding-deterministic", "pmap-deterministic", 0),
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[pathlib.Path, str]:
    """Every 2-process run the tests below compare, in one launch (its
    processes start and connect once): each strategy's 20 steps in OUT/NAME;
    for each crossing, 2 processes saving (steps 5, 10, 13) in OUT/two-SAVE,
    and 2 processes resuming, in OUT/resume-SAVE, to step 20 from what 1
    process saved in OUT/one-SAVE. The folder and the launch's stdout."""
    out = tmp_path_factory.mktemp("launched")
    jobs = [f"{name}={name}" for name in STRATEGIES]
    for save, resume, _ in CROSSINGS:
        one = px.callbacks.Checkpoint(out / f"one-{save}", every_n_steps=5)
        train(STRATEGIES[save](4), [one], steps=13)
        jobs.append(f"save-{save}={save}:13:{out}/two-{save}:fresh")
        jobs.append(f"resume-{save}={resume}:20:{out}/one-{save}:resume")
    return out, launch(str(out), *jobs, timeout=900).stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_processes_equal_one_process(launched, name):
    out, stdout = launched
    folder = out / name
    one = train(STRATEGIES[name](4))
    bitwise = name.endswith("deterministic")
    assert_ranks_hold(folder, parameters(one), atol=0 if bitwise else 1e-6)
    # save_model (by process 0) holds the trained model.
    model = px.load_model(folder / "model.npz", like=one.model)
    saved = [
        np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))
    ]
    for a, b in zip(saved, parameters(one), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # predict: each process passes its rows, each gets everyone's outputs.
    expected = np.asarray(one.predict(PREDICT))
    for rank in (0, 1):
        predicted = np.load(folder / f"predict{rank}.npz")
        for key in ("whole", "chunked"):
            np.testing.assert_allclose(predicted[key], expected, rtol=0, atol=1e-5)
    # Both processes report the same global history as the one process.
    reports = [line for line in stdout.splitlines() if f" history {name} " in line]
    assert sorted(line[:4] for line in reports) == ["[0] ", "[1] "]
    assert reports[0][4:] == reports[1][4:]
    assert f"'accuracy': {one.history[-1]['accuracy']}" in reports[0]
    # Logs and progress are written once, by process 0.
    lines = (folder / "metrics.csv").read_text().splitlines()[1:]
    rows = [line.split(",")[:2] for line in lines]
    assert [step for kind, step in rows if kind == "step"] == ["5", "10", "15", "20"]
    assert [step for kind, step in rows if kind == "epoch"] == ["10", "20"]
    progress = [line for line in stdout.splitlines() if "  step " in line]
    assert progress and all(line.startswith("[0] ") for line in progress)


@pytest.mark.slow
@pytest.mark.parametrize(("save", "resume", "atol"), CROSSINGS)
def test_checkpoints_cross_between_process_counts(launched, save, resume, atol):
    out, _ = launched
    straight = parameters(train(STRATEGIES[save](4)))
    # 2 processes saved (steps 5, 10, 13); 1 process resumes to step 20.
    checkpoint = px.callbacks.Checkpoint(out / f"two-{save}", every_n_steps=5)
    resumed = train(STRATEGIES[resume](4), [checkpoint], resume="latest")
    assert int(resumed.state.step) == 20
    for a, b in zip(parameters(resumed), straight, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
    # 1 process saved (to step 13); 2 processes resumed to step 20.
    assert_ranks_hold(out / f"resume-{save}", straight, atol=atol)


@pytest.mark.slow
def test_processes_with_different_slices_are_refused():
    script = """
import jax, numpy as np, optax
import phalanx as px
px.distributed.initialize()
n = 32 + 8 * jax.process_index()  # process 1 hands more rows
x, y = np.ones((n, 4), np.float32), np.zeros(n, np.int32)
model = px.models.MLP(4, 2, hidden=(8,), key=jax.random.key(0))
px.DataParallelTrainer(model, optax.sgd(0.1)).fit([(x, y)], steps=1)
"""
    done = launch("-c", script, ok=False)
    # Both raise; the launcher may stop one before it has printed.
    assert (
        "ValueError: data: the processes' slices of batch 0 of epoch 0 differ "
        "(process 0: 32 examples {batch[0]: float32[4], batch[1]: int32[]}; "
        "process 1: 40 examples {batch[0]: float32[4], batch[1]: int32[]})"
    ) in done.stderr


@pytest.mark.slow
def test_phalanx_train_under_launch(tmp_path):
    # `phalanx launch ... -- phalanx train` needs no other flag: one run
    # folder, one progress display, the accuracy of 1 process × 4 devices.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA"))}
    env = env | {"JAX_PLATFORMS": "cpu"}
    env.pop("NPROC", None)
    phalanx = [sys.executable, "-m", "phalanx"]
    two = subprocess.run(
        [*phalanx, "launch", "--nproc", "2", "--devices-per-process", "2", "--"]
        + [*phalanx, "train", "--epochs", "2", "--log-every", "5"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stdout + two.stderr
    one = subprocess.run(
        [*phalanx, "train", "--epochs", "2", "--log-every", "5", "--devices", "4"]
        + ["--run-dir", "one"],
        cwd=tmp_path,
        env=env | {"NPROC": "8"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stdout + one.stderr
    (folder,) = (tmp_path / "runs").iterdir()
    final = one.stdout.splitlines()[-1].replace(
        "logs in one", f"logs in runs/{folder.name}"
    )
    lines = [line for line in two.stdout.splitlines() if not is_gloo_note(line)]
    assert lines[-1] == f"[0] {final}"
    assert [line for line in lines if not line.startswith("[0] ")] == []  # 1 is silent
    assert sum("  step " in line for line in lines) == 46 // 5
    for name in ("metrics.csv", "metrics.jsonl", "history.png", "tensorboard"):
        assert (folder / name).exists()
    steps = [row.split(",")[:2] for row in (folder / "metrics.csv").read_text().split()]
    assert [s for k, s in steps if k == "step"] == [str(s) for s in range(5, 47, 5)]


@pytest.mark.parametrize("name", ["sharding", "pmap", "accumulating"])
def test_deterministic_reduction_in_one_process(name):
    # The same update as the all-reduce, to float rounding.
    default = train(STRATEGIES[name](4))
    fixed = train(STRATEGIES[f"{name}-deterministic"](4))
    for a, b in zip(parameters(fixed), parameters(default), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_rank_killed_mid_training_stops_the_run():
    script = """
import os, signal
import jax, numpy as np, optax
import phalanx as px
px.distributed.initialize()

class Die(px.Callback):
    def on_step_end(self, info):
        if info.step == 5 and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

x, y = np.ones((32, 4), np.float32), np.zeros(32, np.int32)
model = px.models.MLP(4, 2, hidden=(8,), key=jax.random.key(0))
trainer = px.DataParallelTrainer(model, optax.sgd(0.1), callbacks=[Die()], sync_every=1)
trainer.fit([(x, y)], steps=10_000)
"""
    start = time.monotonic()
    done = launch("-c", script, ok=False)
    assert time.monotonic() - start < 60
    assert done.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL; the other processes were stopped" in (
        done.stderr
    )
