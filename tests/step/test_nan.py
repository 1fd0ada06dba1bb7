"""Non-finite gradients: nan_policy 'raise' (state from before the bad step),
'skip' (update dropped and counted), 'off'."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import make_data, make_model, max_abs_diff, params_of, sqrt_loss
from phalanx._engine.step import _held


@pytest.fixture(params=["gated", "held"])
def guard(request, monkeypatch):
    """Each ``"raise"`` test under the gated guard (the update decided in its
    step: CPUs) and the held one (decided by the next step: TPUs)."""
    monkeypatch.setattr(_held, "HOLD", request.param == "held")
    return request.param


def batches():
    x, y = make_data(16 * 6)
    y = np.abs(y).astype(np.int32)
    good = [(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]) for i in range(6)]
    bad = (good[3][0], np.full(16, -1, np.int32))
    return good, bad


def trainer(policy, sync_every=16):
    return px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        loss=sqrt_loss,
        strategy=px.PmapStrategy(8),
        nan_policy=policy,
        sync_every=sync_every,
    )


@pytest.mark.parametrize("sync_every", [1, 4, 16])
def test_raise_names_leaf_and_step_and_keeps_state(sync_every, guard):
    good, bad = batches()
    clean = trainer("raise")
    clean.fit(good[:3], epochs=1)
    run = trainer("raise", sync_every)
    with pytest.raises(FloatingPointError) as info:
        run.fit([*good[:3], bad, *good[3:]], epochs=1)
    message = str(info.value)
    assert "model.layers[" in message and "at step 3" in message
    assert "nan_policy='skip'" in message
    # The steps after the bad one were frozen: the state is from before it.
    assert max_abs_diff(run.model, clean.model) == 0
    assert int(run.state.step) == 3


def test_infinite_gradient_is_caught_and_named(guard):
    # +inf (not NaN) in one leaf only, at step 2: caught, and that leaf named.
    class Inf(px.DataParallelTrainer):
        def gradients(self, grads, state):
            bump = jnp.where(state.step == 2, jnp.inf, 0.0)
            return eqx.tree_at(
                lambda g: g.layers[1].bias, grads, grads.layers[1].bias + bump
            )

    good, _ = batches()
    run = Inf(make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8))
    with pytest.raises(FloatingPointError, match=r"model\.layers\[1\]\.bias.*step 2"):
        run.fit(good, epochs=1)
    assert int(run.state.step) == 2


@pytest.mark.parametrize("strategy", [px.ShardingStrategy, px.FullyShardedStrategy])
def test_held_guard_trains_as_the_gated_one(strategy, monkeypatch):
    # The same updates, bitwise, with or without the spare (laid out as the
    # state: every call is the compiled held step's, which keeps a spare);
    # the held step is the one a TPU's fit runs (one step a call, "raise",
    # no dynamic scale), and only there.
    good, _ = batches()
    runs, spares, slots = {}, [], []

    class Spare(px.Callback):
        def on_step_end(self, info):
            spares.append(slots[-1].run.spare is not None)

    for held in (False, True):
        monkeypatch.setattr(_held, "HOLD", held)
        run = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), strategy=strategy(8), callbacks=[Spare()]
        )
        slots.append(run._parts.slot)
        run.fit(good, epochs=2)
        assert run.summary(good[0]) is not None
        runs[held] = run
    assert spares == [False] * 12 + [True] * 12
    assert max_abs_diff(runs[True].model, runs[False].model) == 0
    losses = {held: [e["loss"] for e in run.history] for held, run in runs.items()}
    assert losses[True] == losses[False]
    monkeypatch.setattr(_held, "HOLD", True)
    settings = {"nan_policy": "skip"}, {"steps_per_call": 2}
    for held, kwargs in [(True, {}), *((False, s) for s in settings)]:
        run = px.DataParallelTrainer(make_model(), optax.adam(1e-2), **kwargs)
        run.fit(good[:2], epochs=1)
        program = run._parts.programs.first
        assert program is not None and program.held is held


@pytest.mark.parametrize("where", ["last step", "snapshot"])
def test_held_guard_bad_last_step(where, monkeypatch):
    # The bad step is the last of a fit (no frozen step after it: the run's
    # spare is the state), or a snapshot is taken right after it: either way
    # the state from before it.
    monkeypatch.setattr(_held, "HOLD", True)
    good, bad = batches()
    clean = trainer("raise")
    clean.fit(good[:3], epochs=1)
    snapshots = []

    class Snap(px.Callback):
        def on_step_end(self, info):
            if info.step == 4:
                snapshots.append(info.snapshot().copy())

    run = trainer("raise")
    run.callbacks = [Snap()]
    data = [*good[:3], bad] if where == "last step" else [*good[:3], bad, good[3]]
    with pytest.raises(FloatingPointError, match="at step 3"):
        run.fit(data, epochs=1)
    assert max_abs_diff(run.model, clean.model) == 0
    assert int(run.state.step) == 3
    if where == "snapshot":
        (snapshot,) = snapshots
        assert max_abs_diff(snapshot.state.model, clean.model) == 0


def test_skip_drops_the_update_and_counts_it():
    good, bad = batches()
    clean = trainer("skip")
    clean.fit(good, epochs=1)
    run = trainer("skip")
    run.fit([*good[:3], bad, *good[3:]], epochs=1)
    assert run.history[0]["skipped_steps"] == 1
    assert clean.history[0]["skipped_steps"] == 0
    assert max_abs_diff(run.model, clean.model) == 0
    # The epoch's loss counts only the updates that were applied.
    assert run.history[0]["loss"] == pytest.approx(clean.history[0]["loss"])


def test_off_applies_the_update():
    good, bad = batches()
    run = trainer("off")
    run.fit([good[0], bad], epochs=1)
    assert any(np.isnan(np.asarray(p)).any() for p in params_of(run.model))


def test_skip_reports_per_step_flag():
    good, bad = batches()
    flags = []

    class Record(px.Callback):
        def on_step_end(self, info):
            flags.append(info.metrics["skipped"])

    run = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        loss=sqrt_loss,
        nan_policy="skip",
        callbacks=[Record()],
    )
    run.fit([good[0], bad, good[1]], epochs=1)
    assert flags == [0.0, 1.0, 0.0]
    assert jax.tree.structure(run.state) == jax.tree.structure(trainer("skip").state)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_huge_finite_gradient_whose_sum_overflows_is_applied(policy):
    # Every entry is finite, but their sum overflows float32: the quick check
    # (one sum) is inconclusive there, and the exact one must let it through.
    class Huge(px.DataParallelTrainer):
        def gradients(self, grads, state):
            huge = jnp.full_like(grads.layers[0].weight, 1e38)
            return eqx.tree_at(lambda g: g.layers[0].weight, grads, huge)

    good, _ = batches()
    model = make_model()
    run = Huge(
        model, optax.sgd(1e-40), strategy=px.ShardingStrategy(2), nan_policy=policy
    )
    run.fit(good[:2], epochs=1)
    assert int(run.state.step) == 2
    if policy == "skip":
        assert run.history[0]["skipped_steps"] == 0
    # Each step moved every entry by 1e-40 * 1e38.
    moved = np.asarray(model.layers[0].weight) - np.asarray(run.model.layers[0].weight)
    np.testing.assert_allclose(moved, 0.02, rtol=1e-4)


def test_held_guard_where_the_gradient_is_big_on_a_tpu(monkeypatch):
    # "auto": a TPU's gradient of 16 MiB or more (writing it out and reading
    # it back would cost more than the held step's second state); not the
    # tiny MLPs whose steps are the host's, and never a CPU's.
    def holds(hidden, backend):
        monkeypatch.setattr(_held.jax, "default_backend", lambda: backend)
        model = px.models.MLP(16, 4, hidden=hidden, key=jax.random.key(0))
        run = px.DataParallelTrainer(model, optax.adam(1e-3), progress=False)
        parts = run._parts.programs.parts
        return _held.holds(parts.step, parts.layout, 1)

    assert holds((2048, 2048), "tpu")
    assert not holds((16,), "tpu")
    assert not holds((2048, 2048), "cpu")
