"""Built-in per-example losses, by the names ``loss=`` takes, and the
metrics each reports by default.

Every loss returns one value per example; the trainer weights and sums them
and divides once by the global weight, so no reduction is a mean of means.
"""

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, Shaped

from ._typing import LossFn, LossName, PerExample


def cross_entropy(
    logits: Float[Array, "batch classes"], labels: Int[Array, " batch"]
) -> PerExample:
    """Softmax cross-entropy against integer class labels."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def categorical_cross_entropy(
    logits: Float[Array, "batch classes"], targets: Shaped[Array, "batch ..."]
) -> PerExample:
    """Softmax cross-entropy against one-hot or soft labels (a probability
    per class, as Keras' ``categorical_crossentropy`` takes)."""
    if targets.shape != logits.shape:
        raise ValueError(
            f"loss='categorical_cross_entropy': targets have per-example shape "
            f"{tuple(targets.shape[1:])} but the model outputs "
            f"{tuple(logits.shape[1:])}; give one probability per class (one-hot: "
            "np.eye(classes)[y]), or pass integer labels with loss='cross_entropy'"
        )
    return optax.softmax_cross_entropy(logits, targets.astype(logits.dtype))


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


# What each ``loss=`` name computes.
LOSSES: dict[LossName, LossFn] = {
    "cross_entropy": cross_entropy,
    "categorical_cross_entropy": categorical_cross_entropy,
    "mse": mse,
}


def default_metric_names(loss: LossName | None) -> tuple[str, ...]:
    """The metrics a built-in loss reports beside itself, by their names in
    `px.metrics`' built-in ones: accuracy for the cross-entropies (the arg-max
    class against the label, or against the targets' arg-max), none for the
    others (and for a loss function)."""
    return (
        ("accuracy",) if loss in ("cross_entropy", "categorical_cross_entropy") else ()
    )
