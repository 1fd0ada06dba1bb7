"""The fit planner (issue 43, items 1-2): candidates compiled on abstract
arguments and costed; the choice is the best of the space by the cost
model (checked against an exhaustive grid), pruning never drops a
candidate that fits, the chosen layout's state bytes are those a trainer
allocates, and a budget below the choice's peak picks another or says
that nothing fits."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import host_arrays
from phalanx._engine._summary import format_bytes
from phalanx._plan._measure import Builder, bounds, measure
from phalanx._plan._space import PlanSpace, microbatch_counts
from stacked_transformer import RULES, Transformer


def make() -> Transformer:
    return Transformer(vocab=32, width=32, layers=2, heads=2, key=jax.random.key(0))


def loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)


BATCH = (
    jax.ShapeDtypeStruct((16, 8), jnp.int32),
    jax.ShapeDtypeStruct((16, 8), jnp.int32),
)
# Five of the ten splits of 8 devices (data, fsdp, tensor), one or two
# microbatches: the tests' compiles stay few.
MESHES = [(8, 1, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
SPACE = PlanSpace(meshes=MESHES, microbatches=(1, 2), rules=RULES, min_size=64)


@pytest.fixture(scope="module")
def roomy() -> px.Plan:
    return px.plan(
        make, optax.adam(1e-3), BATCH, budget="64MiB", space=SPACE, loss=loss
    )


def test_a_roomy_budget_chooses_a_layout_that_fits(roomy: px.Plan):
    choice = roomy.choice
    assert choice is not None and choice.measured is not None
    assert choice.measured.peak <= roomy.budget * (1 - roomy.margin)
    fitting = [r.measured for r in roomy.rows if r.status == "fits" and r.measured]
    assert min(m.seconds for m in fitting) == choice.measured.seconds
    assert 0 < roomy.compiled <= len(roomy.rows)
    assert "<- chosen" in str(roomy) and "compiled in" in str(roomy)


def test_the_chosen_state_bytes_are_those_a_trainer_allocates(roomy: px.Plan):
    choice = roomy.choice
    assert choice is not None and choice.bounds is not None
    trainer = px.DataParallelTrainer(
        roomy.model(make()),
        optax.adam(1e-3),
        loss=loss,
        progress=False,
        **roomy.trainer_kwargs(),
    )
    held: dict[object, int] = {}
    for leaf in jax.tree.leaves(eqx.filter(trainer.state, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    assert max(held.values()) == pytest.approx(choice.bounds.state, rel=0.02)


def test_a_budget_below_the_choice_picks_another_or_nothing(roomy: px.Plan):
    assert roomy.choice is not None and roomy.choice.measured is not None
    peak = roomy.choice.measured.peak
    budget = int(peak * 0.8 / (1 - roomy.margin))
    tighter = px.plan(
        make, optax.adam(1e-3), BATCH, budget=budget, space=SPACE, loss=loss
    )
    if tighter.choice is not None:
        assert tighter.choice.candidate != roomy.choice.candidate
        assert tighter.choice.measured is not None
        assert tighter.choice.measured.peak <= budget * (1 - roomy.margin)
    else:
        assert "the smallest peak found is" in tighter.nothing_fits()


def test_nothing_fitting_names_the_smallest_peak_found(roomy: px.Plan):
    """A budget just above the smallest state: that candidate is compiled
    (and too big), every other is pruned; the line names its peak."""
    smallest = min(r.bounds.state for r in roomy.rows if r.bounds is not None)
    budget = int(smallest * 1.01 / (1 - roomy.margin))
    nothing = px.plan(
        make, optax.adam(1e-3), BATCH, budget=budget, space=SPACE, loss=loss
    )
    assert nothing.choice is None and nothing.compiled >= 1
    assert {r.status for r in nothing.rows} <= {"pruned", "too big", "failed"}
    peak = nothing.smallest_peak
    assert peak is not None and peak.measured is not None
    line = nothing.nothing_fits()
    assert f"the smallest peak found is {format_bytes(peak.measured.peak)}" in line
    assert f"over the budget of {format_bytes(budget)}" in line and "\n" not in line
    with pytest.raises(ValueError, match="nothing fits"):
        nothing.strategy()
    none = px.plan(make, optax.adam(1e-3), BATCH, budget="1KiB", space=SPACE, loss=loss)
    assert none.compiled == 0 and "the smallest state is" in none.nothing_fits()


def test_the_choice_is_the_best_of_an_exhaustive_grid():
    """Every (mesh, remat, microbatches) of the space compiled; per (mesh,
    remat) its fewest microbatches that fit; the best of those by the cost
    model is the plan's choice, and no pruned pair had one that fits."""
    budget = 6 * 2**20
    trainer = px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False
    )
    space = PlanSpace(meshes=[(8, 1, 1), (1, 8, 1)], offload=(False, True), min_size=64)
    plan = trainer.plan(BATCH, budget=budget, space=space, margin=0.0)
    compiler = trainer._parts.preparer.compiler
    builder = Builder(
        compiler.parts,
        trainer._parts.layout,
        model_state=None,
        traced_checks=True,
        spec=plan_spec(trainer),
        size=16,
    )
    devices = jax.devices()
    device = plan.device
    best = None
    fits_by_pair = {}
    for row in plan.rows:
        c = row.candidate
        pair = (c.data, c.fsdp, c.tensor, c.remat, c.offload)
        if pair in fits_by_pair:
            continue
        strategy = c._replace(microbatches=1).strategy(space, devices)
        layout = builder.layout(strategy, c.remat)
        found = None
        for k in microbatch_counts(16 // (c.data * c.fsdp), space):
            candidate = c._replace(microbatches=k)
            program, flops = builder.program(candidate.strategy(space, devices), layout)
            bound = bounds(layout, flops, device)
            measured = measure(program, candidate, bound, devices, device)
            assert bound.seconds <= measured.seconds
            if measured.peak <= budget:
                found = (measured.seconds, k)
                break
        fits_by_pair[pair] = found
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    statuses = {
        (r.candidate.data, r.candidate.fsdp, r.candidate.remat): r.status
        for r in plan.rows
    }
    for row in plan.rows:
        c = row.candidate
        if row.status == "pruned":
            assert fits_by_pair[(c.data, c.fsdp, c.tensor, c.remat, c.offload)] is None
    assert (
        plan.choice is not None
        and plan.choice.measured is not None
        and best is not None
    )
    assert plan.choice.measured.seconds == pytest.approx(best[0])
    assert "fits" in statuses.values() or "chosen" in str(plan)


def plan_spec(trainer: px.DataParallelTrainer):
    from phalanx._plan._entry import _spec

    return _spec(trainer._parts, BATCH)[0]


def test_bad_options_say_what_to_pass():
    trainer = px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False
    )
    with pytest.raises(ValueError, match="budget=None.*report no memory limit"):
        trainer.plan(BATCH)
    with pytest.raises(ValueError, match="budget='lots' is not a positive size"):
        trainer.plan(BATCH, budget="lots")
    with pytest.raises(ValueError, match="margin=1.5"):
        trainer.plan(BATCH, budget="1GiB", margin=1.5)
    with pytest.raises(ValueError, match="device='abacus'"):
        trainer.plan(BATCH, budget="1GiB", device="abacus")


def test_a_real_batch_plans_like_its_shapes():
    x = np.zeros((16, 8), np.int32)
    trainer = px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False
    )
    space = PlanSpace(meshes=[(8, 1, 1), (1, 8, 1)], microbatches=(1,), min_size=64)
    real = trainer.plan((x, x), budget="64MiB", space=space)
    shapes = trainer.plan(BATCH, budget="64MiB", space=space)
    assert [r.measured.peak for r in real.rows if r.measured] == [
        r.measured.peak for r in shapes.rows if r.measured
    ]


def test_offloading_the_optimizer_state_fits_what_the_devices_alone_do_not():
    """The optimizer state in host memory: a budget under the state kept
    on the devices, over the parameters alone, chooses offload; its step
    trains as the one without offload does, to the bit."""
    space = PlanSpace(
        meshes=[(1, 8, 1)], microbatches=(1,), offload=(False, True), min_size=64
    )
    roomy = px.plan(
        make, optax.adam(1e-3), BATCH, budget="64MiB", space=space, loss=loss
    )
    on_devices = next(r for r in roomy.rows if not r.candidate.offload)
    offloaded = next(r for r in roomy.rows if r.candidate.offload and r.bounds)
    assert on_devices.bounds is not None and offloaded.bounds is not None
    assert offloaded.bounds.state < on_devices.bounds.state
    assert offloaded.bounds.host > 0
    budget = int((offloaded.bounds.state + on_devices.bounds.state) / 2 / 0.9)
    plan = px.plan(make, optax.adam(1e-3), BATCH, budget=budget, space=space, loss=loss)
    if plan.choice is not None:
        assert plan.choice.candidate.offload
        chosen = plan.strategy()
        assert isinstance(chosen, px.MeshStrategy) and chosen.offload
    tokens = np.random.default_rng(0).integers(0, 32, (16, 8)).astype(np.int32)
    states = []
    for offload in (False, True):
        strategy = px.MeshStrategy(fsdp=8, min_size=64, offload=offload)
        trainer = px.DataParallelTrainer(
            make(), optax.adam(1e-3), strategy=strategy, loss=loss, progress=False
        )
        trainer.fit([(tokens, tokens)] * 2)
        states.append(host_arrays(trainer.state))
        if offload:
            kinds = {
                x.sharding.memory_kind for x in jax.tree.leaves(trainer.state.opt_state)
            }
            assert kinds == {"pinned_host"}
            assert "in host memory" in trainer.summary().short()
    assert all(np.array_equal(a, b) for a, b in zip(*states, strict=True))
