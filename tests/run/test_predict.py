"""predict and evaluate: any number of rows, split across devices, padding
handled, exact weighting; deterministic, the model called as the trainer's
`inference_model` hook says."""

import functools

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import CLASSES, IN, STRATEGIES, make_data, make_model, max_abs_diff


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("rows", [1, 13, 64])
def test_predict_any_number_of_rows(name, rows):
    x, y = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=STRATEGIES[name]()
    )
    trainer.fit([(x, y)], steps=2)
    expected = jax.vmap(jax.device_get(trainer.model))(x[:rows])
    out = trainer.predict(x[:rows])
    assert isinstance(out, jax.Array) and out.shape == (rows, CLASSES)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6)
    chunked = trainer.predict(x[:rows], batch_size=5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(out), atol=1e-6)


def test_predict_is_sharded_across_devices():
    x, _ = make_data(64)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8)
    )
    out = trainer.predict(x)
    assert len(out.sharding.device_set) == 8


def test_predict_bad_rows():
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(ValueError, match="x: rows of shapes"):
        trainer.predict(np.ones((4, 7), np.float32))
    with pytest.raises(ValueError, match="batch_size=0"):
        trainer.predict(np.ones((4, 5), np.float32), batch_size=0)
    with pytest.raises(ValueError, match="0 examples"):
        trainer.predict(np.ones((0, 5), np.float32))


def test_evaluate_weights_every_example_once():
    x, y = make_data(100)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8)
    )
    results = trainer.evaluate(
        [(x[:48], y[:48]), (x[48:96], y[48:96]), (x[96:], y[96:])]
    )
    logits = jax.vmap(jax.device_get(trainer.model))(x)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    assert results["loss"] == pytest.approx(float(expected), rel=1e-6)
    accuracy = float((np.asarray(logits).argmax(-1) == y).mean())
    assert results["accuracy"] == pytest.approx(accuracy)
    with pytest.raises(ValueError, match="no batches"):
        trainer.evaluate([])


def test_states_handed_out_stay_valid():
    # The loop donates state buffers; states returned earlier must survive.
    x, y = make_data(32)
    model = make_model()
    trainer = px.DataParallelTrainer(model, optax.adam(1e-2))
    first = trainer.fit([(x, y)], steps=2)
    trainer.fit([(x, y)], steps=2)
    assert int(first.step) == 2 and int(trainer.state.step) == 4
    assert max_abs_diff(model, make_model()) == 0  # the user's model untouched


class FlaggedDropout(eqx.Module):
    """Dropout on unless the call says otherwise, whatever the inference mode
    (as Equinox's BERT example calls it)."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(IN, CLASSES, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, enable_dropout=True, key=None):
        return self.dropout(self.linear(x), inference=not enable_dropout, key=key)


class DropoutOff(px.DataParallelTrainer[FlaggedDropout]):
    @override
    def inference_model(self, model):
        return functools.partial(model, enable_dropout=False)


@pytest.mark.parametrize("name", ["sharding", "fsdp"])
def test_inference_model_says_how_the_model_is_called(name):
    x, y = make_data(24)
    trainer = DropoutOff(
        FlaggedDropout(jr.key(0)), optax.sgd(0.1), strategy=STRATEGIES[name]()
    )
    trainer.fit([(x, y)], steps=1)  # dropout on: the flag's default
    model = jax.device_get(trainer.model)
    expected = jax.vmap(functools.partial(model, enable_dropout=False))(x)
    out = trainer.predict(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6)
    loss = optax.softmax_cross_entropy_with_integer_labels(expected, y).mean()
    assert trainer.evaluate([(x, y)])["loss"] == pytest.approx(float(loss), rel=1e-6)


def test_randomness_at_inference_is_refused_before_anything_runs():
    x, y = make_data(16)
    trainer = px.DataParallelTrainer(FlaggedDropout(jr.key(0)), optax.sgd(0.1))
    for call in (lambda: trainer.predict(x), lambda: trainer.evaluate([(x, y)])):
        with pytest.raises(RuntimeError) as caught:
            call()
        text = str(caught.value)
        assert text.startswith(
            "evaluate and predict call the model without randomness (key=None)"
        )
        assert "RuntimeError: Dropout requires a key" in text
        assert "functools.partial(model, enable_dropout=False)" in text
    trainer.fit([(x, y)], steps=1)  # training draws its keys as before
    assert trainer.progress.step == 1


def test_inference_model_gets_the_model_in_inference_mode_and_no_key():
    seen = []

    class Spy(px.DataParallelTrainer[FlaggedDropout]):
        @override
        def inference_model(self, model):
            seen.append((model.dropout.inference, model.linear.weight.dtype))

            def call(x, *, key):  # a key it must take: phalanx passes None
                assert key is None
                return model(x, enable_dropout=False)

            return call

    x, _ = make_data(8)
    model = FlaggedDropout(jr.key(1))
    trainer = Spy(model, optax.sgd(0.1), strategy=px.PmapStrategy(8))
    out = trainer.predict(x)
    expected = jax.vmap(functools.partial(model, enable_dropout=False))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6)
    assert seen and set(seen) == {(True, np.dtype(np.float32))}  # at trace time


def test_an_inference_model_that_is_not_callable_names_the_hook():
    class Broken(px.DataParallelTrainer[px.models.MLP]):
        @override
        def inference_model(self, model):  # pyright: ignore[reportIncompatibleMethodOverride]
            return None  # pyright: ignore[reportReturnType]

    x, y = make_data(8)
    trainer = Broken(make_model(), optax.sgd(0.1))
    with pytest.raises(TypeError, match="inference_model returned None; it must"):
        trainer.predict(x)
    with pytest.raises(TypeError, match="inference_model returned None"):
        trainer.evaluate([(x, y)])
