"""`px.models.Linear`: an affine map of one example, as an Equinox module. It
takes one example, never a batch (the trainer maps it over the batch), and
keeps no state beyond its parameters."""

from typing import final

import equinox as eqx
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, PRNGKeyArray, jaxtyped

from ._features import check_features


@final
class Linear(eqx.Module):
    """An affine map of one example: ``y = W x + b``.

    Example:
        ```python
        model = px.models.Linear(3, 1, key=jax.random.key(0))
        y = model(jnp.ones(3))  # shape (1,)
        ```
    """

    layer: eqx.nn.Linear
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)

    def __init__(
        self, in_size: int, out_size: int, *, use_bias: bool = True, key: PRNGKeyArray
    ):
        """
        Args:
            in_size: features of one input example.
            out_size: features of one output.
            use_bias: whether to add a learned bias.
            key: initialises the weights.
        """
        self.layer = eqx.nn.Linear(in_size, out_size, use_bias=use_bias, key=key)
        self.in_size = in_size
        self.out_size = out_size

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, " in"]) -> Float[Array, " out"]:
        """The output for one example (no batch axis)."""
        check_features(x, self.in_size, "Linear")
        return self.layer(x.astype(jnp.result_type(self.layer.weight)))
