"""``phalanx train --metric``: one real run logging F1 and AUC beside the
accuracy (its files read back), the option in run configs and on
``--resume``, and bad uses refused in one line, with exit code 2, before
any device work and with nothing written."""

import csv
import json
import math
import os
import pathlib
import sys
import tomllib

import numpy as np
import pytest

import forkserver
from cli_runs import ENV, NOTICE, TIMEOUT, host_state, refused
from phalanx.cli import main
from phalanx.cli._args import TrainArgs, UsageError
from phalanx.cli._config import resolve_train
from phalanx.cli._main import build_parser


# 12 steps of 128 on the digits: an epoch, a log point every 4 steps.
SHORT = ["--epochs", "1", "--hidden", "16", "--batch-size", "128", "--lr", "0.5"]
SHORT += ["--log-every", "4", "--no-plot"]  # the default loggers: 2 skip arrays
METRICS = ["--metric", "f1", "--metric", "auc", "--metric", "confusion_matrix"]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("metrics")
    command = ["train", *SHORT, *METRICS, "--run-dir", "RUN"]
    result = forkserver.run(
        [sys.executable, "-m", "phalanx", *command],
        cwd=cwd,
        env=ENV,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result, cwd / "RUN"


@pytest.mark.slow
def test_a_run_logs_the_metrics_asked_for(real_run):
    result, run = real_run
    # No warning, no traceback; the CSV file leaves the matrices out, and one
    # line says so (for every logger, the training and test matrices).
    assert result.stderr.splitlines() == [
        NOTICE,
        "phalanx: loggers that write numbers only (CSV, TensorBoard, MLflow, "
        "W&B) leave out 'confusion_matrix' (an array of shape (10, 10)) and its "
        "evaluations' (eval_...); it is in trainer.history, and a JSONLogger "
        "writes it",
    ]
    names = ["accuracy", "auc", "f1"]  # accuracy always, beside those asked for
    with open(run / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    steps = [row for row in rows if row["kind"] == "step"]
    (epoch,) = [row for row in rows if row["kind"] == "epoch"]
    assert [int(row["step"]) for row in steps] == [4, 8, 12]
    for row in steps:
        for name in names:
            assert 0.0 <= float(row[name]) <= 1.0, (name, row)
    for name in (*names, *(f"eval_{n}" for n in names)):
        assert 0.0 <= float(epoch[name]) <= 1.0, (name, epoch)
    # The JSON lines and the checkpoint's history: the same epoch's values.
    lines = [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    (history,) = [line for line in lines if line["kind"] == "epoch"]
    (kept,) = host_state(run / "checkpoints", 12)["history"]["epochs"]
    for name in ("f1", "auc", "eval_f1", "eval_auc"):
        assert math.isclose(history[name], float(epoch[name]), rel_tol=1e-12)
        assert math.isclose(history[name], kept[name], rel_tol=1e-12)
    # The matrices: every example of the epoch (1437) and of the test set (360).
    matrix, test = (
        np.array(history[n]) for n in ("confusion_matrix", "eval_confusion_matrix")
    )
    assert matrix.shape == test.shape == (10, 10)
    assert (matrix.sum(), test.sum()) == (1437, 360)
    assert np.trace(test) / 360 == pytest.approx(history["eval_accuracy"], abs=1e-6)
    # A trained model ranks far better than chance.
    assert history["eval_auc"] > 0.8 and history["eval_f1"] > 0.3
    # The last line: each test metric (the evaluation at the epoch's end).
    last = result.stdout.splitlines()[-1]
    assert last == (
        f"test loss {history['eval_loss']:.4f}, test accuracy "
        f"{history['eval_accuracy']:.4f}, test auc {history['eval_auc']:.4f}, "
        f"test f1 {history['eval_f1']:.4f}; logs in RUN"
    )
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["metrics"] == ["f1", "auc", "confusion_matrix"]


# --- in run configs and on --resume -------------------------------------------


def resolve(*argv: str) -> TrainArgs:
    argv = ("train", *argv)
    return resolve_train(argv, build_parser().parse_args(argv))


def test_a_config_file_holds_them_as_a_list(tmp_path):
    (tmp_path / "c.toml").write_text('metrics = ["auc", "confusion_matrix"]\n')
    args = resolve("--config", str(tmp_path / "c.toml"), "--run-dir", "R")
    assert args.metrics == ("auc", "confusion_matrix")
    assert args.config()["metrics"] == ["auc", "confusion_matrix"]
    # None asked for: accuracy alone, and nothing written for them.
    assert resolve("--run-dir", "R").metrics == ()
    assert "metrics" not in resolve("--run-dir", "R").config()


def test_resume_keeps_the_runs_metrics(tmp_path):
    run = tmp_path / "RUN"
    run.mkdir()
    (run / "config.toml").write_text('metrics = ["f1", "auc"]\nschedule_steps = 9\n')
    assert resolve("--run-dir", str(run), "--resume").metrics == ("f1", "auc")
    # The same set, in another order, with accuracy (always logged): the same.
    again = ("--metric", "auc", "--metric", "accuracy", "--metric", "f1")
    resumed = resolve("--run-dir", str(run), "--resume", *again)
    assert resumed.metrics == ("auc", "accuracy", "f1")
    with pytest.raises(UsageError) as refusal:
        resolve("--run-dir", str(run), "--resume", "--metric", "auc")
    assert str(refusal.value).startswith(
        "--resume: --metric auc differs from this run's f1 auc"
    )
    assert "another set of metrics than the checkpoint holds" in str(refusal.value)


# --- bad commands: exit code 2, one line, nothing written ---------------------


def snapshot(folder: pathlib.Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def one_class(folder: pathlib.Path) -> None:
    """one.npz: labels of one class only."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 4)).astype(np.float32)
    labels = np.zeros(12, np.int64)
    np.savez(folder / "one.npz", x_train=x, y_train=labels, x_test=x, y_test=labels)


@pytest.mark.parametrize(
    ("argv", "config", "needles"),
    [
        (
            ["train", "--metric", "f2"],
            None,
            ["argument --metric: invalid choice: 'f2'", "'f1'", "'confusion_matrix'"],
        ),
        (
            ["train", "--metric", "F1"],
            None,
            ["argument --metric: invalid choice: 'F1'"],
        ),
        (
            ["train", "--config", "c.toml"],
            'metrics = ["f1", "roc"]\n',
            ["--config c.toml: metrics = ['f1', 'roc']", "invalid choice: 'roc'"],
        ),
        (
            ["train", "--config", "c.toml"],
            'metrics = "f1"\n',
            ["metrics = 'f1' is a str", 'a list of strings, e.g. ["a", "b"]'],
        ),
        (
            ["train", "--metric", "f1", "--dataset", "npz:one.npz"],
            None,
            ["--metric f1 scores a classifier of two classes or more", "is 0"],
        ),
        (
            ["find-lr", "--metric", "f1"],
            None,
            ["unrecognized arguments: --metric f1"],
        ),
    ],
    ids=["unknown", "case", "config", "config-string", "one-class", "find-lr"],
)
def test_bad_metrics_are_refused(tmp_path, capsys, monkeypatch, argv, config, needles):
    monkeypatch.chdir(tmp_path)
    one_class(tmp_path)
    if config is not None:
        (tmp_path / "c.toml").write_text(config)
    before = snapshot(tmp_path)
    try:
        code = main([*argv, "--run-dir", "RUN"])
    except SystemExit as exit:  # argparse
        code = exit.code
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    (line,) = err.splitlines()
    assert line.startswith(("phalanx train: error: ", "phalanx: error: "))
    for needle in needles:
        assert needle in line, line
    assert snapshot(tmp_path) == before


def test_the_command_refuses_as_a_user_runs_it(tmp_path):
    line = refused(tmp_path, "train", "--metric", "mse", "--run-dir", "RUN")
    assert line.startswith("phalanx train: error: argument --metric: invalid choice")
    assert "(see phalanx train --help)" in line
    assert os.listdir(tmp_path) == []
