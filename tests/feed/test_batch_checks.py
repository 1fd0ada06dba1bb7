"""Invariant 4: every bad input stops with a clear error naming the argument,
its value and the fix, before any device work, and leaves the state as it was."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import CLASSES, IN, make_data, make_model, max_abs_diff, params_of
from phalanx._engine.feed import _pipeline as _batching
from phalanx._engine.program._spec import BatchSpec


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
            [
                f"({IN},)",
                f"x.shape=({IN + 2},)",
                "x.reshape(16, -1)",
                f"in_size={IN + 2}",
            ],
        ),
        "wrong rank": (
            [(np.ones((16, IN, 1), np.float32), y)],
            TypeError,
            ["data", "float32[5, 1]", f"shape ({IN},)", f"x.reshape(16, {IN})"],
        ),
        "float labels for cross-entropy": (
            [(x, y.astype(np.float32))],
            TypeError,
            ["labels y", "float32", "integer class labels", "astype(np.int32)"],
        ),
        "leaves disagree on the examples axis": (
            [(x, y[:15])],
            ValueError,
            [
                "leading (examples) axis",
                "batch[0] has 16, batch[1] has 15",
                "give every leaf the same number of examples",
                "x[i:j], y[i:j]",
            ],
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


def test_host_structure_checks_run_once_per_signature(monkeypatch):
    # Structure and shape checks are cached by the batch's shape/dtype
    # signature; value checks run on every batch.
    counts = {"examples axis": 0, "against the spec": 0, "values": 0}

    def counting(name, fn):
        def counted(*args):
            counts[name] += 1
            return fn(*args)

        return counted

    monkeypatch.setattr(
        _batching, "num_examples", counting("examples axis", _batching.num_examples)
    )
    monkeypatch.setattr(
        BatchSpec, "check", counting("against the spec", BatchSpec.check)
    )
    monkeypatch.setattr(
        _batching, "check_finite", counting("values", _batching.check_finite)
    )
    x, y = make_data(40)
    data = [(x[:16], y[:16]), (x[16:32], y[16:32]), (x[32:], y[32:])]
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2))
    trainer.fit(data, epochs=2)
    trainer.evaluate(data)
    # Two signatures (16 and 8 rows): the first fixes the spec, the second is
    # checked against it; nine batches get their values checked.
    assert counts == {"examples axis": 2, "against the spec": 1, "values": 9}
    trainer.fit([(x[:4], y[:4])] * 2, epochs=1)  # a new signature: once more
    assert counts == {"examples axis": 3, "against the spec": 2, "values": 11}


def test_bad_batch_is_refused_before_device_work(trainer, monkeypatch):
    x, y = make_data(16)
    # A bad first batch is checked against the model abstractly: nothing is
    # placed on devices or compiled.
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        with pytest.raises(TypeError, match=r"x\.reshape\(16, 5\)"):
            trainer.fit([(x[:, :, None], y)], epochs=1)
    assert trainer._parts.programs.first is None  # nothing built
    trainer.fit([(x, y)], epochs=1)
    before = snapshot(trainer)

    def step_ran(*args):
        raise AssertionError("the compiled step ran on a bad batch")

    program = trainer._parts.programs.first
    assert program is not None
    trainer._parts.programs.add(program._replace(train=step_ran))
    nan_x = x.copy()
    nan_x[3, 1] = np.nan
    bad = [((x, x), y), (x.astype(np.float64), y), (x, y[:15]), (x, y + CLASSES)]
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        for batch in [*bad, (nan_x, y)]:
            with pytest.raises((TypeError, ValueError), match=r"^data: batch 0 of"):
                trainer.fit([batch], epochs=1)
        # The guard does see batches being placed: it stops a good one.
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            trainer.fit([(x, y)], epochs=1)
    assert_unchanged(trainer, before)


class ListGradients(px.DataParallelTrainer):
    @override
    def gradients(self, grads, state):
        return jax.tree.leaves(grads)


class HalfPrecisionGradients(px.DataParallelTrainer):
    @override
    def gradients(self, grads, state):
        return eqx.tree_at(
            lambda g: g.layers[0].weight,
            grads,
            replace_fn=lambda w: w.astype(jnp.bfloat16),
        )


@pytest.mark.parametrize(
    "cls, phrases",
    [
        (
            ListGradients,
            [
                "gradients: the hook returned a tree of structure PyTreeDef([*,",
                "one gradient per parameter",
                "jax.tree.map(fn, grads)",
            ],
        ),
        (
            HalfPrecisionGradients,
            [
                "gradients: the gradient of model.layers[0].weight is bfloat16",
                "the parameter is float32",
                "g.astype(jnp.float32)",
            ],
        ),
    ],
)
def test_gradients_must_match_the_parameters_tree_and_dtypes(cls, phrases):
    trainer = cls(make_model(), optax.sgd(1.0), strategy=px.PmapStrategy(8))
    before = snapshot(trainer)
    with pytest.raises(TypeError) as info:
        trainer.fit([make_data(16)], steps=1)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    assert_unchanged(trainer, before)
    assert len(trainer.history) == 0


def test_checks_off_skips_value_checks():
    x, y = make_data(16)
    x[0, 0] = np.nan
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), checks="off", nan_policy="off"
    )
    trainer.fit([(x, y)], epochs=1)  # no host check: the NaN reaches the model
    assert np.isnan(trainer.history[0]["loss"])
    out_of_range = np.where(y == 0, CLASSES, y).astype(np.int32)
    trainer.fit([(x[1:], out_of_range[1:])], epochs=1)  # labels are not checked
    assert len(trainer.history) == 2


@pytest.mark.parametrize("checks", ["on", "off"])
def test_traced_batch_check_is_in_the_step_only_when_on(monkeypatch, checks):
    traced = []
    build = BatchSpec.traced_check

    def recording(spec):
        check = build(spec)

        def recorded(leaves, weight):
            traced.append(tuple(leaf.shape for leaf in leaves))
            return check(leaves, weight)

        return recorded

    monkeypatch.setattr(BatchSpec, "traced_check", recording)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), checks=checks)
    trainer.fit([make_data(16)], epochs=1)
    # Traced (abstractly, then for the train step), never run per step.
    assert len(traced) == (2 if checks == "on" else 0)


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
            lambda: px.AccumulatingStrategy(px.PmapStrategy(), 2.0),  # pyright: ignore[reportArgumentType]
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
                px.AccumulatingStrategy(px.PmapStrategy(), 2),  # pyright: ignore[reportArgumentType]
                3,
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
        (
            {"loss": "hinge"},
            ValueError,
            ["loss='hinge'", "'cross_entropy', 'categorical_cross_entropy', 'mse'"],
        ),
        ({"strategy": "pmap"}, TypeError, ["strategy='pmap'", "px.PmapStrategy()"]),
        ({"callbacks": [print]}, TypeError, ["callbacks contains", "px.Callback"]),
        ({"checks": True}, ValueError, ["checks=True", "'on' or 'off'"]),
        ({"nan_policy": "ignore"}, ValueError, ["nan_policy='ignore'"]),
        ({"seed": 1.5}, TypeError, ["seed=1.5"]),
        ({"sync_every": 0}, ValueError, ["sync_every=0"]),
        ({"prefetch": -1}, ValueError, ["prefetch=-1", "e.g. 2"]),
        ({"prefetch": 1.5}, ValueError, ["prefetch=1.5"]),
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
    import jaxtyping

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
