"""Several optimizers in one step (``optimizer={group: transformation}`` and
the `param_groups` hook): each group's update is a hand-written loop's under
every strategy, with its own loss or the shared one; and the mistakes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import StopAt, make_strategy


RNG = np.random.default_rng(4)
NOISE = RNG.normal(size=(52, 3)).astype(np.float32)  # a ragged last batch of 4
REAL = RNG.normal(loc=1.0, size=(52, 2)).astype(np.float32)
BATCHES = [(NOISE[i : i + 16], REAL[i : i + 16]) for i in range(0, 52, 16)]
STEPS = 6


class Pair(eqx.Module):
    generator: eqx.nn.MLP
    critic: eqx.nn.MLP

    def __init__(self, key):
        g, c = jax.random.split(key)
        self.generator = eqx.nn.MLP(3, 2, 8, 1, key=g)
        self.critic = eqx.nn.MLP(2, "scalar", 8, 1, key=c)

    def __call__(self, noise):
        return self.generator(noise)


def group_losses(model, outputs, targets):
    fake = jax.vmap(model.critic)(outputs)
    real = jax.vmap(model.critic)(targets)
    return {
        "generator": jax.nn.softplus(-fake),
        "critic": jax.nn.softplus(-real) + jax.nn.softplus(fake),
    }


def shared_loss(model, outputs, targets):
    return (
        jnp.sum((outputs - targets) ** 2, axis=-1)
        + 0.1 * jax.vmap(model.critic)(outputs) ** 2
    )


def labels(model):
    return eqx.tree_at(
        lambda m: (m.generator, m.critic), model, ("generator", "critic")
    )


def optimizers():
    return {"generator": optax.adam(1e-2), "critic": optax.sgd(5e-2, momentum=0.9)}


class PairTrainer(px.DataParallelTrainer[Pair]):
    def __init__(self, *args, loss_of=group_losses, **kwargs):
        self.loss_of = loss_of
        super().__init__(*args, **kwargs)

    @override
    def param_groups(self, model):
        return labels(model)

    @override
    def loss(self, model, outputs, targets):
        return self.loss_of(model, outputs, targets)

    @override
    def metrics(self, outputs, targets):
        return {}


def by_hand(loss_of, steps: int) -> list[np.ndarray]:
    """Two optax optimizers, each on its group's loss over the whole batch
    (a loss of one array: both on it), the other group held fixed."""
    model = Pair(jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    rest = eqx.filter(model, eqx.is_inexact_array, inverse=True)
    parts = {"generator": lambda m: m.generator, "critic": lambda m: m.critic}
    opts = optimizers()
    states = {name: opts[name].init(part(params)) for name, part in parts.items()}

    def mean_loss(params, name, noise, real):
        m = eqx.combine(params, rest)
        losses = loss_of(m, jax.vmap(m)(noise), real)
        return jnp.mean(losses[name] if isinstance(losses, dict) else losses)

    # Jitted: op by op, each operation compiles on its own (~30 s here).
    grad = jax.jit(jax.grad(mean_loss), static_argnums=1)
    for step in range(steps):
        noise, real = BATCHES[step % len(BATCHES)]
        new = params
        for name, part in parts.items():
            grads = grad(params, name, noise, real)
            updates, states[name] = opts[name].update(
                part(grads), states[name], part(params)
            )
            new = eqx.tree_at(part, new, optax.apply_updates(part(params), updates))
        params = new
    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.fixture(scope="module", params=["own", "shared"])
def case(request):
    loss_of = group_losses if request.param == "own" else shared_loss
    return loss_of, by_hand(loss_of, STEPS)


@pytest.mark.parametrize(
    ("kind", "steps_per_call"),
    [("sharding", 1), ("pmap", 1), ("fsdp", 1), ("pmap+acc2", 1), ("mesh", 1),
     ("sharding", 3)],
)  # fmt: skip
def test_each_group_is_updated_as_by_hand(case, kind, steps_per_call):
    loss_of, want = case
    trainer = PairTrainer(
        Pair(jax.random.key(0)),
        optimizers(),
        loss_of=loss_of,
        strategy=make_strategy(kind, 8),
        steps_per_call=steps_per_call,
        progress=False,
    )
    trainer.fit(BATCHES, steps=STEPS)
    got = jax.tree.leaves(eqx.filter(trainer.model, eqx.is_inexact_array))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=1e-5)
    if loss_of is group_losses:
        last = trainer.history[-1]
        assert last["loss"] == pytest.approx(
            last["generator_loss"] + last["critic_loss"], rel=1e-6
        )


def test_assert_equivalent_and_a_bitwise_resume(tmp_path):
    def make(strategy):
        return PairTrainer(
            Pair(jax.random.key(0)), optimizers(), strategy=strategy, progress=False
        )

    px.testing.assert_equivalent(make, BATCHES, steps=3)

    straight = make(px.ShardingStrategy(8))
    straight.fit(BATCHES, steps=STEPS)
    # Resumed at step 3, the run starts on the pass's short last batch (4
    # examples), padded to the pass's 16 rows as the straight run pads it.
    saving = px.callbacks.Checkpoint(tmp_path, every_n_steps=3, every_n_epochs=None)

    first = make(px.ShardingStrategy(8))
    first.callbacks = [saving, StopAt(3)]
    first.fit(BATCHES, steps=STEPS)
    resumed = make(px.ShardingStrategy(8))
    resumed.fit(BATCHES, steps=STEPS, resume=tmp_path)
    for a, b in zip(
        jax.tree.leaves(eqx.filter(resumed.state, eqx.is_inexact_array)),
        jax.tree.leaves(eqx.filter(straight.state, eqx.is_inexact_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_under_bf16_and_a_nan_policy_it_trains():
    trainer = PairTrainer(
        Pair(jax.random.key(0)),
        optimizers(),
        precision="bf16",
        nan_policy="skip",
        progress=False,
    )
    trainer.fit(BATCHES, epochs=2)
    assert np.isfinite(trainer.history[-1]["critic_loss"])


class Plain(px.DataParallelTrainer[Pair]):
    @override
    def loss(self, model, outputs, targets):
        return group_losses(model, outputs, targets)

    @override
    def metrics(self, outputs, targets):
        return {}


@pytest.mark.parametrize(
    ("labels_of", "error"),
    [
        (None, r"optimizer is a mapping of parameter groups \['generator', 'critic'\]; "
         r"override param_groups"),
        (lambda m: eqx.tree_at(lambda m: m.generator, m, "generator"),
         r"param_groups left the parameter model\.critic\.layers\[0\]\.weight in no "
         "group"),
        (lambda m: eqx.tree_at(lambda m: (m.generator, m.critic), m, ("g", "d")),
         r"a group 'g', which the optimizer mapping lacks"),
        (lambda m: jax.tree.map(lambda _: "generator", m),
         r"param_groups gave group 'critic' no parameters"),
    ],
)  # fmt: skip
def test_group_mistakes_are_named_when_the_trainer_is_built(labels_of, error):
    class Labelled(Plain):
        @override
        def param_groups(self, model):
            return None if labels_of is None else labels_of(model)

    with pytest.raises(ValueError, match=error):
        Labelled(Pair(jax.random.key(0)), optimizers())


def test_a_loss_by_group_needs_groups_and_their_names():
    one = Plain(Pair(jax.random.key(0)), optax.adam(1e-3), progress=False)
    with pytest.raises(TypeError, match=r"loss returned a dict of \['critic', "
                       r"'generator'\]: a loss per parameter group, but the "
                       "optimizer is one transformation"):  # fmt: skip
        one.fit(BATCHES, epochs=1)

    class Other(PairTrainer):
        @override
        def loss(self, model, outputs, targets):
            losses = group_losses(model, outputs, targets)
            return {"generator": losses["generator"], "d": losses["critic"]}

    other = Other(Pair(jax.random.key(0)), optimizers(), progress=False)
    with pytest.raises(ValueError, match=r"loss returned losses for \['d', "
                       r"'generator'\], but the optimizer's groups are"):  # fmt: skip
        other.fit(BATCHES, epochs=1)
