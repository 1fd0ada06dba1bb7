"""One block of attention by JAX's Pallas splash kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`), returning its
log-sum-exp beside its output, both differentiable.

The kernel's public call differentiates only its output: asked for the
log-sum-exp (`save_residuals=True`) it refuses to be differentiated. A ring
of blocks (`_ring.py`) needs both, to fold each block into an online
softmax exactly. `attend` is its own `jax.custom_vjp`: the forward pass is
the kernel's, the backward pass the kernel's own backward kernels with the
log-sum-exp's cotangent folded into their ``di`` term: since
``∂lse_i/∂s_ij = p_ij``, ``ds = p (dp - di + dlse)`` (as FlashAttention 4
does). The backward kernels are private functions of JAX's; `refusal` checks
their signatures, so that a JAX that changed them falls back to XLA's
attention with a warning instead of failing.

Blocks: 1,024 queries by 1,024 keys, computed 512 keys at a time where the
sequence allows (measured on a v5e, causal, 8 heads of 64, bf16: at 16k
tokens 58.6 ms forward and backward against 76.2 ms with 512-blocks). The
fused backward kernel (dq, dk and dv together) is the faster one, but it
keeps a float32 partial dq per key block, ``(kv_seq / block) × heads × seq
× dim``: 17 GB at 64k tokens. Above `FUSED_LIMIT` bytes of those the
backward runs dq in a kernel of its own.
"""

import functools
import inspect
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float


# Each sequence's blocks: the largest of these dividing it.
BLOCKS = (1024, 512, 256, 128)
# Keys computed at a time within a block.
COMPUTE = 512
# The fused backward's partial dq a call may keep, in bytes (one example).
FUSED_LIMIT = 1 << 30
# The dtypes the kernel is built for (its matmuls accumulate in float32).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# Default matmul precisions Mosaic does not lower (it takes one bf16 pass
# or full float32: `jax.default_matmul_precision("highest")`).
UNLOWERED_PRECISIONS = ("high", "bfloat16_3x", "tensorfloat32")
# The private backward kernels `attend` calls, with the arguments it passes.
_BACKWARD = {
    "_splash_attention_bwd_dkv": (
        "q k v segment_ids sinks logsumexp do di bq bkv bkv_compute is_mqa "
        "mask_info mask_value attn_logits_soft_cap use_fused_bwd_kernel q_layout "
        "k_layout v_layout mask_function interpret"
    ),
    "_splash_attention_bwd_dq": (
        "q k v segment_ids sinks logsumexp do di bq bkv is_mqa mask_info "
        "mask_value attn_logits_soft_cap q_layout k_layout v_layout "
        "mask_function interpret"
    ),
}


def refusal(
    seq: int, kv_seq: int, dim: int, dtype: jnp.dtype, *, causal: bool
) -> str | None:
    """Why the kernel does not take these arguments, or None where it does."""
    if block(seq) is None or block(kv_seq) is None:
        return (
            f"its sequences are multiples of 128 long, not seq={seq}, kv_seq={kv_seq}"
        )
    if causal and seq != kv_seq:
        return f"causal attention needs seq == kv_seq, not {seq} and {kv_seq}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"it takes bfloat16 and float32, not {jnp.dtype(dtype)}"
    if not 1 <= dim <= 256:
        return f"it takes head dims up to 256, not {dim}"
    precision = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
    if precision in UNLOWERED_PRECISIONS:
        return (
            f"Mosaic does not lower the default matmul precision {precision!r}: "
            "use 'highest' (exact float32) or the default"
        )
    return _backward_missing()


def block(seq: int) -> int | None:
    """The kernel's block along a sequence of `seq` (None: it takes none)."""
    return next((b for b in BLOCKS if seq % b == 0), None)


def attend(
    query: Float[Array, "heads seq dim"],
    key: Float[Array, "heads kv_seq dim"],
    value: Float[Array, "heads kv_seq dim"],
    mask: Bool[Array, " kv_seq"] | None,
    causal: bool,
    interpret: bool,
) -> tuple[Float[Array, "heads seq dim"], Float[Array, "heads seq"]]:
    """Attention of (already scaled) queries over the keys `mask` marks real
    (causal: each query up to its own position), and each query's
    log-sum-exp of its scores (float32). Where `refusal` says None."""
    # Padding as segments: every query in segment 1, a key in 1 where it is
    # real and 0 where padding, so that no query sees a padded key. (Made
    # here, outside the custom_vjp: a mask vmapped from a NumPy array would
    # reach it as a NumPy constant, which it refuses.)
    segments = None if mask is None else mask.astype(jnp.int32)
    return _attend(query, key, value, segments, causal, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend(query, key, value, segments, causal, interpret):
    return _kernel_call(query, key, value, segments, causal, interpret)


def _kernel_call(
    query: Array,
    key: Array,
    value: Array,
    segments: Array | None,
    causal: bool,
    interpret: bool,
) -> tuple[Array, Array]:
    """The kernel's output and log-sum-exp (its forward pass)."""
    kernel = _kernel(*_shape(query, key), causal, interpret)
    # With save_residuals, the kernel returns its output and (lse,).
    out, residuals = cast(
        tuple[Array, tuple[Array]],
        kernel(query, key, value, segment_ids=_ids(query, segments)),
    )
    return out, residuals[0]


def _forward(query, key, value, segments, causal, interpret):
    out, lse = _kernel_call(query, key, value, segments, causal, interpret)
    return (out, lse), (query, key, value, segments, out, lse)


def _backward(causal, interpret, residuals, cotangents):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    query, key, value, segments, out, lse = residuals
    d_out, d_lse = cotangents
    kernel = _kernel(*_shape(query, key), causal, interpret)
    sizes = kernel.kwargs["block_sizes"]
    # The log-sum-exp's cotangent enters where the kernel's own backward
    # subtracts rowsum(out * d_out).
    di = (
        jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), d_out.astype(jnp.float32))
        - d_lse
    )
    d_out = d_out.astype(query.dtype)
    shared: dict[str, Any] = dict(
        is_mqa=False,
        mask_value=kernel.kwargs["mask_value"],
        attn_logits_soft_cap=None,
        q_layout=sizes.q_layout,
        k_layout=sizes.k_layout,
        v_layout=sizes.v_layout,
        mask_function=kernel.kwargs["mask_function"],
        interpret=interpret,
    )
    args = (query, key, value, _ids(query, segments), None, lse, d_out, di)
    d_query, d_key, d_value = splash._splash_attention_bwd_dkv(
        *args,
        bq=sizes.block_q_dkv,
        bkv=sizes.block_kv_dkv,
        bkv_compute=sizes.block_kv_dkv_compute,
        mask_info=kernel.dkv_mask_info,
        use_fused_bwd_kernel=sizes.use_fused_bwd_kernel,
        **shared,
    )
    if not sizes.use_fused_bwd_kernel:
        d_query = splash._splash_attention_bwd_dq(
            *args,
            bq=sizes.block_q_dq,
            bkv=sizes.block_kv_dq,
            mask_info=kernel.dq_mask_info,
            **shared,
        )
    return d_query, d_key, d_value, None


_attend.defvjp(_forward, _backward)


def _shape(query: Array, key: Array) -> tuple[int, int, int, int]:
    heads, seq, dim = query.shape
    return seq, key.shape[1], heads, dim


def _ids(query: Array, segments: Array | None):
    """The kernel's segment ids: the queries' all 1, the keys' `segments`."""
    if segments is None:
        return None
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )

    return splash.SegmentIds(q=jnp.ones(query.shape[1], jnp.int32), kv=segments)


@functools.cache
def _kernel(seq: int, kv_seq: int, heads: int, dim: int, causal: bool, interpret: bool):
    """The splash kernel for these shapes, returning its log-sum-exp (built
    once: building it computes the mask's block structure on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    q_block, kv_block = block(seq), block(kv_seq)
    assert q_block is not None and kv_block is not None
    compute = min(kv_block, COMPUTE)
    fused = (kv_seq // kv_block) * heads * seq * dim * 4 <= FUSED_LIMIT
    one = masks.CausalMask((seq, kv_seq)) if causal else masks.FullMask((seq, kv_seq))
    sizes = splash.BlockSizes(
        block_q=q_block,
        block_kv=kv_block,
        block_kv_compute=compute,
        block_q_dkv=q_block,
        block_kv_dkv=kv_block,
        block_kv_dkv_compute=compute,
        block_q_dq=None if fused else q_block,
        block_kv_dq=None if fused else kv_block,
        use_fused_bwd_kernel=fused,
    )
    # Built while a step is traced: its arrays are concrete values, not
    # part of the trace.
    with jax.ensure_compile_time_eval():
        kernel = splash.make_splash_mha(
            mask=masks.MultiHeadMask([one] * heads),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            save_residuals=True,
            interpret=interpret,
        )
    # The kernel keeps its mask's block structure as device arrays, which a
    # trace closes over; JAX 0.10 then compiles them as extra inputs that
    # neither `Compiled.input_shardings` nor a call of the compiled step
    # counts ("compiled for 63 inputs but called with 58"). As NumPy arrays
    # they are constants of the program instead.
    return jax.tree.map(np.asarray, kernel)


@functools.cache
def _backward_missing() -> str | None:
    """Why this JAX's private splash backward kernels cannot be called as
    `attend` calls them, or None where they can."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as splash,
        )
    except ImportError as error:  # pragma: no cover - a JAX without Pallas
        return f"JAX's splash kernel does not import ({error})"
    for name, wanted in _BACKWARD.items():
        function = vars(splash).get(name)
        if function is None:
            return f"this JAX ({jax.__version__}) has no splash backward {name}"
        have = set(inspect.signature(function).parameters)
        if missing := set(wanted.split()) - have:
            return (
                f"this JAX's ({jax.__version__}) splash backward {name} takes no "
                f"{sorted(missing)}"
            )
    return None
