"""Mixed precision: float32 master weights, the forward and backward pass in
bfloat16 or float16, the reduction's dtype, and float16's dynamic loss
scale (overflow skipped, the scale halved and regrown, checkpointed)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from typing_extensions import override

import phalanx as px
from helpers import (
    BatchNormMLP,
    DropoutMLP,
    RaiseAt,
    make_data,
    make_model,
    make_strategy,
    max_abs_diff,
    reference_fit,
    sqrt_loss,
)
from phalanx._typing import MetricValue


BF16 = jnp.bfloat16
KEY = jax.random.key(0)


def floating(tree) -> list[jax.Array]:
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def reference_bf16_fit(model, batch, steps: int):
    """The casts by hand: float32 parameters and adam, the model run on
    bfloat16 parameters and inputs, its outputs and the loss in float32."""
    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    x, y = jax.device_put(batch, jax.devices()[0])

    @jax.jit
    def step(params, opt_state):
        def loss(params):
            low = jax.tree.map(lambda p: p.astype(BF16), params)
            logits = jax.vmap(eqx.combine(low, static))(x.astype(BF16))
            logits = logits.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state)
        return eqx.apply_updates(params, updates), opt_state

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return eqx.combine(params, static)


@pytest.fixture(scope="module")
def bf16_reference():
    return reference_bf16_fit(make_model(), make_data(64), steps=10)


# One device over the whole batch makes the hand-written loop's casts (≤ 1e-6).
# Over several devices or microbatches each slice's gradient comes out of its
# bfloat16 dot products rounded to bfloat16 (8 bits of mantissa), and the
# slices are added in float32, where one device rounds the whole batch's sum
# once: after 10 adam steps of 1e-2 that leaves up to 8e-3 here (measured),
# against 2.6e-2 between bfloat16 and float32 training. Float32 training
# agrees to 1e-5 (test_equivalence.py).
BF16_TOLERANCE = 1e-2


@pytest.mark.parametrize("devices", [1, 2, 8])
@pytest.mark.parametrize(
    "kind", ["sharding", "pmap", "fsdp", "sharding+acc2", "pmap+acc4", "fsdp+acc2"]
)
def test_bf16_matches_the_casts_by_hand(kind, devices, bf16_reference):
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=make_strategy(kind, devices),
        precision="bf16",
    )
    trainer.fit([make_data(64)], steps=10)
    exact = devices == 1 and "+" not in kind
    tolerance = 1e-6 if exact else BF16_TOLERANCE
    assert max_abs_diff(trainer.model, bf16_reference) <= tolerance


@pytest.mark.parametrize("kind", ["mesh", "mesh+acc2"])
def test_bf16_on_a_mesh_matches_the_casts_by_hand(kind, bf16_reference):
    # MeshStrategy is one global program: the compiler places the reduction,
    # in float32 as the policy says, so it rounds as ShardingStrategy does.
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=make_strategy(kind, 8),
        precision="bf16",
    )
    trainer.fit([make_data(64)], steps=10)
    assert max_abs_diff(trainer.model, bf16_reference) <= BF16_TOLERANCE


def test_the_bf16_tolerance_tells_bf16_from_fp32(bf16_reference):
    fp32 = reference_fit(make_model(), [make_data(64)], steps=10)
    assert max_abs_diff(fp32, bf16_reference) > 2 * BF16_TOLERANCE


def dot_types(lowered: str) -> set[str]:
    """The element types the lowered program's dot products produce."""
    return set(re.findall(r"stablehlo.dot_general.*-> tensor<[\dx]*x(\w+)>", lowered))


def all_reduce_types(lowered: str) -> list[str]:
    """The element type of each all-reduce's first operand."""
    return re.findall(
        r'"stablehlo.all_reduce"\(%[^)]*\).*?\}\) : \(tensor<[\dx]*x(\w+)>',
        lowered,
        re.S,
    )


@pytest.mark.parametrize("policy", ["fp32", "bf16", "fp16"])
def test_master_weights_stay_float32_and_dots_run_in_the_compute_dtype(policy):
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), strategy=px.PmapStrategy(2), precision=policy
    )
    trainer.fit([make_data(64)], steps=3)
    state = trainer.state
    assert {x.dtype for x in floating((state.model, state.opt_state))} == {
        jnp.dtype(jnp.float32)
    }
    lowered = trainer.lower(make_data(64)).as_text()
    compute = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}[policy]
    assert dot_types(lowered) == {compute}
    # The gradients cross devices in float32 (the policies' default).
    assert set(all_reduce_types(lowered)) == {"f32"}


def test_reduce_dtype_sets_the_gradient_all_reduce():
    policy = px.Precision(compute=BF16, reduce=BF16)
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        precision=policy,
    )
    lowered = trainer.lower(make_data(64)).as_text()
    # Four gradient leaves in bfloat16; the loss sums stay float32.
    assert sorted(all_reduce_types(lowered)) == ["bf16"] * 4 + ["f32"]
    trainer.fit([make_data(64)], steps=2)  # and it compiles and runs (XLA:CPU)
    assert all(np.isfinite(np.asarray(x)).all() for x in floating(trainer.model))


def test_a_model_built_in_bf16_gets_float32_master_weights():
    model = jax.tree.map(
        lambda x: x.astype(BF16) if eqx.is_inexact_array(x) else x, make_model()
    )
    trainer = px.DataParallelTrainer(model, optax.adam(1e-2), precision="bf16")
    assert {x.dtype for x in floating(trainer.model)} == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize(
    ("precision", "error", "match"),
    [
        ("fp8", ValueError, "precision='fp8' is not a preset.*'fp32', 'bf16', 'fp16'"),
        (16, TypeError, "precision=16 must be"),
    ],
)
def test_bad_precision_is_refused(precision, error, match):
    with pytest.raises(error, match=match):
        px.DataParallelTrainer(make_model(), optax.adam(1e-2), precision=precision)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"compute": jnp.int32}, TypeError, r"compute=.*int32.*\) must be a floating"),
        ({"reduce": "float8"}, TypeError, r"reduce='float8'\) must be a floating"),
        (
            {"loss_scale": -1.0},
            ValueError,
            r"loss_scale=-1.0\) must be None, 'dynamic'",
        ),
        ({"loss_scale": "auto"}, ValueError, "loss_scale='auto'"),
    ],
)
def test_bad_policies_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        px.Precision(**kwargs)


class Record(px.Callback):
    """Each step's loss scale and whether it was skipped."""

    def __init__(self):
        self.steps: list[tuple[MetricValue, MetricValue]] = []

    @override
    def on_step_end(self, info):
        self.steps.append((info.metrics["loss_scale"], info.metrics["skipped"]))


def spiky(steps: int, spike_at: int, seed: int = 0):
    """`steps` batches of 32; the one at `spike_at` has inputs 1e4 times
    larger, whose scaled float16 gradient overflows."""
    x, y = make_data(32 * steps, seed=seed)
    batches = [
        (x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32]) for i in range(steps)
    ]
    spike = batches[spike_at]
    batches[spike_at] = (spike[0] * 1e4, spike[1])
    return batches


def test_fp16_overflow_skips_the_step_and_halves_the_scale(monkeypatch):
    monkeypatch.setattr(px.DynamicScale, "PERIOD", 3)  # regrowth within the test
    record = Record()
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(2),
        precision="fp16",
        callbacks=[record],
    )
    trainer.fit(spiky(8, spike_at=2), epochs=1)
    start = px.DynamicScale.INITIAL
    assert record.steps == [
        (start, 0.0),
        (start, 0.0),
        (start, 1.0),  # overflow: skipped, not a FloatingPointError
        (start / 2, 0.0),
        (start / 2, 0.0),
        (start / 2, 0.0),  # the third good step in a row: doubled after it
        (start, 0.0),
        (start, 0.0),
    ]
    assert int(trainer.state.step) == 7  # the skipped update is not a step
    logs = trainer.history[-1]
    assert logs["skipped_steps"] == 1 and logs["loss_scale"] == start
    assert np.isfinite(logs["loss"])


def test_fp16_non_finite_at_the_scale_floor_is_the_nan_policys(monkeypatch):
    monkeypatch.setattr(px.DynamicScale, "INITIAL", px.DynamicScale.MIN)
    x, y = make_data(64)
    bad = [(x[:32], y[:32]), (x[32:], np.full(32, -1, np.int32))]  # NaN gradient
    trainer = px.DataParallelTrainer(
        make_model(), optax.adam(1e-2), loss=sqrt_loss, precision="fp16"
    )
    with pytest.raises(FloatingPointError, match="at step 1"):
        trainer.fit(bad, epochs=1)


@pytest.mark.parametrize("kind", ["pmap+acc4", "fsdp"])
def test_fp16_scale_is_one_per_update_under_every_strategy(kind):
    record = Record()
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=make_strategy(kind, 8),
        precision="fp16",
        callbacks=[record],
    )
    trainer.fit(spiky(4, spike_at=1), epochs=1)
    start = px.DynamicScale.INITIAL
    assert record.steps == [(start, 0), (start, 1), (start / 2, 0), (start / 2, 0)]


def test_fp16_resume_restores_the_scale_exactly(tmp_path):
    def run(folder, *crash, resume=None):
        checkpoint = px.callbacks.Checkpoint(tmp_path / folder, every_n_steps=4)
        trainer = px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            strategy=px.ShardingStrategy(2),
            precision="fp16",
            callbacks=[*crash, checkpoint],
        )
        trainer.fit(spiky(8, spike_at=1), epochs=1, resume=resume)
        return trainer

    straight = run("straight")
    with pytest.raises(RuntimeError, match="boom at step 6"):
        run("crashed", RaiseAt(6))  # the newest checkpoint: step 4, scale halved
    resumed = run("crashed", resume="latest")
    scale = resumed.state.loss_scale
    assert scale is not None
    assert float(scale.scale) == px.DynamicScale.INITIAL / 2
    for a, b in zip(
        jax.tree.leaves(resumed.state.loss_scale),
        jax.tree.leaves(straight.state.loss_scale),
        strict=True,
    ):
        assert a == b
    assert int(scale.good_steps) == 6
    assert max_abs_diff(resumed.model, straight.model) == 0


def test_batchnorm_state_keeps_its_dtype_under_bf16():
    model, state = eqx.nn.make_with_state(BatchNormMLP)("batch", "ema", key=KEY)
    trainer = px.DataParallelTrainer(
        model, optax.adam(1e-2), model_state=state, precision="bf16"
    )
    trainer.fit([make_data(64)], steps=3)
    stats = floating(trainer.state.model_state)  # running means and variances
    assert len(stats) == 2 and all(x.dtype == jnp.float32 for x in stats)
    assert np.isfinite(trainer.history[-1]["loss"])


def test_dropout_masks_are_layout_free_under_bf16():
    # The masks come from (seed, step, example) whatever the precision: 1 and
    # 8 devices drop the same units, and their gradients differ only as bf16
    # sums do (SGD: adam's sign-like first steps would magnify a rounding).
    models = []
    for devices in (1, 8):
        trainer = px.DataParallelTrainer(
            DropoutMLP(0.5, key=KEY),
            optax.sgd(0.1),
            strategy=px.ShardingStrategy(devices),
            precision="bf16",
        )
        trainer.fit([make_data(64)], steps=5)
        models.append(trainer.model)
    assert max_abs_diff(*models) <= 1e-3


def test_steps_per_call_under_fp16_is_the_same():
    models = []
    for k in (1, 4):
        trainer = px.DataParallelTrainer(
            make_model(),
            optax.adam(1e-2),
            strategy=px.ShardingStrategy(2),
            precision="fp16",
            steps_per_call=k,
        )
        trainer.fit(spiky(8, spike_at=2), epochs=1)
        models.append(trainer)
    assert max_abs_diff(models[0].model, models[1].model) == 0
    assert models[0].history.epochs == models[1].history.epochs


def test_predict_runs_in_the_compute_dtype():
    trainer = px.DataParallelTrainer(
        make_model(),
        optax.adam(1e-2),
        strategy=px.ShardingStrategy(8),
        precision="bf16",
    )
    x, _ = make_data(13)
    predicted = trainer.predict(x)
    assert predicted.dtype == jnp.float32  # the policy's output dtype
    # The casts by hand, up to bfloat16 rounding (8 bits of mantissa).
    low = jax.tree.map(
        lambda p: p.astype(BF16) if eqx.is_inexact_array(p) else p, trainer.model
    )
    by_hand = jax.vmap(low)(jnp.asarray(x, BF16)).astype(jnp.float32)
    np.testing.assert_allclose(predicted, by_hand, rtol=2**-7, atol=2**-9)
    # The predict program's dot products run in bfloat16.
    rows = np.zeros((8, x.shape[1]), np.float32)  # a row per device
    parts = trainer._parts
    step, _ = parts.programs.predict(jax.tree.structure(rows), [rows])
    lowered = step.lower(parts.layout.structs, [rows]).as_text()
    assert dot_types(lowered) == {"bf16"}
