import time, functools
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from jax.experimental.pallas import tpu as pltpu
from jax._src import config as jcfg
B, H, S, D = 1, 2, 256, 64
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.float32) for _ in range(3))
bs = fa.BlockSizes.get_default(B, H, S, S, D)
def ref(q, k, v, causal):
    return fa.mha_reference(q, k, v, None, None, causal=causal, sm_scale=1.0)
for mode in ("config=True",):
  for causal in (False, True):
    if mode == "config=True":
        import contextlib
        @contextlib.contextmanager
        def c():
            prev = jcfg.pallas_tpu_interpret_mode_context_manager.swap_local(True)
            try: yield
            finally: jcfg.pallas_tpu_interpret_mode_context_manager.set_local(prev)
        ctx = c()
    else:
        ctx = pltpu.force_tpu_interpret_mode()
    try:
      with ctx:
        t = time.time()
        o = jax.jit(functools.partial(fa.flash_attention, causal=causal, block_sizes=bs))(q, k, v); o.block_until_ready(); t1 = time.time()-t
        t = time.time()
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fa.flash_attention(q, k, v, causal=causal, block_sizes=bs) * jnp.cos(q)), argnums=(0,1,2)))(q, k, v); jax.block_until_ready(g); t2 = time.time()-t
        o2, l, m = jax.jit(lambda q, k, v: fa._flash_attention_impl(q, k, v, None, None, True, causal, 1.0, 1, 128, 128, 128, False))(q, k, v)
      gr = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v, causal) * jnp.cos(q)), argnums=(0,1,2))(q, k, v)
      s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
      if causal: s = jnp.where(jnp.tril(jnp.ones((S,S),bool)), s, -jnp.inf)
      lse = jax.nn.logsumexp(s, -1)
      print(mode, "causal", causal, "fwd %.2fs grad %.2fs" % (t1, t2), "out err %.1e" % float(jnp.abs(o - ref(q,k,v,causal)).max()),
            "grad err", ["%.1e" % float(jnp.abs(a-b).max()) for a, b in zip(g, gr)], "m+log(l) vs lse %.1e" % float(jnp.abs(m + jnp.log(l) - lse).max()), l.shape)
    except Exception as e:
      print(mode, "causal", causal, "ERROR", type(e).__name__, str(e).splitlines()[0][:300])
try:
    o = fa.flash_attention(q, k, v)
except Exception as e:
    print("no interpret:", type(e).__name__, str(e).splitlines()[0][:200])
