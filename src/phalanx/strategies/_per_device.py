"""The per-device programs of the mesh strategies: `jax.shard_map` over the
mesh axes a batch is split over, with one cross-device reduction.

`shard_map_reduce` runs a slice's work on each device and adds the devices'
sums once (an all-reduce, a reduce-scatter for sums laid out split, or a
fixed-order sum); `shard_map_apply` maps a function over each device's slice.
Both gather split parameters whole before the work. These functions know
mesh axes and partition specs only: which leaf is split where is the
strategy's to say (`DeviceMeshStrategy`), and nothing here places arrays.
"""

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, PartitionSpec as P
from jaxtyping import PyTree

from ._strategy import AxisName, LocalFn, MapFn


def axis_name_of(axes: tuple[str, ...]) -> AxisName:
    """`axes` as collectives and `PartitionSpec` take them: the name of one
    axis, the tuple of several (so a 1-D strategy compiles as it always did)."""
    return axes[0] if len(axes) == 1 else axes


def spec_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one entry of a `PartitionSpec` names (None: none)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _to_summable(x: jax.Array) -> jax.Array:
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _device_mean(total: jax.Array, like: jax.Array, n: int) -> jax.Array:
    """The mean over `n` slices of a summed leaf: ints floor, bools any."""
    if like.dtype == jnp.bool_:
        return total > 0
    if jnp.issubdtype(like.dtype, jnp.inexact):
        return total / jnp.asarray(n, like.dtype)
    return total // jnp.asarray(n, like.dtype)


# A mesh axis of one device that the per-device program leaves automatic.
_SPARE_AXIS = "_phalanx_spare"


def _shard_map(
    fn: Callable[..., Any],
    mesh: Mesh,
    axes: tuple[str, ...],
    in_specs: PyTree[P],
    out_specs: PyTree[P],
) -> Callable[..., Any]:
    """`jax.shard_map` of `fn`, manual over `axes` only: on `mesh` plus a
    spare automatic axis of size 1 (mesh axes not in `axes` stay automatic
    too: the compiler moves what is split over them).

    Why the spare axis: in a shard_map manual over every axis of its mesh,
    each traced value's type carries that all-manual mesh, and
    `jax.eval_shape` reports it as the value's sharding (JAX 0.10,
    ``_traced_out_info`` in jax/_src/stages.py); a constant made inside,
    such as ``jnp.array(False)``, has none. `eqx.nn.State.set` (equinox
    0.13.8) compares the old and new values' `jax.eval_shape`, so BatchNorm's
    default ``mode="ema"``, which sets its "first time" flag to that
    constant, failed: "The old value is bool[] and the new value is bool[]"
    (they differ only in sharding). With one axis left automatic the mesh is
    not all-manual and `jax.eval_shape` reports no sharding for either. The
    spare axis spans one device, so the compiled program is the same.
    """
    spare = Mesh(
        mesh.devices[..., None],
        (*mesh.axis_names, _SPARE_AXIS),
        axis_types=(*mesh.axis_types, AxisType.Auto),
    )
    return jax.shard_map(
        fn,
        mesh=spare,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axes),
        check_vma=False,
    )


def shard_map_reduce(
    mesh: Mesh,
    axes: tuple[str, ...],
    fn: LocalFn,
    replicated: PyTree,
    carry: PyTree,
    examples: PyTree,
    *,
    deterministic: bool = False,
    gathered: PyTree[P] | None = None,
    scattered: PyTree[P] | None = None,
) -> tuple[PyTree, PyTree]:
    """Run `fn` on each device's slice (the examples split over `axes`), then
    sum over the slices once.

    With `deterministic`, the one reduction is an all-gather of every
    slice's sums, added in device order on each device: the same bits for
    the same devices' slices however the devices are spread over processes
    (a psum's order depends on the collective's implementation).

    Each device differentiates its own slice's sum, and the global objective is
    the sum over devices. That is pmap's semantics, so the program runs with
    ``check_vma=False``: gradients of replicated inputs stay per device (with
    vma checking on, shard_map would sum them over devices by itself, once per
    microbatch under accumulation, and a `pmean` on top would give N times
    the gradient), collectives in user code transpose as under `jax.pmap`,
    and model state may take device-local values (e.g. BatchNorm over the
    device's slice) before it is averaged.

    Args:
        axes: the mesh axes the examples are split over; the program is
            manual over these.
        gathered: where the leaves of `replicated` lie, one `PartitionSpec`
            each, naming only mesh axes of `axes` (None: all whole on every
            device). A split leaf is gathered whole on each device (an
            all-gather per split dimension) before `fn`.
        scattered: one `PartitionSpec` per leaf of `fn`'s sums, naming only
            mesh axes of `axes` (None: all whole). A split leaf leaves as
            this device's part of the sum (a reduce-scatter over the axes it
            is split over, summed over the other axes of `axes`) instead of
            all of it; the others, and `carry`, are summed in one all-reduce.
    """
    if deterministic and scattered is not None:
        raise ValueError("deterministic sums are whole on every device")
    name = axis_name_of(axes)
    slices = _size(mesh, axes)

    def per_device(replicated, carry, examples):
        if gathered is not None and slices > 1:
            replicated = jax.tree.map(_gather, replicated, gathered)
        sums, carry = fn(replicated, carry, examples)
        leaves, treedef = jax.tree.flatten(sums)
        specs = [P()] * len(leaves)
        if scattered is not None:
            specs = treedef.flatten_up_to(scattered)
        split = [
            slices > 1 and any(spec_axes(entry) for entry in spec) for spec in specs
        ]
        whole = [x for x, s in zip(leaves, split, strict=True) if not s]
        # One all-reduce for the rest: the loss sums, whole gradients and
        # model state.
        both = (whole, jax.tree.map(_to_summable, carry))
        if slices == 1:
            # One device along `axes` (data × fsdp = 1: a tensor-only mesh)
            # holds the whole sums. No collective: XLA refuses one over
            # manual axes of size 1 beside automatic ones ("Cross-partition
            # allreduce must be in (partial) manual partitioning mode").
            total = both[1]
        elif deterministic:
            whole, total = _sum_in_device_order(jax.lax.all_gather(both, name))
        else:
            whole, total = _psum(both, name)
        carry = jax.tree.map(lambda t, c: _device_mean(t, c, slices), total, carry)
        whole = iter(whole)
        leaves = [
            _manual(functools.partial(_scatter, spec=spec, axes=axes), _is_narrow(x))(x)
            if s
            else next(whole)
            for x, spec, s in zip(leaves, specs, split, strict=True)
        ]
        return jax.tree.unflatten(treedef, leaves), carry

    in_specs = (P() if gathered is None else gathered, P(), P(name))
    out_specs = (P() if scattered is None else scattered, P())
    return _shard_map(per_device, mesh, axes, in_specs, out_specs)(
        replicated, carry, examples
    )


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """The number of devices along `axes` of `mesh` (their sizes' product)."""
    return math.prod(mesh.shape[axis] for axis in axes)


def _is_narrow(x: Any) -> bool:
    """Whether `x` is a 16-bit float (bfloat16, float16)."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2


def _manual(fn: Callable[[Any], Any], narrow: bool) -> Callable[[Any], Any]:
    """`fn`, a collective over the batch axes, run where every mesh axis is
    manual if its operands are 16-bit floats.

    In the step's shard_map the spare axis is automatic, so JAX annotates
    the collective's reduction computation with a sharding; XLA:CPU
    compiles a 16-bit all-reduce by widening that computation, and fails on
    the annotation ("Invalid binary instruction opcode copy", JAX 0.10).
    Inside a nested shard_map over the spare axis nothing is automatic.
    """
    if not narrow:
        return fn
    return jax.shard_map(
        fn,
        in_specs=P(),
        out_specs=P(),
        axis_names=frozenset({_SPARE_AXIS}),
        check_vma=False,
    )


def _psum(tree: PyTree, name: AxisName) -> PyTree:
    """`jax.lax.psum` of `tree` (its 16-bit float leaves as `_manual` says)."""
    leaves, treedef = jax.tree.flatten(tree)
    narrow = [_is_narrow(x) for x in leaves]
    wide = jax.lax.psum([x for x, n in zip(leaves, narrow, strict=True) if not n], name)
    if any(narrow):
        short = _manual(lambda xs: jax.lax.psum(xs, name), True)(
            [x for x, n in zip(leaves, narrow, strict=True) if n]
        )
    else:
        short = []
    wide, short = iter(wide), iter(short)
    return jax.tree.unflatten(
        treedef, [next(short) if n else next(wide) for n in narrow]
    )


def _scatter(x: jax.Array, *, spec: P, axes: tuple[str, ...]) -> jax.Array:
    """This device's part of the sum over `axes` of `x`, split as `spec`
    says: a reduce-scatter over the axes of each split dimension, then a
    sum over the axes `spec` does not split along."""
    used: list[str] = []
    for dim, entry in enumerate(spec):
        names = spec_axes(entry)
        if names:
            x = jax.lax.psum_scatter(
                x, axis_name_of(names), scatter_dimension=dim, tiled=True
            )
            used += names
    rest = tuple(axis for axis in axes if axis not in used)
    return jax.lax.psum(x, axis_name_of(rest)) if rest else x


def _gather(x: jax.Array, spec: P) -> jax.Array:
    """This device's part of `x` (split as `spec` says), gathered whole."""
    for dim, entry in enumerate(spec):
        names = spec_axes(entry)
        if names:
            x = jax.lax.all_gather(x, axis_name_of(names), axis=dim, tiled=True)
    return x


def _sum_in_device_order(gathered: PyTree) -> PyTree:
    """Sum each leaf's leading (device) axis as ((d0 + d1) + d2) + ..."""
    return jax.tree.map(
        lambda g: functools.reduce(jnp.add, [g[i] for i in range(g.shape[0])]),
        gathered,
    )


def shard_map_apply(
    mesh: Mesh,
    axes: tuple[str, ...],
    fn: MapFn,
    replicated: PyTree,
    examples: PyTree,
    *,
    gathered: PyTree[P] | None = None,
) -> PyTree:
    """Run `fn` on each device's slice (the examples split over `axes`);
    outputs stay split along examples (`gathered`: as in `shard_map_reduce`)."""
    name = axis_name_of(axes)

    def per_device(replicated, examples):
        if gathered is not None:
            replicated = jax.tree.map(_gather, replicated, gathered)
        return fn(replicated, examples)

    in_specs = (P() if gathered is None else gathered, P(name))
    return _shard_map(per_device, mesh, axes, in_specs, P(name))(replicated, examples)
