"""`DataParallelTrainer.find_lr`: the learning-rate range test, on a plain
optimizer, an injected rate and a schedule alike (the rates it tries are
absolute, set through the run's rate multiplier), which leaves the trainer
as it found it, to the bit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import host_arrays, make_data, make_model
from phalanx._engine.run._lr_finder import LRFinderResult


class Calls(px.Callback):
    def __init__(self):
        self.hooks: list[str] = []

    @override
    def on_fit_start(self, info):
        self.hooks.append("fit_start")

    @override
    def on_step_end(self, info):
        self.hooks.append("step_end")


@pytest.fixture
def digits():
    # A fresh loader for each test: where a sweep ends depends on its batches.
    (x, y), _ = px.data.load_digits()
    return px.data.ArrayLoader((x, y), 128, seed=0)


# A warmup from 0 over 10 steps, then a cosine decay over 1000.
WARMUP_COSINE = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 1000)
# Each with the steps trained before the sweep: the schedule's none, so that
# its sweep begins where the warmup's rate is 0 (the first update is taken,
# not swept). (Where a sweep starts moves its suggestion: for adam(1e-3)
# from 0.038 after 0 steps to 0.079 after 5; after 3 steps of adam(1e-5),
# 0.11.)
PRE_STEPS = {"plain": 3, "injected": 3, "schedule": 0}
ADAMS = {
    "plain": lambda: optax.adam(1e-3),
    "injected": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    "schedule": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=WARMUP_COSINE
    ),
}


@pytest.mark.parametrize("kind", ADAMS)
def test_on_digits_with_adam_it_suggests_a_usual_rate_and_changes_nothing(
    digits, tmp_path, kind
):
    calls = Calls()
    model = px.models.MLP(64, 10, hidden=(64,), key=jax.random.key(0))
    trainer = px.DataParallelTrainer(
        model, ADAMS[kind](), callbacks=[calls], progress=False
    )
    if PRE_STEPS[kind]:
        trainer.fit(digits, steps=PRE_STEPS[kind])  # a state of its own, a history
    before, history = host_arrays(trainer.state), trainer.history.state_dict()
    calls.hooks.clear()
    found = trainer.find_lr(digits)
    assert found.suggestion is not None and 1e-4 <= found.suggestion <= 1e-1, found
    # The rates rise geometrically from 1e-7; the loss diverged before 10.
    assert found.lrs[0] == pytest.approx(1e-7)
    ratios = np.diff(np.log(found.lrs))
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-6)
    assert 20 < len(found.lrs) < 100 and found.lrs[-1] < 10
    assert found.smoothed[-1] > 4 * min(found.smoothed)
    assert len(found.losses) == len(found.smoothed) == len(found.lrs)
    # Put back to the bit: state (its multiplier too), step, history; no
    # callback was called.
    for a, b in zip(host_arrays(trainer.state), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(trainer.state.lr_scale) == 1.0
    assert int(trainer.state.step) == PRE_STEPS[kind]
    assert trainer.history.state_dict() == history
    assert calls.hooks == []
    if kind == "plain":
        found.plot(tmp_path / "lr.png")
        assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"
    trainer.fit(digits, steps=1)  # and it trains on from there
    assert int(trainer.state.step) == PRE_STEPS[kind] + 1


SGDS = {
    "plain": lambda: optax.sgd(0.1),
    "injected": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.3),
    "schedule": lambda: optax.inject_hyperparams(optax.sgd)(
        learning_rate=optax.linear_schedule(0.5, 0.05, 4)
    ),
    "clipped": lambda: optax.chain(optax.clip_by_global_norm(1e6), optax.sgd(2.0)),
}


def test_the_rates_are_absolute_whatever_the_optimizer_own():
    # SGD moves by -rate x gradient: from the same state, sweeps of the same
    # rates take the same steps whatever rate (or schedule) the optimizer
    # was built with, to float32's rounding of the multiplier.
    # The trainer's own multiplier (a plateau's 0.25 here) changes nothing
    # either, and is put back.
    x, y = make_data(32)
    runs = {}
    for kind, make in SGDS.items():
        trainer = px.DataParallelTrainer(make_model(), make(), progress=False)
        if kind == "injected":
            quarter = jnp.asarray(0.25, jnp.float32)
            trainer.state = dataclasses.replace(trainer.state, lr_scale=quarter)
        runs[kind] = trainer.find_lr([(x, y)], start=1e-3, end=1.0, steps=6).losses
        assert float(trainer.state.lr_scale) == (0.25 if kind == "injected" else 1)
    for kind, losses in runs.items():
        np.testing.assert_allclose(losses, runs["plain"], rtol=1e-5, err_msg=kind)


def test_the_rate_is_the_one_each_step_uses():
    # A step's loss is of the state before it: the third step's moves with
    # the second step's rate. Two sweeps from the same first rate agree up
    # to there, and part where the second rates differ.
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(make_model(), optax.sgd(0.1), progress=False)
    low = trainer.find_lr([(x, y)], start=1e-6, end=1e-5, steps=3)
    high = trainer.find_lr([(x, y)], start=1e-6, end=1.0, steps=3)
    assert low.lrs[0] == high.lrs[0] and low.lrs[1] < high.lrs[1]
    assert low.losses[:2] == high.losses[:2]
    assert low.losses[2] != high.losses[2]
    assert low.suggestion is None  # too few points


def test_a_step_whose_own_rate_is_0_is_taken_and_not_swept():
    # A warmup from 0: the first update's rate is 0 whatever the multiplier.
    # That step is taken as training takes it (adam's moments move) and is
    # no point of the sweep; the sweep's rates follow from the next step on.
    x, y = make_data(32)
    warmup = optax.linear_schedule(0.0, 1e-2, 5)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=warmup)
    trainer = px.DataParallelTrainer(make_model(), tx, progress=False)
    found = trainer.find_lr([(x, y)], start=1e-4, end=1e-2, steps=4)
    assert found.lrs == pytest.approx(np.geomspace(1e-4, 1e-2, 4))
    assert all(np.isfinite(found.losses))
    # Rate 0 for good: nothing to sweep, said in one line before a rate.
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=lambda count: 0.0 * count)
    trainer = px.DataParallelTrainer(make_model(), tx, progress=False)
    with pytest.raises(ValueError, match=r"learning rate is 0 for 4 steps in a row"):
        trainer.find_lr([(x, y)], steps=4)
    assert int(trainer.state.step) == 0


def test_bad_arguments_and_unreadable_rates_are_refused_before_a_step():
    x, y = make_data(32)
    # A transform after the rate: the update is not proportional to it.
    tx = optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0))
    trainer = px.DataParallelTrainer(make_model(), tx, progress=False)
    with pytest.raises(
        TypeError,
        match=r"phalanx cannot read the optimizer's learning rate: its update ends "
        r"with clip_by_global_norm, not with its learning rate",
    ):
        trainer.find_lr([(x, y)])
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-3), progress=False)
    with pytest.raises(ValueError, match=r"0 < start < end"):
        trainer.find_lr([(x, y)], start=1.0, end=0.1)
    with pytest.raises(ValueError, match=r"steps=1"):
        trainer.find_lr([(x, y)], steps=1)
    with pytest.raises(ValueError, match=r"data has no batch"):
        trainer.find_lr([])
    assert int(trainer.state.step) == 0


def test_plot_makes_the_folders_of_its_path(tmp_path):
    # Issue 54, item 3: a missing folder was a FileNotFoundError.
    rates = tuple(10.0 ** (k / 4) for k in range(-28, 0))
    losses = tuple(1.0 / (k + 1) for k in range(len(rates)))
    found = LRFinderResult(rates, losses, losses, suggestion=rates[5])
    path = tmp_path / "runs" / "lr" / "lr.png"
    found.plot(path)
    assert path.read_bytes()[:4] == b"\x89PNG"
