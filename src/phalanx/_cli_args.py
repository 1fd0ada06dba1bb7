"""What ``phalanx train`` was asked to do: the resolved options of a run, and
its ``config.toml`` (written into the run folder, read by ``--config`` and
``--resume``)."""

import dataclasses
import datetime
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w

from ._env import LAUNCH_STAMP, NUM_PROCESSES


class UsageError(Exception):
    """A bad command: reported in one line with exit code 2."""


CONFIG_FILE = "config.toml"
# Options that say how this command runs rather than what the run is: never
# written to, nor read from, a config file.
PER_COMMAND = ("config", "resume", "overwrite", "run_dir", "distributed")
# Options a resumed run may change: how long it trains, how it logs and where
# it runs. Every other option (the model, the data, the optimizer, the
# numerics) must be the checkpointed run's.
RESUMABLE = (
    "epochs",
    "log_every",
    "checkpoint_every",
    "eval_every",
    "loggers",
    "profile",
    "strategy",
    "shard",
    "microbatches",
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
    # --model-arg NAME=VALUE, as given (VALUE a Python literal).
    model_arg: tuple[str, ...] = ()
    loggers: tuple[str, ...] = DEFAULT_LOGGERS
    # --profile START:END
    profile: tuple[int, int] | None = None
    eval_every: int | None = None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "TrainArgs":
        """From parsed options (argparse's, by field name); a missing run
        folder becomes a new ``runs/<date-time>``."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in options.items() if k in fields}
        for name in ("hidden", "model_arg", "loggers"):
            if values.get(name) is not None:
                values[name] = tuple(values[name])
        values["loggers"] = values.get("loggers") or DEFAULT_LOGGERS
        values["model_arg"] = values.get("model_arg") or ()
        run_dir = options.get("run_dir")
        values["run_dir"] = Path(run_dir) if run_dir else _new_run_dir()
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
            if field.name in PER_COMMAND or value is None or value == ():
                continue
            if field.name == "hidden" and self.model != "mlp":
                continue  # the MLP's widths only
            if field.name == "profile":
                value = f"{value[0]}:{value[1]}"
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out


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


def _new_run_dir() -> Path:
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
