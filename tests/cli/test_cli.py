"""``phalanx train``: end-to-end runs in subprocesses, every log file read back,
strategies agreeing, and bad commands refused in one line with nothing written.
"""

import csv
import json
import math
import os
import pathlib
import re
import resource
import subprocess
import sys
import time

import jax
import matplotlib.image
import numpy as np
import pytest

import forkserver
from cli_runs import said
from helpers import read_event_scalars
from phalanx import __version__ as px_version
from phalanx.cli import main
from phalanx.data import load_digits, write_records


# The tests' compilation cache (tests/conftest.py), left out of a run timed
# as a user's.
_CACHE_SETTINGS = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")


OPTIONS = (
    "--model",
    "--hidden",
    "--dataset",
    "--strategy",
    "--shard",
    "--mesh",
    "--precision",
    "--microbatches",
    "--devices",
    "--batch-size",
    "--epochs",
    "--lr",
    "--optimizer",
    "--schedule",
    "--schedule-steps",
    "--clip-norm",
    "--seed",
    "--run-dir",
    "--overwrite",
    "--log-every",
    "--checkpoint-every",
    "--eval-every",
    "--resume",
    "--distributed",
    "--model-arg",
    "--config",
    "--logger",
    "--no-plot",
    "--profile",
    "--telemetry",
    "--slow-steps",
)
RUN_FILES = [
    "checkpoints",
    "config.toml",
    "history.png",
    "metrics.csv",
    "metrics.jsonl",
    "tensorboard",
    "timeline.json",
]
NOTICE = (
    "phalanx: no accelerator found; using 8 fake CPU devices (--devices N to change)"
)
EPOCHS, LOG_EVERY, BATCH = 3, 5, 64
# Every epoch metric: the learning rate (LearningRateMonitor's) included.
TABLE_COLUMNS = [
    "epoch", "loss", "accuracy", "lr", "ex/s", "eval loss", "eval acc", "time"
]  # fmt: skip
FINAL_LINE = re.compile(r"test loss (\d+\.\d{4}), test accuracy (\d+\.\d{4}); logs in")
# ProgressBar's plain line, printed every --log-every steps when stdout is not
# a terminal: "epoch 1/3  step 5/69  loss 2.1358  450 ex/s  eta 0:00:09".
PROGRESS_LINE = re.compile(
    r"epoch (\d+)/(\d+)  step (\d+)/(\d+)  loss (\d+\.\d{4})  ([\d,]+) ex/s"
    r"  eta (\d+):(\d\d):(\d\d)"
)


def phalanx(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m phalanx ARGS` in `cwd`, as a user would run it (started
    by the fork server, forkserver.py)."""
    return forkserver.run(
        [sys.executable, "-m", "phalanx", *args],
        cwd=cwd,
        # CPU even on a host with accelerators: the expected output names
        # fake CPU devices.
        env={**os.environ, "NPROC": "16", "JAX_PLATFORMS": "cpu"},
        timeout=300,
    )


def train(cwd: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A run that must succeed; shows its output if it does not."""
    result = phalanx(cwd, "train", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def read_csv(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        rows = list(reader)
    assert reader.fieldnames is not None
    assert reader.fieldnames[:3] == ["kind", "step", "epoch"]
    # A short line would fill with None, a long one would add a None key.
    assert all(None not in row and None not in row.values() for row in rows)
    return rows


def read_jsonl(path: pathlib.Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def epoch_rows(path: pathlib.Path) -> list[dict]:
    return [row for row in read_jsonl(path) if row["kind"] == "epoch"]


def snapshot(folder: pathlib.Path) -> dict[str, bytes | None]:
    """Every path under `folder`, with file contents (None for folders)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


# --- one default-ish run, read back by several tests --------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("default")
    args = ["--epochs", str(EPOCHS), "--run-dir", "RUN", "--log-every", "5"]
    result = train(cwd, *args)
    return result, cwd / "RUN"


@pytest.fixture(scope="module")
def steps_per_epoch() -> int:
    (x_train, _), _ = load_digits()
    return math.ceil(len(x_train) / BATCH)


@pytest.mark.slow
def test_run_prints_table_and_test_accuracy(default_run, steps_per_epoch):
    result, run = default_run
    assert said(result.stderr) == [NOTICE]  # no warnings, no traceback
    lines = result.stdout.splitlines()
    assert "ShardingStrategy on 8 cpu device(s), batch 64, 3 epochs" in lines[0]

    headers = [line for line in lines if line.split()[:2] == ["epoch", "loss"]]
    assert len(headers) == 1
    positions = [headers[0].index(column) for column in TABLE_COLUMNS]
    assert positions == sorted(positions)

    rows = [line.split() for line in lines if re.match(rf"\s+\d+/{EPOCHS}\s", line)]
    assert [row[0] for row in rows] == [f"{e}/{EPOCHS}" for e in (1, 2, 3)]
    logged = epoch_rows(run / "metrics.jsonl")
    for row, logs in zip(rows, logged, strict=True):
        assert row[1] == f"{logs['loss']:.4f}"
        assert row[2] == f"{logs['accuracy']:.4f}"
        assert row[3] == f"{logs['lr']:.4f}"
        assert row[5] == f"{logs['eval_loss']:.4f}"
        assert row[6] == f"{logs['eval_accuracy']:.4f}"
        assert row[7].endswith("s")

    final = FINAL_LINE.match(lines[-1])
    assert final is not None, lines[-1]
    assert lines[-1].endswith("logs in RUN")
    # The final evaluation is of the trained model: the last epoch's eval.
    assert final.group(1) == f"{logged[-1]['eval_loss']:.4f}"
    assert final.group(2) == f"{logged[-1]['eval_accuracy']:.4f}"
    assert float(final.group(2)) > 0.9

    # Progress while it works: a plain line every LOG_EVERY steps (captured
    # stdout is no terminal), each before its epoch's table row.
    total = EPOCHS * steps_per_epoch
    progress: list[tuple[int, re.Match[str]]] = []
    for index, line in enumerate(lines):
        if line.startswith("epoch ") and " step " in line:
            match = PROGRESS_LINE.fullmatch(line)
            assert match, line
            progress.append((index, match))
    assert progress, lines
    steps = [int(match.group(3)) for _, match in progress]
    assert steps == list(range(LOG_EVERY, total + 1, LOG_EVERY))
    row_index = [i for i, line in enumerate(lines) if re.match(r"\s+\d+/\d+\s", line)]
    step_rows = {
        int(r["step"]): r for r in read_csv(run / "metrics.csv") if r["kind"] == "step"
    }
    for (index, match), step in zip(progress, steps, strict=True):
        epoch = (step - 1) // steps_per_epoch + 1
        assert match.group(1, 2) == (str(epoch), str(EPOCHS)), match.group(0)
        assert match.group(4) == str(total), match.group(0)
        after = row_index[epoch - 2] if epoch > 1 else 0
        assert after < index < row_index[epoch - 1], match.group(0)
        # The loss shown is the step's logged loss.
        assert match.group(5) == f"{float(step_rows[step]['loss']):.4f}"
        assert int(match.group(6).replace(",", "")) > 0, match.group(0)
        assert int(match.group(8)) < 60 and int(match.group(9)) < 60


@pytest.mark.slow
def test_run_folder_holds_only_the_logs(default_run):
    result, run = default_run
    assert sorted(os.listdir(run)) == RUN_FILES
    # timeline.json on every run; its table and trace.json with --telemetry.
    assert "where the time went" not in result.stdout
    assert json.loads((run / "timeline.json").read_text())["goodput"] > 0
    assert len(os.listdir(run / "tensorboard")) == 1


@pytest.mark.slow
def test_metrics_csv(default_run, steps_per_epoch):
    _, run = default_run
    rows = read_csv(run / "metrics.csv")
    total = EPOCHS * steps_per_epoch
    steps = [row for row in rows if row["kind"] == "step"]
    epochs = [row for row in rows if row["kind"] == "epoch"]
    assert len(steps) + len(epochs) == len(rows)
    # Every log_every steps, exactly once, with that step's epoch.
    assert [int(r["step"]) for r in steps] == list(range(LOG_EVERY, total + 1, 5))
    assert [int(r["epoch"]) for r in steps] == [
        (int(r["step"]) - 1) // steps_per_epoch for r in steps
    ]
    assert [(int(r["step"]), int(r["epoch"])) for r in epochs] == [
        ((e + 1) * steps_per_epoch, e) for e in range(EPOCHS)
    ]
    for row in steps:
        assert row["eval_loss"] == row["eval_accuracy"] == ""
        assert math.isfinite(float(row["loss"]))
        assert 0 <= float(row["accuracy"]) <= 1
        assert float(row["lr"]) > 0
    for row in epochs:
        assert float(row["eval_loss"]) > 0
        assert 0 <= float(row["eval_accuracy"]) <= 1
    assert float(epochs[-1]["loss"]) < float(epochs[0]["loss"])


@pytest.mark.slow
def test_metrics_jsonl_matches_csv(default_run):
    _, run = default_run
    rows = read_csv(run / "metrics.csv")
    lines = read_jsonl(run / "metrics.jsonl")
    assert len(lines) == len(rows)
    for line, row in zip(lines, rows, strict=True):
        assert line["kind"] == row["kind"]
        assert (line["step"], line["epoch"]) == (int(row["step"]), int(row["epoch"]))
        filled = {k for k, v in row.items() if v != ""} - {"kind", "step", "epoch"}
        assert set(line) - {"kind", "step", "epoch"} == filled
        assert {k: line[k] for k in filled} == {k: float(row[k]) for k in filled}


@pytest.mark.slow
def test_tensorboard_scalars_match_csv(default_run):
    _, run = default_run
    rows = read_csv(run / "metrics.csv")
    scalars = read_event_scalars(run / "tensorboard")
    steps = [row for row in rows if row["kind"] == "step"]
    epochs = [row for row in rows if row["kind"] == "epoch"]

    def values(rows, column):
        # Event files hold float32.
        return [(int(r["step"]), float(np.float32(r[column]))) for r in rows]

    for name in ("loss", "accuracy", "lr"):
        assert scalars[f"train/{name}"] == values(steps, name)
        assert scalars[f"epoch/{name}"] == values(epochs, name)
    for name in ("loss", "accuracy"):
        assert scalars[f"eval/{name}"] == values(epochs, f"eval_{name}")


@pytest.mark.slow
def test_history_png(default_run):
    _, run = default_run
    png = run / "history.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0.05  # something is drawn


# --- the README's main job, as written ----------------------------------------


def _children_cpu() -> float:
    """CPU seconds of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.slow
def test_readme_main_job(tmp_path, record_property):
    # The README's Quick start: install, then `phalanx train` with no arguments.
    readme = (
        pathlib.Path(__file__).resolve().parent.parent.parent / "README.md"
    ).read_text()
    assert '&& pip install -e ".[logs]" && phalanx train\n' in readme
    script = pathlib.Path(sys.executable).with_name("phalanx")  # console script
    assert script.exists(), f"{script} missing: install with pip install -e ."
    run = tmp_path / "run"  # --run-dir only keeps the default runs/ out of cwd
    # As a user would run it: no NPROC (the CLI sets its own for fake devices)
    # nor the tests' XLA_FLAGS and compilation cache; CPU even on a host with
    # accelerators, as the acceptance is for 8 fake CPU devices.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NPROC", "XLA_FLAGS") and not k.startswith(_CACHE_SETTINGS)
    }
    env["JAX_PLATFORMS"] = "cpu"
    start, before = time.perf_counter(), _children_cpu()
    result = subprocess.run(
        [str(script), "train", "--run-dir", str(run)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall, cpu = time.perf_counter() - start, _children_cpu() - before
    print(f"phalanx train (the README's main job): {wall:.1f} s, {cpu:.1f} s CPU")
    record_property("wall_s", round(wall, 1))  # in --junitxml reports
    record_property("cpu_s", round(cpu, 1))
    assert result.returncode == 0, result.stdout + result.stderr
    assert said(result.stderr) == [NOTICE]
    lines = result.stdout.splitlines()
    assert "MLP 64-256-128-10 on digits" in lines[0]
    final = FINAL_LINE.match(lines[-1])
    assert final is not None, lines[-1]
    assert float(final.group(2)) >= 0.97, lines[-1]
    # The bound is 60 s on its 2-core machine (about 30 s there);
    # 120 s leaves room for slower CI machines while still catching a job
    # that has become several times slower. Bounded in CPU seconds, which
    # the tests running beside it on the same cores do not inflate as they
    # do its wall time (the job keeps about one core busy).
    assert cpu < 120, f"phalanx train took {cpu:.1f} s of CPU ({wall:.1f} s)"
    for name in ("metrics.csv", "metrics.jsonl", "history.png"):
        assert (run / name).stat().st_size > 0, name
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # The job spends its time training: drawing history.png is off the
    # training thread and within 2% of the fit (issue 41: 44 s of 57 s went
    # to redrawing it at each epoch end), and every callback is timed.
    timeline = json.loads((run / "timeline.json").read_text())
    seconds, wall = timeline["callbacks"], timeline["wall_s"]
    assert seconds["PlotHistory"] <= 0.02 * wall, (seconds, wall)
    print(f"callbacks: {timeline['phases']['callbacks'] / wall:.1%} of the fit")
    record_property("callbacks_share", round(timeline["phases"]["callbacks"] / wall, 3))


# The runs compared with the default run: its options, without drawing
# history.png (tested above).
COMPARED = ["--epochs", str(EPOCHS), "--log-every", "5", "--no-plot"]


@pytest.mark.slow
def test_bf16_reaches_the_accuracy_of_fp32(default_run, tmp_path):
    # Float32 weights, bfloat16 forward and backward passes: the test
    # accuracy within half a point of the float32 run's.
    result, _ = default_run
    common = [*COMPARED, "--run-dir", "RUN"]
    bf16 = train(tmp_path, *common, "--precision", "bf16")
    assert bf16.stdout.splitlines()[0].endswith(", bf16")
    accuracy = [
        float(FINAL_LINE.match(run.stdout.splitlines()[-1]).group(2))  # type: ignore[union-attr]
        for run in (result, bf16)
    ]
    assert abs(accuracy[0] - accuracy[1]) <= 0.005, accuracy


# --- strategies, accumulation and device counts agree -------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "banner"),
    [
        (["--strategy", "pmap"], "PmapStrategy on 8 cpu device(s)"),
        (["--microbatches", "4"], "AccumulatingStrategy on 8 cpu device(s)"),
        (["--devices", "1"], "ShardingStrategy on 1 cpu device(s)"),
        (["--strategy", "fsdp"], "FullyShardedStrategy on 8 cpu device(s)"),
        (
            ["--strategy", "mesh", "--mesh", "data=2,fsdp=4"],
            "MeshStrategy on 8 cpu device(s)",
        ),
    ],
    ids=["pmap", "microbatches-4", "devices-1", "fsdp", "mesh"],
)
def test_same_losses_as_the_default(default_run, tmp_path, args, banner):
    _, default = default_run
    common = [*COMPARED, "--run-dir", "RUN"]
    result = train(tmp_path, *common, *args)
    assert banner in result.stdout.splitlines()[0]
    expected = epoch_rows(default / "metrics.jsonl")
    got = epoch_rows(tmp_path / "RUN" / "metrics.jsonl")
    assert [row["step"] for row in got] == [row["step"] for row in expected]
    for row, reference in zip(got, expected, strict=True):
        for name in ("loss", "eval_loss"):
            assert row[name] == pytest.approx(reference[name], abs=1e-4)
    final = FINAL_LINE.match(result.stdout.splitlines()[-1])
    assert final is not None
    assert float(final.group(1)) == pytest.approx(expected[-1]["eval_loss"], abs=1e-4)


@pytest.mark.slow
def test_eval_every_writes_eval_rows(tmp_path, steps_per_epoch):
    args = ["--epochs", "1", "--eval-every", "5", "--no-plot", "--run-dir", "RUN"]
    # (--telemetry on this run too: tested below, it changes no value.)
    result = train(tmp_path, *args, "--telemetry")
    rows = read_jsonl(tmp_path / "RUN" / "metrics.jsonl")
    evals = [row for row in rows if row["kind"] == "eval"]
    assert [row["step"] for row in evals] == list(range(5, steps_per_epoch + 1, 5))
    assert {"eval_loss", "eval_accuracy"} <= set(evals[0])
    assert "eval_loss" not in epoch_rows(tmp_path / "RUN" / "metrics.jsonl")[0]
    config = (tmp_path / "RUN" / "config.toml").read_text()
    assert "eval_every = 5" in config
    assert "telemetry" not in config  # this command's output, not the run's

    # --telemetry: the Timeline's table at the end, before the final line,
    # and its trace beside timeline.json.
    assert said(result.stderr) == [NOTICE]
    lines = result.stdout.splitlines()
    (title,) = [i for i, line in enumerate(lines) if "where the time went" in line]
    assert FINAL_LINE.match(lines[-1]) and title < len(lines) - 1
    table = "\n".join(lines[title:-1])
    for phase in ("step", "compile", "data", "eval", "checkpoint", "callbacks"):
        assert re.search(rf"^\W*{phase}\s", table, flags=re.M), (phase, table)
    assert "compile: train step, batch f32[64,64] i32[64]" in table
    run = tmp_path / "RUN"
    assert sorted(os.listdir(run)) == [
        "checkpoints", "config.toml", "metrics.csv", "metrics.jsonl",
        "tensorboard", "timeline.json", "trace.json",
    ]  # fmt: skip
    record = json.loads((run / "timeline.json").read_text())
    assert sum(record["phases"].values()) == pytest.approx(record["wall_s"])
    # The table names the callbacks that took the most time (five of them).
    seconds = record["callbacks"]
    for name in sorted(seconds, key=seconds.__getitem__, reverse=True)[:5]:
        assert f"callback: {name}" in table, (name, table)
    named = {"Throughput", "LearningRateMonitor", "Timeline", "ProgressBar"}
    assert named | {"CSVLogger", "JSONLogger", "Checkpoint"} <= set(record["callbacks"])
    assert record["phases"]["eval"] > 0 and record["phases"]["checkpoint"] > 0
    assert 0 < record["goodput"] < 1
    (epoch,) = epoch_rows(run / "metrics.jsonl")  # logged, as the history
    assert epoch["goodput"] == record["epochs"][0]["step"] / record["epochs"][0]["wall"]
    assert epoch["time/eval"] == record["epochs"][0]["eval"]
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"step", "eval", "data"}


# --- other data, --overwrite, --help ------------------------------------------


@pytest.mark.slow
def test_npz_dataset_trains(tmp_path):
    rng = np.random.default_rng(0)
    centres = rng.normal(scale=3.0, size=(3, 20))

    def blobs(n):
        y = rng.integers(0, 3, size=n)
        return (centres[y] + rng.normal(size=(n, 20))).astype(np.float32), y

    (x_train, y_train), (x_test, y_test) = blobs(256), blobs(96)
    np.savez(
        tmp_path / "blobs.npz",
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
    )
    args = ["--dataset", "npz:blobs.npz", "--epochs", "2", "--batch-size", "32"]
    result = train(tmp_path, *args, "--hidden", "16", "--run-dir", "RUN")
    assert "MLP 20-16-3 on npz:blobs.npz (256 train / 96 test)" in result.stdout
    final = FINAL_LINE.match(result.stdout.splitlines()[-1])
    assert final is not None and float(final.group(2)) > 0.9
    assert sorted(os.listdir(tmp_path / "RUN")) == RUN_FILES
    assert [row["step"] for row in epoch_rows(tmp_path / "RUN" / "metrics.jsonl")] == [
        8,
        16,
    ]


@pytest.mark.slow
def test_overwrite_replaces_only_its_own_files(tmp_path):
    run = tmp_path / "RUN"
    (run / "mine").mkdir(parents=True)
    (run / "notes.txt").write_text("my notes\n")
    (run / "mine" / "data.txt").write_text("keep me\n")
    (run / "metrics.csv").write_text("stale,file\n1,2\n")
    train(tmp_path, "--epochs", "1", "--run-dir", "RUN", "--overwrite")
    assert sorted(os.listdir(run)) == sorted([*RUN_FILES, "mine", "notes.txt"])
    assert (run / "notes.txt").read_text() == "my notes\n"
    assert (run / "mine" / "data.txt").read_text() == "keep me\n"
    rows = read_csv(run / "metrics.csv")  # rewritten, not appended to
    assert [row["kind"] for row in rows][-1] == "epoch"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"phalanx {px_version}\n"


@pytest.mark.parametrize("abbreviated", ["--epoch", "--batch", "--strat"])
def test_options_are_not_abbreviated(tmp_path, capsys, monkeypatch, abbreviated):
    # "--epoch 3" is not silently taken for --epochs 3; nothing is written.
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(["train", abbreviated, "3"])
    assert exit.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert f"unrecognized arguments: {abbreviated} 3" in line
    assert snapshot(tmp_path) == before


def test_help_names_every_option(tmp_path):
    result = phalanx(tmp_path, "train", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    for option in OPTIONS:
        assert option in result.stdout
    assert os.listdir(tmp_path) == []


# --- bad commands: exit code 2, one line, nothing written ----------------------


def write_npz(path: pathlib.Path, **arrays) -> None:
    rng = np.random.default_rng(0)
    full = {
        "x_train": rng.normal(size=(12, 4)),
        "y_train": np.arange(12) % 3,
        "x_test": rng.normal(size=(6, 4)),
        "y_test": np.arange(6) % 3,
    }
    full.update(arrays)
    np.savez(path, **{k: v for k, v in full.items() if v is not None})


BAD_DATASETS = {
    "npz-missing-key": (
        {"y_test": None},
        ["--dataset npz:data.npz", "no y_test", "x_train, y_train, x_test, y_test"],
    ),
    "npz-lengths-differ": (
        {"y_train": np.zeros(11, np.int64)},
        ["--dataset npz:data.npz", "x_train has 12 rows but y_train has 11"],
    ),
    "npz-test-label-out-of-range": (
        {"y_test": np.array([0, 1, 2, 3, 0, 1])},
        ["--dataset npz:data.npz", "y_test", "0 to 3", "classes 0..2"],
    ),
    "npz-negative-label": (
        {"y_train": np.arange(12) % 3 - 1},
        ["--dataset npz:data.npz", "y_train has a label of -1 (first at example 0)"],
    ),
}


def refused_in_process(tmp_path, capsys, argv: list[str], needles: list[str]):
    """`main(argv)` in `tmp_path` exits with 2, one line naming `needles`, and
    writes nothing (not even the default runs/ folder)."""
    before = snapshot(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse
        code = exit.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    line = one_line(err)
    assert line.startswith("phalanx train: error: ")
    for needle in needles:
        assert needle in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--model", "foo"], ["--model", "'foo'", "linear", "mlp"]),
        (
            ["--strategy", "foo"],
            ["--strategy", "'foo'", "sharding", "pmap", "fsdp", "mesh"],
        ),
        (["--shard", "optimizer"], ["--shard optimizer", "--strategy fsdp"]),
        (["--mesh", "data=2"], ["--mesh data=2,fsdp=1,tensor=1", "--strategy mesh"]),
        (
            ["--strategy", "mesh", "--mesh", "model=2"],
            ["--mesh", "'model=2'", "data, fsdp, context, tensor", "data=2,fsdp=4"],
        ),
        (
            ["--strategy", "mesh", "--mesh", "fsdp=3", "--run-dir", "RUN"],
            ["--mesh data=-1,fsdp=3,tensor=1", "do not fit 8 devices"],
        ),
        (["--data-workers", "-1"], ["--data-workers", "0 or more, got '-1'"]),
        (
            ["--data-workers", "2"],
            ["--data-workers 2", "records:DIR, not --dataset digits"],
        ),
        (["--precision", "fp8"], ["--precision", "'fp8'", "fp32", "bf16", "fp16"]),
        (["--optimizer", "foo"], ["--optimizer", "'foo'", "adam", "sgd"]),
        (["--devices", "0"], ["--devices", "positive integer, got 0"]),
        (["--eval-every", "0"], ["--eval-every", "positive integer, got 0"]),
        (["--dataset", "foo"], ["--dataset 'foo'", "digits, mnist:PATH, npz:PATH"]),
        (["--dataset", "npz:nope.npz"], ["--dataset npz:nope.npz", "No such file"]),
        (
            ["--dataset", "mnist:/nonexistent"],
            ["--dataset mnist:/nonexistent", "not a folder", "train-images-idx3"],
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value[0], str) else None,
)
def test_bad_argument(tmp_path, capsys, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    refused_in_process(tmp_path, capsys, ["train", *args], needles)


@pytest.mark.parametrize("case", BAD_DATASETS)
def test_bad_npz(tmp_path, capsys, monkeypatch, case):
    arrays, needles = BAD_DATASETS[case]
    write_npz(tmp_path / "data.npz", **arrays)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--dataset", "npz:data.npz", "--run-dir", "RUN"]
    refused_in_process(tmp_path, capsys, argv, needles)


def test_a_negative_label_in_records_is_refused(tmp_path, capsys, monkeypatch):
    x = np.ones((8, 4), np.float32)
    write_records(tmp_path / "rec", "train", [(x, np.array([0, 1, 2, -1] * 2))])
    write_records(tmp_path / "rec", "test", [(x, np.arange(8) % 3)])
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--dataset", "records:rec", "--run-dir", "RUN"]
    needles = ["--dataset records:rec: train has a label of -1 (first at example 3)"]
    refused_in_process(tmp_path, capsys, argv, needles)


def test_nonempty_run_dir_needs_overwrite(tmp_path, capsys, monkeypatch):
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "notes.txt").write_text("my notes\n")
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--run-dir", "RUN"]
    refused_in_process(tmp_path, capsys, argv, ["--run-dir RUN", "--overwrite"])


# --- bugs found by these tests, fixed: they stay as regression tests -----------


def test_non_integer_devices_message(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--devices", "abc"]
    refused_in_process(tmp_path, capsys, argv, ["--devices", "positive integer"])


def test_infinite_lr_is_refused(tmp_path, capsys, monkeypatch):
    assert len(jax.devices()) == 8
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--lr", "inf", "--devices", "8", "--run-dir", "RUN"]
    refused_in_process(tmp_path, capsys, argv, ["--lr", "inf", "finite"])


def test_nan_features_in_npz_are_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    x[7, 2] = np.nan
    y = rng.integers(0, 2, 40).astype(np.int32)
    path = tmp_path / "nan.npz"
    np.savez(path, x_train=x, y_train=y, x_test=x[:8], y_test=y[:8])
    argv = ["train", "--dataset", f"npz:{path}", "--devices", "8", "--run-dir", "RUN"]
    refused_in_process(tmp_path, capsys, argv, ["x_train", "NaN or inf", "row 7"])
