"""``DataParallelTrainer(ema=decay)``: a moving average of the parameters,
updated in the step under every strategy and ``steps_per_call``, used by
evaluations and `predict`, saved and resumed bitwise."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import StopAt, make_data, make_model, make_strategy


DECAY = 0.8
X, Y = make_data(76, seed=2)  # batches of 16: a ragged last batch of 12
BATCHES = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 76, 16)]
STEPS = 20


def params(model) -> list[np.ndarray]:
    return [
        np.asarray(p) for p in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    ]


@pytest.fixture(scope="module")
def by_hand() -> list[np.ndarray]:
    """The average of each step's parameters, from a run without one."""
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.ShardingStrategy(1), progress=False
    )
    average = params(trainer.model)

    class Average(px.Callback):
        def on_step_end(self, info):
            nonlocal average
            now = params(info.trainer.model)
            average = [
                DECAY * a + (1 - DECAY) * p for a, p in zip(average, now, strict=True)
            ]

    trainer.callbacks = [Average()]
    trainer.fit(BATCHES, steps=STEPS)
    return average


@pytest.mark.parametrize(
    ("kind", "steps_per_call"),
    [
        ("sharding", 1),
        ("pmap", 1),
        ("fsdp", 1),
        ("sharding+acc2", 1),
        ("mesh", 1),
        ("sharding", 4),
        ("fsdp", 4),
    ],
)
def test_the_average_is_the_hand_computed_one(by_hand, kind, steps_per_call):
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=make_strategy(kind, 8),
        steps_per_call=steps_per_call,
        ema=DECAY,
        progress=False,
    )
    trainer.fit(BATCHES, steps=STEPS)
    for got, want in zip(params(trainer.ema_model), by_hand, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # Laid out as the parameters are.
    model_leaves = jax.tree.leaves(
        eqx.filter(trainer.state.model, eqx.is_inexact_array)
    )
    for average, param in zip(
        jax.tree.leaves(trainer.state.ema), model_leaves, strict=True
    ):
        assert average.sharding == param.sharding


def test_evaluations_and_predict_use_the_average(tmp_path, capsys):
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), ema=DECAY)
    trainer.fit(BATCHES, epochs=2, eval_data=BATCHES)
    assert "ema=0.8: evaluations use the moving average" in capsys.readouterr().out
    averaged = px.DataParallelTrainer(trainer.ema_model, optax.sgd(0.0), progress=False)
    assert trainer.evaluate(BATCHES) == averaged.evaluate(BATCHES)
    assert trainer.history[-1]["eval_loss"] == averaged.evaluate(BATCHES)["loss"]
    np.testing.assert_array_equal(trainer.predict(X), averaged.predict(X))
    assert not np.array_equal(
        trainer.predict(X), np.asarray(jax.vmap(trainer.model)(jnp.asarray(X)))
    )
    px.save_model(tmp_path / "ema.eqx", trainer.ema_model)
    loaded = px.load_model(tmp_path / "ema.eqx", like=make_model())
    assert all(
        np.array_equal(a, b)
        for a, b in zip(params(loaded), params(trainer.ema_model), strict=True)
    )


def test_a_resumed_run_keeps_the_average_bitwise(tmp_path):
    straight = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), ema=DECAY, progress=False
    )
    straight.fit(BATCHES, steps=STEPS)

    saving = px.callbacks.Checkpoint(tmp_path, every_n_steps=7, every_n_epochs=None)
    first = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        ema=DECAY,
        callbacks=[saving, StopAt(7)],  # mid-epoch
        progress=False,
    )
    first.fit(BATCHES, steps=STEPS)
    resumed = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), ema=DECAY, progress=False
    )
    resumed.fit(BATCHES, steps=STEPS, resume=tmp_path)
    for a, b in zip(params(resumed.ema_model), params(straight.ema_model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("ema", [0, 1, 1.5, -0.1, "0.9", True])
def test_a_bad_decay_is_named(ema):
    with pytest.raises(ValueError, match=rf"ema={ema!r}: pass the decay"):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), ema=ema)


def test_no_average_no_ema_model():
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), progress=False)
    assert trainer.state.ema is None
    with pytest.raises(ValueError, match=r"ema_model: .*ema=0.999"):
        _ = trainer.ema_model


def test_resuming_a_run_without_an_average_names_it(tmp_path):
    plain = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        callbacks=[px.callbacks.Checkpoint(tmp_path)],
        progress=False,
    )
    plain.fit(BATCHES, epochs=1)
    averaging = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), ema=DECAY, progress=False
    )
    with pytest.raises(ValueError, match=r"is of a run with ema=None, but this "
                       r"trainer has ema=0\.8: .* build the trainer with "
                       r"ema=None to continue that run"):  # fmt: skip
        averaging.fit(BATCHES, epochs=2, resume=tmp_path)
