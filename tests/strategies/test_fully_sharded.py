"""FullyShardedStrategy: the state split over the devices (which leaves,
along which axis), the memory it saves, the collectives it compiles to,
checkpoints across layouts, and the trainer's features under it. (Its
equivalence with one device is in test_equivalence.py.)"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import phalanx as px
from helpers import make_data, make_model, max_abs_diff, reference_fit, sqrt_loss
from test_hlo import all_reduces, computations, in_loops


def arrays(tree) -> list[jax.Array]:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def values(tree) -> list[np.ndarray]:
    """`tree`'s arrays on the host, PRNG keys as their key data."""
    return [
        np.asarray(jax.random.key_data(x))
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else np.asarray(x)
        for x in arrays(tree)
    ]


def per_device_bytes(tree) -> int:
    """The most bytes of `tree`'s arrays any one device holds."""
    held: dict = {}
    for leaf in arrays(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.mark.parametrize(
    ("shape", "dtype", "devices", "expected"),
    [
        ((16, 5), jnp.float32, 8, P("data")),  # the one axis 8 divides
        ((5, 16), jnp.float32, 8, P(None, "data")),
        ((16, 32), jnp.float32, 8, P(None, "data")),  # the longest of two
        ((16, 16), jnp.bfloat16, 8, P("data")),  # the first of equal ones
        ((3, 5), jnp.float32, 8, P()),  # no axis 8 divides
        ((8,), jnp.int32, 8, P()),  # not floating point
        ((), jnp.float32, 8, P()),
        ((16, 16), jnp.float32, 1, P()),  # one device: nothing to split
    ],
)
def test_which_leaves_are_split_and_along_which_axis(shape, dtype, devices, expected):
    strategy = px.FullyShardedStrategy(devices, min_size=1)
    assert strategy.spec(shape, dtype) == expected


def test_small_leaves_stay_replicated():
    strategy = px.FullyShardedStrategy(8, min_size=256)
    assert strategy.spec((16, 16), jnp.float32) == P("data")
    assert strategy.spec((8, 16), jnp.float32) == P()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"shard": "params"},
            ValueError,
            "shard='params' must be 'all' or 'optimizer'",
        ),
        ({"min_size": 0}, ValueError, "min_size=0 must be an int >= 1"),
        ({"min_size": 1.5}, ValueError, "min_size=1.5"),
        ({"devices": 99}, ValueError, "devices=99"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        px.FullyShardedStrategy(**kwargs)


def shardable_model() -> px.models.MLP:
    """An MLP whose every leaf 8 devices can split (64-128-8)."""
    return px.models.MLP(64, 8, hidden=(128,), key=jax.random.key(0))


def shardable_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype(np.float32)
    return x, rng.integers(0, 8, 64).astype(np.int32)


@pytest.mark.parametrize("shard", ["all", "optimizer"])
def test_each_device_holds_an_eighth_of_the_state(shard):
    trainers = {
        name: px.DataParallelTrainer(shardable_model(), optax.adam(1e-3), strategy=s)
        for name, s in (
            ("replicated", px.ShardingStrategy(8)),
            ("split", px.FullyShardedStrategy(8, shard=shard, min_size=1)),
        )
    }
    split = trainers["split"]
    split.fit([shardable_batch()], steps=2)  # the layout outlives the steps
    state = split.state
    params, opt = arrays(state.model), arrays(state.opt_state)
    total = sum(x.nbytes for x in params + opt)
    scalars = sum(x.nbytes for x in opt if x.ndim == 0)  # adam's step count
    whole = sum(x.nbytes for x in params)
    if shard == "all":
        assert per_device_bytes((state.model, state.opt_state)) <= total / 8 + scalars
    else:  # the parameters whole on each device, the optimizer state split
        held = per_device_bytes((state.model, state.opt_state))
        assert held <= whole + (total - whole) / 8 + scalars
        assert all(x.sharding.is_fully_replicated for x in params)
    # The compiled step's arguments per device fall accordingly.
    batch = shardable_batch()
    analyses = {
        name: t.lower(batch).compile().memory_analysis() for name, t in trainers.items()
    }
    sizes = {
        name: a.argument_size_in_bytes for name, a in analyses.items() if a is not None
    }
    assert sizes.keys() == analyses.keys()
    batch_bytes = sum(x.nbytes for x in batch) + 64 * 4  # and the weights
    assert sizes["replicated"] >= total
    saved = total * 7 / 8 if shard == "all" else (total - whole) * 7 / 8
    assert sizes["split"] <= sizes["replicated"] - saved + batch_bytes / 8


def collectives(hlo: str, op: str) -> list[str]:
    return [line for line in hlo.splitlines() if f" {op}(" in line]


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("shard", ["all", "optimizer"])
def test_gradients_leave_through_one_reduce_scatter_per_update(shard, microbatches):
    strategy = px.FullyShardedStrategy(8, shard=shard, min_size=1)
    if microbatches > 1:
        strategy = px.AccumulatingStrategy(strategy, microbatches)
    trainer = px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=strategy)
    hlo = trainer.lower(make_data(64)).compile().as_text()
    assert hlo is not None
    # The test model's leaves: weights [8, 5] and [3, 8], biases [8] and [3];
    # all but the last split over 8 devices, each reduce-scattered once.
    scatters = collectives(hlo, "reduce-scatter")
    assert len(scatters) == 3, scatters
    # No split gradient is all-reduced whole: the all-reduces carry the loss
    # sums, the [3] bias's gradient and the non-finite check's three scalars.
    for line in all_reduces(hlo):
        assert not any(s in line for s in ("f32[8,5]", "f32[3,8]", "f32[8]")), line
    gathers = collectives(hlo, "all-gather")
    assert len(gathers) == 3  # the parameters: before the step, or after it
    looped = in_loops(hlo)
    for name, body in computations(hlo).items():
        if name in looped:
            assert not collectives(body, "reduce-scatter"), name
            assert not collectives(body, "all-gather"), name


def test_checkpoints_cross_layouts_and_device_counts(tmp_path):
    # Split over 8 devices -> replicated on 2 -> split over 4: each restore
    # holds the saved values bitwise, laid out as the restoring strategy
    # says, and training goes on from there.
    x, y = make_data(96, seed=4)
    batches = [(x[:48], y[:48]), (x[48:], y[48:])]

    def trainer(strategy, folder):
        checkpoint = px.callbacks.Checkpoint(tmp_path / folder, every_n_steps=2)
        return px.DataParallelTrainer(
            make_model(seed=9),
            optax.adam(1e-2),
            strategy=strategy,
            callbacks=[checkpoint],
        )

    first = trainer(px.FullyShardedStrategy(8, min_size=1), "a")
    first.fit(batches, steps=4)
    second = trainer(px.ShardingStrategy(2), "b")
    second.fit(batches, steps=4, resume=tmp_path / "a" / "4")  # nothing left
    third = trainer(px.FullyShardedStrategy(4, min_size=1), "c")
    for saved, restored, split in ((first, second, None), (second, third, 4)):
        for a, b in zip(values(saved.state), values(restored.state), strict=True):
            np.testing.assert_array_equal(a, b)
        weight = saved.state.model.layers[0].weight
        assert isinstance(weight.sharding, NamedSharding)
        if split is None:
            assert weight.sharding.spec == P("data")
            assert len(weight.sharding.device_set) == 8
            assert restored.state.model.layers[0].weight.sharding.is_fully_replicated
            restored.fit(batches, steps=2)  # a run from step 4 to 6, saved there
            third.fit(batches, steps=2, resume=tmp_path / "b" / "6")  # its end
        else:
            weight = restored.state.model.layers[0].weight
            assert isinstance(weight.sharding, NamedSharding)
            assert weight.sharding.spec == P("data")
            assert len(weight.sharding.device_set) == split
    second.fit(batches, steps=1)
    third.fit(batches, steps=1)
    assert int(third.state.step) == 7
    assert max_abs_diff(second.model, third.model) <= 1e-6


def test_save_model_and_predict_gather_what_they_must(tmp_path):
    x, y = make_data(64, seed=5)
    runs = {}
    for name, strategy in (
        ("replicated", px.ShardingStrategy(8)),
        ("split", px.FullyShardedStrategy(8, min_size=1)),
    ):
        trainer = px.DataParallelTrainer(
            make_model(), optax.adam(1e-2), strategy=strategy
        )
        trainer.fit([(x, y)], steps=3)
        px.save_model(tmp_path / f"{name}.npz", trainer.model)
        runs[name] = trainer
    loaded = px.load_model(tmp_path / "split.npz", like=make_model(seed=3))
    assert max_abs_diff(loaded, runs["replicated"].model) <= 1e-6
    np.testing.assert_allclose(
        runs["split"].predict(x[:13]),
        runs["replicated"].predict(x[:13]),
        rtol=0,
        atol=1e-6,
    )


def test_steps_per_call_and_nan_policy_work_unchanged():
    x, y = make_data(96, seed=6)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 96, 16)]

    def trainer(**kwargs):
        return px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            loss=sqrt_loss,
            strategy=px.FullyShardedStrategy(8, min_size=1),
            **kwargs,
        )

    models = []
    for k in (1, 3):
        run = trainer(steps_per_call=k)
        run.fit(batches, epochs=1)
        models.append(run.model)
    assert max_abs_diff(*models) <= 1e-6
    # A label of -1 makes sqrt_loss's gradient NaN.
    bad = [batches[0], (x[:16], np.full(16, -1, np.int32)), batches[1]]
    skip = trainer(nan_policy="skip")
    skip.fit(bad, epochs=1)
    assert skip.history[-1]["skipped_steps"] == 1
    clean = trainer()
    clean.fit(bad[:1], epochs=1)
    run = trainer(nan_policy="raise")
    with pytest.raises(FloatingPointError, match="at step 1"):
        run.fit(bad, epochs=1)
    assert max_abs_diff(run.model, clean.model) == 0
    sharding = run.state.model.layers[0].weight.sharding
    assert isinstance(sharding, NamedSharding) and sharding.spec == P("data")


@pytest.mark.parametrize("shard", ["all", "optimizer"])
def test_global_norm_clipping_sees_the_whole_gradient(shard):
    # Each device holds part of each split gradient; the global norm is still
    # the whole gradient's (a clip on a device's own part would differ).
    x, y = make_data(64, seed=7)
    clipped = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    reference = reference_fit(make_model(), [(x, y)], steps=5, optimizer=clipped)
    trainer = px.DataParallelTrainer(
        make_model(),
        clipped,
        strategy=px.FullyShardedStrategy(8, shard=shard, min_size=1),
    )
    trainer.fit([(x, y)], steps=5)
    assert max_abs_diff(trainer.model, reference) <= 1e-6
    unclipped = reference_fit(make_model(), [(x, y)], steps=5)
    assert max_abs_diff(unclipped, reference) > 1e-3  # the clip did clip


def instructions(hlo: str) -> list[str]:
    """An HLO module's computations without source metadata."""
    return [
        re.sub(r", metadata=\{[^}]*\}", "", line)
        for line in hlo.splitlines()
        if line.startswith(("%", "ENTRY", "  ", "}"))
    ]


def test_on_one_device_it_compiles_sharding_strategys_program():
    batch = make_data(64)
    texts = [
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), strategy=strategy)
        .lower(batch)
        .compile()
        .as_text()
        for strategy in (px.ShardingStrategy(1), px.FullyShardedStrategy(1, min_size=1))
    ]
    sharding, fully_sharded = texts
    assert sharding is not None and fully_sharded is not None
    assert instructions(sharding) == instructions(fully_sharded)
    assert len(instructions(sharding)) > 50
