"""Layouts proven once per compile (issue 43, item 4): the shape checks,
extended to placement. Nothing here runs per step: each proof reads the
train step's jaxpr (its trace, which the compile reuses), the strategy's
declared layouts, or the compiled step's output shardings.

- **A parameter is used where it lies.** Every `with_sharding_constraint`
  the step applies to a parameter (or to one layer of a `Stacked` stack,
  inside its loop) must lay it out as it is stored, or as the strategy
  uses it (`Strategy.use_shardings`), or either gathered over some of its
  axes (what using a split parameter does anyway): any other moves an axis
  to another dimension, a reshard of that parameter on every step, and of
  its gradient back.
- **A gradient is laid out as its parameter.** Where the strategy places
  the reduced gradients (`Strategy.gradient_shardings`), each must lie as
  its parameter does.
- **The state keeps its layout.** The compiled step returns each state
  leaf in the layout it takes (its own resharding, e.g. ZeRO-2's gather of
  the updated parameters, happens inside the step, not between steps).
- **A per-device program reduces what it returns whole**
  (`_reduced.py`).

A mismatch is one `LayoutError` naming the leaf and both layouts.
"""

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
from jax.sharding import NamedSharding, PartitionSpec as P


class LayoutError(ValueError):
    """A layout the step would silently change: the leaf, both layouts."""


class _Leaf(NamedTuple):
    at: int  # the state leaf
    layer: bool  # one layer of it (its leading axis dropped, inside a loop)


# Primitives whose output lies as their input (a cast, a copy).
_SAME = {"convert_element_type", "copy", "copy_p", "reduce_precision"}
# Primitives that call one jaxpr with their own inputs, in order.
_CALLS = {
    "pjit",
    "closed_call",
    "core_call",
    "remat",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
}


def constraint_mismatches(
    jaxpr: jex.Jaxpr,
    names: Sequence[str],
    stored: Sequence[Any],
    used: Sequence[Any],
) -> list[str]:
    """One line per `with_sharding_constraint` in `jaxpr` (a train step's,
    the state's leaves its first inputs) that lays a parameter out neither
    as it is `stored` nor as it is `used` (None: as stored)."""
    known = {var: _Leaf(i, False) for i, var in enumerate(jaxpr.invars[: len(names)])}
    found: list[str] = []
    _walk(jaxpr, known, names, stored, used, found)
    return list(dict.fromkeys(found))  # each once (forward, backward, steps)


def _walk(
    jaxpr: jex.Jaxpr,
    known: dict[Any, _Leaf],
    names: Sequence[str],
    stored: Sequence[Any],
    used: Sequence[Any],
    found: list[str],
) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        first = eqn.invars[0] if eqn.invars else None
        leaf = known.get(first) if isinstance(first, jex.Var) else None
        if name in _SAME or name == "sharding_constraint":
            if leaf is None:
                continue
            known[eqn.outvars[0]] = leaf
            if name == "sharding_constraint":
                said = _mismatch(eqn, leaf, names, stored, used)
                if said:
                    found.append(said)
        elif name in _CALLS or name == "scan":
            inner = _inner(eqn.params)
            if inner is None or len(inner.invars) != len(eqn.invars):
                continue
            loop = (
                eqn.params["num_consts"] + eqn.params["num_carry"]
                if name == "scan"
                else None
            )
            mapped = {}
            for i, (outer, var) in enumerate(
                zip(eqn.invars, inner.invars, strict=True)
            ):
                got = known.get(outer) if isinstance(outer, jex.Var) else None
                if got is None:
                    continue
                if loop is not None and i >= loop:  # sliced along the loop
                    if got.layer:
                        continue  # a slice of a layer: not tracked further
                    got = got._replace(layer=True)
                mapped[var] = got
            if mapped:
                _walk(inner, mapped, names, stored, used, found)
        elif name == "cond":
            for branch in eqn.params["branches"]:
                inner = branch.jaxpr
                mapped = {
                    var: known[outer]
                    for outer, var in zip(eqn.invars[1:], inner.invars, strict=True)
                    if isinstance(outer, jex.Var) and outer in known
                }
                if mapped:
                    _walk(inner, mapped, names, stored, used, found)
        # shard_map: a per-device program, whose parameters are its own slices.


def _mismatch(
    eqn: Any,
    leaf: _Leaf,
    names: Sequence[str],
    stored: Sequence[Any],
    used: Sequence[Any],
) -> str | None:
    sharding = eqn.params["sharding"]
    if not isinstance(sharding, NamedSharding):
        return None
    ndim = len(eqn.outvars[0].aval.shape)
    allowed = [stored[leaf.at]]
    if used[leaf.at] is not None:
        allowed.append(used[leaf.at])
    if leaf.layer:
        allowed = [_one_layer(s) for s in allowed]
    if any(_gathers(sharding, a, ndim) for a in allowed):
        return None
    what = "one layer of it" if leaf.layer else "it"
    return (
        f"{names[leaf.at]} is stored as {_spec(allowed[0])}, and the step lays "
        f"{what} out as {_spec(sharding)} (a with_sharding_constraint on the "
        "parameter): every step would reshard it, and its gradient back; "
        "constrain the activations instead, or store it so with a rule "
        "(MeshStrategy(rules=...))"
    )


def gradient_mismatches(
    names: Sequence[str], stored: Sequence[Any], gradients: Sequence[Any]
) -> list[str]:
    """One line per parameter whose reduced gradient the strategy places
    other than the parameter (`gradients`: None where it says nothing)."""
    found = []
    for name, lies, grad in zip(names, stored, gradients, strict=True):
        if grad is None or not isinstance(grad, NamedSharding):
            continue
        ndim = len(lies.spec)
        if not grad.is_equivalent_to(lies, max(ndim, len(grad.spec))):
            found.append(
                f"{name}: its gradient is laid out as {_spec(grad)} after the "
                f"reduction, the parameter as {_spec(lies)}: the update would "
                "reshard it on every step; make the strategy's "
                "gradient_shardings return the parameters' own shardings"
            )
    return found


def output_mismatches(
    names: Sequence[str],
    structs: Sequence[jax.ShapeDtypeStruct],
    given: Sequence[Any],
    produced: Sequence[Any],
) -> list[str]:
    """One line per state leaf the compiled step returns in another layout
    than it takes (`given`: the input shardings, `produced`: the output's)."""
    found = []
    for name, struct, into, out in zip(names, structs, given, produced, strict=True):
        if not into.is_equivalent_to(out, len(struct.shape)):
            found.append(
                f"{name} goes into the step as {_spec(into)} and comes out as "
                f"{_spec(out)}: the next step would reshard it; lay it out as "
                "the step computes it (a rule), or constrain it where it is made"
            )
    return found


def raise_if(found: Sequence[str]) -> None:
    """One `LayoutError` for the mismatches `found` (nothing if none)."""
    if found:
        more = (
            f" (and {len(found) - 1} more: {'; '.join(found[1:3])})"
            if len(found) > 1
            else ""
        )
        raise LayoutError(f"layout: {found[0]}{more}")


def _gathers(sharding: NamedSharding, lies: Any, ndim: int) -> bool:
    """Whether `sharding` is `lies` or `lies` gathered over some of its axes
    (each dimension split over a subset of the axes it is split over there):
    what using a split parameter does anyway, not a reshard."""
    if sharding.is_equivalent_to(lies, ndim):
        return True
    if not isinstance(lies, NamedSharding) or sharding.mesh != lies.mesh:
        return False
    return all(
        set(_axes(sharding.spec, d)) <= set(_axes(lies.spec, d)) for d in range(ndim)
    )


def _axes(spec: P, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _one_layer(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, P(*sharding.spec[1:]))


def _spec(sharding: Any) -> str:
    spec = getattr(sharding, "spec", None)
    return str(spec) if spec is not None else str(sharding)


def _inner(params: dict[str, Any]) -> jex.Jaxpr | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        value = params.get(key)
        if isinstance(value, jex.ClosedJaxpr):
            return value.jaxpr
        if isinstance(value, jex.Jaxpr):
            return value
    return None


def by_leaf(treedef: Any, model: Any) -> list[Any]:
    """`model` (a tree of the state's model, with a sharding or None per
    array; None: none at all) as one value per state leaf of `treedef`
    (None for the leaves outside the model)."""
    numbered = jax.tree.unflatten(treedef, range(treedef.num_leaves))
    values: list[Any] = [None] * treedef.num_leaves
    if model is None:
        return values
    structure = jax.tree.structure(numbered.model)
    indices = structure.flatten_up_to(numbered.model)
    try:
        shardings = structure.flatten_up_to(model)
    except (TypeError, ValueError):  # a tree of another structure: unknown
        return values
    for index, sharding in zip(indices, shardings, strict=True):
        values[index] = sharding
    return values
