"""Property-based tests at the batch boundary (hypothesis).

Batches wrong in exactly one respect (shape, rank, dtype, a NaN or inf
somewhere, structure, sample weights, label range, leading axes that
disagree) must each raise a built-in exception whose message names the
argument (``data``) and leave the parameters and step as they were; valid
ragged batches must train. All of it runs on one trainer whose step is
compiled once: every bad batch is refused on the host, before device work.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import phalanx as px
from helpers import CLASSES, IN, make_data, make_model


N = 16  # examples in the first batch, which fixes the spec and step size
SETTINGS = settings(
    max_examples=60,
    deadline=None,
    # The same examples on every run (CI reproduces what it finds), and
    # nothing written into the checkout.
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@functools.cache
def trainer(name: str) -> px.DataParallelTrainer:
    """A trainer whose spec and steps are fixed by one good batch."""
    strategy = {
        "sharding": lambda: px.ShardingStrategy(2),
        "pmap": lambda: px.PmapStrategy(2),
    }[name]()
    trained = px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=strategy)
    trained.fit([make_data(N)], epochs=1)
    return trained


def state_of(trained: px.DataParallelTrainer) -> list[np.ndarray]:
    state = trained.state
    state = eqx.tree_at(lambda s: s.key, state, jax.random.key_data(state.key))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def assert_refused(trained, batch, phrases: list[str]) -> None:
    before = state_of(trained)
    with pytest.raises((TypeError, ValueError)) as info:
        trained.fit([batch], epochs=1)
    message = str(info.value)
    assert type(info.value).__module__ == "builtins", type(info.value)
    assert message.startswith("data"), message
    for phrase in phrases:
        assert phrase in message, message
    after = state_of(trained)
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))


rows = st.integers(1, N)
seeds = st.integers(0, 2**16)
names = st.sampled_from(["sharding", "pmap"])


def good(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    return make_data(n, seed=seed)


@st.composite
def bad_batches(draw) -> tuple[object, list[str]]:
    """A batch wrong in exactly one respect, and what its error must say."""
    n, seed = draw(rows), draw(seeds)
    x, y = good(n, seed)
    kind = draw(
        st.sampled_from(
            [
                "features",
                "rank",
                "dtype",
                "nonfinite",
                "structure",
                "weights",
                "labels",
                "leading",
            ]
        )
    )
    if kind == "features":
        width = draw(st.integers(1, 12).filter(lambda w: w != IN))
        return (good_width(n, width, seed), y), ["batch[0]", f"({width},)"]
    if kind == "rank":
        extra = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
        wide = np.ones((n, IN, *extra), np.float32)
        return (wide, y), ["batch[0]", "shape"]
    if kind == "dtype":
        dtype = draw(st.sampled_from([np.float64, np.float16, np.int32, np.int8]))
        return (x.astype(dtype), y), ["batch[0]", "dtype", np.dtype(dtype).name]
    if kind == "nonfinite":
        i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, IN - 1))
        x = x.copy()
        x[i, j] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        return (x, y), ["non-finite", f"example {i}"]
    if kind == "structure":
        shape = draw(st.sampled_from(["single", "four", "dict"]))
        batch = {
            "single": (x,),
            "four": (x, y, np.ones(n, np.float32), y),
            "dict": {"inputs": x, "labels": y},
        }[shape]
        return batch, ["(x, y) pair"]
    if kind == "weights":
        flaw = draw(st.sampled_from(["negative", "nan", "shape", "zero"]))
        w = np.ones(n, np.float32)
        if flaw == "negative":
            w[draw(st.integers(0, n - 1))] = -draw(st.floats(0.1, 10))
        elif flaw == "nan":
            w[draw(st.integers(0, n - 1))] = np.nan
        elif flaw == "shape":
            w = np.ones(n + draw(st.integers(1, 3)), np.float32)
        else:
            w = np.zeros(n, np.float32)
        phrase = "total sample weight 0" if flaw == "zero" else "sample_weight"
        return (x, y, w), [phrase]
    if kind == "labels":
        i = draw(st.integers(0, n - 1))
        y = y.copy()
        y[i] = draw(st.sampled_from([-1, CLASSES, CLASSES + 7, -100]))
        return (x, y), ["labels", f"[0, {CLASSES})"]
    m = draw(st.integers(1, N + 3).filter(lambda m: m != n))
    return (x, good(m, seed)[1]), ["leading (examples) axis"]


def good_width(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, width)).astype(np.float32)


@SETTINGS
@given(case=bad_batches(), name=names)
def test_a_batch_wrong_in_one_respect_is_refused_and_changes_nothing(case, name):
    batch, phrases = case
    assert_refused(trainer(name), batch, phrases)


@SETTINGS
@given(n=rows, seed=seeds, weighted=st.booleans(), name=names)
def test_ragged_batches_train(n, seed, weighted, name):
    trained = trainer(name)
    step = int(trained.state.step)
    x, y = good(n, seed)
    ragged = (x, y, np.random.default_rng(seed).uniform(0.1, 2, n).astype(np.float32))
    # A pass's first batch is its largest; the ragged one is padded to it.
    trained.fit([good(N, seed + 1), ragged if weighted else (x, y)], epochs=1)
    assert int(trained.state.step) == step + 2
    assert np.isfinite(trained.history[-1]["loss"])
    floats = [leaf for leaf in state_of(trained) if leaf.dtype.kind == "f"]
    assert all(np.isfinite(leaf).all() for leaf in floats)
