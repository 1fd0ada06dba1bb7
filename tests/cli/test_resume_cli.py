"""``phalanx train --resume`` end to end: runs killed with SIGKILL or stopped
with SIGTERM at chosen points, then resumed, end bitwise equal to a straight
run, with every log row written exactly once; checkpoints stay atomic while
the process is killed mid-save; bad ``--resume`` commands exit 2 in one line.

Each run is a subprocess, as a user would start it. Kills are triggered by
what the run shows: a progress line on stdout (printed every ``--log-every``
steps when stdout is not a terminal) or a step folder appearing in
RUN/checkpoints. The process may run a few steps past the trigger; a resume
then continues from the newest complete checkpoint, whatever that is, and the
tests check which kind of checkpoint it was.

Values are compared with an in-process reference: the CLI's trainer (same
model, optimizer, schedule, devices and data order) trained once, its full
state recorded after every step; the straight CLI run must equal it bitwise.
"""

import io
import json
import os
import pathlib
import re
import shutil
import signal
import sys
from collections.abc import Callable

import numpy as np
import optax
import pytest
from rich.console import Console
from typing_extensions import override

import phalanx as px
from cli_runs import (
    COMMON,
    EPOCHS,
    EVERY_5,
    LOG_EVERY,
    NOTICE,
    PROGRESS,
    STALE_TMP,
    STEPS_PER_EPOCH,
    TOTAL,
    Phalanx,
    assert_same_logs,
    assert_same_run,
    cli_trainer,
    csv_rows,
    finish,
    host_state,
    jsonl_rows,
    listed,
    logged_steps,
    refused,
    said,
    same_arrays,
    state_arrays,
)
from helpers import RaiseAt, make_data, make_model
from phalanx._preemption import Preempted
from phalanx.cli import main


# --- the straight run is the reference ----------------------------------------


@pytest.mark.slow
def test_straight_run_equals_the_in_process_reference(straight, reference, restore):
    run, _ = straight
    steps, latest = listed(run / "checkpoints")
    assert steps == [60, 65, TOTAL] and latest == TOTAL  # keep=3
    for step in steps:
        assert same_arrays(restore(run / "checkpoints", step), reference[step])
    assert sorted(os.listdir(run / "checkpoints")) == ["60", "65", "69"]


# --- SIGKILL at three points, then --resume -----------------------------------


def _checkpoint(step: int) -> Callable[[Phalanx, pathlib.Path], bool]:
    return lambda run, folder: (folder / str(step)).is_dir()


KILL_POINTS = {
    # trigger, and the steps the newest complete checkpoint may then be at
    # (saves are written behind training, so a kill soon after a step may
    # find its checkpoint not yet committed: the trigger waits for one)
    "mid-epoch": (_checkpoint(10), range(10, STEPS_PER_EPOCH)),
    "epoch-end": (_checkpoint(STEPS_PER_EPOCH), [STEPS_PER_EPOCH]),
    "later": (_checkpoint(50), range(50, TOTAL)),
}


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_resume_is_exact(tmp_path, straight, reference, restore, point):
    trigger, expected = KILL_POINTS[point]
    args = [*COMMON, *EVERY_5, "--run-dir", "RUN"]
    folder = tmp_path / "RUN" / "checkpoints"
    killed = Phalanx(tmp_path, *args)
    code = killed.signal_when(lambda run: trigger(run, folder), signal.SIGKILL)
    assert code == -signal.SIGKILL, killed.output()

    steps, latest = listed(folder)
    assert latest is not None and latest in expected, (steps, killed.output())
    assert same_arrays(restore(folder, latest), reference[latest])
    host = host_state(folder, latest)
    assert (host["step"], host["epoch"]) == (latest, latest // STEPS_PER_EPOCH)
    assert host["epoch_steps"] == latest % STEPS_PER_EPOCH
    # Rows the killed run wrote after its newest checkpoint are still there
    # now; the resumed run must replace them, not repeat them.

    resumed = finish(tmp_path, *args, "--resume")
    assert resumed.lines[-1] == straight[1]
    assert_same_run(tmp_path / "RUN", straight[0], restore)
    # Progress goes on counting the run's steps, out of the run's total.
    shown = [PROGRESS.search(line) for line in resumed.lines]
    first = latest + LOG_EVERY - latest % LOG_EVERY
    assert [int(m.group(1)) for m in shown if m] == list(
        range(first, TOTAL + 1, LOG_EVERY)
    )
    assert all(m.group(0).endswith(f"/{TOTAL}  ") for m in shown if m)
    # The killed part's timeline survives (its checkpoint holds it up to its
    # step, its file as far as it got), and the steps it made past the
    # checkpoint count as computed again.
    timeline = json.loads((tmp_path / "RUN" / "timeline.json").read_text())
    (part,) = timeline["earlier"]
    assert (part["first_step"], part["ended"]) == (0, None)
    assert latest <= part["last_step"] < TOTAL and part["wall_s"] > 0
    assert (timeline["first_step"], timeline["last_step"]) == (latest, TOTAL)
    assert timeline["total"]["steps_again"] == part["last_step"] - latest
    assert timeline["total"]["fits"] == 2
    # stderr: the notice, the line saying what was resumed, and at most
    # orbax's note on a temporary folder the kill left behind (it reuses the
    # name and removes it).
    notice, resumed_from, *rest = resumed.stderr.splitlines()
    assert notice == NOTICE
    epoch = latest // STEPS_PER_EPOCH + 1  # the one it goes on in, from 1
    assert resumed_from == (
        f"phalanx: resumed from step {latest} (epoch {epoch}) of "
        f"{folder.absolute()}/{latest}"
    )
    for line in rest:
        assert STALE_TMP.fullmatch(line), resumed.output()


# --- SIGTERM: save at the step boundary, exit 143, resume ---------------------


@pytest.mark.slow
def test_sigterm_saves_then_resume_is_exact(tmp_path, straight, reference, restore):
    # No --checkpoint-every: apart from the epoch ends, the only checkpoint is
    # the one the signal makes.
    args = [*COMMON, "--run-dir", "RUN"]
    folder = tmp_path / "RUN" / "checkpoints"
    stopped = Phalanx(tmp_path, *args)
    code = stopped.signal_when(lambda run: run.progress() >= 35, signal.SIGTERM)
    assert code == 143, stopped.output()

    notice, last = stopped.stderr.splitlines()
    assert notice == NOTICE
    saved = re.fullmatch(
        r"phalanx: stopped by SIGTERM at a step boundary; checkpoint saved in "
        r"(.+); continue with --resume",
        last,
    )
    assert saved is not None, last
    step = int(pathlib.Path(saved.group(1)).name)
    assert pathlib.Path(saved.group(1)) == folder.absolute() / str(step)
    assert 35 <= step < 2 * STEPS_PER_EPOCH, "expected a stop in epoch 2"
    assert listed(folder) == ([STEPS_PER_EPOCH, step], step)
    assert same_arrays(restore(folder, step), reference[step])
    host = host_state(folder, step)
    assert (host["epoch"], host["epoch_steps"]) == (1, step - STEPS_PER_EPOCH)
    # Every row up to the stop is in the logs, none after it.
    for rows in (csv_rows(tmp_path / "RUN")[1], jsonl_rows(tmp_path / "RUN")):
        assert logged_steps(rows) == (
            list(range(LOG_EVERY, step + 1, LOG_EVERY)),
            [STEPS_PER_EPOCH],
        )

    stopped_at = json.loads((tmp_path / "RUN" / "timeline.json").read_text())
    assert (stopped_at["first_step"], stopped_at["last_step"]) == (0, step)

    resumed = finish(tmp_path, *args, "--resume")
    assert said(resumed.stderr) == [
        NOTICE,
        f"phalanx: resumed from step {step} (epoch 2) of {folder.absolute()}/{step}",
    ]
    assert resumed.lines[-1] == straight[1]
    # The straight run also saved every 5 steps, which changes no value.
    assert_same_run(tmp_path / "RUN", straight[0], restore)
    # timeline.json holds both parts of the run: the stop saved its step,
    # so no step was computed twice.
    timeline = json.loads((tmp_path / "RUN" / "timeline.json").read_text())
    assert timeline["earlier"] == [
        {k: v for k, v in stopped_at.items() if k not in ("earlier", "total")}
    ]
    assert (timeline["first_step"], timeline["last_step"]) == (step, TOTAL)
    assert timeline["total"]["fits"] == 2 and timeline["total"]["steps_again"] == 0


@pytest.mark.slow
def test_steps_per_call_stops_at_a_call_boundary_and_resumes(
    tmp_path, reference, restore
):
    # 23 steps an epoch: 5 calls of 4 steps, then 3 steps one by one.
    args = [*COMMON, "--run-dir", "RUN", "--steps-per-call", "4"]
    folder = tmp_path / "RUN" / "checkpoints"
    stopped = Phalanx(tmp_path, *args)
    code = stopped.signal_when(lambda run: run.progress() >= 30, signal.SIGTERM)
    assert code == 143, stopped.output()
    _, step = listed(folder)
    assert step is not None
    assert step - STEPS_PER_EPOCH in (4, 8, 12, 16, 20, 23), step
    close = np.testing.assert_allclose
    for got, want in zip(restore(folder, step), reference[step], strict=True):
        close(got, want, rtol=0, atol=1e-6)
    finish(tmp_path, *args, "--resume")
    for got, want in zip(restore(folder, TOTAL), reference[TOTAL], strict=True):
        close(got, want, rtol=0, atol=1e-6)


# --- atomicity: SIGKILL while saving every step -------------------------------

# Seconds after the first progress line of each attempt (chained: each attempt
# resumes from what the previous kill left), spread over the ~85 ms save cycle.
KILL_DELAYS = (0.03, 0.41, 0.77, 1.12, 1.51)


def assert_checkpoints_sound(
    folder: pathlib.Path,
    reference: dict[int, list[np.ndarray]],
    restore: Callable[[pathlib.Path, int], list[np.ndarray]],
) -> int:
    """What a kill left is usable: returns the latest step.

    Step folders are exactly the steps orbax lists as complete, anything else
    is an orbax temporary folder or the folder retired steps are renamed into
    before deletion, and every listed step restores to the reference state at
    that step (a kill while orbax deleted an old step must not leave it
    listed and half-deleted).
    """
    names = os.listdir(folder)
    steps, latest = listed(folder)
    assert sorted(int(n) for n in names if n.isdigit()) == steps
    others = [n for n in names if not n.isdigit()]
    temporary = re.compile(r"\d+\.orbax-checkpoint-tmp(-\d+)?|retired")
    assert all(temporary.fullmatch(n) for n in others), names
    assert steps and latest is not None and latest == steps[-1]
    for step in steps:
        values = restore(folder, step)
        assert same_arrays(values, reference[step]), f"step {step} differs"
    return latest


@pytest.mark.slow
def test_sigkill_while_saving_every_step(tmp_path, straight, reference, restore):
    args = [*COMMON, "--checkpoint-every", "1", "--run-dir", "RUN"]
    folder = tmp_path / "RUN" / "checkpoints"
    latest = []
    for attempt, delay in enumerate(KILL_DELAYS):
        run = Phalanx(tmp_path, *args, *(["--resume"] if attempt else []))
        code = run.signal_when(Phalanx.started, signal.SIGKILL, after=delay)
        if code == 0:  # finished before the kill: nothing left to test
            break
        assert code == -signal.SIGKILL, run.output()
        latest.append(assert_checkpoints_sound(folder, reference, restore))
    assert len(latest) >= 3, latest
    resumed = finish(tmp_path, *args, "--resume")
    assert resumed.lines[-1] == straight[1]
    assert same_arrays(restore(folder, TOTAL), reference[TOTAL])
    assert_same_logs(tmp_path / "RUN", straight[0])


# A SIGKILL while orbax deletes a complete step folder in place (orbax does so
# on a local disk, and a half-deleted folder still counts as complete).
# Regression test: Checkpoint.save used to delete the *newest* checkpoint this
# way when the epoch-end snapshot replaced a step snapshot of the same step
# (manager.delete(trainer._step)), so a kill at that moment left a broken
# latest checkpoint and --resume failed. The wrapper kills the process from
# inside orbax's first removal of step 23's folder: half-way through an
# in-place delete, or right after a rename (an atomic way to delete). If no
# such removal happens, the run just finishes.
_KILL_IN_DELETE = """
import os, pathlib, signal, sys
from orbax.checkpoint._src.path import deleter

original = deleter.PathDeleter.delete

def delete(self, path, *, destination=None, overwrite=False):
    if path.name == "{step}" and path.parent.name == "checkpoints":
        if destination is None:
            folder = pathlib.Path(os.fspath(path))
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            for file in files[: len(files) // 2]:
                file.unlink()
        else:
            original(self, path, destination=destination, overwrite=overwrite)
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, path, destination=destination, overwrite=overwrite)

deleter.PathDeleter.delete = delete
from phalanx.cli import main
sys.exit(main())
"""


@pytest.mark.slow
def test_kill_while_an_epoch_end_checkpoint_replaces_its_step(
    tmp_path, straight, reference, restore
):
    args = [*COMMON, "--checkpoint-every", "1", "--run-dir", "RUN"]
    wrapper = (sys.executable, "-c", _KILL_IN_DELETE.format(step=STEPS_PER_EPOCH))
    killed = Phalanx(tmp_path, *args, prefix=wrapper)
    code = killed.wait()
    if code not in (0, -signal.SIGKILL):
        pytest.fail(f"the wrapped run failed:\n{killed.output()}")
    if code == -signal.SIGKILL:
        steps, _ = listed(tmp_path / "RUN" / "checkpoints")
        if not [step for step in steps if step != STEPS_PER_EPOCH]:
            pytest.fail(f"killed before another step was saved:\n{killed.output()}")
        resumed = Phalanx(tmp_path, *args, "--resume")
        assert resumed.wait() == 0, resumed.output()
        assert resumed.lines[-1] == straight[1]
    folder = tmp_path / "RUN" / "checkpoints"
    assert same_arrays(restore(folder, TOTAL), reference[TOTAL])
    assert_same_logs(tmp_path / "RUN", straight[0])


# --- in process: SIGTERM at an epoch's last step ------------------------------


def test_sigterm_at_an_epochs_last_step_resumes_exactly(tmp_path, reference_run):
    reference, history = reference_run

    # The snapshot holds the whole epoch's sums but not its end (table row,
    # evaluation, epoch-end checkpoint): the resumed fit only ends the epoch.
    class Term(px.Callback):
        @override
        def on_step_end(self, info):
            if info.step == STEPS_PER_EPOCH:
                os.kill(os.getpid(), signal.SIGTERM)

    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=None)
    trainer, loader = cli_trainer([Term(), checkpoint])
    with pytest.raises(KeyboardInterrupt, match="SIGTERM") as stop:
        trainer.fit(loader, epochs=EPOCHS)
    assert isinstance(stop.value, Preempted)
    assert stop.value.exit_code == 143
    assert listed(tmp_path) == ([STEPS_PER_EPOCH], STEPS_PER_EPOCH)
    host = host_state(tmp_path, STEPS_PER_EPOCH)
    assert (host["epoch"], host["epoch_steps"]) == (0, STEPS_PER_EPOCH)
    assert host["history"]["epochs"] == []

    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=None)
    resumed, loader = cli_trainer([checkpoint])
    resumed.fit(loader, epochs=EPOCHS, resume="latest")
    assert same_arrays(state_arrays(resumed), reference[TOTAL])
    # The replayed epoch end reports every metric (a regression: it once left
    # out accuracy, as no batch had built the steps yet).
    assert resumed.history.epochs == history


# --- in process: what the resumed run shows ----------------------------------


def test_resumed_table_numbers_epochs_as_the_run_does(tmp_path):
    def fit(callbacks, resume=None):
        x, y = make_data(100, seed=3)
        loader = px.data.ArrayLoader((x, y), 16, seed=1)  # 7 steps per epoch
        checkpoint = px.callbacks.Checkpoint(tmp_path)
        trainer = px.DataParallelTrainer(
            make_model(), optax.sgd(0.1), callbacks=[*callbacks, checkpoint]
        )
        trainer.fit(loader, epochs=3, resume=resume)

    with pytest.raises(RuntimeError, match="boom at step 10"):
        fit([RaiseAt(10)])  # in epoch 2 of 7 steps; last checkpoint: 7
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=120)
    fit([px.callbacks.ProgressBar(log_every=100, console=console)], "latest")
    rows = [line.split()[0] for line in out.getvalue().splitlines()[1:]]
    assert rows == ["2/3", "3/3"]


# --- bad --resume commands: exit 2, one line, nothing written ------------------


def snapshot(folder: pathlib.Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def _no_run_dir(cwd: pathlib.Path) -> None:
    del cwd


def _empty_run_dir(cwd: pathlib.Path) -> None:
    (cwd / "RUN").mkdir()


def _logs_but_no_checkpoint(cwd: pathlib.Path) -> None:
    # A run killed during its first save: logs, and only orbax's temporary
    # folder.
    (cwd / "RUN" / "checkpoints" / "5.orbax-checkpoint-tmp").mkdir(parents=True)
    (cwd / "RUN" / "metrics.csv").write_text("kind,step,epoch\n")


NO_CHECKPOINT = {
    "missing": _no_run_dir,
    "empty": _empty_run_dir,
    "unfinished-save": _logs_but_no_checkpoint,
}


@pytest.mark.parametrize("case", NO_CHECKPOINT)
def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys, monkeypatch, case):
    NO_CHECKPOINT[case](tmp_path)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert main(["train", "--run-dir", "RUN", "--resume"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("phalanx train: error: --resume: no checkpoint in ")
    assert "RUN/checkpoints" in err
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_resume_errors_from_the_command_line(tmp_path):
    # The real command: exit code 2, one line on stderr, nothing written.
    (tmp_path / "RUN").mkdir()
    before = snapshot(tmp_path)
    for args, needle in (
        (["--resume"], "--resume: no checkpoint in RUN/checkpoints"),
        (["--resume", "--overwrite"], "cannot be combined with --overwrite"),
    ):
        line = refused(tmp_path, "train", "--run-dir", "RUN", *args)
        assert line.startswith("phalanx train: error: ") and needle in line
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_resume_with_other_model_flags_is_refused(
    tmp_path, capsys, monkeypatch, straight
):
    shutil.copytree(straight[0] / "checkpoints", tmp_path / "RUN" / "checkpoints")
    monkeypatch.chdir(tmp_path)
    argv = ["train", *COMMON, "--hidden", "32", "--run-dir", "RUN", "--resume"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "another model" in err
