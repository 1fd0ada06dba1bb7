"""`px.models.Stacked`: layers stored stacked, applied with `jax.lax.scan`."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import phalanx as px


def block(key) -> eqx.nn.MLP:
    return eqx.nn.MLP(8, 8, 16, 1, key=key)


class Noisy(eqx.Module):
    """A layer with dropout: it takes a key."""

    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(8, 8, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.dropout(self.linear(x), key=key, inference=key is None)


def test_the_layers_run_in_order():
    stacked = px.models.Stacked(block, 3, key=jax.random.key(0))
    assert stacked.layers.layers[0].weight.shape == (3, 16, 8)
    params, static = eqx.partition(stacked.layers, eqx.is_array)
    x = jnp.arange(8.0)
    expected = x
    for i in range(3):
        layer = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
        expected = layer(expected)
    np.testing.assert_allclose(stacked(x), expected, rtol=1e-6)
    # Built from the keys jr.split(key, 3) gives, one layer each.
    keys = jax.random.split(jax.random.key(0), 3)
    first = block(keys[0])
    np.testing.assert_array_equal(params.layers[0].weight[0], first.layers[0].weight)


@pytest.mark.parametrize(
    "options",
    [
        {"remat": True},
        {"remat": jax.checkpoint_policies.dots_saveable},
        {"unroll": True},
        {"unroll": 2, "remat": True},
    ],
    ids=["remat", "remat-policy", "unrolled", "unrolled-by-2-remat"],
)
def test_remat_and_unrolling_change_no_gradient(options):
    plain = px.models.Stacked(block, 4, key=jax.random.key(1))
    again = px.models.Stacked(block, 4, key=jax.random.key(1), **options)

    def loss(model):
        return jnp.sum(model(jnp.linspace(-1, 1, 8)) ** 2)

    grad = eqx.filter_jit(eqx.filter_grad(loss))  # not op by op: ~10x faster
    want, have = grad(plain), grad(again)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(have), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_each_layer_gets_its_own_key_and_none_at_inference():
    stacked = px.models.Stacked(Noisy, 2, key=jax.random.key(2))
    x = jnp.ones(8)
    once = stacked(x, key=jax.random.key(3))
    np.testing.assert_array_equal(once, stacked(x, key=jax.random.key(3)))
    assert not np.array_equal(once, stacked(x, key=jax.random.key(4)))
    # Without a key every layer runs without dropout.
    params, static = eqx.partition(stacked.layers, eqx.is_array)
    expected = x
    for i in range(2):
        layer = eqx.combine(jax.tree.map(lambda a, i=i: a[i], params), static)
        expected = layer(expected)
    np.testing.assert_allclose(stacked(x), expected, rtol=1e-6)


def test_dropout_layers_train_with_steps_per_call():
    class Net(eqx.Module):
        blocks: px.models.Stacked
        head: eqx.nn.Linear

        def __init__(self, key):
            one, two = jax.random.split(key)
            self.blocks = px.models.Stacked(Noisy, 2, key=one, remat=True)
            self.head = eqx.nn.Linear(8, 3, key=two)

        def __call__(self, x, *, key=None):
            return self.head(self.blocks(x, key=key))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)
    batches = [(x[:32], y[:32]), (x[32:], y[32:])]
    trained = []
    for steps_per_call in (1, 2):
        trainer = px.DataParallelTrainer(
            Net(jax.random.key(0)),
            optax.adam(1e-2),
            steps_per_call=steps_per_call,
            progress=False,
        )
        trainer.fit(batches, epochs=4)
        trained.append(trainer)
    # The same dropout masks, whether steps run one by one or two at a time.
    for a, b in zip(
        jax.tree.leaves(eqx.filter(trained[0].model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(trained[1].model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    history = trained[0].history
    assert history[-1]["loss"] < history[0]["loss"]


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match=r"n=0 must be an int >= 1"):
        px.models.Stacked(block, 0, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"remat='all' must be a bool or a jax"):
        px.models.Stacked(block, 2, key=jax.random.key(0), remat="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"unroll=0 must be True, False or an int"):
        px.models.Stacked(block, 2, key=jax.random.key(0), unroll=0)


class KeywordKey(eqx.Module):
    """A layer whose constructor takes its key by name only, as Equinox's."""

    linear: eqx.nn.Linear

    def __init__(self, *, key):
        self.linear = eqx.nn.Linear(8, 8, key=key)

    def __call__(self, x):
        return self.linear(x)


def test_make_layer_may_take_its_key_by_name_as_equinox_layers_do():
    key = jax.random.key(0)
    by_position = px.models.Stacked(lambda k: eqx.nn.Linear(8, 8, key=k), 2, key=key)
    for make in (
        functools.partial(eqx.nn.Linear, 8, 8),  # Equinox's keyword-only key
        lambda *, key: eqx.nn.Linear(8, 8, key=key),
        lambda key: eqx.nn.Linear(8, 8, key=key),
    ):
        stacked = px.models.Stacked(make, 2, key=key)
        np.testing.assert_array_equal(stacked.layers.weight, by_position.layers.weight)
    # A class: its __init__'s key by name.
    assert px.models.Stacked(KeywordKey, 3, key=key).layers.linear.weight.shape == (
        3,
        8,
        8,
    )


def test_a_make_layer_that_takes_no_key_is_refused_with_the_fix():
    with pytest.raises(TypeError) as error:
        px.models.Stacked(
            lambda: eqx.nn.Identity(),  # pyright: ignore[reportArgumentType]
            2,
            key=jax.random.key(0),
        )
    assert str(error.value).endswith(
        " takes no argument; it is called with a key: pass a function of one, "
        "e.g. lambda key: eqx.nn.Linear(64, 64, key=key), or one taking key= as "
        "Equinox's layers do, e.g. functools.partial(eqx.nn.Linear, 64, 64)"
    )
    assert str(error.value).startswith("make_layer=<function ")
    with pytest.raises(TypeError, match=r"^make_layer=3 is not callable; pass a"):
        px.models.Stacked(3, 2, key=jax.random.key(0))  # type: ignore[arg-type]


def test_a_stack_copied_with_a_static_field_set_keeps_nothing_alive():
    """A plan's model (its stacks' remat set: `Plan.model`) and the step's
    `each_layer` copy a `Stacked` with a static field changed. Copied by
    `copy.copy`, equinox held every such copy for the process's life (its
    `Module.__new__` holds a module until an `__init__` that never ran),
    and its arrays with it: on a TPU v5e, GPT-2 small's trainer built from
    `plan.model(...)` kept 343 MB of its parameters twice."""
    import gc
    import weakref

    from phalanx._plan._space import with_remat

    stacked = px.models.Stacked(block, 3, key=jax.random.key(0))
    arrays = [
        weakref.ref(x) for x in jax.tree.leaves(eqx.filter(stacked, eqx.is_array))
    ]
    rematted = with_remat([stacked], True)[0]
    used = stacked.each_layer(lambda layer: layer, lambda *_, **__: False)
    assert rematted.remat is True and stacked.remat is False
    assert used.use is not None and stacked.use is None
    x = jnp.ones(8)
    np.testing.assert_allclose(rematted(x), stacked(x))
    del stacked, rematted, used
    gc.collect()
    assert all(ref() is None for ref in arrays)
