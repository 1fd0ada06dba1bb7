"""The fit planner's search (issue 43, items 1-2): its choice is the best
of the space by the cost model, checked against an exhaustive grid, and
pruning never drops a candidate that fits; a real batch plans as its
shapes do; offloading the optimizer state fits what the devices alone do
not. The model, loss and batch are test_plan.py's."""

import jax
import numpy as np
import optax

import phalanx as px
from helpers import host_arrays
from phalanx._plan._choice import TIE
from phalanx._plan._measure import Builder, bounds, measure
from phalanx._plan._space import PlanSpace, microbatch_counts
from test_plan import BATCH, loss, make


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
    builder = Builder(
        trainer._parts.programs.parts.step,
        trainer._parts.layout,
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
    # The fastest of the grid, or one simpler within TIE of it (_choice).
    assert best[0] <= plan.choice.measured.seconds <= best[0] * (1 + TIE)
    assert "fits" in statuses.values() or "chosen" in str(plan)


def plan_spec(trainer: px.DataParallelTrainer):
    from phalanx._plan._entry import _spec

    return _spec(trainer._parts, BATCH)[0]


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
