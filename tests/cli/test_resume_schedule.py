"""``phalanx train --resume`` with other ``--epochs`` keeps the run's
learning-rate schedule (issue 29, item 3).

The schedule's length is written to config.toml when a run starts
(``schedule_steps``); a resumed run uses it whatever ``--epochs`` says. For
each built-in schedule, one uninterrupted run (a linear model, 3 epochs of 12
steps on 2 devices, the rate logged every step) is resumed from its first
epoch-end checkpoint (copies of its folder, the later checkpoints deleted)
with fewer and with more epochs: every logged rate and loss up to the
original end is the uninterrupted run's, and after it the rate stays at the
schedule's final value. Runs are in this process, as `phalanx.cli.main`.
"""

import csv
import pathlib
import re
import shutil
import tomllib

import pytest

from phalanx.cli import main


SCHEDULES = ("constant", "cosine", "warmup-cosine")
STEPS_PER_EPOCH, EPOCHS = 12, 3  # digits: 1437 examples, batch 128
TOTAL = STEPS_PER_EPOCH * EPOCHS
ARGS = [
    "--model", "linear", "--devices", "2", "--log-every", "1", "--logger", "csv",
    "--no-plot", "--lr", "0.05", "--batch-size", "128",
]  # fmt: skip


def train(cwd: pathlib.Path, monkeypatch, *args: str) -> None:
    monkeypatch.chdir(cwd)
    assert main(["train", *ARGS, *args]) == 0


def step_rows(run: pathlib.Path) -> dict[int, dict[str, str]]:
    """metrics.csv's step rows by step, each step exactly once."""
    with open(run / "metrics.csv", newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["kind"] == "step"]
    steps = [int(row["step"]) for row in rows]
    assert steps == list(range(1, len(rows) + 1))
    return dict(zip(steps, rows, strict=True))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Each schedule's uninterrupted run folder."""
    cwd = tmp_path_factory.mktemp("schedules")
    with pytest.MonkeyPatch.context() as monkeypatch:
        for schedule in SCHEDULES:
            run = f"RUN-{schedule}"
            train(
                cwd,
                monkeypatch,
                "--schedule",
                schedule,
                "--epochs",
                "3",
                "--run-dir",
                run,
            )
    return {schedule: cwd / f"RUN-{schedule}" for schedule in SCHEDULES}


def first_epoch_copy(straight: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    """`straight`'s folder with every checkpoint after the first epoch's end
    deleted."""
    run = to / "RUN"
    shutil.copytree(straight, run)
    for step in (2 * STEPS_PER_EPOCH, TOTAL):
        shutil.rmtree(run / "checkpoints" / str(step))
    left = [p.name for p in (run / "checkpoints").iterdir()]
    assert left == [str(STEPS_PER_EPOCH)]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("epochs", [2, 4], ids=["fewer-epochs", "more-epochs"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_with_other_epochs_keeps_the_schedule(
    tmp_path, monkeypatch, capsys, straight, schedule, epochs
):
    run = first_epoch_copy(straight[schedule], tmp_path)
    capsys.readouterr()
    train(
        tmp_path, monkeypatch, "--run-dir", "RUN", "--resume", "--epochs", str(epochs)
    )
    note = [line for line in capsys.readouterr().err.splitlines() if "schedule" in line]

    want, got = step_rows(straight[schedule]), step_rows(run)
    assert len(got) == epochs * STEPS_PER_EPOCH
    for step in range(1, min(epochs * STEPS_PER_EPOCH, TOTAL) + 1):
        # CSV cells are repr(float): equal text is equal bits.
        assert got[step]["lr"] == want[step]["lr"], step
        assert got[step]["loss"] == want[step]["loss"], step
    final = float(want[TOTAL]["lr"])
    assert final == (0.05 if schedule == "constant" else 0.0)
    for step in range(TOTAL + 1, epochs * STEPS_PER_EPOCH + 1):
        assert float(got[step]["lr"]) == final, step

    config = tomllib.loads((run / "config.toml").read_text())
    assert config["schedule_steps"] == TOTAL and config["epochs"] == epochs
    if schedule == "constant":  # its rate has no length to tell
        assert note == []
        return
    end = (
        f"from step {TOTAL} on, the rate stays at its final value"
        if epochs > EPOCHS
        else f"the run stops before the schedule's end, at step {2 * STEPS_PER_EPOCH}"
    )
    assert note == [
        f"phalanx: the {schedule} learning-rate schedule spans {TOTAL} steps, the "
        f"run {epochs * STEPS_PER_EPOCH} ({epochs} epochs of {STEPS_PER_EPOCH}); the "
        f"run's schedule, kept on --resume: {end}"
    ]


@pytest.mark.slow
def test_a_run_of_an_earlier_phalanx_keeps_its_stored_epochs(
    tmp_path, monkeypatch, straight
):
    # Its config.toml has no schedule_steps: the schedule spans its epochs.
    run = first_epoch_copy(straight["cosine"], tmp_path)
    config = (run / "config.toml").read_text()
    assert f"\nschedule_steps = {TOTAL}\n" in config
    (run / "config.toml").write_text(re.sub(r"\nschedule_steps = \d+\n", "\n", config))
    train(tmp_path, monkeypatch, "--run-dir", "RUN", "--resume", "--epochs", "4")
    want, got = step_rows(straight["cosine"]), step_rows(run)
    assert [got[s]["lr"] for s in want] == [want[s]["lr"] for s in want]
    assert tomllib.loads((run / "config.toml").read_text())["schedule_steps"] == TOTAL
