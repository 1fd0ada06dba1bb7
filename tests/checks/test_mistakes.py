"""A newcomer's mistakes in the Python API, each met with the right advice
before any step runs: Keras' habits in fit and evaluate, one-hot labels, a
generator for several epochs, a monitor the run never produces, float64
without 64-bit mode, a first batch the model fails on, and a CPU-only host."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import CLASSES, IN, make_data, make_model, params_of
from phalanx._checks._calls import call_mistake


class RecordSteps(px.Callback):
    """Records the steps it is told of."""

    def __init__(self):
        self.steps: list[int] = []

    @override
    def on_step_end(self, info):
        self.steps.append(info.step)


def trainer_of(**kwargs) -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), progress=False, **kwargs
    )


@pytest.fixture(scope="module")
def trainer() -> px.DataParallelTrainer:
    return trainer_of()


def batches() -> list:
    x, y = make_data(32)
    return [(x[:16], y[:16]), (x[16:], y[16:])]


# --- Keras' fit(x, y, batch_size=...) and its other keywords ------------------


@pytest.mark.parametrize(
    "keyword, value, advice",
    [
        ("batch_size", 128, "px.data.ArrayLoader((x, y), batch_size=128)"),
        ("validation_data", "pair", "eval_data=[(x_val, y_val)]"),
        ("validation_split", 0.2, "split the arrays yourself"),
        ("shuffle", True, "ArrayLoader((x, y), batch_size=64, shuffle=True)"),
        ("verbose", 0, "DataParallelTrainer(..., progress=False)"),
        ("x", "array", "batches go in `data`"),
        ("callbacks", [], "DataParallelTrainer(..., callbacks=[...])"),
        ("initial_epoch", 2, "resume='latest'"),
        ("steps_per_epoch", 10, "steps=N bounds the run's updates"),
        ("sample_weight", "array", "(x, y, sample_weight) triples"),
        ("class_weight", {0: 1.0}, "sample_weight hook"),
    ],
)
def test_a_keras_keyword_of_fit_gets_the_phalanx_way(trainer, keyword, value, advice):
    x, y = make_data(16)
    value = (
        {"pair": (x, y), "array": x}.get(value, value)
        if isinstance(value, str)
        else value
    )
    with pytest.raises(TypeError) as info:
        trainer.fit([(x, y)], **{keyword: value})
    message = str(info.value)
    assert message.startswith(f"fit() got {keyword}="), message
    assert advice in message, message
    assert int(trainer.state.step) == 0


def test_keras_fit_x_y_with_batch_size_gets_both_fixes(trainer):
    x, y = make_data(16)
    with pytest.raises(TypeError) as info:
        trainer.fit(x, y, batch_size=128, validation_split=0.1)  # pyright: ignore[reportCallIssue]
    lines = str(info.value).splitlines()
    assert lines[0] == "fit() was called as Keras' fit is; phalanx's way of each:"
    assert "2 positional arguments (ndarray[16, 5], ndarray[16])" in lines[1]
    assert "px.data.ArrayLoader((x, y), batch_size=64)" in lines[1]
    assert lines[2].startswith("- batch_size=128: the loader batches")
    assert lines[3].startswith("- validation_split=0.1: split the arrays yourself")


@pytest.mark.parametrize(
    "kwargs, advice",
    [
        ({"batch_size": 32}, "the loader batches"),
        ({"verbose": 2}, "progress=False"),
        ({"steps": 3}, "evaluate takes every batch of data"),
        ({"return_dict": True}, "evaluate returns a dict already"),
    ],
)
def test_a_keras_keyword_of_evaluate_gets_the_phalanx_way(trainer, kwargs, advice):
    with pytest.raises(TypeError, match=f"evaluate\\(\\) got .*{advice}"):
        trainer.evaluate(batches(), **kwargs)


def test_epochs_given_positionally_is_told_to_be_a_keyword(trainer):
    with pytest.raises(TypeError, match=r"fit takes data and the rest by keyword"):
        trainer.fit(batches(), 5)  # pyright: ignore[reportCallIssue]


def test_a_misspelt_keyword_gets_the_closest_name(trainer):
    with pytest.raises(TypeError, match=r"fit takes no epoch=; did you mean epochs="):
        trainer.fit(batches(), epoch=3)  # pyright: ignore[reportCallIssue]


# --- labels: one-hot, soft, or with a trailing axis ---------------------------


def one_hot(y: np.ndarray, dtype=np.float32) -> np.ndarray:
    return np.eye(CLASSES, dtype=dtype)[y]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_one_hot_labels_are_told_to_take_the_argmax(dtype):
    x, y = make_data(16)
    trainer = trainer_of()
    with pytest.raises(TypeError) as info:
        trainer.fit([(x, one_hot(y, dtype))])
    message = str(info.value)
    assert "one-hot or soft labels" in message, message
    assert "y.argmax(-1)" in message and "astype" not in message, message
    assert "loss='categorical_cross_entropy'" in message, message
    assert int(trainer.state.step) == 0
    trainer.fit([(x, one_hot(y, dtype).argmax(-1))])  # the advice, followed
    assert int(trainer.state.step) == 1


def test_labels_with_a_trailing_axis_of_one_are_told_to_reshape():
    x, y = make_data(16)
    with pytest.raises(TypeError, match=r"shape \(16, 1\).*y\.reshape\(-1\)"):
        trainer_of().fit([(x, y[:, None])])


def test_categorical_cross_entropy_trains_on_one_hot_labels_as_on_indices():
    x, y = make_data(32)
    hot = trainer_of(loss="categorical_cross_entropy")
    hot.fit([(x, one_hot(y))], epochs=2)
    indices = trainer_of()
    indices.fit([(x, y)], epochs=2)
    for a, b in zip(params_of(hot.model), params_of(indices.model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert hot.history["accuracy"] == indices.history["accuracy"]
    soft = np.full((32, CLASSES), 1 / CLASSES, np.float32)  # soft labels too
    logits = jax.vmap(hot.model)(x)
    assert hot.evaluate([(x, soft)])["loss"] == pytest.approx(
        float(jnp.mean(optax.softmax_cross_entropy(logits, soft))), rel=1e-5
    )


# --- a one-shot iterator read more than once ---------------------------------


def test_a_generator_for_several_epochs_is_refused_before_the_first_step():
    record = RecordSteps()
    trainer = trainer_of(callbacks=[record])
    before = params_of(trainer.model)
    with pytest.raises(ValueError) as info:
        trainer.fit((batch for batch in batches()), epochs=3)
    message = str(info.value)
    assert "data is a one-shot iterator (generator)" in message, message
    assert "epochs=3 makes 3 passes" in message and "ArrayLoader" in message
    assert record.steps == [] and int(trainer.state.step) == 0
    for a, b in zip(before, params_of(trainer.model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_generator_for_eval_data_evaluated_each_epoch_is_refused():
    trainer = trainer_of()
    with pytest.raises(ValueError, match=r"eval_data\['val'\] is a one-shot.*2 times"):
        trainer.fit(batches(), epochs=2, eval_data={"val": (b for b in batches())})
    assert int(trainer.state.step) == 0


def test_an_endless_generator_with_steps_trains():
    def endless():
        while True:
            yield from batches()

    trainer = trainer_of()
    trainer.fit(endless(), steps=3)
    assert int(trainer.state.step) == 3


# --- monitors checked against the metrics the run produces ---------------------


class OwnMetrics(px.DataParallelTrainer):
    """Reports accuracy from a `metrics` hook of its own: its names are known
    only once the first batch has been traced."""

    @override
    def metrics(self, outputs, targets):
        return {"accuracy": (jnp.argmax(outputs, -1) == targets).astype(jnp.float32)}


def refused_monitor(callback, *, own_metrics: bool = False, **fit_kwargs) -> str:
    """The message refusing `callback`'s monitor, checked to come before
    any step (with `own_metrics`, once the first batch is traced)."""
    record = RecordSteps()
    trainer = (OwnMetrics if own_metrics else px.DataParallelTrainer)(
        make_model(), optax.adam(1e-2), progress=False, callbacks=[record, callback]
    )
    with pytest.raises(ValueError) as info:
        trainer.fit(batches(), **fit_kwargs)
    assert record.steps == [] and int(trainer.state.step) == 0
    return str(info.value)


@pytest.mark.parametrize("own_metrics", [False, True])
@pytest.mark.parametrize("kind", ["checkpoint", "early-stopping"])
def test_a_named_set_monitor_with_one_unnamed_set_is_refused(
    tmp_path, kind, own_metrics
):
    callback = (
        px.callbacks.Checkpoint(tmp_path / "ckpt", monitor="eval_val_loss")
        if kind == "checkpoint"
        else px.callbacks.EarlyStopping("eval_val_loss")
    )
    message = refused_monitor(callback, own_metrics=own_metrics, eval_data=batches())
    assert "monitor='eval_val_loss') watches a metric this fit never" in message
    assert "loss, accuracy, eval_loss, eval_accuracy" in message, message
    assert "Did you mean 'eval_loss'?" in message, message
    assert "eval_data={'val': batches}" in message, message
    if not own_metrics:  # refused before fit starts: nothing written
        assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("own_metrics", [False, True])
def test_a_typo_under_eval_every_is_refused_with_the_closest_name(own_metrics):
    message = refused_monitor(
        px.callbacks.EarlyStopping("eval_val_lss"),
        own_metrics=own_metrics,
        eval_data={"val": batches(), "test": batches()},
        eval_every=1,
    )
    assert "the evaluations every 1 steps give eval_val_loss, " in message
    assert "Did you mean 'eval_val_loss'?" in message, message


def test_a_typo_of_a_training_metric_is_refused():
    message = refused_monitor(px.callbacks.EarlyStopping("acuracy"))
    assert "this fit's epochs give loss, accuracy." in message, message
    assert "Did you mean 'accuracy'?" in message, message


def test_metrics_callbacks_add_are_produced_when_they_come_first():
    schedule = optax.constant_schedule(1e-2)
    message = refused_monitor(px.callbacks.EarlyStopping("lr"))
    assert "LearningRateMonitor's 'lr'" in message, message
    stopper = px.callbacks.EarlyStopping("lr", patience=5)
    trainer = trainer_of(
        callbacks=[px.callbacks.LearningRateMonitor(schedule), stopper]
    )
    trainer.fit(batches(), epochs=1)
    assert stopper.best == pytest.approx(1e-2)


def test_skipped_steps_is_a_metric_under_nan_policy_skip():
    stopper = px.callbacks.EarlyStopping("skipped_steps", patience=5)
    trainer = trainer_of(callbacks=[stopper], nan_policy="skip")
    trainer.fit(batches(), epochs=1)
    assert stopper.best == 0.0


# --- precision, first-batch hints ---------------------------------------------


def test_float64_without_x64_names_jax_enable_x64():
    assert not jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(ValueError) as info:
        px.Precision(params=jnp.float64)
    message = str(info.value)
    assert "Precision(params=" in message and "computes in float32" in message
    assert "jax.config.update('jax_enable_x64', True)" in message, message


class Tokens(eqx.Module):
    """Token ids into an embedding, then a layer of the wrong width."""

    embedding: eqx.nn.Embedding
    head: eqx.nn.Linear

    def __init__(self, key):
        a, b = jax.random.split(key)
        self.embedding = eqx.nn.Embedding(20, 4, key=a)
        self.head = eqx.nn.Linear(7, CLASSES, key=b)  # 4 * IN values come in

    def __call__(self, ids):
        return self.head(jax.vmap(self.embedding)(ids).reshape(-1))


def test_token_ids_failing_for_another_reason_get_no_cast_advice():
    ids = np.random.default_rng(0).integers(0, 20, (16, IN)).astype(np.int32)
    _, y = make_data(16)
    trainer = px.DataParallelTrainer(
        Tokens(jax.random.key(0)), optax.adam(1e-2), progress=False
    )
    with pytest.raises((TypeError, ValueError)) as info:
        trainer.fit([(ids, y)])
    message = str(info.value)
    first, _, hint = message.partition("\nHint: ")
    assert first.startswith("data: the first batch"), message
    assert "does not fit the model and loss: " in first, message
    assert "cast" not in message and "astype" not in message, message
    assert hint.startswith("the model fails on x"), message


# --- a hook's call that does not fit the signature of what it calls ----------


class NClasses(px.DataParallelTrainer):
    @override
    def metrics(self, outputs, targets):
        f1 = px.metrics.f1(outputs, targets, nclasses=CLASSES)  # pyright: ignore[reportCallIssue]
        return {"f1": f1}


class F1WithoutTargets(px.DataParallelTrainer):
    @override
    def metrics(self, outputs, targets):
        return {"f1": px.metrics.f1(outputs)}  # pyright: ignore[reportCallIssue]


class Axes(px.DataParallelTrainer):
    @override
    def metrics(self, outputs, targets):
        labels = jnp.argmax(outputs, axes=-1)  # pyright: ignore[reportCallIssue]
        return {"hit": (labels == targets).astype(jnp.float32)}


class NoTargets(px.DataParallelTrainer):
    @override
    def metrics(self, outputs):  # pyright: ignore[reportIncompatibleMethodOverride]
        return {}


F1 = (
    "px.metrics.f1 takes (outputs, targets, *, num_classes=None, "
    "average='macro', zero_division=0.0, from_logits=True): fix the call in "
    "metrics() (the batch is not at fault)"
)
CALLS = {
    "an unexpected keyword of px.metrics.f1": (
        NClasses,
        "the metrics hook called px.metrics.f1 with an argument it does not "
        "take: f1() got an unexpected keyword argument 'nclasses' (did you mean "
        f"num_classes?); {F1}",
    ),
    "px.metrics.f1 without targets": (
        F1WithoutTargets,
        "the metrics hook called px.metrics.f1 without an argument it "
        "requires: f1() missing 1 required positional argument: 'targets'; "
        f"{F1}",
    ),
    "an unexpected keyword of a jax function": (
        Axes,
        "the metrics hook called argmax() with an argument it does not take: "
        "argmax() got an unexpected keyword argument 'axes': fix the call in "
        "metrics() (the batch is not at fault)",
    ),
    "a hook without targets": (
        NoTargets,
        "the metrics hook cannot be called as metrics(outputs, targets): "
        "NoTargets.metrics() takes 2 positional arguments but 3 were given; "
        "give it that signature (as a method: def metrics(self, outputs, "
        "targets))",
    ),
}


@pytest.mark.parametrize("case", list(CALLS))
def test_a_call_mistake_in_the_metrics_hook_is_the_hooks(case):
    """Not the batch's: no first-batch hint to fix the targets."""
    cls, expected = CALLS[case]
    x, y = make_data(16)
    trainer = cls(make_model(), optax.adam(1e-2), progress=False)
    with pytest.raises(TypeError) as info:
        trainer.fit([(x, y)])
    assert str(info.value) == expected


def test_a_look_alike_message_from_inside_a_function_is_not_a_call_mistake():
    """A TypeError that reads like Python's but is raised inside the callee
    (its own check of its arguments) is left as it was."""

    def picky(outputs, targets):
        raise TypeError("picky() got an unexpected keyword argument 'mode'")

    try:
        picky(None, None)
    except TypeError as error:
        assert call_mistake(error, "metrics") is None
    with pytest.raises(TypeError) as info:  # a subclass (jaxtyping's check)
        raise type("TypeCheckError", (TypeError,), {})(
            "f1() missing 1 required positional argument: 'targets'"
        )
    assert call_mistake(info.value, "metrics") is None


# --- a CPU-only host, where JAX sees one device --------------------------------

_FIT_TWICE = """
import sys
import numpy as np, optax, jax
import phalanx as px
if sys.argv[1] != "none":
    px.fake_cpu_devices(int(sys.argv[1]))
x = np.zeros((8, 3), np.float32); y = np.zeros(8, np.int32)
trainer = px.DataParallelTrainer(
    px.models.Linear(3, 2, key=jax.random.key(0)), optax.sgd(0.1), progress=False
)
trainer.fit([(x, y)])
trainer.fit([(x, y)])
"""


@pytest.mark.slow
def test_a_cpu_only_host_is_told_once_how_to_fake_more_devices():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    script = textwrap.dedent(_FIT_TWICE)
    runs = {
        devices: subprocess.Popen(
            [sys.executable, "-c", script, devices],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for devices in ("none", "2")
    }
    stderr = {}
    for devices, run in runs.items():
        _, stderr[devices] = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[devices]
    lines = [line for line in stderr["none"].splitlines() if "CPU device" in line]
    assert len(lines) == 1, stderr["none"]
    assert lines[0].startswith("phalanx: training on 1 CPU device"), lines
    assert "px.fake_cpu_devices(8)" in lines[0], lines
    assert "CPU device" not in stderr["2"]
