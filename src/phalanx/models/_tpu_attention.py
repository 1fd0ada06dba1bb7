"""Where JAX's Pallas splash kernel computes attention (`_splash.py`), and
attention of one whole sequence by it: the score matrix is never built
whole, block by block in the chip's fast memory, with the causal blocks
above the diagonal skipped.

On the lent TPU v5e (GPT-2-small shape, 12 heads of 64, 1,024 tokens, bf16)
XLA's attention ran out of memory at batch 8 where the kernel trained, and
at 16,384 tokens (batch 4, 8 heads of 64) XLA's needed 48.9 GB where the
kernel needs under 0.4 GB.

The kernel runs where attention is traced in one device's program on a
TPU; off a TPU only in Pallas' interpreter (`INTERPRET`, which the tests
set: CI has no TPU). Where it does not take the arguments, `kernel_for`
says why once, in a warning naming XLA's attention as the fallback.
"""

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float

from .._log import logger
from . import _splash


# Off a TPU, run the kernel in Pallas' interpreter instead of XLA's attention
# (the tests set it: CI has no TPU).
INTERPRET = False

# The refusals said, each once per process and shapes.
_said: set[str] = set()


def kernel_for(
    seq: int,
    kv_seq: int,
    dim: int,
    dtype: jnp.dtype,
    *,
    causal: bool,
    what: str,
    instead: str = "XLA's attention",
) -> bool | None:
    """Whether attention traced now runs the splash kernel in Pallas'
    interpreter (True) or compiled (False); None where it does not run it:
    no TPU (nor `INTERPRET`), or arguments it refuses, said in one warning
    that `what` uses `instead`, and why."""
    tpu = jax.default_backend() == "tpu"
    if not (tpu or INTERPRET):
        return None
    reason = _not_one_device() or _splash.refusal(
        seq, kv_seq, dim, dtype, causal=causal
    )
    if reason is not None:
        _refuse(f"{what} uses {instead}, not the splash kernel: {reason}")
        return None
    return not tpu


def splash_attention(
    query: Float[Array, "seq heads dim"],
    key: Float[Array, "kv_seq heads dim"],
    value: Float[Array, "kv_seq heads dim"],
    mask: Bool[Array, " kv_seq"] | None,
    *,
    causal: bool,
    interpret: bool,
) -> Float[Array, "seq heads dim"]:
    """``softmax(q kᵀ / sqrt(dim)) v`` of one example by the splash kernel,
    where `kernel_for` said it takes the arguments. `mask` marks the real
    keys."""
    scale = jnp.asarray(1 / math.sqrt(query.shape[-1]), query.dtype)
    q, k, v = (jnp.swapaxes(x, 0, 1) for x in (query * scale, key, value))

    def attend(q: Array, k: Array, v: Array, mask: Array | None) -> Array:
        return _splash.attend(q, k, v, mask, causal, interpret)[0]

    if not interpret:  # Mosaic's lowering needs it; the interpreter does not
        attend = manual_everywhere(attend)
    return jnp.swapaxes(attend(q, k, v, mask), 0, 1).astype(query.dtype)


def on_one_device() -> bool:
    """Whether the attention being traced runs in one device's program: a
    per-device program (manual over every mesh axis larger than one
    device), or a process of one device."""
    return _not_one_device() is None


def _not_one_device() -> str | None:
    """Why the attention being traced is not in one device's program, or
    None where it is. A Pallas kernel is not split by XLA's partitioner:
    under a global view over several devices its operands would be gathered
    whole onto each."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty and abstract.manual_axes:
        auto = [
            f"{name}={size}"
            for name, size in abstract.shape.items()
            if name not in abstract.manual_axes and size > 1
        ]
        if not auto:
            return None
        return (
            f"the mesh axes {', '.join(auto)} stay automatic where it is traced "
            "(the kernel runs in one device's program)"
        )
    if jax.device_count() == 1:
        return None
    return (
        f"it is traced in a global view over {jax.device_count()} devices, not in "
        "one device's program (a per-device step, or a context split)"
    )


def manual_everywhere(f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` (of arrays, each replicated over the mesh axes left) made manual
    over the mesh's axes left automatic where it is traced, where each is
    of one device (`_automatic_axes`): Mosaic lowers a kernel only where
    every mesh axis is manual, and a per-device step over some axes (the
    microbatches' accumulation) leaves the others automatic. On one device
    each, a `shard_map` over them changes no value. (On the v5e, GPT-2
    small under 2 and 4 microbatches did not compile without.)"""
    auto = _automatic_axes()
    if not auto:
        return f
    return jax.shard_map(
        f, in_specs=P(), out_specs=P(), axis_names=set(auto), check_vma=False
    )


def _automatic_axes() -> tuple[str, ...]:
    """The mesh axes left automatic where attention is traced in a
    per-device program (manual over others), where each is of one device:
    none outside one, nor where a larger axis is left (`kernel_for`
    refuses the kernel there)."""
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty or not abstract.manual_axes:
        return ()
    auto = {n: k for n, k in abstract.shape.items() if n not in abstract.manual_axes}
    return tuple(auto) if set(auto.values()) <= {1} else ()


def _refuse(line: str) -> None:
    """Say once per process (and shapes, which the line names) that the
    kernel does not run."""
    if line not in _said:
        _said.add(line)
        logger.warning("%s", line)
