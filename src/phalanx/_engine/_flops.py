"""The floating-point operations of a train step, counted on its jaxpr.

`count_flops` walks a jaxpr; `FlopCounter` traces a trainer's train step
for a global step size (abstract arguments: nothing is placed, compiled or
run) and remembers the count per size. It never compiles, so counting adds
no compile to a fit.

Why not XLA's `Compiled.cost_analysis()` (measured here, JAX 0.10.2,
XLA:CPU, the MLP 784-256-128-10 at batch 256, adam, 8 devices; the matrix
multiplies come to 257.8 MFLOPs): it counts a while loop's body once, known
trip count or not, so `AccumulatingStrategy(inner, 4)` reported 12.3 MFLOPs
per device instead of ~36, and a step of `Stacked` layers one layer; its
count is of each device's partitioned program (36.3 MFLOPs on each of 8
devices, 290 MFLOPs in all, the replicated optimizer update counted 8
times); and reading it without compiling the step again needs abstract
arguments exactly like the call's (a NumPy batch's leaves without a
sharding, a device batch's with one), or JAX compiles the step once more.
"""

import math
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from .._state._sums import NO_FLAGS
from .._telemetry._flops import StepFlops
from ._compiled import StepCompiler, Steps


def count_flops(jaxpr: jex.Jaxpr) -> float:
    """The operations of `jaxpr`'s matrix multiplies and convolutions (see
    `StepFlops`), its inner jaxprs included."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        params = eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = _shape(eqn.invars[0])
            depth = math.prod(lhs[d] for d in contract)
            total += 2.0 * _size(eqn.outvars[0]) * depth
        elif name == "conv_general_dilated":
            rhs = _shape(eqn.invars[1])
            out_features = rhs[params["dimension_numbers"].rhs_spec[0]]
            # Each output element: in_features / groups × the window's size.
            total += 2.0 * _size(eqn.outvars[0]) * math.prod(rhs) / out_features
        elif name == "scan":
            total += params["length"] * count_flops(params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(count_flops(branch.jaxpr) for branch in params["branches"])
        elif name == "shard_map":  # its body sees one device's slice
            mesh = params["mesh"]
            copies = math.prod(mesh.shape[a] for a in params["newly_manual_axes"])
            total += copies * count_flops(_open(params["jaxpr"]))
        else:  # jit, remat, custom_jvp_call, while (its body once), ...
            total += sum(count_flops(inner) for inner in _inner(params))
    return total


class FlopCounter:
    """The FLOPs of a trainer's train step, per global step size.

    The step is traced on abstract arguments of that size (`jax.jit`'s
    `trace`: the same trace a call makes, taken from JAX's cache where the
    step has run on a batch of that size), never compiled or run.
    """

    def __init__(self, compiler: StepCompiler):
        self.compiler = compiler
        self._counts: dict[int, StepFlops] = {}

    def count(self, steps: Steps, shapes: list[Any], size: int) -> StepFlops:
        """The FLOPs of `steps.train` on batches of `size` examples whose
        leaves have these per-example `shapes` (``(shape, dtype)`` pairs)."""
        known = self._counts.get(size)
        if known is None:
            known = self._counts[size] = self._count(steps, shapes, size)
        return known

    def _count(self, steps: Steps, shapes: list[Any], size: int) -> StepFlops:
        compiler = self.compiler
        layout, strategy = compiler.layout, compiler.parts.strategy
        state = [
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
            for s, sharding in zip(layout.structs, layout.shardings, strict=True)
        ]
        # A NumPy batch's leaves (as `fit` passes one process's host batches:
        # the trace JAX has cached); the count is the same for device leaves.
        batch = [jax.ShapeDtypeStruct((size, *shape), dtype) for shape, dtype in shapes]
        traced = steps.train.trace(
            state,
            jax.ShapeDtypeStruct((steps.sums.size,), jnp.float32),
            jax.ShapeDtypeStruct(NO_FLAGS.shape, NO_FLAGS.dtype),
            batch,
            jax.ShapeDtypeStruct((size,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
        )
        total = count_flops(traced.jaxpr.jaxpr)
        return StepFlops(total=total, devices=strategy.num_devices, size=size)


def _shape(var: Any) -> tuple[int, ...]:
    return var.aval.shape


def _size(var: Any) -> int:
    return math.prod(_shape(var))


def _open(jaxpr: Any) -> jex.Jaxpr:
    """The open jaxpr of a closed or open one."""
    return jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr


def _inner(params: dict[str, Any]) -> list[jex.Jaxpr]:
    """The jaxprs among an equation's parameters (alone or in a tuple)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex.ClosedJaxpr | jex.Jaxpr):
                found.append(_open(item))
    return found
