"""The plan's choice among layouts that fit (issue 57, item 3): the
fastest, a tie within `TIE` going to the simpler layout (fewer mesh axes,
no remat, fewer microbatches), by measured time where steps were timed;
its progress bar on a terminal; and ``phalanx plan --measure``. Nothing
here compiles."""

import io

from rich.console import Console

from phalanx._engine.program._summary import StepMemory
from phalanx._plan._choice import TIE, choose, simplicity
from phalanx._plan._devices import DeviceSpec
from phalanx._plan._measure import Measured
from phalanx._plan._progress import PlanProgress
from phalanx._plan._result import Plan, PlanRow
from phalanx._plan._space import Candidate, PlanSpace
from phalanx.cli._config import resolve_plan
from phalanx.cli._main import build_parser


def row(candidate: Candidate, seconds: float, timed: float | None = None) -> PlanRow:
    memory = StepMemory(arguments=1, outputs=1, aliased=1, temporaries=1)
    measured = Measured(
        memory=memory, peak=2, collectives=0.0, compute=seconds, traffic=0.0,
        communication=0.0,
    )  # fmt: skip
    return PlanRow(candidate, "fits", "", None, measured, timed=timed)


def plan_of(rows: list[PlanRow]) -> Plan:
    return Plan.of(
        rows, budget=10, margin=0.1, device=DeviceSpec("cpu", 1.0, 1.0, 1.0),
        devices=8, size=16, compiled=len(rows), seconds=1.0, space=PlanSpace(),
    )  # fmt: skip


DATA = Candidate(8, 1, 1, 1, False)
TWO_AXES = Candidate(2, 4, 1, 1, False)
REMAT = Candidate(8, 1, 1, 1, True)
MICRO = Candidate(8, 1, 1, 2, False)


def test_simpler_means_fewer_axes_then_no_remat_then_fewer_microbatches():
    assert simplicity(DATA) < simplicity(REMAT) < simplicity(TWO_AXES)
    assert simplicity(DATA) < simplicity(MICRO) < simplicity(REMAT)
    assert simplicity(Candidate(1, 1, 1, 1, None)) == (0, 0, 1, 0)


def test_a_tie_within_the_tolerance_goes_to_the_simpler_layout():
    # Faster by less than TIE: the simpler wins; by more: the faster does.
    close = 1.0 / (1 + TIE / 2)
    assert plan_of([row(TWO_AXES, close), row(DATA, 1.0)]).choice.candidate == DATA  # pyright: ignore[reportOptionalMemberAccess]
    far = 1.0 / (1 + 2 * TIE)
    assert plan_of([row(TWO_AXES, far), row(DATA, 1.0)]).choice.candidate == TWO_AXES  # pyright: ignore[reportOptionalMemberAccess]
    assert plan_of([row(REMAT, close), row(DATA, 1.0)]).choice.candidate == DATA  # pyright: ignore[reportOptionalMemberAccess]
    # Two as simple: the faster.
    other = Candidate(1, 8, 1, 1, False)
    assert plan_of([row(other, 1.0), row(TWO_AXES, close)]).choice.candidate == other  # pyright: ignore[reportOptionalMemberAccess]
    empty: list[PlanRow] = []
    assert choose(empty, lambda r: 1.0, lambda r: r.candidate) is None


def test_measured_times_rank_where_steps_were_timed():
    # Predicted the other way round; measured, DATA is faster by far.
    rows = [row(TWO_AXES, 1.0, timed=2.0), row(DATA, 2.0, timed=1.0), row(MICRO, 0.5)]
    plan = plan_of(rows)
    assert plan.choice is rows[1] and plan.by_measurement
    assert "measured" in str(plan) and "by measured step time" in str(plan)
    assert not plan_of(rows[2:]).by_measurement


def test_the_bar_counts_candidates_on_a_terminal():
    text = io.StringIO()
    console = Console(file=text, force_terminal=True, width=200)
    with PlanProgress(None, console=console) as progress:
        progress.start(4, 8)
        progress.compiling(DATA)
        progress.costed(row(DATA, 1.0), reused=False)
        progress.settled([REMAT, MICRO], "bounded", "its time bound ...")
    out = text.getvalue()
    assert "compiled 1 pruned 0 bounded 2 left 1" in out
    # Off a terminal: nothing, unless asked for (then log lines, not a bar).
    quiet = io.StringIO()
    with PlanProgress(None, console=Console(file=quiet)) as progress:
        progress.start(4, 8)
    assert quiet.getvalue() == ""


def test_phalanx_plan_takes_measure_and_keeps_it_off_the_train_command():
    argv = ["plan", "--hidden", "64", "--budget", "1MiB", "--measure", "2"]
    planned = resolve_plan(argv, build_parser().parse_args(argv))
    assert planned.measure == 2 and "--measure" not in planned.train_flags
    argv = argv[:-2]
    assert resolve_plan(argv, build_parser().parse_args(argv)).measure == 0
