"""``phalanx plan``: the fit planner from the command line, on the model,
data and optimizer ``phalanx train`` builds from the same options. One
real plan, read back (its table, the ``phalanx train`` command it prints,
which parses to the choice); nothing fitting said in one line (exit 1);
bad commands refused in one line with exit code 2."""

import shlex
import sys

import pytest

import forkserver
from cli_runs import ENV, NOTICE, TIMEOUT, refused, said
from phalanx.cli._main import build_parser


MODEL = ["--optimizer", "adam", "--hidden", "64"]


def plan(cwd, *args: str):
    return forkserver.run(
        [sys.executable, "-m", "phalanx", "plan", *MODEL, *args],
        cwd=cwd,
        env=ENV,
        timeout=TIMEOUT,
    )


def test_a_plan_prints_its_table_and_the_command_that_trains_with_it(tmp_path):
    result = plan(tmp_path, "--budget", "1MiB", "--batch-size", "32")
    assert result.returncode == 0, result.stdout + result.stderr
    assert said(result.stderr) == [NOTICE]
    lines = result.stdout.splitlines()
    assert lines[0].strip().startswith("plan: 32 examples a step on 8 devices")
    assert any("<- chosen" in line for line in lines)
    chosen = next(line for line in lines if line.strip().startswith("chosen: "))
    command = lines[-1].removeprefix("train with it: ")
    words = shlex.split(command)
    assert words[:2] == ["phalanx", "train"]
    assert words[2:8] == [*MODEL, "--batch-size", "32"]
    trained = build_parser().parse_args(words[1:])
    assert trained.strategy == "mesh" and trained.batch_size == 32
    assert f"{trained.mesh.replace(',', ' ')}" in chosen  # data=D fsdp=F tensor=1
    assert not list(tmp_path.iterdir())  # a plan writes nothing


def test_a_strategy_given_is_planned_as_it_is(tmp_path):
    # Issue 57, item 4: --strategy fsdp --shard optimizer plans that
    # strategy's microbatches and remat; its command keeps the strategy.
    args = ("--budget", "1MiB", "--batch-size", "32", "--strategy", "fsdp")
    result = plan(tmp_path, *args, "--shard", "optimizer")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.startswith("│")]
    assert rows and all("FullyShardedStrategy" in row for row in rows)
    command = shlex.split(lines[-1].removeprefix("train with it: "))
    trained = build_parser().parse_args(command[1:])
    assert (trained.strategy, trained.shard) == ("fsdp", "optimizer")


def test_nothing_fitting_is_one_line_with_exit_code_1(tmp_path):
    result = plan(tmp_path, "--budget", "20KiB")
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    (line,) = [line for line in said(result.stderr) if line != NOTICE]
    assert line.startswith("phalanx plan: nothing fits: ")
    assert "over the budget of 20.0 KiB a device" in line


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ([], ["--budget is needed here", "e.g. --budget 16GiB"]),
        (["--budget", "lots"], ["--budget", "'lots' is not a positive size"]),
        (["--budget", "1GiB", "--margin", "1"], ["--margin", "below 1"]),
        (["--budget", "1GiB", "--microbatches", "2"], ["--microbatches", "chooses"]),
        (
            ["--budget", "1GiB", "--mesh", "data=2"],
            ["--mesh data=2", "--strategy mesh"],
        ),
        (
            ["--budget", "1GiB", "--strategy", "fsdp", "--mesh", "data=2"],
            ["--mesh data=2", "not of --strategy fsdp"],
        ),
        (["--budget", "1GiB", "--device", "abacus"], ["--device 'abacus'", "h100"]),
    ],
)
def test_bad_options_are_refused_in_one_line(tmp_path, args, needles):
    line = refused(tmp_path, "plan", *args)
    assert line.startswith("phalanx plan: error: ")
    for needle in needles:
        assert needle in line
