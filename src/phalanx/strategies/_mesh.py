"""Building a 1-D device mesh and the per-device program both strategies share."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree

from .._typing import Devices
from ._placement import available_devices, replicated
from ._strategy import LocalFn, MapFn


def make_mesh(devices: Devices, axis_name: str) -> Mesh:
    """A 1-D mesh named `axis_name` over the chosen devices: this process's,
    or in a multi-process run every process's (`jax.devices()`).

    Raises:
        ValueError: `devices` asks for more devices than exist, or none.
        TypeError: `devices` is neither None, an int nor a sequence of devices.
    """
    available = available_devices()
    if devices is None:
        chosen = list(available)
    elif isinstance(devices, bool | str) or not isinstance(devices, int | Sequence):
        raise TypeError(
            f"devices={devices!r} is not supported; pass None (all local devices), "
            "an int (the first n) or a sequence of jax devices"
        )
    elif isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices} but this process sees {len(available)} "
                f"{available[0].platform} device(s); pass an int from 1 to "
                f"{len(available)}, or devices=None for all of them"
            )
        chosen = list(available[:devices])
    else:
        chosen = list(devices)
        if not chosen:
            raise ValueError("devices=[] is empty; pass at least one device or None")
        unknown = [d for d in chosen if d not in available]
        if unknown or len(set(chosen)) != len(chosen):
            raise ValueError(
                f"devices={chosen!r} must be distinct devices of this process; "
                f"choose from jax.local_devices() = {available!r}"
            )
    # Auto axes: jit propagates shardings through reshapes and vmaps on its own.
    return Mesh(np.array(chosen), (axis_name,), axis_types=(AxisType.Auto,))


def replicated_everywhere(mesh: Mesh, state: PyTree[Any]) -> PyTree[NamedSharding]:
    """A full copy of every array of `state` on every device of `mesh`."""
    everywhere = replicated(mesh)
    return jax.tree.map(lambda _: everywhere, state)


def _to_summable(x: jax.Array) -> jax.Array:
    return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x


def _device_mean(total: jax.Array, like: jax.Array, n: int) -> jax.Array:
    """The mean over `n` devices of a summed leaf: ints floor, bools any."""
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
    axis_name: str,
    in_specs: PyTree[P],
    out_specs: PyTree[P],
) -> Callable[..., Any]:
    """`jax.shard_map` of `fn`, manual over `axis_name` only: on `mesh` plus a
    spare automatic axis of size 1.

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
        axis_names=frozenset({axis_name}),
        check_vma=False,
    )


def shard_map_reduce(
    mesh: Mesh,
    axis_name: str,
    fn: LocalFn,
    replicated: PyTree,
    carry: PyTree,
    examples: PyTree,
    *,
    deterministic: bool = False,
    gathered: PyTree[P] | None = None,
    scattered: PyTree[P] | None = None,
) -> tuple[PyTree, PyTree]:
    """Run `fn` on each device's slice, then sum over devices once.

    With `deterministic`, the one reduction is an all-gather of every
    device's sums, added in device order on each device: the same bits for
    the same devices' slices however the devices are spread over processes
    (a psum's order depends on the collective's implementation).

    Each device differentiates its own slice's sum, and the global objective is
    the sum over devices. That is pmap's semantics, so the program runs with
    ``check_vma=False``: gradients of replicated inputs stay per device (with
    vma checking on, shard_map would sum them over devices by itself, once per
    microbatch under accumulation: NOTES trap 2), collectives in user code
    transpose as under `jax.pmap`, and model state may take device-local
    values (e.g. BatchNorm over the device's slice) before it is averaged.

    Args:
        gathered: where the leaves of `replicated` lie, one `PartitionSpec`
            each (None: all whole on every device). A leaf split over the
            devices is gathered whole on each (an all-gather) before `fn`.
        scattered: one `PartitionSpec` per leaf of `fn`'s sums (None: all
            whole). A leaf split there leaves as this device's part of the
            sum over devices (a reduce-scatter) instead of all of it; the
            others, and `carry`, are summed in one all-reduce.
    """
    if deterministic and scattered is not None:
        raise ValueError("deterministic sums are whole on every device")

    def per_device(replicated, carry, examples):
        if gathered is not None:
            replicated = jax.tree.map(
                lambda x, spec: _gather(x, spec, axis_name), replicated, gathered
            )
        sums, carry = fn(replicated, carry, examples)
        leaves, treedef = jax.tree.flatten(sums)
        dims = [None] * len(leaves)
        if scattered is not None:
            specs = treedef.flatten_up_to(scattered)
            dims = [split_dim(spec, axis_name) for spec in specs]
        whole = [x for x, dim in zip(leaves, dims, strict=True) if dim is None]
        # One all-reduce for the rest: the loss sums, whole gradients and
        # model state.
        both = (whole, jax.tree.map(_to_summable, carry))
        if deterministic:
            whole, total = _sum_in_device_order(jax.lax.all_gather(both, axis_name))
        else:
            whole, total = _psum(both, axis_name)
        carry = jax.tree.map(lambda t, c: _device_mean(t, c, mesh.size), total, carry)
        whole = iter(whole)
        leaves = [
            next(whole)
            if dim is None
            else _manual(
                lambda x, dim=dim: jax.lax.psum_scatter(
                    x, axis_name, scatter_dimension=dim, tiled=True
                ),
                _is_narrow(x),
            )(x)
            for x, dim in zip(leaves, dims, strict=True)
        ]
        return jax.tree.unflatten(treedef, leaves), carry

    in_specs = (P() if gathered is None else gathered, P(), P(axis_name))
    out_specs = (P() if scattered is None else scattered, P())
    return _shard_map(per_device, mesh, axis_name, in_specs, out_specs)(
        replicated, carry, examples
    )


def _is_narrow(x: Any) -> bool:
    """Whether `x` is a 16-bit float (bfloat16, float16)."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2


def _manual(fn: Callable[[Any], Any], narrow: bool) -> Callable[[Any], Any]:
    """`fn`, a collective over the data axis, run where every mesh axis is
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


def _psum(tree: PyTree, axis_name: str) -> PyTree:
    """`jax.lax.psum` of `tree` (its 16-bit float leaves as `_manual` says)."""
    leaves, treedef = jax.tree.flatten(tree)
    narrow = [_is_narrow(x) for x in leaves]
    wide = jax.lax.psum(
        [x for x, n in zip(leaves, narrow, strict=True) if not n], axis_name
    )
    if any(narrow):
        short = _manual(lambda xs: jax.lax.psum(xs, axis_name), True)(
            [x for x, n in zip(leaves, narrow, strict=True) if n]
        )
    else:
        short = []
    wide, short = iter(wide), iter(short)
    return jax.tree.unflatten(
        treedef, [next(short) if n else next(wide) for n in narrow]
    )


def split_dim(spec: P, axis_name: str) -> int | None:
    """The dimension `spec` splits over `axis_name`, or None."""
    return next((i for i, name in enumerate(spec) if name == axis_name), None)


def _gather(x: jax.Array, spec: P, axis_name: str) -> jax.Array:
    """This device's part of `x` (split as `spec` says), gathered whole."""
    dim = split_dim(spec, axis_name)
    if dim is None:
        return x
    return jax.lax.all_gather(x, axis_name, axis=dim, tiled=True)


def _sum_in_device_order(gathered: PyTree) -> PyTree:
    """Sum each leaf's leading (device) axis as ((d0 + d1) + d2) + ..."""
    return jax.tree.map(
        lambda g: functools.reduce(jnp.add, [g[i] for i in range(g.shape[0])]),
        gathered,
    )


def shard_map_apply(
    mesh: Mesh,
    axis_name: str,
    fn: MapFn,
    replicated: PyTree,
    examples: PyTree,
    *,
    gathered: PyTree[P] | None = None,
) -> PyTree:
    """Run `fn` on each device's slice; outputs stay split along examples
    (`gathered`: as in `shard_map_reduce`)."""

    def per_device(replicated, examples):
        if gathered is not None:
            replicated = jax.tree.map(
                lambda x, spec: _gather(x, spec, axis_name), replicated, gathered
            )
        return fn(replicated, examples)

    in_specs = (P() if gathered is None else gathered, P(axis_name))
    return _shard_map(per_device, mesh, axis_name, in_specs, P(axis_name))(
        replicated, examples
    )
