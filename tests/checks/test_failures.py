"""Issue 15: mistakes a user makes get one clear error naming the argument or
hook, what it was, and the fix; the state is left as it was.

Each case here once ended in a raw AttributeError/ValueError from deep
inside, or in an error blaming the wrong thing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import CLASSES, IN, make_data, make_model
from phalanx._checks._run_errors import ZERO_WEIGHT, nonfinite_error
from phalanx._engine.step._guard import Update, guard as _guard
from phalanx._state._sums import NO_FLAGS, EpochSums


def state_of(trainer) -> list[np.ndarray]:
    state = trainer.state
    state = eqx.tree_at(lambda s: s.key, state, jax.random.key_data(state.key))
    return [np.asarray(leaf) for leaf in jax.tree.leaves(state)]


def assert_refused(trainer, data, error, phrases, **fit):
    """`fit(data)` raises `error` naming every phrase; the state is kept."""
    before = state_of(trainer)
    with pytest.raises(error) as info:
        trainer.fit(data, **fit)
    for phrase in phrases:
        assert phrase in str(info.value), str(info.value)
    after = state_of(trainer)
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    return info.value


def trainer_of(cls=px.DataParallelTrainer, model=None, **kwargs):
    kwargs.setdefault("strategy", px.ShardingStrategy(2))
    return cls(model or make_model(), optax.adam(1e-2), **kwargs)


# --- item 5: save_model refuses what holds no weights -------------------------


@pytest.mark.parametrize("what", ["trainer", "string"])
def test_save_model_refuses_what_holds_no_arrays(tmp_path, what):
    trainer = trainer_of()
    model = trainer if what == "trainer" else "hello"
    with pytest.raises(TypeError) as info:
        px.save_model(tmp_path / "model.npz", model)  # pyright: ignore[reportArgumentType]
    message = str(info.value)
    assert "holds no arrays" in message and "trainer.model" in message
    assert ("DataParallelTrainer" if what == "trainer" else "'hello'") in message
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_save_model_makes_its_folder(tmp_path):
    model = make_model()
    path = tmp_path / "new" / "deeper" / "model.npz"
    px.save_model(path, model)
    loaded = px.load_model(path, like=make_model(seed=9))
    assert eqx.tree_equal(loaded, model)


# --- item 6: a batch that weighs nothing --------------------------------------


@pytest.mark.parametrize("policy", ["raise", "skip", "off"])
def test_a_batch_of_zero_total_weight_is_named(policy):
    x, y = make_data(16)
    good, empty = (x, y, np.ones(16, np.float32)), (x, y, np.zeros(16, np.float32))
    trainer = trainer_of(nan_policy=policy)
    with pytest.raises(ValueError) as info:
        trainer.fit([good, empty], epochs=1)
    message = str(info.value)
    for phrase in ("batch 1 of epoch 0", "total sample weight 0", "padding"):
        assert phrase in message, message
    assert "non-finite" not in message and "learning rate" not in message
    assert int(trainer.state.step) == 1  # the good step before it is kept


def test_zero_total_weight_found_on_the_devices_is_named():
    # In a multi-process run the total weight is summed on the devices; a
    # step whose total is 0 records ZERO_WEIGHT instead of a leaf, and the
    # host names the batch, not the model.
    state = trainer_of().state
    params = eqx.filter(state.model, eqx.is_inexact_array)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), params)
    acc = EpochSums(jnp.zeros(2), jnp.asarray(NO_FLAGS))

    def flags(total):
        leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
        update = Update(
            state.step, leaves, grads, None, lambda _: leaves, lambda _: leaves
        )
        _, new, _ = _guard("raise", update, jnp.zeros(2), acc, jnp.float32(total))
        return [int(f) for f in new.flags]

    assert flags(0.0) == [1, 0, ZERO_WEIGHT]
    assert flags(5.0) == [1, 0, 0]  # a NaN gradient: its first leaf
    error = nonfinite_error(0, ZERO_WEIGHT, state.model)
    assert isinstance(error, ValueError) and "total sample weight 0" in str(error)


def test_evaluate_on_data_of_zero_total_weight_is_refused():
    x, y = make_data(16)
    trainer = trainer_of()
    with pytest.raises(ValueError, match=r"sample_weight 0 \(total weight 0"):
        trainer.evaluate([(x, y, np.zeros(16, np.float32))])


# --- item 7: hooks that return the wrong thing --------------------------------

# Each hook below returns the wrong type on purpose (what pyright is told).


class LossNone(px.DataParallelTrainer):
    @override
    def loss(self, model, outputs, targets):  # pyright: ignore[reportIncompatibleMethodOverride]
        return None  # pyright: ignore[reportReturnType]


class MetricFloat(px.DataParallelTrainer):
    @override
    def metrics(self, outputs, targets):  # pyright: ignore[reportIncompatibleMethodOverride]
        return {"half": 0.5}  # pyright: ignore[reportReturnType]


class MetricList(px.DataParallelTrainer):
    @override
    def metrics(self, outputs, targets):  # pyright: ignore[reportIncompatibleMethodOverride]
        return [outputs[:, 0]]  # pyright: ignore[reportReturnType]


class SplitThree(px.DataParallelTrainer):
    @override
    def split_batch(self, batch):  # pyright: ignore[reportIncompatibleMethodOverride]
        return batch[0], batch[1], batch[1]  # pyright: ignore[reportReturnType]


HOOKS = {
    "loss returns None": (
        LossNone,
        {},
        TypeError,
        ["loss returned None", "one value per example", "shape (16,)"],
    ),
    "a metric is a float": (
        MetricFloat,
        {},
        TypeError,
        ["metrics()['half'] returned float 0.5", "one value per example"],
    ),
    "metrics returns a list": (
        MetricList,
        {},
        TypeError,
        ["metrics() returned a list of 1", "must return a dict"],
    ),
    "split_batch returns three": (
        SplitThree,
        {},
        TypeError,
        ["split_batch() returned a tuple of 3", "(inputs, targets)", "sample_weight"],
    ),
    # mse's own message, or (with the jaxtyping import hook on, as in this
    # suite, whose check of mse's annotations speaks first) the first-batch
    # hint: the model ran, the batches hold no targets.
    "mse without targets": (
        px.DataParallelTrainer,
        {"loss": "mse"},
        (TypeError, ValueError),
        ["targets y", "yield (x, y) batches"],
    ),
}


@pytest.mark.parametrize("case", list(HOOKS))
def test_a_hook_returning_the_wrong_thing_is_named(case):
    cls, kwargs, error, phrases = HOOKS[case]
    x, y = make_data(16)
    targets = None if case == "mse without targets" else y
    assert_refused(trainer_of(cls, **kwargs), [(x, targets)], error, phrases)


def test_a_model_without_parameters_is_refused_when_built():
    class Fixed(eqx.Module):
        def __call__(self, x):
            return x[:CLASSES]

    with pytest.raises(ValueError, match="model=Fixed has no floating-point arrays"):
        trainer_of(model=Fixed())


# --- item 8: first-batch hints that look at dtype, state and batch axis --------


class BatchModel(eqx.Module):
    """Written for whole batches: x @ w over a leading batch axis."""

    weight: jax.Array

    def __call__(self, x):
        return x.reshape(x.shape[0], -1) @ self.weight


class Stateful(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(IN, CLASSES, key=key)
        self.norm = eqx.nn.BatchNorm(CLASSES, axis_name="batch", mode="batch")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def first_batch_error(model, x, **kwargs) -> str:
    _, y = make_data(16)
    trainer = trainer_of(model=model, **kwargs)
    with pytest.raises((TypeError, ValueError)) as info:
        trainer.fit([(x, y)])
    return str(info.value)


def test_integer_images_are_told_to_be_cast():
    x, _ = make_data(16)
    message = first_batch_error(make_model(), (np.abs(x) * 50).astype(np.uint8))
    assert "x holds uint8 values but the model computes in float32" in message
    assert "x.astype(np.float32) / 255" in message
    assert "fix the targets" not in message


def test_model_state_for_a_stateless_model_is_named():
    x, _ = make_data(16)
    message = first_batch_error(make_model(), x, model_state=eqx.nn.State(make_model()))
    assert "model_state= was given" in message and "drop model_state=" in message
    assert "fix the targets" not in message


def test_a_stateful_model_without_its_state_is_named():
    x, _ = make_data(16)
    model, _ = eqx.nn.make_with_state(Stateful)(jax.random.key(0))
    message = first_batch_error(model, x)
    assert "takes a state after x" in message and "model_state=state" in message


def test_a_positional_key_is_not_taken_for_a_state():
    class Keyed(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x, key=None):
            del key
            return self.linear(x)

    x, _ = make_data(16)
    model = Keyed(eqx.nn.Linear(IN + 2, CLASSES, key=jax.random.key(0)))
    message = first_batch_error(model, x)
    assert "the model fails on x" in message and "takes a state" not in message


def test_a_model_written_for_whole_batches_is_told_vmap_is_inside():
    x, _ = make_data(16)
    model = BatchModel(jnp.ones((IN, CLASSES)))
    message = first_batch_error(model, x)
    assert "models are called per example (jax.vmap inside)" in message
    assert "without the batch axis" in message


def test_targets_that_do_not_fit_blame_the_targets():
    x, _ = make_data(16)
    trainer = trainer_of(loss="mse")
    with pytest.raises((TypeError, ValueError)) as info:
        trainer.fit([(x, np.ones((16, 2), np.float32))])
    message = str(info.value)
    assert "the model runs on x and gives outputs float32[3]" in message
    assert "targets y float32[2]" in message and "fix the targets" in message


# --- item 11: small inconsistencies --------------------------------------------


def test_keras_style_fit_x_y_says_how_to_pass_batches():
    x, y = make_data(16)
    trainer = trainer_of()
    with pytest.raises(TypeError, match=r"fit\(\) got 2 .* as in Keras' fit\(x, y\)"):
        trainer.fit(x, y)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match=r"evaluate\(\) got 2 .* Keras' evaluate\(x, y"):
        trainer.evaluate(x, y)  # pyright: ignore[reportCallIssue]
    assert_refused(trainer, (x, y), TypeError, ["data=(x, y) is one batch", "[(x, y)]"])
    assert_refused(trainer, x, TypeError, ["one array of shape (16, 5)", "ArrayLoader"])
    with pytest.raises(TypeError, match=r"data=\(x, y, sample_weight\) is one batch"):
        trainer.evaluate((x, y, np.ones(16, np.float32)))


def test_one_batch_of_arrays_is_fine_with_an_own_split_batch():
    class Autoencoder(px.DataParallelTrainer):
        @override
        def split_batch(self, batch):
            return batch, batch

    x = np.random.default_rng(0).normal(size=(16, IN)).astype(np.float32)
    model = eqx.nn.Linear(IN, IN, key=jax.random.key(0))
    trainer = trainer_of(Autoencoder, model=model, loss="mse")
    trainer.fit([x, x])  # two batches, each one array: not a mistake here
    assert int(trainer.state.step) == 2


def test_predict_of_a_loader_says_it_takes_arrays():
    x, y = make_data(16)
    trainer = trainer_of()
    with pytest.raises(
        TypeError, match=r"x=ArrayLoader is a loader.*predict\(x_test\)"
    ):
        trainer.predict(px.data.ArrayLoader((x, y), 8))


@pytest.mark.parametrize("make", ["early-stopping", "checkpoint"])
def test_monitoring_eval_metrics_without_eval_data_fails_before_training(
    tmp_path, make
):
    callback = (
        px.callbacks.EarlyStopping(monitor="eval_loss")
        if make == "early-stopping"
        else px.callbacks.Checkpoint(tmp_path / "ckpt", monitor="eval_accuracy")
    )
    trainer = trainer_of(callbacks=[callback])
    assert_refused(
        trainer,
        [make_data(16)],
        ValueError,
        ["monitor='eval_", "no eval_data", "eval_data=..."],
    )
    assert not (tmp_path / "ckpt").exists()


def test_an_eval_metric_from_a_callback_of_ones_own_is_let_be():
    class Scores(px.Callback):  # adds the monitored metric at each epoch's end
        @override
        def on_epoch_end(self, info):
            info.metrics["eval_score"] = 1.0 / (info.epoch + 1)

    stopper = px.callbacks.EarlyStopping(monitor="eval_score", patience=1)
    trainer = trainer_of(callbacks=[Scores(), stopper])
    trainer.fit([make_data(16)], epochs=2)
    assert stopper.best == 0.5


def test_loggers_make_their_missing_folders(tmp_path):
    plot = px.callbacks.PlotHistory(tmp_path / "f" / "history.png")
    callbacks = [
        px.callbacks.CSVLogger(tmp_path / "a" / "b" / "metrics.csv", log_every=1),
        px.callbacks.JSONLogger(tmp_path / "c" / "metrics.jsonl", log_every=1),
        px.callbacks.TensorBoardLogger(tmp_path / "d" / "e" / "tb", log_every=1),
        plot,
        px.callbacks.Checkpoint(tmp_path / "g" / "ckpt"),
    ]
    assert list(tmp_path.iterdir()) == []  # nothing is written before fit
    trainer_of(callbacks=callbacks).fit([make_data(16)], epochs=1)
    plot.wait()  # drawn on a thread of its own
    for path in ("a/b/metrics.csv", "c/metrics.jsonl", "d/e/tb", "f/history.png"):
        assert (tmp_path / path).exists(), path
    assert (tmp_path / "g" / "ckpt" / "1").is_dir()


def test_a_logger_under_a_file_is_refused_when_built(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file, so no folder"):
        px.callbacks.CSVLogger(tmp_path / "file" / "sub" / "metrics.csv")
