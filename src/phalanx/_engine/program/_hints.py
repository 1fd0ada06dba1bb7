"""What to fix when the first batch does not fit the model and loss.

The first batch is traced through the model and loss before anything
compiles. When that fails, the model is traced alone on the same inputs to
tell a model that cannot take the inputs (their shape, their dtype, a state
argument given or missing, a model written for whole batches) from a loss
that cannot take the model's outputs and the targets. (A hook's call
whose arguments do not fit what it calls is the hook's mistake, told before
this: see `_checks._calls`.)
"""

import inspect
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np

from ..step._forward import forward
from ._spec import BatchSpec


def first_batch_hint(
    spec: BatchSpec,
    model: Any,
    model_state: eqx.nn.State | None,
    *,
    pass_key: bool,
    size: int,
) -> str:
    """What to fix, for a first batch of `spec` (a step of `size` examples)
    that the model and loss failed on (`model` and `model_state` may be
    shapes alone: `jax.ShapeDtypeStruct` leaves)."""
    structs = [
        jax.ShapeDtypeStruct((size, *shape), dtype)
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    ]
    batch = jax.tree.unflatten(spec.treedef, structs)
    inputs, targets = batch if isinstance(batch, tuple) else (None, None)
    keys = jax.ShapeDtypeStruct((size,), jax.eval_shape(lambda: jr.key(0)).dtype)

    def outputs_of(x: Any) -> Any:
        return eqx.filter_eval_shape(
            lambda m, s, x, k: forward(m, x, state=s, keys=k, pass_key=pass_key)[0],
            model,
            model_state,
            x,
            keys,
        )

    try:
        outputs = outputs_of(inputs)
    except Exception:
        return _model_hint(
            spec, model, model_state, inputs, outputs_of, pass_key=pass_key
        )
    ran = f"the model runs on x and gives outputs {_describe(outputs)} per example"
    if not jax.tree.leaves(targets):
        return f"{ran}, but the batches hold no targets y: yield (x, y) batches"
    return (
        f"{ran}, but the loss or metrics fail on them with targets y "
        f"{_describe(targets)}: fix the targets (their shape or dtype), or the "
        "loss or metrics for them"
    )


def _model_hint(
    spec: BatchSpec,
    model: Any,
    model_state: eqx.nn.State | None,
    inputs: Any,
    outputs_of: Callable[[Any], Any],
    *,
    pass_key: bool,
) -> str:
    """Why the model fails on the inputs: state, dtype, batch axis or shape
    (`outputs_of` traces the model on inputs of a batch's size, or raises)."""
    accepted, required = _positional_parameters(model)
    if model_state is not None and accepted < 2:
        return (
            "model_state= was given, so the model is called as model(x, state), "
            "but its __call__ takes no state: drop model_state= (it is for "
            "models with stateful layers, from eqx.nn.make_with_state)"
        )
    if model_state is None and required >= 2:
        return (
            "the model's __call__ takes a state after x (stateful layers such "
            "as BatchNorm): build it with model, state = "
            "eqx.nn.make_with_state(...)(...) and pass model_state=state"
        )
    cast = _cast_hint(model, inputs, outputs_of)
    if cast is not None:
        return cast
    if not pass_key and model_state is None and _runs_on_whole_batch(model, inputs):
        return (
            "the model runs on the whole batch but not on one example: models "
            "are called per example (jax.vmap inside); write __call__ for one "
            "example, without the batch axis"
        )
    return _shape_fix(spec, model)


def _cast_hint(model: Any, inputs: Any, outputs_of: Callable[[Any], Any]) -> str | None:
    """The cast to advise for integer inputs x, where the model runs on them
    cast to its own floating dtype: the dtype is then the cause (token ids
    into an embedding fail for another reason, and get no such advice)."""
    floats = {
        leaf.dtype
        for leaf in jax.tree.leaves(model)
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct)
        and jnp.issubdtype(leaf.dtype, jnp.inexact)
    }
    leaves = jax.tree.leaves(inputs)
    if not (floats and leaves and all(np.dtype(x.dtype).kind in "biu" for x in leaves)):
        return None
    dtype = sorted(str(d) for d in floats)[0]
    as_floats = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), inputs)
    try:
        outputs_of(as_floats)
    except Exception:
        return None  # not the dtype's fault
    kind = np.dtype(leaves[0].dtype).name
    return (
        f"x holds {kind} values but the model computes in {dtype}, and runs on "
        f"x cast to it: cast them, e.g. x.astype(np.{dtype}) (images: "
        f"x.astype(np.{dtype}) / 255)"
    )


def _positional_parameters(model: Any) -> tuple[int | float, int]:
    """How many positional arguments the model's __call__ accepts (inf for
    ``*args``, or where its signature cannot be read) and how many it
    requires, a ``key`` not counted."""
    try:
        parameters = inspect.signature(model).parameters.values()
    except (TypeError, ValueError):
        return math.inf, 0
    positional = [
        p
        for p in parameters
        if p.name != "key"
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    if any(p.kind == p.VAR_POSITIONAL for p in positional):
        return math.inf, 0
    required = sum(p.default is p.empty for p in positional)
    return len(positional), required


def _runs_on_whole_batch(model: Any, inputs: Any) -> bool:
    try:
        eqx.filter_eval_shape(lambda m, x: m(x), model, inputs)
    except Exception:
        return False
    return True


def _shape_fix(spec: BatchSpec, model: Any) -> str:
    """How to make the inputs x fit a model that declares its `in_size`
    (phalanx's and Equinox's Linear and MLP); generic for other models."""
    in_size = getattr(model, "in_size", None)
    expected = None
    if isinstance(in_size, int):
        expected = (in_size,)
    elif in_size == "scalar":
        expected = ()
    shape = spec.shapes[0]
    if expected is None or shape == expected:
        return "the model fails on x: fix the inputs or the model"
    n, size = spec.examples, math.prod(expected)
    fix = (
        f"the model takes examples of shape {expected}, but x holds "
        f"{len(shape)}-d examples of shape {shape}; "
    )
    if math.prod(shape) == size:
        return fix + f"reshape them, e.g. x.reshape{(n, *expected)}"
    return fix + (
        f"give each example {size} values, or flatten them with "
        f"x.reshape({n}, -1) and build the model with in_size={math.prod(shape)}"
    )


def _describe(tree: Any) -> str:
    """A pytree of shapes as dtype[per-example shape], e.g. float32[10]."""
    parts = [f"{x.dtype}{list(x.shape[1:])}" for x in jax.tree.leaves(tree)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
