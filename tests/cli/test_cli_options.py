"""``phalanx train``'s options: which ones ``--resume`` accepts (and why),
``--model-arg`` compared as values, the schedule's length as an option of the
run, ``--batch-size`` padded as the API pads it, and ``--help`` (issue 29,
items 3, 9, 11 and 18)."""

import argparse
import pathlib
import re

import jax
import numpy as np
import pytest

import phalanx as px
from cli_runs import cli_args, state_arrays
from phalanx._telemetry._alarms import SlowSteps
from phalanx.cli._args import PER_COMMAND, RESUMABLE, TrainArgs, UsageError
from phalanx.cli._config import _WHAT, resolve_train
from phalanx.cli._datasets import load_dataset
from phalanx.cli._main import build_parser, main
from phalanx.cli._start import check_batch_size
from phalanx.cli._train import make_model, make_optimizer, make_schedule, make_strategy


def train_options() -> set[str]:
    parser = build_parser()
    (commands,) = [
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ]
    train = commands.choices["train"]
    return {a.dest for a in train._actions if a.option_strings and a.dest != "help"}


# --- what --resume may change -------------------------------------------------


def test_the_options_resume_accepts_are_pinned():
    # Each is justified in _cli_args.RESUMABLE's comments: none changes an
    # update of the run. Adding one needs the same argument.
    assert set(RESUMABLE) == {
        "epochs", "log_every", "checkpoint_every", "eval_every", "loggers",
        "no_plot", "profile", "strategy", "shard", "mesh", "microbatches",
        "devices", "steps_per_call", "data_workers",
    }  # fmt: skip


def test_every_option_is_resumable_per_command_or_refused_by_name():
    # A new option must be placed: changeable on --resume, not part of the
    # run, or refused naming what it would change.
    groups = [set(RESUMABLE), set(PER_COMMAND), set(_WHAT)]
    assert sum(map(len, groups)) == len(set.union(*groups)), "in two groups"
    assert train_options() == set.union(*groups)


def write_run(folder: pathlib.Path, **changes: str) -> pathlib.Path:
    """A run folder's config.toml, as a run with --model m:f writes it."""
    text = (
        'model = "m:f"\nmodel_arg = ["hidden=(64,128)", "act=\'relu\'"]\n'
        "epochs = 3\nschedule_steps = 69\n"
    )
    for name, value in changes.items():
        text = re.sub(rf"^{name} = .*$", f"{name} = {value}", text, flags=re.M)
    run = folder / "RUN"
    run.mkdir()
    (run / "config.toml").write_text(text)
    return run


def resolve(*argv: str) -> TrainArgs:
    argv = ("train", *argv)
    return resolve_train(argv, build_parser().parse_args(argv))


def test_resume_compares_model_args_as_values(tmp_path):
    run = str(write_run(tmp_path))
    same = ("--model-arg", "hidden=(64, 128)", "--model-arg", 'act="relu"')
    args = resolve("--run-dir", run, "--resume", *same)
    assert args.model_arg == ("hidden=(64, 128)", 'act="relu"')
    # In another order, as values: the same arguments.
    resolve("--run-dir", run, "--resume", *same[2:], *same[:2])
    for other in (
        ["--model-arg", "hidden=(64, 256)", "--model-arg", "act='relu'"],
        ["--model-arg", "hidden=(64, 128)"],
        ["--model-arg", "hidden=[64, 128]", "--model-arg", "act='relu'"],
    ):
        with pytest.raises(UsageError, match="--model-arg .* another model"):
            resolve("--run-dir", run, "--resume", *other)


def test_schedule_steps_is_the_runs_and_not_resumable(tmp_path):
    run = str(write_run(tmp_path))
    args = resolve("--run-dir", run, "--resume", "--epochs", "5")
    assert (args.epochs, args.schedule_steps, args.schedule_length(23)) == (5, 69, 69)
    assert resolve("--run-dir", run, "--resume", "--schedule-steps", "69")
    with pytest.raises(UsageError, match="--schedule-steps 70 differs .* optimizer"):
        resolve("--run-dir", run, "--resume", "--schedule-steps", "70")


def test_an_earlier_phalanx_run_keeps_its_stored_epochs(tmp_path):
    # No schedule_steps in its config.toml: its schedule spanned its epochs.
    run = str(write_run(tmp_path, schedule_steps="3"))
    (tmp_path / "RUN" / "config.toml").write_text(
        (tmp_path / "RUN" / "config.toml")
        .read_text()
        .replace("schedule_steps = 3\n", "")
    )
    args = resolve("--run-dir", run, "--resume", "--epochs", "5")
    assert args.schedule_steps is None and args.schedule_length(23) == 69
    fixed = args.with_schedule_steps(23)
    assert fixed.schedule_steps == 69 and fixed.config()["schedule_steps"] == 69
    assert "schedule_epochs" not in fixed.config()


def test_a_new_runs_schedule_spans_its_epochs_unless_told():
    args = cli_args("--epochs", "4")
    assert args.with_schedule_steps(23).config()["schedule_steps"] == 92
    assert args.with_schedule_steps(23).schedule_note(23) is None
    told = cli_args("--epochs", "4", "--schedule-steps", "50").with_schedule_steps(23)
    assert told.schedule_steps == 50
    assert told.schedule_note(23) == (
        "phalanx: the cosine learning-rate schedule spans 50 steps, the run 92 "
        "(4 epochs of 23); from step 50 on, the rate stays at its final value "
        "(--schedule-steps 92 fits it to the run)"
    )
    constant = cli_args("--schedule", "constant", "--schedule-steps", "50")
    assert constant.schedule_note(23) is None


# --- --batch-size padded as fit pads it ---------------------------------------


def api_state(args: TrainArgs, devices: int) -> list[np.ndarray]:
    """The CLI's run of `args` through the API on `devices` devices."""
    (x, y), _ = load_dataset(args.dataset)
    model, _ = make_model(args, x, y)
    loader = px.data.ArrayLoader((x, y), args.batch_size, seed=args.seed)
    args = args.with_schedule_steps(len(loader))
    trainer = px.DataParallelTrainer(
        model,
        make_optimizer(args, make_schedule(args, args.schedule_length(len(loader)))),
        strategy=make_strategy(args, jax.devices()[:devices]),
        seed=args.seed,
        progress=False,
    )
    trainer.fit(loader, epochs=args.epochs)
    return state_arrays(trainer)


@pytest.mark.slow
def test_batch_size_not_a_multiple_of_the_devices_is_padded(
    tmp_path, capsys, monkeypatch
):
    argv = [
        "--model", "linear", "--devices", "8", "--batch-size", "60",
        "--epochs", "1", "--logger", "csv", "--no-plot", "--run-dir", "RUN",
    ]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 0
    padded = [line for line in capsys.readouterr().err.splitlines() if "60" in line]
    assert padded == [
        "phalanx: --batch-size 60 is padded to 64 examples per step with weight-0 "
        "examples (no effect on the update), for 8 device(s) x 1 microbatch(es); "
        "a multiple of 8 wastes nothing (e.g. 56 or 64)"
    ]
    # The CLI's checkpoint equals the API's run on 2 devices (60 needs no
    # padding there) to float summation order.
    args = cli_args(*argv)
    folder = tmp_path / "RUN" / "checkpoints"
    (step,) = (int(p.name) for p in folder.iterdir())
    assert step == 24  # 1437 digits in batches of 60
    restored, _ = make_model(args, *load_dataset(args.dataset)[0])
    trainer = px.DataParallelTrainer(
        restored,
        make_optimizer(args, make_schedule(args, step)),
        strategy=make_strategy(args, jax.devices()[:2]),
        seed=args.seed,
    )
    px.callbacks.Checkpoint(folder).restore(trainer, folder / str(step), None)
    for got, want in zip(state_arrays(trainer), api_state(args, 2), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_microbatches_pad_too(capsys):
    check_batch_size(64, 8, 3)
    assert capsys.readouterr().err == (
        "phalanx: --batch-size 64 is padded to 72 examples per step with weight-0 "
        "examples (no effect on the update), for 8 device(s) x 3 microbatch(es); "
        "a multiple of 24 wastes nothing (e.g. 48 or 72)\n"
    )
    check_batch_size(48, 8, 3)
    assert capsys.readouterr().err == ""


def test_processes_must_share_the_batch_equally(monkeypatch):
    # Each process's loader takes batch_size / processes examples of a step.
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(UsageError) as refused:
        check_batch_size(64, 6, 1)
    assert str(refused.value) == (
        "--batch-size 64 is not divisible by the 3 processes, each of which takes "
        "an equal slice; use e.g. 63 or 66"
    )


# --- --slow-steps -------------------------------------------------------------


def test_slow_steps_takes_a_factor_or_off(capsys):
    assert cli_args().slow_steps == 3.0  # the trainer's default
    assert cli_args("--slow-steps", "2.5").slow_steps == 2.5
    assert cli_args("--slow-steps", "off").slow_steps is None
    for bad in ("1", "-3", "inf", "fast"):
        with pytest.raises(SystemExit) as exit:
            cli_args("--slow-steps", bad)
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            "phalanx train: error: argument --slow-steps: must be a factor "
            f"above 1 (e.g. 3) or off, got {bad!r} (see phalanx train --help)"
        )


def test_hang_timeout_takes_seconds_auto_or_off(capsys):
    assert cli_args().hang_timeout == "auto"  # the trainer's default
    assert cli_args("--hang-timeout", "90").hang_timeout == 90.0
    assert cli_args("--hang-timeout", "off").hang_timeout is None
    for bad in ("0", "0.001", "-3", "inf", "soon"):
        with pytest.raises(SystemExit) as exit:
            cli_args("--hang-timeout", bad)
        assert exit.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            "phalanx train: error: argument --hang-timeout: must be a number of "
            f"seconds, at least 1 (e.g. 600), auto or off, got {bad!r} (see "
            "phalanx train --help)"
        )


def test_a_bad_hang_timeout_in_the_environment_is_a_usage_error(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PHALANX_HANG_TIMEOUT", "abc")
    assert main(["train", "--run-dir", "R"]) == 2
    out, err = capsys.readouterr()
    assert err == (
        "phalanx train: error: PHALANX_HANG_TIMEOUT='abc': set it to a number of "
        "seconds, at least 1 (e.g. 600), or off, or unset it\n"
    )
    assert out == "" and not (tmp_path / "R").exists()


def test_mesh_takes_a_context_axis_splitting_dimension_one():
    args = cli_args("--strategy", "mesh", "--mesh", "data=2,context=2")
    assert args.mesh == "data=2,fsdp=1,context=2,tensor=1"
    strategy = make_strategy(args, jax.devices()[:4])
    assert isinstance(strategy, px.MeshStrategy)
    assert dict(strategy.mesh.shape) == {
        "data": 2,
        "fsdp": 1,
        "context": 2,
        "tensor": 1,
    }
    assert strategy.sequence_dims.every == 1
    assert cli_args("--strategy", "mesh", "--mesh", "fsdp=2").mesh == (
        "data=-1,fsdp=2,tensor=1"
    )


def test_slow_steps_reaches_the_trainer_and_not_the_config(
    tmp_path, monkeypatch, capsys
):
    factors = []
    init = SlowSteps.__init__

    def recording(self, clock, factor):
        factors.append(factor)
        init(self, clock, factor)

    monkeypatch.setattr(SlowSteps, "__init__", recording)
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--epochs", "1", "--hidden", "16", "--batch-size", "256"]
    argv += ["--no-plot", "--logger", "csv", "--slow-steps", "off", "--run-dir", "R"]
    assert main(argv) == 0, capsys.readouterr().err
    assert factors == [None]  # the one fit's alarm, off
    assert "slow_steps" not in (tmp_path / "R" / "config.toml").read_text()


# --- --mesh with a tensor axis ------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "instead"),
    [
        ("tensor=2", "data=-1,fsdp=2"),
        ("data=2,fsdp=2,tensor=2", "data=2,fsdp=4"),
        ("tensor=-1", "data=1,fsdp=-1"),
    ],
)
def test_a_tensor_axis_is_refused_as_no_rule_can_be_given(
    tmp_path, capsys, monkeypatch, sizes, instead
):
    # A config file holds the same options as the flags: no rules either.
    (tmp_path / "c.toml").write_text(f'strategy = "mesh"\nmesh = "{sizes}"\n')
    monkeypatch.chdir(tmp_path)
    for argv in (["--strategy", "mesh", "--mesh", sizes], ["--config", "c.toml"]):
        assert main(["train", *argv, "--run-dir", "R"]) == 2
        out, err = capsys.readouterr()
        written = cli_args("--mesh", sizes).mesh
        assert err == (
            f"phalanx train: error: --mesh {written}: the tensor axis splits the "
            "parameters only where sharding rules say, and phalanx train takes "
            "none (no option or config key), so tensor="
            f"{sizes.split('tensor=')[1]} would hold and compute the same on each "
            f"of its devices; split the state over fsdp instead, e.g. --mesh "
            f"{instead}, or train in Python with px.MeshStrategy(tensor=..., "
            "rules=[...])\n"
        )
        assert out == "" and not (tmp_path / "R").exists()


# --- --help -------------------------------------------------------------------


def test_help_shows_only_defaults_that_exist(capsys):
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(all, the default) or the optimizer state only --microbatches" in text
    for shown in ("--seed SEED seeds initialisation, shuffling, dropout (default: 0)",
                  "--epochs N passes over the data (default: 30)",
                  "--batch-size N global batch size"):  # fmt: skip
        assert shown in text
