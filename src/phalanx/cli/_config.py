"""``phalanx train``'s options resolved: the defaults, then a config file's
(``--config``, or the run's own ``config.toml`` under ``--resume``), then the
flags given; and ``phalanx find-lr``'s: train's defaults, then the flags
given."""

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._env import RESTART_COUNT
from ._args import (
    CONFIG_FILE,
    PER_COMMAND,
    RESUMABLE,
    FindLRArgs,
    PlanArgs,
    TrainArgs,
    UsageError,
    new_run_dir,
    read_config,
)
from ._model import model_args
from ._parser import RaisingParser, build_parser


def resolve_train(argv: Sequence[str], namespace: argparse.Namespace) -> TrainArgs:
    """The run's options: the defaults, then a config file's (--config, or
    the run's own config.toml under --resume), then the flags given."""
    given = vars(build_parser(explicit_only=True).parse_args(argv))
    del given["command"]
    options = vars(namespace)
    resume = given.get("resume", False)
    if "config" in given:
        if resume:
            raise UsageError(
                f"--config starts a run from a file; --resume continues one from "
                f"its own {CONFIG_FILE}: drop --config"
            )
        source = Path(given["config"])
        stored = _config_options(read_config(source, "--config"), f"--config {source}")
    elif resume and "run_dir" in given:
        source = Path(given["run_dir"]) / CONFIG_FILE
        if not source.exists():  # a run of an earlier phalanx: flags as given
            return TrainArgs.from_options(options)
        stored = _config_options(read_config(source, "--resume"), f"--resume {source}")
        _check_resumable(given, stored, source)
        if "schedule_steps" not in stored and "epochs" in stored:
            # An earlier phalanx's run: its schedule spanned its stored epochs.
            stored["schedule_epochs"] = stored["epochs"]
    else:
        return TrainArgs.from_options(options)
    return TrainArgs.from_options({**options, **stored, **given})


def restarted(argv: list[str], namespace: argparse.Namespace) -> list[str]:
    """`argv` of a ``phalanx train`` that ``phalanx launch --max-restarts``
    started again (``PHALANX_RESTART_COUNT`` above 0): the run goes on in
    its folder, from its latest checkpoint (``--resume``), or afresh where
    the start before failed before its first one (``--overwrite``). As
    given for a first start, or where --resume, --overwrite or --config
    says otherwise."""
    if os.environ.get(RESTART_COUNT, "0") in ("", "0"):
        return argv
    if namespace.resume or namespace.overwrite or namespace.config:
        return argv
    run_dir = Path(namespace.run_dir) if namespace.run_dir else new_run_dir()
    checkpoints = run_dir / "checkpoints"
    if checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir()):
        return [*argv, "--resume", "--run-dir", str(run_dir)]
    if run_dir.exists():
        return [*argv, "--overwrite", "--run-dir", str(run_dir)]
    return argv


# find-lr's own options: the range, and where its files go.
_FIND_LR_ONLY = ("start", "end", "steps", "run_dir", "overwrite", "no_plot")


def resolve_find_lr(argv: Sequence[str], namespace: argparse.Namespace) -> FindLRArgs:
    """The range test's options: its run is train's defaults, then the
    flags given (which find-lr shares with train)."""
    run, flags = _run_and_flags(argv, namespace, _FIND_LR_ONLY)
    return FindLRArgs(run, namespace.start, namespace.end, namespace.steps, flags)


# plan's own options.
_PLAN_ONLY = ("budget", "margin", "device", "measure")
# train's options that plan chooses itself.
PLAN_CHOOSES = ("microbatches",)


def resolve_plan(argv: Sequence[str], namespace: argparse.Namespace) -> PlanArgs:
    """The plan's options: its run is train's defaults, then the flags
    given (which plan shares with train). A --strategy given is the one
    planned (with its --shard or --mesh); none, every mesh split.

    Raises:
        UsageError: an option that plan chooses itself was given.
    """
    given = vars(build_parser(explicit_only=True).parse_args(argv))
    chosen = [name for name in PLAN_CHOOSES if name in given]
    if chosen:
        flags = ", ".join(f"--{name}" for name in chosen)
        raise UsageError(
            f"{flags}: phalanx plan chooses the microbatches itself (that is its "
            "answer); drop them"
        )
    run, flags = _run_and_flags(argv, namespace, _PLAN_ONLY)
    return PlanArgs(
        run,
        namespace.budget,
        namespace.margin,
        namespace.device,
        flags,
        measure=namespace.measure,
        strategy_given="strategy" in given,
    )


def _run_and_flags(
    argv: Sequence[str], namespace: argparse.Namespace, own: tuple[str, ...]
) -> tuple[TrainArgs, tuple[str, ...]]:
    """The run a command (find-lr, plan) works on: train's defaults, then
    the flags given; and those of the flags given that ``phalanx train``
    takes (not the command's `own`), as its flags."""
    given = vars(build_parser(explicit_only=True).parse_args(argv))
    defaults = vars(build_parser().parse_args(["train"]))
    run = TrainArgs.from_options({**defaults, **vars(namespace)})
    actions = _train_actions()
    flags = [
        part
        for name, value in given.items()
        if name in actions and name not in own
        for token in _tokens(
            actions[name], list(value) if isinstance(value, tuple) else value
        )
        or ()
        for part in _spaced(token)
    ]
    return run, tuple(flags)


def _spaced(token: str) -> list[str]:
    """``--flag=value`` as ``--flag value``, as people write it, unless the
    value starts with "-" (it would be taken for an option)."""
    flag, equals, value = token.partition("=")
    return [flag, value] if equals and not value.startswith("-") else [token]


def _config_options(table: dict[str, Any], where: str) -> dict[str, Any]:
    """A config file's options, each checked as its flag would be."""
    actions = _train_actions()
    known = sorted(name for name in actions if name not in PER_COMMAND)
    parser = build_parser(explicit_only=True, parser_class=RaisingParser)
    out: dict[str, Any] = {}
    for name, value in table.items():
        if name not in known:
            raise UsageError(
                f"{where}: unknown option {name!r}; a config file holds "
                f"{', '.join(known)}"
            )
        tokens = _tokens(actions[name], value)
        if tokens is None:
            raise UsageError(
                f"{where}: {name} = {value!r} is a {type(value).__name__}; "
                f"write it as {_expected(actions[name])}"
            )
        try:
            parsed = vars(parser.parse_args(["train", *tokens]))
        except UsageError as error:
            raise UsageError(f"{where}: {name} = {value!r}: {error}") from None
        # Absent where no token was given: an empty list, or a false flag.
        empty = [] if isinstance(actions[name], argparse._AppendAction) else False
        out[name] = parsed.get(name, empty)
    return out


def _train_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    subparsers = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    )
    train = subparsers.choices["train"]
    return {a.dest: a for a in train._actions if a.option_strings and a.dest != "help"}


def _tokens(action: argparse.Action, value: Any) -> list[str] | None:
    """The command-line tokens that give `value` to `action`'s option (None
    where the value's TOML type cannot be that option's)."""
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction):
        return ([flag] if value else []) if isinstance(value, bool) else None
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return None
        return [f"{flag}={item}" for item in value]
    if action.dest == "hidden" and isinstance(value, list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return None
        return [f"{flag}={','.join(map(str, value))}"]
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    return [f"{flag}={value}"]


def _expected(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "true or false"
    if isinstance(action, argparse._AppendAction):
        return 'a list of strings, e.g. ["a", "b"]'
    if action.dest == "hidden":
        return "a list of integers, e.g. [256, 128]"
    return "a string or a number"


# What a flag that may not change on --resume would change.
_WHAT = {
    "model": "model",
    "hidden": "model",
    "model_arg": "model",
    "dataset": "data",
    "batch_size": "data order",
    "seed": "run",
    "optimizer": "optimizer",
    "lr": "optimizer",
    "schedule": "optimizer",
    "schedule_steps": "optimizer",
    "clip_norm": "optimizer",
    "precision": "numerics",
    # The checkpoint holds the history, and a part-done epoch's running sums,
    # of the run's metrics.
    "metrics": "set of metrics",
}


def _check_resumable(
    given: dict[str, Any], stored: dict[str, Any], source: Path
) -> None:
    """Refuse a flag that would make the resumed run another run than the
    one its checkpoint holds."""
    actions = _train_actions()
    for name, value in given.items():
        old = stored.get(name)
        if name in PER_COMMAND or name in RESUMABLE or _same(name, value, old):
            continue
        # The flag as written: --metric's values are stored as "metrics".
        flag, what = actions[name].option_strings[0], _WHAT.get(name, "run")
        raise UsageError(
            f"--resume: {flag} {_shown(value)} differs from this run's "
            f"{_shown(old)} ({source}): it would be another {what} than "
            f"the checkpoint holds; drop {flag} to continue the run, or start "
            "a new run in another --run-dir"
        )


def _same(name: str, value: Any, old: Any) -> bool:
    """Whether a flag's value is the stored one: --model-arg's as Python
    values (``hidden=(64, 128)`` is ``hidden=(64,128)``), --metric's as a
    set, the rest as shown."""
    if name == "model_arg":
        try:
            return model_args(tuple(value)) == model_args(tuple(old or ()))
        except UsageError:  # a name given twice: told when the model is built
            return False
    if name == "metrics":  # accuracy is always logged; order and repeats aside
        return set(value) - {"accuracy"} == set(old or ()) - {"accuracy"}
    return _shown(value) == _shown(old)


def _shown(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, tuple | list):  # --model-arg's as given, --hidden's
        separator = " " if value and isinstance(value[0], str) else ","
        return separator.join(map(str, value))
    return str(value)
