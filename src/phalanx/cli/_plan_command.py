"""``phalanx plan``: its options checked among themselves (no JAX), then
the data loaded and the devices chosen as ``phalanx train`` would, then
the plan made and reported (`cli/_plan_report.py`, which starts JAX)."""

from ._args import PlanArgs, UsageError
from ._strategy_options import check_strategy_options, check_tensor_axis


def check_plan(args: PlanArgs) -> None:
    """The checks of plan's options among themselves (no JAX, no data)."""
    if args.run.distributed:
        raise UsageError(
            "phalanx plan runs in one process, on its devices (--devices N); run "
            "it without phalanx launch"
        )
    run = args.run
    check_strategy_options(run.strategy, {"shard": run.shard, "mesh": run.mesh})
    if run.mesh is not None:
        check_tensor_axis(run.mesh)


def run_plan(args: PlanArgs) -> int:
    """Load the data, choose the devices, then plan; returns the exit code
    (`args` has passed `check_plan`)."""
    from ._start import checked_start

    train, _, devices, defaulted = checked_start(args.run, files=())
    # Only now: importing it starts JAX, which must see the devices chosen.
    from ._plan_report import plan_and_report

    return plan_and_report(args, devices, train, defaulted=defaulted)
