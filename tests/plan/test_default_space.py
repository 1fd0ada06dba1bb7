"""The planner's default space comes from what the trainer's strategy
declares (`Strategy.mesh_settings`), never from its class (issue 55, item
3): a `MeshStrategy`'s rules, min_size, context axis and sequence dims,
through an `AccumulatingStrategy` too; a strategy of the user's own that
declares settings gives them; one that declares none is planned as it is
(issue 57, item 4: tests/plan/test_plan_strategies.py).
Nothing is compiled."""

import pytest

import phalanx as px
import phalanx.strategies._registry as registry
from helpers import RowsStrategy
from phalanx._plan._entry import _space_of
from phalanx._plan._space import PlanSpace
from phalanx.strategies._strategy import MeshSettings


RULES = [(r"blocks\.layers\.up\.weight", (None, "tensor", "fsdp"))]


def mesh() -> px.MeshStrategy:
    return px.MeshStrategy(
        data=2,
        fsdp=2,
        context=2,
        sequence_dims={"x": 1},
        rules=RULES,
        min_size=64,
    )


def test_a_mesh_strategy_declares_its_settings():
    settings = mesh().mesh_settings()
    assert settings == MeshSettings(
        rules=tuple(RULES),
        min_size=64,
        context=2,
        sequence_dims={"x": 1},
        offload=False,
    )
    every = px.MeshStrategy(data=4, context=2, sequence_dims=1).mesh_settings()
    assert every is not None and every.sequence_dims == 1 and every.rules == ()
    plain = px.MeshStrategy().mesh_settings()
    assert plain is not None and plain.sequence_dims == {} and plain.context == 1


def test_the_default_space_has_the_declared_settings():
    expected = PlanSpace(rules=RULES, min_size=64, context=2, sequence_dims={"x": 1})
    assert _space_of(None, mesh()) == expected
    # The wrapper answers for the strategy it wraps.
    wrapped = px.AccumulatingStrategy(mesh(), microbatches=2)
    assert wrapped.mesh_settings() == mesh().mesh_settings()
    assert _space_of(None, wrapped) == expected


@pytest.mark.parametrize(
    "strategy",
    [
        px.ShardingStrategy(),
        px.PmapStrategy(),
        px.FullyShardedStrategy(min_size=8),
        px.AccumulatingStrategy(px.ShardingStrategy(), microbatches=2),
        RowsStrategy(),
    ],
    ids=lambda strategy: type(strategy).__name__,
)
def test_a_strategy_declaring_no_settings_is_planned_as_it_is(strategy):
    # Its microbatches and remat weighed (issue 57, item 4); a wrapper
    # planned as the strategy it wraps.
    assert strategy.mesh_settings() is None
    wrapper = isinstance(strategy, px.AccumulatingStrategy)
    inner = strategy.inner if wrapper else strategy
    assert _space_of(None, strategy) == PlanSpace(strategy=inner)


def test_a_users_strategy_gives_the_settings_it_declares():
    declared = MeshSettings(
        rules=(("head", (None, "tensor")),),
        min_size=16,
        context=1,
        sequence_dims={},
        offload=True,
    )
    rows = RowsStrategy(settings=declared)
    # Offload is the planner's own to weigh; the rest is the strategy's.
    expected = PlanSpace(
        rules=[("head", (None, "tensor"))], min_size=16, sequence_dims={}
    )
    assert _space_of(None, rows) == expected
    wrapped = px.AccumulatingStrategy(rows, microbatches=4)
    assert _space_of(None, wrapped) == expected
    # A space given is the space used, whatever the strategy declares.
    given = PlanSpace(microbatches=(1, 2))
    assert _space_of(given, wrapped) is given


def test_a_mesh_shows_the_offload_its_settings_declare():
    # The registry's mesh entry reads offload from the declaration (a CPU
    # offers no host memory apart from its own, so no MeshStrategy here
    # offloads).
    assert registry.lookup("mesh").details(mesh()) == "data=2, fsdp=2, context=2"
    offloading = MeshSettings((), 16, 1, {}, offload=True)
    assert registry.lookup("mesh").details(RowsStrategy(settings=offloading)) == (
        "rows=8, offload=True"
    )
    assert registry.lookup("mesh").details(RowsStrategy()) == "rows=8"
