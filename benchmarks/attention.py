"""`px.models.dot_product_attention` on one device against XLA's attention:
which kernel it takes (on a GPU cuDNN's fused one where it accepts the
arguments, said by the absence of the fallback warning; on a TPU JAX's
Pallas splash kernel), how far its values and gradients are from XLA's, and
the time of a forward and backward pass, causal.

Each cell (dtype, seq) also gets the speed as FLOP/s and, where the device
is in phalanx's peak table (`phalanx._telemetry._peak_flops`), as a
fraction of its peak for the dtype. FLOPs count only the unmasked half of
the causal scores: a forward pass is ``4 · batch · heads · seq² · dim / 2``
(two matmuls, ``q kᵀ`` and ``p v``, of ``2 · seq² · dim`` each). Keys
ending ``_model`` count a forward and backward pass as 3 forwards (the
model's FLOPs: the backward's four matmuls); keys ending
``_flashattention`` as 3.5 (the FlashAttention papers' count: the backward
recomputes the scores, a fifth matmul). Each side's compiled program's
planned memory (``_planned_bytes``: arguments, outputs and temporaries, as
XLA plans them) is per program; ``peak_bytes_in_use`` is the device's
high-water mark of the whole process after the cell (cells run in the order
given). A side that runs out of memory (XLA's at 16k tokens on a TPU v5e)
is recorded as ``"out of memory"`` in ``<side>_error`` and the run goes on.

Run: ``python benchmarks/attention.py [--seq 1024,4096] [--batch 4]
[--heads 8] [--dim 64] [--dtypes bfloat16,float32] [--repeats 10] [--out F]``
"""

import argparse
import json
import logging
import pathlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import phalanx as px
from phalanx._telemetry._peak_flops import peak_flops
from phalanx.models._tpu_attention import kernel_for


# A forward and backward pass in forward passes: the model's count, and the
# FlashAttention papers' (the backward's recomputed scores included).
COUNTS = {"model": 3.0, "flashattention": 3.5}
SIDES = ("phalanx", "xla")


def ours(q, k, v):
    return px.models.dot_product_attention(q, k, v, causal=True)


def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


ATTEND = {"phalanx": ours, "xla": xla}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
    kind = jax.devices()[0].device_kind
    print(kind)
    rows = []
    for dtype in args.dtypes.split(","):
        peak = peak_flops(kind, np.dtype(dtype))
        for seq in map(int, args.seq.split(",")):
            shape = (args.batch, seq, args.heads, args.dim)
            keys = jax.random.split(jax.random.key(0), 3)
            q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
            before = len(warnings)
            # On a TPU: whether the splash kernel takes these arguments,
            # compiled (False: in Pallas' interpreter; None: it does not).
            splash = kernel_for(
                seq, seq, args.dim, jnp.dtype(dtype), causal=True, what="attention"
            )
            forward = 4 * args.batch * args.heads * seq**2 * args.dim / 2
            row: dict[str, Any] = {
                "device": kind,
                "dtype": dtype,
                "seq": seq,
                "batch": args.batch,
                "heads": args.heads,
                "dim": args.dim,
                "flops_forward": forward,
                **{f"flops_{name}": n * forward for name, n in COUNTS.items()},
                "peak_flops": peak,
            }
            results = {}
            for side in SIDES:
                result, numbers = _side(ATTEND[side], (q, k, v), args.repeats)
                results[side] = result
                row.update({f"{side}_{key}": value for key, value in numbers.items()})
                for name in COUNTS:
                    flops = row[f"flops_{name}"]
                    seconds = row[f"{side}_s"]
                    rate = None if seconds is None else flops / seconds
                    row[f"{side}_tflops_{name}"] = None if rate is None else rate / 1e12
                    row[f"{side}_peak_fraction_{name}"] = (
                        None if rate is None or peak is None else rate / peak
                    )
            row["cudnn"] = jax.default_backend() == "gpu" and len(warnings) == before
            row["splash"] = splash is False
            row["refusal"] = warnings[before:]
            row.update(_differences(results["phalanx"], results["xla"]))
            stats = jax.devices()[0].memory_stats() or {}
            row["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
            rows.append(row)
            print(_line(row))
            if args.out:  # after each cell: a run cut short keeps what it measured
                pathlib.Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


def _side(
    attend: Callable, qkv: tuple[jax.Array, ...], repeats: int
) -> tuple[tuple[jax.Array, tuple[jax.Array, ...]] | None, dict[str, Any]]:
    """One side's output and gradients (None where it ran out of memory),
    and its numbers: seconds of a forward and backward pass (the median of
    `repeats`), the compiled program's planned bytes, the error if any."""

    def loss(q, k, v):
        return jax.vmap(attend)(q, k, v).astype(jnp.float32).sum()

    try:
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        compiled = step.lower(*qkv).compile()
        _, grads = compiled(*qkv)
        out = jax.jit(jax.vmap(attend))(*qkv).astype(jnp.float32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(*qkv))
            times.append(time.perf_counter() - start)
    except Exception as error:  # XLA's whole score matrix past the chip's memory
        if not _out_of_memory(error):
            raise
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        numbers = {"s": None, "planned_bytes": None, "error": "out of memory"}
        return None, numbers | {"error_message": first[:300]}
    memory = compiled.memory_analysis()
    planned = None
    if memory is not None:
        planned = int(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
    numbers = {"s": statistics.median(times), "planned_bytes": planned, "error": None}
    return (out, grads), numbers


def _out_of_memory(error: Exception) -> bool:
    """Whether `error` is XLA's out of memory (at compile or run time)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _differences(ours: Any, theirs: Any) -> dict[str, float | None]:
    """The largest |difference| of the outputs and of the gradients (None
    where a side has none)."""
    if ours is None or theirs is None:
        return {"max_abs_out": None, "max_abs_grad": None}

    def largest(a: jax.Array, b: jax.Array) -> float:
        return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

    pairs = zip(ours[1], theirs[1], strict=True)
    return {
        "max_abs_out": largest(ours[0], theirs[0]),
        "max_abs_grad": max(largest(a, b) for a, b in pairs),
    }


def _line(row: dict[str, Any]) -> str:
    """One cell as a line."""

    def time_of(side: str) -> str:
        if row[f"{side}_error"]:
            return row[f"{side}_error"]
        text = f"{row[f'{side}_s'] * 1e3:.3f} ms, {row[f'{side}_tflops_model']:.1f}"
        fraction = row[f"{side}_peak_fraction_model"]
        text += " TFLOP/s" if fraction is None else f" TFLOP/s ({fraction:.1%} of peak"
        return text if fraction is None else text + ", model count)"

    def number(key: str) -> str:
        return "-" if row[key] is None else f"{row[key]:.3g}"

    kernel = "cudnn" if row["cudnn"] else "splash" if row["splash"] else "none"
    return (
        f"{row['dtype']:>9} seq {row['seq']:>6}: kernel {kernel:<6} "
        f"|Δout| {number('max_abs_out')} |Δgrad| {number('max_abs_grad')} "
        f"fwd+bwd {time_of('phalanx')}; xla {time_of('xla')}"
    )


if __name__ == "__main__":
    main()
