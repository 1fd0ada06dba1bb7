"""A train call compiled ahead of time, and what is known of it.

The abstract arguments of a train call of one or several steps
(`call_arguments`), the call compiled for them with the state's layouts
proven on the way (`compile_proven`: from its trace, then from its
output), and whether an error raised by calling it says its arguments are
not those it was compiled for (`mismatched`). `build_program` uses these;
nothing here builds the step functions, runs a step or sees a batch.
"""

from typing import Any

import jax
import jax.numpy as jnp

from ..._state._sums import NO_FLAGS
from ..step._layout import StateLayout, leaf_names
from ..step._reduced import unreduced
from ..step._step import StepParts
from ..step._step_parts import plan_steps
from ._executables import holding, key_of, take
from ._proofs import (
    by_leaf,
    constraint_mismatches,
    gradient_mismatches,
    output_mismatches,
    raise_if,
)


def compile_proven(
    call: jax.stages.Wrapped,
    arguments: tuple[Any, ...],
    step: StepParts,
    layout: StateLayout,
    treedef: Any,
    *,
    proofs: bool,
) -> jax.stages.Compiled:
    """`call` compiled for `arguments`, its layouts proven on the way where
    the trainer checks batches in the step too (`proofs`; `_proofs.py`):
    from its trace (which the compile reuses), then from its output
    (`step`, `layout`: the program's; `treedef`: its batches' structure).

    Raises:
        LayoutError: a parameter, gradient or state leaf would be resharded.
    """
    traced = call.trace(*arguments)
    if not proofs:
        return _executable(traced, arguments)
    names = leaf_names(layout.treedef)
    plan = plan_steps(step, layout, treedef, None)
    raise_if(
        gradient_mismatches(
            names, layout.shardings, by_leaf(layout.treedef, plan.grad_shardings)
        )
        + constraint_mismatches(
            traced.jaxpr.jaxpr,
            names,
            layout.shardings,
            by_leaf(layout.treedef, plan.use_shardings),
        )
        + unreduced(
            traced.jaxpr.jaxpr,
            _gradient_names(layout, names),
            step.strategy.axis_name,
        )
    )
    compiled = _executable(traced, arguments)
    # The state leaves as they came in (the step's own resharding, e.g.
    # ZeRO-2's gather of updated parameters, happens inside it).
    produced = compiled.output_shardings[0]
    raise_if(
        output_mismatches(
            names, layout.structs, compiled.input_shardings[0][0], produced
        )
    )
    return compiled


def _executable(traced: jax.stages.Traced, arguments: tuple[Any, ...]) -> Any:
    """`traced` lowered and compiled, or taken from the plan that compiled
    it (``_executables.py``)."""
    lowered = traced.lower()
    found = take(key_of(lowered, arguments)) if holding() else None
    return found or lowered.compile()


def _gradient_names(layout: StateLayout, names: list[str]) -> list[str]:
    """The names of the reduced gradient's leaves, in order (each floating
    array of the model), as a per-device program returns them first."""
    return [
        f"{name}'s gradient"
        for name, struct in zip(names, layout.structs, strict=True)
        if name.startswith("state.model") and jnp.issubdtype(struct.dtype, jnp.inexact)
    ]


def call_arguments(
    layout: StateLayout,
    shapes: list[jax.ShapeDtypeStruct],
    size: int,
    sums: int,
    shardings: tuple[Any, Any, Any],
    k: int,
) -> tuple[Any, ...]:
    """The abstract arguments of a train call of `k` steps (1: one step,
    unstacked). State leaves are strongly typed: a weakly typed initial
    leaf is accepted by the compiled step, and every later state is strong.
    """
    lead = () if k == 1 else (k,)
    leaves, split, rep = shardings  # each batch leaf's, the weights', replicated
    state = [
        jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
        for s, sharding in zip(layout.structs, layout.shardings, strict=True)
    ]
    batch = [
        jax.ShapeDtypeStruct((*lead, *s.shape), s.dtype, sharding=leaf)
        for s, leaf in zip(shapes, leaves, strict=True)
    ]
    return (
        state,
        jax.ShapeDtypeStruct((sums,), jnp.float32, sharding=rep),
        jax.ShapeDtypeStruct(NO_FLAGS.shape, NO_FLAGS.dtype, sharding=rep),
        batch,
        jax.ShapeDtypeStruct((*lead, size), jnp.float32, sharding=split),
        jax.ShapeDtypeStruct(lead, jnp.float32, sharding=rep),
    )


def mismatched(error: BaseException) -> bool:
    """Whether `error`, raised by calling a compiled step, says its arguments
    are not those it was compiled for (raised before it runs: nothing was
    donated)."""
    text = str(error)
    return isinstance(error, TypeError | ValueError) and (
        text.startswith("Argument types differ")
        or text.startswith("Computation was compiled for input shardings")
    )
