"""The floating-point operations of a train step: `StepFlops` (the value
read by callbacks, the summary and the CLI) and `count_flops` (a jaxpr's
count).

The engine counts its train step traced on abstract arguments (nothing is
placed, compiled or run; `Programs.flops`, once per step size), so counting
adds no compile to a fit.

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
from typing import Any, NamedTuple

import jax.extend.core as jex


class StepFlops(NamedTuple):
    """The floating-point operations of one train step: its matrix
    multiplies and convolutions, forward and backward, over the global batch.

    Counted from the step's program (its jaxpr, the program XLA compiles),
    never run: ``2·m·n·k`` per matrix multiply, ``2`` per multiply-add of a
    convolution, a ``lax.scan``'s body times its length (microbatches,
    `Stacked` layers), the larger branch of a ``lax.cond``, a `while_loop`'s
    body once (its trip count is not known). Elementwise work (activations,
    the optimizer's update) is left out: as in the ``6·params·tokens``
    convention, and as in the peak figures of accelerators' matrix units
    that model FLOPs utilisation divides by.

    Attributes:
        total: the step's operations over all devices.
        devices: the devices the step runs on.
        size: the examples of the global step it was counted for.
    """

    total: float
    devices: int
    size: int

    @property
    def per_device(self) -> float:
        """Each device's share: `total` over `devices` (data parallelism
        splits every multiply evenly; work a device repeats is not counted)."""
        return self.total / self.devices

    def short(self) -> str:
        """E.g. ``"258 MFLOPs per step (32.2 MFLOPs per device)"``."""
        return (
            f"{format_flops(self.total)} per step "
            f"({format_flops(self.per_device)} per device)"
        )


def format_flops(n: float) -> str:
    """`n` operations with a unit, 3 significant figures: ``"258 MFLOPs"``."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOPs"


_UNITS = (("PFLOPs", 1e15), ("TFLOPs", 1e12), ("GFLOPs", 1e9), ("MFLOPs", 1e6))


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
            total += copies * count_flops(open_jaxpr(params["jaxpr"]))
        else:  # jit, remat, custom_jvp_call, while (its body once), ...
            total += sum(count_flops(inner) for inner in inner_jaxprs(params))
    return total


def _shape(var: Any) -> tuple[int, ...]:
    return var.aval.shape


def _size(var: Any) -> int:
    return math.prod(_shape(var))


def open_jaxpr(jaxpr: Any) -> jex.Jaxpr:
    """The open jaxpr of a closed or open one."""
    return jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr


def inner_jaxprs(params: dict[str, Any]) -> list[jex.Jaxpr]:
    """The jaxprs among an equation's parameters (alone or in a tuple)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex.ClosedJaxpr | jex.Jaxpr):
                found.append(open_jaxpr(item))
    return found
