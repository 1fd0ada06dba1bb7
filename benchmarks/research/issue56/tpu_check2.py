import functools, time
import jax, jax.numpy as jnp, numpy as np
F = jnp.float32
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sp, splash_attention_mask as mk
FU = True
def kern(S, H, causal, b, res):
    bs = sp.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b, use_fused_bwd_kernel=FU) if FU else sp.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    m = mk.CausalMask((S, S)) if causal else mk.FullMask((S, S))
    return sp.make_splash_mha(mk.MultiHeadMask([m] * H), block_sizes=bs, head_shards=1, q_seq_shards=1, save_residuals=res)
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def blk(q, k, v, causal, b):
    o, (l,) = kern(q.shape[1], q.shape[0], causal, b, True)(q, k, v); return o, l
def f(q, k, v, causal, b):
    o, l = blk(q, k, v, causal, b); return (o, l), (q, k, v, o, l)
def g(causal, b, r, c):
    q, k, v, o, l = r; do, dl = c; K = kern(q.shape[1], q.shape[0], causal, b, True); z = K.kwargs["block_sizes"]
    di = jnp.einsum("hsd,hsd->hs", o.astype(F), do.astype(F)) - dl
    dq, dk, dv = sp._splash_attention_bwd_dkv(q, k, v, None, None, l, do.astype(q.dtype), di, bq=b, bkv=b, bkv_compute=b, is_mqa=False, mask_info=K.dkv_mask_info, mask_value=K.kwargs["mask_value"], attn_logits_soft_cap=None, use_fused_bwd_kernel=True, q_layout=z.q_layout, k_layout=z.k_layout, v_layout=z.v_layout, mask_function=K.kwargs["mask_function"], interpret=False)
    return dq, dk, dv
blk.defvjp(f, g)
def ref(q, k, v, causal, b):
    s = jnp.einsum("hqd,hkd->hqk", q, k, precision="highest", preferred_element_type=F)
    if causal: s = jnp.where(jnp.tril(jnp.ones(s.shape[1:], bool)), s, -0.7 * 3.4e38)
    l = jax.nn.logsumexp(s, -1)
    return jnp.einsum("hqk,hkd->hqd", jnp.exp(s - l[..., None]), v.astype(F), precision="highest"), l
r = np.random.default_rng(0)
for dt, S in ((F, 2048),):
  for causal in (False, True):
    q, k, v, w = (jnp.asarray(r.standard_normal((8, S, 64)) / (8 if i == 0 else 1), dt) for i in range(4)); w2 = jnp.asarray(r.standard_normal((8, S)), F)
    L = lambda fn, q, k, v: (lambda o, l: jnp.sum(o.astype(F) * w) + jnp.sum(l * w2))(*fn(q, k, v, causal, 512))
    with jax.default_matmul_precision('highest'): a = jax.jit(jax.value_and_grad(functools.partial(L, blk), argnums=(0, 1, 2)))(q, k, v)
    c = jax.jit(jax.value_and_grad(functools.partial(L, ref), argnums=(0, 1, 2)))(q, k, v)
    print(dt.__name__, S, "causal", causal, ["%.1e" % float(jnp.abs(x.astype(F) - y.astype(F)).max() / jnp.abs(y.astype(F)).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c))], flush=True)
FU = False
for S in (65536,):
    K = kern(S, 8, True, 512, False)
    q, k, v = (jnp.asarray(r.standard_normal((8, S, 64)) / 8, jnp.bfloat16) for _ in range(3))
    st = jax.jit(jax.grad(lambda q, k, v: jnp.sum(K(q, k, v).astype(F)), argnums=(0, 1, 2)))
    jax.block_until_ready(st(q, k, v)); t = time.perf_counter()
    for _ in range(5): x = st(q, k, v)
    jax.block_until_ready(x); ms = (time.perf_counter() - t) / 5 * 1e3
    fl = 4 * 8 * S * S * 64 / 2 * 3.5
    print(f"S={S}: {ms:.1f} ms fwd+bwd, {fl / ms / 1e9:.1f}TF, peak {jax.devices()[0].memory_stats()['peak_bytes_in_use'] / 2**30:.2f} GiB", flush=True)
