"""Two wrong gradients from XLA's SPMD partitioner, in plain `jax.jit`, as
phalanx works around them (`MeshStrategy`, issue 41); written up for the
upstream report in docs/guides/meshes.md ("Two XLA partitioner bugs").

Seen with jax and jaxlib 0.10.2 (Shardy, the default, and GSPMD propagation
alike), on 8 CPU devices; the partitioner is XLA's, shared by every backend.
Each test asserts the bug as it is: when one fails, XLA has fixed it, and
phalanx's workaround (named in the test) may go.

1. A grouped (or depthwise) convolution's weight gradient is a convolution
   with ``batch_group_count > 1`` summing over the examples. With the
   examples split over one mesh axis and replicated over another, XLA adds
   the devices' partial sums over *every* device (an all-reduce with
   ``replica_groups={{0,...,7}}``): the gradient comes out multiplied by the
   replicated axis's size. (``PartitionConvolutionWithSpatialDimension
   HaloExchangeOnRHS`` in ``xla/service/spmd/convolution_handler.cc`` ends
   in ``create_cross_partition_all_reduce(..., {}, ...)``.)
2. ``relu(x @ w0.T) @ w1.T`` with x split over ``("data", "fsdp")``, w0's
   rows over ``tensor``, w1's rows over ``tensor`` and its columns over
   ``fsdp``: the gradient of w0 is wrong. Partitioning the backward dot
   ``g @ w1`` XLA reorders the batch's blocks from (data, fsdp) to (fsdp,
   data) with a collective-permute and labels the result as if it had not:
   two devices' rows trade places before the elementwise product with the
   forward's activations.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from phalanx.strategies._example_sums import examples_summed_by_dots


def mesh(**sizes: int) -> Mesh:
    """All 8 devices, the last axis varying fastest (as `MeshStrategy`'s)."""
    grid = np.array(jax.devices()).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def placed(m: Mesh, x: np.ndarray, *spec) -> jax.Array:
    return jax.device_put(x, NamedSharding(m, P(*spec)))


def depthwise_loss(w: jax.Array, x: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, w, (1,), "SAME", feature_group_count=4)
    return jnp.sum(y**2)


def test_a_grouped_convolutions_weight_gradient_is_counted_per_replica():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4, 16)).astype(np.float32)  # (batch, channels, length)
    w = rng.normal(size=(4, 1, 3)).astype(np.float32)  # depthwise: 4 groups
    grad = jax.jit(jax.grad(depthwise_loss))
    want = grad(w, x)
    for data, tensor in ((4, 2), (2, 4)):
        m = mesh(data=data, tensor=tensor)  # the batch replicated over tensor
        args = placed(m, w), placed(m, x, "data")
        have = grad(*args)
        np.testing.assert_allclose(have, tensor * want, rtol=1e-5)  # the bug
        # phalanx's workaround: the same function, the convolution summing
        # over the examples computed as a dot product.
        fixed = jax.jit(examples_summed_by_dots(jax.grad(depthwise_loss)))(*args)
        np.testing.assert_allclose(fixed, want, rtol=1e-5)
    # The batch split over every device: right.
    m = mesh(data=8)
    args = placed(m, w), placed(m, x, "data")
    np.testing.assert_allclose(grad(*args), want, rtol=1e-5)


def mlp_loss(w: list[jax.Array], x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.sin(jax.nn.relu(x @ w[0].T) @ w[1].T))


def test_a_parameter_split_over_a_batch_axis_beside_tensor_reorders_the_batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    w = [
        rng.normal(size=(8, 4)).astype(np.float32),
        rng.normal(size=(8, 8)).astype(np.float32),
    ]
    want = jax.jit(jax.grad(mlp_loss))(w, x)
    m = mesh(data=2, fsdp=2, tensor=2)
    args = [placed(m, w[0], "tensor"), placed(m, w[1], "tensor", "fsdp")]
    batch = placed(m, x, ("data", "fsdp"))
    have = jax.jit(jax.grad(mlp_loss))(args, batch)
    gap = np.abs(have[0] - want[0]).max() / np.abs(want[0]).max()
    assert gap > 0.5, gap  # the bug: w0's gradient is wrong...
    np.testing.assert_allclose(have[1], want[1], rtol=1e-4, atol=1e-5)  # w1's not

    # phalanx's workaround (MeshStrategy.use_shardings): compute with each
    # parameter gathered over the batch axes, split over tensor only.
    def gathered(w, x):
        w = [
            jax.lax.with_sharding_constraint(w[0], NamedSharding(m, P("tensor"))),
            jax.lax.with_sharding_constraint(w[1], NamedSharding(m, P("tensor"))),
        ]
        return mlp_loss(w, x)

    fixed = jax.jit(jax.grad(gathered))(args, batch)
    for a, b in zip(fixed, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        # (input shape, layout, groups, stride, dilation, input dilation, padding)
        ((4, 4, 9), ("NCH", "OIH", "NCH"), 4, 1, 1, 1, (1, 1)),
        ((4, 9, 4), ("NHC", "HIO", "NHC"), 2, 2, 1, 1, (0, 2)),
        ((4, 4, 9), ("NCH", "OIH", "NCH"), 2, 1, 2, 2, (2, 2)),
        ((4, 4, 5, 5), ("NCHW", "OIHW", "NCHW"), 4, 2, 1, 1, (1, 1)),
        ((4, 5, 5, 4), ("NHWC", "HWIO", "NHWC"), 2, 1, 2, 1, (2, 0)),
    ],
)
def test_the_workaround_computes_the_convolutions_gradients(case):
    shape, layout, groups, stride, dilation, lhs_dilation, padding = case
    spatial = len(shape) - 2
    channels = shape[layout[0].index("C")]
    kernel = [3] * spatial
    kernel.insert(layout[1].index("O"), channels)
    kernel.insert(layout[1].index("I"), channels // groups)
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    w = rng.normal(size=kernel).astype(np.float32)

    def loss(w, x):
        y = jax.lax.conv_general_dilated(
            x, w, (stride,) * spatial, (padding,) * spatial,
            lhs_dilation=(lhs_dilation,) * spatial, rhs_dilation=(dilation,) * spatial,
            dimension_numbers=layout, feature_group_count=groups,
        )  # fmt: skip
        return jnp.sum(jnp.sin(y))

    grad = jax.grad(loss, argnums=(0, 1))
    for have, want in zip(
        jax.jit(examples_summed_by_dots(grad))(w, x), jax.jit(grad)(w, x), strict=True
    ):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)


def test_the_workaround_rebuilds_the_constructs_around_a_convolution():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 4, 8)).astype(np.float32)
    w = rng.normal(size=(4, 1, 3)).astype(np.float32)
    grad = jax.grad(depthwise_loss)

    def constructs(w, x):
        scanned = jax.lax.scan(
            lambda c, s: (c + jax.checkpoint(grad)(w, x * s), None),
            jnp.zeros_like(w),
            jnp.arange(1.0, 3.0),
        )[0]
        chosen = jax.lax.cond(x[0, 0, 0] > 0, grad, lambda w, x: -grad(w, x), w, x)
        looped = jax.lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + grad(w, x)), (0, w)
        )[1]
        return scanned, chosen, looped, jax.jit(grad)(w, x)

    for have, want in zip(
        jax.tree.leaves(jax.jit(examples_summed_by_dots(constructs))(w, x)),
        jax.tree.leaves(jax.jit(constructs)(w, x)),
        strict=True,
    ):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-5)
