"""``phalanx launch``'s options: how many processes, their devices, the
coordinator's port, restarts and the hang watchdog's deadline (no JAX)."""

import argparse
from typing import Any

from ._values import non_negative_int, port, positive_int, seconds_or_off


def add_launch(commands: "argparse._SubParsersAction[Any]") -> None:
    """``phalanx launch``'s options, as a subcommand of `commands`."""
    launch = commands.add_parser(
        "launch",
        help="run a program in N local processes on JAX's multi-process runtime",
        description=(
            "Start COMMAND in N processes on this machine, joined through a "
            "coordinator on 127.0.0.1 (phalanx.distributed.initialize() reads "
            "the environment this sets). Output lines are prefixed with the "
            "rank; Ctrl-C and SIGTERM reach every process; if one fails, the "
            "others are stopped and launch exits non-zero (or, with "
            "--max-restarts, starts them all again). On Linux they also "
            "die with launch, even if it is killed with SIGKILL."
        ),
        usage="phalanx launch --nproc N [options] -- COMMAND [ARGS ...]",
    )
    launch.add_argument(
        "--nproc",
        type=positive_int,
        required=True,
        metavar="N",
        help="processes to start",
    )
    launch.add_argument(
        "--devices-per-process",
        type=positive_int,
        metavar="M",
        help="fake M CPU devices in each process (CPU platform only)",
    )
    launch.add_argument(
        "--port",
        type=port,
        metavar="PORT",
        help="coordinator port (default: a free one)",
    )
    launch.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="when a process fails (exits non-zero, is killed, or hangs and "
        "its hang watchdog ends it), stop the others and start all of them "
        "again, up to N times; the program resumes from its latest checkpoint "
        "(fit(resume='latest'), phalanx train --resume). Each start has "
        "PHALANX_RESTART_COUNT=0,1,... and a fresh port; JAX's compile cache "
        "is kept across starts (a temporary folder unless "
        "JAX_COMPILATION_CACHE_DIR is set). Default 0",
    )
    launch.add_argument(
        "--hang-timeout",
        type=seconds_or_off,
        default="auto",
        metavar="SECONDS",
        help="the hang watchdog's deadline in every process whose trainer "
        "leaves hang_timeout at 'auto' (phalanx train: --hang-timeout auto): "
        "seconds without progress, or off; sets PHALANX_HANG_TIMEOUT",
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
