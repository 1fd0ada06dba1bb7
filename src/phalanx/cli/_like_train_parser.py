"""The commands that build what ``phalanx train`` would from the same model,
device and optimizer options and then do something else with it:
``phalanx find-lr`` and ``phalanx plan``. Each is a row of `LIKE_TRAIN` (its
name, help, description and own options), and `cli/_parser.py` builds every
row the same way, so that a new such command is a row, not a copy of a
builder. Like the parser it imports no JAX."""

import dataclasses
from collections.abc import Callable

from ._options import Add, add_folder_options
from ._values import at_least_two, fraction, non_negative_int, positive_float, size


@dataclasses.dataclass(frozen=True)
class LikeTrain:
    """A command that takes phalanx train's model, device and optimizer
    options: its name and one-line help in ``phalanx --help``, its
    description, and what adds its own options (before the compile cache's,
    which every such command takes)."""

    name: str
    help: str
    description: str
    add_options: Callable[[Add], None]


def _add_find_lr_options(add: Add) -> None:
    """--start, --end and --steps of the sweep, and where its files go."""
    add(
        "--start",
        type=positive_float,
        default=1e-7,
        metavar="LR",
        help="the first rate",
    )
    add(
        "--end",
        type=positive_float,
        default=10.0,
        metavar="LR",
        help="the last rate, above --start",
    )
    add(
        "--steps",
        type=at_least_two,
        default=100,
        metavar="N",
        help="steps at most, one per rate (the sweep stops where the loss "
        "diverges); the suggestion needs at least 13 before that",
    )
    add_folder_options(add, what="lr_find.json and lr_find.png", plot="lr_find.png")


def _add_plan_options(add: Add) -> None:
    """--budget and --margin (the memory a step may take), --device (the
    one whose speed is priced) and --measure (how many to run and time)."""
    add(
        "--budget",
        type=size,
        default=None,
        metavar="SIZE",
        help="the memory a step may take on each device, e.g. 16GiB or 500MB "
        "(default: the device's memory, where JAX reports it; required on CPU)",
    )
    add(
        "--margin",
        type=fraction,
        default=0.1,
        metavar="F",
        help="the share of --budget kept free",
    )
    add(
        "--device",
        default=None,
        metavar="NAME",
        help="the device the cost model prices (h100, a100, tpu v5p, ...; "
        "default: the devices' own kind; on CPU the times only rank)",
    )
    add(
        "--measure",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="run the N fastest predicted that fit for a few steps each and "
        "choose by their measured step time (default 0: by prediction)",
    )


LIKE_TRAIN = (
    LikeTrain(
        name="find-lr",
        help="find a learning rate for phalanx train: the range test",
        description=(
            "The learning-rate range test (Lightning's lr_find) on the model, "
            "data, strategy and optimizer phalanx train would build from the "
            "same options: one step per rate, the rates rising geometrically "
            "from --start to --end until the loss diverges. Prints the rate "
            "where the loss falls fastest and the phalanx train command that "
            "uses it; writes lr_find.json (rates, losses, suggestion) and "
            "lr_find.png in the run folder. Nothing is trained: the steps are "
            "computed, not kept."
        ),
        add_options=_add_find_lr_options,
    ),
    LikeTrain(
        name="plan",
        help="choose the layout that fits and is fastest, before training",
        description=(
            "The fit planner on the model, data, optimizer and precision phalanx "
            "train would build from the same options: the train step compiled "
            "ahead of time (nothing runs) under each mesh split of the devices "
            "(data x fsdp), Stacked remat setting and microbatch count, and the "
            "fastest predicted that fits --budget chosen. Prints the table of "
            "candidates and the phalanx train command that trains with the "
            "choice; exits 1, with one line, where nothing fits. With --strategy "
            "(and its --shard or --mesh) it plans that strategy as it is: its "
            "microbatch counts and remat settings. It chooses --microbatches "
            "itself."
        ),
        add_options=_add_plan_options,
    ),
)
