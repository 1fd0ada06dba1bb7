"""``phalanx train``'s start: a plain install (no extras) runs the main job,
a user's model that does not fit the labels or whose code raises is
reported before anything is written, and a run that fails before its first
step (a tracker that cannot start) leaves no folder behind, so the very same
command works once the cause is fixed."""

import os
import pathlib
import socket
import subprocess
import sys
import tomllib

import mlflow
import pytest

from cli_runs import ENV, said
from phalanx.cli._folder import RunFolder
from phalanx.cli._main import EXIT_USER_CODE, main
from test_cli import NOTICE, one_line, snapshot


# What `phalanx train` says where neither tensorboardX nor matplotlib is
# installed (a plain `pip install phalanx`).
PLAIN_NOTE = (
    "phalanx: no TensorBoard events or history.png (tensorboardX and matplotlib "
    "are not installed; pip install 'phalanx[logs]' adds them)"
)
# A short run: one epoch of the digits (with a small MLP: SMALL).
SHORT = ["--epochs", "1", "--log-every", "5"]
SMALL = [*SHORT, "--hidden", "16"]


# --- a plain install: the extras' libraries made unimportable -------------------


# Imported at the start of every Python process with its folder on PYTHONPATH:
# tensorboardX and matplotlib cannot be imported there, and
# importlib.util.find_spec answers None for them, as where they are not
# installed.
SITECUSTOMIZE = """
import sys

for name in ("tensorboardX", "matplotlib"):
    sys.modules[name] = None
"""


@pytest.fixture(scope="module")
def plain_env(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("plain-install")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), ENV.get("PYTHONPATH")) if p)
    env = {**ENV, "PYTHONPATH": path}
    check = (
        "import importlib.util\n"
        "for name in ('tensorboardX', 'matplotlib'):\n"
        "    assert importlib.util.find_spec(name) is None, name\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return env


def run_cli(cwd: pathlib.Path, env: dict[str, str], *args: str):
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "train", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_plain_install_runs_the_main_job(tmp_path, plain_env):
    result = run_cli(tmp_path, plain_env, *SMALL, "--run-dir", "RUN")
    assert result.returncode == 0, result.stderr
    # The default TensorBoard logger and plot are left out, in one line.
    assert said(result.stderr) == [NOTICE, PLAIN_NOTE]
    run = tmp_path / "RUN"
    assert sorted(os.listdir(run)) == [
        "checkpoints", "config.toml", "metrics.csv", "metrics.jsonl", "timeline.json"
    ]  # fmt: skip
    assert sorted(os.listdir(run / "checkpoints")) == ["23"]
    # Its config is the default's: where the extras are installed, the same
    # config draws the plot and logs to TensorBoard.
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["loggers"] == ["csv", "jsonl", "tensorboard"]
    assert config["no_plot"] is False

    # A logger asked for explicitly is required: one line, nothing written.
    result = run_cli(tmp_path, plain_env, "--logger", "tensorboard", "--run-dir", "B")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "phalanx train: error: --logger tensorboard needs tensorboardX, which is "
        "not installed: pip install 'phalanx[tensorboard]'"
    )
    assert sorted(os.listdir(tmp_path)) == ["RUN"]


# --- a user's model: checked on one example before anything is written ----------


USER_MODULE = '''
"""Models for the digits (rows of 64 features, labels 0 to 9)."""

import equinox as eqx
import jax
import jax.numpy as jnp

OUTPUTS = {outputs}  # None: out_size


class Reshaped(eqx.Module):
    linear: eqx.nn.Linear
    form: str

    def __call__(self, x):
        y = self.linear(x)
        if self.form == "extra":
            return y[None]
        if self.form == "pair":
            return y, y
        if self.form == "int":
            return jnp.round(y).astype(jnp.int32)
        return self.linear(x.reshape(8, 8))  # "image": a 2-d input


def net(*, in_shape, out_size, key):
    return eqx.nn.Linear(in_shape[0], OUTPUTS or out_size, key=key)


def shaped(*, in_shape, out_size, key, form):
    return Reshaped(eqx.nn.Linear(in_shape[0], out_size, key=key), form)


def cnn(*, in_shape, out_size, key, channels=8):
    channels_in, height, width = in_shape  # an image, not a row
    return None


def data():
    raise FileNotFoundError("images.npz")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes mine.py in `tmp_path` (the current folder) with OUTPUTS =
    `outputs` (a Python literal, None for out_size); each call imports it
    afresh."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)

    def write(outputs: str) -> None:
        (tmp_path / "mine.py").write_text(USER_MODULE.format(outputs=outputs))
        sys.modules.pop("mine", None)

    yield write
    sys.modules.pop("mine", None)


def refused(tmp_path, capsys, argv: list[str]) -> str:
    """`main(argv)` exits 2 with one line on stderr and writes nothing."""
    before = snapshot(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line != NOTICE]
    assert len(lines) == 1, err
    assert snapshot(tmp_path) == before
    return lines[0]


@pytest.mark.parametrize(
    ("model", "output"),
    [
        (["mine:net"], "an output of shape (2,)"),
        (["mine:shaped", "--model-arg", "form='extra'"], "an output of shape (1, 10)"),
        (["mine:shaped", "--model-arg", "form='pair'"], "a tuple of 2 (not one array)"),
        (
            ["mine:shaped", "--model-arg", "form='int'"],
            "an output of shape (10,) and dtype int32",
        ),
    ],
    ids=["two-outputs", "extra-dim", "tuple", "int"],
)
def test_a_model_that_does_not_fit_the_labels(
    tmp_path, capsys, user_module, model, output
):
    user_module("2")
    line = refused(tmp_path, capsys, ["train", "--model", *model, "--run-dir", "R"])
    assert line == (
        f"phalanx train: error: --model {model[0]}: the model maps one example of "
        f"shape (64,) to {output}, but the labels run from 0 to 9: phalanx "
        "train's cross-entropy needs one float logit per class, an output of "
        "shape (10,) per example (the factory's out_size=10)"
    )


@pytest.mark.slow
def test_the_same_command_works_once_the_model_is_fixed(tmp_path, capsys, user_module):
    """Issue 29, item 13: the refused start writes nothing, so the very same
    command trains once the factory returns one output per class."""
    argv = ["train", "--model", "mine:net", *SHORT, "--run-dir", "R"]
    argv += ["--logger", "csv", "--no-plot"]
    user_module("'scalar'")  # one number per example
    line = refused(tmp_path, capsys, argv)
    assert "to an output of shape ()" in line
    user_module("None")
    assert main(argv) == 0
    err = capsys.readouterr().err
    # Loggers chosen and no plot: nothing left out, nothing to say.
    assert said(err) == [NOTICE]
    assert sorted(os.listdir("R")) == [
        "checkpoints", "config.toml", "metrics.csv", "timeline.json"
    ]  # fmt: skip
    config = tomllib.loads(pathlib.Path("R/config.toml").read_text())
    assert config["no_plot"] is True and config["loggers"] == ["csv"]


@pytest.mark.parametrize(
    ("argv", "frame", "context", "hinted"),
    [
        (
            ["--model", "mine:cnn", "--model-arg", "channels=4"],
            "channels_in, height, width = in_shape",
            "--model mine:cnn: cnn(in_shape=(64,), out_size=10, key=<PRNG key>, "
            "channels=4) raised ValueError: not enough values to unpack (expected 3, "
            "got 1) (traceback above)",
            True,
        ),
        (
            ["--model", "mine:shaped", "--model-arg", "form='image'"],
            "return self.linear(x.reshape(8, 8))",
            "--model mine:shaped: the Reshaped it built, called on one example of "
            "shape (64,) as model(x) (vmapped over the batch), raised TypeError: ",
            True,
        ),
        (
            ["--model", "mine:net", "--dataset", "mine:data"],
            'raise FileNotFoundError("images.npz")',
            "--dataset mine:data: data() raised FileNotFoundError: images.npz "
            "(traceback above)",
            False,
        ),
    ],
    ids=["factory", "model", "dataset"],
)
def test_an_exception_in_user_code_keeps_its_traceback(
    tmp_path, capsys, user_module, argv, frame, context, hinted
):
    """Issue 29, item 7: the user's traceback, then one line of context (what
    the factory was called with, the likely cause); exit 4, nothing written."""
    user_module("None")
    before = snapshot(tmp_path)
    assert main(["train", *argv, "--run-dir", "R"]) == EXIT_USER_CODE
    err = capsys.readouterr().err
    assert snapshot(tmp_path) == before
    lines = err.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert f'  File "{tmp_path / "mine.py"}"' in err and frame in err
    assert lines[-1].startswith(f"phalanx train: error: {context}")
    # The likely cause, where the model got the built-in digits.
    hint = (
        "(traceback above); the built-in digits (--dataset digits) are rows of 64 "
        "features, in_shape=(64,): for images pass --dataset npz:PATH, mnist:PATH "
        "or MODULE:FUNCTION"
    )
    assert lines[-1].endswith(hint if hinted else "(traceback above)")


# --- trackers that cannot start: one line, no folder, the same command again ----


def closed_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        return listener.getsockname()[1]


def failed_start(capsys, argv: list[str], cwd: pathlib.Path) -> str:
    """`main(argv)` fails before its first step with exit 2 and one error
    line (besides phalanx's notes); what it wrote in `cwd` is gone."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("phalanx train")]
    assert len(errors) == 1, err
    assert all(line.startswith("phalanx") for line in err.splitlines()), err
    assert os.listdir(cwd) == []
    return errors[0]


@pytest.mark.slow
def test_mlflow_that_cannot_start_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """Issue 29, item 16: no server at the tracking URI; then a local store."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    # MLflow retries an unanswered request for minutes by default.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    argv = ["train", *SMALL, "--logger", "csv", "--logger", "mlflow", "--no-plot"]
    argv += ["--run-dir", "runs/first"]  # runs/ too is made by the run
    line = failed_start(capsys, argv, work)
    assert line.startswith(
        f"phalanx train: error: MLflowLogger could not start its run at {uri} "
        "(MlflowException: API request to "
    )
    assert line.endswith(
        "; check that the tracking server runs there (or that the store can be "
        "opened), or pass another tracking_uri / MLFLOW_TRACKING_URI"
    )
    assert "Connection refused" in line

    store = (tmp_path / "mlruns").as_uri()  # the cause fixed: a store that opens
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert main(argv) == 0, capsys.readouterr().err
    client = mlflow.MlflowClient(store)
    (found,) = client.search_runs(["0"])
    assert found.info.status == "FINISHED" and found.info.run_name == "first"


@pytest.mark.slow
def test_wandb_with_a_bad_setting_leaves_no_folder(tmp_path):
    # In their own processes, as a user runs them: W&B keeps the settings it
    # first read for the rest of a process.
    work = tmp_path / "work"
    work.mkdir()
    env = {
        **ENV,
        "WANDB_SILENT": "true",
        "WANDB_MODE": "bogus",
        **{
            name: str(tmp_path / "wandb-home")
            for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
        },
    }
    args = [*SMALL, "--logger", "csv", "--logger", "wandb", "--no-plot", "--run-dir"]
    result = run_cli(work, env, *args, "R")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    line = one_line(result.stderr.replace(NOTICE, ""))
    assert line.startswith(
        "phalanx train: error: WandbLogger could not start its run (ValidationError: "
        "1 validation error for Settings mode Input should be 'online', "
    )
    assert "input_value='bogus'" in line and "WANDB_MODE" in line
    assert os.listdir(work) == []
    result = run_cli(work, {**env, "WANDB_MODE": "offline"}, *args, "R")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(work / "R")) == [
        "checkpoints", "config.toml", "metrics.csv", "timeline.json", "wandb"
    ]  # fmt: skip


# --- the run folder of a failed start, undone ----------------------------------


def fill(folder: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_a_new_run_removes_the_folders_it_made(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "other").mkdir()  # another run's: left alone
    path = tmp_path / "runs" / "a" / "b" / "RUN"
    folder = RunFolder(path, resume=False)
    folder.create(main=True)
    fill(path, {"config.toml": "x", "checkpoints/.tmp": "", "wandb/run-1/log": ""})
    folder.undo()
    assert sorted(os.listdir(tmp_path / "runs")) == ["other"]


def test_overwrite_leaves_other_programs_files(tmp_path):
    fill(
        tmp_path,
        {
            "notes.txt": "mine",
            "config.toml": "old",
            "metrics.csv": "old",
            "tensorboard/events.out.tfevents.1": "old",
            "tensorboard/README": "mine",
            "checkpoints/23/host": "old",
        },
    )
    folder = RunFolder(tmp_path, resume=False)
    folder.create(main=True)  # --overwrite: the earlier run's files go
    fill(tmp_path, {"config.toml": "new", "tensorboard/events.out.tfevents.2": ""})
    folder.undo()
    assert snapshot(tmp_path) == {
        "checkpoints": None,
        "notes.txt": b"mine",
        "tensorboard": None,
        "tensorboard/README": b"mine",
    }


def test_a_resume_that_fails_leaves_the_run_as_it_was(tmp_path):
    fill(
        tmp_path,
        {
            "config.toml": "epochs = 3\n",
            "metrics.csv": "kind,step\nstep,5\nstep,10\n",
            "metrics.jsonl": '{"step": 5}\n{"step": 10}\n',
            "tensorboard/events.out.tfevents.1": "events",
            "checkpoints/5/host": "state",
            "wandb/offline-run-1/run-1.wandb": "log",
        },
    )
    before = snapshot(tmp_path)
    folder = RunFolder(tmp_path, resume=True)
    folder.create(main=True)
    # What a resume's start writes: its config, the logs cut back to the
    # checkpoint's rows, a new event file and W&B run part.
    fill(
        tmp_path,
        {
            "config.toml": "epochs = 6\n",
            "metrics.csv": "kind,step\nstep,5\n",
            "tensorboard/events.out.tfevents.2": "",
            "wandb/offline-run-2/run-1.wandb": "",
        },
    )
    (tmp_path / "metrics.jsonl").unlink()
    folder.undo()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("progress", ["a step", "a checkpoint"])
def test_a_run_that_got_somewhere_is_kept(tmp_path, progress):
    path = tmp_path / "RUN"
    folder = RunFolder(path, resume=False)
    folder.create(main=True)
    fill(path, {"config.toml": "x", "checkpoints/.keep": ""})
    if progress == "a step":
        folder.marker.reached = True
    else:  # SIGTERM before the first step: a checkpoint of step 0 to resume
        (path / "checkpoints" / "0").mkdir()
    folder.undo()
    assert (path / "config.toml").read_text() == "x"
