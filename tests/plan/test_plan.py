"""The fit planner (issue 43, items 1-2) under budgets: candidates
compiled on abstract arguments and costed, the chosen layout's state
bytes are those a trainer allocates, and a budget below the choice's peak
picks another or says that nothing fits. The search against an exhaustive
grid, real batches and offloading: test_plan_search.py (a file of its own,
so that the two share out among the suite's workers)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from phalanx._engine.program._summary import format_bytes
from phalanx._plan._choice import TIE
from phalanx._plan._devices import BANDWIDTHS, device_spec
from phalanx._plan._space import PlanSpace
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


def held_bytes(trainer: px.DataParallelTrainer) -> int:
    """The state's bytes on the trainer's fullest device."""
    held: dict[object, int] = {}
    for leaf in jax.tree.leaves(eqx.filter(trainer.state, eqx.is_array)):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


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
    fastest = min(m.seconds for m in fitting)
    assert fastest <= choice.measured.seconds <= fastest * (1 + TIE)
    assert 0 < roomy.compiled + roomy.reused <= len(roomy.rows)
    said = str(roomy)
    assert "<- chosen" in said and "by predicted step time" in said
    cached = f" ({roomy.from_cache} from JAX's cache)" if roomy.from_cache else ""
    assert f"compiled {roomy.compiled}{cached}, reused {roomy.reused}, in " in said


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
    assert held_bytes(trainer) == pytest.approx(choice.bounds.state, rel=0.02)


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
    assert nothing.choice is None and nothing.compiled + nothing.reused >= 1
    statuses = {"pruned", "too big", "failed", "bounded"}
    assert {r.status for r in nothing.rows} <= statuses
    peak = nothing.smallest_peak
    assert peak is not None and peak.measured is not None
    line = nothing.nothing_fits()
    assert f"the smallest peak found is {format_bytes(peak.measured.peak)}" in line
    assert f"over the budget of {format_bytes(budget)}" in line and "\n" not in line
    with pytest.raises(ValueError, match="nothing fits"):
        nothing.strategy()
    # A budget under every state: all pruned, none compiled (one mesh shows
    # it: each candidate is traced before it is pruned).
    one_mesh = PlanSpace(meshes=MESHES[:1], microbatches=(1,), rules=RULES, min_size=64)
    none = px.plan(
        make, optax.adam(1e-3), BATCH, budget="1KiB", space=one_mesh, loss=loss
    )
    assert none.compiled == 0 and "the smallest state is" in none.nothing_fits()


def test_tensor_only_layouts_compile_with_microbatches_and_bf16():
    # (1, 1, 2): the batch on one device along data × fsdp, which XLA
    # refused to compile with a reduction (issue 54); every candidate now
    # compiles with accumulation and bf16 (it "failed").
    space = PlanSpace(
        meshes=[(1, 1, 2)], microbatches=(2,), remat=(False,), rules=RULES, min_size=64
    )
    tensor_only = px.plan(
        make, optax.adam(1e-3), BATCH, budget="64MiB", space=space, loss=loss,
        devices=2, precision="bf16",
    )  # fmt: skip
    (row,) = tensor_only.rows
    assert row is tensor_only.choice and row.candidate.microbatches == 2, row


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


def test_bad_inputs_are_refused_before_any_compile():
    # Issue 54, item 3: one line naming the argument, its value and the fix.
    trainer = px.DataParallelTrainer(
        make(), optax.adam(1e-3), loss=loss, progress=False
    )
    n = len(jax.devices())
    fix = f"pass a count from 1 to {n}, or a list of devices (e.g. jax.devices()[:4])"
    with pytest.raises(TypeError, match=re.escape(f"devices='8': {fix}")):
        trainer.plan(BATCH, budget="1GiB", devices="8")
    with pytest.raises(TypeError, match=re.escape("devices contains '8', which")):
        trainer.plan(BATCH, budget="1GiB", devices=["8"])
    with pytest.raises(ValueError, match=re.escape("devices=[] is empty; pass a")):
        trainer.plan(BATCH, budget="1GiB", devices=[])
    msg = (
        "margin='0.1' must be a number in [0, 1): the share of the budget kept "
        "free, e.g. 0.1"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        px.plan(make, optax.adam(1e-3), BATCH, budget="1GiB", margin="0.1")  # pyright: ignore[reportArgumentType]
    uneven = (
        jax.ShapeDtypeStruct((64, 8), jnp.int32),
        jax.ShapeDtypeStruct((32, 8), jnp.int32),
    )
    msg = (
        "data: batch leaves disagree on the leading (examples) axis: batch[0] "
        "has 64, batch[1] has 32; give every leaf the same number of examples, "
        "slicing them together (e.g. x[i:j], y[i:j], one row of each per example)"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        px.plan(make, optax.adam(1e-3), uneven, budget="1GiB", loss=loss)
    known = [entry[0] for entry in BANDWIDTHS]
    msg = (
        f"device='h1000' is not a device the cost model knows; pass one of "
        f"{known} or 'cpu', or a "
        "px.DeviceSpec(name, flops, memory_bandwidth, link_bandwidth)"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        trainer.plan(BATCH, budget="1GiB", device="h1000")
    with pytest.raises(TypeError, match=re.escape("device=100: pass a device")):
        trainer.plan(BATCH, budget="1GiB", device=100)
    msg = (
        "trainer='DataParallelTrainer' is not px.DataParallelTrainer or a "
        "subclass of it; pass the class itself, e.g. trainer=MyTrainer"
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        px.plan(make, optax.adam(1e-3), BATCH, trainer="DataParallelTrainer")  # pyright: ignore[reportArgumentType]
    # Meshes that cannot use the devices, named (not "the batch splits over
    # no candidate").
    for space, msg in [
        (
            PlanSpace(context=3, sequence_dims=1),
            "context=3 does not divide the 8 devices; pass a divisor of 8 (1: no "
            "sequence split), e.g. context=2",
        ),
        (
            PlanSpace(meshes=[(8, 1, 1), (3, 1, 1)]),
            "meshes[1]=(3, 1, 1): data × fsdp × tensor is 3, not the 8 devices; "
            "pass sizes whose product is 8, e.g. (8, 1, 1)",
        ),
        (
            PlanSpace(meshes=[(16, 1, 1)]),
            "meshes[0]=(16, 1, 1): data × fsdp × tensor is 16, not the 8 devices; "
            "pass sizes whose product is 8, e.g. (8, 1, 1)",
        ),
        (
            PlanSpace(meshes=[(8, 1, 1)], context=2, sequence_dims=1),
            "meshes[0]=(8, 1, 1): data × fsdp × tensor is 8, not the 4 devices "
            "that context=2 leaves; pass sizes whose product is 4, e.g. (4, 1, 1)",
        ),
    ]:
        with pytest.raises(ValueError) as refused:
            trainer.plan(BATCH, budget="1GiB", space=space)
        assert str(refused.value) == msg


def test_a_device_name_is_matched_as_whole_words():
    f32 = np.dtype("float32")
    assert device_spec("h100", "cpu", f32).name == "H100"
    assert device_spec("NVIDIA H100 80GB HBM3", "cpu", f32).name == "H100"
    assert device_spec("TPU v5e", "cpu", f32).name == "TPU V5E"
    with pytest.raises(ValueError, match=re.escape("device='h1000' is not")):
        device_spec("h1000", "cpu", f32)
    # The devices' own kind is still found inside a longer name.
    assert device_spec(None, "NVIDIA GH200 480GB", f32).name == "H200"


def test_space_microbatches_must_be_counts():
    fix = (
        "pass microbatch counts, ints >= 1, e.g. microbatches=(1, 2, 4), or "
        "None for 1, 2, 4, ... up to each device's share of the batch"
    )
    with pytest.raises(ValueError, match=re.escape(f"microbatches=[0]: {fix}")):
        PlanSpace(microbatches=[0])
    with pytest.raises(ValueError, match=re.escape(f"microbatches=(): {fix}")):
        PlanSpace(microbatches=())
    # microbatches=4 (no sequence) is a TypeError too: the tests' runtime
    # type checker raises it before __post_init__ can.
