from typing import Any, final

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import PyTree
from typing_extensions import override

from .._typing import Devices, validates_own_arguments
from .._validate import boolean
from ._mesh import (
    make_mesh,
    replicated_everywhere,
    shard_map_apply,
    shard_map_reduce,
)
from ._placement import named
from ._strategy import LocalFn, MapFn, PerDeviceStrategy


@final
class PmapStrategy(PerDeviceStrategy):
    """Data parallelism as a per-device program with explicit collectives.

    Each device runs the step on its slice of the batch inside `jax.shard_map`
    (the successor of `jax.pmap`), then one `psum` adds up gradients, loss and
    metrics. User code inside the loss may call `jax.lax.psum`,
    `jax.lax.all_gather`, ... with `axis_name`. State stays ordinary
    replicated arrays, interchangeable with [`phalanx.ShardingStrategy`][].

    BatchNorm with ``axis_name="batch"`` normalises over each device's slice;
    use ``axis_name=("batch", strategy.axis_name)`` for global statistics.

    Example:
        ```python
        strategy = px.PmapStrategy(devices=8, axis_name="data")
        ```
    """

    mesh: Mesh
    axis_name: str
    # Whether the one cross-device reduction adds in a fixed device order.
    deterministic: bool

    @validates_own_arguments
    def __init__(
        self,
        devices: Devices = None,
        axis_name: str = "data",
        *,
        deterministic: bool = False,
    ):
        """
        Args:
            devices: None for all local devices (every process's in a
                multi-process run), an int for the first n, or a sequence of
                devices.
            axis_name: the name collectives use for the device axis.
            deterministic: sum the devices' gradients in a fixed order (an
                all-gather, then additions in device order) instead of an
                all-reduce: bitwise the same result however the devices are
                spread over processes, for debugging and reproducibility; costs
                memory and time in proportion to the device count.
        """
        if not isinstance(axis_name, str) or not axis_name or axis_name == "batch":
            raise ValueError(
                f"axis_name={axis_name!r} must be a non-empty string other than "
                "'batch' (the per-example vmap axis); e.g. axis_name='data'"
            )
        self.axis_name = axis_name
        self.mesh = make_mesh(devices, axis_name)
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
        return self.reduce_per_device(fn, replicated, carry, examples)

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
        return shard_map_apply(self.mesh, self.axis_name, fn, replicated, examples)
