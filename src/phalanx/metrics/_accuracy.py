"""Accuracy: the share of examples whose most likely class is the true one,
or, for per-token targets, the share of tokens over every token."""

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._labels import predicted_labels, true_labels
from ._statistic import Statistic


class TokenAccuracy(Statistic):
    """Each example's correctly predicted tokens and tokens counted (those
    with a label, not an ignore index); the total is both, over every
    example, and the accuracy their ratio: a mean over tokens, not over
    examples' means."""

    hits: Float[Array, " batch"]
    tokens: Float[Array, " batch"]

    def total(self, weight: Float[Array, " batch"]) -> Float[Array, "2"]:
        return jnp.stack([weight @ self.hits, weight @ self.tokens])

    def read(self, total: np.ndarray) -> float:
        return float(total[0] / total[1]) if total[1] else float("nan")


def accuracy(outputs: Array, targets: Array) -> Float[Array, " batch"] | Statistic:
    """1 where the predicted class (the arg-max score; for one score per
    example, above 0) is the true one (the label, or the arg-max of one-hot
    or soft targets), else 0: averaged over examples as the loss is.

    Per-token targets (outputs of shape (batch, *tokens, classes), labels of
    shape (batch, *tokens), or one-hot targets of the outputs' shape) are
    scored over every token together, as Keras' ``SparseCategoricalAccuracy``
    and torchmetrics' ``Accuracy(multidim_average="global")`` do: correct
    tokens over tokens counted, each token of its example's weight. A
    negative label (an ignore index, e.g. -100 as PyTorch's) is left out of
    both, as the loss should leave it out too.

    Raises:
        MetricArgumentError: targets of a shape that fits none of these.
    """
    true = true_labels(outputs, targets, "the built-in 'accuracy'")
    hit = predicted_labels(outputs, from_logits=True) == true
    if true.ndim == 1:
        dtype = outputs.dtype if jnp.issubdtype(outputs.dtype, jnp.floating) else None
        return hit.astype(dtype or jnp.float32)
    counted = true >= 0
    axes = tuple(range(1, true.ndim))
    return TokenAccuracy(
        jnp.sum(hit & counted, axis=axes, dtype=jnp.float32),
        jnp.sum(counted, axis=axes, dtype=jnp.float32),
    )
