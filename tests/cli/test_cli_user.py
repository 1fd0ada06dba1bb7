"""``phalanx train`` on a user's own model and data (``--model MODULE:FACTORY``,
``--dataset MODULE:FUNCTION``), run configs (``config.toml``, ``--config``,
``--resume`` with no other flag), and the CLI's answers to bad input."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import tomllib

import jax
import mlflow
import numpy as np
import pytest

import phalanx as px
from cli_runs import Phalanx, finish, same_arrays, state_arrays
from helpers import wandb_parts
from phalanx.cli._datasets import load_dataset
from phalanx.cli._main import build_parser, resolve_train
from phalanx.cli._train import make_model, make_optimizer, make_schedule, make_strategy
from test_cli import refused_in_process, snapshot


USER_MODULE = textwrap.dedent(
    '''
    """A small convolutional model for the 8x8 digits, and their loader."""

    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from phalanx.data import load_digits


    class CNN(eqx.Module):
        conv: eqx.nn.Conv2d
        head: eqx.nn.Linear

        def __init__(self, in_shape, out_size, channels, key):
            k1, k2 = jax.random.split(key)
            height, width = in_shape
            self.conv = eqx.nn.Conv2d(1, channels, 3, padding=1, key=k1)
            self.head = eqx.nn.Linear(channels * height * width // 4, out_size, key=k2)

        def __call__(self, x):
            h = jax.nn.relu(self.conv(x[None]))
            c, height, width = h.shape
            h = h.reshape(c, height // 2, 2, width // 2, 2).mean(axis=(2, 4))
            return self.head(h.reshape(-1))


    def cnn(*, in_shape, out_size, key, channels=8):
        return CNN(in_shape, out_size, channels, key)


    def load():
        (x, y), (x_test, y_test) = load_digits()
        return x.reshape(-1, 8, 8), y, x_test.reshape(-1, 8, 8), y_test


    def two_positional(a, b):
        return None


    def not_a_module(*, in_shape, out_size, key):
        return {"weights": jnp.zeros(in_shape)}


    def three_arrays():
        (x, y), (x_test, _) = load_digits()
        return x, y, x_test


    NOT_CALLABLE = 3
    '''
)
CNN_ARGS = [
    "--model",
    "mod:cnn",
    "--model-arg",
    "channels=8",
    "--dataset",
    "mod:load",
    "--optimizer",
    "adam",
    "--lr",
    "0.05",
    "--epochs",
    "3",
    "--devices",
    "2",
    "--log-every",
    "5",
]
STEPS = 23 * 3  # 1437 digits, batch 64


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("user")
    (folder / "mod.py").write_text(USER_MODULE)
    return folder


@pytest.fixture(scope="module")
def cnn_run(user_dir) -> tuple[pathlib.Path, Phalanx]:
    """The CNN trained straight through, checkpointing every 5 steps and
    profiling steps 2 to 4."""
    run = finish(
        user_dir, *CNN_ARGS, "--checkpoint-every", "5", "--profile", "2:4",
        "--run-dir", "STRAIGHT",
    )  # fmt: skip
    return user_dir / "STRAIGHT", run


def cli_state(cwd: pathlib.Path, run: pathlib.Path, step: int) -> list[np.ndarray]:
    """Checkpoint `step` of `run` read into the trainer the CLI builds from
    the run's config.toml (the test process's first 2 devices)."""
    argv = ["train", "--config", str(run / "config.toml")]
    args = resolve_train(argv, build_parser().parse_args(argv))
    sys.path.insert(0, str(cwd))
    try:
        (x, y), _ = load_dataset(args.dataset, flatten=False)
        model, _ = make_model(args, x, y)
    finally:
        sys.path.remove(str(cwd))
    loader = px.data.ArrayLoader((x, y), args.batch_size, seed=args.seed)
    schedule = make_schedule(args, args.epochs * len(loader))
    trainer = px.DataParallelTrainer(
        model,
        make_optimizer(args, schedule),
        strategy=make_strategy(args, jax.devices()[: args.devices]),
        seed=args.seed,
        progress=False,
    )
    checkpoint = px.callbacks.Checkpoint(run / "checkpoints", every_n_epochs=None)
    checkpoint.restore(trainer, run / "checkpoints" / str(step), None)
    assert int(trainer.state.step) == step
    return state_arrays(trainer)


@pytest.mark.slow
def test_user_cnn_and_dataset_train_from_the_command_line(cnn_run):
    run, result = cnn_run
    found = re.search(r"test accuracy (\d\.\d+)", result.lines[-1])
    assert found, result.output()
    accuracy = float(found[1])
    assert accuracy > 0.9, result.output()
    assert result.lines[0].startswith("phalanx: CNN (mod:cnn) 8x8 -> 10 on mod:load")
    # The summary's short form, with the model's real parameter count.
    params = 8 * 1 * 3 * 3 + 8 + 8 * 16 * 10 + 10
    assert re.match(rf"phalanx: CNN: {params:,} parameters", result.lines[1])
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["model"] == "mod:cnn" and config["model_arg"] == ["channels=8"]
    assert config["dataset"] == "mod:load" and config["devices"] == 2
    assert "run_dir" not in config and "resume" not in config
    traces = list((run / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


@pytest.mark.slow
def test_killed_user_run_resumes_with_run_dir_alone(user_dir, cnn_run):
    straight, _ = cnn_run
    folder = user_dir / "KILLED" / "checkpoints"
    killed = Phalanx(
        user_dir, *CNN_ARGS, "--checkpoint-every", "5", "--run-dir", "KILLED"
    )
    code = killed.signal_when(lambda run: (folder / "30").is_dir(), signal.SIGKILL)
    assert code == -signal.SIGKILL, killed.output()

    resumed = finish(user_dir, "--run-dir", "KILLED", "--resume")
    assert resumed.lines[-1].split(";")[0] == cnn_run[1].lines[-1].split(";")[0]
    assert same_arrays(
        cli_state(user_dir, user_dir / "KILLED", STEPS),
        cli_state(user_dir, straight, STEPS),
    )


@pytest.mark.slow
def test_config_starts_a_run_like_it_and_flags_override(tmp_path, user_dir, cnn_run):
    straight, _ = cnn_run
    finish(
        user_dir, "--config", str(straight / "config.toml"), "--epochs", "1",
        "--run-dir", str(tmp_path / "AGAIN"),
    )  # fmt: skip
    written = tomllib.loads((tmp_path / "AGAIN" / "config.toml").read_text())
    expected = tomllib.loads((straight / "config.toml").read_text())
    assert written == {**expected, "epochs": 1}


# --- bad commands: exit code 2, one line, nothing written ----------------------


BAD_INPUT = {
    "missing module": (
        ["--model", "nowhere:cnn"],
        ["--model nowhere:cnn", "no module named 'nowhere'", "PYTHONPATH"],
    ),
    "missing factory": (
        ["--model", "mod:resnet"],
        ["--model mod:resnet", "has no 'resnet'", "cnn"],
    ),
    "not callable": (
        ["--model", "mod:NOT_CALLABLE"],
        ["--model mod:NOT_CALLABLE", "is not callable (int)"],
    ),
    "wrong signature": (
        ["--model", "mod:two_positional"],
        ["--model mod:two_positional", "cannot call", "in_shape, out_size"],
    ),
    "not a module": (
        ["--model", "mod:not_a_module"],
        ["returned a dict, not an Equinox module"],
    ),
    "unknown model arg": (
        ["--model", "mod:cnn", "--model-arg", "depth=3"],
        ["--model mod:cnn", "cannot call", "depth"],
    ),
    "model arg without =": (
        ["--model", "mod:cnn", "--model-arg", "channels"],
        ["--model-arg", "'channels' is not NAME=VALUE"],
    ),
    "model arg not a literal": (
        ["--model", "mod:cnn", "--model-arg", "act=relu"],
        ["--model-arg", "'relu' is not a Python literal", "act='relu'"],
    ),
    "model arg phalanx passes": (
        ["--model", "mod:cnn", "--model-arg", "key=1"],
        ["key is passed by phalanx itself"],
    ),
    "model arg twice": (
        [
            "--model",
            "mod:cnn",
            "--model-arg",
            "channels=4",
            "--model-arg",
            "channels=8",
        ],
        ["--model-arg channels is given twice"],
    ),
    "model arg for a built-in": (
        ["--model", "mlp", "--model-arg", "channels=4"],
        ["--model-arg is for --model MODULE:FACTORY", "--hidden"],
    ),
    "bad model spec": (
        ["--model", "mod:"],
        ["--model", "'mod:' is not linear, mlp or MODULE:FACTORY"],
    ),
    "dataset of three": (
        ["--dataset", "mod:three_arrays"],
        ["--dataset mod:three_arrays", "returned a tuple of 3", "(x_train, y_train"],
    ),
    "missing dataset": (["--dataset", "mod:nothing"], ["has no 'nothing'"]),
    "profile": (["--profile", "5"], ["--profile", "'5' is not START:END"]),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_model_and_dataset(user_dir, capsys, monkeypatch, case):
    args, needles = BAD_INPUT[case]
    monkeypatch.chdir(user_dir)
    monkeypatch.syspath_prepend(str(user_dir))
    before = snapshot(user_dir)
    # No --devices: in this process JAX may not have started yet, and
    # --devices 2 would start it with 2 devices for every later test here.
    refused_in_process(user_dir, capsys, ["train", *args], needles)
    assert snapshot(user_dir) == before


BAD_CONFIGS = {
    "missing": (None, ["--config config.toml: no such file"]),
    "not toml": ("epochs = = 3\n", ["--config config.toml: not valid TOML"]),
    "unknown option": ("batch = 64\n", ["unknown option 'batch'", "batch_size"]),
    "out of range": (
        "batch_size = 0\n",
        ["batch_size = 0", "--batch-size", "must be a positive integer, got 0"],
    ),
    "wrong type": ('epochs = "many"\n', ["epochs = 'many'", "positive integer"]),
    "a choice": ('optimizer = "lion"\n', ["optimizer = 'lion'", "'adam'"]),
    "a list for a number": ("lr = [1, 2]\n", ["lr = [1, 2] is a list"]),
    "widths": ('hidden = ["a"]\n', ["list of integers"]),
    "per command": ("resume = true\n", ["unknown option 'resume'"]),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config(tmp_path, capsys, monkeypatch, case):
    text, needles = BAD_CONFIGS[case]
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / "config.toml").write_text(text)
    refused_in_process(tmp_path, capsys, ["train", "--config", "config.toml"], needles)


def test_config_values_are_the_flags_values(tmp_path):
    (tmp_path / "c.toml").write_text(
        'hidden = [32, 16]\nlr = 0.5\nseed = -3\nloggers = ["csv", "jsonl"]\n'
        'model_arg = ["a=(1, 2)"]\nmodel = "m:f"\nprofile = "3:7"\n'
    )
    argv = ["train", "--config", str(tmp_path / "c.toml"), "--lr", "0.25"]
    args = resolve_train(argv, build_parser().parse_args(argv))
    assert args.hidden == (32, 16) and args.seed == -3 and args.lr == 0.25
    assert args.loggers == ("csv", "jsonl") and args.profile == (3, 7)
    assert args.model == "m:f" and args.model_arg == ("a=(1, 2)",)
    # Empty lists, as a run without --model-arg writes them.
    (tmp_path / "c.toml").write_text("model_arg = []\n")
    argv = ["train", "--config", str(tmp_path / "c.toml")]
    assert resolve_train(argv, build_parser().parse_args(argv)).model_arg == ()


@pytest.mark.slow
def test_resume_refuses_a_flag_that_changes_the_run(cnn_run, capsys, monkeypatch):
    straight, _ = cnn_run
    monkeypatch.chdir(straight.parent)
    for flag, value, what in (
        ("--lr", "0.5", "another optimizer"),
        ("--model-arg", "channels=4", "another model"),
        ("--seed", "1", "another run"),
    ):
        refused_in_process(
            straight.parent,
            capsys,
            ["train", "--run-dir", "STRAIGHT", "--resume", flag, value],
            [f"--resume: {flag} {value} differs from this run's", what],
        )
    refused_in_process(
        straight.parent,
        capsys,
        ["train", "--run-dir", "STRAIGHT", "--resume", "--config", "x.toml"],
        ["drop --config"],
    )


# --- answering without JAX ------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["train", "--help"], ["--version"], ["train", "--epoch", "3"]],
    ids=" ".join,
)
def test_help_and_usage_errors_do_not_import_jax(tmp_path, argv):
    code = (
        "import sys\nfrom phalanx.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit:\n    pass\nassert 'jax' not in sys.modules, 'jax'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# --- trackers from the command line ---------------------------------------------


@pytest.mark.slow
def test_wandb_and_mlflow_loggers_from_the_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # to read it back here
    uri = (tmp_path / "mlruns").as_uri()
    env = {
        **os.environ,
        "NPROC": "16",
        "JAX_PLATFORMS": "cpu",
        "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        **{
            name: str(tmp_path / "wb")
            for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")
        },
    }
    args = ["--epochs", "1", "--devices", "2", "--hidden", "16", "--log-every", "5"]
    loggers = ["--logger", "jsonl", "--logger", "wandb", "--logger", "mlflow"]
    result = subprocess.run(
        [sys.executable, "-m", "phalanx", "train", *args, *loggers, "--run-dir", "R"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "R"
    assert not (run / "metrics.csv").exists() and not (run / "tensorboard").exists()
    logged = [
        (row["step"], row["loss"])
        for row in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "step"
    ]
    assert [step for step, _ in logged] == [5, 10, 15, 20]

    client = mlflow.MlflowClient(uri)
    (found,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()]
    )
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == logged
    params = found.data.params
    assert params["hidden"] == "[16]" and params["devices"] == "2"
    # The command line's options win over the trainer's own names for them.
    assert params["strategy"] == "sharding" and params["strategy.num_devices"] == "2"
    assert params["model"] == "mlp" and params["model.parameters"] == "1210"
    assert found.info.run_name == "R"

    (part,) = wandb_parts(run)
    rows = part["rows"]
    shown = [
        (step, rows[step]["train/loss"]) for step in rows if "train/loss" in rows[step]
    ]
    assert shown == logged
    assert part["config"]["hidden"] == [16] and part["exit_code"] == 0
