"""Built-in per-example losses and metrics.

Every loss returns one value per example; the trainer weights and sums them
and divides once by the global weight, so no reduction is a mean of means.
"""

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Shaped

from ._typing import PerExample


def cross_entropy(
    logits: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> PerExample:
    """Softmax cross-entropy against integer class labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def accuracy(
    logits: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> PerExample:
    """1 where the arg-max class is the label, else 0."""
    return (jnp.argmax(logits, axis=-1) == labels).astype(logits.dtype)


def mse(
    outputs: Float[Array, "batch ..."], targets: Shaped[Array, "batch ..."]
) -> PerExample:
    """Squared error, averaged over each example's features."""
    if targets is None:
        raise ValueError(
            "loss='mse' needs targets y, but the batches' y is None; yield (x, y) "
            "batches, or pass a loss= function that needs no targets"
        )
    if targets.size != outputs.size:
        raise ValueError(
            f"loss='mse': targets have per-example shape {tuple(targets.shape[1:])} "
            f"but the model outputs {tuple(outputs.shape[1:])}; give targets as "
            "many values per example as the model outputs"
        )
    targets = targets.reshape(outputs.shape).astype(outputs.dtype)
    error = jnp.square(outputs - targets)
    return jnp.mean(error.reshape(error.shape[0], -1), axis=1)
