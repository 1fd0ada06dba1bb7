"""`DataParallelTrainer.find_lr`: the learning-rate range test, which
leaves the trainer as it found it, to the bit."""

import jax
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import host_arrays, make_data, make_model


class Calls(px.Callback):
    def __init__(self):
        self.hooks: list[str] = []

    @override
    def on_fit_start(self, info):
        self.hooks.append("fit_start")

    @override
    def on_step_end(self, info):
        self.hooks.append("step_end")


@pytest.fixture(scope="module")
def digits():
    (x, y), _ = px.data.load_digits()
    return px.data.ArrayLoader((x, y), 128, seed=0)


def adam_trainer(callbacks=()) -> px.DataParallelTrainer:
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    model = px.models.MLP(64, 10, hidden=(64,), key=jax.random.key(0))
    return px.DataParallelTrainer(model, tx, callbacks=callbacks, progress=False)


def test_on_digits_with_adam_it_suggests_a_usual_rate_and_changes_nothing(
    digits, tmp_path
):
    calls = Calls()
    trainer = adam_trainer([calls])
    trainer.fit(digits, steps=3)  # a state of its own, and a history
    before, history = host_arrays(trainer.state), trainer.history.state_dict()
    calls.hooks.clear()
    found = trainer.find_lr(digits)
    assert 1e-4 <= found.suggestion <= 1e-1, found
    # The rates rise geometrically from 1e-7; the loss diverged before 10.
    assert found.lrs[0] == pytest.approx(1e-7)
    ratios = np.diff(np.log(found.lrs))
    np.testing.assert_allclose(ratios, ratios[0], rtol=1e-6)
    assert 20 < len(found.lrs) < 100 and found.lrs[-1] < 10
    assert found.smoothed[-1] > 4 * min(found.smoothed)
    assert len(found.losses) == len(found.smoothed) == len(found.lrs)
    # Put back to the bit: state, step, history; no callback was called.
    for a, b in zip(host_arrays(trainer.state), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(trainer.state.step) == 3
    assert trainer.history.state_dict() == history
    assert calls.hooks == []
    found.plot(tmp_path / "lr.png")
    assert (tmp_path / "lr.png").read_bytes()[:4] == b"\x89PNG"
    trainer.fit(digits, steps=1)  # and it trains on from there
    assert int(trainer.state.step) == 4


def test_the_rate_is_the_one_each_step_uses():
    # A step's loss is of the state before it: the third step's moves with
    # the second step's rate. Two sweeps from the same first rate agree up
    # to there, and part where the second rates differ.
    x, y = make_data(32)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    trainer = px.DataParallelTrainer(make_model(), tx, progress=False)
    low = trainer.find_lr([(x, y)], start=1e-6, end=1e-5, steps=3)
    high = trainer.find_lr([(x, y)], start=1e-6, end=1.0, steps=3)
    assert low.lrs[0] == high.lrs[0] and low.lrs[1] < high.lrs[1]
    assert low.losses[:2] == high.losses[:2]
    assert low.losses[2] != high.losses[2]
    assert low.suggestion is None  # too few points


def test_bad_arguments_and_optimizers_are_refused_before_a_step():
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-3), progress=False)
    with pytest.raises(TypeError, match=r"optax\.inject_hyperparams\(optax\.adam\)"):
        trainer.find_lr([(x, y)])
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    trainer = px.DataParallelTrainer(make_model(), tx, progress=False)
    with pytest.raises(ValueError, match=r"0 < start < end"):
        trainer.find_lr([(x, y)], start=1.0, end=0.1)
    with pytest.raises(ValueError, match=r"steps=1"):
        trainer.find_lr([(x, y)], steps=1)
    with pytest.raises(ValueError, match=r"data has no batch"):
        trainer.find_lr([])
    assert int(trainer.state.step) == 0
