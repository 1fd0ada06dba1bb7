"""The planner plans the trainer's own strategy (issue 57, item 4): a
`ShardingStrategy`, `FullyShardedStrategy` or `PmapStrategy` trainer (an
`AccumulatingStrategy` around one too) gets its microbatches and remat
weighed on the strategy's own devices and layout, its rows named by the
strategy, its choice that strategy (wrapped where it accumulates), and its
command the strategy's flags; `px.PlanSpace(strategy=...)` plans one as it
is; a space that mixes a strategy with mesh splits, or devices not the
strategy's, is one line."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import phalanx as px
from phalanx._plan._space import PlanSpace
from test_plan import BATCH, held_bytes, loss, make


LONG = (jax.ShapeDtypeStruct((32, 64), jnp.int32),) * 2


def trainer_of(strategy: px.Strategy) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False, strategy=strategy
    )


def test_a_fully_sharded_trainer_plans_its_microbatches_and_remat():
    fsdp = px.FullyShardedStrategy(jax.devices()[:4], min_size=64)
    trainer = trainer_of(fsdp)
    roomy = trainer.plan(BATCH, budget="64MiB")
    assert roomy.devices == 4  # the strategy's own devices
    assert {row.candidate.named for row in roomy.rows} == {"FullyShardedStrategy"}
    assert {row.candidate.remat for row in roomy.rows} == {False, True}
    assert roomy.choice is not None and roomy.choice.measured is not None
    assert roomy.strategy() is fsdp
    said = str(roomy)
    assert "strategy" in said and "FullyShardedStrategy" in said
    # Which peak the table gives (issue 57, item 1): XLA's plan of the step.
    assert "peak: the compiled step's as XLA plans it" in said
    # The chosen state bytes are what a trainer allocates under it.
    assert roomy.choice.bounds is not None
    allocated = held_bytes(trainer_of(roomy.strategy()))
    assert allocated == pytest.approx(roomy.choice.bounds.state, rel=0.02)

    # Longer sequences (activations 4.6 MiB a device, 0.9 with 8
    # microbatches) under 1 MiB: the fewest microbatches that fit, the
    # choice an AccumulatingStrategy around the trainer's own.
    space = PlanSpace(remat=(False,), microbatches=(1, 8))
    tight = trainer.plan(LONG, budget="1MiB", margin=0.0, space=space)
    chosen = tight.choice
    assert chosen is not None and chosen.candidate.microbatches == 8, str(tight)
    strategy = tight.strategy()
    assert isinstance(strategy, px.AccumulatingStrategy) and strategy.inner is fsdp
    assert strategy.microbatches == chosen.candidate.microbatches
    command = tight.command(["--model", "mlp", "--strategy", "mesh"])
    assert command == "phalanx train --model mlp --strategy fsdp --microbatches 8"
    over = [r for r in tight.rows if r.candidate.microbatches == 1]
    assert over and over[0].status == "too big"


def test_an_accumulating_trainer_is_planned_as_the_strategy_it_wraps():
    # Its microbatch count is the plan's to choose: one fits here.
    sharding = px.ShardingStrategy(jax.devices()[:2])
    trainer = trainer_of(px.AccumulatingStrategy(sharding, microbatches=4))
    plan = trainer.plan(BATCH, budget="64MiB", space=None)
    assert plan.space == PlanSpace(strategy=sharding)
    assert {row.candidate.named for row in plan.rows} == {"ShardingStrategy"}
    assert plan.strategy() is sharding
    assert plan.command() == "phalanx train --strategy sharding"
    # The replicated state: the whole of it on each device, so a budget
    # under it prunes every candidate uncompiled, and says so in one line.
    assert plan.choice is not None and plan.choice.bounds is not None
    state = plan.choice.bounds.state
    assert state == pytest.approx(held_bytes(trainer_of(sharding)), rel=0.02)
    nothing = trainer.plan(BATCH, budget=state // 2, margin=0.0)
    assert nothing.choice is None and nothing.compiled == 0
    assert {row.status for row in nothing.rows} == {"pruned"}
    with pytest.raises(ValueError, match="over the budget.*weigh the mesh splits"):
        nothing.strategy()


def test_a_space_plans_one_mesh_as_it_is():
    mesh = px.MeshStrategy(data=2, fsdp=4, min_size=64)
    plan = px.plan(
        make,
        optax.adam(1e-3),
        BATCH,
        budget="64MiB",
        space=PlanSpace(strategy=mesh, remat=(False,), microbatches=(1,)),
        loss=loss,
    )
    [row] = plan.rows
    assert row.candidate.named == "MeshStrategy(data=2, fsdp=4)"
    assert (row.candidate.data, row.candidate.fsdp) == (2, 4)
    assert plan.strategy() is mesh
    assert plan.command().endswith("--strategy mesh --mesh data=2,fsdp=4,context=1")


def test_px_plan_with_a_strategy_plans_it_and_without_one_the_meshes():
    # A space that sets no field of the mesh splits plans the strategy
    # given; without a strategy, px.plan weighs the splits of the devices.
    fsdp = px.FullyShardedStrategy(jax.devices()[:2], min_size=64)
    kwargs = {"budget": "64MiB", "loss": loss}
    space = PlanSpace(remat=(False,), microbatches=(1,))
    own = px.plan(make, optax.sgd(0.1), BATCH, space=space, strategy=fsdp, **kwargs)
    assert own.space.strategy is fsdp and own.strategy() is fsdp
    meshes = px.plan(make, optax.sgd(0.1), BATCH, space=space, devices=2, **kwargs)
    assert meshes.space.strategy is None
    assert {row.candidate.sizes for row in meshes.rows} == {"2·1·1·1", "1·2·1·1"}


def test_bad_spaces_and_devices_are_one_line():
    sharding = px.ShardingStrategy(jax.devices()[:4])
    with pytest.raises(ValueError, match=r"meshes=\[\(8, 1, 1\)\] sets a mesh split"):
        PlanSpace(strategy=sharding, meshes=[(8, 1, 1)])
    with pytest.raises(ValueError, match="offload=.* drop offload"):
        PlanSpace(strategy=sharding, offload=(True,))
    wrapped = px.AccumulatingStrategy(sharding, microbatches=2)
    with pytest.raises(TypeError, match=r"pass the strategy it wraps \(Sharding"):
        PlanSpace(strategy=wrapped)
    trainer = trainer_of(sharding)
    message = re.escape("devices=8: the strategy planned is built on its own 4")
    with pytest.raises(ValueError, match=message):
        trainer.plan(BATCH, budget="64MiB", devices=8)


def test_a_plan_compiles_the_fits_own_step_held_or_not(monkeypatch):
    """A plan compiles the call its fit makes first, the held guard's
    (a TPU's default for a big enough gradient: ``_held.py``) where the fit
    holds one: so its peak counts the spare state a fit keeps beside the
    state (measured on a v5e: the tests' transformer held the state and 230
    MB more while it trained), ``measure=`` times that step, and the fit's
    compile is the very program the plan compiled: it compiles nothing."""
    from phalanx._engine.step import _held

    texts: list[str] = []
    compile = jax.stages.Lowered.compile

    def recorded(lowered: jax.stages.Lowered, *args, **kwargs):
        texts.append(lowered.as_text())
        return compile(lowered, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recorded)
    trainer = trainer_of(px.ShardingStrategy(jax.devices()[:1]))
    space = PlanSpace(remat=(False,), microbatches=(1,))
    rows = {}
    for held in (False, True):
        monkeypatch.setattr(_held, "HOLD", held)
        texts.clear()
        plan = trainer.plan(BATCH, budget="1GiB", space=space, measure=1)
        [rows[held]] = plan.rows
        assert texts  # the candidate, and no other program
        texts.clear()
        fitted = px.DataParallelTrainer(
            make(), optax.adam(1e-3), loss=loss, progress=False,
            **plan.trainer_kwargs(),
        )  # fmt: skip
        tokens = jnp.zeros(BATCH[0].shape, BATCH[0].dtype)
        fitted.fit([(tokens, tokens)])
        assert not texts, held
    state = rows[True].bounds.state
    plain, spared = rows[False].measured, rows[True].measured
    assert spared.memory.arguments - plain.memory.arguments == state
    assert spared.peak - plain.peak >= state
    assert rows[True].timed is not None and rows[True].timed > 0
    # A budget the state fits in once but not twice: pruned, uncompiled.
    budget = int(1.5 * state)
    [row] = trainer.plan(BATCH, budget=budget, margin=0.0, space=space).rows
    assert row.status == "pruned" and "spare" in row.why, row
