"""A run as a value: `trainer.snapshot()` and `trainer.restore(snapshot)`
continue a run exactly, in memory, with no checkpoint in between."""

import dataclasses

import jax
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import make_data, make_model, max_abs_diff


def batches():
    x, y = make_data(64)
    return [(x[:32], y[:32]), (x[32:], y[32:])]


def trainer(seed: int = 0) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(seed), optax.adam(1e-2), strategy=px.PmapStrategy(4)
    )


def test_a_snapshot_continues_a_run_exactly():
    straight = trainer()
    straight.fit(batches(), epochs=3)
    first = trainer()
    first.fit(batches(), epochs=1)
    snapshot = first.snapshot()
    assert isinstance(snapshot, px.Snapshot)
    assert (snapshot.progress.step, snapshot.progress.epoch) == (2, 1)
    second = trainer(seed=1)  # other weights: all of them come from the snapshot
    second.restore(snapshot)
    assert second.progress.step == 2 and len(second.history) == 1
    # epochs count from the restored run's start, as with resume=.
    second.fit(batches(), epochs=3)
    assert max_abs_diff(second.model, straight.model) == 0
    assert second.history["loss"] == straight.history["loss"]
    # The snapshot stays valid while its trainer trains on (fit copies the
    # state before its steps donate it).
    first.fit(batches(), epochs=1)
    assert int(jax.device_get(snapshot.state.step)) == 2


def test_a_snapshot_of_another_model_is_refused():
    other = px.DataParallelTrainer(
        px.models.MLP(5, 3, hidden=(4,), key=jax.random.key(0)), optax.adam(1e-2)
    )
    mine = trainer()
    with pytest.raises(ValueError, match="this trainer's model and optimizer"):
        mine.restore(other.snapshot())
    assert mine.progress.step == 0


def test_a_snapshot_taken_at_a_preemption_resumes_without_stopping():
    first = trainer()
    first.fit(batches(), epochs=1)
    stopped = first.snapshot()
    stopped = dataclasses.replace(
        stopped, progress=dataclasses.replace(stopped.progress, preempted=15)
    )
    second = trainer()
    second.restore(stopped)
    second.fit(batches(), epochs=2)  # no Preempted: the signal was the old run's
    assert second.progress.step == 4 and second.progress.preempted is None


def test_a_snapshot_mid_epoch_continues_its_epoch():
    straight = trainer()
    straight.fit(batches(), epochs=2)
    taken = []

    class Take(px.Callback):
        @override
        def on_step_end(self, info):
            if info.step == 3:  # epoch 1, one of its two steps made
                taken.append(info.snapshot().copy())

    first = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(4), callbacks=[Take()]
    )
    first.fit(batches(), epochs=2)
    (snapshot,) = taken
    assert (snapshot.progress.epoch, snapshot.progress.epoch_steps) == (1, 1)
    second = trainer(seed=1)
    second.restore(snapshot)
    second.fit(batches(), epochs=2)  # the rest of epoch 1: its second batch
    assert second.progress.step == 4
    assert max_abs_diff(second.model, straight.model) == 0
    assert second.history["loss"] == straight.history["loss"]


def test_the_state_is_built_as_the_layout_builds_it():
    # `trainer.state` fills the arrays into the structure kept once (a key,
    # an average of the weights, a part-done epoch's state: all of a state).
    straight = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(4), ema=0.9
    )
    straight.fit(batches(), epochs=1)
    leaves = straight._parts.slot.run.leaves
    built, reference = straight.state, straight._parts.layout.unflatten(leaves)
    assert jax.tree.structure(built) == jax.tree.structure(reference)
    for new, old in zip(
        jax.tree.leaves(built), jax.tree.leaves(reference), strict=True
    ):
        assert new is old or (
            jax.dtypes.issubdtype(new.dtype, jax.dtypes.prng_key)
            and jax.random.key_data(new) is jax.random.key_data(old)
        )
    assert straight.snapshot().state.model.layers[0].weight is leaves[1]
