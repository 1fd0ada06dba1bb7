"""The ``phalanx`` command line: ``phalanx train`` (also ``python -m phalanx``).

Every argument is validated, and the data loaded and checked, before a run
folder is created or JAX starts, so a bad command exits with code 2 and a
one-line reason and leaves nothing behind.
"""

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ._cli_train import (
    TrainArgs,
    UsageError,
    check_batch_size,
    check_run_dir,
    load_dataset,
    select_devices,
)
from ._launch import LaunchArgs, LaunchError, run_launch
from ._preemption import Preempted
from ._version import __version__
from .checkpoint import CheckpointWriteError


# Exit codes besides 0 (done), 1 (a bug in phalanx: a traceback), 2 (a bad
# command, refused before training) and 128 + N (stopped by signal N, after
# saving a checkpoint).
EXIT_DIVERGED = 3  # a non-finite gradient (nan_policy="raise")
EXIT_IO = 74  # a file could not be written (sysexits' EX_IOERR)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), and an
    option must be spelled out (``--epoch`` is not taken for ``--epochs``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"must be a positive finite number, got {text}"
        )
    return value


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of widths, e.g. 256,128"
        ) from None
    if not widths or any(w < 1 for w in widths):
        raise argparse.ArgumentTypeError(
            f"widths must be positive integers, e.g. 256,128; got {text!r}"
        )
    return widths


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="phalanx",
        description="Data-parallel training for Equinox models on JAX.",
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser
    )
    train = commands.add_parser(
        "train",
        help="train a model on a dataset across devices",
        description=(
            "Train a classifier data-parallel on every device, with a progress "
            "bar, a per-epoch table and logs (metrics.csv, metrics.jsonl, "
            "TensorBoard events, history.png) in the run folder. With no "
            "arguments: an MLP on the bundled digits data on 8 fake CPU devices."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = train.add_argument
    add("--model", choices=("linear", "mlp"), default="mlp", help="the model")
    add(
        "--hidden",
        type=_widths,
        default="256,128",
        metavar="W1,W2,...",
        help="hidden layer widths of the MLP",
    )
    add(
        "--dataset",
        default="digits",
        metavar="digits|mnist:PATH|npz:PATH",
        help="bundled digits, MNIST IDX files in PATH, or an .npz with x_train, "
        "y_train, x_test, y_test",
    )
    add(
        "--strategy",
        choices=("sharding", "pmap", "fsdp"),
        default="sharding",
        help="ShardingStrategy (jit over sharded arrays), PmapStrategy "
        "(per-device program) or FullyShardedStrategy (the state split over "
        "the devices)",
    )
    add(
        "--shard",
        choices=("all", "optimizer"),
        default=None,
        help="with --strategy fsdp: split parameters and optimizer state (all, "
        "the default) or the optimizer state only",
    )
    add(
        "--microbatches",
        type=_positive_int,
        default=1,
        metavar="K",
        help="gradient accumulation: split each device's batch in K parts",
    )
    add(
        "--devices",
        type=_positive_int,
        default=None,
        metavar="N",
        help="devices to train on; on a CPU-only host this fakes N CPU devices "
        "(default 8), on accelerators the default is all of them",
    )
    add(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="global batch size (a multiple of devices x microbatches)",
    )
    add("--epochs", type=_positive_int, default=30, help="passes over the data")
    add("--lr", type=_positive_float, default=0.1, help="peak learning rate")
    add(
        "--optimizer",
        choices=("adam", "adamw", "sgd"),
        default="sgd",
        help="optax optimizer (sgd uses momentum 0.9)",
    )
    add(
        "--schedule",
        choices=("constant", "cosine", "warmup-cosine"),
        default="cosine",
        help="learning-rate schedule over the run",
    )
    add(
        "--clip-norm",
        type=_positive_float,
        default=None,
        metavar="C",
        help="clip gradients to this global norm",
    )
    add("--seed", type=int, default=0, help="seeds initialisation, shuffling, dropout")
    add(
        "--run-dir",
        default=None,
        metavar="DIR",
        help="where logs go (default runs/<date-time>); must be new or empty",
    )
    add(
        "--overwrite",
        action="store_true",
        help="allow a non-empty --run-dir (files phalanx writes are replaced; "
        "others are left alone)",
    )
    add(
        "--checkpoint-every",
        type=_positive_int,
        default=None,
        metavar="STEPS",
        help="also checkpoint every this many steps (a checkpoint is always "
        "written at each epoch end, into RUN_DIR/checkpoints)",
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
        "as if it had never stopped",
    )
    add(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="float32 throughout, or float32 weights with the forward and "
        "backward pass in bfloat16 or float16 (fp16: with a dynamic loss scale)",
    )
    add(
        "--steps-per-call",
        type=_positive_int,
        default=1,
        metavar="K",
        help="run K steps per compiled call (lax.scan): for small models, "
        "where the host's work per step would otherwise set the speed",
    )
    add(
        "--log-every",
        type=_positive_int,
        default=10,
        metavar="STEPS",
        help="log training metrics every this many steps",
    )
    _add_launch(commands)
    return parser


def _add_launch(commands: "argparse._SubParsersAction[_Parser]") -> None:
    launch = commands.add_parser(
        "launch",
        help="run a program in N local processes on JAX's multi-process runtime",
        description=(
            "Start COMMAND in N processes on this machine, joined through a "
            "coordinator on 127.0.0.1 (phalanx.distributed.initialize() reads "
            "the environment this sets). Output lines are prefixed with the "
            "rank; Ctrl-C and SIGTERM reach every process; if one fails, the "
            "others are stopped and launch exits non-zero."
        ),
        usage="phalanx launch --nproc N [options] -- COMMAND [ARGS ...]",
    )
    launch.add_argument(
        "--nproc", type=_positive_int, required=True, help="processes to start"
    )
    launch.add_argument(
        "--devices-per-process",
        type=_positive_int,
        metavar="M",
        help="fake M CPU devices in each process (CPU platform only)",
    )
    launch.add_argument(
        "--port", type=_positive_int, help="coordinator port (default: a free one)"
    )
    launch.add_argument(
        "--verbose",
        action="store_true",
        help="keep gloo's connection notes ('[Gloo] Rank r is connected to n "
        "peer ranks...') in the output",
    )
    launch.add_argument(
        "program", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS ...]"
    )


def _launch(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> int:
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
            )
        )
    except LaunchError as error:
        print(f"phalanx launch: error: {error}", file=sys.stderr)
        return 2


def run_train(args: TrainArgs) -> int:
    """Validate, then train; returns the exit code."""
    train, test = load_dataset(args.dataset)
    if args.resume and args.overwrite:
        raise UsageError(
            "--resume continues a run; it cannot be combined with --overwrite"
        )
    if args.shard is not None and args.strategy != "fsdp":
        raise UsageError(
            f"--shard {args.shard} splits the state of --strategy fsdp, not of "
            f"--strategy {args.strategy}; add --strategy fsdp, or drop --shard"
        )
    check_run_dir(args.run_dir, args.overwrite, args.resume)
    devices, defaulted = select_devices(args.devices, args.distributed)
    check_batch_size(args.batch_size, len(devices), args.microbatches)
    # Only now: importing it starts JAX, which must see the devices chosen.
    from ._cli_run import train_and_report

    return train_and_report(args, devices, train, test, defaulted=defaulted)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phalanx`` console script."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    if namespace.command == "launch":
        return _launch(parser, namespace)
    try:
        args = TrainArgs.from_namespace(namespace)
        return run_train(args)
    except UsageError as error:
        print(f"phalanx {namespace.command}: error: {error}", file=sys.stderr)
        return 2
    except FloatingPointError as error:
        print(
            f"phalanx train: error: {error} (here: a lower --lr, or --clip-norm)",
            file=sys.stderr,
        )
        return EXIT_DIVERGED
    except CheckpointWriteError as error:
        message = str(error).replace("resume='latest'", "--resume")
        print(f"phalanx train: error: {message}", file=sys.stderr)
        return EXIT_IO
    except OSError as error:  # a log file: no space, or a folder gone read-only
        print(
            f"phalanx train: error: cannot write the run's files ({error}); free "
            "space or make the folder writable, then continue with --resume",
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
