"""``phalanx find-lr``: the learning-rate range test from the command line,
on the model, data, strategy and optimizer ``phalanx train`` builds from the
same options. One real run, read back (its table, lr_find.json,
lr_find.png, the ``phalanx train`` command it prints); bad commands refused
in one line, with exit code 2, before any device work and with nothing
written."""

import argparse
import json
import os
import pathlib
import shlex
import sys

import matplotlib.image
import numpy as np
import pytest

import forkserver
from cli_runs import ENV, NOTICE, TIMEOUT, refused, said
from phalanx._env import NUM_PROCESSES
from phalanx.cli import main
from phalanx.cli._folder import FIND_LR_FILES, RunFolder
from phalanx.cli._main import build_parser


STEPS = 30
# The options given besides the range: passed on to the train command.
MODEL = ["--optimizer", "adam", "--hidden", "64"]


def table(stdout: str) -> dict[str, str]:
    """The rows of the table the run prints: label (16 columns), value."""
    rows = {}
    for line in stdout.splitlines():
        if not line.startswith("phalanx"):
            label, value = line[:16].strip(), line[17:]
            rows[label] = value
    return rows


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("find-lr")
    args = [*MODEL, "--steps", str(STEPS), "--run-dir", "RUN"]
    result = forkserver.run(
        [sys.executable, "-m", "phalanx", "find-lr", *args],
        cwd=cwd,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result, cwd / "RUN"


@pytest.mark.slow
def test_a_run_prints_what_it_found_and_writes_it(real_run):
    result, run = real_run
    assert said(result.stderr) == [NOTICE]  # no warning, no traceback
    banner = result.stdout.splitlines()[0]
    assert banner.startswith("phalanx: MLP 64-64-10 on digits (1437 train")
    assert banner.endswith("batch 64, rates 1e-07 to 10 in 30 steps")
    assert sorted(os.listdir(run)) == ["lr_find.json", "lr_find.png"]

    found = json.loads((run / "lr_find.json").read_text())
    assert (found["start"], found["end"], found["steps"]) == (1e-7, 10.0, STEPS)
    lrs, taken = found["lrs"], len(found["lrs"])
    assert 13 <= taken <= STEPS  # enough for a suggestion
    assert len(found["losses"]) == len(found["smoothed"]) == taken
    np.testing.assert_allclose(lrs, np.geomspace(1e-7, 10.0, STEPS)[:taken])
    assert all(loss is None or loss > 0 for loss in found["losses"])
    suggestion = found["suggestion"]
    assert suggestion in lrs and 1e-5 <= suggestion <= 1.0, suggestion

    rows = table(result.stdout)
    assert rows["lr range tried"] == f"{lrs[0]:.2g} to {lrs[-1]:.2g}"
    assert rows["steps run"] == f"{taken} of {STEPS}"
    # Where it diverged: the last rate, where the sweep stopped (its smoothed
    # loss above 4 times the best before, or not finite).
    *before, last = found["smoothed"]
    assert found["diverged"] == (last is None or last > 4 * min(before))
    assert found["diverged"] or taken == STEPS
    if found["diverged"]:
        assert rows["loss diverged"].startswith(f"at lr {lrs[-1]:.2g} (step {taken})")
    else:
        assert rows["loss diverged"].startswith("no")
    assert rows["suggested lr"].split()[0] == f"{suggestion:.2g}"

    # The command that trains with it: train's options as given, and --lr.
    command = rows["train with it"]
    assert command == found["train"]
    words = shlex.split(command)
    assert words == ["phalanx", "train", *MODEL, "--lr", f"{suggestion:.2g}"]
    trained = build_parser().parse_args(words[1:])
    assert (trained.optimizer, trained.hidden) == ("adam", (64,))
    assert trained.lr == pytest.approx(suggestion, rel=0.05)
    assert rows["files"].startswith("RUN/lr_find.json, RUN/lr_find.png (")

    png = run / "lr_find.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.std() > 0.05


# --- the options ----------------------------------------------------------------


def options(command: str) -> set[str]:
    (commands,) = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    parser = commands.choices[command]
    return {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}


def test_it_takes_trains_options_for_the_run_and_none_for_training():
    own = {"start", "end", "steps"}
    assert options("find-lr") - own <= options("train")
    training = {
        "epochs", "lr", "schedule", "schedule_steps", "checkpoint_every",
        "eval_every", "resume", "config", "loggers", "log_every", "profile",
        "steps_per_call", "distributed", "metrics", "telemetry", "slow_steps",
        "hang_timeout",
    }  # fmt: skip
    assert options("find-lr") == options("train") - training | own


# --- bad commands: exit code 2, one line, nothing written ---------------------


def snapshot(folder: pathlib.Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--start", "0"], ["--start", "positive finite number, got 0"]),
        (["--start", "-0.001"], ["--start", "positive finite number, got -0.001"]),
        (["--end", "inf"], ["--end", "positive finite number, got inf"]),
        (
            ["--start", "0.1", "--end", "0.01"],
            ["--end 0.01 is not above --start 0.1", "e.g. --end 10"],
        ),
        (["--start", "1", "--end", "1"], ["--end 1 is not above --start 1"]),
        (["--steps", "1"], ["--steps", "at least 2", "got 1"]),
        (["--steps", "ten"], ["--steps", "positive integer, got 'ten'"]),
        (["--epochs", "3"], ["unrecognized arguments: --epochs 3"]),
        (["--lr", "0.1"], ["unrecognized arguments: --lr 0.1"]),
        (["--resume"], ["unrecognized arguments: --resume"]),
        (["--checkpoint-every", "5"], ["unrecognized arguments: --checkpoint-every"]),
        (["--eval-every", "5"], ["unrecognized arguments: --eval-every"]),
        (["--shard", "all"], ["--shard all", "--strategy fsdp"]),
        (["--model", "foo"], ["--model", "'foo'", "linear", "mlp"]),
        (["--dataset", "foo"], ["--dataset 'foo'", "digits, mnist:PATH"]),
    ],
    ids=" ".join,
)
def test_bad_arguments_are_refused(tmp_path, capsys, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    try:
        code = main(["find-lr", *args, "--run-dir", "RUN"])
    except SystemExit as exit:  # argparse
        code = exit.code
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith(("phalanx find-lr: error: ", "phalanx: error: "))
    for needle in needles:
        assert needle in line
    assert snapshot(tmp_path) == before


def test_a_non_empty_folder_needs_overwrite(tmp_path, capsys, monkeypatch):
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "notes.txt").write_text("mine\n")
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    assert main(["find-lr", "--run-dir", "RUN"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "--run-dir RUN exists and is not empty" in line
    assert "lr_find.json, lr_find.png" in line  # what --overwrite replaces
    assert snapshot(tmp_path) == before


def test_under_launch_it_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(NUM_PROCESSES, "2")
    assert main(["find-lr", "--run-dir", "RUN"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "runs in one process" in line and "phalanx launch" in line
    assert os.listdir(tmp_path) == []


def test_the_command_refuses_as_a_user_runs_it(tmp_path):
    line = refused(tmp_path, "find-lr", "--steps", "1", "--run-dir", "RUN")
    assert line.startswith("phalanx find-lr: error: argument --steps: ")
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_only_its_own_files(tmp_path):
    # A train run's folder: find-lr --overwrite there leaves the run alone.
    files = {
        "config.toml": b"run",
        "metrics.csv": b"run",
        "checkpoints/23/host": b"run",
        "lr_find.json": b"old",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text)
    folder = RunFolder(tmp_path, resume=False, files=FIND_LR_FILES)
    folder.create(main=True)
    assert not (tmp_path / "lr_find.json").exists()
    (tmp_path / "lr_find.png").write_bytes(b"new")
    folder.undo()  # a failed sweep: what it wrote goes
    kept = {k: v for k, v in files.items() if k != "lr_find.json"}
    assert {k: v for k, v in snapshot(tmp_path).items() if v is not None} == kept
