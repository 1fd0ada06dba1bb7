"""`px.models.dot_product_attention` by JAX's Pallas splash kernel (a TPU's
path), run here in Pallas' interpreter: one block with its log-sum-exp,
differentiable in both; a whole sequence against XLA's attention (values and
gradients, causal or not, padded, float32 and bfloat16, over a batch); the
refusals, each one warning naming XLA's attention; and the blockwise
attention a CPU runs long sequences with."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import phalanx as px
from phalanx.models import _attention, _blockwise, _splash, _tpu_attention


SEQ, HEADS, DIM = 256, 2, 64  # the kernel's sequences: multiples of 128


@pytest.fixture
def interpreted(monkeypatch):
    """The kernel, in Pallas' interpreter off a TPU, as in a program of one
    device's (the tests' process has 8); the shapes of its calls."""
    monkeypatch.setattr(_tpu_attention, "INTERPRET", True)
    monkeypatch.setattr(_tpu_attention, "_not_one_device", lambda: None)
    monkeypatch.setattr(_tpu_attention, "_said", set())
    calls = []
    attend = _splash.attend

    def recorded(query, key, *args):
        calls.append((query.shape, key.shape))
        return attend(query, key, *args)

    monkeypatch.setattr(_splash, "attend", recorded)
    return calls


def qkv(batch=2, seq=SEQ, dtype=np.float32):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((batch, seq, HEADS, DIM)).astype(dtype) for _ in "qkv"]


def xla(q, k, v, causal, mask):
    visible = None if mask is None else mask[:, None, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=visible, is_causal=causal)


def reference_block(q, k, v, mask, causal):
    """A block's output and log-sum-exp, in float32 `jnp` (heads first)."""
    scores = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest")
    visible = jnp.ones(scores.shape[1:], bool)
    if causal:
        visible = jnp.tril(visible)
    if mask is not None:
        visible = visible & mask[None]
    scores = jnp.where(visible[None], scores, _blockwise.MASKED)
    lse = jax.nn.logsumexp(scores, axis=-1)
    weights = jnp.exp(scores - lse[..., None])
    return jnp.einsum("hqk,hkd->hqd", weights, v, precision="highest"), lse


def close(have, want, tolerance):
    """Each leaf within `tolerance` of its largest entry."""
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        bound = tolerance * float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=tolerance, atol=bound)


@pytest.mark.parametrize(
    ("causal", "masked"), [(True, False), (False, True), (True, True)]
)
def test_a_block_returns_its_log_sum_exp_and_differentiates_through_it(causal, masked):
    rng = np.random.default_rng(1)
    q, k, v, w = (
        jnp.asarray(rng.standard_normal((HEADS, SEQ, DIM)), jnp.float32) for _ in "qkvw"
    )
    u = jnp.asarray(rng.standard_normal((HEADS, SEQ)), jnp.float32)
    mask = jnp.arange(SEQ) < SEQ - 37 if masked else None

    def loss(block, q, k, v):
        out, lse = block(q, k, v)
        # Both outputs in the loss: the log-sum-exp's cotangent is exercised.
        return jnp.sum(out * w) + jnp.sum(jnp.sin(lse) * u)

    def kernel(q, k, v):
        return _splash.attend(q, k, v, mask, causal, True)

    def reference(q, k, v):
        return reference_block(q, k, v, mask, causal)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    with jax.default_matmul_precision("highest"):
        close(jax.jit(kernel)(q, k, v), jax.jit(reference)(q, k, v), 1e-5)
        close(grad(kernel, q, k, v), grad(reference, q, k, v), 1e-5)


@pytest.mark.parametrize(
    ("causal", "masked", "dtype"),
    [
        (True, False, np.float32),
        (False, True, np.float32),
        (True, True, jnp.bfloat16),
    ],
)
def test_the_kernel_computes_xla_attention(interpreted, causal, masked, dtype):
    q, k, v = qkv(dtype=dtype)
    mask = np.arange(SEQ)[None] < np.array([[SEQ], [SEQ - 37]]) if masked else None

    def kernel(q, k, v):
        def one(q, k, v, m):
            return px.models.dot_product_attention(q, k, v, causal=causal, mask=m)

        return jax.vmap(one)(q, k, v, mask)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * jnp.cos(q))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    have = grad(kernel, q, k, v)
    assert interpreted == [((HEADS, SEQ, DIM), (HEADS, SEQ, DIM))]  # it ran
    if dtype == np.float32:
        close(have, grad(lambda q, k, v: xla(q, k, v, causal, mask), q, k, v), 1e-5)
    else:
        # bfloat16 inputs, float32 accumulation in both: against XLA's
        # attention of the same bfloat16 inputs in float32, within bfloat16's
        # rounding of the output and the gradients (2^-8 relative, a few ulps).
        up = [x.astype(np.float32) for x in (q, k, v)]
        close(have, grad(lambda q, k, v: xla(q, k, v, causal, mask), *up), 3e-2)


def test_arguments_the_kernel_refuses_use_xla_with_one_warning(interpreted, caplog):
    q, k, v = (jnp.asarray(x[0, :200]) for x in qkv())  # no block divides 200
    attend = px.models.dot_product_attention
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        # Two layers of one model (two traces): said once.
        outs = [
            jax.jit(lambda q, k, v: attend(q, k, v, causal=True))(q, k, v)
            for _ in range(2)
        ]
    np.testing.assert_allclose(
        outs[1], xla(q[None], k[None], v[None], True, None)[0], rtol=1e-5, atol=1e-6
    )
    assert interpreted == []
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        "dot_product_attention uses XLA's attention, not the splash kernel: its "
        "sequences are multiples of 128 long, not seq=200, kv_seq=200"
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("precision", "Mosaic does not lower the default matmul precision 'high'"),
        ("dtype", "it takes bfloat16 and float32, not float16"),
        ("dim", "it takes head dims up to 256, not 320"),
        ("private", "splash backward _splash_attention_bwd_dq takes no ['renamed']"),
    ],
)
def test_each_refusal_names_its_reason(
    interpreted, monkeypatch, caplog, change, reason
):
    q = jnp.ones((SEQ, HEADS, 320 if change == "dim" else DIM))
    q = q.astype(jnp.float16) if change == "dtype" else q
    if change == "private":
        wanted = dict(_splash._BACKWARD)
        wanted["_splash_attention_bwd_dq"] += " renamed"
        monkeypatch.setattr(_splash, "_BACKWARD", wanted)
        _splash._backward_missing.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="phalanx"):
            with jax.default_matmul_precision(
                "high" if change == "precision" else None
            ):
                px.models.dot_product_attention(q, q, q)
    finally:
        _splash._backward_missing.cache_clear()
    assert interpreted == []
    (said,) = [r.getMessage() for r in caplog.records]
    assert reason in said and "uses XLA's attention" in said


def test_this_jaxs_private_backward_kernels_are_the_ones_it_calls():
    # Fails loudly on a JAX that renamed them (the kernel path would fall
    # back to XLA's attention with a warning).
    assert _splash._backward_missing() is None


def test_a_global_view_over_several_devices_is_not_one_devices():
    # Under a global-view jit over 8 devices XLA would gather a kernel's
    # operands whole onto each device: there, attention is XLA's.
    assert jax.device_count() == 8 and not _tpu_attention.on_one_device()


@pytest.mark.parametrize(
    ("manual", "one_device"),
    [({"data"}, False), ({"data", "context"}, True)],
)
def test_a_program_manual_over_every_axis_larger_than_one_is_one_devices(
    manual, one_device
):
    mesh = jax.make_mesh(
        (2, 4, 1),
        ("data", "context", "tensor"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 3,
    )
    seen = []

    def body(x):
        seen.append(_tpu_attention.on_one_device())
        return x

    jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=P(tuple(manual)),
            out_specs=P(tuple(manual)),
            axis_names=manual,
        )
    )(jnp.ones(8))
    assert seen == [one_device]


def test_the_compiled_kernel_is_traced_manual_over_every_mesh_axis(interpreted):
    """Mosaic lowers a kernel only where every mesh axis is manual. In a
    per-device program over some axes (accumulation's microbatches), those
    left automatic (one device each) are made manual around the compiled
    kernel (`manual_everywhere`; on the v5e, GPT-2 small under 2
    microbatches did not compile without), its values and gradients
    unchanged. Here around the interpreted one, which does not need it."""
    mesh = jax.make_mesh(
        (1, 2, 1),
        ("data", "context", "tensor"),
        axis_types=(jax.sharding.AxisType.Explicit,) * 3,
        devices=jax.devices()[:2],
    )
    manual = []

    def kernel(q, k, v, causal, mask):
        abstract = jax.sharding.get_abstract_mesh()
        manual.append(set(abstract.manual_axes) == set(abstract.axis_names))
        return px.models.dot_product_attention(q, k, v, causal=causal, mask=mask)

    def loss(q, k, v, attention):
        out = jax.vmap(lambda *x: attention(*x, True, None))(q, k, v)
        weights = jnp.arange(out[0].size).reshape(out.shape[1:]) / out[0].size
        return jnp.sum(out * weights[None])

    def ours(q, k, v, causal, mask):
        made = _tpu_attention.manual_everywhere(
            lambda q, k, v: kernel(q, k, v, causal, mask)
        )
        return made(q, k, v)

    per_device = jax.shard_map(
        lambda *x: jax.value_and_grad(loss, argnums=(0, 1, 2))(*x, ours),
        mesh=mesh,
        in_specs=P("context"),
        out_specs=(P(), P("context")),
        axis_names={"data", "context"},
        check_vma=False,
    )
    q, k, v = qkv(batch=2)
    _, grads = jax.jit(per_device)(q, k, v)
    _, expected = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, _xla_one)
    assert manual and all(manual) and interpreted
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def _xla_one(q, k, v, causal, mask):
    """XLA's attention of one example."""
    return xla(q[None], k[None], v[None], causal, mask)[0]


@pytest.mark.parametrize(("causal", "masked"), [(True, True), (False, False)])
def test_a_cpu_attends_long_sequences_a_block_at_a_time(monkeypatch, causal, masked):
    monkeypatch.setattr(_attention, "BLOCKWISE_FROM", 256)
    monkeypatch.setattr(_attention, "BLOCKWISE", 64)
    q, k, v = qkv(batch=1)
    mask = np.arange(SEQ)[None] < SEQ - 70 if masked else None
    blocks = []
    blockwise = _attention.blockwise_attention

    def recorded(*args, **kwargs):
        blocks.append(kwargs["block"])
        return blockwise(*args, **kwargs)

    monkeypatch.setattr(_attention, "blockwise_attention", recorded)

    def ours(q, k, v):
        m = None if mask is None else mask[0]
        return px.models.dot_product_attention(q[0], k[0], v[0], causal=causal, mask=m)

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v) * jnp.cos(q[0]))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3)), static_argnums=0)
    have = grad(ours, q, k, v)
    assert blocks == [64]
    close(have, grad(lambda q, k, v: xla(q, k, v, causal, mask)[0], q, k, v), 1e-5)
