"""The ``phalanx`` command line: ``phalanx train``, ``phalanx find-lr`` and
``phalanx launch`` (also ``python -m phalanx``).

Every argument is validated, and the data loaded and checked, before a run
folder is created or JAX starts, so a bad command exits with code 2 and a
one-line reason and leaves nothing behind; a run that fails later, before
its first step, removes what it wrote. ``--help``, ``--version`` and a
bad option answer without importing JAX: only the parser is imported here,
the rest once the command is valid.
"""

import argparse
import functools as ft
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from .._env import hang_timeout_from_env
from ._args import FindLRArgs, TrainArgs, UsageError
from ._config import resolve_find_lr, resolve_plan, resolve_train, restarted
from ._parser import build_parser
from ._plan_command import check_plan, run_plan
from ._strategy_options import check_strategy_options, check_tensor_axis


# Exit codes besides 0 (done), 1 (a bug in phalanx: a traceback), 2 (a bad
# command, refused before training) and 128 + N (stopped by signal N, after
# saving a checkpoint).
EXIT_DIVERGED = 3  # a non-finite gradient (nan_policy="raise")
# The user's code raised (--model's module, factory or model, --dataset's
# function): its traceback, then one line of context.
EXIT_USER_CODE = 4
EXIT_IO = 74  # a file could not be written (sysexits' EX_IOERR)


def _launch(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
    from ._launch import run_launch
    from ._ranks import LaunchArgs, LaunchError

    program = list(namespace.program)
    if program[:1] == ["--"]:
        program = program[1:]
    if not program:
        parser.error("launch needs a command after --, e.g. -- phalanx train")
    try:
        return run_launch(
            LaunchArgs(
                namespace.nproc,
                tuple(program),
                devices_per_process=namespace.devices_per_process,
                port=namespace.port,
                verbose=namespace.verbose,
                max_restarts=namespace.max_restarts,
                hang_timeout=_hang_timeout(namespace.hang_timeout),
            )
        )
    except LaunchError as error:
        print(f"phalanx launch: error: {error}", file=sys.stderr)
        return 2


def _hang_timeout(value: float | str | None) -> str | None:
    """``--hang-timeout`` of launch as PHALANX_HANG_TIMEOUT (None: unset)."""
    if value == "auto":
        return None
    return "off" if value is None else f"{value:g}"


# --- train ----------------------------------------------------------------------


def check_arguments(args: TrainArgs) -> None:
    """The checks of the options among themselves (no JAX, no data)."""
    if args.resume and args.overwrite:
        raise UsageError(
            "--resume continues a run; it cannot be combined with --overwrite"
        )
    if args.compile_cache is not None and args.no_compile_cache:
        raise UsageError(
            f"--compile-cache {args.compile_cache} and --no-compile-cache "
            "contradict each other; pass one"
        )
    check_strategy_options(args.strategy, {"shard": args.shard, "mesh": args.mesh})
    if args.mesh is not None:
        check_tensor_axis(args.mesh)
    if args.model_arg and not args.user_model:
        raise UsageError(
            f"--model-arg is for --model MODULE:FACTORY, not the built-in "
            f"--model {args.model}"
            + (" (its widths: --hidden)" if args.model == "mlp" else "")
        )
    if args.data_workers and not args.dataset.startswith("records:"):
        raise UsageError(
            f"--data-workers {args.data_workers} sets the processes reading "
            f"--dataset records:DIR, not --dataset {args.dataset}; write the "
            "data with px.data.write_records and pass records:DIR, or drop "
            "--data-workers"
        )
    if args.hang_timeout == "auto":
        try:  # PHALANX_HANG_TIMEOUT, as the trainer would read it at fit
            hang_timeout_from_env()
        except ValueError as error:
            raise UsageError(str(error)) from None
    if args.hidden != (256, 128) and args.model != "mlp":
        raise UsageError(
            f"--hidden sets the widths of --model mlp, not of --model {args.model}"
            + ("; pass widths with --model-arg" if args.user_model else "")
        )


def run_train(args: TrainArgs) -> int:
    """Validate what needs the data and the devices, then train; returns the
    exit code (`args` has passed `check_arguments`)."""
    from ._outputs import choose_outputs
    from ._start import checked_start

    outputs = choose_outputs(args)
    train, test, devices, defaulted = checked_start(args)
    # Only now: importing it starts JAX, which must see the devices chosen.
    from ._folder import RunFolder
    from ._train import train_and_report

    folder = RunFolder(args.run_dir, resume=args.resume)
    try:
        return train_and_report(
            args,
            devices,
            train,
            test,
            defaulted=defaulted,
            outputs=outputs,
            folder=folder,
        )
    except BaseException:
        folder.undo()  # unless it got as far as a step or a checkpoint
        raise


# --- find-lr --------------------------------------------------------------------


def check_find_lr(args: FindLRArgs) -> None:
    """The checks of find-lr's options among themselves (no JAX, no data)."""
    check_arguments(args.run)
    if args.end <= args.start:
        raise UsageError(
            f"--end {args.end:g} is not above --start {args.start:g}: the rates "
            "rise from --start to --end; pass an --end above --start, e.g. "
            f"--end {10.0 if args.start < 10 else args.start * 100:g}"
        )
    if args.run.distributed:
        raise UsageError(
            "phalanx find-lr runs in one process, on its devices (--devices "
            "N); run it without phalanx launch"
        )


def run_find_lr(args: FindLRArgs) -> int:
    """Validate what needs the data and the devices, then run the range
    test; returns the exit code (`args` has passed `check_find_lr`)."""
    from ._folder import FIND_LR_FILES
    from ._outputs import choose_plot
    from ._start import checked_start

    plot, note = choose_plot(args.run.no_plot, FIND_LR_FILES[1])
    train, test, devices, defaulted = checked_start(args.run, FIND_LR_FILES)
    # Only now: importing it starts JAX, which must see the devices chosen.
    from ._find_lr import find_lr_and_report
    from ._folder import RunFolder

    folder = RunFolder(args.run.run_dir, resume=False, files=FIND_LR_FILES)
    try:
        return find_lr_and_report(
            args,
            devices,
            train,
            test,
            defaulted=defaulted,
            plot=plot,
            note=note,
            folder=folder,
        )
    except BaseException:
        folder.undo()
        raise


def main(argv: Sequence[str] | None = None) -> int:
    """The ``phalanx`` command: what the console script runs.

    Args:
        argv: the arguments after ``phalanx`` (e.g. ``["train", "--epochs",
            "2"]`` or ``["find-lr", "--optimizer", "adam"]``); default
            ``sys.argv[1:]``.

    Returns:
        The exit code, as the command's (the command-line guide's table):
        0 done; 1 ``phalanx plan`` found nothing that fits; 2 a bad
        argument (one line on stderr); 3 a non-finite gradient; 4 your own
        code raised; 74 a file could not be written; 130 / 143 stopped by
        SIGINT / SIGTERM.

    Example:
        ```python
        from phalanx.cli import main

        main(["train", "--epochs", "1", "--run-dir", "runs/quick"])
        ```
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    namespace = parser.parse_args(argv)
    command = namespace.command
    if command == "launch":
        return _launch(parser, namespace)
    run: Callable[[], int]
    try:
        if command == "find-lr":
            found = resolve_find_lr(argv, namespace)
            check_find_lr(found)
            run = ft.partial(run_find_lr, found)
        elif command == "plan":
            planned = resolve_plan(argv, namespace)
            check_plan(planned)
            run = ft.partial(run_plan, planned)
        else:
            argv = restarted(argv, namespace)  # under launch --max-restarts
            namespace = parser.parse_args(argv)
            args = resolve_train(argv, namespace)
            check_arguments(args)
            run = ft.partial(run_train, args)
    except UsageError as error:
        print(f"phalanx {command}: error: {error}", file=sys.stderr)
        return 2
    return _reported(command, run)


def _reported(command: str, run: Callable[[], int]) -> int:
    """`run()`, its failures reported in one line (``phalanx COMMAND:
    error: ...``) with their exit code."""
    from .._preemption import Preempted
    from ..callbacks import TrackerError
    from ..checkpoint import CheckpointWriteError
    from ._model import UserCodeError

    prefix = f"phalanx {command}: error:"
    # What to do once the cause is fixed: a run goes on from its checkpoint.
    then = "continue with --resume" if command == "train" else "run it again"
    try:
        return run()
    except (UsageError, TrackerError) as error:
        print(f"{prefix} {error}", file=sys.stderr)
        return 2
    except UserCodeError as error:
        assert error.__cause__ is not None
        traceback.print_exception(error.__cause__)
        print(f"{prefix} {error}", file=sys.stderr)
        return EXIT_USER_CODE
    except FloatingPointError as error:
        print(
            f"{prefix} {error} (here: a lower --lr, or --clip-norm)",
            file=sys.stderr,
        )
        return EXIT_DIVERGED
    except CheckpointWriteError as error:
        message = str(error).replace("resume='latest'", "--resume")
        print(f"{prefix} {message}", file=sys.stderr)
        return EXIT_IO
    except OSError as error:  # a log file: no space, or a folder gone read-only
        print(
            f"{prefix} cannot write the run's files ({error}); free space or "
            f"make the folder writable, then {then}",
            file=sys.stderr,
        )
        return EXIT_IO
    except Preempted as stop:
        print(f"phalanx: {stop}; continue with --resume", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("phalanx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    os._exit(main())
