"""Issue 56's 35%: splash with SEQ_MINOR layouts (head dim 64 fills half the
128 lanes in HEAD_DIM_MINOR; the kernel takes (heads, seq, dim) whatever the
layout and transposes a SEQ_MINOR input itself: checked in Pallas'
interpreter, every layout the same values and grads), and JAX's
flash_attention kernel; causal
fwd+bwd, batch 4, 8x64, bf16, 4k-16k. Not run yet (no device time in the session that wrote it): on the
lent TPU, `SCRIPT=layouts56.py LIMIT=500 bash scratch/run.sh` with this file
copied to scratch/layouts56.py, carry [".whl-tpu", "scratch"]; writes $OUT/layouts.json."""
import json, os, time, statistics
import jax, jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash, splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu import flash_attention as fa

OUT = os.environ.get("OUT", "/tmp")
rows = []
SEQ_MINOR, HEAD_MINOR = splash.QKVLayout.SEQ_MINOR, splash.QKVLayout.HEAD_DIM_MINOR

def splash_kernel(seq, heads, bq, bkv, bkvc, layout, fused=True):
    blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc,
        block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkvc,
        block_q_dq=None if fused else bq, block_kv_dq=None if fused else bkv,
        use_fused_bwd_kernel=fused, q_layout=layout[0], k_layout=layout[1], v_layout=layout[2])
    one = masks.CausalMask((seq, seq))
    return splash.make_splash_mha(masks.MultiHeadMask([one] * heads), block_sizes=blocks, head_shards=1, q_seq_shards=1)

def timed(f, *xs, reps=5):
    jax.block_until_ready(f(*xs))
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); jax.block_until_ready(f(*xs)); ts.append(time.perf_counter() - t)
    return statistics.median(ts)

B, H, D = 4, 8, 64
LAYOUTS = {"HHH": (HEAD_MINOR,) * 3, "SSS": (SEQ_MINOR,) * 3, "HSH": (HEAD_MINOR, SEQ_MINOR, HEAD_MINOR), "HSS": (HEAD_MINOR, SEQ_MINOR, SEQ_MINOR)}
for seq in (4096, 8192, 16384):
    q, k, v = (jax.random.normal(jax.random.key(i), (B, H, seq, D), jnp.bfloat16) for i in range(3))
    flops = 4 * B * H * seq * seq * D / 2
    cases = []
    for lname, layout in LAYOUTS.items():
        for bq, bkv, bkvc in ((1024, 1024, 512), (512, 1024, 512), (1024, 2048, 512), (1024, 1024, 1024)):
            cases.append((f"splash {lname} {bq}/{bkv}/{bkvc}", "splash", (bq, bkv, bkvc, layout)))
    for bq, bk in ((512, 512), (1024, 512), (1024, 1024), (2048, 512)):
        cases.append((f"flash {bq}/{bk}", "flash", (bq, bk)))
    for name, kind, c in cases:
        try:
            if kind == "splash":
                bq, bkv, bkvc, layout = c
                kern = splash_kernel(seq, H, bq, bkv, bkvc, layout)
                def f(q, k, v, kern=kern):
                    return jax.vmap(kern)(q, k, v)
            else:
                bq, bk = c
                sizes = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1,
                    block_q_major_dkv=bq, block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq,
                    block_k_major_dq=bk, block_k_dq=bk, block_q_dq=bq)
                def f(q, k, v, sizes=sizes):
                    return fa.flash_attention(q, k, v, causal=True, sm_scale=1.0, block_sizes=sizes)
            fwd = jax.jit(f)
            step = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
            tf, tb = timed(fwd, q, k, v), timed(step, q, k, v)
            row = dict(seq=seq, cfg=name, fwd_ms=tf * 1e3, fwdbwd_ms=tb * 1e3,
                       pct_3=3 * flops / tb / 197e12 * 100, pct_35=3.5 * flops / tb / 197e12 * 100)
        except Exception as e:
            row = dict(seq=seq, cfg=name, error=str(e).splitlines()[0][:200])
        print(row, flush=True)
        rows.append(row)
        json.dump(rows, open(f"{OUT}/layouts.json", "w"), indent=1)
