"""Sums over the examples computed as dot products, for a global program
whose batch is replicated over a mesh axis.

XLA's SPMD partitioner (jaxlib 0.10.2) miscounts one kind of operation: a
convolution with ``batch_group_count > 1`` — the weight gradient of a
grouped or depthwise convolution, which sums over the examples — whose
examples are split over some mesh axes and replicated over others (the
batch of `MeshStrategy` when ``tensor > 1``). Its convolution handler
(``PartitionConvolutionWithSpatialDimensionHaloExchangeOnRHS``/``OnLHS`` in
``xla/service/spmd/convolution_handler.cc``) adds the devices' partial sums
with an all-reduce over *every* device (empty replica groups) instead of
over the axes the examples are split over, so each partial sum is counted
once per replica: the gradient comes out multiplied by the replicated axes'
size. A dot product (`dot_general`) that sums over the examples is
partitioned right (a dense layer's weight gradient is exact), so
`examples_summed_by_dots` evaluates a function with each such convolution
re-expressed as one: its windows gathered by slicing, then one `einsum`
(exact up to float summation order; it holds the kernel's taps × the
input's bytes while it runs). The reproduction for the upstream report:
``tests/strategies/test_xla_partitioner.py``.

This module changes how a traced function is computed, never what; it
places nothing.
"""

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util


_prims = jex.primitives
CONV = _prims.conv_general_dilated_p


def examples_summed_by_dots(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, computed with every convolution that sums over its batch
    (``batch_group_count > 1``) as a dot product instead (traced once, then
    evaluated from its jaxpr: the same operations where it has none).

    Raises:
        NotImplementedError: such a convolution lies inside a construct this
            cannot rebuild (e.g. a `jax.shard_map` in the model).
    """

    @functools.wraps(fn)
    def computed(*args: Any) -> Any:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = _evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shapes), out)

    return computed


def _is_summing(eqn: Any) -> bool:
    return eqn.primitive is CONV and eqn.params["batch_group_count"] > 1


def _summing(jaxpr: Any) -> bool:
    """Whether `jaxpr`, or one nested in it, has a convolution summing over
    its batch."""
    return any(
        _is_summing(eqn)
        or any(_summing(_open(sub)) for sub in jex.jaxprs_in_params(eqn.params))
        for eqn in jaxpr.eqns
    )


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr


def _evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """`jaxpr` evaluated (as `jax.core.eval_jaxpr`), each convolution
    summing over its batch computed by `conv_as_dot`, and each construct
    holding one rebuilt around its evaluated body."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jex.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        names = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with (
            source_info_util.user_context(eqn.source_info.traceback, name_stack=names),
            eqn.ctx.manager,
        ):
            if _is_summing(eqn):
                out = [conv_as_dot(*values, **eqn.params)]
            elif any(_summing(_open(s)) for s in jex.jaxprs_in_params(eqn.params)):
                out = _rebuilt(eqn, values)
            else:
                out = eqn.primitive.bind(
                    *values, **eqn.primitive.get_bind_params(eqn.params)
                )
                out = out if eqn.primitive.multiple_results else [out]
        for var, value in zip(eqn.outvars, out, strict=True):
            if not isinstance(var, jex.DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _closed(closed: Any) -> Callable[..., list[Any]]:
    return lambda *args: _evaluate(closed.jaxpr, closed.consts, args)


def _rebuilt(eqn: Any, values: list[Any]) -> list[Any]:
    """A construct whose body sums over a batch by convolution, rebuilt
    with `jax.lax`'s own constructors around the evaluated body. (The
    function is past differentiation: a custom derivative's rule is of no
    further use, and its primal is inlined.)"""
    params, name = eqn.params, eqn.primitive.name
    if name in ("jit", "pjit", "closed_call", "core_call"):
        body = params.get("jaxpr", params.get("call_jaxpr"))
        return _closed(body)(*values)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        body = params.get("call_jaxpr", params.get("fun_jaxpr"))
        return _closed(body)(*values)
    if name == "remat2":
        body = params["jaxpr"]
        cse = params["prevent_cse"]
        return jax.checkpoint(
            lambda *args: _evaluate(body, (), args),
            prevent_cse=cse if isinstance(cse, bool) else any(cse),
            policy=params["policy"],
        )(*values)
    if name == "scan":
        consts, carry = params["num_consts"], params["num_carry"]
        body = _closed(params["jaxpr"])

        def step(c: Any, x: Any) -> tuple[Any, Any]:
            out = body(*values[:consts], *c, *x)
            return out[:carry], out[carry:]

        last, ys = jax.lax.scan(
            step,
            values[consts : consts + carry],
            values[consts + carry :],
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
        return [*last, *ys]
    if name == "cond":
        index, *operands = values
        branches = [_closed(b) for b in params["branches"]]
        return jax.lax.switch(index, branches, *operands)
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond, body = _closed(params["cond_jaxpr"]), _closed(params["body_jaxpr"])
        return jax.lax.while_loop(
            lambda c: cond(*values[:nc], *c)[0],
            lambda c: body(*values[nc : nc + nb], *c),
            values[nc + nb :],
        )
    raise NotImplementedError(
        f"a grouped convolution's weight gradient inside {name!r} cannot be "
        "made exact on a mesh whose batch is replicated over an axis (XLA "
        "counts it once per replica); use tensor=1, or the convolution outside "
        f"the {name!r}"
    )


def conv_as_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    window_strides: Sequence[int],
    padding: Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int],
    rhs_dilation: Sequence[int],
    dimension_numbers: Any,
    feature_group_count: int,
    batch_group_count: int,
    precision: Any,
    preferred_element_type: Any,
    **unused: Any,
) -> jax.Array:
    """`jax.lax.conv_general_dilated` with ``batch_group_count > 1`` as one
    `einsum` over its windows (the same values, up to summation order).

    The input's batch splits into `batch_group_count` groups, group g
    convolved with the g-th group of output features (XLA's semantics).
    """
    del unused
    if feature_group_count != 1:  # XLA: at most one of the counts exceeds 1
        raise ValueError(f"{feature_group_count=} with {batch_group_count=}")
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    x = jnp.transpose(lhs, lhs_spec)  # (N, C, *spatial)
    w = jnp.transpose(rhs, rhs_spec)  # (O, C, *window)
    spatial = range(x.ndim - 2)
    # Padding and input dilation at once: edges, and zeros between entries.
    x = jax.lax.pad(
        x,
        jnp.zeros((), x.dtype),
        [(0, 0, 0)] * 2
        + [(lo, hi, d - 1) for (lo, hi), d in zip(padding, lhs_dilation, strict=True)],
    )
    window = w.shape[2:]
    out = tuple(
        (x.shape[2 + i] - (window[i] - 1) * rhs_dilation[i] - 1) // window_strides[i]
        + 1
        for i in spatial
    )
    # Every window of every output position, (N, C, *window, *out): sliced
    # once per output position or once per window tap, whichever is fewer.
    if math.prod(out) <= math.prod(window):
        pieces = [
            _slice(x, [o * s for o, s in zip(at, window_strides, strict=True)],
                   window, rhs_dilation)
            for at in itertools.product(*map(range, out))
        ]  # fmt: skip
        windows = jnp.stack(pieces, axis=-1)
    else:
        pieces = [
            _slice(x, [t * d for t, d in zip(tap, rhs_dilation, strict=True)],
                   out, window_strides)
            for tap in itertools.product(*map(range, window))
        ]  # fmt: skip
        windows = jnp.stack(pieces, axis=2)
    groups, (n, c), o = batch_group_count, x.shape[:2], w.shape[0]
    y = jnp.einsum(
        "gnckp,gock->ngop",
        windows.reshape(groups, n // groups, c, math.prod(window), math.prod(out)),
        w.reshape(groups, o // groups, c, math.prod(window)),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    order = tuple(int(i) for i in np.argsort(out_spec))
    return jnp.transpose(y.reshape(n // groups, o, *out), order)


def _slice(
    x: jax.Array, start: list[int], count: Sequence[int], step: Sequence[int]
) -> jax.Array:
    """`count` entries `step` apart from `start` along each spatial axis of
    `x` (N, C, *spatial)."""
    limit = [b + (n - 1) * s + 1 for b, n, s in zip(start, count, step, strict=True)]
    return jax.lax.slice(x, (0, 0, *start), (*x.shape[:2], *limit), (1, 1, *step))
