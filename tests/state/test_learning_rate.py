"""Reading the learning rate of an optimizer's next update from the optimizer
and its state (`phalanx._state._learning_rate.next_rate`): the rate
`ReduceLROnPlateau` and `LearningRateMonitor` log and `find_lr` divides by.
Read exactly where optax's construction ends with the rate; unknown, with
why, wherever it does not."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px
from helpers import make_model
from phalanx._state._learning_rate import next_rate


PARAMS = {"a": jnp.ones(3), "b": jnp.ones((2, 2))}
GRADS = {"a": jnp.full(3, 0.5), "b": jnp.full((2, 2), -0.5)}
WARMUP_COSINE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50)


def rates(tx: optax.GradientTransformation, updates: int = 3) -> list[float | None]:
    """The rate read before each of `updates` updates and after the last."""
    state = tx.init(PARAMS)
    found = [next_rate(tx, state).value]
    for _ in range(updates):
        _, state = tx.update(GRADS, state, PARAMS)
        found.append(next_rate(tx, state).value)
    return found


@pytest.mark.parametrize(
    ("tx", "rate"),
    [
        (optax.adam(1e-3), 1e-3),
        (optax.adamw(2e-3, weight_decay=1e-2), 2e-3),
        (optax.sgd(0.1, momentum=0.9), 0.1),
        (optax.sgd(1.0), 1.0),  # a chain of scales only: their product
        (optax.inject_hyperparams(optax.adam)(learning_rate=3e-3), 3e-3),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(4e-3)), 4e-3),
        (optax.apply_if_finite(optax.adam(5e-3), 3), 5e-3),
        (optax.lion(1e-4), 1e-4),
        (optax.adafactor(1e-2, multiply_by_parameter_scale=False), 1e-2),
    ],
    ids=lambda x: "" if isinstance(x, float) else None,
)
def test_optax_optimizers_ending_with_their_rate(tx, rate):
    assert rates(tx) == pytest.approx([rate] * 4, rel=1e-6)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(WARMUP_COSINE),
        optax.inject_hyperparams(optax.adam)(learning_rate=WARMUP_COSINE),
        optax.inject_hyperparams(optax.adamw)(learning_rate=WARMUP_COSINE),
    ],
    ids=["schedule", "injected-schedule", "injected-adamw"],
)
def test_a_schedule_is_read_at_the_next_update(tx):
    # optax counts updates from 0: the rate before update n is schedule(n).
    expected = [float(np.asarray(WARMUP_COSINE(n))) for n in range(4)]
    assert expected[0] == 0.0
    assert rates(tx) == pytest.approx(expected, rel=1e-6)


def test_several_groups_read_as_the_first_with_a_rate():
    # The groups' optimizers as one optax.multi_transform, as the trainer
    # builds it: the first group in the mapping's order with a rate.
    class Split(px.DataParallelTrainer):
        def param_groups(self, model):
            return eqx.tree_at(
                lambda m: (m.layers[0], m.layers[1]), model, ("body", "head")
            )

    def read(groups):
        trainer = Split(make_model(), groups, progress=False)
        return next_rate(trainer.optimizer, trainer.state.opt_state)

    assert read({"body": optax.adam(1e-3), "head": optax.sgd(0.1)}).value == 1e-3
    assert read({"head": optax.sgd(0.1), "body": optax.adam(1e-3)}).value == 0.1
    frozen = read({"body": optax.set_to_zero(), "head": optax.sgd(0.1)})
    assert frozen.value == 0.1  # a frozen group has no rate
    clipped = optax.chain(optax.adam(1e-3), optax.clip(1.0))
    unknown = read({"body": optax.sgd(0.1), "head": clipped})
    assert unknown.value is None
    assert unknown.why.startswith("group 'head': its update ends with clip, ")


class _Halve(optax.GradientTransformation):
    """An optimizer of one's own: nothing phalanx can read."""

    def __new__(cls):
        return super().__new__(
            cls,
            lambda params: optax.EmptyState(),
            lambda updates, state, params=None: (
                jax.tree.map(lambda u: -0.5 * u, updates),
                state,
            ),
        )


class _Callable:
    """An update function that is an object, not a function."""

    def __call__(self, updates, state, params=None):
        return updates, state


@pytest.mark.parametrize(
    ("tx", "why"),
    [
        (
            optax.chain(optax.adam(1e-3), optax.clip_by_global_norm(1.0)),
            "its update ends with clip_by_global_norm, not with its learning "
            "rate (optax.scale_by_learning_rate, the last transform of optax's "
            "optimizers), so the update need not be proportional to the rate",
        ),
        # Momentum after the rate: the multiplier would scale the whole
        # momentum buffer, not the rate of the next gradient.
        (optax.rmsprop(1e-3, momentum=0.9), "its update ends with trace, "),
        (optax.lars(1e-3), "its update ends with trace, "),
        # adafactor's last link flips the sign after scaling by the
        # parameters' size: a flip and a rate of 1 look alike.
        (
            optax.adafactor(1e-2),
            "its update ends with optax.scale(-1) after scale_by_param_block_rms: "
            "a sign flip (as in optax.adafactor) or a rate of 1, which phalanx "
            "cannot tell apart",
        ),
        (
            optax.MultiSteps(optax.adam(1e-3), 2).gradient_transformation(),
            "its update ends with MultiSteps.update, ",
        ),
        (_Halve(), "its update ends with _Halve."),
        (
            optax.GradientTransformation(
                lambda params: optax.EmptyState(), _Callable()
            ),
            "its update ends with _Callable, not with its learning rate",
        ),
        (optax.scale(2.0), "its update ends by multiplying by 2, not by minus a "),
    ],
    ids=[
        "clip-after",
        "rmsprop-momentum",
        "lars",
        "adafactor",
        "multisteps",
        "own",
        "object",
        "ascent",
    ],
)
def test_anything_else_is_unknown_with_why(tx, why):
    state = tx.init(PARAMS)
    found = next_rate(tx, state)
    assert found.value is None
    assert found.why.startswith(why), found.why
