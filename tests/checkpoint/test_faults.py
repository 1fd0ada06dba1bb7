"""The fault suite (issue 15): real processes meet real faults.

A checkpoint folder that turns unwritable mid-run, a file size limit reached
during a save, a corrupt newest checkpoint, SIGINT, a run folder that cannot
be written, a launch of a command that does not exist. Each ends with a
non-zero exit within `FAULT_SECONDS` of the fault (never a hang: orbax's
threads once kept the interpreter from exiting), one line of message (no
orbax/TensorStore dump), the complete checkpoints intact, and, where a
resume is possible, a resumed run equal to a straight one to the bit.

Every subprocess here has its own timeout.
"""

import contextlib
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from cli_runs import (
    COMMON,
    ENV,
    EVERY_5,
    NOTICE,
    TOTAL,
    Phalanx,
    assert_same_run,
    finish,
    listed,
    refused,
    same_arrays,
)


# How long a process may take to end once a fault has hit it.
FAULT_SECONDS = 60
SCRIPT = pathlib.Path(__file__).with_name("fault_script.py")
ARGS = (*COMMON, *EVERY_5, "--run-dir", "RUN")
# What must never reach a user's screen for a fault phalanx names.
RAW = ("ERROR:absl", "Exception ignored", "Event loop is closed", "OUT_OF_RANGE")


@contextlib.contextmanager
def unwritable(folder: pathlib.Path) -> Iterator[None]:
    """`folder` refuses new entries until the block ends: chmod for a user,
    the immutable attribute for root (whom permissions do not stop)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot make a folder unwritable")
    made = subprocess.run(
        ["chattr", "+i", str(folder)], capture_output=True, timeout=30
    )
    if made.returncode != 0:
        pytest.skip(f"chattr +i is not permitted here: {made.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True, timeout=30)


def complete(folder: pathlib.Path, step: int) -> bool:
    """Whether checkpoint `step` in `folder` has been committed."""
    return (folder / str(step) / "_CHECKPOINT_METADATA").exists()


def ended(run: Phalanx) -> int:
    """The exit code of a run hit by a fault: it must end promptly."""
    try:
        return run.process.wait(FAULT_SECONDS)
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail(f"still running {FAULT_SECONDS}s after the fault:\n{run.output()}")


def assert_one_error_line(run: Phalanx, *phrases: str) -> str:
    """stderr is the device notice and one line of error naming `phrases`."""
    lines = run.stderr.splitlines()
    assert lines[:1] == [NOTICE] and len(lines) == 2, run.output()
    error = lines[1]
    assert error.startswith("phalanx train: error: "), error
    for phrase in phrases:
        assert phrase in error, error
    return error


# --- the checkpoint folder turns unwritable, mid-run --------------------------


@pytest.mark.slow
def test_cli_run_whose_checkpoint_folder_turns_unwritable(tmp_path, straight, restore):
    folder = tmp_path / "RUN" / "checkpoints"
    run = Phalanx(tmp_path, *ARGS)
    run.wait_for(lambda: complete(folder, 10), "checkpoint 10")
    with unwritable(folder):
        code = ended(run)
    assert code == 74, run.output()
    error = assert_one_error_line(
        run, "Checkpoint: saving step", "failed: the folder is not writable"
    )
    assert "then run again with --resume" in error
    steps, latest = listed(folder)
    assert latest is not None and latest >= 10
    for step in steps:  # every listed checkpoint is complete and readable
        restore(folder, step)
    resumed = finish(tmp_path, *ARGS, "--resume")
    assert resumed.lines[-1] == straight[1]
    assert_same_run(tmp_path / "RUN", straight[0], restore)


@pytest.mark.slow
def test_script_whose_checkpoint_folder_turns_unwritable_exits(tmp_path):
    # The hang of issue 15: orbax's non-daemon threads waited forever for a
    # folder that could not be made, and the interpreter never exited.
    folder = tmp_path / "ckpt"
    run = Phalanx(
        tmp_path, str(folder), prefix=(sys.executable, str(SCRIPT)), script=True
    )
    run.wait_for(lambda: complete(folder, 5), "checkpoint 5")
    with unwritable(folder):
        code = ended(run)
    assert code == 1, run.output()
    last = run.stderr.splitlines()[-1]
    assert last.startswith("phalanx.checkpoint.CheckpointWriteError: "), last
    assert "the folder is not writable" in last
    assert not any(raw in run.stderr for raw in RAW), run.stderr
    # The script resumes from what was kept, and finishes.
    again = Phalanx(
        tmp_path, str(folder), prefix=(sys.executable, str(SCRIPT)), script=True
    )
    assert again.wait() == 0, again.output()
    assert again.lines[-1] == "done at step 120"


# --- a file size limit (ulimit -f), reached during a save ---------------------


@pytest.mark.slow
def test_file_size_limit_during_a_save(tmp_path, straight, restore):
    folder = tmp_path / "RUN" / "checkpoints"
    run = Phalanx(tmp_path, *ARGS)
    run.wait_for(lambda: complete(folder, 10), "checkpoint 10")
    # Above the logs' sizes, below a checkpoint's arrays (~600 KB).
    limit = 64 * 1024
    resource.prlimit(run.process.pid, resource.RLIMIT_FSIZE, (limit, limit))
    code = ended(run)
    assert code == 74, run.output()
    assert_one_error_line(run, "Checkpoint: saving step", "file size limit (ulimit -f)")
    steps, latest = listed(folder)
    assert latest is not None and 10 <= latest < TOTAL
    for step in steps:
        restore(folder, step)
    resumed = finish(tmp_path, *ARGS, "--resume")
    assert resumed.lines[-1] == straight[1]
    assert_same_run(tmp_path / "RUN", straight[0], restore)


# --- a corrupt newest checkpoint -----------------------------------------------


def truncate_arrays(step_folder: pathlib.Path) -> None:
    for path in (step_folder / "arrays").rglob("*"):
        if path.is_file() and path.stat().st_size > 1024:
            path.write_bytes(path.read_bytes()[:100])


@pytest.mark.slow
def test_resume_skips_a_corrupt_newest_checkpoint(tmp_path, straight, restore):
    # (A damaged JSON half takes the same path: test_checkpoint.py, in process.)
    shutil.copytree(straight[0], tmp_path / "RUN")
    folder = tmp_path / "RUN" / "checkpoints"
    truncate_arrays(folder / str(TOTAL))
    resumed = Phalanx(tmp_path, *ARGS, "--resume")
    assert resumed.wait() == 0, resumed.output()
    lines = resumed.stderr.splitlines()
    assert len(lines) == 3 and NOTICE in lines, resumed.output()
    warning, resumed_from = [line for line in lines if line != NOTICE]
    assert (
        resumed_from
        == f"phalanx: resumed from step 65 (epoch 3) of {folder.absolute()}/65"
    )
    assert warning.startswith(
        f"phalanx: resume='latest': skipped checkpoint {folder.absolute()}/{TOTAL}, "
        "which cannot be read ("
    ), warning
    assert warning.endswith(f"resuming from {folder.absolute()}/65"), warning
    assert resumed.lines[-1] == straight[1]
    assert_same_run(tmp_path / "RUN", straight[0], restore)


@pytest.mark.slow
def test_resume_with_every_checkpoint_corrupt_is_refused(tmp_path, straight):
    shutil.copytree(straight[0], tmp_path / "RUN")
    folder = tmp_path / "RUN" / "checkpoints"
    steps, _ = listed(folder)
    for step in steps:
        truncate_arrays(folder / str(step))
    line = refused(tmp_path, "train", *ARGS, "--resume")
    assert line.startswith("phalanx train: error: --resume: "), line
    assert "no checkpoint in" in line and "can be read" in line
    for step in steps:
        assert f"step {step}: a file in it is shorter than its index" in line
    assert not any(raw in line for raw in RAW)


# --- SIGINT: saves at the step boundary, exits 130, resumes exactly ----------


@pytest.mark.slow
def test_sigint_saves_then_resume_is_exact(tmp_path, straight, reference, restore):
    folder = tmp_path / "RUN" / "checkpoints"
    stopped = Phalanx(tmp_path, *ARGS)
    code = stopped.signal_when(lambda run: run.progress() >= 30, signal.SIGINT)
    assert code == 130, stopped.output()
    lines = stopped.stderr.splitlines()
    assert lines[0] == NOTICE and len(lines) == 2, stopped.output()
    assert lines[1].startswith("phalanx: stopped by SIGINT at a step boundary; ")
    _, latest = listed(folder)
    assert latest is not None and latest >= 30
    assert same_arrays(restore(folder, latest), reference[latest])
    resumed = finish(tmp_path, *ARGS, "--resume")
    assert resumed.lines[-1] == straight[1]
    assert_same_run(tmp_path / "RUN", straight[0], restore)


# --- an error on one process of a multi-process run -----------------------------

RANK_FAILS = """
import jax, numpy as np, optax
import phalanx as px

px.distributed.initialize()


class Boom(px.Callback):
    def on_step_end(self, info):
        if info.step == 3 and jax.process_index() == 1:
            raise RuntimeError("boom on process 1")


rng = np.random.default_rng(0)
x = rng.normal(size=(256, 5)).astype(np.float32)
y = rng.integers(0, 3, size=256).astype(np.int32)
model = px.models.MLP(5, 3, hidden=(8,), key=jax.random.key(0))
trainer = px.DataParallelTrainer(model, optax.adam(1e-3), callbacks=[Boom()])
trainer.fit(px.data.ArrayLoader((x, y), 32), epochs=50)
"""


@pytest.mark.slow
def test_an_error_on_one_process_ends_the_whole_run(tmp_path):
    # JAX's exit waits up to 5 minutes for every process to exit; the others
    # wait in a collective for the failed one: the run hung that long.
    script = tmp_path / "rank_fails.py"
    script.write_text(RANK_FAILS)
    env = {k: v for k, v in ENV.items() if k not in ("NPROC", "XLA_FLAGS")}
    command = [sys.executable, "-m", "phalanx", "launch", "--nproc", "2"]
    command += ["--devices-per-process", "2", "--", sys.executable, str(script)]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert time.monotonic() - start < 2 * FAULT_SECONDS, result.stderr
    assert result.returncode == 1, result.stderr
    assert "[1] RuntimeError: boom on process 1" in result.stderr
    assert result.stderr.rstrip().endswith(
        "phalanx launch: rank 1 exited with code 1; the other processes were stopped"
    )


# --- the other exit codes: a diverging run, a log file that cannot be written --


@pytest.mark.slow
def test_a_diverging_run_exits_3_in_one_line(tmp_path):
    run = Phalanx(tmp_path, "--epochs", "1", "--lr", "1e30", "--run-dir", "RUN")
    assert run.wait() == 3, run.output()
    error = assert_one_error_line(run, "non-finite gradient (NaN or inf)")
    assert error.endswith("(here: a lower --lr, or --clip-norm)")


@pytest.mark.slow
def test_a_run_folder_that_turns_unwritable_exits_74_in_one_line(tmp_path):
    # The logs' folder refuses new files: the history plot, written whole and
    # renamed into place at the first epoch's end, cannot be.
    run = Phalanx(tmp_path, *(arg for arg in ARGS if arg != "--no-plot"))
    run.wait_for(run.started, "progress line")
    with unwritable(tmp_path / "RUN"):
        code = ended(run)
    assert code == 74, run.output()
    assert_one_error_line(run, "cannot write the run's files", "--resume")


# --- commands that cannot run: exit 2, one line, nothing written --------------


def test_run_dir_in_an_unwritable_folder_is_refused(tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    with unwritable(parent):
        line = refused(tmp_path, "train", "--run-dir", "locked/a/RUN")
    assert line.startswith("phalanx train: error: --run-dir locked/a/RUN: ")
    assert "cannot write in" in line and "choose a folder you can write to" in line
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize(
    ("command", "phrase"),
    [
        ("nonexistent_cmd_for_phalanx", "not found on PATH"),
        ("./no/such/program", "no such file"),
    ],
)
def test_launch_of_a_command_that_cannot_run_is_refused(tmp_path, command, phrase):
    line = refused(tmp_path, "launch", "--nproc", "2", "--", command)
    assert line.startswith(f"phalanx launch: error: command {command!r}: ")
    assert phrase in line
