"""Running ``phalanx train`` as a user would, and reading what it leaves.

Shared by the end-to-end resume tests (test_resume_cli.py) and the fault
suite (test_faults.py); their session-wide fixtures (the in-process
reference, the straight run) are in conftest.py. Values are compared with an
in-process reference: the CLI's trainer (same model, optimizer, schedule,
devices and data order) trained once, its full state recorded after every
step; a straight CLI run must equal it bitwise.
"""

import csv
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import forkserver
import phalanx as px
from helpers import host_arrays
from phalanx.cli._args import TrainArgs
from phalanx.cli._datasets import load_dataset
from phalanx.cli._main import build_parser
from phalanx.cli._train import make_optimizer, make_schedule, make_strategy


STEPS_PER_EPOCH, EPOCHS, LOG_EVERY = 23, 3, 5  # digits: 1437 examples, batch 64
TOTAL = STEPS_PER_EPOCH * EPOCHS
# --no-plot: these runs test resume and faults; drawing history.png (tested in
# test_cli.py) would add ~3 s to each of some fifty runs.
COMMON = ["--epochs", str(EPOCHS), "--log-every", str(LOG_EVERY), "--no-plot"]
EVERY_5 = ["--checkpoint-every", "5"]
NOTICE = (
    "phalanx: no accelerator found; using 8 fake CPU devices (--devices N to change)"
)
# What orbax logs of the temporary folder a killed run left behind (see
# test_sigkill_then_resume_is_exact): when a resumed run saves that step
# again, and, where the kill came before the folder's metadata was written,
# when it lists the folder.
STALE_TMP = re.compile(
    r"WARNING:absl:Attempted to create temporary directory .*/checkpoints/\d+"
    r"\.orbax-checkpoint-tmp which already exists\. Removing existing directory "
    r"since it is not finalized\."
    r"|WARNING:absl:Metadata file does not exist: .*/checkpoints/\d+"
    r"\.orbax-checkpoint-tmp/_CHECKPOINT_METADATA"
)
PROGRESS = re.compile(r"  step (\d+)/\d+  ")
FINAL = re.compile(r"test loss \d+\.\d{4}, test accuracy \d+\.\d{4}; logs in RUN$")
# Throughput figures and the Timeline's (time/<phase>, goodput) are wall-clock
# measurements: the only values allowed to differ between runs.
TIMINGS = ("examples_per_sec", "steps_per_sec", "tflops_per_sec", "mfu", "goodput")


# phalanx's slow-step alarm, on a run that other work on the machine slowed
# down (in CI, the other test workers share its two cores). The alarm's own
# tests judge it (tests/telemetry/test_alarms.py); elsewhere such lines report
# the machine's load, not the code under test.
SLOW_STEPS = "phalanx: slow steps: "


def said(stderr: str) -> list[str]:
    """A run's stderr lines, less the slow-step alarm's."""
    return [line for line in stderr.splitlines() if not line.startswith(SLOW_STEPS)]


def timing(name: str) -> bool:
    """Whether a logged value is a wall-clock measurement."""
    return name in TIMINGS or name.startswith("time/")


ENV = {
    **os.environ,
    "NPROC": "16",
    "JAX_PLATFORMS": "cpu",
    # Progress lines reach the pipe as they are printed.
    "PYTHONUNBUFFERED": "1",
    # (os.environ holds the session's compilation cache, conftest.py: every
    # run compiles the same programs, and a later run's start takes ~2 s
    # less for it.)
}
TIMEOUT = 120


# --- running the CLI ----------------------------------------------------------


class Phalanx:
    """`python -m phalanx train ARGS` in `cwd`, stdout read line by line
    (or `prefix` instead of ``python -m phalanx``, and with `script`, ARGS
    alone: a script of one's own); started by the fork server
    (forkserver.py) where it can be."""

    def __init__(
        self,
        cwd: pathlib.Path,
        *args: str,
        prefix: tuple[str, ...] = (),
        script: bool = False,
    ):
        self.stderr_path = cwd / f"stderr-{time.monotonic_ns()}.txt"
        command = prefix or (sys.executable, "-m", "phalanx")
        with open(self.stderr_path, "w") as stderr:
            self.process = forkserver.Popen(
                [*command, *([] if script else ["train"]), *args],
                cwd=cwd,
                env=ENV,
                stdout=subprocess.PIPE,
                stderr=stderr,
            )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout as stdout:
            for line in stdout:
                self.lines.append(line.rstrip("\n"))

    def progress(self) -> int:
        """The step of the newest progress line (0 before the first)."""
        for line in reversed(self.lines):
            match = PROGRESS.search(line)
            if match:
                return int(match.group(1))
        return 0

    def started(self) -> bool:
        """Whether training has begun (a progress line was printed)."""
        return self.progress() > 0

    def signal_when(
        self,
        condition: Callable[["Phalanx"], bool],
        signum: int,
        *,
        after: float = 0.0,
    ) -> int:
        """Send `signum` as soon as `condition(self)` holds (then `after`
        seconds later); returns the exit code."""
        self.wait_for(lambda: condition(self), "trigger")
        if after:
            time.sleep(after)
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)
        return self.wait()

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        """Return as soon as `condition()` holds; fail if the run ends first
        or it does not hold within `TIMEOUT` seconds."""
        deadline = time.monotonic() + TIMEOUT
        while not condition():
            if self.process.poll() is not None:
                pytest.fail(f"the run ended before the {what}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {what} within {TIMEOUT}s:\n{self.output()}")
            time.sleep(0.002)

    def kill(self) -> None:
        """SIGKILL the run, and reap it."""
        self.process.kill()
        self.process.wait(TIMEOUT)

    def wait(self) -> int:
        try:
            code = self.process.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._reader.join(TIMEOUT)
        return code

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def output(self) -> str:
        return "\n".join(self.lines) + "\n--- stderr ---\n" + self.stderr


def finish(cwd: pathlib.Path, *args: str) -> Phalanx:
    """A run that must end with exit code 0."""
    run = Phalanx(cwd, *args)
    assert run.wait() == 0, run.output()
    assert "Traceback" not in run.stderr, run.output()
    return run


def refused(cwd: pathlib.Path, *args: str) -> str:
    """`python -m phalanx ARGS` must exit 2 with one line on stderr and
    nothing on stdout; returns that line."""
    result = forkserver.run(
        [sys.executable, "-m", "phalanx", *args], cwd=cwd, env=ENV, timeout=TIMEOUT
    )
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- reading checkpoints and logs back ----------------------------------------


def cli_args(*args: str) -> TrainArgs:
    return TrainArgs.from_options(vars(build_parser().parse_args(["train", *args])))


def state_arrays(trainer: px.callbacks.TrainerLike) -> list[np.ndarray]:
    """Every array of the trainer's state (parameters, optimizer state, step,
    PRNG key data) on the host."""
    return host_arrays(trainer.state)


def same_arrays(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def cli_trainer(callbacks=()) -> tuple[px.DataParallelTrainer, px.data.ArrayLoader]:
    """The trainer and loader `phalanx train COMMON` builds (_cli_run.py)."""
    args = cli_args(*COMMON, "--run-dir", "unused")
    (x, y), _ = load_dataset(args.dataset)
    loader = px.data.ArrayLoader((x, y), args.batch_size, seed=args.seed)
    schedule = make_schedule(args, args.epochs * len(loader))
    model = px.models.MLP(
        x.shape[1], int(y.max()) + 1, hidden=args.hidden, key=jax.random.key(args.seed)
    )
    trainer = px.DataParallelTrainer(
        model,
        make_optimizer(args, schedule),
        strategy=make_strategy(args, jax.devices()[:8]),
        seed=args.seed,
        callbacks=callbacks,
    )
    return trainer, loader


def listed(folder: pathlib.Path) -> tuple[list[int], int | None]:
    """The steps orbax takes as complete, and the one it takes as latest."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(folder, options=options) as manager:
        return sorted(manager.all_steps()), manager.latest_step()


def host_state(folder: pathlib.Path, step: int) -> dict:
    """The JSON half of a checkpoint, timings left out of its history, and
    the Timeline's record (wall-clock measurements, its state) with them."""
    options = ocp.CheckpointManagerOptions(read_only=True)
    with ocp.CheckpointManager(folder, options=options) as manager:
        args = ocp.args.Composite(host=ocp.args.JsonRestore())
        host = manager.restore(step, args=args)["host"]
    for epoch in host["history"]["epochs"]:
        for name in [name for name in epoch if timing(name)]:
            del epoch[name]  # (mfu: only where the peak is known)
    host["callbacks"].pop("Timeline", None)
    return host


def csv_rows(run: pathlib.Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(run / "metrics.csv", newline="") as file:
        reader = csv.DictReader(file)
        rows = [{k: v for k, v in row.items() if not timing(k)} for row in reader]
    assert reader.fieldnames is not None
    return list(reader.fieldnames), rows


def jsonl_rows(run: pathlib.Path) -> list[dict]:
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    rows = [json.loads(line) for line in text.splitlines()]
    return [{k: v for k, v in row.items() if not timing(k)} for row in rows]


def logged_steps(rows: list[dict]) -> tuple[list[int], list[int]]:
    """The steps of the step rows and of the epoch rows, in file order."""
    steps = [int(r["step"]) for r in rows if r["kind"] == "step"]
    epochs = [int(r["step"]) for r in rows if r["kind"] == "epoch"]
    return steps, epochs


def assert_same_logs(run: pathlib.Path, straight: pathlib.Path) -> None:
    """Each logged step's row exactly once, equal to the straight run's: the
    same losses, accuracies, learning rates and eval results, to the bit."""
    header, rows = csv_rows(run)
    expected_header, expected = csv_rows(straight)
    lines, expected_lines = jsonl_rows(run), jsonl_rows(straight)
    for got in (rows, lines):
        steps, epochs = logged_steps(got)
        assert steps == list(range(LOG_EVERY, TOTAL + 1, LOG_EVERY))
        assert epochs == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    assert header == expected_header
    # CSV cells are repr(float): equal text is equal bits.
    assert rows == expected
    assert lines == expected_lines


def assert_same_run(
    run: pathlib.Path,
    straight: pathlib.Path,
    restore: Callable[[pathlib.Path, int], list[np.ndarray]],
) -> None:
    """Final state, checkpointed metadata and logs equal the straight run's."""
    steps, latest = listed(run / "checkpoints")
    assert latest == TOTAL, steps
    final = restore(run / "checkpoints", TOTAL)
    assert same_arrays(final, restore(straight / "checkpoints", TOTAL))
    # History, data position, loggers' row counts, the run's plan, ...
    assert host_state(run / "checkpoints", TOTAL) == host_state(
        straight / "checkpoints", TOTAL
    )
    assert_same_logs(run, straight)
