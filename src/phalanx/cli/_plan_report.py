"""The plan behind ``phalanx plan``, once every argument is valid: the
model, optimizer and precision ``phalanx train`` builds from the same
options, planned for its batch size on the devices chosen; the table of
candidates, and the ``phalanx train`` command that trains with the choice
(or one line where nothing fits)."""

import sys
from typing import Any

import numpy as np

from .._checks._device_note import devices_said
from .._plan._devices import budget_bytes, device_spec
from .._plan._space import PlanSpace
from .._trainer import DataParallelTrainer
from ..strategies import MeshStrategy, Strategy
from ._args import PlanArgs, UsageError
from ._datasets import Split
from ._train import make_model, make_optimizer, make_strategy, start_notes


# The exit code of a plan in which nothing fits.
EXIT_NOTHING_FITS = 1


def plan_and_report(
    args: PlanArgs, devices: list[Any], train: Split, *, defaulted: bool
) -> int:
    """Plan and print the plan; 0 where something fits, else
    `EXIT_NOTHING_FITS` with one line on stderr."""
    run = args.run
    try:  # before anything is said or built: a bad option is one line
        budget = budget_bytes(args.budget, devices)
        device_spec(args.device, devices[0].device_kind, np.dtype("float32"))
    except ValueError as error:
        raise UsageError(_as_flags(str(error))) from None
    x, y = train
    model, _ = make_model(run, x, y)
    strategy, space = _planned(args, devices)
    trainer = DataParallelTrainer(
        model,
        make_optimizer(run, run.lr),
        strategy=strategy,
        seed=run.seed,
        precision=run.precision,
        progress=False,
    )
    for line in start_notes(defaulted):
        print(line, file=sys.stderr)
    devices_said()
    batch = (x[: run.batch_size], y[: run.batch_size])
    plan = trainer.plan(
        batch,
        space=space,
        budget=budget,
        margin=args.margin,
        device=args.device,
        devices=devices,
        measure=args.measure,
    )
    if plan.choice is None:
        print(f"phalanx plan: {plan.nothing_fits()}", file=sys.stderr)
        return EXIT_NOTHING_FITS
    print(plan)
    print(f"train with it: {plan.command(args.train_flags)}")
    return 0


def _planned(args: PlanArgs, devices: list[Any]) -> tuple[Strategy, PlanSpace | None]:
    """The strategy planned and its space: without --strategy a mesh, whose
    plan weighs every split of the devices; with one, that strategy as it
    is (its microbatches and remat weighed), a mesh with --mesh sizes too."""
    if not args.strategy_given:
        return MeshStrategy(devices), None
    strategy = make_strategy(args.run, devices)
    if isinstance(strategy, MeshStrategy) and args.run.mesh is not None:
        return strategy, PlanSpace(strategy=strategy)
    return strategy, None


def _as_flags(message: str) -> str:
    """A planner's message about its arguments, in the command's flags."""
    if message.startswith("budget=None"):
        return (
            "--budget is needed here: the devices report no memory limit to JAX; "
            "pass the memory a step may take on each device, e.g. --budget 16GiB"
        )
    return message.replace("device=", "--device ")
