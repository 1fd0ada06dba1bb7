"""Issue 56's ceiling: what a v5e reaches on the matmuls of attention at
head dim 64 against 128 (bf16, batch*heads 32, plain XLA einsums), a big
square matmul for the chip's practical peak, and splash causal fwd+bwd at
8x64 against 4x128 (the same width) at 4k/8k/16k. Writes $OUT/ceiling.json."""
import json, os, time, statistics, sys
sys.path.insert(0, "src")
import jax, jax.numpy as jnp
OUT = os.environ.get("OUT", "/tmp")
PEAK = 197e12
rows = []
def save(row):
    print(row, flush=True); rows.append(row)
    json.dump(rows, open(f"{OUT}/ceiling.json", "w"), indent=1)
def timed(f, *xs, reps=7):
    jax.block_until_ready(f(*xs))
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(*xs)); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
k = jax.random.key(0)
a = jax.random.normal(k, (8192, 8192), jnp.bfloat16)
t = timed(jax.jit(lambda a, b: a @ b), a, a)
save(dict(case="square 8192 bf16", ms=t * 1e3, pct=2 * 8192**3 / t / PEAK * 100))
for seq in (4096, 8192):
    for d in (64, 128):
        bh = 32 * 64 // d  # the same width: 8x64 or 4x128, batch 4
        q = jax.random.normal(k, (bh, seq, d), jnp.bfloat16)
        flops = 2 * bh * seq * seq * d
        qk = jax.jit(lambda q, kk: jnp.einsum("bqd,bkd->bqk", q, kk, preferred_element_type=jnp.float32))
        t = timed(qk, q, q)
        save(dict(case=f"QK^T seq {seq} d {d} bh {bh}", ms=t * 1e3, pct=flops / t / PEAK * 100))
        p = jax.random.normal(k, (bh, seq, seq), jnp.bfloat16)
        pv = jax.jit(lambda p, v: jnp.einsum("bqk,bkd->bqd", p, v, preferred_element_type=jnp.float32))
        t = timed(pv, p, q)
        save(dict(case=f"PV seq {seq} d {d} bh {bh}", ms=t * 1e3, pct=flops / t / PEAK * 100))
        del p
import phalanx as px
for seq in (4096, 8192, 16384):
    for heads, d in ((8, 64), (4, 128)):
        try:
            q, kk, v = (jax.random.normal(jax.random.key(i), (4, seq, heads, d), jnp.bfloat16) for i in range(3))
            f = jax.vmap(lambda q, kk, v: px.models.dot_product_attention(q, kk, v, causal=True))
            step = jax.jit(jax.grad(lambda q, kk, v: f(q, kk, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            t = timed(step, q, kk, v, reps=5)
            flops = 4 * 4 * heads * seq * seq * d / 2
            save(dict(case=f"phalanx attention causal fwd+bwd seq {seq} {heads}x{d}", ms=t * 1e3, pct_3x=3 * flops / t / PEAK * 100))
        except Exception as e:
            save(dict(case=f"attention seq {seq} {heads}x{d}", error=str(e).splitlines()[0][:200]))
