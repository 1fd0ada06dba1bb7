"""Design A prototype: phalanx's own ring (_ring.ring_attention, balanced causal
schedule) with each block computed by the splash kernel (interpret mode), the
block returning (out, lse) through a custom_vjp whose backward folds dlse into di."""
import os, time, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.sharding import PartitionSpec as P
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash, splash_attention_mask as masks
from phalanx.models import _ring, _blockwise
from phalanx.models._attention_inputs import AttentionInputs

@functools.cache
def kernel(seq, heads, causal, block):
    blocks = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                               block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    one = masks.CausalMask((seq, seq)) if causal else masks.FullMask((seq, seq))
    with jax.ensure_compile_time_eval():
        k = splash.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=blocks, head_shards=1,
                                   q_seq_shards=1, interpret=True, save_residuals=True)
    return jax.tree.map(np.asarray, k)

def _ids(q, kv_mask):
    if kv_mask is None:
        return None
    return splash.SegmentIds(jnp.ones(q.shape[1], jnp.int32), kv_mask.astype(jnp.int32))

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def kernel_block(q, k, v, kv_mask, causal):
    """(heads, seq, dim) q (scaled), k, v -> out (heads, seq, dim), lse (heads, seq) f32."""
    out, (lse,) = kernel(q.shape[1], q.shape[0], causal, 128)(q, k, v, segment_ids=_ids(q, kv_mask))
    return out, lse

def _fwd(q, k, v, kv_mask, causal):
    out, lse = kernel_block(q, k, v, kv_mask, causal)
    return (out, lse), (q, k, v, kv_mask, out, lse)

def _bwd(causal, res, cts):
    q, k, v, kv_mask, out, lse = res
    do, dlse = cts
    ker = kernel(q.shape[1], q.shape[0], causal, 128)
    b = ker.kwargs["block_sizes"]
    # d lse_i / d s_ij = p_ij, so ds = p * (dp - di + dlse): fold dlse into di.
    di = jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    dq, dk, dv = splash._splash_attention_bwd_dkv(
        q, k, v, _ids(q, kv_mask), None, lse, do.astype(q.dtype), di,
        bq=b.block_q_dkv, bkv=b.block_kv_dkv, bkv_compute=b.block_kv_dkv_compute, is_mqa=False,
        mask_info=ker.dkv_mask_info, mask_value=ker.kwargs["mask_value"], attn_logits_soft_cap=None,
        use_fused_bwd_kernel=True, q_layout=b.q_layout, k_layout=b.k_layout, v_layout=b.v_layout,
        mask_function=ker.kwargs["mask_function"], interpret=True)
    return dq, dk, dv, None
kernel_block.defvjp(_fwd, _bwd)

def attend_block_kernel(stats, query, key, value, kv_mask, causal):
    """phalanx's Stats (out unnormalised f32, peak, total) after one block, by the kernel."""
    t = lambda x: jnp.swapaxes(x, 0, 1)
    o_b, lse_b = kernel_block(t(query), t(key), t(value), kv_mask, causal)
    peak = jax.lax.stop_gradient(jnp.maximum(stats.peak, lse_b))  # cancels in out/total
    rescale, weight = jnp.exp(stats.peak - peak), jnp.exp(lse_b - peak)
    out = stats.out * rescale.T[..., None] + t(o_b).astype(jnp.float32) * weight.T[..., None]
    return _blockwise.Stats(out, peak, stats.total * rescale + weight)

def _step(kinds, query_parts, key_parts, stats, query, chunk, device, *, step):
    keys, values, mask = chunk
    qs = jnp.asarray(query_parts, jnp.int32)[step, device]
    ks = jnp.asarray(key_parts, jnp.int32)[step, device]
    for slot, causal in enumerate(kinds):
        qi, ki = qs[slot], ks[slot]
        old = jax.tree.map(lambda s, qi=qi: s[qi], stats)
        new = attend_block_kernel(old, query[qi], keys[ki], values[ki], None if mask is None else mask[ki], causal)
        stats = jax.tree.map(lambda s, x, qi=qi: s.at[qi].set(x), stats, new)
    return stats
_ring._step = _step  # this process only

n, SEQ, H, D = 4, 1024, 2, 64   # causal: parts of SEQ/(2n) = 128
mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((SEQ, H, D)), jnp.float32) for _ in range(3))
w = jnp.asarray(rng.standard_normal((SEQ, H, D)), jnp.float32)
for causal, padded in ((True, False), (False, True), (True, True)):
    mask = jnp.asarray(np.arange(SEQ) < SEQ - 100) if padded else None
    def ring(q, k, v):
        f = functools.partial(_ring.ring_attention, axis="context", n=n, causal=causal)
        return jax.shard_map(f, mesh=mesh, in_specs=P("context"), out_specs=P("context"), check_vma=False)(AttentionInputs(q, k, v, mask))
    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, mask=None if mask is None else mask[None, None, None], implementation="xla")
    loss = lambda f, q, k, v: jnp.sum(f(q, k, v) * w)
    t0 = time.time()
    have = jax.jit(jax.value_and_grad(functools.partial(loss, ring), argnums=(0, 1, 2)))(q, k, v); jax.block_until_ready(have)
    dt = time.time() - t0
    want = jax.value_and_grad(functools.partial(loss, xla), argnums=(0, 1, 2))(q, k, v)
    rel = [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want))]
    ab = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want))]
    print(f"ring n={n} causal={causal} padded={padded}: {dt:.1f}s; max abs err (loss,dq,dk,dv) " + " ".join(f"{e:.1e}" for e in ab) + "; rel " + " ".join(f"{e:.1e}" for e in rel))
