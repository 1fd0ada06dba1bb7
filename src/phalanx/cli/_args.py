"""What ``phalanx train`` was asked to do: the resolved options of a run, and
its ``config.toml`` (written into the run folder, read by ``--config`` and
``--resume``); and what ``phalanx find-lr`` was: the run it tests a range of
rates on, and the range."""

import dataclasses
import datetime
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w

from .._env import LAUNCH_STAMP, NUM_PROCESSES
from .._metric_names import MetricName


class UsageError(Exception):
    """A bad command: reported in one line with exit code 2."""


CONFIG_FILE = "config.toml"
# Options that say how this command runs rather than what the run is: never
# written to, nor read from, a config file.
PER_COMMAND = (
    "config",
    "resume",
    "overwrite",
    "run_dir",
    "distributed",
    "compile_cache",
    "no_compile_cache",
    # What this command prints and traces of where its time goes; nothing
    # of the run itself (its timeline.json is written either way).
    "telemetry",
    # Whether it warns of slow steps, nothing of the run either.
    "slow_steps",
    # When a run that stopped progressing is ended: nothing of the run.
    "hang_timeout",
)
# Options a resumed run may change: each leaves every update of the run as it
# was (invariant 5 of docs/architecture.md: a resumed run continues exactly as
# if never stopped, onto any strategy and device count). Every other option
# (the model, the data, the optimizer and its schedule, the seed, the
# numerics) must be the checkpointed run's; cli/_config.py checks them.
RESUMABLE = (
    # How long it trains: the learning-rate schedule keeps the run's
    # schedule_steps (written at the start), and epoch e's data order comes
    # from the seed and e alone, so the steps both runs take are the same.
    "epochs",
    # Output and cadence: what is logged, saved, evaluated or traced, and
    # when. Evaluation reads the state and changes none of it (not its key).
    "log_every",
    "checkpoint_every",
    "eval_every",
    "loggers",
    "no_plot",
    "profile",
    # Where and how a step runs. Every strategy, device count and number of
    # microbatches computes the same update: the gradient of the loss summed
    # over the global batch and divided once by its size (weight-0 padding
    # adds nothing), each example's dropout key folded from its index in the
    # global batch; they differ only in float summation order. So does
    # steps_per_call (the same steps in one lax.scan). A user model's
    # per-device batch statistics (BatchNorm) are the documented exception.
    "strategy",
    "shard",
    "mesh",
    "microbatches",
    # Who decodes the examples: the same batches either way.
    "data_workers",
    "devices",
    "steps_per_call",
)
DEFAULT_LOGGERS = ("csv", "jsonl", "tensorboard")


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """The resolved options of one ``phalanx train``: defaults, then a config
    file's values, then the command line's flags."""

    model: str
    hidden: tuple[int, ...]
    dataset: str
    strategy: str
    microbatches: int
    devices: int | None
    batch_size: int
    epochs: int
    lr: float
    optimizer: str
    schedule: str
    clip_norm: float | None
    seed: int
    run_dir: Path
    overwrite: bool
    checkpoint_every: int | None
    resume: bool
    log_every: int
    steps_per_call: int = 1
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    distributed: bool = False
    # FullyShardedStrategy's (None: its default, "all").
    shard: Literal["all", "optimizer"] | None = None
    # MeshStrategy's axis sizes, "data=D,fsdp=F,tensor=T" (None: not a mesh).
    mesh: str | None = None
    # --model-arg NAME=VALUE, as given (VALUE a Python literal).
    model_arg: tuple[str, ...] = ()
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    # --metric names, as given (accuracy is logged whether named or not).
    metrics: tuple[MetricName, ...] = ()
    # --profile START:END
    profile: tuple[int, int] | None = None
    eval_every: int | None = None
    # --no-plot: no history.png.
    no_plot: bool = False
    # --compile-cache DIR, --no-compile-cache (_telemetry/_compile_cache.py).
    compile_cache: str | None = None
    no_compile_cache: bool = False
    # --telemetry: the Timeline's table at the end, and RUN_DIR/trace.json.
    telemetry: bool = False
    # --data-workers N: grain's processes decoding a records: dataset.
    data_workers: int = 0
    # --slow-steps FACTOR or off (None): the trainer's slow-step alarm.
    slow_steps: float | None = 3.0
    # --hang-timeout SECONDS, auto or off (None): the trainer's hang watchdog.
    hang_timeout: float | Literal["auto"] | None = "auto"
    # The learning-rate schedule's length in steps; None until the run
    # starts, when it becomes its epochs x steps per epoch (see
    # `with_schedule_steps`) and is written to config.toml.
    schedule_steps: int | None = None
    # Not an option: for a run of an earlier phalanx, whose config.toml has no
    # schedule_steps, the epochs it stored (its schedule spanned those).
    schedule_epochs: int | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "TrainArgs":
        """From parsed options (argparse's, by field name); a missing run
        folder becomes a new ``runs/<date-time>``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in options.items() if k in fields}
        for name in ("hidden", "model_arg", "loggers", "metrics"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        values["loggers"] = values.get("loggers") or DEFAULT_LOGGERS
        values["model_arg"] = values.get("model_arg") or ()
        values["metrics"] = values.get("metrics") or ()
        run_dir = options.get("run_dir")
        values["run_dir"] = Path(run_dir) if run_dir else new_run_dir()
        values["distributed"] = bool(values.get("distributed")) or bool(
            os.environ.get(NUM_PROCESSES)
        )
        return cls(**values)

    @property
    def user_model(self) -> bool:
        """Whether ``--model`` names a factory of the user's (MODULE:FACTORY)."""
        return ":" in self.model

    def config(self) -> dict[str, Any]:
        """The run's options as a config file holds them (TOML values; unset
        options left out)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in _NOT_WRITTEN or value is None or value == ():
                continue
            if field.name == "hidden" and self.model != "mlp":
                continue  # the MLP's widths only
            if field.name == "profile":
                value = f"{value[0]}:{value[1]}"
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out

    def schedule_length(self, steps_per_epoch: int) -> int:
        """The steps the learning-rate schedule spans: --schedule-steps (or
        the run's stored value), else the epochs the schedule is made for
        (these, or an earlier phalanx's stored ones) x `steps_per_epoch`."""
        if self.schedule_steps is not None:
            return self.schedule_steps
        return (self.schedule_epochs or self.epochs) * steps_per_epoch

    def with_schedule_steps(self, steps_per_epoch: int) -> "TrainArgs":
        """These options with `schedule_length` fixed as schedule_steps (as
        the run's config.toml then holds it)."""
        steps = self.schedule_length(steps_per_epoch)
        return dataclasses.replace(self, schedule_steps=steps, schedule_epochs=None)

    def schedule_note(self, steps_per_epoch: int) -> str | None:
        """One line on how the schedule's length and the run's differ; None
        where they agree, or the rate is constant."""
        steps = self.schedule_length(steps_per_epoch)
        total = self.epochs * steps_per_epoch
        if steps == total or self.schedule == "constant":
            return None
        if total > steps:
            after = f"from step {steps} on, the rate stays at its final value"
        else:
            after = f"the run stops before the schedule's end, at step {total}"
        if self.resume:
            after = f"the run's schedule, kept on --resume: {after}"
        else:  # --schedule-steps, or a config file's
            after += f" (--schedule-steps {total} fits it to the run)"
        epochs = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        return (
            f"phalanx: the {self.schedule} learning-rate schedule spans {steps} "
            f"steps, the run {total} ({epochs} of {steps_per_epoch}); {after}"
        )


@dataclasses.dataclass(frozen=True)
class FindLRArgs:
    """The resolved options of one ``phalanx find-lr``."""

    # The run whose rate is sought, as ``phalanx train`` builds it from the
    # same options (train's defaults for those find-lr does not take); its
    # run_dir is where the range test's files go.
    run: TrainArgs
    start: float
    end: float
    steps: int
    # The options given that ``phalanx train`` takes, as its flags: with
    # --lr, the command that trains with the rate found.
    train_flags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    """The resolved options of one ``phalanx plan``."""

    # The run planned, as ``phalanx train`` builds it from the same options.
    run: TrainArgs
    budget: int | None
    margin: float
    device: str | None
    # The options given that ``phalanx train`` takes, as its flags.
    train_flags: tuple[str, ...] = ()
    # How many of the fastest predicted that fit are run and timed.
    measure: int = 0
    # Whether --strategy was given: that strategy is planned as it is (a
    # mesh with --mesh sizes too); else every mesh split of the devices.
    strategy_given: bool = False


# Fields never written to a config file: the per-command options, and what is
# no option.
_NOT_WRITTEN = (*PER_COMMAND, "schedule_epochs")


def write_config(args: TrainArgs) -> None:
    """Write `args.config()` to the run folder's config.toml, atomically (a
    reader sees the old file or the new one, never part of one)."""
    path = args.run_dir / CONFIG_FILE
    temporary = path.with_name(f".{CONFIG_FILE}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(_HEADER.encode())
            tomli_w.dump(args.config(), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


_HEADER = (
    "# The options of this run, written by phalanx train. `phalanx train "
    "--config\n# THIS_FILE` starts a run like it; `phalanx train --run-dir "
    "THIS_FOLDER --resume`\n# continues it.\n"
)


def read_config(path: Path, option: str) -> dict[str, Any]:
    """A config file's table of options.

    Raises:
        UsageError: the file cannot be read or is not TOML (named as `option`).
    """
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file") from None
    except OSError as error:
        raise UsageError(
            f"{option} {path}: cannot read it ({error.strerror})"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{option} {path}: not valid TOML ({error})") from None


def new_run_dir() -> Path:
    """runs/<date-time>, with a suffix if a run started in the same second;
    under phalanx launch, the launch's time (the same in every process)."""
    if LAUNCH_STAMP in os.environ:
        return Path("runs") / os.environ[LAUNCH_STAMP]
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = Path("runs") / stamp, 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{stamp}-{n}"
    return path
