"""`px.models.MLP`: a multi-layer perceptron of one example, as an Equinox
module. It takes one example, never a batch (the trainer maps it over the
batch), and keeps no state beyond its parameters (no dropout, no BatchNorm)."""

from collections.abc import Callable, Sequence
from typing import final

import equinox as eqx
import jax
import jax.random as jr
from beartype import beartype
from jaxtyping import Array, Float, PRNGKeyArray, jaxtyped

from .._validate import is_int
from ._features import check_features


@final
class MLP(eqx.Module):
    """A multi-layer perceptron of one example, with hidden widths of your choice.

    Example:
        ```python
        model = px.models.MLP(784, 10, hidden=(256, 128), key=jax.random.key(0))
        logits = model(jnp.ones(784))  # shape (10,)
        ```
    """

    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable[[Array], Array]
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        hidden: Sequence[int] = (256, 128),
        *,
        activation: Callable[[Array], Array] = jax.nn.relu,
        key: PRNGKeyArray,
    ):
        """
        Args:
            in_size: features of one input example.
            out_size: features of one output (e.g. classes, for logits).
            hidden: the width of each hidden layer, input side first; () for none.
            activation: applied after every hidden layer.
            key: initialises the weights.
        """
        widths = [in_size, *hidden, out_size]
        if any(not is_int(w) or w < 1 for w in widths):
            raise ValueError(
                f"in_size={in_size}, hidden={tuple(hidden)}, out_size={out_size}: "
                "every width must be a positive int, e.g. hidden=(256, 128)"
            )
        keys = jr.split(key, len(widths) - 1)
        self.layers = tuple(
            eqx.nn.Linear(a, b, key=k)
            for a, b, k in zip(widths[:-1], widths[1:], keys, strict=True)
        )
        self.activation = activation
        self.in_size = in_size
        self.out_size = out_size

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        """The output for one example (no batch axis)."""
        check_features(x, self.in_size, "MLP")
        x = x.astype(self.layers[0].weight.dtype)
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)
