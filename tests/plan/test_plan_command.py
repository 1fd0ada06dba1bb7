"""The ``phalanx train`` command of a plan's choice (`_command.py`), for
each kind of layout, and the layouts it cannot say, each one line naming
the Python API instead. Nothing is compiled."""

import jax
import pytest

import phalanx as px
from helpers import RowsStrategy
from phalanx._plan._command import train_command
from phalanx._plan._space import Candidate, PlanSpace


FLAGS = ["--model", "mlp", "--strategy", "pmap", "--microbatches=2", "--seed", "1"]


def test_a_mesh_split_is_strategy_mesh_and_its_sizes():
    split = Candidate(2, 4, 1, 2, False)
    assert train_command(PlanSpace(), split, FLAGS) == (
        "phalanx train --model mlp --seed 1 --strategy mesh --mesh data=2,fsdp=4 "
        "--microbatches 2"
    )
    context = Candidate(2, 1, 1, 1, None, context=4)
    space = PlanSpace(context=4, sequence_dims=1)
    assert train_command(space, context, []).endswith("--mesh data=2,fsdp=1,context=4")


def test_a_strategy_planned_as_it_is_is_its_registry_name():
    zero2 = px.FullyShardedStrategy(jax.devices()[:2], shard="optimizer")
    space = PlanSpace(strategy=zero2)
    chosen = Candidate(1, 2, 1, 4, True, named="FullyShardedStrategy")
    assert train_command(space, chosen, []) == (
        "phalanx train --strategy fsdp --shard optimizer --microbatches 4"
    )
    pmap = PlanSpace(strategy=px.PmapStrategy())
    assert train_command(pmap, Candidate(8, 1, 1, 1, None), FLAGS) == (
        "phalanx train --model mlp --seed 1 --strategy pmap"
    )


@pytest.mark.parametrize(
    ("space", "chosen", "said"),
    [
        (PlanSpace(), Candidate(2, 1, 4, 1, None), "splits over tensor"),
        (
            PlanSpace(context=2, sequence_dims={"x": 1}),
            Candidate(4, 1, 1, 1, None, context=2),
            "splits sequences by sequence_dims",
        ),
        (
            PlanSpace(),
            Candidate(8, 1, 1, 1, jax.checkpoint_policies.dots_saveable),
            "remat=.*, a policy no flag",
        ),
        (
            PlanSpace(strategy=RowsStrategy()),
            Candidate(8, 1, 1, 1, None, named="RowsStrategy"),
            "RowsStrategy is not a registered strategy",
        ),
        (
            PlanSpace(strategy=px.MeshStrategy(data=2, tensor=4)),
            Candidate(2, 1, 4, 1, None, named="MeshStrategy(data=2, tensor=4)"),
            "a tensor axis",
        ),
    ],
    ids=["tensor", "sequence-dims", "policy", "unregistered", "own-mesh-tensor"],
)
def test_what_the_command_line_cannot_say_is_one_line(space, chosen, said):
    with pytest.raises(ValueError, match=said) as raised:
        train_command(space, chosen, [])
    assert "\n" not in str(raised.value)
    assert str(raised.value).endswith("plan.trainer_kwargs()")
