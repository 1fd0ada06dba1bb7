import functools, contextlib, time
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from jax.experimental.pallas import tpu as pltpu
B, H, S, D = 1, 2, 256, 64
MASK = fa.DEFAULT_MASK_VALUE
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32) for _ in range(3))
w1 = jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32); w2 = jnp.asarray(rng.standard_normal((B, H, S)), jnp.float32)
bs = fa.BlockSizes.get_default(B, H, S, S, D)

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def block(q, k, v, causal):
    o, l, m = fa._flash_attention_impl(q, k, v, None, None, True, causal, 1.0, 1, 128, 128, 128, False)
    return o, m + jnp.log(l)
def fwd(q, k, v, causal):
    o, lse = block(q, k, v, causal)
    return (o, lse), (q, k, v, o, lse)
def bwd(causal, res, cts):
    q, k, v, o, lse = res
    do, dlse = cts
    di = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), -1) - dlse
    l = jnp.ones_like(lse)  # p = exp(s - m) / l with m = lse, l = 1
    dk, dv = fa._flash_attention_bwd_dkv(q, k, v, None, None, l, lse, do, di, block_q_major=128, block_q=128, block_k_major=128, block_k=128, sm_scale=1.0, causal=causal, mask_value=MASK, debug=False)
    dq, _ = fa._flash_attention_bwd_dq(q, k, v, None, None, l, lse, do, di, block_q_major=128, block_k_major=128, block_k=128, sm_scale=1.0, causal=causal, mask_value=MASK, debug=False)
    return dq, dk, dv
block.defvjp(fwd, bwd)
def ref(q, k, v, causal):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
    if causal: s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, MASK)
    lse = jax.nn.logsumexp(s, -1)
    return jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v), lse
with pltpu.force_tpu_interpret_mode():
  for causal in (False, True):
    loss = lambda f, q, k, v: (lambda o, l: jnp.sum(o * w1) + jnp.sum(l * w2))(*f(q, k, v, causal))
    t = time.time()
    g1 = jax.jit(jax.grad(functools.partial(loss, block), argnums=(0, 1, 2)))(q, k, v); jax.block_until_ready(g1)
    dt = time.time() - t
    g2 = jax.grad(functools.partial(loss, ref), argnums=(0, 1, 2))(q, k, v)
    print("flash per-block (o, lse) vjp causal", causal, "%.1fs" % dt, ["%.1e" % float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(g1, g2)])
