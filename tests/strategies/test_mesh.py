"""`px.MeshStrategy`: data × fsdp × tensor meshes with sharding rules, held
to the update of one device on the whole batch (issue 31)."""

import functools
import inspect
import logging
import textwrap

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import phalanx as px
from helpers import host_arrays


WIDTH = 32


class Block(eqx.Module):
    """A residual MLP block: x + down(relu(up(x)))."""

    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        one, two = jax.random.split(key)
        self.up = eqx.nn.Linear(WIDTH, 2 * WIDTH, key=one)
        self.down = eqx.nn.Linear(2 * WIDTH, WIDTH, key=two)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class Net(eqx.Module):
    """16 features in, 2 stacked blocks of width 32, 4 logits out."""

    inp: eqx.nn.Linear
    blocks: px.models.Stacked
    out: eqx.nn.Linear

    def __init__(self, key):
        one, two, three = jax.random.split(key, 3)
        self.inp = eqx.nn.Linear(16, WIDTH, key=one)
        self.blocks = px.models.Stacked(Block, 2, key=two)
        self.out = eqx.nn.Linear(WIDTH, 4, key=three)

    def __call__(self, x):
        return self.out(self.blocks(jax.nn.relu(self.inp(x))))


# Every array of at least 64 elements split over fsdp and tensor (a stacked
# array's first axis is its layers').
RULES = [
    (r"inp\.weight", ("tensor", "fsdp")),
    (r"blocks\.layers\.up\.weight", (None, "tensor", "fsdp")),
    (r"blocks\.layers\.down\.weight", (None, "fsdp", "tensor")),
    (r"blocks\.layers\.(up|down)\.bias", (None, ("tensor", "fsdp"))),
    (r"out\.weight", (None, ("fsdp", "tensor"))),
]
MESHES = {
    "(8,1,1)": {"data": 8},
    "(1,8,1)": {"data": 1, "fsdp": 8},
    "(2,4,1)": {"data": 2, "fsdp": 4},
    "(4,2,1)": {"data": 4, "fsdp": 2},
    "(2,2,2) rules": {"data": 2, "fsdp": 2, "tensor": 2, "rules": RULES},
    "(1,4,2) rules": {"data": 1, "fsdp": 4, "tensor": 2, "rules": RULES},
}


def model(seed: int = 0) -> Net:
    return Net(jax.random.key(seed))


def mesh(devices=None, **sizes) -> px.MeshStrategy:
    return px.MeshStrategy(devices, min_size=64, **sizes)


def trainer(
    strategy: px.Strategy, seed: int = 0, callbacks=()
) -> px.DataParallelTrainer:
    # eps=1e-4: adam's 1e-8 would amplify float32 summation-order noise in
    # near-cancelling gradient entries (issue 31).
    tx = optax.adam(1e-2, eps=1e-4)
    return px.DataParallelTrainer(
        model(seed), tx, strategy=strategy, callbacks=callbacks, progress=False
    )


def ragged_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """91 examples in batches of 32, 32 and 27: the last padded (to 32 under
    every mesh here, so each compiles one step)."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(91, 16)).astype(np.float32)
    y = rng.integers(0, 4, 91).astype(np.int32)
    return [(x[:32], y[:32]), (x[32:64], y[32:64]), (x[64:], y[64:])]


def specs(tree) -> list[P]:
    return [x.sharding.spec for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


@pytest.mark.slow
def test_every_mesh_is_the_update_of_one_device():
    setups = []
    for name, sizes in MESHES.items():
        setups.append((name, mesh(**sizes)))
        setups.append(
            (f"{name} × 2 microbatches", px.AccumulatingStrategy(mesh(**sizes), 2))
        )
    results = px.testing.assert_equivalent(
        trainer, ragged_batches(), strategies=setups, steps=10
    )
    assert len(results) == 12
    for name, result in results.items():
        assert max(result.gradient, result.values, result.parameters) <= 1e-5, name


def test_a_tensor_only_mesh_accumulates_and_runs_in_bf16():
    # data × fsdp = 1: the per-device program is manual over axes of one
    # device, where XLA refused any collective ("Cross-partition allreduce
    # must be in (partial) manual partitioning mode", issue 54). Each is the
    # update of one device: to 1e-5, and in bf16 to bf16's rounding.
    def tensor_only():
        return mesh(jax.devices()[:2], data=1, tensor=2, rules=RULES)

    results = px.testing.assert_equivalent(
        trainer,
        ragged_batches(),
        strategies=[("accumulating", px.AccumulatingStrategy(tensor_only(), 2))],
        steps=3,
    )
    result = results["accumulating"]
    assert max(result.gradient, result.values, result.parameters) <= 1e-5

    def low(strategy):
        return px.DataParallelTrainer(
            model(), optax.adam(1e-2, eps=1e-4), strategy=strategy,
            precision="bf16", progress=False,
        )  # fmt: skip

    results = px.testing.assert_equivalent(
        low,
        ragged_batches(),
        strategies=[
            ("bf16", tensor_only()),
            ("bf16 accumulating", px.AccumulatingStrategy(tensor_only(), 2)),
        ],
        steps=3,
        rtol=2e-2,
        atol=2e-2,
    )
    assert set(results) == {"bf16", "bf16 accumulating"}


def test_the_mesh_and_the_batch_split():
    strategy = mesh(data=2, fsdp=-1, tensor=2)
    assert dict(strategy.mesh.shape) == {
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "tensor": 2,
    }
    assert strategy.num_devices == 8 and strategy.batch_multiple == 4
    assert strategy.batch_sharding.spec == P(("data", "fsdp"))
    # The last axis varies fastest: a tensor pair is two consecutive devices.
    assert list(strategy.mesh.devices[0, 0, 0]) == jax.devices()[:2]
    assert dict(px.MeshStrategy().mesh.shape) == {
        "data": 8,
        "fsdp": 1,
        "context": 1,
        "tensor": 1,
    }


def test_rules_then_size_lay_out_the_state():
    fitted = trainer(mesh(data=2, fsdp=2, tensor=2, rules=RULES[:1]))
    # inp by its rule; then by size over fsdp, along the longest dimension
    # it divides but never a stacked array's first (its layers'); below
    # min_size (64 elements) whole.
    assert specs(fitted.state.model) == [
        P("tensor", "fsdp"),  # inp.weight (32, 16)
        P(),  # inp.bias (32,)
        P(None, "fsdp"),  # blocks.layers.up.weight (2, 64, 32)
        P(None, "fsdp"),  # blocks.layers.up.bias (2, 64)
        P(None, None, "fsdp"),  # blocks.layers.down.weight (2, 32, 64)
        P(None, "fsdp"),  # blocks.layers.down.bias (2, 32)
        P(None, "fsdp"),  # out.weight (4, 32)
        P(),  # out.bias (4,)
    ]
    # adam's moments follow their parameters; its step count is whole.
    assert specs(fitted.state.opt_state) == [P(), *specs(fitted.state.model) * 2]


@pytest.mark.parametrize("sizes", ["(1,8,1)", "(2,2,2) rules"])
def test_gradients_come_back_laid_out_as_their_parameters(sizes):
    # Split where the parameter is split, whole where it is whole (left to
    # itself, the compiler keeps a small bias's gradient split over fsdp).
    fitted = trainer(mesh(**MESHES[sizes]))
    grads = fitted.compute_step(ragged_batches()[0]).grads
    params = eqx.filter(fitted.state.model, eqx.is_inexact_array)
    assert specs(grads) == specs(params)
    assert P() in specs(params) and len(set(specs(params))) > 1


@pytest.mark.parametrize("sizes", ["(2,2,2) rules", "(1,4,2) rules"])
def test_each_device_holds_its_share_of_the_state(sizes):
    fitted = trainer(mesh(**MESHES[sizes]))
    fitted.fit(ragged_batches(), steps=1)
    state = eqx.filter((fitted.state.model, fitted.state.opt_state), eqx.is_array)
    device = jax.devices()[0]
    split = MESHES[sizes]["fsdp"] * MESHES[sizes]["tensor"]
    total = held = small = 0
    for leaf in jax.tree.leaves(state):
        (shard,) = [s for s in leaf.addressable_shards if s.device == device]
        if leaf.size < 64:  # below min_size, no rule: whole everywhere
            small += leaf.nbytes
        else:
            total += leaf.nbytes
            held += shard.data.nbytes
    assert held <= total / split * 1.1 + small, (held, total, small)
    assert total > 20 * small
    # The summary reads the same from the layout, and names the mesh.
    summary = fitted.summary()
    params = eqx.filter(fitted.state.model, eqx.is_inexact_array)
    assert summary.param_bytes_per_device == sum(
        leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(params)
    )
    names = {
        "(2,2,2) rules": "MeshStrategy(data=2, fsdp=2, tensor=2)",
        "(1,4,2) rules": "MeshStrategy(fsdp=4, tensor=2)",
    }
    assert summary.strategy == names[sizes]


def test_bad_meshes_and_rules_say_what_to_fix():
    with pytest.raises(ValueError, match=r"fsdp=0 must be an int >= 1, or -1"):
        px.MeshStrategy(fsdp=0)
    with pytest.raises(ValueError, match=r"do not fit 8 devices"):
        px.MeshStrategy(fsdp=3)
    with pytest.raises(ValueError, match=r"'model' is not a mesh axis"):
        px.MeshStrategy(rules=[("x", ("model",))])
    with pytest.raises(ValueError, match=r"not a regular expression"):
        px.MeshStrategy(rules=[("layers[", (None,))])
    with pytest.raises(TypeError, match=r"is not a \(pattern, spec\) pair"):
        px.MeshStrategy(rules=[("layers",)])  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"names an axis twice"):
        px.MeshStrategy(rules=[("x", ("fsdp", "fsdp"))])
    # Against the model, before anything is placed:
    cases = [
        ([(r"inp\.weight", ("tensor",))], r"has 1 entries for its 2 dimensions"),
        (
            [(r"out\.weight", ("tensor", None))],
            r"splits 'out\.weight' of shape \[4, 32\] 8 ways along a dimension "
            r"of 4",
        ),
        ([(r"layer\.0\.weight", (None, None))], r"matches no parameter"),
    ]
    for rules, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer(mesh(data=1, tensor=8, rules=rules))


def test_a_rule_for_one_layer_of_a_stacked_array_gets_the_rule_with_its_axis():
    # Written for one layer's weight (out, in); Net's blocks are Stacked, so
    # the array is (layers, out, in).
    rules = [(r"blocks\.layers\.up\.weight", ("tensor", None))]
    with pytest.raises(ValueError) as error:
        trainer(mesh(data=4, tensor=2, rules=rules))
    assert str(error.value) == (
        r"rules: ('blocks\\.layers\\.up\\.weight', ('tensor', None)) matches "
        "'blocks.layers.up.weight' of shape [2, 64, 32], but has 2 entries for "
        "its 3 dimensions; it is an array of a px.models.Stacked, whose first "
        "axis holds its 2 layers: give that axis an entry too (None: whole, each "
        r"layer gathered on its turn), e.g. ('blocks\\.layers\\.up\\.weight', "
        "(None, 'tensor', None))"
    )
    # The rule it names is the one that works.
    fixed = [(r"blocks\.layers\.up\.weight", (None, "tensor", None))]
    laid_out = trainer(mesh(data=4, tensor=2, rules=fixed)).state.model.blocks
    assert laid_out.layers.up.weight.sharding.spec == P(None, "tensor", None)
    # One entry too many: the layer axis is named, with no rule to copy.
    rules = [(r"blocks\.layers\.up\.bias", (None, None, "tensor"))]
    with pytest.raises(ValueError) as error:
        trainer(mesh(data=4, tensor=2, rules=rules))
    assert str(error.value).endswith(
        "but has 3 entries for its 2 dimensions; it is an array of a "
        "px.models.Stacked, whose first axis holds its 2 layers and takes an "
        "entry too (None: whole); give one per dimension, or a pattern that "
        "does not match it"
    )


def test_the_docstring_example_lays_out_a_stacked_model():
    # MeshStrategy's example, as its API page shows it, on Net (whose
    # `blocks` is a Stacked stack of `up` and `down` Linear layers).
    doc = inspect.getdoc(px.MeshStrategy) or ""
    code = doc.split("```python\n")[1].split("```")[0]
    namespace: dict = {"px": px}
    exec(textwrap.dedent(code), namespace)
    laid_out = trainer(namespace["strategy"]).state.model.blocks.layers
    assert laid_out.up.weight.sharding.spec == P(None, "tensor", "fsdp")
    assert laid_out.down.weight.sharding.spec == P(None, "fsdp", "tensor")


def test_a_rule_matching_nothing_names_the_models_nearest_paths():
    # Written for blocks unrolled in a list; Net's are Stacked.
    rules = [(r"blocks\.0\.up\.weight", ("tensor", None))]
    with pytest.raises(ValueError) as error:
        trainer(mesh(data=4, tensor=2, rules=rules))
    assert str(error.value) == (
        r"rules: ('blocks\\.0\\.up\\.weight', ('tensor', None)) matches no "
        "parameter of the model (by re.fullmatch of its path); its nearest paths "
        "are 'blocks.layers.up.weight', 'blocks.layers.down.weight', "
        "'out.weight': fix the pattern, or remove the rule"
    )


def test_a_large_leaf_left_whole_is_named_once(caplog):
    # Widths 5, 15 and 3: no dimension that fsdp=2 divides; layers.1.bias
    # (3 elements) is below min_size.
    odd = px.models.MLP(5, 3, hidden=(15,), key=jax.random.key(0))
    strategy = px.MeshStrategy(data=4, fsdp=2, min_size=15)
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        for _ in range(2):
            px.DataParallelTrainer(odd, optax.adam(1e-2), strategy=strategy)
    lines = [r.getMessage() for r in caplog.records if "kept whole" in r.getMessage()]
    assert lines == [
        "MeshStrategy({'data': 4, 'fsdp': 2, 'context': 1, 'tensor': 1}): kept "
        "whole on every device: layers.0.weight float32[15, 5] (300 bytes); "
        "layers.0.bias float32[15] (60 bytes); layers.1.weight float32[3, 15] "
        "(180 bytes); add a rule for it, or make a dimension divisible by fsdp"
    ]


def test_checkpoints_cross_meshes(tmp_path):
    # Saved under (2,4,1), restored on one device and under (1,2,2) with rules:
    # every array bitwise, and training goes on as if never stopped.
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=3)
    saved = trainer(mesh(data=2, fsdp=4), callbacks=[checkpoint])
    saved.fit(ragged_batches(), steps=3)
    straight = trainer(mesh(data=2, fsdp=4))
    straight.fit(ragged_batches(), steps=6)
    for strategy in (mesh(1, data=1), mesh(4, data=1, fsdp=2, tensor=2, rules=RULES)):
        other = trainer(strategy, seed=9)
        other.fit(ragged_batches(), steps=3, resume=tmp_path / "3")  # nothing left
        for a, b in zip(
            host_arrays(other.state), host_arrays(saved.state), strict=True
        ):
            np.testing.assert_array_equal(a, b)
        other.fit(ragged_batches(), steps=3)  # 3 more: as the straight run's
        for a, b in zip(
            host_arrays(other.model), host_arrays(straight.model), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_a_model_built_in_its_shards():
    strategy = mesh(data=1, fsdp=4, tensor=2, rules=RULES)
    built = px.sharded_model(Net, strategy, key=jax.random.key(0))
    # The model make_model builds, its arrays already laid out.
    for a, b in zip(host_arrays(built), host_arrays(model(0)), strict=True):
        np.testing.assert_array_equal(a, b)
    fitted = trainer(strategy)
    assert specs(built) == specs(fitted.state.model)
    up = built.blocks.layers.up.weight
    assert up.addressable_shards[0].data.shape == (2, 64 // 2, 32 // 4)
    # The trainer takes it as it is.
    tx = optax.adam(1e-2, eps=1e-4)
    taken = px.DataParallelTrainer(built, tx, strategy=strategy, progress=False)
    assert specs(taken.state.model) == specs(built)
    with pytest.raises(TypeError, match=r"is not a phalanx strategy"):
        px.sharded_model(Net, "fsdp", key=jax.random.key(0))  # type: ignore[arg-type]


def test_sharded_model_takes_a_builder_of_key_by_name_as_equinox_models():
    strategy = mesh(data=1, fsdp=8)
    key = jax.random.key(0)
    by_name = px.sharded_model(
        functools.partial(eqx.nn.MLP, 16, 4, 64, 1), strategy, key=key
    )
    by_position = px.sharded_model(
        lambda k: eqx.nn.MLP(16, 4, 64, 1, key=k), strategy, key=key
    )
    for a, b in zip(host_arrays(by_name), host_arrays(by_position), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"^make_model=<function .* takes no argument"):
        px.sharded_model(lambda: Net(key), strategy, key=key)  # pyright: ignore[reportArgumentType]


def test_predict_save_model_and_a_skipped_step_on_a_mesh(tmp_path):
    strategy = mesh(data=2, fsdp=2, tensor=2, rules=RULES)
    fitted = trainer(strategy)
    fitted.fit(ragged_batches(), steps=3)
    alone = trainer(mesh(1, data=1))
    alone.state = fitted.state  # the same values, on one device
    x, y = ragged_batches()[2]  # 27 rows: padded to the mesh's batch multiple
    np.testing.assert_allclose(
        fitted.predict(x), alone.predict(x), rtol=1e-6, atol=1e-6
    )
    results, expected = fitted.evaluate([(x, y)]), alone.evaluate([(x, y)])
    assert results == pytest.approx(expected, rel=1e-6)
    # save_model writes whole arrays and leaves the layout as it was.
    before = specs(fitted.state)
    px.save_model(tmp_path / "model.npz", fitted.model)
    loaded = px.load_model(tmp_path / "model.npz", like=model(seed=1))
    for a, b in zip(host_arrays(loaded), host_arrays(fitted.model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert specs(fitted.state) == before
    # nan_policy="skip": a batch with a NaN (let through the value checks)
    # leaves every sharded array as it was, and the step is counted skipped.
    skipping = px.DataParallelTrainer(
        model(), optax.adam(1e-2), strategy=strategy, nan_policy="skip",
        checks="off", progress=False,
    )  # fmt: skip
    bad = x.copy()
    bad[0, 0] = np.nan
    start = host_arrays(skipping.model)
    skipping.fit([(bad, y)], steps=1)
    for a, b in zip(host_arrays(skipping.model), start, strict=True):
        np.testing.assert_array_equal(a, b)
    assert skipping.history[-1]["skipped_steps"] == 1
    assert np.isnan(skipping.history[-1]["loss"])  # no applied step to average
    assert specs(skipping.state) == specs(fitted.state)
