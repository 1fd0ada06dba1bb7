"""Design A prototype: phalanx's own ring (_ring.ring_attention, balanced causal
schedule) with each block computed by the splash kernel (interpret mode), the
block returning (out, lse) through a custom_vjp whose backward folds dlse into di."""
import os, time, functools
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


H, S, D, B = 2, 256, 64, 2
MASK = -0.7*float(jnp.finfo(jnp.float32).max)
rng = np.random.default_rng(1)
q, k, v = (jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32) for _ in range(3))
w1 = jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32); w2 = jnp.asarray(rng.standard_normal((B, H, S)), jnp.float32)
kvm = jnp.asarray(np.arange(S)[None] < np.array([[S], [S - 37]]))
def ref(q, k, v, m, causal):
    s = jnp.einsum("hqd,hkd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
    vis = m[None, None]
    if causal: vis = vis & jnp.tril(jnp.ones((S, S), bool))
    s = jnp.where(vis, s, MASK); lse = jax.nn.logsumexp(s, -1)
    return jnp.einsum("hqk,hkd->hqd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32)), lse
for dtype in (jnp.float32, jnp.bfloat16):
  for causal in (False, True):
    def loss(f, q, k, v):
        o, l = jax.vmap(lambda q, k, v, m: f(q, k, v, m, causal))(q, k, v, kvm)
        return jnp.sum(o.astype(jnp.float32) * w1) + jnp.sum(l * w2)
    a = [x.astype(dtype) for x in (q, k, v)]
    t = time.time()
    g1 = jax.jit(jax.grad(lambda *x: loss(kernel_block, *x), argnums=(0, 1, 2)))(*a); jax.block_until_ready(g1)
    dt = time.time() - t
    g2 = jax.grad(lambda *x: loss(ref, *x), argnums=(0, 1, 2))(q, k, v)
    print(dtype.__name__, "vmap causal", causal, "%.1fs" % dt, "rel err dq dk dv", ["%.1e" % float(jnp.abs(x.astype(jnp.float32) - y).max() / jnp.abs(y).max()) for x, y in zip(g1, g2)])
