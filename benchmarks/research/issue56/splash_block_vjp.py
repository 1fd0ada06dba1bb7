import time, math, functools
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash, splash_attention_mask as masks
H, S, D = 2, 256, 64
MASK = -0.7*float(jnp.finfo(jnp.float32).max)
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((H, S, D)), jnp.float32) for _ in range(3))
blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128, use_fused_bwd_kernel=True)

@functools.cache
def kernel(causal):
    m = masks.CausalMask((S, S)) if causal else masks.FullMask((S, S))
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(masks.MultiHeadMask([m]*H), block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=True, save_residuals=True)

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def block(q, k, v, kv_ids, causal):
    out, (lse,) = kernel(causal)(q, k, v, segment_ids=splash.SegmentIds(jnp.ones(S, jnp.int32), kv_ids))
    return out, lse
def block_fwd(q, k, v, kv_ids, causal):
    out, lse = block(q, k, v, kv_ids, causal)
    return (out, lse), (q, k, v, kv_ids, out, lse)
def block_bwd(causal, res, cts):
    q, k, v, kv_ids, out, lse = res
    do, dlse = cts
    ker = kernel(causal)
    kw = ker.kwargs
    # d lse / d s = p: fold it into di (ds = p * (dp - di + dlse))
    di = jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    mi = ker.dkv_mask_info
    dq, dk, dv = splash._splash_attention_bwd_dkv(
        q, k, v, splash.SegmentIds(jnp.ones(S, jnp.int32), kv_ids), None, lse, do.astype(q.dtype), di,
        bq=blocks.block_q_dkv, bkv=blocks.block_kv_dkv, bkv_compute=blocks.block_kv_dkv_compute,
        is_mqa=False, mask_info=mi, mask_value=kw["mask_value"], attn_logits_soft_cap=None,
        use_fused_bwd_kernel=True, q_layout=blocks.q_layout, k_layout=blocks.k_layout, v_layout=blocks.v_layout,
        mask_function=kw["mask_function"], interpret=True)
    return dq, dk, dv, None
block.defvjp(block_fwd, block_bwd)

def ref(q, k, v, kv_ids, causal):
    s = jnp.einsum("hqd,hkd->hqk", q, k)
    vis = (kv_ids == 1)[None, None]
    if causal:
        vis = vis & jnp.tril(jnp.ones((S, S), bool))
    s = jnp.where(vis, s, MASK)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("hqk,hkd->hqd", jnp.exp(s - lse[..., None]), v), lse

w1 = jnp.asarray(rng.standard_normal((H, S, D)), jnp.float32); w2 = jnp.asarray(rng.standard_normal((H, S)), jnp.float32)
for causal in (False, True):
  for padded in (False, True):
    kv_ids = jnp.asarray(np.arange(S) < (S - 37 if padded else S), jnp.int32)
    def loss(f, q, k, v):
        o, l = f(q, k, v, kv_ids, causal)
        return jnp.sum(o * w1) + jnp.sum(l * w2)
    t = time.time()
    g1 = jax.jit(jax.value_and_grad(lambda *a: loss(block, *a), argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(g1); dt = time.time() - t
    g2 = jax.value_and_grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
    errs = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2))]
    print("causal", causal, "padded", padded, "time %.2f" % dt, "max abs err (loss,dq,dk,dv)", ["%.1e" % e for e in errs])
