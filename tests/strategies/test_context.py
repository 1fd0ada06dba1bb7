"""`MeshStrategy(context=N)`: each example's sequence split over a mesh axis,
per batch leaf (`sequence_dims`), and the update still one device's on the
whole batch (issue 44)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import phalanx as px
from phalanx._contracts import sequence_split
from phalanx.strategies import _mesh_leaves


VOCAB, WIDTH, SEQ = 16, 16, 32


class TinyLM(eqx.Module):
    """Tokens in, next-token logits out: an embedding, one causal attention
    (`jax.nn.dot_product_attention` on the whole sequence: XLA gathers the
    split sequence for it), a residual and an unembedding."""

    embed: eqx.nn.Embedding
    qkv: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key):
        a, b, c = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, WIDTH, key=a)
        # No bias: a key bias's gradient is zero up to rounding (softmax is
        # shift invariant), which adam would turn into steps of its rate.
        self.qkv = eqx.nn.Linear(WIDTH, 3 * WIDTH, use_bias=False, key=b)
        self.out = eqx.nn.Linear(WIDTH, VOCAB, key=c)

    def __call__(self, tokens):
        x = jax.vmap(self.embed)(tokens)
        q, k, v = jnp.split(jax.vmap(self.qkv)(x)[:, None], 3, axis=-1)
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)[:, 0]
        return jax.vmap(self.out)(x + h)


def next_token_loss(logits, targets):
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.mean(per_token, axis=-1)


def make_trainer(strategy, model=None, **kwargs):
    return px.DataParallelTrainer(
        model or TinyLM(jax.random.key(0)),
        optax.adam(1e-2),
        loss=next_token_loss,
        strategy=strategy,
        progress=False,
        **kwargs,
    )


def batches(n=2, examples=8, seq=SEQ):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (n, examples, seq + 1)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


CONTEXT = {"data": 2, "context": 4, "sequence_dims": {"x": 1, "y": 1}}


def _spec(sharding):
    assert isinstance(sharding, jax.sharding.NamedSharding)
    return sharding.spec


# --- construction ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"context": 4}, ValueError, r"context=4 splits .* sequence_dims="),
        ({"context": 3, "sequence_dims": 1}, ValueError, r"do not fit 8 devices"),
        ({"context": 4, "sequence_dims": "x"}, TypeError, r"sequence_dims='x' must"),
        ({"context": 4, "sequence_dims": {"x": 0}}, ValueError, r"an int >= 1"),
        ({"context": 4, "sequence_dims": {"(x": 1}}, ValueError, r"not a regular"),
    ],
)
def test_bad_context_settings_are_one_line(kwargs, error, match):
    with pytest.raises(error, match=match) as caught:
        px.MeshStrategy(**kwargs)
    assert "\n" not in str(caught.value)


# --- the batch's layout ------------------------------------------------------------


def test_named_leaves_are_split_over_context_the_rest_whole():
    strategy = px.MeshStrategy(data=2, context=4, sequence_dims={"x.tokens": 1})
    names = ["x.tokens", "x.position", "y"]
    specs = [_spec(s) for s in strategy.batch_leaf_shardings(names, [(32,), (), (32,)])]
    assert specs == [
        P(("data", "fsdp"), "context"),
        P(("data", "fsdp")),
        P(("data", "fsdp")),
    ]
    every = px.MeshStrategy(data=2, context=4, sequence_dims=1)
    specs = [_spec(s) for s in every.batch_leaf_shardings(names, [(32,), (), (32, 3)])]
    assert specs == [
        P(("data", "fsdp"), "context"),
        P(("data", "fsdp")),
        P(("data", "fsdp"), "context"),
    ]


def test_the_compiled_step_takes_the_sequence_split():
    trainer = make_trainer(px.MeshStrategy(**CONTEXT))
    compiled = trainer.lower(batches()[0]).compile()
    leaves = compiled.input_shardings[0][3]
    assert [s.spec for s in leaves] == [P(("data", "fsdp"), "context")] * 2


def test_a_context_that_does_not_divide_the_devices_is_named_first():
    # Issue 54: before asking for sequence_dims.
    with pytest.raises(ValueError, match=r"'context': 3, .* do not fit 8 devices"):
        px.MeshStrategy(context=3)


@pytest.mark.parametrize(
    "sequence_dims, seq, match",
    [
        (
            {"tokens": 1},
            SEQ,
            r"'tokens' matches no leaf of the batch, whose leaves are x, y",
        ),
        ({"x": 2}, SEQ, r"x has 2 dimensions .* no dimension 2"),
        (
            {"x": 1},
            30,
            r"x's dimension 1 has 30 positions, which context=4 does not divide",
        ),
        (  # issue 54: past every leaf's dimensions, nothing split, silently
            5,
            SEQ,
            r"^sequence_dims=5: no leaf of the batch has dimension 5 \(their "
            r"dimensions, examples first: x 2, y 2\), so nothing would be split "
            r"over context; name a dimension from 1 to 1$",
        ),
    ],
)
def test_sequence_dims_that_do_not_fit_the_batch_fail_before_a_step(
    sequence_dims, seq, match
):
    strategy = px.MeshStrategy(data=2, context=4, sequence_dims=sequence_dims)
    trainer = make_trainer(strategy)
    with pytest.raises(ValueError, match=match) as caught:
        trainer.fit(batches(seq=seq))
    assert "\n" not in str(caught.value)
    assert int(trainer.state.step) == 0


# --- the update ----------------------------------------------------------------------


def test_a_split_sequence_makes_one_devices_update(caplog, monkeypatch):
    # Attention on the whole sequence (XLA gathers it): exact, if no memory
    # saved (px.models.dot_product_attention splits it: tests/models), and
    # said once.
    monkeypatch.setattr(_mesh_leaves, "_WARNED", set())  # said once a process
    px.testing.assert_equivalent(
        make_trainer,
        batches(),
        strategies=[
            px.MeshStrategy(**CONTEXT),
            px.AccumulatingStrategy(px.MeshStrategy(**CONTEXT), 2),
        ],
        steps=3,
        rtol=1e-5,
        atol=1e-5,
    )
    said = [r.getMessage() for r in caplog.records if "asked for the" in r.getMessage()]
    assert said == [
        "MeshStrategy(context=4): nothing in the model asked for the sequence "
        "split (phalanx.models.dot_product_attention does): where positions mix, "
        "XLA gathers each whole sequence (exact, but the activations there are "
        "not split); compute attention with px.models.dot_product_attention"
    ]


def test_predict_takes_split_sequences():
    trainer = make_trainer(px.MeshStrategy(**CONTEXT))
    x = batches()[0][0]
    reference = make_trainer(px.ShardingStrategy(devices=1))
    np.testing.assert_allclose(trainer.predict(x), reference.predict(x), atol=1e-6)


@pytest.mark.parametrize("context", [1, 2])
def test_resumed_under_another_context_size(tmp_path, context):
    # Saved at step 3 under context=4; restored under `context` (the state is
    # whole along the axis: the same values, bitwise), then trained on as the
    # uninterrupted run under context=4 did.
    data = batches(n=3)
    straight = make_trainer(px.MeshStrategy(**CONTEXT))
    straight.fit(data, epochs=2)
    checkpoint = px.callbacks.Checkpoint(tmp_path, every_n_steps=3, every_n_epochs=None)
    saving = make_trainer(px.MeshStrategy(**CONTEXT), callbacks=[checkpoint])
    saving.fit(data, steps=3)
    other = px.MeshStrategy(data=8 // context, context=context, sequence_dims=1)
    resumed = make_trainer(other, model=TinyLM(jax.random.key(9)))
    resumed.fit(data, steps=3, resume=tmp_path / "3")  # nothing left to train
    leaves = jax.tree.leaves
    for a, b in zip(leaves(resumed.model), leaves(saving.model), strict=True):
        np.testing.assert_array_equal(a, b)
    resumed.fit(data, epochs=2, resume=tmp_path / "3")
    assert int(resumed.state.step) == 6
    for a, b in zip(leaves(resumed.model), leaves(straight.model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_several_steps_per_call_and_bf16_take_split_sequences():
    data = batches(n=4)
    one = make_trainer(px.MeshStrategy(**CONTEXT))
    one.fit(data)
    several = make_trainer(px.MeshStrategy(**CONTEXT), steps_per_call=2)
    several.fit(data)
    leaves = jax.tree.leaves
    for a, b in zip(leaves(several.model), leaves(one.model), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    low = make_trainer(px.MeshStrategy(**CONTEXT), precision="bf16")
    low.fit(data)
    assert np.isfinite(np.asarray(low.history["loss"], float)).all()


def test_a_plan_keeps_the_context_axis():
    # The planner splits what context leaves of the devices (8 / 4: data
    # and fsdp of 2), and its strategy splits the sequences as the trainer's.
    trainer = make_trainer(px.MeshStrategy(**CONTEXT))
    plan = trainer.plan(batches()[0], budget="1GiB")
    chosen = plan.strategy()
    inner = chosen.inner if isinstance(chosen, px.AccumulatingStrategy) else chosen
    assert isinstance(inner, px.MeshStrategy)
    assert inner.mesh.shape["context"] == 4
    names, shapes = ["x", "y"], [(SEQ,), (SEQ,)]
    specs = [_spec(s) for s in inner.batch_leaf_shardings(names, shapes)]
    assert specs == [P(("data", "fsdp"), "context")] * 2


class ChunkAttentionLM(eqx.Module):
    """A planted mistake: `lm`, but under a sequence split each device
    attends within its own chunk only (a shard_map that exchanges nothing)."""

    lm: TinyLM

    def __call__(self, tokens):
        split = sequence_split()
        if split is None:
            return self.lm(tokens)
        x = jax.vmap(self.lm.embed)(tokens)
        q, k, v = jnp.split(jax.vmap(self.lm.qkv)(x)[:, None], 3, axis=-1)

        def chunk(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)

        h = jax.shard_map(
            chunk,
            mesh=split.mesh,
            in_specs=P("context"),
            out_specs=P("context"),
            axis_names={split.axis, *split.batch_axes},
            check_vma=False,
        )(q, k, v)[:, 0]
        return jax.vmap(self.lm.out)(x + h)


def test_attention_that_ignores_the_split_is_caught():
    # assert_equivalent compares with one device on whole sequences.
    with pytest.raises(AssertionError, match="gradient|loss"):
        px.testing.assert_equivalent(
            lambda strategy: make_trainer(
                strategy, ChunkAttentionLM(TinyLM(jax.random.key(0)))
            ),
            batches(),
            strategies=[px.MeshStrategy(**CONTEXT)],
            steps=1,
        )
