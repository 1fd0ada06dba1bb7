"""A compiled candidate's step, run for a few steps and timed (a plan's
``measure=``): the program the plan compiled, called on arrays of the
shapes and layouts it was compiled for, filled with constants.

The values are not a model's: every float 0.01 (no square root of a
negative, no overflow) and every integer 0 (a valid token or label of any
vocabulary). A step's time depends on the shapes, the layouts and the
program, not on the values: a real fit's steps run the same executable.
"""

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..strategies._placement import put_state


# Steps run before the timed ones: the first call of an executable pays for
# loading it and for first-touch allocations, which no later step does.
WARMUP = 1
# Steps timed: their median is the candidate's measured step time.
STEPS = 5


def step_seconds(
    compiled: jax.stages.Compiled, arguments: Any, steps: int, *, held: bool = False
) -> float:
    """The median seconds of `steps` steps of `compiled`, after `WARMUP`
    untimed ones, on arrays laid out as `arguments` (its abstract
    arguments) say. `compiled` is a train step ``(leaves, sums, flags,
    batch, weight, total) -> (leaves, (sums, flags), step_sums)`` donating
    its state and sums, or with `held` the held guard's (``_held.py``),
    which takes the spare after the state and donates it instead: each
    step takes the state, sums and flags the one before returned (held,
    the state before it as the spare), as a fit's do; each is waited for
    before the next."""
    leaves, *rest = _arrays(arguments)
    spare, (sums, flags, batch, weight, total) = (
        (rest[0], rest[1:]) if held else ([], rest)
    )
    times = []
    for step in range(WARMUP + steps):
        began = time.perf_counter()
        spares = (spare,) if held else ()
        out = compiled(leaves, *spares, sums, flags, batch, weight, total)
        jax.block_until_ready(out)
        if step >= WARMUP:
            times.append(time.perf_counter() - began)
        spare, leaves, (sums, flags) = leaves, out[0], out[1]
    return statistics.median(times)


def _arrays(arguments: Any) -> Any:
    """Arrays of `arguments`' shapes, dtypes and shardings (see module),
    each device given its own part only; nothing is compiled for them."""
    return jax.tree.map(_array, arguments)


def _array(struct: jax.ShapeDtypeStruct) -> jax.Array:
    dtype = struct.dtype
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(0), struct.shape)
        [placed] = put_state([keys], [struct.sharding])
        return placed
    fill = 0.01 if jnp.issubdtype(dtype, jnp.inexact) else 0
    return jax.make_array_from_callback(
        struct.shape, struct.sharding, lambda index: _filled(struct, index, fill)
    )


def _filled(struct: jax.ShapeDtypeStruct, index: Any, fill: int | float) -> np.ndarray:
    """The part `index` of an array of `struct`'s shape filled with `fill`."""
    shape = tuple(
        len(range(*part.indices(size)))
        for part, size in zip(index, struct.shape, strict=True)
    )
    return np.full(shape, fill, dtype=struct.dtype)
