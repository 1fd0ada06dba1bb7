"""What a ``phalanx train`` run writes besides its checkpoints and
config.toml: its loggers and plot, chosen before anything is written (and
whether ``phalanx find-lr`` draws its plot). The default ones whose library
is missing are left out, in one line naming the extra that adds them; a
logger asked for must be installed."""

import dataclasses
import importlib.util
import os
import sys

from ._args import DEFAULT_LOGGERS, TrainArgs, UsageError


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a run writes besides its checkpoints and config.toml."""

    loggers: tuple[str, ...]  # the --logger names whose library is installed
    plot: bool  # whether it draws history.png
    note: str | None  # one line on what a missing extra left out, if anything


# The library each output needs, and the extra that installs it.
_NEEDS = {
    "tensorboard": ("tensorboardX", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "plot": ("matplotlib", "plot"),
}
# The extra with everything the default outputs need.
LOGS_EXTRA = "logs"


def choose_outputs(args: TrainArgs) -> Outputs:
    """The loggers and plot of the run. A default one whose library is
    missing (TensorBoard, history.png) is left out, and the note says which
    extra adds it; a --logger asked for is required.

    Raises:
        UsageError: a --logger given whose library is missing, or --logger
            mlflow without a tracking URI.
    """
    defaults = args.loggers == DEFAULT_LOGGERS
    loggers: list[str] = []
    missing: list[str] = []  # the default outputs left out
    for name in dict.fromkeys(args.loggers):
        if name not in _NEEDS or installed(_NEEDS[name][0]):
            loggers.append(name)
        elif defaults:
            missing.append(name)
        else:
            package, extra = _NEEDS[name]
            raise UsageError(
                f"--logger {name} needs {package}, which is not installed: "
                f"pip install 'phalanx[{extra}]'"
            )
    if "mlflow" in loggers and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise UsageError(
            "--logger mlflow: set MLFLOW_TRACKING_URI to your tracking server "
            "(http://...), or to a local store (file:./mlruns, with "
            "MLFLOW_ALLOW_FILE_STORE=true under MLflow 3)"
        )
    plot = _plot(args.no_plot, missing)
    return Outputs(tuple(loggers), plot, _note(missing, "history.png"))


def choose_plot(no_plot: bool, image: str) -> tuple[bool, str | None]:
    """Whether a command draws its plot `image` (not with `no_plot`, nor
    where matplotlib is missing), and the note saying it is left out."""
    missing: list[str] = []
    return _plot(no_plot, missing), _note(missing, image)


def _plot(no_plot: bool, missing: list[str]) -> bool:
    """Whether the plot is drawn; "plot" added to `missing` where it is
    asked for but matplotlib is not installed."""
    plot = not no_plot and installed(_NEEDS["plot"][0])
    if not no_plot and not plot:
        missing.append("plot")
    return plot


def _note(missing: list[str], image: str) -> str | None:
    """One line: the default outputs left out (the plot is `image`), and
    the extra that adds them."""
    if not missing:
        return None
    what = {"tensorboard": "TensorBoard events", "plot": image}
    packages = " and ".join(_NEEDS[name][0] for name in missing)
    verb = "is" if len(missing) == 1 else "are"
    outputs = " or ".join(what[name] for name in missing)
    return (
        f"phalanx: no {outputs} ({packages} {verb} not installed; pip install "
        f"'phalanx[{LOGS_EXTRA}]' adds {'it' if len(missing) == 1 else 'them'})"
    )


def installed(package: str) -> bool:
    """Whether `package` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent missing; imported, no spec
        return package in sys.modules and sys.modules[package] is not None
