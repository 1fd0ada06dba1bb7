"""`px.callbacks.ReduceLROnPlateau`: the rate lowered after `patience`
values without improvement, used by the next updates, resumed exactly."""

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
BATCH = make_data(16)


class Scripted(px.Callback):
    """Adds ``score`` to each epoch's metrics, from `SCORES`."""

    @override
    def added_metrics(self) -> tuple[str, ...]:
        return ("score",)

    @override
    def on_epoch_end(self, info: px.StepInfo) -> None:
        info.metrics["score"] = float(SCORES[info.epoch])


def plateau() -> px.callbacks.ReduceLROnPlateau:
    return px.callbacks.ReduceLROnPlateau(
        "score", factor=0.5, patience=2, cooldown=1, min_lr=0.02
    )


def trainer(callbacks) -> px.DataParallelTrainer:
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    return px.DataParallelTrainer(make_model(), tx, callbacks=callbacks, progress=False)


def test_the_rate_falls_after_patience_values_without_improvement():
    callback = plateau()
    fitted = trainer([Scripted(), callback])
    fitted.fit([BATCH], epochs=len(SCORES))
    assert fitted.history["lr"] == pytest.approx(RATES, rel=1e-6)
    assert callback.reductions == 3
    # The next update uses the rate: sgd moves by rate × gradient.
    values = fitted.compute_step(BATCH)
    for new, old, grad in zip(
        host_arrays(values.state.model),
        host_arrays(fitted.model),
        host_arrays(values.grads),
        strict=True,
    ):
        np.testing.assert_allclose(new, old - 0.02 * grad, rtol=0, atol=1e-7)


def test_a_resumed_run_goes_on_at_the_same_rate(tmp_path):
    straight = trainer([Scripted(), plateau()])
    straight.fit([BATCH], epochs=len(SCORES))
    checkpoint = px.callbacks.Checkpoint(tmp_path)
    first = trainer([Scripted(), plateau(), checkpoint])
    first.fit([BATCH], epochs=9)  # stopped mid-cooldown, after a reduction
    resumed = trainer([Scripted(), plateau(), px.callbacks.Checkpoint(tmp_path)])
    resumed.fit([BATCH], epochs=len(SCORES), resume="latest")
    assert resumed.history["lr"] == straight.history["lr"]
    for a, b in zip(
        host_arrays(resumed.state), host_arrays(straight.state), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_an_optimizer_without_the_rate_in_its_state_is_refused_before_a_step():
    fitted = px.DataParallelTrainer(
        make_model(), optax.sgd(0.1), callbacks=[Scripted(), plateau()], progress=False
    )
    with pytest.raises(TypeError, match=r"optax\.inject_hyperparams\(optax\.adam\)"):
        fitted.fit([BATCH], epochs=1)
    assert int(fitted.state.step) == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"factor": 1.0}, ValueError, r"factor=1\.0 must be a number in \(0, 1\)"),
        ({"patience": 0}, ValueError, r"patience=0"),
        ({"cooldown": -1}, ValueError, r"cooldown=-1"),
        ({"min_lr": -1.0}, ValueError, r"min_lr=-1\.0"),
        ({"mode": "up"}, ValueError, r"mode='up'"),
        ({"hyperparam": ""}, TypeError, r"hyperparam='' must be a non-empty str"),
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
