"""`px.models.TransformerBlock`: a pre-norm self-attention block of one
example's sequence, attending with `dot_product_attention`, so that it stays
exact when a strategy splits the sequence over devices. Everything else in it
is per position. It keeps no state beyond its parameters (no dropout)."""

from typing import final

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._typing import validates_own_arguments
from .._validate import is_int
from ._attention import IMPLEMENTATIONS, Implementation, dot_product_attention


@final
class TransformerBlock(eqx.Module):
    """Self-attention then an MLP, each on a layer-normed input and added
    back (pre-norm residual): ``x + attention(norm(x))``, then
    ``x + mlp(norm(x))``. Shape-preserving, so `Stacked` stacks it.

    The query, key and value projections are one layer, `qkv_proj` (one
    matrix product instead of three), whose outputs are the heads in order,
    each head's query, key and value together: a tensor rule splitting its
    weight's first axis (and `output_proj`'s second) splits whole heads.

    Example:
        ```python
        blocks = px.models.Stacked(
            lambda key: px.models.TransformerBlock(64, heads=4, key=key), 2,
            key=jax.random.key(0),
        )
        y = blocks(jnp.ones((128, 64)))  # (sequence, width) -> the same
        ```
    """

    attention_norm: eqx.nn.LayerNorm
    qkv_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    mlp_norm: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear
    width: int = eqx.field(static=True)
    heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    implementation: Implementation = eqx.field(static=True)

    @validates_own_arguments
    def __init__(
        self,
        width: int,
        heads: int,
        mlp_width: int | None = None,
        *,
        causal: bool = True,
        implementation: Implementation = "auto",
        key: PRNGKeyArray,
    ):
        """
        Args:
            width: features per position, in and out.
            heads: attention heads; they split `width` evenly.
            mlp_width: the MLP's hidden width (None: 4 × `width`).
            causal: each position attends only to itself and earlier ones.
            implementation: how attention exchanges a split sequence
                (`dot_product_attention`).
            key: initialises the weights.

        Raises:
            ValueError: a width or `heads` is not a positive int, `heads`
                does not divide `width`, or `implementation` is unknown.
        """
        mlp_width = 4 * width if mlp_width is None else mlp_width
        sizes = {"width": width, "heads": heads, "mlp_width": mlp_width}
        if any(not is_int(size) or size < 1 for size in sizes.values()):
            raise ValueError(f"{sizes}: each must be a positive int")
        if width % heads:
            raise ValueError(
                f"heads={heads} does not divide width={width}; each head takes "
                f"width / heads features, e.g. heads={_divisor(width, heads)}"
            )
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation={implementation!r} is not one of {IMPLEMENTATIONS}"
            )
        keys = jr.split(key, 4)
        self.attention_norm = eqx.nn.LayerNorm(width)
        self.qkv_proj = eqx.nn.Linear(width, 3 * width, key=keys[0])
        self.output_proj = eqx.nn.Linear(width, width, key=keys[1])
        self.mlp_norm = eqx.nn.LayerNorm(width)
        self.mlp_in = eqx.nn.Linear(width, mlp_width, key=keys[2])
        self.mlp_out = eqx.nn.Linear(mlp_width, width, key=keys[3])
        self.width = width
        self.heads = heads
        self.causal = causal
        self.implementation = implementation

    @validates_own_arguments
    def __call__(
        self, x: Float[Array, "seq width"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq width"]:
        """The block's output for one sequence (no batch axis)."""
        del key  # no dropout
        if x.ndim != 2 or x.shape[1] != self.width:
            raise ValueError(
                f"TransformerBlock expects one sequence of shape (seq, {self.width}), "
                f"got x.shape={tuple(x.shape)}"
            )
        seq = x.shape[0]
        each = jax.vmap  # the layers below act on one position
        normed = each(self.attention_norm)(x)
        # (seq, heads, 3, dim): each head's query, key and value together.
        qkv = each(self.qkv_proj)(normed).reshape(
            seq, self.heads, 3, self.width // self.heads
        )
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attended = dot_product_attention(
            q, k, v, causal=self.causal, implementation=self.implementation
        )
        x = x + each(self.output_proj)(attended.reshape(seq, self.width))
        hidden = jax.nn.gelu(each(self.mlp_in)(each(self.mlp_norm)(x)))
        return x + each(self.mlp_out)(hidden)


def _divisor(width: int, heads: int) -> int:
    """The divisor of `width` nearest `heads`, to suggest."""
    return min(
        (h for h in range(1, width + 1) if width % h == 0), key=lambda h: abs(h - heads)
    )
