import abc
import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree


# ``fn(replicated, carry, examples) -> (sums, carry)``: the work of one slice of
# examples. ``sums`` are additive over examples (weighted loss, gradients, ...);
# ``carry`` is model state threaded through the step (e.g. BatchNorm averages).
LocalFn: TypeAlias = Callable[[Any, Any, Any], tuple[Any, Any]]
# ``fn(replicated, examples) -> per-example outputs``.
MapFn: TypeAlias = Callable[[Any, Any], Any]


class Strategy(eqx.Module):
    """How one training step runs across devices.

    A strategy places state (replicated) and batches (split along the leading
    examples axis) on a 1-D device mesh, and turns a function of a slice of
    examples into a global result with exactly one cross-device reduction.
    The trainer builds its step from these pieces and never asks which
    strategy it holds.

    Concrete strategies: [`phalanx.ShardingStrategy`][],
    [`phalanx.PmapStrategy`][] and [`phalanx.AccumulatingStrategy`][].
    """

    mesh: eqx.AbstractVar[Mesh]
    axis_name: eqx.AbstractVar[str]
    microbatches: eqx.AbstractVar[int]
    # Whether the one cross-device reduction adds in a fixed device order.
    deterministic: eqx.AbstractVar[bool]

    @property
    def num_devices(self) -> int:
        """How many devices a step runs on."""
        return self.mesh.size

    @property
    def batch_multiple(self) -> int:
        """A step's global batch is padded to a multiple of this."""
        return self.num_devices * self.microbatches

    @property
    def process_batch_multiple(self) -> int:
        """This process's slice of a step is padded to a multiple of this
        (its devices in the mesh × microbatches)."""
        me = jax.process_index()
        mine = sum(d.process_index == me for d in self.mesh.devices.flat)
        return mine * self.microbatches

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of state: a full copy on every device."""
        return _sharding(self.mesh, P())

    @property
    def split(self) -> NamedSharding:
        """The sharding of batches: split along the leading examples axis."""
        return _sharding(self.mesh, P(self.axis_name))

    def replicate(self, leaves: list[Any]) -> list[jax.Array]:
        """Place state leaves (the same values in every process) on every
        device of the mesh."""
        replicated = self.replicated
        if jax.process_count() == 1:
            return jax.device_put(leaves, replicated)
        return [_replicate_across_processes(x, replicated) for x in leaves]

    def shard(self, leaves: list[np.ndarray | jax.Array]) -> list[jax.Array]:
        """Place batch leaves (host arrays, or arrays on any devices) on the
        mesh, split along the examples axis."""
        split = self.split
        placed = [x for x in leaves if isinstance(x, jax.Array) and x.sharding == split]
        if len(placed) == len(leaves):
            return placed  # already there: nothing to dispatch
        if jax.process_count() > 1:
            # Each process holds its own slice of the global batch.
            return [
                x
                if isinstance(x, jax.Array) and not x.is_fully_addressable
                else jax.make_array_from_process_local_data(split, np.asarray(x))
                for x in leaves
            ]
        return jax.device_put(leaves, split)

    @abc.abstractmethod
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """Sum `fn` over every example of the global batch.

        Called inside `jax.jit`. The result must equal ``fn`` applied to the
        whole batch on one device, up to float summation order, and must cost
        exactly one cross-device reduction.

        Args:
            fn: the work of one slice, ``fn(replicated, carry, examples) ->
                (sums, carry)``.
            replicated: arrays every device holds in full (parameters, keys).
            carry: model state threaded through the step; every device
                returns the same value (float state is averaged over devices).
            examples: a pytree of arrays sharing the leading examples axis.

        Returns:
            ``(sums, carry)``, both replicated.
        """

    @abc.abstractmethod
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        """As `reduce`, but `fn` always runs as a per-device program.

        Inside `fn` the replicated inputs are device-varying, so gradients
        taken there are this device's own; the one reduction happens after
        `fn` returns. Wrapping strategies build on this.
        """

    @abc.abstractmethod
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        """Apply `fn` to every example; outputs stay split across devices."""


@functools.cache
def _sharding(mesh: Mesh, spec: P) -> NamedSharding:
    """One `NamedSharding` per mesh and spec, built once (they are read per
    batch, and a strategy's properties run on every access)."""
    return NamedSharding(mesh, spec)


def _replicate_across_processes(leaf: Any, sharding: NamedSharding) -> jax.Array:
    """A global replicated array from a value every process holds."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return jax.device_put(leaf, sharding)  # already global: reshard
    is_key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
    host = np.asarray(jax.random.key_data(leaf) if is_key else leaf)
    array = jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    if is_key:
        return jax.random.wrap_key_data(array, impl=jax.random.key_impl(leaf))
    return array
