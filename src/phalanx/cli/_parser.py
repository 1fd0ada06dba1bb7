"""The ``phalanx`` command line's parser: options, their types and help.

It turns text into values and nothing more. It imports no JAX (``phalanx
--help`` and a bad option answer at once), and how options combine with a
config file, or which ones a resumed run may change, is `cli/_config.py`'s.
"""

import argparse
from typing import Any, NoReturn

from .._metric_names import METRIC_NAMES
from .._version import __version__
from ._args import UsageError
from ._launch_parser import add_launch
from ._like_train_parser import LIKE_TRAIN, LikeTrain
from ._options import (
    add_compile_cache_options,
    add_device_options,
    add_folder_options,
    add_model_options,
    add_optimizer_options,
)
from ._values import (
    factor_or_off,
    positive_float,
    positive_int,
    seconds_or_off,
    steps,
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), and an
    option must be spelled out (``--epoch`` is not taken for ``--epochs``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help with its default, where it has one to show: not
    for an unset option or a flag, nor where the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.default is None or action.default is False or "default" in help:
            return help
        return super()._get_help_string(action)


class RaisingParser(_Parser):
    """A parser of a config file's options: an error is raised, to be
    reported with the file's name."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


LOGGERS = ("csv", "jsonl", "tensorboard", "wandb", "mlflow")
# --metric's names: the trainer's built-in metrics (accuracy is logged
# whatever is chosen).
METRICS = METRIC_NAMES


def build_parser(
    *, explicit_only: bool = False, parser_class: type[_Parser] = _Parser
) -> argparse.ArgumentParser:
    """The ``phalanx`` parser. With `explicit_only`, ``train``'s options have
    no defaults: parsing gives only the options given."""
    parser = parser_class(
        prog="phalanx",
        description="Data-parallel training for Equinox models on JAX.",
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=parser_class
    )
    train = commands.add_parser(
        "train",
        help="train a model on a dataset across devices",
        description=(
            "Train a classifier data-parallel on every device, with a progress "
            "bar, a per-epoch table and logs (metrics.csv, metrics.jsonl, "
            "TensorBoard events, history.png, config.toml) in the run folder. "
            "With no arguments: an MLP on the bundled digits data on 8 fake CPU "
            "devices."
        ),
        formatter_class=_HelpFormatter,
    )
    add = train.add_argument
    add_model_options(add)
    add(
        "--config",
        metavar="FILE",
        help="read options from a TOML file (as the config.toml a run writes); "
        "options given on the command line override it",
    )
    add_device_options(add)
    add(
        "--epochs",
        type=positive_int,
        default=30,
        metavar="N",
        help="passes over the data",
    )
    add("--lr", type=positive_float, default=0.1, help="peak learning rate")
    add(
        "--schedule",
        choices=("constant", "cosine", "warmup-cosine"),
        default="cosine",
        help="learning-rate schedule over --schedule-steps",
    )
    add(
        "--schedule-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="steps the schedule spans (default: the run's epochs x steps per "
        "epoch, fixed at its start and written to config.toml: a run resumed "
        "with other --epochs keeps it; past its end the rate stays at the "
        "schedule's final value)",
    )
    add_optimizer_options(add)
    add_folder_options(add, what="logs", plot="history.png")
    add_compile_cache_options(add)
    add(
        "--checkpoint-every",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="also checkpoint every this many steps (a checkpoint is always "
        "written at each epoch end, into RUN_DIR/checkpoints)",
    )
    add(
        "--eval-every",
        type=positive_int,
        default=None,
        metavar="STEPS",
        help="evaluate on the test set every this many steps (its metrics as "
        "eval rows in the logs) instead of at each epoch end",
    )
    add(
        "--distributed",
        action="store_true",
        help="join a multi-process run (phalanx.distributed.initialize: the "
        "environment phalanx launch sets, or the cluster's, e.g. SLURM); "
        "implied under phalanx launch. --batch-size is then the global batch",
    )
    add(
        "--resume",
        action="store_true",
        help="continue the run in --run-dir from its newest checkpoint, exactly "
        "as if it had never stopped; --epochs, logging, checkpointing, "
        "evaluation and where it runs (strategy, devices) may change, options "
        "that would change its updates may not",
    )
    add(
        "--steps-per-call",
        type=positive_int,
        default=1,
        metavar="K",
        help="run K steps per compiled call (lax.scan): for small models, "
        "where the host's work per step would otherwise set the speed",
    )
    add(
        "--log-every",
        type=positive_int,
        default=10,
        metavar="STEPS",
        help="log training metrics every this many steps",
    )
    add(
        "--logger",
        dest="loggers",
        action="append",
        choices=LOGGERS,
        help="where metrics go (repeatable; default: csv, jsonl and "
        "tensorboard, the last where tensorboardX is installed: pip install "
        "'phalanx[logs]'); wandb and mlflow need pip install 'phalanx[wandb]' / "
        "'phalanx[mlflow]' and take their settings from the environment "
        "(WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...)",
    )
    add(
        "--metric",
        dest="metrics",
        action="append",
        choices=METRICS,
        help="also log this metric of the classifier, in training and "
        "evaluations, over every example of each (repeatable; accuracy is "
        "always logged): f1, precision and recall macro-averaged over the "
        "classes, auc the ROC AUC (each class against the rest), "
        "confusion_matrix in metrics.jsonl only (CSV and TensorBoard hold "
        "numbers)",
    )
    add(
        "--telemetry",
        action="store_true",
        help="print where the time went at the end (px.callbacks.Timeline's "
        "table: compile, data, steps, evaluation, checkpoints, ...) and write "
        "RUN_DIR/trace.json, a trace of those phases for ui.perfetto.dev; "
        "RUN_DIR/timeline.json is written on every run",
    )
    add(
        "--hang-timeout",
        type=seconds_or_off,
        default="auto",
        metavar="SECONDS",
        help="end the run when it makes no progress for SECONDS (a step, "
        "collective, callback or checkpoint write that never returns): each "
        "process writes its Python stacks to RUN_DIR/checkpoints/hang-rank"
        "{r}.txt and exits with code 75 (phalanx launch --max-restarts then "
        "restarts the run from its last checkpoint); auto (the default): "
        "max(300, 3 x 16 x the median step) seconds; off: never",
    )
    add(
        "--slow-steps",
        type=factor_or_off,
        default=3.0,
        metavar="FACTOR",
        help="warn (one line each, at most 5 a run) of a stretch of steps "
        "slower than FACTOR x the median, naming where the time went "
        "(data, the device, callbacks, ...); off: no warnings (e.g. on a "
        "machine busy with other work, which slows steps down)",
    )
    add(
        "--profile",
        type=steps,
        metavar="START:END",
        help="record a jax.profiler trace of steps START to END into "
        "RUN_DIR/profile (TensorBoard's profile plugin or ui.perfetto.dev)",
    )
    like_train = [_add_like_train(commands, like) for like in LIKE_TRAIN]
    if explicit_only:
        for command in (train, *like_train):
            for action in command._actions:
                action.default = argparse.SUPPRESS
    add_launch(commands)
    return parser


def _add_like_train(
    commands: "argparse._SubParsersAction[_Parser]", like: LikeTrain
) -> _Parser:
    """`like`'s command (find-lr, plan): the model, device and optimizer
    options it shares with phalanx train, then its own, then the compile
    cache's."""
    command = commands.add_parser(
        like.name,
        description=like.description,
        help=like.help,
        formatter_class=_HelpFormatter,
    )
    add = command.add_argument
    add_model_options(add)
    add_device_options(add)
    add_optimizer_options(add)
    like.add_options(add)
    add_compile_cache_options(add)
    return command
