from typing import Any, final

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from .._validate import boolean
from ._mesh import (
    make_mesh,
    replicated_everywhere,
    shard_map_reduce,
)
from ._placement import named
from ._strategy import LocalFn, MapFn, PerDeviceStrategy


@final
class ShardingStrategy(PerDeviceStrategy):
    """Data parallelism in the global view: `jax.jit` over sharded arrays.

    The step is written as if on one device over the whole batch; the batch is
    split along a 1-D ``"data"`` mesh with `NamedSharding` and the compiler
    inserts the one gradient all-reduce. State is replicated on every device.
    BatchNorm statistics computed with ``axis_name="batch"`` are therefore
    over the global batch.

    Example:
        ```python
        strategy = px.ShardingStrategy()          # all local devices
        strategy = px.ShardingStrategy(devices=4)  # the first four
        ```
    """

    mesh: Mesh
    axis_name: str
    # Whether the one cross-device reduction adds in a fixed device order.
    deterministic: bool

    @validates_own_arguments
    def __init__(self, devices: Devices = None, *, deterministic: bool = False):
        """
        Args:
            devices: None for all local devices (every process's in a
                multi-process run), an int for the first n, or a sequence of
                devices.
            deterministic: sum the devices' gradients in a fixed order (an
                all-gather, then additions in device order) instead of an
                all-reduce: bitwise the same result however the devices are
                spread over processes, for debugging and reproducibility; costs
                memory and time in proportion to the device count.
        """
        self.axis_name = "data"
        self.mesh = make_mesh(devices, self.axis_name)
        self.deterministic = boolean("deterministic", deterministic)

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

    @override
    def state_shardings(self, state: PyTree[Any]) -> PyTree[NamedSharding]:
        return replicated_everywhere(self.mesh, state)

    @override
    def reduce(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        if self.deterministic:  # explicit per-device sums, added in order
            return self.reduce_per_device(fn, replicated, carry, examples)
        return fn(replicated, carry, examples)

    @override
    def reduce_per_device(
        self, fn: LocalFn, replicated: PyTree, carry: PyTree, examples: PyTree
    ) -> tuple[PyTree, PyTree]:
        return shard_map_reduce(
            self.mesh,
            self.axis_name,
            fn,
            replicated,
            carry,
            examples,
            deterministic=self.deterministic,
        )

    @override
    def map(self, fn: MapFn, replicated: PyTree, examples: PyTree) -> PyTree:
        return fn(replicated, examples)
