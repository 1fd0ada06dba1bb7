"""`px.models.dot_product_attention` by the Pallas splash kernel (a TPU's
path), run here in Pallas' interpreter: the same values and gradients as
XLA's attention, causal or not, with a padding mask, over a batch (`vmap`),
and XLA's attention where the kernel does not take the shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import phalanx as px
from phalanx.models import _attention, _tpu_attention


SEQ, HEADS, DIM = 256, 2, 64  # the kernel's sequences: multiples of 128


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel, in Pallas' interpreter off a TPU, as in a program of one
    device's (the tests' process has 8); the shapes it was asked for, and
    whether it took them."""
    monkeypatch.setattr(_tpu_attention, "INTERPRET", True)
    monkeypatch.setattr(_attention, "on_one_device", lambda: True)
    asked = []

    def splash(query, *args, **kwargs):
        out = _tpu_attention.splash_attention(query, *args, **kwargs)
        asked.append((query.shape, out is not None))
        return out

    monkeypatch.setattr(_attention, "splash_attention", splash)
    return asked


def qkv(seq=SEQ):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, seq, HEADS, DIM)).astype(np.float32)] * 1 + [
        rng.standard_normal((2, seq, HEADS, DIM)).astype(np.float32) for _ in range(2)
    ]


def xla(q, k, v, causal, mask):
    visible = None if mask is None else mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=visible, is_causal=causal)


@pytest.mark.parametrize(
    ("causal", "masked"), [(True, False), (False, False), (False, True)]
)
def test_the_kernel_computes_xla_attention(interpreted, causal, masked):
    q, k, v = qkv()
    mask = np.arange(SEQ)[None] < np.array([[SEQ], [SEQ - 37]]) if masked else None

    def kernel(q, k, v):
        def one(q, k, v, m):
            return px.models.dot_product_attention(q, k, v, causal=causal, mask=m)

        return jax.vmap(one)(q, k, v, mask)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * jnp.cos(q))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    have = grad(kernel, q, k, v)
    assert interpreted == [((SEQ, HEADS, DIM), True)]  # the kernel ran
    want = grad(lambda q, k, v: xla(q, k, v, causal, mask), q, k, v)
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_shapes_the_kernel_does_not_take_use_xla(interpreted):
    q, k, v = (jnp.asarray(x[0, :200]) for x in qkv())  # no block divides 200
    out = px.models.dot_product_attention(q, k, v, causal=True)
    np.testing.assert_allclose(
        out, xla(q[None], k[None], v[None], True, None)[0], rtol=1e-5, atol=1e-6
    )
    assert interpreted == [((200, HEADS, DIM), False)]  # asked; it said no


def test_a_global_view_over_several_devices_uses_xla():
    # Under a global-view jit over 8 devices XLA would gather a kernel's
    # operands whole onto each device: there, attention is XLA's.
    assert jax.device_count() == 8 and not _tpu_attention.on_one_device()


def test_a_per_device_program_is_one_devices():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = []

    def body(x):
        seen.append(_tpu_attention.on_one_device())
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        jnp.ones(8)
    )
    assert seen == [True]
