"""The built-in metrics of per-token targets (a language model's: outputs
(batch, tokens, classes), targets (batch, tokens)): accuracy and the
confusion matrix over every token, negative labels (an ignore index) left
out; the AUC, and targets that fit the outputs in no way, refused in one
line naming the metric and the shapes, before the first step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxtyping import Array, Float, Int, PRNGKeyArray

import phalanx as px


B, T, V = 8, 4, 5
_rng = np.random.default_rng(0)
X = _rng.integers(0, V, (B, T)).astype(np.int32)
Y = _rng.integers(0, V, (B, T)).astype(np.int32)
TOKEN = np.arange(T)[None, :]
# Ignored tokens (PyTorch's ignore index -100): example i's first i % 4. Hit
# tokens: all but the first. Over tokens, 9 of 10 counted ones are hits; the
# mean of the examples' accuracies is 0.9375.
IGNORED = TOKEN < np.arange(B)[:, None] % T
HIT = TOKEN >= 1


class Tagger(eqx.Module):
    """A class per token: an embedding, then a linear layer."""

    embedding: eqx.nn.Embedding
    linear: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        embedding, linear = jax.random.split(key)
        self.embedding = eqx.nn.Embedding(V, 6, key=embedding)
        self.linear = eqx.nn.Linear(6, V, key=linear)

    def __call__(self, ids: Int[Array, " tokens"]) -> Float[Array, "tokens classes"]:
        return jax.vmap(lambda i: self.linear(self.embedding(i)))(ids)


def token_loss(
    logits: Float[Array, "batch tokens classes"], targets: Int[Array, "batch tokens"]
) -> Float[Array, " batch"]:
    """Each example's cross-entropy over its counted tokens."""
    counted = targets >= 0
    each = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(counted, targets, 0)
    )
    tokens = jnp.maximum(jnp.sum(counted, axis=-1), 1).astype(each.dtype)
    return jnp.sum(jnp.where(counted, each, 0.0), axis=-1) / tokens


def predicted(model: Tagger) -> np.ndarray:
    return np.asarray(jax.vmap(model)(jnp.asarray(X))).argmax(-1)


def by_hand(model: Tagger, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Accuracy over the counted tokens, and their confusion matrix."""
    counted = targets >= 0
    matrix = np.zeros((V, V))
    np.add.at(matrix, (targets[counted], predicted(model)[counted]), 1)
    return float(np.mean(predicted(model)[counted] == targets[counted])), matrix


def test_accuracy_and_confusion_count_every_token_but_ignored_ones():
    model = Tagger(key=jax.random.key(0))
    guess = predicted(model)
    targets = np.where(IGNORED, -100, np.where(HIT, guess, (guess + 1) % V))
    targets = targets.astype(np.int32)
    trainer = px.DataParallelTrainer(
        model,
        optax.sgd(0.5),
        loss=token_loss,
        metrics=("accuracy", "confusion_matrix"),
        progress=False,
    )
    trainer.fit([(X, targets)], epochs=1)  # one step: scored on the model before it
    accuracy, matrix = by_hand(model, targets)
    logged = trainer.history[-1]
    assert accuracy == pytest.approx(0.9)
    assert logged["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    np.testing.assert_array_equal(logged["confusion_matrix"], matrix)
    # Evaluated with no token ignored, on the model after the step.
    results = trainer.evaluate([(X, Y)])
    accuracy, matrix = by_hand(trainer.model, Y)
    assert results["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    np.testing.assert_array_equal(results["confusion_matrix"], matrix)


def _outputs_only(logits, targets):
    del targets
    return jnp.mean(jnp.square(logits), axis=(1, 2))


def top2(outputs, targets):  # written for one label per example
    best = jnp.argsort(outputs, axis=-1)[:, -2:]
    return jnp.any(best == targets[:, None], axis=-1).astype(jnp.float32)


@pytest.mark.parametrize(
    ("metrics", "targets", "message"),
    [
        (
            ("auc",),
            Y,
            "metrics(): px.metrics.auc: targets of shape (8, 4) label each token of "
            "outputs (8, 4, 5), but the AUC ranks one score per example (a token's "
            "would need a histogram per class of the vocabulary); leave 'auc' out "
            "for per-token targets and score tokens with accuracy, f1, precision, "
            "recall or confusion_matrix",
        ),
        (
            ("accuracy",),
            Y[:, :3],
            "metrics(): the built-in 'accuracy': targets of shape (8, 3) do not fit "
            "outputs of shape (8, 4, 5); pass class labels of shape (8, 4) (per "
            "token, negative ones left out) or one-hot targets of shape (8, 4, 5)",
        ),
        (
            ("f1",),
            Y[:, 0],
            "metrics(): px.metrics.f1: targets of shape (8,) do not fit outputs of "
            "shape (8, 4, 5); pass class labels of shape (8, 4) (per token, "
            "negative ones left out) or one-hot targets of shape (8, 4, 5)",
        ),
        (  # a failure inside a metric names it, not the model or the batch
            {"top2": top2},
            Y,
            "metrics(): metrics['top2'] fails on outputs float32[8, 4, 5] and "
            "targets int32[8, 4], which the model and loss ran on: eq got "
            "incompatible shapes for broadcasting: (8, 2, 5), (8, 1, 4); fix the "
            "metric for them, or leave it out of metrics=",
        ),
    ],
)
def test_targets_a_metric_cannot_score_are_refused_before_the_first_step(
    metrics, targets, message
):
    trainer = px.DataParallelTrainer(
        Tagger(key=jax.random.key(0)),
        optax.sgd(0.5),
        loss=_outputs_only,
        metrics=metrics,
        progress=False,
    )
    with pytest.raises(ValueError) as refused:
        trainer.fit([(X, targets)], epochs=1)
    assert str(refused.value) == message
    assert trainer.history.epochs == []
