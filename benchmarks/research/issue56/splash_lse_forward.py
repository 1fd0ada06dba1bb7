import time, math, functools, traceback
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash, splash_attention_mask as masks
H, S, D = 2, 256, 64
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((H, S, D)), jnp.float32) for _ in range(3))
blocks = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128, use_fused_bwd_kernel=True)
def ref(q, k, v, causal):
    s = jnp.einsum("hqd,hkd->hqk", q, k)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -0.7*float(jnp.finfo(jnp.float32).max))
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("hqk,hkd->hqd", jnp.exp(s - lse[..., None]), v), lse
for causal in (False, True):
    m = masks.CausalMask((S, S)) if causal else masks.FullMask((S, S))
    ker = splash.make_splash_mha(masks.MultiHeadMask([m]*H), block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=True, save_residuals=True)
    t = time.time()
    out, (lse,) = jax.jit(ker)(q, k, v)
    out.block_until_ready(); print("splash fwd save_residuals causal", causal, "time", round(time.time()-t, 2))
    ro, rl = ref(q, k, v, causal)
    print("  out err", float(jnp.abs(out-ro).max()), "lse err", float(jnp.abs(lse-rl).max()), lse.shape)
    try:
        jax.grad(lambda q: ker(q, k, v)[0].sum())(q)
    except Exception as e:
        print("  grad of save_residuals kernel:", type(e).__name__, str(e).splitlines()[0])
