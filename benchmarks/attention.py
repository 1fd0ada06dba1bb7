"""`px.models.dot_product_attention` on one device against XLA's attention:
which kernel it takes (cuDNN's fused one on a GPU that accepts the
arguments, said by the absence of the fallback warning), how far its values
and gradients are from XLA's, and the time of a forward and backward pass.

Run: ``python benchmarks/attention.py [--seq 1024,4096] [--batch 4]
[--heads 8] [--dim 64] [--dtypes bfloat16,float32] [--out F]``
"""

import argparse
import json
import logging
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp

import phalanx as px


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="1024,4096")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="write the numbers as JSON")
    args = parser.parse_args()

    warnings: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("phalanx").addHandler(Said(logging.WARNING))

    def loss(attend, q, k, v):
        return (
            jax.vmap(lambda q, k, v: attend(q, k, v))(q, k, v).astype(jnp.float32).sum()
        )

    def ours(q, k, v):
        return px.models.dot_product_attention(q, k, v, causal=True)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla"
        )

    def timed(fn, *xs) -> float:
        jax.block_until_ready(fn(*xs))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*xs))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows = []
    print(jax.devices()[0].device_kind)
    for dtype in args.dtypes.split(","):
        for seq in map(int, args.seq.split(",")):
            shape = (args.batch, seq, args.heads, args.dim)
            keys = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
            before = len(warnings)
            steps = {
                name: jax.jit(
                    jax.value_and_grad(
                        lambda q, k, v, a=attend: loss(a, q, k, v), argnums=(0, 1, 2)
                    )
                )
                for name, attend in (("phalanx", ours), ("xla", xla))
            }
            (_, ours_grads), (_, xla_grads) = (
                steps[n](q, k, v) for n in ("phalanx", "xla")
            )
            outs = [
                jax.jit(jax.vmap(f))(q, k, v).astype(jnp.float32) for f in (ours, xla)
            ]
            row = {
                "dtype": dtype,
                "seq": seq,
                "cudnn": jax.default_backend() == "gpu" and len(warnings) == before,
                "refusal": warnings[before:],
                "max_abs_out": float(jnp.max(jnp.abs(outs[0] - outs[1]))),
                "max_abs_grad": max(
                    float(
                        jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                    )
                    for a, b in zip(ours_grads, xla_grads, strict=True)
                ),
                "phalanx_s": timed(steps["phalanx"], q, k, v),
                "xla_s": timed(steps["xla"], q, k, v),
            }
            rows.append(row)
            print(
                f"{dtype:>9} seq {seq:>6}: cudnn {row['cudnn']!s:<5} "
                f"|Δout| {row['max_abs_out']:.3g} |Δgrad| {row['max_abs_grad']:.3g} "
                f"fwd+bwd {row['phalanx_s'] * 1e3:.3f} ms, "
                f"xla {row['xla_s'] * 1e3:.3f} ms"
            )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
