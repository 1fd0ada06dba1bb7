"""predict and evaluate: any number of rows, split across devices, padding
handled, exact weighting."""

import jax
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import CLASSES, STRATEGIES, make_data, make_model, max_abs_diff


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
