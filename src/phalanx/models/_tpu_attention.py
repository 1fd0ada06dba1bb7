"""Attention of one whole sequence with JAX's own Pallas TPU kernel (splash
attention, `jax.experimental.pallas.ops.tpu.splash_attention`): the score
matrix is never built whole, block by block in the chip's fast memory, with
the causal blocks above the diagonal skipped.

On the lent TPU v5e (GPT-2-small shape, 12 heads of 64, 1,024 tokens, bf16)
XLA's attention ran out of memory at batch 8 where the kernel trained; the
kernel's default 128 × 128 blocks spent 80 ms of a 147 ms step in it, so it
is built with blocks of up to 512 (MaxText's default on v5e).

`splash_attention` returns None where the kernel does not take the
arguments (sequences not a multiple of 128 long), and the caller computes
attention with XLA instead. Off a TPU the kernel runs only in Pallas'
interpreter, which the tests use to check it against XLA's attention.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float


# The kernel's blocks along each sequence: the largest of these dividing it.
BLOCKS = (512, 256, 128)
# Off a TPU, run the kernel in Pallas' interpreter instead of XLA's attention
# (the tests set it: CI has no TPU).
INTERPRET = False


def splash_attention(
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    *,
    causal: bool,
    interpret: bool = False,
) -> Float[Array, "seq heads dim"] | None:
    """``softmax(q kᵀ / sqrt(dim)) v`` of one example by the splash kernel, or
    None where it does not take these shapes (a sequence not a multiple of
    128 long, or causal attention of unequal lengths). `mask` marks the real
    keys; `interpret` runs Pallas' interpreter (off a TPU)."""
    seq, heads, dim = query.shape
    kv_seq = key.shape[0]
    q_block, kv_block = _block(seq), _block(kv_seq)
    if q_block is None or kv_block is None or (causal and seq != kv_seq):
        return None
    kernel = _kernel(seq, kv_seq, heads, q_block, kv_block, causal, interpret)
    # The kernel takes (heads, seq, dim) and does not scale the scores.
    scale = jnp.asarray(1 / math.sqrt(dim), query.dtype)
    q, k, v = (jnp.swapaxes(x, 0, 1) for x in (query * scale, key, value))
    segments = None
    if mask is not None:
        # Padding as segments: every query is in segment 1, a key in 1 where
        # it is real and 0 where padding, so no query sees a padded key.
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as splash,
        )

        segments = splash.SegmentIds(
            q=jnp.ones(seq, jnp.int32), kv=mask.astype(jnp.int32)
        )
    out = kernel(q, k, v, segment_ids=segments)
    return jnp.swapaxes(out, 0, 1).astype(query.dtype)


def _block(seq: int) -> int | None:
    """The kernel's block along a sequence of `seq` (None: it takes none)."""
    return next((block for block in BLOCKS if seq % block == 0), None)


@functools.cache
def _kernel(
    seq: int,
    kv_seq: int,
    heads: int,
    q_block: int,
    kv_block: int,
    causal: bool,
    interpret: bool,
):
    """The splash kernel for these shapes (built once: building it computes
    the mask's block structure on the host)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    one = masks.CausalMask((seq, kv_seq)) if causal else masks.FullMask((seq, kv_seq))
    # One backward kernel for dq, dk and dv together, as MaxText runs it
    # (a dq kernel and a dk, dv one measured the same on a v5e).
    blocks = splash.BlockSizes(
        block_q=q_block,
        block_kv=kv_block,
        block_kv_compute=kv_block,
        block_q_dkv=q_block,
        block_kv_dkv=kv_block,
        block_kv_dkv_compute=kv_block,
        use_fused_bwd_kernel=True,
    )
    # Built while a step is traced: its arrays are concrete values, not
    # part of the trace.
    with jax.ensure_compile_time_eval():
        kernel = splash.make_splash_mha(
            mask=masks.MultiHeadMask([one] * heads),
            block_sizes=blocks,
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )
    # The kernel keeps its mask's block structure as device arrays, which a
    # trace closes over; JAX 0.10 then compiles them as extra inputs that
    # neither `Compiled.input_shardings` nor a call of the compiled step
    # counts ("compiled for 63 inputs but called with 58"). As NumPy arrays
    # they are constants of the program instead.
    return jax.tree.map(np.asarray, kernel)


def on_one_device() -> bool:
    """Whether the attention being traced runs in one device's program: a
    per-device program (manual over the mesh's axes), or a process of one
    device. A Pallas kernel is not split by XLA's partitioner: under a
    global-view `jax.jit` over several devices its operands would be
    gathered whole onto each."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and abstract.manual_axes:
        return set(abstract.manual_axes) == set(abstract.axis_names)
    return jax.device_count() == 1
