"""The plan's search, fast and visible (issue 57, item 6; acceptance 3 on
CPU): a budget nothing can meet answered in at most two compiles (the least
peak of the space, its floor, compiled and over it), the floor's
monotonicity checked on the candidates most likely to break it, a line per
candidate on a log while it compiles, the compiles of one plan reused by
the next, and ``measure=`` choosing by measured step time.

One model throughout, the new user's of the issue (a `Stacked` LM of
156,928 parameters on 8 devices): the tests of this file run in one process
and share its compiled programs (`_engine/program/_executables.py`), so
each candidate is compiled once in the file."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from phalanx._engine.program import _executables
from phalanx._plan._choice import TIE, simplicity
from phalanx._plan._compiles import Compiles
from phalanx._plan._devices import device_spec
from phalanx._plan._entry import _spec
from phalanx._plan._floor import SLACK
from phalanx._plan._measure import Builder, bounds, measure
from phalanx._plan._space import Candidate, PlanSpace
from stacked_transformer import Transformer


def make() -> Transformer:
    return Transformer(vocab=448, width=64, layers=2, heads=2, key=jax.random.key(0))


def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)


BATCH = (
    jax.ShapeDtypeStruct((32, 64), jnp.int32),
    jax.ShapeDtypeStruct((32, 64), jnp.int32),
)
# The floor of the default space on 8 devices: the most microbatches (32
# examples over 8 devices: 4), remat on, every device splitting the state.
FLOOR = Candidate(1, 8, 1, 4, True)


def test_a_budget_nothing_meets_is_answered_in_two_compiles(capsys):
    """Over every state (none is pruned), under the floor's peak: the most
    promising candidate compiled, too big; then the floor, too big; every
    other candidate bounded by it, uncompiled. While it compiles, a line a
    candidate on the log (not a terminal: ``progress=True``)."""
    plan = px.plan(
        make, optax.adam(1e-3), BATCH, budget="2.5MiB", loss=loss, progress=True
    )
    assert plan.choice is None
    assert plan.compiled + plan.reused <= 2
    compiled = [r for r in plan.rows if r.measured is not None]
    assert FLOOR in [r.candidate for r in compiled]
    assert all(r.status == "too big" for r in compiled)
    bounded = [r for r in plan.rows if r.status == "bounded"]
    # 4 meshes x 2 remats: each pair's one row, but the first's, compiled.
    assert len(bounded) == 7
    floor = next(r for r in compiled if r.candidate == FLOOR)
    assert floor.measured is not None
    for row in bounded:
        assert "the least peak of the space" in row.why and FLOOR.describe() in row.why
        least = row.least_peak
        assert least is not None and least == int(floor.measured.peak * (1 - SLACK))
        assert least > plan.budget * (1 - plan.margin)
    assert "nothing fits: the smallest peak found is" in plan.nothing_fits()
    assert "≥ " in str(plan)  # the bounds in the peak and step columns
    said = [
        line
        for line in capsys.readouterr().err.splitlines()
        if "phalanx: plan:" in line
    ]
    assert said[0] == "phalanx: plan: 24 candidates on 8 devices"
    assert sum(": too big" in line for line in said) == len(compiled)
    assert sum(line.startswith("phalanx: plan: bounded: ") for line in said) == len(
        bounded
    )
    assert all("peak" in line for line in said if ": too big" in line)


def test_no_candidate_holds_much_less_than_its_floor():
    """The floor's monotonicity (`_floor.py`), where it is likeliest to
    fail: remat off, and the state split over data instead of fsdp, at the
    most microbatches (fewer hold more: the bisection's own assumption)."""
    trainer = px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False
    )
    builder = Builder(
        trainer._parts.programs.parts.step,
        trainer._parts.layout,
        traced_checks=True,
        spec=_spec(trainer._parts, BATCH)[0],
        size=32,
    )
    devices, space = jax.devices(), PlanSpace()
    device = device_spec(None, "cpu", np.dtype("float32"))
    compiles = Compiles()
    peaks = {}
    for candidate in [FLOOR, *(Candidate(d, f, 1, 4, r) for d, f, r in [
        (1, 8, False), (8, 1, True), (8, 1, False)
    ])]:  # fmt: skip
        strategy = candidate.strategy(space, devices)
        layout = builder.layout(strategy, candidate.remat)
        program, flops = builder.program(strategy, layout)
        bound = bounds(layout, flops, device)
        found = measure(
            program, candidate, bound, devices, device, compile=compiles.compile
        )
        peaks[candidate] = found.peak
    least = min(peaks.values())
    assert peaks[FLOOR] * (1 - SLACK) <= least, peaks


def test_a_second_plan_reuses_the_compiles_and_measure_times_steps(capsys):
    """Two plans of the same model, batch and space: the second compiles
    nothing. With ``measure=2`` both candidates that fit run for a few
    steps, and the choice is by their measured time (the simpler within
    TIE); the table says so. No progress lines off a terminal by default.
    A plan in a process that compiled none reads them from JAX's persistent
    compilation cache, and says how many it read."""
    space = PlanSpace(meshes=[(1, 8, 1)], microbatches=(4,), remat=(True, False))
    plans = [
        px.plan(
            make,
            optax.adam(1e-3),
            BATCH,
            budget="64MiB",
            space=space,
            loss=loss,
            measure=2,
        )  # fmt: skip
        for _ in range(2)
    ]
    first, second = plans
    # The second costs both from the first's compiles; it times the one
    # not chosen on an executable compiled again (a plan keeps only its
    # choice's: each holds its code in device memory on an accelerator).
    assert second.reused == 2 and second.compiled == 1
    assert first.compiled + first.reused >= 2
    assert "phalanx: plan:" not in capsys.readouterr().err
    for plan in plans:
        timed = [r for r in plan.rows if r.timed is not None]
        assert len(timed) == 2 and all(r.timed > 0 for r in timed)  # pyright: ignore[reportOptionalOperand]
        choice = plan.choice
        assert choice is not None and choice.timed is not None and plan.by_measurement
        fastest = min(r.timed for r in timed)  # pyright: ignore[reportArgumentType]
        tied = [r for r in timed if r.timed <= fastest * (1 + TIE)]  # pyright: ignore[reportOptionalOperand]
        assert simplicity(choice.candidate) == min(
            simplicity(r.candidate) for r in tied
        )
        said = str(plan)
        assert "measured" in said and "by measured step time" in said
        assert plan.timed_steps == 5
    # A new process's store (JAX's persistent cache kept, as the tests'
    # conftest sets it): compiled, each read from that cache, and said.
    _executables._STORE.clear()
    third = px.plan(
        make, optax.adam(1e-3), BATCH, budget="64MiB", space=space, loss=loss
    )
    assert third.reused == 0 and third.compiled == third.from_cache == 2
    assert "compiled 2 (2 from JAX's cache), reused 0" in str(third)
    with pytest.raises(ValueError, match="measure=-1 must be at least 0"):
        px.plan(make, optax.adam(1e-3), BATCH, budget="64MiB", loss=loss, measure=-1)
