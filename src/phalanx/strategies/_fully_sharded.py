import math
from typing import Any, Literal, final

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from .._validate import is_int, one_of
from ._mesh import _shard_map, make_mesh, shard_map_apply, shard_map_reduce
from ._placement import named
from ._strategy import LocalFn, MapFn, PerDeviceStrategy


Shard = Literal["all", "optimizer"]
SHARD: tuple[Shard, ...] = ("all", "optimizer")


@final
class FullyShardedStrategy(PerDeviceStrategy):
    """Data parallelism with the training state split over the devices
    (ZeRO / FSDP): each device keeps about 1/N of the parameters, gradients
    and optimizer state, and the update is still the one of one device on
    the whole batch.

    Each device runs the step on its slice of the batch inside `jax.shard_map`,
    as under [`phalanx.PmapStrategy`][]: it gathers the parameters whole (one
    all-gather per split leaf), computes its slice's gradients, and a
    reduce-scatter leaves it the sum over devices of its own part of each
    gradient, which it updates with its own part of the optimizer state.
    Cross-leaf transforms (``optax.clip_by_global_norm``) still see the
    whole gradient: the compiler adds the few scalars they need across the
    devices. Under [`phalanx.AccumulatingStrategy`][] the parameters are
    gathered and the gradients reduce-scattered once per update, not once
    per microbatch.

    Which leaves are split: a floating-point leaf of at least `min_size`
    elements with an axis whose length the device count divides, along the
    longest such axis (the first of equal ones). The others (biases of a
    small layer, scalars, integer arrays, the step counter, PRNG keys and
    model state such as BatchNorm averages) are replicated.

    Memory: at rest each device holds ~1/N of the split leaves. During the
    step it also holds the whole parameters (gathered once for the forward
    and backward pass, not layer by layer) and its slice's whole gradient
    until the reduce-scatter, as ZeRO-2 does; the saving is the optimizer
    state and the parameters between steps, ~3/4 of an adam run's state on
    many devices.

    Example:
        ```python
        strategy = px.FullyShardedStrategy()                     # ZeRO-3 / FSDP
        strategy = px.FullyShardedStrategy(shard="optimizer")    # ZeRO-2
        strategy = px.AccumulatingStrategy(px.FullyShardedStrategy(), 4)
        ```
    """

    mesh: Mesh
    axis_name: str
    # "all": parameters and optimizer state split; "optimizer": only the latter.
    shard: Shard
    # Leaves with fewer elements stay replicated (splitting them saves less
    # than their collectives cost).
    min_size: int

    @validates_own_arguments
    def __init__(
        self,
        devices: Devices = None,
        *,
        shard: Shard = "all",
        min_size: int = 2**12,
    ):
        """
        Args:
            devices: None for all local devices (every process's in a
                multi-process run), an int for the first n, or a sequence of
                devices.
            shard: ``"all"``: parameters, gradients and optimizer state split
                (ZeRO-3, FSDP); ``"optimizer"``: gradients and optimizer state
                split, parameters replicated (ZeRO-2: no gather before the
                forward pass, a whole copy of the parameters per device).
            min_size: leaves with fewer elements stay replicated.
        """
        if not is_int(min_size) or min_size < 1:
            raise ValueError(
                f"min_size={min_size!r} must be an int >= 1 (leaves with fewer "
                "elements stay replicated), e.g. min_size=4096"
            )
        self.axis_name = "data"
        self.mesh = make_mesh(devices, self.axis_name)
        self.shard = one_of("shard", shard, SHARD)
        self.min_size = min_size

    @property
    @override
    def num_devices(self) -> int:
        return self.mesh.size

    @property
    @override
    def batch_sharding(self) -> NamedSharding:
        return named(self.mesh, P(self.axis_name))

    @property
    @override
    def batch_multiple(self) -> int:
        return self.mesh.size

    def spec(self, shape: tuple[int, ...], dtype: Any) -> P:
        """Where a leaf of this shape and dtype is split (`P()`: whole)."""
        n = self.mesh.size
        if n == 1 or not jnp.issubdtype(dtype, jnp.inexact):
            return P()
        if math.prod(shape) < self.min_size:
            return P()
        fits = [i for i, length in enumerate(shape) if length and length % n == 0]
        if not fits:
            return P()
        dim = max(fits, key=lambda i: (shape[i], -i))
        return P(*[None] * dim, self.axis_name)

    def _specs(self, tree: PyTree) -> PyTree[P]:
        return jax.tree.map(lambda x: self.spec(x.shape, x.dtype), tree)

    @override
    def state_shardings(self, state: PyTree[Any]) -> PyTree[NamedSharding]:
        fields = ("model", "opt_state") if self.shard == "all" else ("opt_state",)

        def place(path: tuple[Any, ...], x: Any) -> NamedSharding:
            field = getattr(path[0], "name", None) if path else None
            spec = self.spec(x.shape, x.dtype) if field in fields else P()
            return named(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(place, state)

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        if self.mesh.size == 1:  # nothing to split: ShardingStrategy's program
            return fn(replicated, carry, examples)
        return self.reduce_per_device(fn, replicated, carry, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        gathered = self._specs(replicated) if self.shard == "all" else None
        # The sums' shapes (a trace, nothing runs) decide which are scattered.
        whole = _shard_map(
            fn,
            self.mesh,
            self.axis_name,
            (P(), P(), P(self.axis_name)),
            (P(), P()),
        )
        sums = jax.eval_shape(whole, replicated, carry, examples)[0]
        return shard_map_reduce(
            self.mesh,
            self.axis_name,
            fn,
            replicated,
            carry,
            examples,
            gathered=gathered,
            scattered=self._specs(sums),
        )

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        gathered = self._specs(replicated) if self.shard == "all" else None
        return shard_map_apply(
            self.mesh, self.axis_name, fn, replicated, examples, gathered=gathered
        )
