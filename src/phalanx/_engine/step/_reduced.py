"""A proof that a per-device program reduces what it says it reduces (issue
43, item 4): for each `jax.shard_map` in a train step, which mesh axes each
of its values may still differ along (a value read from an input split over
an axis differs along it; a `psum` or `all_gather` over the axis makes it
the same again), and, for each output its `out_specs` declares whole along
an axis, that it no longer differs along it.

`jax.shard_map`'s own check (``check_vma=True``) would prove this, but also
sum the gradients of replicated inputs by itself (see
`strategies/_per_device.py`): phalanx's programs run with it off, and this
module proves the one property it needs, once per compile, on the jaxpr.
"""

from collections.abc import Sequence
from typing import Any

import jax.extend.core as jex

from ..._telemetry._flops import inner_jaxprs, open_jaxpr


Axes = frozenset[str]
_NONE: Axes = frozenset()

# Collectives after which a value is the same along their axes.
_REDUCING = {"psum", "pmean", "pmax", "pmin", "all_gather", "psum_invariant"}
# After which it differs along them (each device its own part or index).
_SPLITTING = {"psum_scatter", "reduce_scatter", "pbroadcast", "pvary", "axis_index"}


def unreduced(
    jaxpr: jex.Jaxpr, names: Sequence[str], batch_axes: str | Sequence[str]
) -> list[str]:
    """One line per output of a per-device program in `jaxpr` (a `shard_map`
    manual over the strategy's `batch_axes`: its ``axis_name``) that its
    `out_specs` declares whole along a mesh axis but that may still differ
    along it; the step's outputs named by `names` (the reduced gradients'
    leaves, in order, then the step's sums). A `shard_map` of the model's
    own (attention over a sequence split over ``context`` is manual over
    that axis too) is the model's to prove, against one device, with
    `phalanx.testing.assert_equivalent`. (This walk, on its
    outputs that JAX batched apart from its inputs split over the examples,
    would see every output differ.)"""
    found: list[str] = []
    axes = frozenset((batch_axes,) if isinstance(batch_axes, str) else batch_axes)
    for eqn in _shard_maps(jaxpr):
        body = open_jaxpr(eqn.params["jaxpr"])
        manual = frozenset(eqn.params["newly_manual_axes"])
        if manual != axes:
            continue
        # An axis of one device (data × fsdp = 1 on a tensor-only mesh) has
        # nothing to differ between.
        sizes = eqn.params["mesh"].shape
        manual = frozenset(axis for axis in manual if sizes[axis] > 1)
        ins = [_spec_axes(spec) & manual for spec in eqn.params["in_specs"]]
        outs = _run(body, ins)
        for j, (varies, spec) in enumerate(
            zip(outs, eqn.params["out_specs"], strict=True)
        ):
            left = (varies & manual) - _spec_axes(spec)
            if left:
                what = names[j] if j < len(names) else f"output {j}"
                found.append(
                    f"{what}: the per-device program returns it whole along "
                    f"{sorted(left)}, but it still differs between the devices "
                    "along them (no psum over them: left unreduced); add the "
                    "axes to the reduction (jax.lax.psum(x, axis_names))"
                )
    return found


def _shard_maps(jaxpr: jex.Jaxpr) -> list[Any]:
    """The outermost `shard_map` equations of `jaxpr`, inner jaxprs too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(eqn)
            continue
        for inner in inner_jaxprs(eqn.params):
            found.extend(_shard_maps(inner))
    return found


def _run(jaxpr: jex.Jaxpr, ins: Sequence[Axes]) -> list[Axes]:
    """The axes each output of `jaxpr` may differ along, given its inputs'."""
    env: dict[Any, Axes] = {}
    for var, axes in zip(jaxpr.invars, ins, strict=True):
        env[var] = axes

    def read(v: Any) -> Axes:
        return env.get(v, _NONE) if isinstance(v, jex.Var) else _NONE

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        for var, axes in zip(eqn.outvars, _equation(eqn, args), strict=True):
            env[var] = axes
    return [read(v) for v in jaxpr.outvars]


def _equation(eqn: Any, args: list[Axes]) -> list[Axes]:
    name, params = eqn.primitive.name, eqn.params
    every = frozenset().union(*args) if args else _NONE
    n = len(eqn.outvars)
    if name in _REDUCING:
        named = _names(params)
        return [arg - named for arg in args][:n] + [every - named] * max(
            0, n - len(args)
        )
    if name in _SPLITTING:
        return [every | _names(params)] * n
    if name == "scan":
        return _scan(eqn, args)
    if name == "while":
        return _while(eqn, args)
    if name == "cond":
        branches = [_run(b.jaxpr, args[1:]) for b in params["branches"]]
        return [
            frozenset().union(args[0], *outs) for outs in zip(*branches, strict=True)
        ]
    inner = _inner_call(params)
    if inner is not None and len(inner.invars) == len(args):
        return _run(inner, args)
    return [every] * n  # anything else: as any of its inputs


def _scan(eqn: Any, args: list[Axes]) -> list[Axes]:
    body = open_jaxpr(eqn.params["jaxpr"])
    consts, carries = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = list(args[consts : consts + carries])
    for _ in range(len(carry) + 1):  # to a fixed point: sets only grow
        outs = _run(body, [*args[:consts], *carry, *args[consts + carries :]])
        grown = [c | o for c, o in zip(carry, outs[:carries], strict=True)]
        if grown == carry:
            break
        carry = grown
    outs = _run(body, [*args[:consts], *carry, *args[consts + carries :]])
    return [*carry, *outs[carries:]]


def _while(eqn: Any, args: list[Axes]) -> list[Axes]:
    params = eqn.params
    body = open_jaxpr(params["body_jaxpr"])
    skip = params["cond_nconsts"] + params["body_nconsts"]
    consts = args[params["cond_nconsts"] : skip]
    carry = list(args[skip:])
    for _ in range(len(carry) + 1):
        grown = [
            c | o for c, o in zip(carry, _run(body, [*consts, *carry]), strict=True)
        ]
        if grown == carry:
            break
        carry = grown
    return carry


def _names(params: dict[str, Any]) -> Axes:
    for key in ("axes", "axis_name", "axis_names"):
        if key in params:
            value = params[key]
            values = (
                value if isinstance(value, tuple | list | frozenset | set) else (value,)
            )
            return frozenset(v for v in values if isinstance(v, str))
    return _NONE


def _spec_axes(spec: Any) -> Axes:
    axes = set()
    for entry in spec or ():
        if entry is None:
            continue
        axes.update(entry if isinstance(entry, tuple) else (entry,))
    return frozenset(axes)


def _inner_call(params: dict[str, Any]) -> jex.Jaxpr | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        value = params.get(key)
        if isinstance(value, jex.ClosedJaxpr | jex.Jaxpr):
            return open_jaxpr(value)
    return None
