"""px.save_model / px.load_model: exact, atomic, no pickle, clear errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import make_data, make_model, max_abs_diff


@pytest.fixture
def trained():
    x, y = make_data(32)
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8)
    )
    trainer.fit([(x, y)], steps=3)
    return trainer


def test_round_trip_is_exact(tmp_path, trained):
    path = tmp_path / "model.npz"
    px.save_model(path, trained.model)
    loaded = px.load_model(path, like=make_model(seed=1))
    assert max_abs_diff(loaded, trained.model) == 0
    x, _ = make_data(4)
    np.testing.assert_allclose(
        np.asarray(jax.vmap(loaded)(jnp.asarray(x))),
        np.asarray(trained.predict(x)),
        atol=1e-6,
    )
    # Nothing else is left next to it (the temporary file was renamed).
    assert os.listdir(tmp_path) == ["model.npz"]


def test_overwrite_is_atomic(tmp_path, trained, monkeypatch):
    path = tmp_path / "model.npz"
    px.save_model(path, make_model(seed=3))
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        px.save_model(path, trained.model)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.npz"]


def test_other_architecture_names_the_leaf(tmp_path, trained):
    path = tmp_path / "model.npz"
    px.save_model(path, trained.model)
    other = px.models.MLP(5, 3, hidden=(16,), key=jax.random.key(0))
    with pytest.raises(
        ValueError, match=r"model\.layers\[0\]\.weight.*\[8, 5\].*\[16, 5\]"
    ):
        px.load_model(path, like=other)
    deeper = px.models.MLP(5, 3, hidden=(8, 8), key=jax.random.key(0))
    with pytest.raises(ValueError, match="another model"):
        px.load_model(path, like=deeper)


def test_missing_corrupt_and_truncated_files(tmp_path, trained):
    with pytest.raises(FileNotFoundError, match="px.save_model"):
        px.load_model(tmp_path / "nope.npz", like=make_model())
    path = tmp_path / "model.npz"
    px.save_model(path, trained.model)
    data = path.read_bytes()
    (tmp_path / "cut.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        px.load_model(tmp_path / "cut.npz", like=make_model())
    (tmp_path / "text.npz").write_text("not a model")
    with pytest.raises(ValueError, match="truncated or corrupt"):
        px.load_model(tmp_path / "text.npz", like=make_model())


def test_loading_never_unpickles(tmp_path):
    # An .npz whose arrays are pickled objects is refused, not executed.
    path = tmp_path / "evil.npz"
    np.savez(path, spec=np.array([{"format": "x"}], dtype=object))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        px.load_model(path, like=make_model())
