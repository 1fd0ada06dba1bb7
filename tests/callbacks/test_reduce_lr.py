"""`px.callbacks.ReduceLROnPlateau`: the rate lowered after `patience`
values without improvement, through the run's rate multiplier, on a plain
optimizer, an injected rate and a schedule alike: the next update changes by
the factor, the logged rate is the one used, and a resume goes on exactly."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import host_arrays, make_data, make_model


# One value per epoch; the rates ReduceLROnPlateau(factor=0.5, patience=2,
# cooldown=1, min_lr=0.02) reports after each, from 0.1: reduced after two
# values without improvement (epochs 3 and 8), the value after a reduction
# not counted, a new best (epoch 6) starting the count again, and never
# below min_lr (epoch 11: 0.0125 -> 0.02, then no more).
SCORES = [5, 4, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 3, 3, 3]
RATES = [0.1] * 3 + [0.05] * 5 + [0.025] * 3 + [0.02] * 4
# The multiplier after each epoch (one batch an epoch, so epoch = step - 1).
SCALES = [1.0] * 3 + [0.5] * 5 + [0.25] * 3
BATCH = make_data(16)
# A warmup from 0 to 0.1 over 3 steps, then a cosine decay over 30.
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 30)
# SGD without momentum, so that an update is -rate x gradient: three ways
# to give it its rate.
OPTIMIZERS = {
    "plain": lambda: optax.sgd(0.1),
    "injected": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    "schedule": lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE),
}


def base_rate(kind: str, step: int) -> float:
    """The optimizer's own rate for the update after `step` updates."""
    return float(np.asarray(SCHEDULE(step))) if kind == "schedule" else 0.1


class Scripted(px.Callback):
    """Adds ``score`` to each epoch's metrics, from `SCORES`."""

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return ("score",)

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        info.metrics["score"] = float(SCORES[info.epoch])


def plateau(**kwargs) -> px.callbacks.ReduceLROnPlateau:
    return px.callbacks.ReduceLROnPlateau(
        "score", **{"factor": 0.5, "patience": 2, "cooldown": 1, **kwargs}
    )


def trainer(callbacks, kind: str = "injected") -> px.DataParallelTrainer:
    return px.DataParallelTrainer(
        make_model(), OPTIMIZERS[kind](), callbacks=callbacks, progress=False
    )


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_a_reduction_scales_the_rate_used_and_a_resume_goes_on_exactly(tmp_path, kind):
    callback = plateau(min_lr=0.02)
    straight = trainer([Scripted(), callback], kind)
    straight.fit([BATCH], epochs=len(SCORES))
    # The rate after each epoch is the next update's: the optimizer's own (a
    # schedule's at that step) times the multiplier.
    expected = [base_rate(kind, e + 1) * s for e, s in enumerate(SCALES)]
    assert straight.history["lr"][:11] == pytest.approx(expected, rel=1e-6)
    if kind != "schedule":  # and never below min_lr: 0.0125 -> 0.02, no more
        assert straight.history["lr"] == pytest.approx(RATES, rel=1e-6)
        assert callback.reductions == 3

    first = trainer(
        [Scripted(), plateau(min_lr=0.02), px.callbacks.Checkpoint(tmp_path)], kind
    )
    first.fit([BATCH], epochs=9)  # stopped mid-cooldown, after a reduction
    assert float(first.state.lr_scale) == 0.25
    # The reduction (0.5 -> 0.25) halves the next update: the same state
    # with the multiplier it had before moves twice as far, and each update
    # is -(the logged rate) x gradient, to the rounding of the parameters.
    reduced = first.compute_step(BATCH)
    first.state = dataclasses.replace(
        first.state, lr_scale=jnp.asarray(0.5, jnp.float32)
    )
    before = first.compute_step(BATCH)
    rate = first.history["lr"][-1]
    assert rate == pytest.approx(0.25 * base_rate(kind, 9), rel=1e-6) and rate > 0
    for old, new, unreduced, grad in zip(
        host_arrays(first.model),
        host_arrays(reduced.state.model),
        host_arrays(before.state.model),
        host_arrays(reduced.grads),
        strict=True,
    ):
        ulps = 2 * np.spacing(np.abs(old).max())
        np.testing.assert_allclose(new - old, 0.5 * (unreduced - old), atol=ulps)
        np.testing.assert_allclose(new - old, -rate * grad, atol=ulps)

    # Resumed from the checkpoint of epoch 9: the multiplier, the callback's
    # counters, and so every later update and logged rate, as if never
    # stopped.
    again = plateau(min_lr=0.02)
    resumed = trainer([Scripted(), again, px.callbacks.Checkpoint(tmp_path)], kind)
    resumed.fit([BATCH], epochs=len(SCORES), resume="latest")
    assert resumed.history["lr"] == straight.history["lr"]
    assert again.state_dict() == callback.state_dict()
    for a, b in zip(
        host_arrays(resumed.state), host_arrays(straight.state), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_learning_rate_monitor_logs_the_rate_used():
    # The schedule given to it, or the optimizer's rate read, times the
    # multiplier: after each reduction, the rate the plateau logs.
    fitted = trainer(
        [
            Scripted(),
            plateau(),
            px.callbacks.LearningRateMonitor(SCHEDULE, name="given"),
            px.callbacks.LearningRateMonitor(name="read"),
        ],
        "schedule",
    )
    fitted.fit([BATCH], epochs=11)
    assert fitted.history["given"] == pytest.approx(fitted.history["lr"], rel=1e-6)
    assert fitted.history["read"] == pytest.approx(fitted.history["lr"], rel=1e-6)
    expected = [base_rate("schedule", e + 1) * s for e, s in enumerate(SCALES)]
    assert fitted.history["read"] == pytest.approx(expected, rel=1e-6)


def test_a_transform_after_the_rate_is_said_once_and_the_multiplier_logged(capsys):
    # Clipping after the rate: the update is not proportional to it. The
    # callback still scales the final update, and logs the multiplier.
    tx = optax.chain(optax.sgd(0.1), optax.clip(1.0))
    monitor = px.callbacks.LearningRateMonitor(name="monitored")
    fitted = px.DataParallelTrainer(
        make_model(),
        tx,
        callbacks=[Scripted(), plateau(min_lr=0.3), monitor],
        progress=False,
    )
    fitted.fit([BATCH], epochs=11)
    assert fitted.history["monitored"] == fitted.history["lr"]
    err = capsys.readouterr().err
    assert err.count("phalanx:") == 2, err  # once for each callback
    assert (
        "LearningRateMonitor: phalanx cannot read the optimizer's learning rate: "
        "its update ends with clip, " in err
    )
    assert (
        "ReduceLROnPlateau: phalanx cannot read the optimizer's learning rate: "
        "its update ends with clip, not with its learning rate" in err
    )
    assert (
        "'lr' logs that multiplier instead of the rate, and min_lr=0.3 bounds it" in err
    )
    # Bounded by min_lr as a multiplier: 1, 0.5, then 0.3 (not 0.25).
    assert fitted.history["lr"] == pytest.approx(
        [1.0] * 3 + [0.5] * 5 + [0.3] * 3, rel=1e-6
    )
    fitted.fit([BATCH], epochs=1)  # said once: not again at the next fit
    assert "phalanx:" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"factor": 1.0}, ValueError, r"factor=1\.0 must be a number in \(0, 1\)"),
        ({"patience": 0}, ValueError, r"patience=0"),
        ({"cooldown": -1}, ValueError, r"cooldown=-1"),
        ({"min_lr": -1.0}, ValueError, r"min_lr=-1\.0"),
        ({"mode": "up"}, ValueError, r"mode='up'"),
        ({"name": ""}, TypeError, r"name='' must be a non-empty str"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs, error, match):
    with pytest.raises(error, match=match):
        px.callbacks.ReduceLROnPlateau("eval_loss", **kwargs)


def test_its_monitor_is_checked_before_the_fit():
    # "scor" is no metric of this run: refused before the first step.
    fitted = trainer([Scripted(), px.callbacks.ReduceLROnPlateau("scor")])
    with pytest.raises(ValueError, match=r"Did you mean 'score'\?"):
        fitted.fit([BATCH], epochs=1)
    assert int(fitted.state.step) == 0
