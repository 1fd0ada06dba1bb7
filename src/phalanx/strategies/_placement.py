"""Putting arrays where a strategy says they go: the one place outside
`data/` that calls `jax.device_put` (checkpoints, the engine's accumulators
and totals, and `phalanx.testing` place through the functions here).

The one module that knows a run may span several processes: in one process
every device is addressable and `jax.device_put` places anything; in
several, each process holds only its own devices' parts, so a global array
is assembled from what each process has (`jax.make_array_from_callback` for
values every process holds, `jax.make_array_from_process_local_data` for
each process's slice of a batch).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding
from jaxtyping import PyTree


def single_process() -> bool:
    """Whether this run is one process (every device addressable here)."""
    return jax.process_count() == 1


@functools.cache
def named(mesh: Mesh, spec: P, memory_kind: str | None = None) -> NamedSharding:
    """One `NamedSharding` per mesh, spec and memory kind, built once (they
    are read per batch, and a strategy's properties run on every access)."""
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


# Host memory the devices read and write directly (what `offload` keeps
# state in).
HOST_MEMORY = "pinned_host"


def has_host_memory(device: Any) -> bool:
    """Whether `device`'s backend offers host memory for its arrays."""
    return any(m.kind == HOST_MEMORY for m in device.addressable_memories())


def in_device_memory(leaves: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Inside a traced step: `leaves` (laid out as `shardings`) with those
    kept in host memory brought to the devices' memory, laid out alike."""
    return [
        jax.device_put(x, s.with_memory_kind("device")) if _on_host(s) else x
        for x, s in zip(leaves, shardings, strict=True)
    ]


def in_stored_memory(leaves: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Inside a traced step: `leaves` back where `shardings` keep them (those
    kept in host memory returned there)."""
    return [
        jax.device_put(x, s) if _on_host(s) else x
        for x, s in zip(leaves, shardings, strict=True)
    ]


def _on_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST_MEMORY


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of `mesh` (the epoch's sums, totals)."""
    return named(mesh, P())


def stacked(sharding: Sharding) -> NamedSharding:
    """`sharding` (a batch's) with a new leading axis kept whole: where the
    batches of several steps go, stacked for one compiled call.

    Raises:
        TypeError: `sharding` is not a `NamedSharding`.
    """
    if not isinstance(sharding, NamedSharding):
        raise TypeError(
            f"steps_per_call > 1 stacks batches along a new leading axis, which "
            f"needs a strategy whose batch_sharding is a NamedSharding, not "
            f"{sharding!r}; use steps_per_call=1 with this strategy"
        )
    return named(sharding.mesh, P(None, *sharding.spec))


def available_devices() -> list[Any]:
    """The devices a strategy may use: this process's, or in a multi-process
    run every process's."""
    return jax.local_devices() if single_process() else jax.devices()


def local_rows(sharding: Sharding, rows: int) -> int:
    """How many of a batch's `rows` this process's devices hold when it is
    laid out as `sharding` says: each distinct slice once, so devices that
    hold the same rows (a mesh axis the batch is not split over) count once.
    """
    me = jax.process_index()
    held = {
        index[0].indices(rows)
        for device, index in sharding.devices_indices_map((rows,)).items()
        if device.process_index == me
    }
    return sum(len(range(*bounds)) for bounds in held)


def put_state(leaves: Sequence[Any], shardings: Sequence[Sharding]) -> list[jax.Array]:
    """Place state leaves (the same values in every process) as `shardings` say."""
    if single_process():
        return jax.device_put(list(leaves), list(shardings))
    return [_global(x, s) for x, s in zip(leaves, shardings, strict=True)]


def put_replicated(tree: PyTree, mesh: Mesh) -> PyTree:
    """Place host values (the same in every process) as a full copy on
    every device of `mesh`: an epoch's zeroed sums and flags, an
    evaluation's sums.

    Each leaf is made by `jax.make_array_from_callback` (~12 µs for a small
    array): a `jax.device_put` of the pytree took ~60 µs of Python for the
    two arrays each epoch starts from.
    """
    sharding = replicated(mesh)
    return jax.tree.map(lambda leaf: _global(leaf, sharding), tree)


def replicated_copies(arrays: Sequence[jax.Array], mesh: Mesh) -> list[jax.Array]:
    """Copies of `arrays`, replicated on every device of `mesh`.

    Copies: `jax.device_put` of an array already there may share its buffer,
    and a step that donates the result would delete the original.
    """
    return jax.device_put([jnp.copy(x) for x in arrays], replicated(mesh))


def replicated_float32(values: float | Sequence[float], mesh: Mesh) -> jax.Array:
    """A float32 scalar (or vector, for several values) replicated on every
    device of `mesh`: a batch's total weight, the totals of stacked steps."""
    return jax.device_put(np.asarray(values, np.float32), replicated(mesh))


def on_device(tree: PyTree, device: Any) -> PyTree:
    """Every array of `tree` (device arrays anywhere, or host values) on one
    `device`: where a one-device reference computes with another set-up's
    results."""
    return jax.device_put(tree, device)


def put_batch(
    leaves: Sequence[np.ndarray | jax.Array],
    sharding: Sharding | Sequence[Sharding],
    *,
    before_move: Callable[[Sequence[Any]], None] | None = None,
) -> list[jax.Array]:
    """Place batch leaves (host arrays, or arrays on any devices) split as
    `sharding` says (one for all, or one per leaf); in a multi-process run
    each process holds its own slice of the global batch.
    `before_move(leaves)` is called only where some leaf must move (it may
    raise: a layout the caller refuses)."""
    shardings = (
        list(sharding) if isinstance(sharding, Sequence) else [sharding] * len(leaves)
    )
    placed = [
        x
        for x, s in zip(leaves, shardings, strict=True)
        if isinstance(x, jax.Array) and laid_out(x, s)
    ]
    if len(placed) == len(leaves):
        return placed  # already there: nothing to dispatch
    if before_move is not None:
        before_move(leaves)
    if single_process():
        return jax.device_put(list(leaves), shardings)
    return [
        x
        if isinstance(x, jax.Array) and not x.is_fully_addressable
        else jax.make_array_from_process_local_data(s, np.asarray(x))
        for x, s in zip(leaves, shardings, strict=True)
    ]


def laid_out(x: jax.Array, sharding: Sharding) -> bool:
    """Whether `x` is already laid out as `sharding` says: the same sharding,
    or an equivalent one (e.g. `jax.device_put(x)`'s single-device sharding
    for a strategy of one device)."""
    return x.sharding == sharding or _equivalent(x.sharding, sharding, x.ndim)


@functools.lru_cache(maxsize=64)
def _equivalent(have: Sharding, want: Sharding, ndim: int) -> bool:
    """`have.is_equivalent_to(want, ndim)`, asked once per pair (it is read
    per batch)."""
    return have.is_equivalent_to(want, ndim)


def _global(leaf: Any, sharding: Sharding) -> jax.Array:
    """A global array laid out as `sharding` says, from a value every
    process holds."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return jax.device_put(leaf, sharding)  # already global: reshard
    is_key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    host = np.asarray(jax.random.key_data(leaf) if is_key else leaf)
    array = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    if is_key:
        return jax.random.wrap_key_data(array, impl=jax.random.key_impl(leaf))
    return array


def to_host(leaf: Any) -> np.ndarray:
    """An array's whole value on the host, however it is laid out: a
    replicated array spanning several processes is read from this process's
    own copy; one split over several processes is gathered (a collective:
    every process calls this)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_shards[0].data)
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))
