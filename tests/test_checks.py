"""Invariant 4: every bad input stops with a clear error naming the argument,
its value and the fix, before any device work, and leaves the state as it was."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import CLASSES, IN, make_data, make_model, max_abs_diff, params_of


def snapshot(trainer):
    state = trainer.state
    state = eqx.tree_at(lambda s: s.key, state, jax.random.key_data(state.key))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def assert_unchanged(trainer, before):
    after = snapshot(trainer)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.fixture
def trainer():
    return px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(8)
    )


def bad_batches():
    x, y = make_data(16)
    nan_x = x.copy()
    nan_x[5, 2] = np.nan
    return {
        "wrong feature size": (
            [(np.ones((16, IN + 2), np.float32), y)],
            ValueError,
            [f"({IN},)", f"x.shape=({IN + 2},)", f"in_size={IN + 2}"],
        ),
        "wrong rank": (
            [(np.ones((16, IN, 1), np.float32), y)],
            TypeError,
            ["data", "float32[5, 1]", "fix the batch or the model"],
        ),
        "float labels for cross-entropy": (
            [(x, y.astype(np.float32))],
            TypeError,
            ["labels y", "float32", "integer class labels", "astype(np.int32)"],
        ),
        "leaves disagree on the examples axis": (
            [(x, y[:15])],
            ValueError,
            ["leading (examples) axis", "16", "15"],
        ),
        "labels out of range": (
            [(x, np.where(y == 0, CLASSES, y).astype(np.int32))],
            ValueError,
            [f"outside [0, {CLASSES})", f"0..{CLASSES - 1}"],
        ),
        "negative labels": ([(x, y - 1)], ValueError, ["from -1", "class indices"]),
        "NaN in inputs": (
            [(nan_x, y)],
            ValueError,
            ["batch[0]", "NaN", "example 5", "checks='off'"],
        ),
        "empty data": ([], ValueError, ["no batches", "non-empty"]),
        "empty batch": ([(x[:0], y[:0])], ValueError, ["0 examples", "drop empty"]),
        "not a pair": ([x], TypeError, ["(x, y) pair", "split_batch"]),
        "strings": ([(x, np.array(["a"] * 16))], TypeError, ["batch[1]", "numeric"]),
        "not iterable": (3, TypeError, ["data=int", "iterable"]),
    }


@pytest.mark.parametrize("case", list(bad_batches()))
def test_bad_data_is_refused_and_state_kept(trainer, case):
    data, error, phrases = bad_batches()[case]
    before = snapshot(trainer)
    with pytest.raises(error) as info:
        trainer.fit(data, epochs=1)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    assert_unchanged(trainer, before)
    assert len(trainer.history) == 0


def test_batch_structure_must_match_the_first(trainer):
    x, y = make_data(16)
    trainer.fit([(x, y)], epochs=1)
    before = snapshot(trainer)
    for bad, phrase in [
        (((x, x), y), "structure"),
        ((x[:, :3], y), "examples of shape (5,)"),
        ((x, y[:, None]), "examples of shape ()"),
        ((x.astype(np.float64), y), "dtype float64"),
    ]:
        with pytest.raises((ValueError, TypeError)) as info:
            trainer.fit([bad], epochs=1)
        assert phrase in str(info.value) and "first batch" in str(info.value)
        assert_unchanged(trainer, before)


def test_bad_batch_mid_epoch_keeps_the_good_steps():
    x, y = make_data(32)
    good = [(x[:16], y[:16]), (x[16:], y[16:])]
    bad = (x[:16], y[:16] + CLASSES)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    reference = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    reference.fit(good, epochs=1)
    with pytest.raises(ValueError, match="batch 2 of epoch 0"):
        trainer.fit([*good, bad], epochs=1)
    for a, b in zip(params_of(trainer.model), params_of(reference.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_checks_off_skips_value_checks():
    x, y = make_data(16)
    x[0, 0] = np.nan
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), checks="off", nan_policy="off"
    )
    trainer.fit([(x, y)], epochs=1)  # no host check: the NaN reaches the model
    assert np.isnan(trainer.history[0]["loss"])


@pytest.mark.parametrize(
    "make, error, phrases",
    [
        (
            lambda: px.ShardingStrategy(devices=9),
            ValueError,
            ["devices=9", "from 1 to 8"],
        ),
        (lambda: px.PmapStrategy(devices=0), ValueError, ["devices=0", "from 1 to 8"]),
        (lambda: px.PmapStrategy(devices="all"), TypeError, ["devices='all'", "None"]),
        (lambda: px.ShardingStrategy(devices=[]), ValueError, ["devices=[]"]),
        (
            lambda: px.AccumulatingStrategy(px.PmapStrategy(), 0),
            ValueError,
            ["microbatches=0", ">= 1"],
        ),
        (
            lambda: px.AccumulatingStrategy(px.PmapStrategy(), 2.0),
            TypeError,
            ["microbatches=2.0", "int"],
        ),
        (
            lambda: px.AccumulatingStrategy("pmap", 2),  # pyright: ignore
            TypeError,
            ["inner='pmap'", "Strategy"],
        ),
        (
            lambda: px.AccumulatingStrategy(
                px.AccumulatingStrategy(px.PmapStrategy(), 2), 3
            ),
            TypeError,
            ["microbatches=2 * k"],
        ),
        (lambda: px.PmapStrategy(axis_name="batch"), ValueError, ["axis_name='batch'"]),
    ],
)
def test_bad_strategy_arguments(make, error, phrases):
    with pytest.raises(error) as info:
        make()
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "kwargs, error, phrases",
    [
        ({"optimizer": "adam"}, TypeError, ["optimizer='adam'", "optax.adam(1e-3)"]),
        ({"optimizer": optax.adam}, TypeError, ["not an optax", "hyperparameters"]),
        ({"loss": "hinge"}, ValueError, ["loss='hinge'", "'cross_entropy', 'mse'"]),
        ({"strategy": "pmap"}, TypeError, ["strategy='pmap'", "px.PmapStrategy()"]),
        ({"callbacks": [print]}, TypeError, ["callbacks contains", "px.Callback"]),
        ({"checks": True}, ValueError, ["checks=True", "'on' or 'off'"]),
        ({"nan_policy": "ignore"}, ValueError, ["nan_policy='ignore'"]),
        ({"seed": 1.5}, TypeError, ["seed=1.5"]),
        ({"sync_every": 0}, ValueError, ["sync_every=0"]),
        ({"model_state": {}}, TypeError, ["model_state=dict", "make_with_state"]),
        ({"model": "mlp"}, TypeError, ["model='mlp'", "callable"]),
    ],
)
def test_bad_trainer_arguments(kwargs, error, phrases):
    args = {"model": make_model(), "optimizer": optax.adam(1e-2), **kwargs}
    with pytest.raises(error) as info:
        px.DataParallelTrainer(args.pop("model"), args.pop("optimizer"), **args)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"epochs": 0}, "epochs=0"),
        ({"steps": -1}, "steps=-1"),
        ({"epochs": 1.0}, "epochs=1.0"),
    ],
)
def test_bad_fit_arguments(trainer, kwargs, phrase):
    before = snapshot(trainer)
    with pytest.raises(ValueError, match=phrase):
        trainer.fit([make_data(16)], **kwargs)
    assert_unchanged(trainer, before)


def test_generator_used_up_after_one_epoch(trainer):
    x, y = make_data(16)
    with pytest.raises(ValueError, match="generator is used up"):
        trainer.fit((b for b in [(x, y)]), epochs=2)
    assert int(trainer.state.step) == 1  # the first epoch's update is kept


def test_mse_shape_mismatch_is_explained():
    x, _ = make_data(16)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), loss="mse")
    with pytest.raises((ValueError, TypeError)) as info:
        trainer.fit([(x, np.ones((16, 2), np.float32))])
    assert "per-example shape (2,)" in str(info.value)
    assert "(3,)" in str(info.value)


def test_loss_must_return_one_value_per_example():
    x, y = make_data(16)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        loss=lambda out, y: optax.softmax_cross_entropy_with_integer_labels(
            out, y
        ).mean(),
    )
    with pytest.raises((ValueError, TypeError)) as info:
        trainer.fit([(x, y)])
    # Without a runtime type checker phalanx's own check speaks; with the
    # jaxtyping import hook (as in this suite) the hook's annotation does.
    message = str(info.value)
    assert "does not fit the model and loss" in message
    assert "one value per example" in message or "Float[" in message


def test_traced_batch_check_uses_jaxtyping_and_beartype():
    # Inside the compiled step the batch is checked against the spec at trace
    # time: every leaf's per-example shape and dtype, one shared batch axis.
    import jax.numpy as jnp
    import jaxtyping

    from phalanx._checks import BatchSpec

    x, y = make_data(16)
    leaves, treedef = jax.tree.flatten((x, y))
    check = BatchSpec.of(leaves, treedef).traced_check()
    weight = jnp.ones(16)
    check((jnp.asarray(x), jnp.asarray(y)), weight)
    for bad in [
        (jnp.asarray(x[:, :3]), jnp.asarray(y)),  # per-example shape
        (jnp.asarray(x), jnp.asarray(y, jnp.float32)),  # dtype
        (jnp.asarray(x[:8]), jnp.asarray(y[:8])),  # batch axis vs weights
    ]:
        with pytest.raises(jaxtyping.TypeCheckError):
            check(bad, weight)


def test_fit_after_an_error_starts_a_fresh_epoch():
    x, y = make_data(32)
    good = [(x[:16], y[:16]), (x[16:], y[16:])]
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    with pytest.raises(ValueError, match="labels"):
        trainer.fit([good[0], (x[:16], y[:16] + CLASSES)], epochs=1)
    trainer.fit(good, epochs=1)  # both batches, its own epoch sums
    reference = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    reference.fit(good[:1], epochs=1)
    reference.fit(good, epochs=1)
    assert max_abs_diff(trainer.model, reference.model) == 0
    assert trainer.history[-1] == reference.history[-1]
