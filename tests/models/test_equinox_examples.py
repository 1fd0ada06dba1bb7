"""Equinox's own examples, their model code copied as written (small sizes),
trained by phalanx: the BERT classifier of ``docs/examples/bert.ipynb`` and
the BatchNorm/SpectralNorm model of ``docs/examples/stateful.ipynb`` in
https://github.com/patrick-kidger/equinox (Apache-2.0; copied from commit
9336d820b2ef66b360fc6cb3611b3da5cefbb14d).

Both pass `px.testing.assert_equivalent` under every set-up that is exact for
them, and inference calls BERT with dropout off, as the example does.
"""

# The examples annotate `key: jax.random.PRNGKey | None`, a function or'ed
# with None: an error where annotations are evaluated when a function is
# defined (before Python 3.14). Deferred here, as 3.14 defers them; pyright,
# which wants a class there, is told so on each such line, and the code
# stays as written.
from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float, Int
from typing_extensions import override

import phalanx as px


# --- docs/examples/bert.ipynb, as written ------------------------------------


class EmbedderBlock(eqx.Module):
    """BERT embedder."""

    token_embedder: eqx.nn.Embedding
    segment_embedder: eqx.nn.Embedding
    position_embedder: eqx.nn.Embedding
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        type_vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        dropout_rate: float,
        key: jax.random.PRNGKey,  # pyright: ignore[reportGeneralTypeIssues]
    ):
        token_key, segment_key, position_key = jax.random.split(key, 3)

        self.token_embedder = eqx.nn.Embedding(
            num_embeddings=vocab_size, embedding_size=embedding_size, key=token_key
        )
        self.segment_embedder = eqx.nn.Embedding(
            num_embeddings=type_vocab_size,
            embedding_size=embedding_size,
            key=segment_key,
        )
        self.position_embedder = eqx.nn.Embedding(
            num_embeddings=max_length, embedding_size=embedding_size, key=position_key
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        token_ids: Int[Array, " seq_len"],
        position_ids: Int[Array, " seq_len"],
        segment_ids: Int[Array, " seq_len"],
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,  # pyright: ignore[reportGeneralTypeIssues]
    ) -> Float[Array, "seq_len hidden_size"]:
        tokens = jax.vmap(self.token_embedder)(token_ids)
        segments = jax.vmap(self.segment_embedder)(segment_ids)
        positions = jax.vmap(self.position_embedder)(position_ids)
        embedded_inputs = tokens + segments + positions
        embedded_inputs = jax.vmap(self.layernorm)(embedded_inputs)
        embedded_inputs = self.dropout(
            embedded_inputs, inference=not enable_dropout, key=key
        )
        return embedded_inputs


class FeedForwardBlock(eqx.Module):
    """A single transformer feed forward block."""

    mlp: eqx.nn.Linear
    output: eqx.nn.Linear
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dropout_rate: float,
        key: jax.random.PRNGKey,  # pyright: ignore[reportGeneralTypeIssues]
    ):
        mlp_key, output_key = jax.random.split(key)
        self.mlp = eqx.nn.Linear(
            in_features=hidden_size, out_features=intermediate_size, key=mlp_key
        )
        self.output = eqx.nn.Linear(
            in_features=intermediate_size, out_features=hidden_size, key=output_key
        )

        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        inputs: Float[Array, " hidden_size"],
        enable_dropout: bool = True,
        key: jax.random.PRNGKey | None = None,  # pyright: ignore[reportGeneralTypeIssues]
    ) -> Float[Array, " hidden_size"]:
        # Feed-forward.
        hidden = self.mlp(inputs)
        hidden = jax.nn.gelu(hidden)

        # Project back to input size.
        output = self.output(hidden)
        output = self.dropout(output, inference=not enable_dropout, key=key)

        # Residual and layer norm.
        output += inputs
        output = self.layernorm(output)

        return output


class AttentionBlock(eqx.Module):
    """A single transformer attention block."""

    attention: eqx.nn.MultiheadAttention
    layernorm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,  # pyright: ignore[reportGeneralTypeIssues]
    ):
        self.num_heads = num_heads
        self.attention = eqx.nn.MultiheadAttention(
            num_heads=num_heads,
            query_size=hidden_size,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            dropout_p=attention_dropout_rate,
            key=key,
        )
        self.layernorm = eqx.nn.LayerNorm(shape=hidden_size)
        self.dropout = eqx.nn.Dropout(dropout_rate)

    def __call__(
        self,
        inputs: Float[Array, "seq_len hidden_size"],
        mask: Int[Array, " seq_len"] | None,
        enable_dropout: bool = False,
        key: "jax.random.PRNGKey" = None,  # noqa: UP037 (as written)  # pyright: ignore[reportGeneralTypeIssues]
    ) -> Float[Array, "seq_len hidden_size"]:
        if mask is not None:
            mask = self.make_self_attention_mask(mask)
        attention_key, dropout_key = (
            (None, None) if key is None else jax.random.split(key)
        )

        attention_output = self.attention(
            query=inputs,
            key_=inputs,
            value=inputs,
            mask=mask,
            inference=not enable_dropout,
            key=attention_key,
        )

        result = attention_output
        result = self.dropout(result, inference=not enable_dropout, key=dropout_key)
        result = result + inputs
        result = jax.vmap(self.layernorm)(result)
        return result

    def make_self_attention_mask(
        self, mask: Int[Array, " seq_len"]
    ) -> Float[Array, "num_heads seq_len seq_len"]:
        """Create self-attention mask from sequence-level mask."""
        mask = jnp.multiply(
            jnp.expand_dims(mask, axis=-1), jnp.expand_dims(mask, axis=-2)
        )
        mask = jnp.expand_dims(mask, axis=-3)
        mask = jnp.repeat(mask, repeats=self.num_heads, axis=-3)
        return mask.astype(jnp.float32)


class TransformerLayer(eqx.Module):
    """A single transformer layer."""

    attention_block: AttentionBlock
    ff_block: FeedForwardBlock

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,  # pyright: ignore[reportGeneralTypeIssues]
    ):
        attention_key, ff_key = jax.random.split(key)

        self.attention_block = AttentionBlock(
            hidden_size=hidden_size,
            num_heads=num_heads,
            dropout_rate=dropout_rate,
            attention_dropout_rate=attention_dropout_rate,
            key=attention_key,
        )
        self.ff_block = FeedForwardBlock(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            dropout_rate=dropout_rate,
            key=ff_key,
        )

    def __call__(
        self,
        inputs: Float[Array, "seq_len hidden_size"],
        mask: Int[Array, " seq_len"] | None = None,
        *,
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,  # pyright: ignore[reportGeneralTypeIssues]
    ) -> Float[Array, "seq_len hidden_size"]:
        attn_key, ff_key = (None, None) if key is None else jax.random.split(key)
        attention_output = self.attention_block(
            inputs, mask, enable_dropout=enable_dropout, key=attn_key
        )
        seq_len = inputs.shape[0]
        ff_keys = None if ff_key is None else jax.random.split(ff_key, num=seq_len)
        output = jax.vmap(self.ff_block, in_axes=(0, None, 0))(
            attention_output, enable_dropout, ff_keys
        )
        return output


class Encoder(eqx.Module):
    """Full BERT encoder."""

    embedder_block: EmbedderBlock
    layers: list[TransformerLayer]
    pooler: eqx.nn.Linear

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        type_vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        intermediate_size: int,
        num_layers: int,
        num_heads: int,
        dropout_rate: float,
        attention_dropout_rate: float,
        key: jax.random.PRNGKey,  # pyright: ignore[reportGeneralTypeIssues]
    ):
        embedder_key, layer_key, pooler_key = jax.random.split(key, num=3)
        self.embedder_block = EmbedderBlock(
            vocab_size=vocab_size,
            max_length=max_length,
            type_vocab_size=type_vocab_size,
            embedding_size=embedding_size,
            hidden_size=hidden_size,
            dropout_rate=dropout_rate,
            key=embedder_key,
        )

        layer_keys = jax.random.split(layer_key, num=num_layers)
        self.layers = []
        for layer_key in layer_keys:
            self.layers.append(
                TransformerLayer(
                    hidden_size=hidden_size,
                    intermediate_size=intermediate_size,
                    num_heads=num_heads,
                    dropout_rate=dropout_rate,
                    attention_dropout_rate=attention_dropout_rate,
                    key=layer_key,
                )
            )

        self.pooler = eqx.nn.Linear(
            in_features=hidden_size, out_features=hidden_size, key=pooler_key
        )

    def __call__(
        self,
        token_ids: Int[Array, " seq_len"],
        position_ids: Int[Array, " seq_len"],
        segment_ids: Int[Array, " seq_len"],
        *,
        enable_dropout: bool = False,
        key: jax.random.PRNGKey | None = None,  # pyright: ignore[reportGeneralTypeIssues]
    ) -> dict[str, Array]:
        emb_key, l_key = (None, None) if key is None else jax.random.split(key)

        embeddings = self.embedder_block(
            token_ids=token_ids,
            position_ids=position_ids,
            segment_ids=segment_ids,
            enable_dropout=enable_dropout,
            key=emb_key,
        )

        # We assume that all 0-values should be masked out.
        mask = jnp.asarray(token_ids != 0, dtype=jnp.int32)

        x = embeddings
        layer_outputs = []
        for layer in self.layers:
            cl_key, l_key = (None, None) if l_key is None else jax.random.split(l_key)
            x = layer(x, mask, enable_dropout=enable_dropout, key=cl_key)
            layer_outputs.append(x)

        # BERT pooling.
        # The first token in the last layer is the embedding of the "[CLS]" token.
        first_token_last_layer = x[..., 0, :]
        pooled = self.pooler(first_token_last_layer)
        pooled = jnp.tanh(pooled)

        # (As written: "layers" is a list, where the annotation says Array.)
        return {"embeddings": embeddings, "layers": layer_outputs, "pooled": pooled}  # pyright: ignore[reportReturnType]


class BertClassifier(eqx.Module):
    """BERT classifier."""

    encoder: Encoder
    classifier_head: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, config: Mapping, num_classes: int, key: jax.random.PRNGKey):  # pyright: ignore[reportGeneralTypeIssues]
        encoder_key, head_key = jax.random.split(key)

        self.encoder = Encoder(
            vocab_size=config["vocab_size"],
            max_length=config["max_position_embeddings"],
            type_vocab_size=config["type_vocab_size"],
            embedding_size=config["hidden_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            dropout_rate=config["hidden_dropout_prob"],
            attention_dropout_rate=config["attention_probs_dropout_prob"],
            key=encoder_key,
        )
        self.classifier_head = eqx.nn.Linear(
            in_features=config["hidden_size"], out_features=num_classes, key=head_key
        )
        self.dropout = eqx.nn.Dropout(config["hidden_dropout_prob"])

    def __call__(
        self,
        inputs: dict[str, Int[Array, " seq_len"]],
        enable_dropout: bool = True,
        key: jax.random.PRNGKey = None,  # pyright: ignore[reportGeneralTypeIssues]
    ) -> Float[Array, " num_classes"]:
        seq_len = inputs["token_ids"].shape[-1]
        position_ids = jnp.arange(seq_len)

        e_key, d_key = (None, None) if key is None else jax.random.split(key)

        pooled_output = self.encoder(
            token_ids=inputs["token_ids"],
            segment_ids=inputs["segment_ids"],
            position_ids=position_ids,
            enable_dropout=enable_dropout,
            key=e_key,
        )["pooled"]
        pooled_output = self.dropout(
            pooled_output, inference=not enable_dropout, key=d_key
        )

        return self.classifier_head(pooled_output)


# --- docs/examples/stateful.ipynb, as written --------------------------------


# This model is just a weird mish-mash of stateful and non-stateful layers for
# demonstration purposes, it isn't doing any clever.
class Model(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        key1, key2, key3, key4 = jr.split(key, 4)
        self.norm1 = eqx.nn.BatchNorm(input_size=3, axis_name="batch")
        self.spectral_linear = eqx.nn.SpectralNorm(
            layer=eqx.nn.Linear(in_features=3, out_features=32, key=key1),
            weight_name="weight",
            key=key2,
        )
        self.norm2 = eqx.nn.BatchNorm(input_size=32, axis_name="batch")
        self.linear1 = eqx.nn.Linear(in_features=32, out_features=32, key=key3)
        self.linear2 = eqx.nn.Linear(in_features=32, out_features=3, key=key4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x = jax.nn.relu(x)
        x, state = self.norm2(x, state)
        x = self.linear1(x)
        x = jax.nn.relu(x)
        x = self.linear2(x)
        return x, state


# --- phalanx trains them -----------------------------------------------------

# The example's Tiny-BERT config at test size: its vocabulary, widths, depth
# and sequence length shrunk; its dropout rates kept.
BERT_CONFIG = {
    "vocab_size": 32,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "hidden_act": "gelu",
    "intermediate_size": 32,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 8,
    "type_vocab_size": 2,
    "initializer_range": 0.02,
}
KEY_BIAS = "encoder.layers[0].attention_block.attention.key_proj.bias"


def sentences(n: int, seed: int = 0):
    """Token ids (0-padded, as the example's mask assumes), segment ids and
    binary labels."""
    rng = np.random.default_rng(seed)
    seq = BERT_CONFIG["max_position_embeddings"]
    tokens = rng.integers(1, BERT_CONFIG["vocab_size"], size=(n, seq))
    lengths = rng.integers(seq // 2, seq + 1, size=n)
    padding = np.arange(seq)[None, :] >= lengths[:, None]
    tokens[padding] = 0
    segments = np.arange(seq)[None, :] >= (lengths[:, None] // 2)
    inputs = {
        "token_ids": tokens.astype(np.int32),
        "segment_ids": segments.astype(np.int32),
    }
    return inputs, rng.integers(0, 2, size=n).astype(np.int32)


class BertTrainer(px.DataParallelTrainer[BertClassifier]):
    """Evaluates as the example does: ``partial(model, enable_dropout=False)``."""

    @override
    def inference_model(self, model):
        return functools.partial(model, enable_dropout=False)


def bert(
    strategy: px.Strategy,
    trainer_class: type[px.DataParallelTrainer] = BertTrainer,
) -> px.DataParallelTrainer:
    classifier = BertClassifier(BERT_CONFIG, num_classes=2, key=jr.key(5678))
    # The example's optimizer, at a learning rate that moves a tiny model.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    return trainer_class(classifier, tx, strategy=strategy, progress=False)


@pytest.mark.slow
def test_bert_classifier_with_adam_is_equivalent_under_every_setup():
    # Dropout on: each example's mask comes from (seed, step, example), so
    # every set-up draws the reference's masks.
    results = px.testing.assert_equivalent(bert, [sentences(16)], steps=2)
    assert len(results) == 5
    for name, result in results.items():
        assert result.gradient <= 1e-4 and result.values <= 1e-4, name
        # The key bias's true gradient is 0 (softmax ignores a constant added
        # to every key): only it may have adam amplify its rounding.
        assert set(result.amplified) <= {KEY_BIAS}, name
    for kind in ("FullyShardedStrategy", "MeshStrategy"):
        (split,) = [r for n, r in results.items() if n.startswith(kind)]
        assert "encoder.layers[0].ff_block.mlp.weight" in split.split, kind
        assert len(split.split) >= 8, kind


def test_bert_classifier_predicts_and_evaluates_with_dropout_off():
    inputs, labels = sentences(12, seed=1)
    trainer = bert(px.PmapStrategy())
    # As the example evaluates: the model with dropout off (jitted: one
    # compilation, not one per operation).
    evaluate = jax.vmap(functools.partial(trainer.model, enable_dropout=False))
    expected = jax.jit(evaluate)(inputs)
    np.testing.assert_allclose(
        np.asarray(trainer.predict(inputs)), np.asarray(expected), atol=1e-6
    )
    results = trainer.evaluate([(inputs, labels)])
    loss = optax.softmax_cross_entropy_with_integer_labels(expected, labels).mean()
    assert results["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert trainer.evaluate([(inputs, labels)]) == results


def test_a_model_that_keeps_dropout_on_is_refused_at_inference():
    # BertClassifier's own enable_dropout=True overrides inference mode: with
    # no key at inference its dropout fails, and phalanx says why.
    trainer = bert(px.ShardingStrategy(), trainer_class=px.DataParallelTrainer)
    inputs, labels = sentences(8)
    fix = r"override DataParallelTrainer.inference_model .* enable_dropout=False"
    for call in (
        lambda: trainer.predict(inputs),
        lambda: trainer.evaluate([(inputs, labels)]),
    ):
        with pytest.raises(RuntimeError, match="draws random numbers") as caught:
            call()
        assert "Dropout requires a key" in str(caught.value)
        assert re.search(fix, str(caught.value), re.IGNORECASE)


# The example's BatchNorm leaves `mode` unset, which Equinox warns about.
unset_mode = pytest.mark.filterwarnings("ignore:When `eqx.nn.BatchNorm")


def regression(n: int):
    """The example's data: 3 features, targets sin(x) + 1."""
    xs = np.asarray(jr.normal(jr.key(1), (n, 3)))
    return xs, (np.sin(xs) + 1).astype(np.float32)


def stateful(strategy):
    model, state = eqx.nn.make_with_state(Model)(jr.key(5678))
    return px.DataParallelTrainer(
        model,
        optax.adam(3e-4),  # the example's optimizer
        strategy=strategy,
        model_state=state,
        loss="mse",  # the example's loss: a mean of squares
        progress=False,
    )


@unset_mode
def test_stateful_model_is_equivalent_where_batchnorm_sees_the_global_batch():
    # BatchNorm(axis_name="batch") normalises over the global batch only under
    # ShardingStrategy; per-device strategies normalise each device's slice
    # (documented in the strategies guide), which the next test shows caught.
    results = px.testing.assert_equivalent(
        stateful, [regression(32)], strategies=[px.ShardingStrategy()], steps=3
    )
    (result,) = results.values()
    assert result.gradient <= 1e-4 and result.model_state <= 1e-4
    # A bias before BatchNorm: adam amplifies its rounding, and says so.
    assert set(result.amplified) <= {"spectral_linear.layer.bias"}


@unset_mode
def test_stateful_model_per_device_statistics_are_named():
    with pytest.raises(AssertionError) as caught:
        px.testing.assert_equivalent(
            stateful, [regression(32)], strategies=[px.PmapStrategy()], steps=1
        )
    text = str(caught.value)
    assert text.startswith("PmapStrategy on 8 devices: at step 0")
    assert "BatchNorm statistics per device" in text
